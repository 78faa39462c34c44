// Pinned host<->device copy bandwidth by transfer size: the physical limit that weight streaming
// (H2D) and gradient offload (D2H) are measured against. Skips with a message without a GPU.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "oom/cuda/device.hpp"

static void BM_pinned_copy(benchmark::State& state) {
  const oom::Bytes size{static_cast<std::uint64_t>(state.range(0))};
  oom::cuda::CopyBandwidth r;
  for (auto _ : state) r = oom::cuda::measure_copy_bandwidth(0, size, 4);
  state.counters["h2d_GBps"] = r.h2d_bytes_per_s / 1e9;
  state.counters["d2h_GBps"] = r.d2h_bytes_per_s / 1e9;
  state.counters["bidir_GBps"] = r.bidir_bytes_per_s / 1e9;
  state.counters["pageable_h2d_GBps"] = r.pageable_h2d_bytes_per_s / 1e9;
  if (!r.verified) state.SkipWithError("round trip returned different bytes");
}
BENCHMARK(BM_pinned_copy)->Arg(4 << 20)->Arg(64 << 20)->Arg(256 << 20)->Iterations(2)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  if (oom::cuda::device_count() == 0) {
    std::printf("SKIPPED bench_copy: no GPU (%s)\n", oom::cuda::no_device_reason().c_str());
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
