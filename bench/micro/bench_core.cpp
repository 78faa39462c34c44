// Host conversion throughput: bf16 rounding is on the CPU optimizer's write-back path (fp32
// master -> bf16 working weights), so its cost per element bounds that path.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "oom/core/numeric.hpp"

static void BM_float_to_bf16(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> in(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& v : in) v = dist(rng);
  std::vector<oom::bf16> out(n);
  for (auto _ : state) {
    for (std::size_t i = 0; i < n; ++i) out[i] = oom::to_bf16(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * (sizeof(float) + sizeof(oom::bf16))));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
}
BENCHMARK(BM_float_to_bf16)->Arg(1 << 16)->Arg(1 << 22);
