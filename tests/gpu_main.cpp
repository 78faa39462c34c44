// Main of the `gpu` tests: without a usable GPU, say why and exit 77, which ctest reports as
// skipped (SKIP_RETURN_CODE), so a machine without a GPU neither fails nor pretends to pass.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "oom/cuda/device.hpp"

int main(int argc, char** argv) {
  if (oom::cuda::device_count() == 0) {
    std::printf("SKIPPED: no GPU available (%s); this test needs a CUDA device\n",
                oom::cuda::no_device_reason().c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
