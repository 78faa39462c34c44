// The CudaLayerExecutor (runtime/cuda_layer_executor.hpp): a stack of a user's own CUDA layers
// (examples/custom_layer/residual_mlp_cuda.hpp) trained on the GPU as LayerStackPlanner's plans
// say. Every plan (streamed, offloaded, recomputed, regenerated, chunked; 1 or 2 micro-batches)
// computes the resident plan's step bit for bit, within the device and pinned bytes it predicts;
// the GPU stack trains as the HostExecutor's CPU stack of the same layer does. Also the
// CudaBackend's executor operations (host tasks, stream-ordered frees, the device AdamW).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "custom_layer/residual_mlp.hpp"
#include "custom_layer/residual_mlp_cublas.hpp"
#include "custom_layer/residual_mlp_cuda.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/plan/layer_stack_planner.hpp"
#include "oom/runtime/cuda_layer_executor.hpp"
#include "oom/runtime/host_executor.hpp"
#include "support/compare.hpp"
#include "support/empty_segment.hpp"
#include "support/same_step.hpp"

using namespace oom;
using namespace oom::literals;
using oom::test::any_retention;
using oom::test::bitwise_equal;
using oom::test::resident_plan;
using oom::examples::CudaResidualMlp;
using oom::examples::ResidualMlp;

namespace {

constexpr int layer_count = 6;
constexpr std::uint64_t hidden = 64, inter = 192, tokens = 200;  // 200: chunks of 100 and 50, no power of two

std::vector<std::vector<float>> initial_weights() {
  std::vector<std::vector<float>> init;
  for (int l = 0; l < layer_count; ++l) init.push_back(test::random_normal(2 * hidden * inter, 11 + static_cast<std::uint64_t>(l), 0.07f));
  return init;
}

// initial_weights() by segment: a segment of no parameters gets none, the others the layer's.
template <class Layer>
std::vector<std::vector<float>> initial_weights_of(const std::vector<Layer>& layers) {
  auto weights = initial_weights();
  std::vector<std::vector<float>> init;
  std::size_t next = 0;
  for (const auto& l : layers)
    for (const auto& s : l.segments()) init.push_back(s.parameters() == 0 ? std::vector<float>{} : std::move(weights.at(next++)));
  return init;
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> master;
  std::vector<SegmentOptimizerState> state;
  Bytes gpu_peak, pinned_peak;
  Bytes heap_high_water;  // the device heap's extent: the peak plus its fragments
  std::size_t events_first = 0, events_all = 0;  // CUDA events created by the first step, by all
};

// The step's data: micro-batch m of step s.
std::vector<float> input_of(int s, int m) { return test::random_normal(tokens * hidden, 1000 + 10 * static_cast<std::uint64_t>(s) + m, 1.0f); }
std::vector<float> target_of(int s, int m) { return test::random_normal(tokens * hidden, 5000 + 10 * static_cast<std::uint64_t>(s) + m, 1.0f); }

LayerExecutorOptions default_options() {
  LayerExecutorOptions eo;
  eo.adamw.lr = 3e-3f;
  return eo;
}

// `largest_workset`: the layers' largest declared workset. The heap's reserve is room for its
// fragments: half the budget again, and two of that workset (the cuBLAS layer's, 4 MiB of it
// cuBLAS's, is most of a tight plan's budget: it found no piece that large in 1.5x, H100, 2026-12-05).
CudaBackend::Options backend_options(Bytes gpu, Bytes pinned, Bytes largest_workset = {}) {
  CudaBackend::Options bo;
  bo.device_budget = gpu;
  bo.device_reserve = Bytes{gpu.count() * 3 / 2 + 2 * largest_workset.count()};
  bo.pinned_budget = pinned;
  bo.pinned_slab = 16_MiB;
  return bo;
}

// The CUDA stack under one plan, in a CudaBackend of `gpu` device and `pinned` host bytes; its
// loss uploads the micro-batch's targets on the compute stream, then takes the GPU MSE.
template <class Layer>
struct GpuStackOf {
  std::vector<Layer> layers;
  CudaBackend backend;
  std::vector<std::shared_ptr<float>> target_dev;
  std::vector<std::vector<float>> target_host;
  std::vector<DeviceLossFn> losses;
  std::unique_ptr<CudaLayerExecutor<Layer>> exec;

  static std::vector<Layer> make_layers() {
    std::vector<Layer> v;
    for (int l = 0; l < layer_count; ++l) v.emplace_back(l, hidden, inter);
    return v;
  }

