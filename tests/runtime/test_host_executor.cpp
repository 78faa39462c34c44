// Every plan computes the same step: on the host backend, for random small MoE models and random
// plans (residency per segment, keep/offload/recompute per activation class, token chunks, prefetch
// depth), the weights after 3 optimizer steps equal those of the plain resident plan bit for bit;
// a schedule that drops one event wait is caught; the device arena stays within the plan's budget.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "custom_layer/residual_mlp.hpp"
#include "moe_mlp_layer.hpp"
#include "oom/io/json.hpp"
#include "oom/plan/simulator.hpp"
#include "oom/runtime/host_executor.hpp"
#include "oom/runtime/timeline.hpp"
#include "support/compare.hpp"
#include "support/empty_segment.hpp"
#include "support/same_step.hpp"

using namespace oom;
using namespace oom::literals;
using oom::test::bitwise_equal;

// The names from before the executor was generic still name the same things.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<HostLayerContext, LayerContext>);
static_assert(std::is_same_v<HostExecutorOptions, LayerExecutorOptions>);
#pragma GCC diagnostic pop
static_assert(host_layer<test::MoeMlpLayer>);

namespace {

struct Case {
  std::uint64_t hidden, experts, top_k, inter, tokens;
  int layers;
};

Plan resident_plan(const std::vector<test::MoeMlpLayer>& layers, std::uint64_t tokens) {
  Plan p;
  p.workload = {1, tokens};
  p.prefetch_depth = 2;
  p.gpu_budget = 1_GiB;
  p.host_budget = 1_GiB;
  for (const auto& l : layers)
    for (const auto& s : l.segments()) p.resident_segments.push_back(s.name);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::array<RetentionDecision, activation_class_count> row{};
    p.retention.push_back(row);
    p.chunks.push_back({{tokens}, tokens});
  }
  p.loss_rows = tokens;
  return p;
}

/// resident_plan with its first half of the segments resident (GPU AdamW) and the rest streamed
/// (CPU AdamW): both update paths in one step.
Plan half_resident_plan(const std::vector<test::MoeMlpLayer>& layers, std::uint64_t tokens) {
  Plan p = resident_plan(layers, tokens);
  p.resident_segments.resize(p.resident_segments.size() / 2);
  return p;
}

Plan random_plan(const std::vector<test::MoeMlpLayer>& layers, std::uint64_t tokens, std::mt19937_64& rng) {
  Plan p = resident_plan(layers, tokens);
  p.prefetch_depth = 1 + static_cast<int>(rng() % 3);
  p.resident_segments.clear();
  for (const auto& l : layers)
    for (const auto& s : l.segments())
      if (rng() % 2) p.resident_segments.push_back(s.name);
  int group = -1;  // the first layer of the group of regenerated boundaries l would join
  for (std::size_t l = 0; l < layers.size(); ++l) {
    auto& row = p.retention[l];
    // A boundary is kept, offloaded, or (a third of the time above layer 0) regenerated through
    // the layers from its group's first, whose boundary is kept or offloaded.
    if (l > 0 && rng() % 3 == 0) {
      if (group < 0) group = static_cast<int>(l) - 1;
      row[static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::recompute(group);
    } else {
      group = -1;
      row[static_cast<std::size_t>(ActivationClass::layer_boundary)] =
          rng() % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
    }
    for (auto c : {ActivationClass::router_output, ActivationClass::expert_intermediate}) {
      const auto pick = rng() % 3;
      row[static_cast<std::size_t>(c)] = pick == 0   ? RetentionDecision::keep()
                                         : pick == 1 ? RetentionDecision::offload()
                                                     : RetentionDecision::recompute(static_cast<int>(l));
    }
    p.chunks[l].moe_tokens = 1 + rng() % tokens;
  }
  return p;
}

/// A small random MoE stack: hidden 8 or 16, 2-8 experts, top 1-2, 3-32 tokens, 1-4 layers.
Case random_case(std::mt19937_64& rng) {
  return {8 + 8 * (rng() % 2), std::uint64_t{2} << (rng() % 3), 1 + rng() % 2, 8 + 8 * (rng() % 2), 3 + rng() % 30,
          1 + static_cast<int>(rng() % 4)};
}
std::vector<test::MoeMlpLayer> layers_of(const Case& c) {
  std::vector<test::MoeMlpLayer> layers;
  for (int l = 0; l < c.layers; ++l) layers.emplace_back(l, c.hidden, c.experts, c.top_k, c.inter);
  return layers;
}

struct Result {
  std::vector<std::vector<float>> master;
  std::vector<SegmentOptimizerState> state;
  std::vector<double> losses;
  Bytes device_peak, host_state;  ///< the device arena's peak; the pinned arena's host_state bytes
  bool leaked = false;  ///< the arenas held more after a step than before it
};

Result train(const Case& c, const Plan& plan, std::uint64_t seed, LayerExecutorOptions options = {}) {
  std::vector<test::MoeMlpLayer> layers = layers_of(c);
  std::vector<std::vector<float>> init;
  std::uint64_t s = seed;
  for (const auto& l : layers)
    for (const auto& seg : l.segments()) init.push_back(test::random_normal(seg.parameters(), ++s, 0.3f));
  HostBackend backend({plan.gpu_budget, 1_GiB, true});
  Result r;
  {
    options.adamw.lr = 1e-2f;
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, init, options);
    const Bytes device_held = backend.device_arena().in_use(), pinned_held = backend.pinned_arena().in_use();
    for (int step = 0; step < 3; ++step) {
      const auto x = test::random_normal(c.tokens * c.hidden, seed * 100 + static_cast<std::uint64_t>(step));
      const auto y = test::random_normal(c.tokens * c.hidden, seed * 100 + 50 + static_cast<std::uint64_t>(step));
      r.losses.push_back(exec.step(x, y));
      r.leaked |= backend.device_arena().in_use() != device_held || backend.pinned_arena().in_use() != pinned_held;
    }
    r.master = exec.master();
    r.state = exec.optimizer_state();
    r.host_state = backend.pinned_arena().in_use(Claimant::host_state);
  }
  r.device_peak = backend.device_arena().peak();
  return r;
}

}  // namespace

TEST_CASE("60 random (model, plan) pairs: 3 steps give the resident plan's weights, bit for bit") {
  std::mt19937_64 rng(42);
  int streamed_plans = 0, regenerating_plans = 0;
  for (int i = 0; i < 60; ++i) {
    const Case c = random_case(rng);
    const std::vector<test::MoeMlpLayer> shape = layers_of(c);
    const Plan reference = resident_plan(shape, c.tokens);
    const Plan plan = random_plan(shape, c.tokens, rng);
    regenerating_plans += std::any_of(plan.retention.begin(), plan.retention.end(),
                                      [](const auto& row) { return row[0].action == Retention::recompute; });
    std::size_t segments = 0;
    for (const auto& l : shape) segments += l.segments().size();
    streamed_plans += plan.resident_segments.size() < segments;
    const auto seed = rng();
    const Result expect = train(c, reference, seed);
    const Result got = train(c, plan, seed);
    CAPTURE(i);
    CAPTURE(plan.prefetch_depth);
    REQUIRE(got.losses == expect.losses);
    REQUIRE(bitwise_equal(got.master, expect.master));
    CHECK_FALSE(got.leaked);  // every buffer a step takes (regenerated boundaries too) is given back
    // The optimizer did move the weights (the comparison is not between two untouched copies).
    CHECK(expect.losses.back() != expect.losses.front());
  }
  CHECK(streamed_plans > 50);
  CHECK(regenerating_plans > 15);
}

