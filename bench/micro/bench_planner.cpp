// Planning time for the shipped 48-layer configurations (the planner must answer in under a second
// on the 2-core CI machine, so trainers can re-plan at start-up and in trial steps).
#include <benchmark/benchmark.h>

#include <string>

#include "oom/model/model_spec.hpp"
#include "oom/plan/planner.hpp"

namespace {

void plan_case(benchmark::State& state, const char* config, const char* machine, int gpus, std::uint64_t seq) {
  const auto spec = oom::ModelSpec::from_file(std::string(OOM_SOURCE_DIR "/examples/configs/") + config);
  const auto profile = oom::MachineProfile::builtin(machine, gpus);
  const oom::Planner planner(spec, profile, config);
  oom::PlanRequest req;
  req.gpus = gpus;
  req.workload = {1, seq};
  req.gpu_budget = profile.gpu_memory;
  req.host_budget = oom::Bytes{2ull << 40};
  int evaluated = 0;
  for (auto _ : state) {
    const auto set = planner.plan(req);
    evaluated = set.evaluated;
    benchmark::DoNotOptimize(set.plans.front().predicted.step_s);
  }
  state.counters["layers"] = spec.num_layers();
  state.counters["candidates"] = evaluated;
}

}  // namespace

BENCHMARK_CAPTURE(plan_case, qwen3_30b_4k_1xh200, "qwen3-30b-a3b.json", "h200", 1, 4096)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(plan_case, qwen3_30b_32k_2xh200, "qwen3-30b-a3b.json", "h200", 2, 32768)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(plan_case, qwen3_30b_256k_4xh100, "qwen3-30b-a3b.json", "h100-80gb", 4, 262144)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(plan_case, qwen3_next_80b_64k_2xh200, "qwen3-next-80b-a3b.json", "h200", 2, 65536)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(plan_case, qwen3_5_122b_32k_4xh100, "qwen3.5-122b-a10b.json", "h100-80gb", 4, 32768)->Unit(benchmark::kMillisecond);
