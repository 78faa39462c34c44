// A tiny program that uses OOM the way an embedding trainer would: the vocabulary, an error, and
// (when the package was built with CUDA) a symbol from oom::cuda.
#include <cstdio>

#include <oom/oom.hpp>
#if OOM_CONSUMER_CUDA
#include <oom/cuda/device.hpp>
int consumer_kernel_launches();  // consumer_kernel.cu
#endif

int main() {
  using namespace oom::literals;
  const oom::Bytes budget = oom::parse_bytes("80GiB");
  if (budget != 80_GiB) return 1;
  try {
    OOM_THROW(oom::Errc::out_of_budget, "consumer check");
  } catch (const oom::Error& e) {
    if (e.code() != oom::Errc::out_of_budget) return 2;
  }
#if OOM_CONSUMER_CUDA
  std::printf("GPUs visible: %d\n", oom::cuda::device_count());
  if (consumer_kernel_launches() != 1) return 3;
#endif
  oom::log_info("budget {}", budget);
  std::printf("oom consumer ok\n");
  return 0;
}