TEST_CASE("bf16 moments: every plan computes the resident plan's step; the moments are bf16, 4 bytes a parameter less") {
  std::mt19937_64 rng(7);
  const auto bf16_moments = [](Plan p) {
    p.precision.moments = DType::bf16;
    return p;
  };
  int differing = 0;
  for (int i = 0; i < 20; ++i) {
    const Case c = random_case(rng);
    const std::vector<test::MoeMlpLayer> shape = layers_of(c);
    const Plan fp32_reference = resident_plan(shape, c.tokens);
    const Plan reference = bf16_moments(fp32_reference);
    // Resident segments take the backend's device AdamW, streamed ones the CPU's: both kinds in
    // most plans, so their bf16 moments must agree bit for bit.
    const Plan plan = bf16_moments(random_plan(shape, c.tokens, rng));
    const auto seed = rng();
    const Result expect = train(c, reference, seed);
    const Result got = train(c, plan, seed);
    CAPTURE(i);
    REQUIRE(got.losses == expect.losses);
    REQUIRE(bitwise_equal(got.master, expect.master));
    CHECK_FALSE(got.leaked);
    std::uint64_t streamed = 0;
    for (std::size_t s = 0; s < got.state.size(); ++s) {
      const auto& st = got.state[s];
      CHECK(bitwise_equal({st.exp_avg}, {expect.state[s].exp_avg}));
      CHECK(bitwise_equal({st.exp_avg_sq}, {expect.state[s].exp_avg_sq}));
      for (const auto* m : {&st.exp_avg, &st.exp_avg_sq})  // exported exactly: every value a bf16
        CHECK(std::all_of(m->begin(), m->end(), [](float x) { return std::bit_cast<std::uint32_t>(x) % 65536 == 0; }));
    }
    for (const auto& l : shape)
      for (const auto& seg : l.segments())
        if (std::find(plan.resident_segments.begin(), plan.resident_segments.end(), seg.name) == plan.resident_segments.end())
          streamed += seg.parameters();
    // A streamed parameter's host state: bf16 weights 2 + fp32 master 4 + two bf16 moments 4.
    CHECK(got.host_state == Bytes{streamed * 10});
    // The moments' rounding changes the step: the fp32-moment run ends elsewhere.
    differing += !bitwise_equal(train(c, fp32_reference, seed).master, expect.master);
  }
  CHECK(differing == 20);
}

TEST_CASE("executors made and destroyed on one backend leave no streams behind") {
  const Case c{16, 4, 2, 16, 12, 2};
  std::vector<test::MoeMlpLayer> layers = layers_of(c);
  std::vector<std::vector<float>> init;
  std::uint64_t seed = 3;
  for (const auto& l : layers)
    for (const auto& seg : l.segments()) init.push_back(test::random_normal(seg.parameters(), ++seed, 0.3f));
  const Plan plan = resident_plan(layers, c.tokens);
  HostBackend backend({1_GiB, 1_GiB, false});
  for (int i = 0; i < 5; ++i) {
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, init);
    CHECK(backend.stream_count() == 4);
    (void)exec.step(test::random_normal(c.tokens * c.hidden, 1), test::random_normal(c.tokens * c.hidden, 2));
  }
  CHECK(backend.stream_count() == 0);
  CHECK(backend.device_arena().in_use() == Bytes{});
  CHECK(backend.pinned_arena().in_use() == Bytes{});
  // An executor whose state does not fit is refused, and gives back what it had taken.
  HostBackend small({Bytes{backend.device_arena().peak().count() / 3}, 1_GiB, false});
  CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(small, layers, plan, init), doctest::Contains("resident_state asks for"), Error);
  CHECK(small.stream_count() == 0);
  CHECK(small.device_arena().in_use() == Bytes{});
  CHECK(small.pinned_arena().in_use() == Bytes{});
  // And one refused for its input, before it takes anything.
  auto short_init = init;
  short_init.pop_back();
  CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(backend, layers, plan, short_init),
                       doctest::Contains("initial weight vectors for the layers'"), Error);
  CHECK(backend.stream_count() == 0);
}

TEST_CASE("dropping the wait for a layer's weights is caught") {
  // One slot: the load of layer l+1 starts when layer l's compute ends, and a compute that does
  // not wait for it reads a slot being poisoned and refilled.
  const Case c{16, 4, 2, 16, 24, 4};
  const std::vector<test::MoeMlpLayer> shape = layers_of(c);
  const Plan reference = resident_plan(shape, c.tokens);
  Plan streamed = reference;
  streamed.resident_segments.clear();
  streamed.prefetch_depth = 1;
  const Result expect = train(c, reference, 7);
  CHECK(bitwise_equal(train(c, streamed, 7).master, expect.master));  // the correct schedule agrees
  LayerExecutorOptions broken;
  broken.drop_weight_wait = true;
  CHECK_FALSE(bitwise_equal(train(c, streamed, 7, broken).master, expect.master));
}

TEST_CASE("the device arena enforces the plan's budget, naming the claimant") {
  const Case c{16, 4, 2, 16, 32, 2};
  const std::vector<test::MoeMlpLayer> shape = layers_of(c);
  Plan plan = resident_plan(shape, c.tokens);
  const Result roomy = train(c, plan, 3);
  CHECK(roomy.device_peak <= plan.gpu_budget);
  // Half the peak. A roomy run's peak counts buffers queued ahead of the frees before them, and
  // varies with when the streams run those; a tighter arena makes allocations wait for the frees
  // (test_host_backend), so only a budget below what the step holds at once is refused.
  plan.gpu_budget = Bytes{roomy.device_peak.count() / 2};
  CHECK_THROWS_WITH_AS((void)train(c, plan, 3), doctest::Contains("the budget is"), Error);
}

namespace {

struct Stack {
  Case c;
  std::vector<test::MoeMlpLayer> layers;
  std::vector<std::vector<float>> init;
  explicit Stack(const Case& cs, std::uint64_t seed) : c(cs), layers(layers_of(cs)) {
    for (const auto& l : layers)
      for (const auto& seg : l.segments()) init.push_back(test::random_normal(seg.parameters(), ++seed, 0.3f));
  }
  std::vector<float> input(int step) const { return test::random_normal(c.tokens * c.hidden, 1000 + static_cast<std::uint64_t>(step)); }
  std::vector<float> target(int step) const { return test::random_normal(c.tokens * c.hidden, 2000 + static_cast<std::uint64_t>(step)); }
};

// A small stack (seed `seed`), half its segments resident, whose executor defers its updates
// (lr 1e-2): the deferred-update tests' setup.
struct DeferredStack {
  static LayerExecutorOptions options() {
    LayerExecutorOptions o;
    o.adamw.lr = 1e-2f;
    o.defer_updates = true;
    return o;
  }
  const Stack st;
  std::vector<test::MoeMlpLayer> layers;
  const Plan plan;
  HostBackend backend;
  HostExecutor<test::MoeMlpLayer> exec;
  explicit DeferredStack(std::uint64_t seed)
      : st({8, 2, 1, 8, 9, 2}, seed),
        layers(st.layers),
        plan(half_resident_plan(layers, st.c.tokens)),
        backend({1_GiB, 1_GiB, true}),
        exec(backend, layers, plan, st.init, options()) {}
};

}  // namespace

TEST_CASE("resuming from exported optimizer state continues the same run, bit for bit (fp32 and bf16 moments)") {
  for (const DType moments : {DType::fp32, DType::bf16}) {
    const std::string moments_name(name(moments));
    CAPTURE(moments_name);
    const Stack st({16, 4, 2, 16, 12, 3}, 11);
    auto layers = st.layers;
    Plan plan = half_resident_plan(layers, st.c.tokens);
    plan.precision.moments = moments;
    LayerExecutorOptions opt;
    opt.adamw.lr = 1e-2f;
    HostBackend backend({1_GiB, 1_GiB, true});
    std::vector<double> straight;
    std::vector<std::vector<float>> expect;
    {
      HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, opt);
      for (int s = 0; s < 4; ++s) straight.push_back(exec.step(st.input(s), st.target(s)));
      expect = exec.master();
    }
    std::vector<SegmentOptimizerState> saved;
    std::int64_t steps = 0;
    {
      HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, opt);
      for (int s = 0; s < 2; ++s) CHECK(exec.step(st.input(s), st.target(s)) == straight[static_cast<std::size_t>(s)]);
      saved = exec.optimizer_state();
      steps = exec.optimizer_steps();
    }
    CHECK(steps == 2);
    HostExecutor<test::MoeMlpLayer> resumed(backend, layers, plan, st.init, opt);  // initial weights overwritten below
    resumed.load_optimizer_state(saved, steps);
    for (int s = 2; s < 4; ++s) CHECK(resumed.step(st.input(s), st.target(s)) == straight[static_cast<std::size_t>(s)]);
    CHECK(bitwise_equal(resumed.master(), expect));
    // A negative step count is refused as it is loaded (every later step had been refused, "AdamW
    // step is -4"), the state left as it was.
    CHECK_THROWS_WITH_AS(resumed.load_optimizer_state(saved, -5),
                         doctest::Contains("load_optimizer_state(): optimizer_steps is -5; a step count is at least 0"), Error);
    CHECK(resumed.optimizer_steps() == 4);
    CHECK(bitwise_equal(resumed.master(), expect));
    saved.pop_back();
    CHECK_THROWS_WITH_AS(resumed.load_optimizer_state(saved, 1), doctest::Contains("segments"), Error);
  }
}