  GpuStackOf(const Plan& plan, Bytes gpu, Bytes pinned, const LayerExecutorOptions& eo = default_options())
      : layers(make_layers()), backend(backend_options(gpu, pinned, layers.front().cost(plan.workload).workset)) {
    const auto k = static_cast<std::size_t>(plan.micro_batches);
    target_host.resize(k);
    for (std::size_t m = 0; m < k; ++m) {
      target_dev.push_back(examples::device_floats(tokens * hidden));
      losses.push_back([dev = target_dev[m].get(), host = &target_host[m]](const float* y, float* g, double* l, void* s) {
        OOM_CUDA_CHECK(cudaMemcpyAsync(dev, host->data(), host->size() * sizeof(float), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)));
        examples::mse_loss(y, dev, g, tokens, hidden, l, s);
      });
    }
    exec = std::make_unique<CudaLayerExecutor<Layer>>(backend, layers, plan, initial_weights_of(layers), eo);
  }
  // Step s (its inputs and targets by micro-batch); the sum of the micro-batches' losses.
  double step(int s, std::vector<std::vector<float>>* grad_inputs = nullptr) {
    std::vector<std::vector<float>> inputs;
    for (std::size_t m = 0; m < target_host.size(); ++m) {
      inputs.push_back(input_of(s, static_cast<int>(m)));
      target_host[m] = target_of(s, static_cast<int>(m));
    }
    return exec->step(inputs, losses, grad_inputs);
  }
};

using GpuStack = GpuStackOf<CudaResidualMlp>;

// `steps` steps of `plan` on the GPU.
template <class Layer = CudaResidualMlp>
Run train_gpu(const Plan& plan, Bytes gpu, Bytes pinned, int steps = 3, const LayerExecutorOptions& eo = default_options()) {
  Run run;
  GpuStackOf<Layer> g(plan, gpu, pinned, eo);
  for (int s = 1; s <= steps; ++s) {
    run.losses.push_back(g.step(s));
    if (s == 1) run.events_first = g.backend.events_created();
  }
  run.events_all = g.backend.events_created();
  run.master = g.exec->master();
  run.state = g.exec->optimizer_state();
  g.exec.reset();
  run.gpu_peak = g.backend.device_arena().peak();
  run.heap_high_water = g.backend.device_high_water();
  run.pinned_peak = g.backend.pinned_arena().peak();
  return run;
}

// The same on the HostExecutor with the CPU layer (the reference), all resident.
Run train_host(int steps = 3) {
  std::vector<ResidualMlp> layers;
  for (int l = 0; l < layer_count; ++l) layers.emplace_back(l, hidden, inter);
  HostBackend backend({1_GiB, 1_GiB, /*expose_races=*/false});
  LayerExecutorOptions eo;
  eo.adamw.lr = 3e-3f;
  const Plan plan = resident_plan(layers, tokens);
  HostExecutor<ResidualMlp> exec(backend, layers, plan, initial_weights(), eo);
  Run run;
  for (int s = 1; s <= steps; ++s) run.losses.push_back(exec.step(input_of(s, 0), target_of(s, 0)));
  run.master = exec.master();
  return run;
}

// The relative L2 difference of two runs' updates (master - initial); b's must not be all zero.
double update_difference(const Run& a, const Run& b, const std::vector<std::vector<float>>& init) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < init.size(); ++i)
    for (std::size_t e = 0; e < init[i].size(); ++e) {
      const double x = a.master[i][e] - init[i][e], y = b.master[i][e] - init[i][e];
      diff += (x - y) * (x - y);
      norm += y * y;
    }
  REQUIRE(norm > 0);  // the reference run moved its weights
  return std::sqrt(diff / norm);
}

bool same_run(const Run& a, const Run& b) {
  if (a.losses != b.losses || !bitwise_equal(a.master, b.master) || a.state.size() != b.state.size()) return false;
  for (std::size_t i = 0; i < a.state.size(); ++i)
    if (!bitwise_equal({a.state[i].exp_avg, a.state[i].exp_avg_sq}, {b.state[i].exp_avg, b.state[i].exp_avg_sq})) return false;
  return true;
}

}  // namespace

