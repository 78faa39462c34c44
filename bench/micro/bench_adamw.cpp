// CPU AdamW throughput (params/s) with fp32 and bf16 moments, at 1 thread and all hardware
// threads, per ISA, next to a host memory bandwidth measured in the same run (a+b->b over arrays
// larger than the last-level cache, on the same thread pool). Each AdamW result carries
// `bw_ratio`: the bytes AdamW must move per second divided by that measured bandwidth at the same
// thread count, timed in the same iterations (and `bw_ratio_machine`: divided by the best
// all-threads bandwidth seen, as a share of the whole machine), so the numbers
// transfer between machines as fractions of the memory-bandwidth floor.
//   bytes per parameter, fp32 moments: read p,m,v,g (16) + write p,m,v (12) + bf16 weights (2) = 30
//   bytes per parameter, bf16 moments: read p,m,v,g (12) + write p,m,v (8)  + bf16 weights (2) = 22
// Usage: bench_adamw [--params=N] [google benchmark flags]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "oom/optim/cpu_adamw.hpp"

using namespace oom;
using namespace oom::optim;

namespace {

// 32M parameters: 576 MB of fp32-moment state, above this build machine's 260 MB L3 and the GPU
// machine's L3, so both the copy and AdamW stream from DRAM.
std::size_t g_params = std::size_t{1} << 25;

std::size_t all_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

ThreadPool& pool_of(std::size_t threads) {
  static std::map<std::size_t, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return *p;
}

// a+b->b over two arrays of 2*params floats (bandwidth arrays as large as AdamW's state), split in
// the same tiles as AdamW. Counts 12 bytes per element: read a, read b, write b.
struct AddArrays {
  std::vector<float> a, b;
  AddArrays() : a(2 * g_params, 1.0f), b(2 * g_params, 0.5f) {}
};
AddArrays& add_arrays() {
  static AddArrays arrays;
  return arrays;
}
void add_into(ThreadPool& pool) {
  AddArrays& x = add_arrays();
  const std::size_t n = x.a.size();
  const std::size_t tiles = (n + adamw_tile_elements - 1) / adamw_tile_elements;
  pool.run(tiles, [&](std::size_t t) {
    const std::size_t begin = t * adamw_tile_elements;
    const std::size_t end = std::min(n, begin + adamw_tile_elements);
    float* __restrict b = x.b.data();
    const float* __restrict a = x.a.data();
    for (std::size_t i = begin; i < end; ++i) b[i] = a[i] + b[i];
  });
}
double add_bytes() { return 12.0 * static_cast<double>(add_arrays().a.size()); }

/// Bytes/s of a+b->b at `threads`, best of 5 runs, measured once per thread count.
double measured_bandwidth(std::size_t threads) {
  static std::map<std::size_t, double> cache;
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  ThreadPool& pool = pool_of(threads);
  add_into(pool);  // first touch and warm-up
  double best = 0.0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    add_into(pool);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, add_bytes() / s);
  }
  return cache[threads] = best;
}

template <class Moment>
struct AdamWArrays {
  std::vector<float> p, g;
  std::vector<Moment> m, v;
  std::vector<bf16> out;
  AdamWArrays() : p(g_params), g(g_params), m(g_params), v(g_params), out(g_params) {
    for (std::size_t i = 0; i < g_params; ++i) {
      p[i] = 0.01f * static_cast<float>(static_cast<int>(i % 201) - 100);
      g[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48);
    }
  }
  AdamWSpan<Moment> span() { return {p, m, v, g, out}; }
};
template <class Moment>
AdamWArrays<Moment>& adamw_arrays() {
  static AdamWArrays<Moment> arrays;
  return arrays;
}

template <class Moment>
constexpr double bytes_per_param() {
  return std::is_same_v<Moment, float> ? 30.0 : 22.0;
}

void BM_add_bandwidth(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  ThreadPool& pool = pool_of(threads);
  add_into(pool);
  for (auto _ : state) add_into(pool);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * add_bytes()));
  state.counters["threads"] = static_cast<double>(threads);
  state.counters["best_of_5_GBps"] = measured_bandwidth(threads) / 1e9;
}

template <class Moment>
void BM_adamw(benchmark::State& state, CpuIsa isa) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  ThreadPool& pool = pool_of(threads);
  const double machine_bandwidth = measured_bandwidth(all_threads());
  AdamWArrays<Moment>& x = adamw_arrays<Moment>();
  AdamWConfig config;
  std::int64_t step = 1;
  adamw_update(x.span(), adamw_step_scalars(config, step++), pool, isa);  // first touch
  // Each iteration also times one a+b->b pass (outside the measured time), so the ratio compares
  // AdamW with the bandwidth the machine gave in the same moments: on a shared VM it drifts by 2x
  // within a minute.
  double adamw_s = 0.0;
  double copy_s = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    const auto c0 = std::chrono::steady_clock::now();
    add_into(pool);
    copy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    adamw_update(x.span(), adamw_step_scalars(config, step++), pool, isa);
    adamw_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double iterations = static_cast<double>(state.iterations());
  const double params = iterations * static_cast<double>(g_params);
  const double bytes_per_s = params * bytes_per_param<Moment>() / adamw_s;
  const double copy_bytes_per_s = iterations * add_bytes() / copy_s;
  state.SetItemsProcessed(static_cast<std::int64_t>(params));
  state.counters["threads"] = static_cast<double>(threads);
  state.counters["params_per_s"] = params / adamw_s;
  state.counters["adamw_GBps"] = bytes_per_s / 1e9;
  state.counters["copy_GBps"] = copy_bytes_per_s / 1e9;
  state.counters["bw_ratio"] = bytes_per_s / copy_bytes_per_s;
  state.counters["bw_ratio_machine"] = bytes_per_s / std::max(machine_bandwidth, threads == all_threads() ? copy_bytes_per_s : 0.0);
  state.SetLabel(to_string(isa));
}

}  // namespace

int main(int argc, char** argv) {
  // Our own flag first; Google Benchmark rejects unknown ones.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--params=", 9) == 0) {
      g_params = std::strtoull(argv[i] + 9, nullptr, 10);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  std::vector<std::int64_t> thread_counts = {1};
  if (all_threads() > 1) thread_counts.push_back(static_cast<std::int64_t>(all_threads()));

  auto* add = benchmark::RegisterBenchmark("add_bandwidth", BM_add_bandwidth);
  for (auto t : thread_counts) add->Arg(t);
  add->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);
  for (CpuIsa isa : supported_cpu_isas()) {
    const std::string suffix = std::string("/") + to_string(isa);
    auto* f = benchmark::RegisterBenchmark(("adamw_fp32_moments" + suffix).c_str(), BM_adamw<float>, isa);
    auto* b = benchmark::RegisterBenchmark(("adamw_bf16_moments" + suffix).c_str(), BM_adamw<bf16>, isa);
    for (auto* bm : {f, b}) {
      for (auto t : thread_counts) bm->Arg(t);
      bm->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);
    }
  }
  std::printf("params %zu, hardware threads %zu, best ISA %s\n", g_params, all_threads(), to_string(best_cpu_isa()));
  benchmark::Initialize(&n, args.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