TEST_CASE("a non-finite loss skips the step and leaves the state untouched; a non-finite gradient names its segment") {
  const Stack st({16, 4, 2, 16, 10, 2}, 5);
  auto layers = st.layers;
  Plan plan = resident_plan(layers, st.c.tokens);
  plan.resident_segments.clear();
  plan.retention[0][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::offload();
  HostBackend backend({1_GiB, 1_GiB, true});
  HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, {});
  const auto before = exec.master();
  const HostLossFn nan_loss = [](const float*, float*) { return std::nan(""); };
  CHECK(std::isnan(exec.step(st.input(0), nan_loss)));
  CHECK(exec.last_step_skipped());
  CHECK(exec.optimizer_steps() == 0);
  CHECK(bitwise_equal(exec.master(), before));
  CHECK(backend.device_arena().in_use(Claimant::retained_activations) == 0_B);
  CHECK(backend.pinned_arena().in_use(Claimant::host_offload) == 0_B);
  // Finite loss, poisoned gradient: the update refuses it and says where.
  const std::uint64_t n = st.c.tokens * st.c.hidden;
  const HostLossFn bad_grad = [n](const float*, float* g) {
    std::fill(g, g + n, 0.0f);
    g[3] = std::numeric_limits<float>::infinity();
    return 1.0;
  };
  CHECK_THROWS_WITH_AS((void)exec.step(st.input(1), bad_grad), doctest::Contains("non-finite gradient"), Error);
}

TEST_CASE("a loss or a layer that throws stops the step: no backward, no update, the step not counted, the error thrown") {
  const Stack st({16, 4, 2, 16, 10, 2}, 5);
  auto layers = st.layers;
  const Plan plan = half_resident_plan(layers, st.c.tokens);
  HostBackend backend({1_GiB, 1_GiB, true});
  LayerExecutorOptions options;
  options.skip_nonfinite_loss = false;  // no synchronize after the loss: the backward is queued behind it
  HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, options);
  const auto before = exec.master();
  const HostLossFn throws = [](const float*, float*) -> double { throw std::runtime_error("the loss failed"); };
  CHECK_THROWS_WITH_AS((void)exec.step(st.input(0), throws), "the loss failed", std::runtime_error);
  CHECK(exec.optimizer_steps() == 0);
  CHECK(bitwise_equal(exec.master(), before));  // updated before: every segment, from gradients never written
  CHECK(backend.device_arena().in_use(Claimant::retained_activations) == 0_B);
  // The executor goes on: the next step is a whole one.
  const std::uint64_t n = st.c.tokens * st.c.hidden;
  const HostLossFn half_square = [n](const float* y, float* g) {
    double sum = 0;
    for (std::uint64_t i = 0; i < n; ++i) sum += 0.5 * static_cast<double>(y[i]) * y[i], g[i] = y[i];
    return sum;
  };
  (void)exec.step(st.input(1), half_square);
  CHECK(exec.optimizer_steps() == 1);
  CHECK(!bitwise_equal(exec.master(), before));
  // An empty loss is refused by name, before any work is queued.
  CHECK_THROWS_WITH_AS((void)exec.step(st.input(2), HostLossFn{}), doctest::Contains("the loss of micro-batch 0 is an empty function"),
                       Error);
  // apply_updates() belongs to deferred updates: without them it would update a second time.
  CHECK_THROWS_WITH_AS(exec.apply_updates(1.0f), doctest::Contains("defer_updates"), Error);
  CHECK(exec.optimizer_steps() == 1);
}

TEST_CASE("the gradient of the stack's input is what every plan computes") {
  const Stack st({8, 2, 1, 8, 9, 2}, 3);
  auto layers = st.layers;
  const Plan reference = resident_plan(layers, st.c.tokens);
  std::mt19937_64 rng(9);
  const Plan plan = random_plan(layers, st.c.tokens, rng);
  std::vector<float> g_ref, g_plan;
  HostBackend backend({1_GiB, 1_GiB, true});
  const auto tgt = st.target(0);
  const float* t = tgt.data();
  const std::uint64_t n = tgt.size();
  const HostLossFn mse = [t, n](const float* y, float* g) {
    double sum = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      g[i] = y[i] - t[i];
      sum += 0.5 * g[i] * g[i];
    }
    return sum;
  };
  {
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, reference, st.init, {});
    (void)exec.step(st.input(0), mse, &g_ref);
  }
  {
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, {});
    (void)exec.step(st.input(0), mse, &g_plan);
  }
  REQUIRE(g_ref.size() == n);
  CHECK(g_ref == g_plan);
  // A residual stack passes the gradient through: dL/dx is not zero.
  CHECK(std::any_of(g_ref.begin(), g_ref.end(), [](float v) { return v != 0.0f; }));
  // The target overload hands its input gradient out too: its loss is the mean over the T tokens,
  // so (the backward being linear in dL/dy) T times it is the summed loss's, to rounding.
  std::vector<float> g_target;
  {
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, reference, st.init, {});
    (void)exec.step(st.input(0), tgt, &g_target);
  }
  REQUIRE(g_target.size() == n);
  double diff = 0, norm = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const double a = static_cast<double>(g_target[i]) * static_cast<double>(st.c.tokens), b = g_ref[i];
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  CHECK(std::sqrt(diff / norm) < 1e-5);
}

TEST_CASE("deferred updates with a clipping factor: the same bits under every plan, and the unclipped step when the factor is 1") {
  const Stack st({16, 4, 2, 16, 11, 3}, 21);
  auto layers = st.layers;
  const Plan reference = resident_plan(layers, st.c.tokens);
  HostBackend backend({1_GiB, 1_GiB, true});
  auto run = [&](const Plan& plan, bool defer, double max_norm, std::vector<double>* norms) {
    LayerExecutorOptions opt;
    opt.adamw.lr = 1e-2f;
    opt.defer_updates = defer;
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, opt);
    for (int s = 0; s < 3; ++s) {
      (void)exec.step(st.input(s), st.target(s));
      if (!defer) continue;
      const double ss = exec.gradient_sum_of_squares();
      if (norms) norms->push_back(ss);
      exec.apply_updates(max_norm > 0 ? optim::clip_grad_scale(ss, max_norm) : 1.0f);
    }
    return exec.master();
  };
  const auto plain = run(reference, false, 0, nullptr);
  CHECK(bitwise_equal(run(reference, true, 0, nullptr), plain));  // deferring alone changes nothing
  std::vector<double> norms;
  const auto clipped = run(reference, true, 0.05, &norms);
  REQUIRE(norms.size() == 3);
  CHECK(std::sqrt(norms[0]) > 0.05);  // so the factor really is below 1
  CHECK_FALSE(bitwise_equal(clipped, plain));
  std::mt19937_64 rng(5);
  for (int i = 0; i < 6; ++i) {
    std::vector<double> got_norms;
    CAPTURE(i);
    CHECK(bitwise_equal(run(random_plan(layers, st.c.tokens, rng), true, 0.05, &got_norms), clipped));
    CHECK(got_norms == norms);
  }
}