TEST_CASE("every plan LayerStackPlanner gives the CUDA layer stack computes the resident plan's step bit for bit, within its predicted bytes") {
  std::vector<ResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const MachineProfile profile = MachineProfile::h200(1);  // the planner holds it by reference
  const LayerStackPlanner planner(describe_layers(shapes), profile, "residual MLP stack");
  const Run expect = train_gpu(resident_plan(shapes, tokens), 64_MiB, 64_MiB);
  MESSAGE("resident plan: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
  CHECK(expect.losses[2] < expect.losses[0]);  // it trains

  PlanRequest r;
  r.host_budget = 1_GiB;
  r.workload = {1, tokens};
  r.candidates = 4;
  const Bytes all = planner.plan([&] {
                             auto q = r;
                             q.gpu_budget = 1_GiB;
                             return q;
                           }())
                        .plans.front()
                        .predicted.gpu_peak;
  std::vector<Plan> plans;
  for (double share : {0.7, 0.45, 0.3, 0.2}) {
    r.gpu_budget = Bytes{static_cast<std::uint64_t>(static_cast<double>(all.count()) * share)};
    try {
      for (auto& p : planner.plan(r).plans) plans.push_back(std::move(p));
    } catch (const Error& e) {
      REQUIRE(e.code() == Errc::out_of_budget);  // below what any plan needs
    }
  }
  for (const char* name : {"offload-all", "checkpoint, boundaries regenerated in groups of 2",
                           "offload-checkpoint, boundaries regenerated in groups of 4"}) {
    r.gpu_budget = 1_GiB;
    r.retention = name;
    r.candidates = 2;
    for (auto& p : planner.plan(r).plans) plans.push_back(std::move(p));
  }
  int streamed = 0, offloaded = 0, recomputed = 0, chunked = 0;
  double fragments = 0;  // the largest heap extent over the budget
  for (const Plan& p : plans) {
    CAPTURE(p.retention_name);
    CAPTURE(p.resident_segments.size());
    CAPTURE(p.prefetch_depth);
    streamed += p.resident_segments.size() < static_cast<std::size_t>(layer_count);
    offloaded += any_retention(p, Retention::offload);
    recomputed += any_retention(p, Retention::recompute);
    for (const auto& c : p.chunks) chunked += c.moe_tokens < tokens;
    // In budgets of exactly the bytes it predicts (the arenas refuse a byte more): an allocation
    // past them waits for the frees queued before it (the device runs behind the host), and would
    // be refused if none were pending.
    const Run got = train_gpu(p, p.predicted.gpu_peak, p.predicted.host_peak);
    CHECK(same_run(got, expect));
    // Pooled events: the later steps reuse the first's (a few more if their frees are reaped
    // later); without the pool each step would create as many as the first.
    CHECK(got.events_all - got.events_first <= got.events_first / 4);
    fragments = std::max(fragments, static_cast<double>(got.heap_high_water.count()) / static_cast<double>(p.predicted.gpu_peak.count()));
  }
  MESSAGE(plans.size() << " plans: " << streamed << " stream, " << offloaded << " offload, " << recomputed << " recompute, " << chunked
                       << " chunked layers; the device heap's extent at most " << fragments << "x the predicted peak");
  CHECK(streamed > 0);
  CHECK(offloaded > 0);
  CHECK(recomputed > 0);
  CHECK(chunked > 0);

  // Two micro-batches: a streamed, offloading plan against the resident one, both accumulating.
  Plan two = plans.front();
  for (const Plan& p : plans)
    if (p.resident_segments.size() < static_cast<std::size_t>(layer_count) && any_retention(p, Retention::offload)) two = p;
  two.micro_batches = 2;
  const Run expect2 = train_gpu(resident_plan(shapes, tokens, 2), 64_MiB, 64_MiB);
  CHECK(same_run(train_gpu(two, 64_MiB, 64_MiB), expect2));
  CHECK_FALSE(same_run(expect2, expect));  // the second micro-batch counts

  // The comparison catches a broken schedule: compute that does not wait for its weights' load
  // (each load held 2 ms, so the stale slot is surely read) gives another step.
  Plan all_streamed = resident_plan(shapes, tokens);
  all_streamed.resident_segments.clear();
  LayerExecutorOptions broken = default_options();
  broken.drop_weight_wait = true;
  broken.check_gradients = false;  // a stale slot may give NaNs: another step, not an error
  broken.slow_weight_loads_ms = 2;
  LayerExecutorOptions slow = default_options();
  slow.slow_weight_loads_ms = 2;
  CHECK(same_run(train_gpu(all_streamed, 64_MiB, 64_MiB, 3, slow), expect));
  CHECK_FALSE(same_run(train_gpu(all_streamed, 64_MiB, 64_MiB, 3, broken), expect));
}

using WithEmpty = test::WithEmptySegment<CudaResidualMlp>;

TEST_CASE("a layer with a segment of no parameters trains as the same layer without it, its segments resident, streamed or both") {
  std::vector<WithEmpty> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  std::vector<ResidualMlp> plain_shapes;
  for (int l = 0; l < layer_count; ++l) plain_shapes.emplace_back(l, hidden, inter);
  const Run expect = train_gpu(resident_plan(plain_shapes, tokens), 64_MiB, 64_MiB);
  // The runs' weights and moments without the empty segments' (none).
  const auto without_empty = [](Run r) {
    for (std::size_t i = r.master.size(); i-- > 0;)
      if (r.master[i].empty()) {
        r.master.erase(r.master.begin() + static_cast<std::ptrdiff_t>(i));
        r.state.erase(r.state.begin() + static_cast<std::ptrdiff_t>(i));
      }
    return r;
  };
  for (int placement = 0; placement < 3; ++placement) {
    CAPTURE(placement);  // 0: all resident, 1: all streamed, 2: the empty segments resident, the others streamed
    Plan p = resident_plan(shapes, tokens);
    if (placement > 0) p.resident_segments.clear();
    if (placement == 2)
      for (const auto& l : shapes) p.resident_segments.push_back(l.segments().front().name);
    const Run got = without_empty(train_gpu<WithEmpty>(p, 64_MiB, 64_MiB));
    CHECK(got.master.size() == expect.master.size());
    CHECK(same_run(got, expect));
  }
}

TEST_CASE("bf16 AdamW moments on the GPU: every plan LayerStackPlanner gives computes the resident bf16 step, within its predicted bytes") {
  std::vector<ResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(shapes), profile, "residual MLP stack");
  Plan resident = resident_plan(shapes, tokens);
  const Run fp32 = train_gpu(resident, 64_MiB, 64_MiB);
  resident.precision.moments = DType::bf16;
  const Run expect = train_gpu(resident, 64_MiB, 64_MiB);  // CudaBackend's device AdamW, bf16 moments
  CHECK(expect.losses[2] < expect.losses[0]);
  CHECK_FALSE(same_run(expect, fp32));  // the moments' rounding is another step
  PlanRequest r;
  r.host_budget = 1_GiB;
  r.workload = {1, tokens};
  r.candidates = 3;
  r.precision.moments = DType::bf16;
  r.gpu_budget = 1_GiB;
  const Bytes all = planner.plan(r).plans.front().predicted.gpu_peak;
  int streamed = 0, tried = 0;
  for (double share : {0.6, 0.3}) {
    r.gpu_budget = Bytes{static_cast<std::uint64_t>(static_cast<double>(all.count()) * share)};
    for (const Plan& p : planner.plan(r).plans) {
      CAPTURE(p.resident_segments.size());
      REQUIRE(p.precision.moments == DType::bf16);
      streamed += p.resident_segments.size() < static_cast<std::size_t>(layer_count);
      ++tried;
      // Exactly its predicted bytes, both arenas: the planner counts the bf16 moments as held.
      CHECK(same_run(train_gpu(p, p.predicted.gpu_peak, p.predicted.host_peak), expect));
    }
  }
  MESSAGE(tried << " bf16-moment plans, " << streamed << " streaming (the CPU AdamW's bf16 moments beside the GPU's)");
  CHECK(streamed > 0);
}

