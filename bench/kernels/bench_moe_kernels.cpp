// Expert GEMM throughput for the 5.13B shapes (H = 2048, I = 768, E = 64, k = 8, T = 4096..32768),
// every method (per-expert loop, cuBLAS grouped batched, multi-stream loop, row-chunked batched)
// and a sweep of their stream counts and chunk sizes, each as a ratio to ONE dense cuBLAS GEMM of
// the same total FLOPs measured in the same run. Target: ratio >= 0.8. Beside it, the vendor on the
// same per-expert problems at its best case (cuBLAS strided batched over equal rows per expert:
// "batched_ms", its ratio to the dense GEMM "b_ratio"), and the grouped run against it ("vs_b").
// Last, "mem_cap": the highest ratio the op's least memory traffic allows (each operand read once,
// each output written once, fp32 dW read too when added into: kernels::detail::expert_gemm_min_bytes)
// at the bandwidth of a device-to-device copy measured at the start, products at the dense GEMM's
// rate beside it. Below 1 the op is bound by memory whatever the kernel: no grouped launch reaches
// a ratio above it.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/device_balance.hpp"
#include "kernels/expert_gemm_throughput.hpp"
#include "oom/core/error.hpp"

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no GPU: nothing to measure\n");
    return 0;
  }
  // OOM_BENCH_TOKENS / OOM_BENCH_VARIANTS: comma-separated subsets (default: every T, every variant).
  const auto listed = [](const char* env, const std::string& item) {
    const char* v = std::getenv(env);
    if (v == nullptr || *v == '\0') return true;
    const std::string list = std::string(",") + v + ",";
    return list.find("," + item + ",") != std::string::npos;
  };
  {  // what splits the row GEMMs around a memory-bound dW (ExpertGemmStreamsOptions::row_sm_share)
    oom::kernels::detail::DeviceBalance b;
    OOM_CUDA_CHECK(oom::kernels::detail::query_device_balance(0, &b));
    std::printf("device balance: %.0f dense bf16 FLOPs per byte (%d SMs, %d MHz, memory %d MHz x %d bits)\n", b.flops_per_byte, b.sms,
                b.clock_khz / 1000, b.memory_clock_khz / 1000, b.bus_bits);
  }
  const double copy = oom::test::copy_bytes_per_s(nullptr);
  std::printf("memory: a device-to-device copy moves %.0f GB/s (read + write)\n", copy / 1e9);
  std::printf("%-10s %6s %-20s %10s %10s %8s %6s %8s %10s %10s %7s %5s %7s\n", "method", "T", "op", "grouped_ms", "dense_ms", "TFLOP/s",
              "ratio", "host_us", "piped_ms", "batched_ms", "b_ratio", "vs_b", "mem_cap");
  for (const std::int64_t T : {4096, 8192, 16384, 32768}) {
    if (!listed("OOM_BENCH_TOKENS", std::to_string(T))) continue;
    for (const auto& variant : oom::test::expert_gemm_variants(true)) {
      if (!listed("OOM_BENCH_VARIANTS", variant.name)) continue;
      try {
        for (const auto& r : oom::test::measure_expert_gemm_ratio(T, 2048, 768, 64, 8, variant, 10, true))
          std::printf("%-10s %6lld %-20s %10.3f %10.3f %8.0f %6.2f %8.0f %10.3f %10.3f %7.2f %5.2f %7.2f\n", variant.name.c_str(),
                      static_cast<long long>(T), r.op.c_str(), r.grouped_ms, r.dense_ms, r.tflops, r.ratio(), r.host_us, r.pipelined_ms,
                      r.batched_ms, r.batched_ratio(), r.batched_ms / r.grouped_ms, r.memory_cap(copy));
      } catch (const oom::Error& e) {
        std::printf("%-10s %6lld failed: %s\n", variant.name.c_str(), static_cast<long long>(T), e.what());
      }
    }
  }
  return 0;
}