TEST_CASE("apply_updates() applies a deferred step's updates once: refused before a step, a second time and after a skipped step") {
  // It had run AdamW again on whatever gradients were left: a second call, or one after a step
  // whose loss was not finite, updated every segment once more from the last step's gradients.
  DeferredStack d(3);
  const Stack& st = d.st;
  auto& exec = d.exec;
  CHECK_THROWS_WITH_AS(exec.apply_updates(1.0f), doctest::Contains("no step's gradients wait"), Error);
  (void)exec.step(st.input(0), st.target(0));
  exec.apply_updates(1.0f);
  const auto once = exec.master();
  CHECK_FALSE(bitwise_equal(once, st.init));
  CHECK_THROWS_WITH_AS(exec.apply_updates(1.0f), doctest::Contains("no step's gradients wait"), Error);
  CHECK(bitwise_equal(exec.master(), once));
  const HostLossFn nan_loss = [](const float*, float*) { return std::nan(""); };
  (void)exec.step(st.input(1), nan_loss);
  REQUIRE(exec.last_step_skipped());
  CHECK_THROWS_WITH_AS(exec.apply_updates(1.0f), doctest::Contains("no step's gradients wait"), Error);
  CHECK(bitwise_equal(exec.master(), once));
  CHECK(exec.optimizer_steps() == 1);
  // The next whole step's updates apply as before.
  (void)exec.step(st.input(2), st.target(2));
  exec.apply_updates(1.0f);
  CHECK(exec.optimizer_steps() == 2);
  CHECK_FALSE(bitwise_equal(exec.master(), once));
}

TEST_CASE("deferred updates: a step() before the last one's apply_updates() is refused, and only applied updates count as steps") {
  // The second step() had overwritten the waiting gradients, which were lost unapplied, while
  // optimizer_steps() counted both steps.
  DeferredStack d(7);
  const Stack& st = d.st;
  auto& exec = d.exec;
  (void)exec.step(st.input(0), st.target(0));
  CHECK(exec.optimizer_steps() == 0);  // gradients wait: no update yet
  CHECK_THROWS_WITH_AS((void)exec.step(st.input(1), st.target(1)), doctest::Contains("the previous step's updates were never applied"),
                       Error);
  CHECK(exec.optimizer_steps() == 0);
  CHECK(bitwise_equal(exec.master(), st.init));
  // The refused step left the first step's gradients: applying them gives the plain first step.
  exec.apply_updates(1.0f);
  CHECK(exec.optimizer_steps() == 1);
  HostExecutor<test::MoeMlpLayer> plain(d.backend, d.layers, d.plan, st.init, [] {
    LayerExecutorOptions o = DeferredStack::options();
    o.defer_updates = false;
    return o;
  }());
  (void)plain.step(st.input(0), st.target(0));
  CHECK(bitwise_equal(exec.master(), plain.master()));
  (void)exec.step(st.input(1), st.target(1));
  exec.apply_updates(1.0f);
  CHECK(exec.optimizer_steps() == 2);
}

TEST_CASE("gradient_sum_of_squares() is refused where no step's gradients wait, as apply_updates() is") {
  // Before any step it had summed buffers no step had written (NaN, or 1e75).
  DeferredStack d(3);
  const Stack& st = d.st;
  auto& exec = d.exec;
  CHECK_THROWS_WITH_AS((void)exec.gradient_sum_of_squares(), doctest::Contains("no step's gradients wait"), Error);
  (void)exec.step(st.input(0), st.target(0));
  const double ss = exec.gradient_sum_of_squares();
  CHECK(std::isfinite(ss));
  CHECK(ss > 0);
  exec.apply_updates(1.0f);
  CHECK_THROWS_WITH_AS((void)exec.gradient_sum_of_squares(), doctest::Contains("no step's gradients wait"), Error);
  HostExecutor<test::MoeMlpLayer> updating(d.backend, d.layers, d.plan, st.init, {});
  CHECK_THROWS_WITH_AS((void)updating.gradient_sum_of_squares(), doctest::Contains("defer_updates"), Error);
  (void)updating.step(st.input(0), st.target(0));
  CHECK_THROWS_WITH_AS((void)updating.gradient_sum_of_squares(), doctest::Contains("defer_updates"), Error);
}

TEST_CASE("a recorded step: spans of every kind of work per resource, serial within a resource, as Chrome trace") {
  const Stack st({16, 4, 2, 16, 12, 3}, 8);
  auto layers = st.layers;
  Plan plan = resident_plan(layers, st.c.tokens);
  plan.resident_segments.clear();
  for (auto& row : plan.retention) row[0] = RetentionDecision::offload();
  HostBackend backend({1_GiB, 1_GiB, true});
  HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, {});
  (void)exec.step(st.input(0), st.target(0));  // not recorded
  Timeline tl;
  exec.record_next_step(&tl);
  (void)exec.step(st.input(1), st.target(1));
  (void)exec.step(st.input(2), st.target(2));  // not recorded either
  const auto spans = tl.spans();
  auto count = [&](const std::string& prefix, Resource r) {
    return std::count_if(spans.begin(), spans.end(), [&](const TimelineSpan& s) { return s.resource == r && s.name.starts_with(prefix); });
  };
  CHECK(count("fwd layer", Resource::gpu_compute) == 3);
  CHECK(count("bwd layer", Resource::gpu_compute) == 3);
  CHECK(count("loss", Resource::gpu_compute) == 1);
  CHECK(count("h2d weights", Resource::h2d) == 6);  // forward and backward
  CHECK(count("h2d layer_boundary", Resource::h2d) == 3);
  CHECK(count("d2h layer_boundary", Resource::d2h) == 3);
  CHECK(count("d2h grads", Resource::d2h) == 3);
  CHECK(count("adamw layer", Resource::cpu) == 3);
  // One stream per resource: its spans never overlap.
  for (int r = 0; r < resource_count; ++r) {
    std::vector<TimelineSpan> lane;
    for (const auto& s : spans)
      if (static_cast<int>(s.resource) == r) lane.push_back(s);
    std::sort(lane.begin(), lane.end(), [](const auto& a, const auto& b) { return a.begin_s < b.begin_s; });
    for (std::size_t i = 1; i < lane.size(); ++i) CHECK(lane[i].begin_s >= lane[i - 1].end_s);
  }
  const auto busy = tl.busy();
  CHECK(busy[Resource::gpu_compute] > 0);
  CHECK(busy[Resource::gpu_compute] <= tl.wall_seconds() + 1e-9);
  const Json trace = Json::parse(tl.chrome_trace(), "trace");
  CHECK(trace.find("traceEvents")->size() == spans.size() + resource_count + 1);

  // Asked for during a step (here from the progress callback), a recording is the next step's.
  Timeline late;
  bool asked = false;
  exec.on_layer([&](const LayerProgress&) {
    if (!asked) exec.record_next_step(&late);
    asked = true;
  });
  (void)exec.step(st.input(3), st.target(3));
  CHECK(late.spans().empty());
  exec.on_layer({});
  (void)exec.step(st.input(4), st.target(4));
  const auto next = late.spans();
  CHECK(std::count_if(next.begin(), next.end(), [](const TimelineSpan& s) { return s.name.starts_with("fwd layer"); }) == 3);
}

TEST_CASE("a timeline's host spans: a track of their own in the trace, not a resource") {
  Timeline tl;
  tl.add("fwd layers.0", Resource::gpu_compute, 0.001, 0.004);
  tl.add_host("issue fwd layers.0", 0.0, 0.010);  // the host blocked longer than the GPU worked
  CHECK(tl.busy()[Resource::gpu_compute] == doctest::Approx(0.003));
  CHECK(tl.busy()[Resource::cpu] == 0.0);
  CHECK(tl.wall_seconds() == doctest::Approx(0.003));
  REQUIRE(tl.host_spans().size() == 1);
  const Json trace = Json::parse(tl.chrome_trace(), "trace");
  const auto& events = *trace.find("traceEvents");
  int host_tracks = 0, host_events = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const JsonCursor e = JsonCursor(events, "traceEvents")[i];
    if (!e["tid"].present() || e["tid"].as_int64() != resource_count) continue;
    if (e["ph"].as_string() == "M") host_tracks += e["args"]["name"].as_string().starts_with("host") ? 1 : 0;
    if (e["ph"].as_string() == "X") {
      ++host_events;
      CHECK(e["name"].as_string() == "issue fwd layers.0");
      CHECK(e["dur"].as_double() == doctest::Approx(10000.0));
    }
  }
  CHECK(host_tracks == 1);
  CHECK(host_events == 1);
  tl.clear();
  CHECK(tl.host_spans().empty());
}