TEST_CASE("on the GPU: clipping's deferred updates, the input gradient, state saved and resumed, a non-finite loss skipped, a "
          "non-finite gradient named") {
  std::vector<ResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(shapes), profile, "residual MLP stack");
  PlanRequest r;
  r.gpu_budget = 1_GiB;
  r.host_budget = 1_GiB;
  r.workload = {1, tokens};
  r.retention = "offload-all";
  const Plan streamed = planner.plan(r).plans.front();
  REQUIRE(streamed.resident_segments.size() < static_cast<std::size_t>(layer_count));  // it does stream
  const Plan resident = resident_plan(shapes, tokens);

  SUBCASE("deferred updates with a clipping factor: every plan the same norm and step; the input gradient too") {
    LayerExecutorOptions eo = default_options();
    eo.defer_updates = true;
    std::vector<double> norms;
    std::vector<std::vector<std::vector<float>>> masters, grads;
    for (const Plan* p : {&resident, &streamed}) {
      GpuStack g(*p, 64_MiB, 64_MiB, eo);
      std::vector<std::vector<float>> gi;
      (void)g.step(1, &gi);
      const double sq = g.exec->gradient_sum_of_squares();
      g.exec->apply_updates(optim::clip_grad_scale(sq, 0.5));
      norms.push_back(sq);
      masters.push_back(g.exec->master());
      grads.push_back(gi);
    }
    MESSAGE("gradient norm " << std::sqrt(norms[0]) << ", clipped to 0.5");
    CHECK(norms[0] > 0.25);  // the clip acts
    CHECK(std::memcmp(&norms[0], &norms[1], sizeof(double)) == 0);
    CHECK(bitwise_equal(masters[0], masters[1]));
    REQUIRE(grads[0].size() == 1);
    CHECK(grads[0][0].size() == tokens * hidden);
    CHECK(bitwise_equal(grads[0], grads[1]));
    CHECK(std::any_of(grads[0][0].begin(), grads[0][0].end(), [](float v) { return v != 0.0f; }));
  }

  SUBCASE("state saved after a step and loaded into another plan's executor continues bit for bit") {
    const Run straight = train_gpu(resident, 64_MiB, 64_MiB, 3);
    std::vector<SegmentOptimizerState> saved;
    {
      GpuStack a(resident, 64_MiB, 64_MiB);
      (void)a.step(1);
      saved = a.exec->optimizer_state();
    }
    GpuStack b(streamed, 64_MiB, 64_MiB);
    b.exec->load_optimizer_state(saved, 1);
    (void)b.step(2);
    (void)b.step(3);
    CHECK(bitwise_equal(b.exec->master(), straight.master));
  }

  SUBCASE("a non-finite loss skips the step; a throwing loss gives back what the step held; a non-finite gradient is named") {
    GpuStack g(resident, 64_MiB, 64_MiB);
    const Bytes worksets = g.backend.device_arena().in_use(Claimant::worksets);  // the slots, held for good
    const auto before = g.exec->master();
    const DeviceLossFn nan_loss = [](const float*, float* grad, double* l, void* s) {
      OOM_CUDA_CHECK(cudaMemsetAsync(grad, 0, tokens * hidden * sizeof(float), static_cast<cudaStream_t>(s)));
      *l = std::numeric_limits<double>::quiet_NaN();  // host memory; the executor reads it after the stream
    };
    CHECK(std::isnan(g.exec->step(input_of(1, 0), nan_loss)));
    CHECK(g.exec->last_step_skipped());
    CHECK(g.exec->optimizer_steps() == 0);
    CHECK(bitwise_equal(g.exec->master(), before));
    // A loss that throws as it is queued (on the GPU, before the step's frees are queued): what
    // the step held goes back, and the executor steps again.
    const DeviceLossFn refusing = [](const float*, float*, double*, void*) { OOM_THROW(Errc::invalid_argument, "the loss refuses"); };
    CHECK_THROWS_WITH_AS((void)g.exec->step(input_of(1, 0), refusing), doctest::Contains("the loss refuses"), Error);
    CHECK(g.backend.device_arena().in_use(Claimant::retained_activations) == 0_B);
    CHECK(g.backend.device_arena().in_use(Claimant::worksets) == worksets);
    CHECK(std::isfinite(g.step(1)));
    CHECK(g.exec->optimizer_steps() == 1);
    const DeviceLossFn nan_grad = [](const float*, float* grad, double* l, void* s) {
      OOM_CUDA_CHECK(cudaMemsetAsync(grad, 0xff, tokens * hidden * sizeof(float), static_cast<cudaStream_t>(s)));  // NaNs
      *l = 1.0;
    };
    CHECK_THROWS_WITH_AS((void)g.exec->step(input_of(2, 0), nan_grad),
                         doctest::Contains("non-finite gradient (NaN or infinite) in segment 'blocks."), Error);
    CHECK(g.backend.device_arena().in_use(Claimant::retained_activations) == 0_B);
  }
}

