// Expert GEMM throughput for the 5.13B shapes (H = 2048, I = 768, E = 64, k = 8, T = 4096..32768),
// every method (per-expert loop, cuBLAS grouped batched, multi-stream loop, row-chunked batched)
// and a sweep of their stream counts and chunk sizes, each as a ratio to ONE dense cuBLAS GEMM of
// the same total FLOPs measured in the same run. Target: ratio >= 0.8.
#include <cstdio>

#include "kernels/expert_gemm_throughput.hpp"
#include "oom/core/error.hpp"

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no GPU: nothing to measure\n");
    return 0;
  }
  std::printf("%-10s %6s %-20s %10s %10s %8s %6s\n", "method", "T", "op", "grouped_ms", "dense_ms", "TFLOP/s", "ratio");
  for (const std::int64_t T : {4096, 8192, 16384, 32768})
    for (const auto& variant : oom::test::expert_gemm_variants(true)) {
      try {
        for (const auto& r : oom::test::measure_expert_gemm_ratio(T, 2048, 768, 64, 8, variant))
          std::printf("%-10s %6lld %-20s %10.3f %10.3f %8.0f %6.2f\n", variant.name.c_str(), static_cast<long long>(T), r.op.c_str(),
                      r.grouped_ms, r.dense_ms, r.tflops, r.ratio());
      } catch (const oom::Error& e) {
        std::printf("%-10s %6lld failed: %s\n", variant.name.c_str(), static_cast<long long>(T), e.what());
      }
    }
  return 0;
}