TEST_CASE("gradient accumulation over micro-batches: the same bits under every plan; a zero-gradient micro-batch adds nothing") {
  const Stack st({16, 4, 2, 16, 10, 3}, 31);
  auto layers = st.layers;
  HostBackend backend({1_GiB, 1_GiB, true});
  const std::uint64_t n = st.c.tokens * st.c.hidden;
  auto mse = [n](const std::vector<float>& target, float scale) {
    const float* t = target.data();
    return HostLossFn([t, n, scale](const float* y, float* g) {
      double sum = 0;
      for (std::uint64_t i = 0; i < n; ++i) {
        const float d = y[i] - t[i];
        sum += 0.5 * static_cast<double>(d) * d;
        g[i] = d * scale;
      }
      return sum * scale;
    });
  };
  const auto t0 = st.target(0), t1 = st.target(1), t2 = st.target(2);
  auto run = [&](Plan plan, int k, bool zero_rest) {
    plan.micro_batches = k;
    LayerExecutorOptions opt;
    opt.adamw.lr = 1e-2f;
    HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, opt);
    for (int s = 0; s < 2; ++s) {
      std::vector<std::vector<float>> in;
      std::vector<HostLossFn> losses;
      const std::vector<const std::vector<float>*> targets{&t0, &t1, &t2};
      for (int i = 0; i < k; ++i) {
        in.push_back(st.input(10 * s + i));
        losses.push_back(mse(*targets[static_cast<std::size_t>(i)], zero_rest && i > 0 ? 0.0f : 1.0f / static_cast<float>(k)));
      }
      if (zero_rest) losses[0] = mse(t0, 1.0f);
      (void)exec.step(in, losses);
    }
    return exec.master();
  };
  const Plan reference = resident_plan(layers, st.c.tokens);
  std::mt19937_64 rng(17);
  for (int k : {2, 3}) {
    CAPTURE(k);
    const auto expect = run(reference, k, false);
    for (int i = 0; i < 5; ++i) CHECK(bitwise_equal(run(random_plan(layers, st.c.tokens, rng), k, false), expect));
    CHECK_FALSE(bitwise_equal(expect, run(reference, 1, false)));
  }
  // Micro-batch 0 alone vs micro-batch 0 plus micro-batches whose gradients are exactly zero.
  const auto one = run(reference, 1, true);
  CHECK(bitwise_equal(run(reference, 3, true), one));
  CHECK(bitwise_equal(run(random_plan(layers, st.c.tokens, rng), 3, true), one));
}

TEST_CASE("layer progress: every layer's forward, then every layer's backward in reverse, once a step") {
  const Stack st({16, 4, 2, 16, 12, 3}, 8);
  auto layers = st.layers;
  Plan plan = resident_plan(layers, st.c.tokens);
  HostBackend backend({1_GiB, 1_GiB, true});
  HostExecutor<test::MoeMlpLayer> exec(backend, layers, plan, st.init, {});
  std::vector<LayerProgress> seen;
  exec.on_layer([&](const LayerProgress& p) { seen.push_back(p); });
  (void)exec.step(st.input(0), st.target(0));
  const int n = static_cast<int>(layers.size());
  REQUIRE(seen.size() == static_cast<std::size_t>(2 * n));
  for (int i = 0; i < 2 * n; ++i) {
    CAPTURE(i);
    const auto& p = seen[static_cast<std::size_t>(i)];
    CHECK(p.backward == (i >= n));
    CHECK(p.layer == (i < n ? i : 2 * n - 1 - i));
    CHECK(p.layers == n);
    CHECK(p.micro_batch == 0);
  }
  exec.on_layer({});  // removed: no more calls
  (void)exec.step(st.input(1), st.target(1));
  CHECK(seen.size() == static_cast<std::size_t>(2 * n));
}

TEST_CASE("the CPU AdamW's thread count changes no bit") {
  // Experts of 3 x 64 x 128 = 24,576 parameters: two of the AdamW's 16,384-element tiles each, so
  // four threads do split a segment.
  const Case c{64, 2, 1, 128, 8, 2};
  const std::vector<test::MoeMlpLayer> shape = layers_of(c);
  Plan streamed = resident_plan(shape, c.tokens);
  streamed.resident_segments.clear();  // every segment updated by the CPU AdamW
  LayerExecutorOptions one, four;
  one.cpu_threads = 1;
  four.cpu_threads = 4;
  const Result a = train(c, streamed, 11, one), b = train(c, streamed, 11, four);
  CHECK(a.losses == b.losses);
  CHECK(bitwise_equal(a.master, b.master));
}

namespace {

// y = 2x (dx = 2 dy), four parameters that get no gradient, a workset of 3 floats a token; it
// fills the workspace it is handed and logs what it got, call by call.
template <bool Uses>
struct ScratchLayer {
  static constexpr bool uses_workspace = Uses;
  std::vector<StateSegment> segs{{"scratch", SegmentRole::dense_mlp, 0, -1, {{"scratch.w", {4}}}}};
  std::shared_ptr<std::vector<std::pair<bool, std::uint64_t>>> log = std::make_shared<std::vector<std::pair<bool, std::uint64_t>>>();

  const std::vector<StateSegment>& segments() const { return segs; }
  LayerCost cost(const Workload& w) const {
    LayerCost c;
    c.workset = Bytes{w.tokens() * 3 * sizeof(float)};
    c.output = Bytes{w.tokens() * 4 * sizeof(float)};
    return c;
  }
  ChunkDependency chunking() const { return ChunkDependency::independent; }
  std::uint64_t hidden() const { return 4; }
  std::uint64_t saved_floats(ActivationClass, std::uint64_t) const { return 0; }
  void record(const LayerContext& ctx) const {
    log->emplace_back(ctx.workspace != nullptr, ctx.workspace_bytes);
    if (ctx.workspace != nullptr) std::memset(ctx.workspace, 0x7f, ctx.workspace_bytes);  // all of it is ours
  }
  void forward(LayerContext& ctx) const {
    record(ctx);
    for (std::uint64_t i = ctx.begin * 4; i < ctx.end * 4; ++i) ctx.output[i] = 2 * ctx.input[i];
  }
  void backward(LayerContext& ctx) const {
    record(ctx);
    for (std::uint64_t i = ctx.begin * 4; i < ctx.end * 4; ++i) ctx.grad_input[i] = 2 * ctx.grad_output[i];
  }
};

struct ScratchStep {
  std::vector<std::pair<bool, std::uint64_t>> log;  ///< (handed a workspace, its bytes), call by call
  bool balanced = false;                            ///< the arena held after the step what it held before
};

// One step of two ScratchLayers over 10 tokens in chunks of 3.
template <bool Uses>
ScratchStep scratch_step(Bytes device_budget = 1_MiB) {
  std::vector<ScratchLayer<Uses>> layers(2);
  Plan p = test::resident_plan(layers, 10);
  for (auto& c : p.chunks) c.moe_tokens = 3;
  HostBackend backend({device_budget, 1_MiB, true});
  ScratchStep r;
  {
    HostExecutor<ScratchLayer<Uses>> exec(backend, layers, p, {std::vector<float>(4, 0.5f), std::vector<float>(4, 0.5f)});
    const Bytes held = backend.device_arena().in_use();
    (void)exec.step(std::vector<float>(40, 1.0f), std::vector<float>(40, 0.0f));
    r.balanced = backend.device_arena().in_use() == held;  // the workspaces went back
  }
  r.log = *layers[0].log;
  r.log.insert(r.log.end(), layers[1].log->begin(), layers[1].log->end());
  return r;
}

}  // namespace