TEST_CASE("the CUDA stack trains as the HostExecutor's CPU stack of the same layer does") {
  std::vector<ResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const Run gpu = train_gpu(resident_plan(shapes, tokens), 64_MiB, 64_MiB);
  const Run host = train_host();
  const auto init = initial_weights();
  for (std::size_t s = 0; s < gpu.losses.size(); ++s) CHECK(gpu.losses[s] == doctest::Approx(host.losses[s]).epsilon(1e-4));
  // The updates (master - initial) agree within fp32 rounding of the sums' order and exp.
  const double rel = update_difference(gpu, host, init);
  MESSAGE("losses GPU " << gpu.losses[2] << ", host " << host.losses[2] << "; updates' relative L2 difference " << rel);
  CHECK(rel < 1e-2);
}

TEST_CASE("a cuBLAS layer (bf16 GEMMs on the tensor cores): every plan gives the resident step bit for bit; it trains as the CPU stack") {
  using examples::CublasResidualMlp;
  std::vector<CublasResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(shapes), profile, "cuBLAS residual MLP stack");
  const Run expect = train_gpu<CublasResidualMlp>(resident_plan(shapes, tokens), 64_MiB, 64_MiB);
  CHECK(expect.losses[2] < expect.losses[0]);
  PlanRequest r;
  r.host_budget = 1_GiB;
  r.workload = {1, tokens};
  r.candidates = 4;
  r.gpu_budget = 1_GiB;
  const Bytes all = planner.plan(r).plans.front().predicted.gpu_peak;
  // Budgets between one pass's workset (most of it cuBLAS's workspace) and all resident.
  const Bytes workset = shapes.front().cost(r.workload).workset;
  REQUIRE(all > workset);
  std::vector<Plan> plans;
  for (double share : {0.6, 0.35}) {
    r.gpu_budget = workset + Bytes{static_cast<std::uint64_t>(static_cast<double>((all - workset).count()) * share)};
    try {
      for (auto& p : planner.plan(r).plans) plans.push_back(std::move(p));
    } catch (const Error& e) {
      REQUIRE(e.code() == Errc::out_of_budget);
    }
  }
  for (const char* name : {"offload-all", "checkpoint, boundaries regenerated in groups of 2"}) {
    r.gpu_budget = 1_GiB;
    r.retention = name;
    r.candidates = 2;
    for (auto& p : planner.plan(r).plans) plans.push_back(std::move(p));
  }
  int streamed = 0, offloaded = 0, recomputed = 0, chunked = 0, rerun_saved = 0, regenerated = 0;
  constexpr auto other = static_cast<std::size_t>(ActivationClass::other), boundary = static_cast<std::size_t>(ActivationClass::layer_boundary);
  for (const Plan& p : plans) {
    CAPTURE(p.retention_name);
    CAPTURE(p.resident_segments.size());
    streamed += p.resident_segments.size() < static_cast<std::size_t>(layer_count);
    offloaded += any_retention(p, Retention::offload);
    recomputed += any_retention(p, Retention::recompute);
    for (const auto& c : p.chunks) chunked += c.moe_tokens < tokens;
    for (const auto& row : p.retention) {  // the forward's two reruns: without an output, without a saved class
      rerun_saved += row[other].action == Retention::recompute;
      regenerated += row[boundary].action == Retention::recompute;
    }
    CHECK(same_run(train_gpu<CublasResidualMlp>(p, p.predicted.gpu_peak, p.predicted.host_peak), expect));
  }
  CHECK(rerun_saved > 0);
  CHECK(regenerated > 0);
  MESSAGE(plans.size() << " plans of the cuBLAS stack: " << streamed << " stream, " << offloaded << " offload, " << recomputed
                       << " recompute, " << chunked << " chunked layers");
  CHECK(streamed > 0);
  CHECK(offloaded > 0);
  CHECK(recomputed > 0);
  CHECK(chunked == 0);  // not chunkable: its weight gradients are one GEMM a pass

  // Against the CPU layer in fp32 (bf16 weights): the GEMMs' operands are rounded to bf16 here.
  const Run host = train_host();
  const auto init = initial_weights();
  for (std::size_t s = 0; s < expect.losses.size(); ++s) CHECK(expect.losses[s] == doctest::Approx(host.losses[s]).epsilon(1e-3));
  const double rel = update_difference(expect, host, init);
  // Step 1's input gradient against the CPU stack's: a wrong scale anywhere in the backward shows
  // here, where Adam's updates (about lr x sign) would hide it.
  std::vector<std::vector<float>> gpu_dx;
  {
    GpuStackOf<CublasResidualMlp> g(resident_plan(shapes, tokens), 64_MiB, 64_MiB);
    (void)g.step(1, &gpu_dx);
  }
  std::vector<float> cpu_dx;
  {
    std::vector<ResidualMlp> cpu;
    for (int l = 0; l < layer_count; ++l) cpu.emplace_back(l, hidden, inter);
    HostBackend backend({1_GiB, 1_GiB, /*expose_races=*/false});
    HostExecutor<ResidualMlp> exec(backend, cpu, resident_plan(cpu, tokens), initial_weights(), default_options());
    (void)exec.step(input_of(1, 0), target_of(1, 0), &cpu_dx);  // the GPU's MSE (examples::mse_loss)
  }
  REQUIRE(gpu_dx.size() == 1);
  REQUIRE(gpu_dx[0].size() == cpu_dx.size());
  double dd = 0, dn = 0;
  for (std::size_t i = 0; i < cpu_dx.size(); ++i) {
    dd += (static_cast<double>(gpu_dx[0][i]) - cpu_dx[i]) * (static_cast<double>(gpu_dx[0][i]) - cpu_dx[i]);
    dn += static_cast<double>(cpu_dx[i]) * cpu_dx[i];
  }
  REQUIRE(dn > 0);
  MESSAGE("cuBLAS stack: step 1's input gradient " << std::sqrt(dd / dn) << " relative L2 from the CPU stack's");
  CHECK(std::sqrt(dd / dn) < 5e-2);
  MESSAGE("cuBLAS stack: losses " << expect.losses[0] << " " << expect.losses[2] << " (CPU " << host.losses[0] << " " << host.losses[2]
                                  << "); updates' relative L2 difference " << rel);
  CHECK(rel < 5e-2);
}

TEST_CASE("the GPU layers' rates measured on a recorded step predict the next step's compute; the GEMM rate does not") {
  std::vector<ResidualMlp> shapes;
  for (int l = 0; l < layer_count; ++l) shapes.emplace_back(l, hidden, inter);
  const MachineProfile profile = MachineProfile::h200(1);
  const auto described = describe_layers(shapes);  // the CUDA layer's names and costs are the CPU twin's
  const Plan plan = resident_plan(shapes, tokens);
  GpuStack g(plan, 64_MiB, 64_MiB);
  auto compute_of = [&](Timeline& tl, int s) {
    tl.clear();
    g.exec->record_next_step(&tl);
    (void)g.step(s);
    return test::pass_seconds(tl);
  };
  auto predicted = [&](const LayerStackPlanner& pl) { return test::pass_seconds(pl.step_graph(plan), profile.launch_overhead_s); };
  (void)g.step(1);  // warm-up
  std::array<Timeline, 2> tl;
  (void)compute_of(tl[0], 2);
  const LayerStackPlanner plain(described, profile);
  double declared_ratio = 0, best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const LayerStackPlanner calibrated(with_measured_rates(described, tl[static_cast<std::size_t>(round % 2)], plan.workload), profile);
    const double measured = compute_of(tl[static_cast<std::size_t>(1 - round % 2)], 3 + round);
    declared_ratio = measured / predicted(plain);
    best = std::min(best, std::abs(std::log(predicted(calibrated) / measured)));
  }
  MESSAGE("GPU layers' compute over the declared FLOPs' prediction: " << declared_ratio << "x; with measured rates, within a factor of "
                                                                       << std::exp(best));
  CHECK(declared_ratio > 5);
  CHECK(best < std::log(2.0));
}