TEST_CASE("a layer that asks for its workset gets a chunk's share of it, every call, given back after the pass; one that does not, none") {
  const ScratchStep uses = scratch_step<true>(), plain = scratch_step<false>();
  const auto& with = uses.log;
  const auto& without = plain.log;
  // 2 layers x (forward + backward) x 4 chunks (3, 3, 3, 1 tokens).
  REQUIRE(with.size() == 16);
  REQUIRE(without.size() == 16);
  const std::uint64_t share = chunk_workset(Bytes{10 * 3 * sizeof(float)}, 10, 3).count();
  CHECK(share == 36);
  for (const auto& [given, bytes] : with) {
    CHECK(given);
    CHECK(bytes == share);
  }
  for (const auto& [given, bytes] : without) {
    CHECK_FALSE(given);
    CHECK(bytes == 0);
  }
  CHECK(uses.balanced);
  CHECK(plain.balanced);
  // In a device arena of exactly what the step needs at its fullest (layer 1's backward: the two
  // layers' resident state, 4 x 18 bytes each, and four buffers of 10 x 4 floats: two boundaries,
  // the incoming and the outgoing gradient), plus one share: the workspace is counted in the
  // budget (a byte less is refused), and one pass's is given back before the next takes its own
  // (held longer, two or more would be live there).
  const Bytes need{2 * 4 * 18 + 4 * 10 * 4 * sizeof(float)};
  CHECK_NOTHROW((void)scratch_step<false>(need));
  CHECK_NOTHROW((void)scratch_step<true>(need + Bytes{share}));
  CHECK_THROWS_AS((void)scratch_step<true>(need + Bytes{share - 1}), Error);
}


namespace {

// y = 2x, with one segment of `n` parameters (no gradient) that may be streamed; it logs where
// its weights were, pass by pass: the address modulo 256 and whether the pass regenerated.
struct OddLayer {
  std::vector<StateSegment> segs;
  std::shared_ptr<std::vector<std::pair<std::uintptr_t, bool>>> log = std::make_shared<std::vector<std::pair<std::uintptr_t, bool>>>();

  OddLayer(int l, std::uint64_t n) : segs{{fmt::format("odd.{}", l), SegmentRole::dense_mlp, l, -1, {{fmt::format("odd.{}.w", l), {n}}}}} {}
  const std::vector<StateSegment>& segments() const { return segs; }
  LayerCost cost(const Workload& w) const {
    LayerCost c;
    c.output = Bytes{w.tokens() * 4 * sizeof(float)};
    return c;
  }
  ChunkDependency chunking() const { return ChunkDependency::independent; }
  std::uint64_t hidden() const { return 4; }
  std::uint64_t saved_floats(ActivationClass, std::uint64_t) const { return 0; }
  void forward(LayerContext& ctx) const {
    log->emplace_back(reinterpret_cast<std::uintptr_t>(ctx.weights[0].data()) % streamed_weight_alignment, ctx.regenerating);
    for (std::uint64_t i = ctx.begin * 4; i < ctx.end * 4; ++i) ctx.output[i] = 2 * ctx.input[i];
  }
  void backward(LayerContext& ctx) const {
    log->emplace_back(reinterpret_cast<std::uintptr_t>(ctx.weights[0].data()) % streamed_weight_alignment, false);
    for (std::uint64_t i = ctx.begin * 4; i < ctx.end * 4; ++i) ctx.grad_input[i] = 2 * ctx.grad_output[i];
  }
};

}  // namespace

TEST_CASE("a regeneration sees each layer's streamed weights 256-byte aligned, as its forward did, whatever the layers below hold") {
  // Four streamed layers of 5, 7, 130 and 3 parameters (no multiple of 128 bf16s), layers 1-3's
  // boundaries regenerated from layer 0's: the backward of layer 3 reruns layers 0-2 with their
  // weights packed in one workset, where layer 1's would start 10 bytes in if packed tight.
  std::vector<OddLayer> layers;
  for (const std::uint64_t n : {5, 7, 130, 3}) layers.emplace_back(static_cast<int>(layers.size()), n);
  Plan p = test::resident_plan(layers, 6);
  p.resident_segments.clear();
  p.prefetch_depth = 1;
  for (std::size_t l = 1; l < layers.size(); ++l)
    p.retention[l][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::recompute(0);
  std::vector<std::vector<float>> init;
  for (const auto& l : layers) init.emplace_back(l.segs[0].parameters(), 0.25f);
  HostBackend backend({1_MiB, 1_MiB, true});
  {
    HostExecutor<OddLayer> exec(backend, layers, p, init);
    (void)exec.step(std::vector<float>(24, 1.0f), std::vector<float>(24, 0.0f));
  }
  int regenerated = 0;
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (const auto& [misalignment, regenerating] : *layers[l].log) {
      CAPTURE(l);
      CAPTURE(regenerating);
      CHECK(misalignment == 0);
      regenerated += regenerating ? 1 : 0;
    }
  CHECK(regenerated == 3);  // layers 0, 1, 2 rerun once, for layer 3's backward
}

namespace {
// OddLayer of another width, running whole: y = 2x over `h` features.
struct WholeLayer {
  std::vector<StateSegment> segs;
  std::uint64_t h;
  WholeLayer(int l, std::uint64_t h) : segs{{fmt::format("whole.{}", l), SegmentRole::dense_mlp, l, -1, {{fmt::format("whole.{}.w", l), {3}}}}}, h(h) {}
  const std::vector<StateSegment>& segments() const { return segs; }
  LayerCost cost(const Workload& w) const {
    LayerCost c;
    c.output = Bytes{w.tokens() * h * sizeof(float)};
    return c;
  }
  std::uint64_t hidden() const { return h; }  // no chunking(): ChunkDependency::none, runs whole
  std::uint64_t saved_floats(ActivationClass, std::uint64_t) const { return 0; }
  void forward(LayerContext& ctx) const {
    for (std::uint64_t i = ctx.begin * h; i < ctx.end * h; ++i) ctx.output[i] = 2 * ctx.input[i];
  }
  void backward(LayerContext& ctx) const {
    for (std::uint64_t i = ctx.begin * h; i < ctx.end * h; ++i) ctx.grad_input[i] = 2 * ctx.grad_output[i];
  }
};
/// WholeLayer whose segments() answers by value, as describable_layer allows.
struct ByValueLayer : WholeLayer {
  using WholeLayer::WholeLayer;
  std::vector<StateSegment> segments() const { return segs; }
};
}  // namespace

TEST_CASE("a layer whose segments() answers by value runs a plan that names its stack, and is refused another's") {
  HostBackend backend({1_MiB, 1_MiB, true});
  std::vector<ByValueLayer> layers{ByValueLayer(0, 4), ByValueLayer(1, 4)};
  Plan plan = test::resident_plan(layers, 6);
  plan.layers_fingerprint = layer_stack_fingerprint({layers[0].segments(), layers[1].segments()});
  const std::vector<std::vector<float>> init(2, std::vector<float>(3, 0.25f));
  HostExecutor<ByValueLayer> exec(backend, layers, plan, init);
  CHECK(std::isfinite(exec.step(std::vector<float>(24, 1.0f), std::vector<float>(24, 0.0f))));
  std::vector<ByValueLayer> others{ByValueLayer(0, 4), ByValueLayer(5, 4)};
  CHECK_THROWS_WITH_AS(HostExecutor<ByValueLayer>(backend, others, plan, init), doctest::Contains("made for another layer stack"), Error);
}

TEST_CASE("an executor refuses, when made, a stack or a plan it would misread; it keeps its own copy of the plan") {
  HostBackend backend({1_MiB, 1_MiB, true});
  const auto init_of = [](const auto& layers) {
    std::vector<std::vector<float>> init;
    init.assign(layers.size(), std::vector<float>(3, 0.25f));
    return init;
  };
  std::vector<WholeLayer> layers{WholeLayer(0, 4), WholeLayer(1, 4)};
  const Plan plan = test::resident_plan(layers, 6);
  {
    std::vector<WholeLayer> mixed{WholeLayer(0, 4), WholeLayer(1, 8)};  // layer 1 would read 8-wide rows of a 4-wide boundary
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, mixed, plan, init_of(mixed)),
                         doctest::Contains("layer 1 has hidden size 8, layer 0 4"), Error);
  }
  {
    std::vector<WholeLayer> none;
    Plan empty = plan;
    empty.retention.clear();
    empty.chunks.clear();
    empty.resident_segments.clear();
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, none, empty, {}), doctest::Contains("at least one layer"), Error);
  }
  {
    Plan fp16 = plan;  // moments it does not keep: the plan's bytes would not be what it holds
    fp16.precision.moments = DType::fp16;
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, fp16, init_of(layers)),
                         doctest::Contains("layer executor: precision.moments is fp16; it keeps fp32 or bf16 moments"), Error);
  }
  {
    Plan chunked = plan;
    chunked.chunks[1].moe_tokens = 2;  // a layer that runs whole, cut in three
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, chunked, init_of(layers)),
                         doctest::Contains("layer 1 runs whole"), Error);
    chunked.chunks[1].moe_tokens = 0;  // which the executor would run a token at a time
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, chunked, init_of(layers)),
                         doctest::Contains("plan, layer 1: a chunk of 0 tokens"), Error);
  }
  {
    // Counts out of range, as the planners and the plan reader refuse them: each had run, a
    // prefetch depth of 0 with one slot and one of 10^6 taking that many, a chunkable layer's
    // chunk of 0 tokens a token at a time.
    Plan counts = plan;
    counts.prefetch_depth = 0;
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, counts, init_of(layers)),
                         doctest::Contains("plan: prefetch_depth 0 (1 to 64) is out of range"), Error);
    counts.prefetch_depth = 1000000;
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, counts, init_of(layers)),
                         doctest::Contains("plan: prefetch_depth 1000000 (1 to 64) is out of range"), Error);
    const Stack st({8, 2, 1, 8, 6, 2}, 3);
    auto moe = st.layers;
    Plan zero = resident_plan(moe, st.c.tokens);
    zero.chunks[1].moe_tokens = 0;
    CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(backend, moe, zero, st.init),
                         doctest::Contains("plan, layer 1: a chunk of 0 tokens"), Error);
  }
  {
    // A micro-batch of no tokens, and one past the limit whose count wraps to none: each had run,
    // every step's loss a mean over no tokens (NaN) and the step skipped.
    Plan none = plan;
    none.workload = {1, 0};
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, none, init_of(layers)),
                         doctest::Contains("the plan's micro-batch has 1 sequences of 0 tokens (needs at least 1 of 1)"), Error);
    none.workload = {0, 6};
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, none, init_of(layers)),
                         doctest::Contains("the plan's micro-batch has 0 sequences of 6 tokens"), Error);
    none.workload = {std::uint64_t{1} << 33, std::uint64_t{1} << 31};  // 2^64 tokens: 0 in 64 bits
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, none, init_of(layers)),
                         doctest::Contains("more than the 4294967296 tokens a micro-batch may hold"), Error);
  }
  {
    // More initial weights than the stack has segments: the caller's weights do not belong to
    // these layers (had been taken as the first ones, the rest ignored).
    auto extra = init_of(layers);
    extra.emplace_back(3, 0.25f);
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, plan, extra),
                         doctest::Contains("3 initial weight vectors for the layers' 2 segments"), Error);
    // One fewer: named as a count too (had been "initial weights of segment 1 (...): 0 values for
    // 3 parameters", a segment the caller had no vector for).
    auto short_by_one = init_of(layers);
    short_by_one.pop_back();
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, plan, short_by_one),
                         doctest::Contains("1 initial weight vectors for the layers' 2 segments"), Error);
  }
  {
    // A NaN or infinite initial weight: named with its segment (had been taken, every step's loss
    // NaN and skipped).
    auto nan = init_of(layers);
    nan[1][2] = std::numeric_limits<float>::quiet_NaN();
    const std::string nan_named = "initial weights of segment 1 ('" + layers[1].segments()[0].name + "'): value 2 of 3 is nan";
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, plan, nan), doctest::Contains(nan_named.c_str()), Error);
    auto inf = init_of(layers);
    inf[0][0] = -std::numeric_limits<float>::infinity();
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, plan, inf), doctest::Contains("value 0 of 3 is -inf"), Error);
  }
  {
    // A plan priced for clipping by the global norm, the executor updating as gradients land: the
    // steps had run unclipped, nothing said.
    Plan clipped = plan;
    clipped.clip_grad_norm = true;
    CHECK_THROWS_WITH_AS(HostExecutor<WholeLayer>(backend, layers, clipped, init_of(layers)),
                         doctest::Contains("the plan clips gradients by their global norm (PlanRequest::clip_grad_norm), which needs "
                                           "LayerExecutorOptions::defer_updates"),
                         Error);
    LayerExecutorOptions deferring;
    deferring.defer_updates = true;
    CHECK_NOTHROW(HostExecutor<WholeLayer>(backend, layers, clipped, init_of(layers), deferring));
  }
  CHECK(backend.device_arena().in_use() == 0_B);
  // The plan is the executor's: the caller's may change or go.
  Plan mine = plan;
  HostExecutor<WholeLayer> exec(backend, layers, mine, init_of(layers));
  mine.workload.seq_len *= 2;
  mine.retention.clear();
  CHECK_NOTHROW((void)exec.step(std::vector<float>(24, 1.0f), std::vector<float>(24, 0.0f)));
  // Wrong sizes name what came: the targets as the inputs do, the optimizer state with the count.
  CHECK_THROWS_WITH_AS((void)exec.step(std::vector<float>(24, 1.0f), std::vector<float>(23, 0.0f)),
                       doctest::Contains("step needs (T, H) = (6, 4) targets, got 23 values"), Error);
  std::vector<SegmentOptimizerState> state(1);
  CHECK_THROWS_WITH_AS(exec.load_optimizer_state(state, 0), doctest::Contains("optimizer state holds 1 segments, the layers 2"), Error);
}

TEST_CASE("a stack that changed its layer count after the executor was made is refused by step(), not read past its state") {
  // The layers are held by reference: a layer added to the caller's vector had the step index
  // the executor's per-layer state past its end (a crash in load_weights).
  HostBackend backend({1_MiB, 1_MiB, true});
  std::vector<WholeLayer> layers{WholeLayer(0, 4), WholeLayer(1, 4)};
  const Plan plan = test::resident_plan(layers, 6);
  HostExecutor<WholeLayer> exec(backend, layers, plan, {std::vector<float>(3, 0.25f), std::vector<float>(3, 0.25f)});
  const Bytes held = backend.device_arena().in_use();
  layers.emplace_back(2, 4);
  CHECK_THROWS_WITH_AS((void)exec.step(std::vector<float>(24, 1.0f), std::vector<float>(24, 0.0f)),
                       doctest::Contains("the stack has 3 layers, the executor was made for 2"), Error);
  CHECK(backend.device_arena().in_use() == held);
  layers.pop_back();
  CHECK_NOTHROW((void)exec.step(std::vector<float>(24, 1.0f), std::vector<float>(24, 0.0f)));
}

namespace {
// y = 2x over `h` features, saving x (ActivationClass::other) for nothing; what it declares
// (cost(): its output as `declared_h` wide, `declared_saved` floats a token of class other) and
// what it tells the executor (hidden(), saved_floats(): `saved` floats a token, which may change
// once the executor is made) are set apart, to disagree.
struct DeclaringLayer {
  std::vector<StateSegment> segs;
  std::string nm;
  std::uint64_t h = 4, declared_h = 4, declared_saved = 4;
  std::shared_ptr<std::uint64_t> saved = std::make_shared<std::uint64_t>(4);
  explicit DeclaringLayer(int l) : segs{{fmt::format("decl.{}", l), SegmentRole::dense_mlp, l, -1, {{fmt::format("decl.{}.w", l), {3}}}}},
                                   nm(fmt::format("decl.{}", l)) {}
  const std::vector<StateSegment>& segments() const { return segs; }
  LayerCost cost(const Workload& w) const {
    LayerCost c;
    if (declared_saved > 0) c.activations.push_back({ActivationClass::other, Bytes{w.tokens() * declared_saved * sizeof(float)}, 0});
    c.output = Bytes{w.tokens() * declared_h * sizeof(float)};
    return c;
  }
  std::string name() const { return nm; }
  std::uint64_t hidden() const { return h; }
  std::uint64_t saved_floats(ActivationClass c, std::uint64_t t) const { return c == ActivationClass::other ? t * *saved : 0; }
  void forward(LayerContext& ctx) const {
    float* keep = ctx.saved[static_cast<std::size_t>(ActivationClass::other)];
    for (std::uint64_t i = ctx.begin * h; i < ctx.end * h; ++i) {
      if (ctx.output != nullptr) ctx.output[i] = 2 * ctx.input[i];
      if (keep != nullptr) keep[i] = ctx.input[i];
    }
  }
  void backward(LayerContext& ctx) const {
    for (std::uint64_t i = ctx.begin * h; i < ctx.end * h; ++i) ctx.grad_input[i] = 2 * ctx.grad_output[i];
  }
};
}  // namespace