TEST_CASE("CudaBackend's executor operations: stream-ordered frees, host tasks and their errors, zero/add, the device AdamW") {
  CudaBackend::Options bo;
  bo.device_budget = 1_MiB;
  bo.pinned_budget = 16_MiB;
  bo.pinned_slab = 16_MiB;
  CudaBackend b(bo);
  auto s = b.make_stream();

  SUBCASE("an allocation waits for a free queued behind running work, and is refused when none is pending") {
    void* a = b.allocate(MemorySpace::device(0), 1_MiB, Claimant::worksets);
    std::atomic<bool> ran{false};
    b.host_task(s, [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ran = true;
    });
    b.free_after(s, a, MemorySpace::device(0), 1_MiB, Claimant::worksets);
    void* again = b.allocate(MemorySpace::device(0), 1_MiB, Claimant::worksets);  // waits for the task, then the free
    CHECK(ran.load());
    CHECK(again == a);
    try {
      (void)b.allocate(MemorySpace::device(0), 256_KiB, Claimant::retained_activations);
      FAIL("allocated past the budget");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::out_of_budget);
    }
    b.free(again, MemorySpace::device(0), 1_MiB, Claimant::worksets);
    CHECK(b.device_arena().in_use() == 0_B);
  }

  SUBCASE("a device reserve below the budget is refused by name") {
    CudaBackend::Options small = bo;
    small.device_reserve = 512_KiB;
    CHECK_THROWS_WITH_AS(CudaBackend{small}, doctest::Contains("a device reserve of 512.00 KiB is below the budget of 1.00 MiB"), Error);
  }

  SUBCASE("a host task's error is thrown by the next synchronize, once; drain does not throw") {
    b.host_task(s, [] { OOM_THROW(Errc::invalid_argument, "the task's own words"); });
    b.drain(s);
    CHECK_THROWS_WITH_AS(b.synchronize(s), doctest::Contains("the task's own words"), Error);
    CHECK_NOTHROW(b.synchronize(s));
  }

  SUBCASE("zero, add, and the device AdamW give the CPU's bits; a non-finite gradient names its segment") {
    constexpr std::uint64_t n = 1003;  // not a multiple of a vector width
    auto* dev = static_cast<float*>(b.allocate(MemorySpace::device(0), Bytes{5 * n * sizeof(float) + n * sizeof(bf16)}, Claimant::worksets));
    float *master = dev, *m = dev + n, *v = dev + 2 * n, *grad = dev + 3 * n, *x = dev + 4 * n;
    auto* w = reinterpret_cast<bf16*>(dev + 5 * n);
    auto hm = test::random_normal(n, 1, 1.0f), hv = test::random_normal(n, 2, 1.0f), hg = test::random_normal(n, 3, 1.0f), hx = test::random_normal(n, 4, 1.0f), hmaster = test::random_normal(n, 5, 1.0f);
    for (auto& e : hv) e = e * e;  // second moments are not negative
    OOM_CUDA_CHECK(cudaMemcpy(master, hmaster.data(), n * 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaMemcpy(m, hm.data(), n * 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaMemcpy(v, hv.data(), n * 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaMemcpy(grad, hg.data(), n * 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaMemcpy(x, hx.data(), n * 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaDeviceSynchronize());  // pageable uploads may return before they land; s does not wait for them
    b.add(grad, x, n, s);  // grad = g + x
    optim::AdamWConfig cfg;
    cfg.lr = 1e-2f;
    cfg.weight_decay = 0.1f;
    const auto sc = optim::adamw_step_scalars(cfg, 3);
    b.device_adamw(sc, master, m, v, grad, w, n, s, "segment 'blocks.0' (step 3)");
    b.synchronize(s);
    std::vector<float> gm(n), gmm(n), gv(n);
    std::vector<bf16> gw(n);
    OOM_CUDA_CHECK(cudaMemcpy(gm.data(), master, n * 4, cudaMemcpyDeviceToHost));
    OOM_CUDA_CHECK(cudaMemcpy(gmm.data(), m, n * 4, cudaMemcpyDeviceToHost));
    OOM_CUDA_CHECK(cudaMemcpy(gv.data(), v, n * 4, cudaMemcpyDeviceToHost));
    OOM_CUDA_CHECK(cudaMemcpy(gw.data(), w, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    int differ = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      float p = hmaster[i], mm = hm[i], vv = hv[i];
      optim::adamw_element(sc, p, mm, vv, hg[i] + hx[i]);
      differ += std::memcmp(&p, &gm[i], 4) != 0 || std::memcmp(&mm, &gmm[i], 4) != 0 || std::memcmp(&vv, &gv[i], 4) != 0 ||
                to_bf16(p).bits != gw[i].bits;
    }
    CHECK(differ == 0);
    b.zero(grad, n, s);
    b.synchronize(s);
    std::vector<float> z(n, 1.0f);
    OOM_CUDA_CHECK(cudaMemcpy(z.data(), grad, n * 4, cudaMemcpyDeviceToHost));
    CHECK(std::all_of(z.begin(), z.end(), [](float e) { return e == 0.0f; }));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    OOM_CUDA_CHECK(cudaMemcpy(grad + 777, &nan, 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    b.device_adamw(sc, master, m, v, grad, w, n, s, "segment 'blocks.4' (step 9)");
    CHECK_THROWS_WITH_AS(b.synchronize(s), doctest::Contains("non-finite gradient (NaN or infinite) in segment 'blocks.4' (step 9)"), Error);
    // Clean ones after it pass: the flag was cleared and is reused (the next check takes it).
    b.zero(grad, n, s);
    for (int i = 0; i < 3; ++i) b.device_adamw(sc, master, m, v, grad, w, n, s, "segment 'blocks.5' (step 10)");
    CHECK_NOTHROW(b.synchronize(s));
    // drain() keeps a flagged check's error for the next synchronize().
    OOM_CUDA_CHECK(cudaMemcpy(grad + 5, &nan, 4, cudaMemcpyHostToDevice));
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    b.device_adamw(sc, master, m, v, grad, w, n, s, "segment 'blocks.6' (step 11)");
    b.drain(s);
    CHECK_THROWS_WITH_AS(b.synchronize(s), doctest::Contains("blocks.6"), Error);
    b.free(dev, MemorySpace::device(0), Bytes{5 * n * sizeof(float) + n * sizeof(bf16)}, Claimant::worksets);
  }
  b.retire(s);
}