TEST_CASE("an executor refuses a layer whose cost() disagrees with its hidden() or saved_floats(), naming the layer and both sizes") {
  // The plan counts what cost() declares; the executor holds a boundary of hidden() x T fp32 and
  // saved_floats() fp32 a class. Each disagreement had been taken: a class saved but not declared
  // ran out of a budget of the plan's prediction naming no layer ("retained_activations asks for
  // ..."), a hidden() of 0 had the layer write its rows past (T, 0) boundaries (free(): invalid
  // next size).
  HostBackend backend({1_MiB, 1_MiB, true});
  const std::vector<std::vector<float>> init(2, std::vector<float>(3, 0.25f));
  const auto stack = [] { return std::vector<DeclaringLayer>{DeclaringLayer(0), DeclaringLayer(1)}; };
  auto good = stack();
  const Plan plan = test::resident_plan(good, 6);
  {
    auto layers = stack();
    layers[1].declared_saved = 0;  // saves 4 floats a token of class other, declares none
    CHECK_THROWS_WITH_AS(HostExecutor<DeclaringLayer>(backend, layers, plan, init),
                         doctest::Contains("layer 1 ('decl.1'): saved_floats(other, 6 tokens) is 24 floats, its cost() declares 0 "
                                           "bytes of other activations"), Error);
    layers[1].declared_saved = 8;  // declares twice what it saves
    CHECK_THROWS_WITH_AS(HostExecutor<DeclaringLayer>(backend, layers, plan, init),
                         doctest::Contains("saved_floats(other, 6 tokens) is 24 floats, its cost() declares 192 bytes"), Error);
  }
  {
    auto layers = stack();
    layers[0].declared_h = 2;  // a boundary of half its real size
    CHECK_THROWS_WITH_AS(HostExecutor<DeclaringLayer>(backend, layers, plan, init),
                         doctest::Contains("layer 0 ('decl.0'), cost for 1 x 6 tokens: LayerCost::output is 48 bytes where hidden() 4 x "
                                           "6 tokens x 4 bytes (fp32) = 96 were expected"), Error);
  }
  {
    auto layers = stack();
    for (auto& l : layers) l.h = 0;  // cost() declares 4 wide
    CHECK_THROWS_WITH_AS(HostExecutor<DeclaringLayer>(backend, layers, plan, init),
                         doctest::Contains("layer 0 ('decl.0'): hidden() is 0"), Error);
  }
  CHECK(backend.device_arena().in_use() == 0_B);
  // What a layer answers is read again at each step, before anything is taken for it: one that
  // changed since the executor was made is refused by name, and the executor runs on once it is back.
  HostExecutor<DeclaringLayer> exec(backend, good, plan, init);
  const Bytes held = backend.device_arena().in_use();
  const std::vector<float> x(24, 1.0f), y(24, 0.0f);
  CHECK_NOTHROW((void)exec.step(x, y));
  *good[1].saved = 8;
  CHECK_THROWS_WITH_AS((void)exec.step(x, y),
                       doctest::Contains("step(): layer 1 ('decl.1'): saved_floats(other, 6 tokens) is 48 floats, its cost() declares "
                                         "96 bytes of other activations"), Error);
  CHECK(backend.device_arena().in_use() == held);
  *good[1].saved = 4;
  good[1].h = 8;
  CHECK_THROWS_WITH_AS((void)exec.step(x, y), doctest::Contains("step(): layer 1 ('decl.1') has hidden size 8, 4 when the executor was made"),
                       Error);
  CHECK(backend.device_arena().in_use() == held);
  good[1].h = 4;
  CHECK_NOTHROW((void)exec.step(x, y));
}

TEST_CASE("write_step_traces: both timelines written, busy seconds side by side; an empty timeline writes nothing") {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("oom-step-traces-{}", ::getpid());
  std::filesystem::create_directories(dir);
  StepGraph graph;
  const int up = graph.add({"h2d.weights", Resource::h2d, 0.5, {}, 0});
  graph.add({"fwd", Resource::gpu_compute, 1.0, {up}, 0});
  Timeline measured;
  measured.add("h2d weights layer 0", Resource::h2d, 0.0, 0.25);
  measured.add("fwd layer 0", Resource::gpu_compute, 0.25, 2.0);
  const std::string line = write_step_traces(dir / "t.json", "step 7", "test step", measured, 2.0, graph);
  MESSAGE(line);
  CHECK(line.starts_with("step 7 recorded in "));
  CHECK(line.find("(2 spans; the prediction's in ") != std::string::npos);
  CHECK(line.find("gpu_compute 1.75 / 1, h2d 0.25 / 0.5;") != std::string::npos);  // d2h, cpu, network idle in both: left out
  CHECK(line.ends_with("; step 2 / 1.5"));
  for (const char* name : {"t.json", "t.predicted.json"}) {
    const Json doc = read_json_file(dir / name);
    const Json* events = doc.find("traceEvents");
    REQUIRE(events != nullptr);
    CHECK(events->size() >= 2);
  }
  Timeline lost;
  const std::string none = write_step_traces(dir / "none.json", "step 8", "lost", lost, 1.0, graph);
  CHECK(none.empty());  // and a warning on stderr
  CHECK_FALSE(std::filesystem::exists(dir / "none.json"));
  CHECK_FALSE(std::filesystem::exists(dir / "none.predicted.json"));
  std::filesystem::remove_all(dir);
}


TEST_CASE("a layer with a segment of no parameters trains as the same layer without it, its segments resident, streamed or both") {
  constexpr int count = 3;
  constexpr std::uint64_t h = 8, inter = 12, t = 10;
  using WithEmpty = test::WithEmptySegment<examples::ResidualMlp>;
  std::vector<examples::ResidualMlp> plain;
  std::vector<WithEmpty> with;
  std::vector<std::vector<float>> plain_init, with_init;
  for (int l = 0; l < count; ++l) {
    plain.emplace_back(l, h, inter);
    with.emplace_back(l, h, inter);
    plain_init.push_back(test::random_normal(2 * h * inter, 70 + static_cast<std::uint64_t>(l), 0.2f));
    with_init.emplace_back();
    with_init.push_back(plain_init.back());
  }
  const auto input = test::random_normal(t * h, 1, 1.0f), target = test::random_normal(t * h, 2, 1.0f);
  // Three steps; the losses and the master weights of the segments with parameters.
  const auto train = [&](auto& layers, const Plan& p, const std::vector<std::vector<float>>& init) {
    HostBackend backend({1_MiB, 1_MiB, true});
    HostExecutor<typename std::decay_t<decltype(layers)>::value_type> exec(backend, layers, p, init);
    std::vector<double> losses;
    for (int s = 0; s < 3; ++s) losses.push_back(exec.step(input, target));
    std::vector<std::vector<float>> master;
    for (auto& m : exec.master())
      if (!m.empty()) master.push_back(std::move(m));
    return std::pair{losses, master};
  };
  const auto expect = train(plain, test::resident_plan(plain, t), plain_init);
  CHECK(expect.first[2] < expect.first[0]);  // it trains
  for (int placement = 0; placement < 3; ++placement) {
    CAPTURE(placement);  // 0: all resident, 1: all streamed, 2: the empty segments resident, the others streamed
    Plan p = test::resident_plan(with, t);
    if (placement > 0) p.resident_segments.clear();
    if (placement == 2)
      for (const auto& l : with) p.resident_segments.push_back(l.segments().front().name);
    const auto got = train(with, p, with_init);
    CHECK(got.first == expect.first);
    CHECK(bitwise_equal(got.second, expect.second));
  }
}
