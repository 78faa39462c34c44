// LayerStackPlanner: a plan for a stack of the user's own layers, from what they declare. The
// plans fit their budgets, move what the budget does not hold (streaming, offloading,
// recomputing, chunking), run on the HostExecutor to the resident plan's weights bit for bit, and
// bad stacks or budgets are refused by name.
#include <doctest/doctest.h>

#include <array>
#include <deque>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/plan/layer_stack_planner.hpp"
#include "oom/runtime/host_executor.hpp"
#include "runtime/moe_mlp_layer.hpp"
#include "support/same_step.hpp"
#include "support/compare.hpp"

using namespace oom;
using namespace oom::literals;
using oom::test::any_retention;
using oom::test::bitwise_equal;

namespace {

constexpr std::uint64_t hidden = 16, experts = 4, top_k = 2, inter = 8, tokens = 24;

/// The same layer, declared chunkable by tokens (its tokens are independent).
struct ChunkedMoe : test::MoeMlpLayer {
  using MoeMlpLayer::MoeMlpLayer;
  ChunkDependency chunking() const { return ChunkDependency::independent; }
};
static_assert(executor_layer<ChunkedMoe>);

/// The same layer, declared not recomputable (as one with dropout whose mask is not replayed).
struct NoRecompute : test::MoeMlpLayer {
  using MoeMlpLayer::MoeMlpLayer;
  static constexpr bool recomputable = false;
};
static_assert(executor_layer<NoRecompute>);

template <class L>
std::vector<L> stack(int n, std::uint64_t h = hidden, std::uint64_t e = experts, std::uint64_t i = inter) {
  std::vector<L> layers;
  for (int l = 0; l < n; ++l) layers.emplace_back(l, h, e, top_k, i);
  return layers;
}

PlanRequest request(Bytes gpu, Bytes host = 1_GiB, std::uint64_t t = tokens) {
  PlanRequest r;
  r.gpu_budget = gpu;
  r.host_budget = host;
  r.workload = {1, t};
  return r;
}

std::size_t segment_count(const std::vector<LayerDescription>& d) {
  std::size_t n = 0;
  for (const auto& l : d) n += l.segments.size();
  return n;
}

/// Weights after 3 steps of `plan` (micro-batches as the plan has them). A planned plan runs with
/// no more device and pinned memory than it predicts: the arenas are exactly its figures, and
/// the backend refuses any byte past them.
template <class L>
std::vector<std::vector<float>> train(std::vector<L>& layers, const Plan& plan) {
  std::vector<std::vector<float>> init;
  std::uint64_t s = 7;
  for (const auto& l : layers)
    for (const auto& seg : l.segments()) init.push_back(test::random_normal(seg.parameters(), ++s, 0.3f));
  const bool planned = plan.predicted.gpu_peak.count() > 0;
  HostBackend backend({planned ? plan.predicted.gpu_peak : 1_GiB, planned ? plan.predicted.host_peak : 1_GiB, true});
  LayerExecutorOptions o;
  o.adamw.lr = 1e-2f;
  HostExecutor<L> exec(backend, layers, plan, init, o);
  for (std::uint64_t step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> x;
    std::vector<HostLossFn> losses;
    std::vector<std::vector<float>> targets;
    for (int mb = 0; mb < plan.micro_batches; ++mb) {
      x.push_back(test::random_normal(tokens * hidden, 100 * step + static_cast<std::uint64_t>(mb)));
      targets.push_back(test::random_normal(tokens * hidden, 100 * step + 50 + static_cast<std::uint64_t>(mb)));
    }
    for (int mb = 0; mb < plan.micro_batches; ++mb) {
      const float* tgt = targets[static_cast<std::size_t>(mb)].data();
      const double k = plan.micro_batches;
      losses.push_back([tgt, k](const float* y, float* g) {
        double sum = 0;
        for (std::uint64_t i = 0; i < tokens * hidden; ++i) {
          const float d = y[i] - tgt[i];
          sum += 0.5 * static_cast<double>(d) * d;
          g[i] = d / static_cast<float>(tokens * k);
        }
        return sum / (static_cast<double>(tokens) * k);
      });
    }
    exec.step(x, losses);
  }
  return exec.master();
}

std::string thrown(const std::function<void()>& f, Errc* code = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
  return "(nothing thrown)";
}

}  // namespace

template <class R>
concept describes = requires(R&& r) { describe_layers(std::forward<R>(r)); };
// A temporary container is refused: each description's cost points into its layers, and
// `LayerStackPlanner p(describe_layers(make_layers()), profile)` had read freed memory. A
// temporary view of layers that live on is taken.
static_assert(describes<std::vector<ChunkedMoe>&>);
static_assert(describes<const std::vector<ChunkedMoe>&>);
static_assert(!describes<std::vector<ChunkedMoe>>);
static_assert(!describes<const std::vector<ChunkedMoe>>);
static_assert(describes<std::span<const ChunkedMoe>>);

TEST_CASE("describe_layers reads a describable layer's name, segments, cost per workload and traits") {
  const auto layers = stack<ChunkedMoe>(2);
  const auto d = describe_layers(layers);
  REQUIRE(d.size() == 2);
  CHECK(d[1].name == "layer 1");
  CHECK(d[1].segments == layers[1].segments());
  CHECK(d[0].chunking == ChunkDependency::independent);
  CHECK(d[0].recomputable);
  const auto fixed = stack<NoRecompute>(1);
  CHECK_FALSE(describe_layers(fixed)[0].recomputable);
  const LayerCost at8 = d[0].cost({1, 8}), at16 = d[0].cost({2, 8});
  CHECK(at16.forward_flops == doctest::Approx(2 * at8.forward_flops));
  CHECK(at16.activation_bytes() == 2 * at8.activation_bytes());
}

TEST_CASE("descriptions of a vector's layers follow the vector as it grows, and name a layer removed from it") {
  // A user's growing the vector after describing its first layers had moved the layers from under
  // the descriptions: the planner read freed memory and asked for petabytes.
  auto layers = stack<ChunkedMoe>(1);
  const auto d = describe_layers(layers);
  const LayerCost before = d[0].cost({1, 8});
  for (int l = 1; l < 40; ++l) layers.emplace_back(l, hidden, experts, top_k, inter);  // reallocates
  const LayerCost after = d[0].cost({1, 8});
  CHECK(after.forward_flops == before.forward_flops);
  CHECK(after.activation_bytes() == before.activation_bytes());
  const MachineProfile profile = MachineProfile::h200(1);
  const auto one = std::vector<ChunkedMoe>(layers.begin(), layers.begin() + 1);
  const auto fresh = LayerStackPlanner(describe_layers(one), profile).plan(request(1_GiB));
  const auto grown = LayerStackPlanner(d, profile).plan(request(1_GiB));
  CHECK(grown.plans.front().predicted.gpu_peak == fresh.plans.front().predicted.gpu_peak);
  const auto two = describe_layers(layers);
  layers.erase(layers.begin() + 1, layers.end());
  Errc code{};
  CHECK(thrown([&] { (void)two[1].cost({1, 8}); }, &code).find("describe_layers: layer 1 ('layer 1') is no longer in its container, "
                                                                "which holds 1 layers now") != std::string::npos);
  CHECK(code == Errc::invalid_argument);
  // A span's descriptions still reach each layer where it is.
  const std::span<const ChunkedMoe> view(layers);
  CHECK(describe_layers(view)[0].cost({1, 8}).forward_flops == before.forward_flops);
  // A layer removed before another: the later one's description names itself, not the cost of the
  // layer that moved into its place.
  auto three = stack<ChunkedMoe>(3);
  const auto d3 = describe_layers(three);
  three.erase(three.begin());
  CHECK(thrown([&] { (void)d3[0].cost({1, 8}); }).find("describe_layers: layer 0 ('layer 0') is not the layer at that index of its "
                                                       "container any more") != std::string::npos);
  // The container moved: its descriptions say so (the moved-from vector is empty).
  auto kept = stack<ChunkedMoe>(2);
  const auto dk = describe_layers(kept);
  const auto moved = std::move(kept);
  CHECK(thrown([&] { (void)dk[1].cost({1, 8}); }).find("which holds 0 layers now: describe the layers again after removing, inserting "
                                                       "or moving any") != std::string::npos);
  CHECK(moved.size() == 2);
  // A deque keeps its layers where they are as it grows at either end: reached by address.
  std::deque<ChunkedMoe> dq;
  dq.emplace_back(0, hidden, experts, top_k, inter);
  const auto dd = describe_layers(dq);
  const double flops = dd[0].cost({1, 8}).forward_flops;
  dq.emplace_front(7, 2 * hidden, experts, top_k, inter);  // a wider layer in front
  CHECK(dd[0].cost({1, 8}).forward_flops == flops);
  CHECK(dq.front().cost({1, 8}).forward_flops != flops);
}

TEST_CASE("a plan names the layer stack it was made for: an executor refuses another stack's, and the JSON keeps the name") {
  // Another stack's plan had run: its resident segment names matching none of these (everything
  // streamed, nothing said), its predicted bytes another stack's.
  auto layers = stack<test::MoeMlpLayer>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  const Plan p = planner.plan(request(1_GiB)).plans.front();
  REQUIRE_FALSE(p.resident_segments.empty());
  CHECK(p.layers_fingerprint == planner.layers_fingerprint());
  CHECK(p.layers_fingerprint.size() == 16);
  CHECK(p.model_fingerprint.empty());
  CHECK(Plan::from_json(Json::parse(p.to_json().dump(2)), "<round trip>").layers_fingerprint == p.layers_fingerprint);
  Json bad = p.to_json();
  bad.set("layers_fingerprint", "0123");
  CHECK_THROWS_WITH_AS((void)Plan::from_json(bad, "bad.json"), doctest::Contains("layers_fingerprint: '0123' is not 16 lowercase hex"),
                       Error);
  const auto init_for = [](const auto& ls) {
    std::vector<std::vector<float>> init;
    for (const auto& l : ls)
      for (const auto& seg : l.segments()) init.emplace_back(seg.parameters(), 0.01f);
    return init;
  };
  HostBackend backend({1_GiB, 1_GiB, true});
  CHECK_NOTHROW(HostExecutor<test::MoeMlpLayer>(backend, layers, p, init_for(layers)));
  // Other segment names (layers 100..102), and the same names at another width.
  std::vector<test::MoeMlpLayer> renamed, wider;
  for (int l = 0; l < 3; ++l) {
    renamed.emplace_back(100 + l, hidden, experts, top_k, inter);
    wider.emplace_back(l, 2 * hidden, experts, top_k, inter);
  }
  const std::string stranger = "its resident segment '" + p.resident_segments.front() + "' is none of theirs";
  CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(backend, renamed, p, init_for(renamed)),
                       doctest::Contains("the plan was made for another layer stack (layers fingerprint"), Error);
  CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(backend, renamed, p, init_for(renamed)), doctest::Contains(stranger.c_str()), Error);
  CHECK_THROWS_WITH_AS(HostExecutor<test::MoeMlpLayer>(backend, wider, p, init_for(wider)),
                       doctest::Contains("the plan was made for another layer stack"), Error);
  CHECK(backend.device_arena().in_use() == 0_B);
  // A plan without the name (by hand, older JSON) is taken as before.
  Plan unnamed = p;
  unnamed.layers_fingerprint.clear();
  unnamed.resident_segments.clear();
  unnamed.predicted = Prediction::of(LayerStackPlanner(describe_layers(renamed), profile).simulate(unnamed));
  CHECK_NOTHROW(HostExecutor<test::MoeMlpLayer>(backend, renamed, unnamed, init_for(renamed)));
}

TEST_CASE("with room for everything, the plan keeps everything resident and on the GPU") {
  // Layers of some size: at the test stacks' few KiB, launch overheads rule and a GPU update on
  // the compute stream costs more than a copy and a CPU update beside it.
  const auto layers = stack<test::MoeMlpLayer>(3, 1024, 4, 2048);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile, "three MoE layers");
  const auto set = planner.plan(request(8_GiB, 8_GiB, 4096));
  REQUIRE_FALSE(set.plans.empty());
  const Plan& p = set.plans.front();
  CHECK(p.resident_segments.size() == segment_count(planner.layers()));
  CHECK(p.retention_name == "keep-all");
  CHECK(p.predicted.gpu_peak <= 8_GiB);
  CHECK(p.predicted.step_s > 0);
  CHECK(set.feasible <= set.evaluated);
  const std::string text = planner.describe(p);
  CHECK(text.find("residency: 15 of 15 segments resident") != std::string::npos);
  CHECK(text.find("predicted step") != std::string::npos);
}

TEST_CASE("tight budgets: the plan streams, offloads or recomputes what does not fit, stays within the budget, and computes the resident step bit for bit") {
  auto layers = stack<test::MoeMlpLayer>(4);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  const Bytes all = planner.plan(request(1_GiB)).plans.front().predicted.gpu_peak;
  const auto expect = train(layers, resident_plan(layers, tokens));
  int streamed = 0, moved = 0, mixed = 0;
  for (double share : {0.9, 0.6, 0.4, 0.25}) {
    const Bytes budget{static_cast<std::uint64_t>(static_cast<double>(all.count()) * share)};
    CAPTURE(share);
    PlanSet set;
    const std::string why = thrown([&] { set = planner.plan(request(budget)); });
    if (set.plans.empty()) {  // the smallest shares may be below what any plan needs: refused by name
      CHECK(why.find("the least GPU memory a plan needs") != std::string::npos);
      continue;
    }
    for (const Plan& p : set.plans) {
      CHECK(p.predicted.gpu_peak <= budget);
      // Re-simulating the returned plan predicts what the search saw.
      const SimResult again = planner.simulate(p);
      CHECK(again.gpu_peak == p.predicted.gpu_peak);
      CHECK(again.step_s == doctest::Approx(p.predicted.step_s));
      streamed += p.resident_segments.size() < segment_count(planner.layers());
      moved += any_retention(p, Retention::offload) || any_retention(p, Retention::recompute);
      // A mix: the last layers (nearest the loss, backward first) neither offload nor regenerate.
      if (const auto at = p.retention_name.find(" + last "); at != std::string::npos) {
        ++mixed;
        const auto q = static_cast<std::size_t>(std::stoul(p.retention_name.substr(at + 8)));
        REQUIRE(q < p.retention.size());
        for (std::size_t l = p.retention.size() - q; l < p.retention.size(); ++l)
          for (const auto& d : p.retention[l]) CHECK(d.action != Retention::offload);
      }
      CHECK(bitwise_equal(train(layers, p), expect));
    }
  }
  CHECK(streamed > 0);
  CHECK(moved > 0);
  CHECK(mixed > 0);
}

TEST_CASE("a budget too small for any plan is refused with the least bytes a plan needs and its largest claimant") {
  const auto layers = stack<test::MoeMlpLayer>(2);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile, "my stack");
  Errc code{};
  const std::string why = thrown([&] { (void)planner.plan(request(1_KiB)); }, &code);
  CHECK(code == Errc::out_of_budget);
  CHECK(why.find("no plan for my stack fits") != std::string::npos);
  CHECK(why.find("within the host budget, the least GPU memory a plan needs is") != std::string::npos);
  CHECK(why.find("largest claimant:") != std::string::npos);
  CHECK(why.find("the budget is 1.00 KiB") != std::string::npos);
  // A host budget of 1 byte besides: every segment resident needs no host memory, so only the GPU
  // is named (the refusal had also said "the least host memory any plan needs is 8.00 KiB", the
  // host need of the templates that offload, which a larger GPU budget alone made moot).
  const std::string gpu_only = thrown([&] { (void)planner.plan(request(1_KiB, 1_B)); });
  CHECK(gpu_only.find("within the host budget, the least GPU memory a plan needs is") != std::string::npos);
  CHECK(gpu_only.find("host memory") == std::string::npos);
  // Host memory too small for any plan, every segment resident included (activations offloaded by
  // the only template asked for): named apart.
  PlanRequest offloading = request(1_KiB, 1_B);
  offloading.retention = "offload-all";
  const std::string host = thrown([&] { (void)planner.plan(offloading); });
  INFO(host);
  CHECK(host.find("the least host memory any plan needs is") != std::string::npos);
  // A host too small for the state streamed, a GPU too small to hold it: the refusal names the
  // host memory a plan within the GPU budget needs.
  Plan streamed = planner.plan(request(1_GiB)).plans.front();
  streamed.resident_segments.clear();
  const auto tight = planner.simulate(streamed);
  const std::string both = thrown([&] {
    (void)planner.plan(request(Bytes{tight.gpu_peak.count() * 105 / 100}, Bytes{tight.host_peak.count() / 2}));
  });
  CHECK(both.find("within the GPU budget, the least host memory a plan needs is") != std::string::npos);
}

TEST_CASE("a host budget too small for streamed state is met by keeping more resident") {
  const auto layers = stack<test::MoeMlpLayer>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  auto r = request(1_GiB);
  const Plan streamed = planner.plan(r).plans.front();
  // Every segment streamed needs this much host memory; half of it forces residency.
  Plan none = streamed;
  none.resident_segments.clear();
  const Bytes host_all_streamed = planner.simulate(none).host_peak;
  REQUIRE(host_all_streamed.count() > 0);
  r.host_budget = Bytes{host_all_streamed.count() / 2};
  r.candidates = 8;
  const auto set = planner.plan(r);
  for (const Plan& p : set.plans) {
    CHECK(p.predicted.host_peak <= r.host_budget);
    CHECK_FALSE(p.resident_segments.empty());
  }
}

TEST_CASE("the step graph is the HostExecutor's schedule: slots in turn, gradient slots by parity, a recompute where one is planned") {
  const auto layers = stack<test::MoeMlpLayer>(4);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  Plan p = resident_plan(layers, tokens);
  p.resident_segments.clear();  // every layer streamed
  p.prefetch_depth = 2;
  p.retention[1][static_cast<std::size_t>(ActivationClass::router_output)] = RetentionDecision::recompute(1);
  p.retention[2][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::offload();
  const StepGraph g = planner.step_graph(p);
  std::vector<int> loads, users, grads_by_layer(4, -1);
  int recomputes = 0, prefetches = 0;
  for (std::size_t i = 0; i < g.ops().size(); ++i) {
    const auto& op = g.ops()[i];
    const std::string what = op.what;
    if (what == "h2d.weights") loads.push_back(static_cast<int>(i));
    if (what == "fwd" || what == "bwd") users.push_back(static_cast<int>(i));
    if (what == "recompute") {
      ++recomputes;
      CHECK(op.layer == 1);
    }
    if (what == "h2d.activations") {
      ++prefetches;
      CHECK(op.layer == 2);
    }
    if (what == "bwd" && op.layer <= 1) {  // waits for the gradient slot of layer + 2
      CHECK(std::find(op.deps.begin(), op.deps.end(), grads_by_layer[static_cast<std::size_t>(op.layer + 2)]) != op.deps.end());
    }
    if (what == "d2h.grads") grads_by_layer[static_cast<std::size_t>(op.layer)] = static_cast<int>(i);
  }
  CHECK(recomputes == 1);
  CHECK(prefetches == 1);
  REQUIRE(loads.size() == 8);
  REQUIRE(users.size() == 8);
  for (std::size_t i = 2; i < loads.size(); ++i) {  // load i reuses the slot of load i - 2
    const auto& deps = g.ops()[static_cast<std::size_t>(loads[i])].deps;
    CHECK(std::find(deps.begin(), deps.end(), users[i - 2]) != deps.end());
  }
  // The first backward load waits for the loss (the executor checks it before queueing backward).
  int loss = -1;
  for (std::size_t i = 0; i < g.ops().size(); ++i)
    if (std::string(g.ops()[i].what) == "loss") loss = static_cast<int>(i);
  const auto& first_bwd_load = g.ops()[static_cast<std::size_t>(loads[4])].deps;
  CHECK(std::find(first_bwd_load.begin(), first_bwd_load.end(), loss) != first_bwd_load.end());
  // A chunk of 0 tokens is refused: the executor would run a token at a time.
  p.chunks[3].moe_tokens = 0;
  CHECK(thrown([&] { (void)planner.step_graph(p); }).find("layer 3: a chunk of 0 tokens") != std::string::npos);
}

TEST_CASE("where boundaries do not fit, groups of them are regenerated through the layers below: the plan runs in its predicted "
          "arenas and computes the resident step bit for bit") {
  // Six layers whose boundaries (T x H fp32) outweigh what each saves: below the checkpointed
  // plans' memory the search keeps one boundary in each group and reruns the group's layers.
  auto layers = stack<test::MoeMlpLayer>(6);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  const auto expect = train(layers, resident_plan(layers, tokens));
  Bytes budget = planner.plan(request(1_GiB)).plans.front().predicted.gpu_peak;
  int regenerating = 0, offloaded_first = 0;
  for (;;) {
    budget = Bytes{budget.count() * 9 / 10};
    auto r = request(budget);
    r.candidates = 40;  // offloading the boundaries is often faster than a rerun: regeneration ranks below
    PlanSet set;
    try {
      set = planner.plan(r);
    } catch (const Error& e) {
      REQUIRE(e.code() == Errc::out_of_budget);  // below the least any plan needs
      break;
    }
    for (const Plan& p : set.plans) {
      bool regen = false;
      for (std::size_t l = 0; l < p.retention.size(); ++l) {
        const auto d = p.retention[l][0];
        if (d.action != Retention::recompute) continue;
        regen = true;
        CHECK(d.recompute_from < static_cast<int>(l));
        offloaded_first += p.retention[static_cast<std::size_t>(d.recompute_from)][0].action == Retention::offload;
      }
      if (!regen || regenerating == 8) continue;  // eight runs are enough (each takes a while)
      ++regenerating;
      CAPTURE(p.retention_name);
      CHECK(p.retention_name.find("boundaries regenerated in groups of") != std::string::npos);
      CHECK(bitwise_equal(train(layers, p), expect));  // in arenas of exactly its predicted bytes
    }
  }
  CHECK(regenerating > 0);
  CHECK(offloaded_first > 0);
}

TEST_CASE("a request for one retention template plans only it and its mixes nearer the loss") {
  const auto layers = stack<test::MoeMlpLayer>(6);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  auto r = request(1_GiB);
  r.candidates = 10;
  for (const char* name : {"offload-checkpoint", "checkpoint, boundaries regenerated in groups of 2"}) {
    CAPTURE(name);
    r.retention = name;
    const auto set = planner.plan(r);
    REQUIRE_FALSE(set.plans.empty());
    for (const Plan& p : set.plans) {
      CHECK(p.retention_name.rfind(name, 0) == 0);
      // Not a longer name that merely begins the same ("offload-checkpoint, boundaries ...").
      CHECK((p.retention_name.size() == std::strlen(name) || p.retention_name.compare(std::strlen(name), 8, " + last ") == 0));
    }
  }
  // A template whose table equals another's (no layer recomputable: checkpoint is keep-all) is
  // still planned when asked for by name.
  const auto fixed = stack<NoRecompute>(6);
  const LayerStackPlanner strict(describe_layers(fixed), profile);
  r.retention = "checkpoint";
  const auto set = strict.plan(r);
  REQUIRE_FALSE(set.plans.empty());
  CHECK(set.plans.front().retention_name.rfind("checkpoint", 0) == 0);
}

TEST_CASE("a regenerated group's step graph: the offloaded first boundary back before the rerun, held to its own backward") {
  const auto layers = stack<test::MoeMlpLayer>(4);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  Plan p = resident_plan(layers, tokens);
  p.resident_segments.clear();
  p.retention[1][0] = RetentionDecision::offload();
  p.retention[2][0] = RetentionDecision::recompute(1);
  p.retention[3][0] = RetentionDecision::recompute(1);
  const StepGraph g = planner.step_graph(p);
  const auto& ops = g.ops();
  int regen = -1, back = -1, weights = -1, bwd1 = -1, prefetch1 = -1;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const std::string what = ops[i].what;
    if (what == "regenerate") {
      CHECK(regen < 0);  // once: layer 3's backward gives back the boundaries of layers 2 and 3
      regen = static_cast<int>(i);
      CHECK(ops[i].layer == 3);
    }
    if (what == "h2d.boundary (to regenerate from)") back = static_cast<int>(i);
    if (what == "h2d.weights.regenerate") weights = static_cast<int>(i);
    if (what == "bwd" && ops[i].layer == 1) bwd1 = static_cast<int>(i);
    if (what == "h2d.activations" && ops[i].layer == 1) prefetch1 = static_cast<int>(i);
  }
  REQUIRE(regen >= 0);
  REQUIRE(back >= 0);
  REQUIRE(weights >= 0);
  const auto& deps = ops[static_cast<std::size_t>(regen)].deps;
  CHECK(std::find(deps.begin(), deps.end(), back) != deps.end());
  CHECK(std::find(deps.begin(), deps.end(), weights) != deps.end());
  CHECK(prefetch1 < 0);  // layer 1 saves nothing else to offload: its boundary came back already
  // Layer 1's boundary: on the GPU from its copy back to layer 1's backward; layers 2's and 3's
  // from the rerun to their own backward; the rerun's weights (layers 1 and 2) a workset until it.
  const Bytes boundary{tokens * hidden * sizeof(float)};
  bool held_back = false, held_weights = false;
  int held_regenerated = 0;
  for (const auto& h : g.holds()) {
    if (h.claimant == Claimant::retained_activations && h.from == back && h.to == bwd1 && h.bytes == boundary) held_back = true;
    if (h.claimant == Claimant::retained_activations && h.from == regen && h.bytes == boundary) ++held_regenerated;
    if (h.claimant == Claimant::worksets && h.from == weights && h.to == regen) held_weights = true;
  }
  CHECK(held_back);
  CHECK(held_regenerated == 2);
  CHECK(held_weights);
  // And the HostExecutor runs it in those bytes to the resident plan's weights, one micro-batch or
  // two (each regenerates its own boundaries).
  p.predicted = Prediction::of(planner.simulate(p));
  auto stack4 = stack<test::MoeMlpLayer>(4);
  CHECK(bitwise_equal(train(stack4, p), train(stack4, resident_plan(stack4, tokens))));
  Plan two = p, two_resident = resident_plan(stack4, tokens);
  two.micro_batches = two_resident.micro_batches = 2;
  two.predicted = Prediction::of(planner.simulate(two));
  CHECK(bitwise_equal(train(stack4, two), train(stack4, two_resident)));
  // Shapes the executors do not run are refused by name: a regeneration past a boundary kept in
  // between, from a regenerated one, through a layer that is not recomputable.
  Plan bad = p;
  bad.retention[2][0] = RetentionDecision::keep();
  CHECK(thrown([&] { (void)planner.step_graph(bad); }).find("layer 3: its boundary is regenerated from layer 1 but layer 2's is not") !=
        std::string::npos);
  bad = p;
  bad.retention[3][0] = RetentionDecision::recompute(2);
  CHECK(thrown([&] { (void)planner.step_graph(bad); }).find("regenerated from layer 2, whose own boundary is regenerated too") !=
        std::string::npos);
  const auto fixed = stack<NoRecompute>(4);
  const LayerStackPlanner strict(describe_layers(fixed), profile);
  CHECK(thrown([&] { (void)strict.step_graph(p); }).find("layer 2: its boundary is regenerated through layer 1") != std::string::npos);
}

TEST_CASE("more GPU memory never predicts a slower best plan") {
  const auto layers = stack<ChunkedMoe>(6, 64, 8, 128);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  auto r = request(1_GiB, 1_GiB, 512);
  const Bytes all = planner.plan(r).plans.front().predicted.gpu_peak;
  double last = 0;
  int planned = 0;
  for (int pct = 10; pct <= 110; pct += 5) {
    r.gpu_budget = Bytes{all.count() * static_cast<std::uint64_t>(pct) / 100};
    try {
      const double step = planner.plan(r).plans.front().predicted.step_s;
      CAPTURE(pct);
      if (planned > 0) CHECK(step <= last * (1 + 1e-12));
      last = step;
      ++planned;
    } catch (const Error& e) {
      CHECK(planned == 0);  // once a budget fits, every larger one does
    }
  }
  CHECK(planned >= 10);
}

TEST_CASE("a chunkable layer runs in token chunks when its whole workset does not fit; the chunked plan computes the same step") {
  auto layers = stack<ChunkedMoe>(2);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  // Find the smallest budget that plans at all: it can only be met by chunking.
  Bytes budget = planner.plan(request(1_GiB)).plans.front().predicted.gpu_peak;
  Plan smallest;
  for (;;) {
    const Bytes next{budget.count() * 9 / 10};
    PlanSet set;
    try {
      set = planner.plan(request(next));
    } catch (const Error&) {
      break;
    }
    smallest = set.plans.front();
    budget = next;
  }
  REQUIRE_FALSE(smallest.chunks.empty());
  CHECK(smallest.chunks.front().moe_tokens < tokens);
  CHECK(smallest.predicted.gpu_peak <= budget);
  CHECK(bitwise_equal(train(layers, smallest), train(layers, resident_plan(layers, tokens))));
}

TEST_CASE("a layer that is not recomputable is never planned to recompute") {
  const auto layers = stack<NoRecompute>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  const Bytes all = planner.plan(request(1_GiB)).plans.front().predicted.gpu_peak;
  int plans = 0;
  for (double share : {0.8, 0.5, 0.3}) {
    try {
      auto r = request(Bytes{static_cast<std::uint64_t>(static_cast<double>(all.count()) * share)});
      r.candidates = 8;
      for (const Plan& p : planner.plan(r).plans) {
        CHECK_FALSE(any_retention(p, Retention::recompute));
        ++plans;
      }
    } catch (const Error&) {
    }
  }
  CHECK(plans > 0);
}

TEST_CASE("micro-batches and clipping: the graph repeats the passes, the updates follow the last, and the norm comes first") {
  auto layers = stack<test::MoeMlpLayer>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile);
  auto r = request(1_GiB);
  r.micro_batches = 2;
  r.clip_grad_norm = true;
  Plan p = planner.plan(r).plans.front();
  p.resident_segments = {layers[0].segments()[0].name, layers[0].segments()[1].name};  // both optimizers run
  const StepGraph g = planner.step_graph(p);
  int fwd = 0, bwd = 0, norm = -1, cpu = 0, gpu = 0;
  for (std::size_t i = 0; i < g.ops().size(); ++i) {
    const std::string what = g.ops()[i].what;
    fwd += what == "fwd";
    bwd += what == "bwd";
    if (what == "cpu.grad_norm") norm = static_cast<int>(i);
    if (what == "cpu.adamw" || what == "gpu.adamw") {
      (what == "cpu.adamw" ? cpu : gpu)++;
      CHECK(norm >= 0);
      CHECK(std::find(g.ops()[i].deps.begin(), g.ops()[i].deps.end(), norm) != g.ops()[i].deps.end());
    }
    if (what == "cpu.adamw") {
      // Its layer's streamed parameters at the profile's rate, slowed by 10 bytes more a
      // parameter over AdamW's 30: the gradient check's read (4), the layer's copies (4 + 2).
      std::uint64_t n = 0;
      for (const auto& seg : layers[static_cast<std::size_t>(g.ops()[i].layer)].segments())
        if (std::find(p.resident_segments.begin(), p.resident_segments.end(), seg.name) == p.resident_segments.end()) n += seg.parameters();
      CHECK(g.ops()[i].duration_s == doctest::Approx(static_cast<double>(n) * 40.0 / 30.0 / profile.cpu_adamw_params_per_s).epsilon(1e-9));
    }
  }
  CHECK(fwd == 6);
  CHECK(bwd == 6);
  CHECK(cpu == 3);  // every layer streams something
  CHECK(gpu == 1);  // layer 0 holds the two resident segments
  // Two micro-batches on the HostExecutor compute what the resident plan does.
  Plan resident = resident_plan(layers, tokens);
  resident.micro_batches = 2;
  p.clip_grad_norm = false;  // the executor leaves clipping to its caller (defer_updates)
  p.predicted = Prediction::of(planner.simulate(p));  // the memory figures of the residency set here
  CHECK(bitwise_equal(train(layers, p), train(layers, resident)));
}

TEST_CASE("a plan written to JSON reads back as the same plan: its layers have no attention chunks") {
  // from_json had refused every plan of this planner: "layers[0].attention_chunk_ends: the last
  // chunk must end at seq_len", for the empty list to_json writes for them.
  const auto layers = stack<ChunkedMoe>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  const LayerStackPlanner planner(describe_layers(layers), profile, "three MoE layers");
  const Plan p = planner.plan(request(48_KiB)).plans.front();
  REQUIRE(p.chunks.size() == 3);
  CHECK(p.chunks[0].attention.empty());
  const Plan back = Plan::from_json(Json::parse(p.to_json().dump(2)), "<round trip>");
  CHECK(back.to_json() == p.to_json());
  CHECK(back.resident_segments == p.resident_segments);
  CHECK(back.retention == p.retention);
  for (std::size_t l = 0; l < p.chunks.size(); ++l) {
    CHECK(back.chunks[l].attention.empty());
    CHECK(back.chunks[l].moe_tokens == p.chunks[l].moe_tokens);
  }
  CHECK(planner.simulate(back).step_s == doctest::Approx(p.predicted.step_s));
  CHECK(planner.describe(back) == planner.describe(p));
  // Ends that are there still end at seq_len.
  Json bad = p.to_json();
  Json::Array layers_json = bad.find("layers")->as_array();
  layers_json[0].set("attention_chunk_ends", Json(Json::Array{Json(8)}));
  bad.set("layers", Json(std::move(layers_json)));
  CHECK_THROWS_WITH_AS((void)Plan::from_json(bad, "bad.json"), doctest::Contains("the last chunk must end at seq_len 24"), Error);
}

TEST_CASE("bad stacks and requests are refused by name") {
  const auto layers = stack<test::MoeMlpLayer>(2);
  const MachineProfile profile = MachineProfile::h200(1);
  Errc code{};
  CHECK(thrown([&] { LayerStackPlanner({}, profile); }, &code).find("the stack has no layers") != std::string::npos);
  CHECK(code == Errc::invalid_argument);

  auto d = describe_layers(layers);
  d[1].segments[0].name = d[0].segments[0].name;
  CHECK(thrown([&] { LayerStackPlanner(d, profile); }).find("segment name 'layers.0.mlp.gate' is used by layer 0 and layer 1") !=
        std::string::npos);

  d = describe_layers(layers);
  d[0].cost = nullptr;
  CHECK(thrown([&] { LayerStackPlanner(d, profile); }).find("layer 0 ('layer 0') has no cost function") != std::string::npos);

  auto with_cost = [&](std::function<void(LayerCost&)> edit) {
    auto e = describe_layers(layers);
    auto base = e[1].cost;
    e[1].cost = [base, edit](const Workload& w) {
      LayerCost c = base(w);
      edit(c);
      return c;
    };
    const LayerStackPlanner planner(e, profile);
    return thrown([&] { (void)planner.plan(request(1_GiB)); });
  };
  CHECK(with_cost([](LayerCost& c) { c.forward_flops = -1; }).find("layer 1 ('layer 1'), cost for 1 x 24 tokens: FLOPs must be finite") !=
        std::string::npos);
  CHECK(with_cost([](LayerCost& c) { c.backward_flops = std::numeric_limits<double>::quiet_NaN(); }).find("FLOPs must be finite") !=
        std::string::npos);
  CHECK(with_cost([](LayerCost& c) { c.activations.push_back({ActivationClass::layer_boundary, 64_KiB, 0}); })
            .find("declares a layer_boundary activation") != std::string::npos);
  CHECK(with_cost([](LayerCost& c) { c.activations[0].recompute_flops = std::numeric_limits<double>::infinity(); })
            .find("router_output recompute FLOPs must be finite") != std::string::npos);

  const LayerStackPlanner planner(describe_layers(layers), profile);
  auto r = request(1_GiB);
  r.gpus = 2;
  CHECK(thrown([&] { (void)planner.plan(r); }, &code).find("plans one GPU, not 2") != std::string::npos);
  CHECK(code == Errc::unsupported);
  r = request(1_GiB);
  r.precision.moments = DType::fp16;  // the executors keep fp32 or bf16 moments: its memory would be misstated
  CHECK(thrown([&] { (void)planner.plan(r); }, &code).find("precision.moments is fp16; it keeps fp32 or bf16 moments") != std::string::npos);
  CHECK(code == Errc::unsupported);
  r.precision = StatePrecision{};
  r.precision.master = DType::bf16;
  CHECK(thrown([&] { (void)planner.plan(r); }, &code).find("precision.master is bf16; it keeps fp32 master") != std::string::npos);
  CHECK(thrown([&] { (void)planner.plan(request(1_GiB, 1_GiB, 0)); }).find("the workload has no tokens") != std::string::npos);
  r = request(1_GiB);
  r.retention = "checkpointing";
  CHECK(thrown([&] { (void)planner.plan(r); }, &code).find("retention 'checkpointing' is not one the layer-stack planner searches") !=
        std::string::npos);
  CHECK(code == Errc::invalid_argument);
  r = request(0_B);
  CHECK(thrown([&] { (void)planner.plan(r); }).find("budgets must be > 0") != std::string::npos);
  // A hand-made plan that recomputes from another layer's boundary is refused, not simulated.
  Plan p = resident_plan(layers, tokens);
  p.retention[1][static_cast<std::size_t>(ActivationClass::router_output)] = RetentionDecision::recompute(0);
  CHECK(thrown([&] { (void)planner.simulate(p); }).find("layer 1: router_output recomputed from layer 0") != std::string::npos);
  p.retention.pop_back();
  CHECK(thrown([&] { (void)planner.simulate(p); }).find("plan covers 1 layers") != std::string::npos);
  // Counts no plan reader accepts are refused before a graph of that size is built.
  p = resident_plan(layers, tokens);
  p.prefetch_depth = 1 << 30;
  CHECK(thrown([&] { (void)planner.simulate(p); }).find("prefetch_depth 1073741824 (1 to 64)") != std::string::npos);
  p = resident_plan(layers, tokens);
  p.workload = {0, 24};
  CHECK(thrown([&] { (void)planner.simulate(p); }).find("plan: 0 sequences of 24 tokens") != std::string::npos);
  // describe() refuses what simulate() does: a plan of another stack had been described as this one's.
  p = resident_plan(stack<test::MoeMlpLayer>(3), tokens);
  CHECK(thrown([&] { (void)planner.describe(p); }).find("plan covers 3 layers (3 chunk entries), the stack has 2") != std::string::npos);
  // A request for no plans, or fewer, had been answered with one.
  for (const int n : {0, -1}) {
    r = request(1_GiB);
    r.candidates = n;
    CHECK(thrown([&] { (void)planner.plan(r); }, &code).find(fmt::format("candidates (plans to return) must be at least 1, not {}", n)) !=
          std::string::npos);
    CHECK(code == Errc::invalid_argument);
  }
}

TEST_CASE("a layer cost with no output (LayerCost::output of 0 bytes, its default) is refused, naming the layer") {
  // The audit's stack: a layer's output is the next layer's boundary (the first layer's is its
  // own); at 0 bytes an offloaded boundary had no copy down for its regeneration to wait on, and
  // planning threw Errc::internal ("op 'h2d.boundary (to regenerate from) L1' depends on op -1").
  const MachineProfile profile = MachineProfile::h200(1);
  constexpr std::uint64_t h = 8, t = 16;
  auto described = [&](int without_output) {
    std::vector<LayerDescription> d(2);
    for (int l = 0; l < 2; ++l) {
      d[static_cast<std::size_t>(l)].name = std::string("l").append(std::to_string(l));
      d[static_cast<std::size_t>(l)].cost = [=](const Workload& w) {
        LayerCost c;
        c.forward_flops = 1e3;
        c.backward_flops = 2e3;
        if (l != without_output) c.output = Bytes{w.tokens() * h * 4};
        return c;
      };
    }
    return d;
  };
  // Layer 0's boundary offloaded, layer 1's regenerated from it: the graph that had no offload op.
  Plan regenerate;
  regenerate.workload = {1, t};
  regenerate.gpu_budget = regenerate.host_budget = 1_MiB;
  regenerate.retention.resize(2);
  regenerate.chunks.assign(2, {{t}, t});
  regenerate.loss_rows = t;
  regenerate.retention[0][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::offload();
  regenerate.retention[1][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::recompute(0);
  for (const int l : {0, 1}) {
    CAPTURE(l);
    const LayerStackPlanner planner(described(l), profile, "no-output");
    const std::string want = fmt::format("layer {} ('l{}'), cost for 1 x 16 tokens: LayerCost::output is 0 bytes", l, l);
    Errc code{};
    CHECK(thrown([&] { (void)planner.plan(request(1_MiB, 1_MiB, t)); }, &code).find(want) != std::string::npos);
    CHECK(code == Errc::invalid_argument);
    CHECK(thrown([&] { (void)planner.simulate(regenerate); }, &code).find(want) != std::string::npos);
    CHECK(code == Errc::invalid_argument);
  }
  const LayerStackPlanner planner(described(-1), profile, "with-output");
  CHECK_FALSE(planner.plan(request(1_MiB, 1_MiB, t)).plans.empty());
  const SimResult sim = planner.simulate(regenerate);
  CHECK(sim.peak_of(Claimant::host_offload) == Bytes{t * h * 4});
}

TEST_CASE("a chunk's workset is its share rounded up, exact at any size (what the planner holds and the executor hands out)") {
  CHECK(chunk_workset(1000_B, 10, 10) == 1000_B);  // unchunked: the whole
  CHECK(chunk_workset(1000_B, 10, 20) == 1000_B);
  CHECK(chunk_workset(1000_B, 10, 3) == 300_B);
  CHECK(chunk_workset(1001_B, 10, 3) == Bytes{301});  // 300.3 rounded up
  CHECK(chunk_workset(7_B, 3, 1) == Bytes{3});
  // Past 64 bits in the product: 2^40 bytes over 2^32 - 1 of 2^32 tokens.
  const std::uint64_t t = std::uint64_t{1} << 32;
  CHECK(chunk_workset(Bytes{std::uint64_t{1} << 40}, t, t - 1) == Bytes{(std::uint64_t{1} << 40) - 256});
  CHECK(chunk_workset(Bytes{(std::uint64_t{1} << 40) + 1}, t, t - 1) == Bytes{(std::uint64_t{1} << 40) - 255});
}

TEST_CASE("measured rates price a layer's passes: the forward, recompute and backward at the layer's own FLOPs a second") {
  const auto layers = stack<test::MoeMlpLayer>(3);
  const MachineProfile profile = MachineProfile::h200(1);
  auto d = describe_layers(layers);
  const LayerCost c = d[1].cost({1, tokens});
  double rerun = 0;  // the recomputed class's FLOPs (the planner reruns what it recomputes, at most the forward)
  for (const auto& a : c.activations)
    if (a.cls == ActivationClass::router_output) rerun += a.recompute_flops;
  if (rerun == 0) rerun = c.forward_flops;
  rerun = std::min(rerun, c.forward_flops);
  d[1].measured = {1e9, 5e8};  // layer 1 only: the others keep the GEMM rate
  const LayerStackPlanner measured(d, profile), declared(describe_layers(layers), profile);
  Plan p = resident_plan(layers, tokens);
  p.retention[1][static_cast<std::size_t>(ActivationClass::router_output)] = RetentionDecision::recompute(1);
  const StepGraph g = measured.step_graph(p), base = declared.step_graph(p);
  REQUIRE(g.ops().size() == base.ops().size());
  int checked = 0;
  for (std::size_t i = 0; i < g.ops().size(); ++i) {
    const SimOp& op = g.ops()[i];
    const std::string what = op.what;
    if (op.layer != 1) {
      CHECK(op.duration_s == base.ops()[i].duration_s);  // only layer 1 is re-priced
      continue;
    }
    CAPTURE(what);
    if (what == "fwd") CHECK(op.duration_s == doctest::Approx(profile.launch_overhead_s + c.forward_flops / 1e9));
    if (what == "bwd") CHECK(op.duration_s == doctest::Approx(profile.launch_overhead_s + c.backward_flops / 5e8));
    if (what == "recompute") CHECK(op.duration_s == doctest::Approx(profile.launch_overhead_s + rerun / 1e9));
    checked += what == "fwd" || what == "bwd" || what == "recompute";
  }
  CHECK(checked == 3);
  // A slower layer makes a slower plan.
  CHECK(measured.simulate(p).step_s > declared.simulate(p).step_s);
  CHECK(measured.describe(p).find("compute: 1 of 3 layers at their measured rates") != std::string::npos);
  CHECK(declared.describe(p).find("compute: declared FLOPs at the profile's GEMM rate") != std::string::npos);

  d[2].measured.backward_flops_per_s = -1;
  CHECK(thrown([&] { LayerStackPlanner bad(d, profile); }).find("layer 2 ('layer 2'): measured FLOP rates must be finite and >= 0") !=
        std::string::npos);
  d[2].measured.backward_flops_per_s = std::numeric_limits<double>::quiet_NaN();
  CHECK(thrown([&] { LayerStackPlanner bad(d, profile); }).find("measured FLOP rates") != std::string::npos);
}

TEST_CASE("with_measured_rates: a layer's FLOPs per span over its spans' time, micro-batches counted; a missing span named") {
  const auto layers = stack<test::MoeMlpLayer>(2);
  const auto d = describe_layers(layers);
  const Workload w{1, tokens};
  Timeline tl;
  // Two micro-batches: each pass twice. Layer 0's forward 2 ms + 2 ms, backward 3 + 5 ms; layer 1's
  // forward 1 + 1 ms, backward 2 + 2 ms; a recompute and a copy that are not the passes.
  tl.add("fwd layer 0", Resource::gpu_compute, 0.000, 0.002);
  tl.add("fwd layer 1", Resource::gpu_compute, 0.002, 0.003);
  tl.add("recompute layer 1", Resource::gpu_compute, 0.003, 0.010);
  tl.add("bwd layer 1", Resource::gpu_compute, 0.010, 0.012);
  tl.add("bwd layer 0", Resource::gpu_compute, 0.012, 0.015);
  tl.add("fwd layer 0", Resource::gpu_compute, 0.020, 0.022);
  tl.add("fwd layer 1", Resource::gpu_compute, 0.022, 0.023);
  tl.add("bwd layer 1", Resource::gpu_compute, 0.023, 0.025);
  tl.add("bwd layer 0", Resource::gpu_compute, 0.025, 0.030);
  tl.add("fwd layer 0", Resource::h2d, 0.0, 1.0);  // not the compute stream: ignored
  const auto m = with_measured_rates(d, tl, w);
  const LayerCost c0 = d[0].cost(w), c1 = d[1].cost(w);
  CHECK(m[0].measured.forward_flops_per_s == doctest::Approx(2 * c0.forward_flops / 0.004));
  CHECK(m[0].measured.backward_flops_per_s == doctest::Approx(2 * c0.backward_flops / 0.008));
  CHECK(m[1].measured.forward_flops_per_s == doctest::Approx(2 * c1.forward_flops / 0.002));
  CHECK(m[1].measured.backward_flops_per_s == doctest::Approx(2 * c1.backward_flops / 0.004));
  CHECK(m[1].segments == d[1].segments);  // the rest of the description as it was

  Timeline partial;
  partial.add("fwd layer 0", Resource::gpu_compute, 0, 0.001);
  partial.add("bwd layer 0", Resource::gpu_compute, 0, 0.001);
  partial.add("fwd layer 1", Resource::gpu_compute, 0, 0.001);
  CHECK(thrown([&] { (void)with_measured_rates(d, partial, w); })
            .find("layer 1 ('layer 1'): the recorded step has no 'bwd layer 1' span") != std::string::npos);
  partial.add("bwd layer 1", Resource::gpu_compute, 0.5, 0.5);
  CHECK(thrown([&] { (void)with_measured_rates(d, partial, w); }).find("its 'bwd layer 1' spans took 0 s") != std::string::npos);
  CHECK(thrown([&] { (void)with_measured_rates(d, tl, Workload{1, 0}); }).find("the workload has no tokens") != std::string::npos);
  auto twins = d;  // two layers of one name: whose spans are whose cannot be told
  twins[1].name = twins[0].name;
  CHECK(thrown([&] { (void)with_measured_rates(twins, tl, w); }).find("layers 0 and 1 are both named 'layer 0'") != std::string::npos);
}

TEST_CASE("a measured rate prices a chunked layer's passes chunk by chunk, each chunk adding the launch overhead") {
  const auto layers = stack<ChunkedMoe>(2);
  const MachineProfile profile = MachineProfile::h200(1);
  auto d = describe_layers(layers);
  for (auto& l : d) l.measured = {2e9, 1e9};
  const LayerStackPlanner planner(d, profile);
  Plan p = resident_plan(layers, tokens);
  p.chunks[0].moe_tokens = tokens / 3;  // 3 chunks of 8 tokens
  const LayerCost c = d[0].cost({1, tokens});
  int checked = 0;
  const StepGraph g = planner.step_graph(p);  // ops() is the graph's: keep it alive
  for (const SimOp& op : g.ops()) {
    const std::string what = op.what;
    const double chunks = op.layer == 0 ? 3.0 : 1.0;
    if (what == "fwd") CHECK(op.duration_s == doctest::Approx(chunks * profile.launch_overhead_s + c.forward_flops / 2e9));
    if (what == "bwd") CHECK(op.duration_s == doctest::Approx(chunks * profile.launch_overhead_s + c.backward_flops / 1e9));
    checked += what == "fwd" || what == "bwd";
  }
  CHECK(checked == 4);
}

TEST_CASE("a step's measured rates predict the next step's compute: the HostExecutor's CPU layers, off the GEMM rate by orders") {
  // The CPU layers run far below an H200's GEMM rate, so the declared FLOPs predict their compute
  // orders of magnitude too fast; rates measured on one recorded step predict the next's.
  constexpr std::uint64_t h = 128;
  auto layers = stack<test::MoeMlpLayer>(4, h, 4, 512);
  const MachineProfile profile = MachineProfile::h200(1);
  const auto described = describe_layers(layers);
  const Plan p = resident_plan(layers, tokens);
  std::vector<std::vector<float>> init;
  std::uint64_t seed = 3;
  for (const auto& l : layers)
    for (const auto& seg : l.segments()) init.push_back(test::random_normal(seg.parameters(), ++seed, 0.1f));
  HostBackend backend({1_GiB, 1_GiB, false});
  LayerExecutorOptions o;
  o.adamw.lr = 1e-3f;
  o.cpu_threads = 1;
  HostExecutor<test::MoeMlpLayer> exec(backend, layers, p, init, o);
  const HostLossFn loss = [](const float* y, float* g) {
    double sum = 0;
    for (std::uint64_t i = 0; i < tokens * h; ++i) {
      g[i] = y[i] / static_cast<float>(tokens);
      sum += 0.5 * static_cast<double>(y[i]) * y[i];
    }
    return sum / static_cast<double>(tokens);
  };
  // Five rounds, each step's rates predicting the next recorded step's compute; the best round
  // counts (a busy machine may stretch one). A span is milliseconds here, not scheduler noise.
  auto compute_of = [&](Timeline& tl) {
    tl.clear();
    exec.record_next_step(&tl);
    exec.step(test::random_normal(tokens * h, 11), loss);
    return test::pass_seconds(tl);
  };
  exec.step(test::random_normal(tokens * h, 10), loss);  // warm-up
  std::array<Timeline, 2> tl;  // the step measured, the next
  (void)compute_of(tl[0]);
  double declared_ratio = 0, best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const Timeline& last = tl[static_cast<std::size_t>(round % 2)];
    Timeline& next = tl[static_cast<std::size_t>(1 - round % 2)];
    const LayerStackPlanner calibrated(with_measured_rates(described, last, p.workload), profile);
    const LayerStackPlanner plain(described, profile);
    auto predicted = [&](const LayerStackPlanner& pl) { return test::pass_seconds(pl.step_graph(p), profile.launch_overhead_s); };
    const double measured = compute_of(next);
    declared_ratio = measured / predicted(plain);
    best = std::min(best, std::abs(std::log(predicted(calibrated) / measured)));
  }
  MESSAGE("measured compute over the declared FLOPs' prediction: " << declared_ratio << "x; with measured rates, within a factor of "
                                                                   << std::exp(best));
  CHECK(declared_ratio > 20);      // the GEMM rate is no description of these layers
  CHECK(best < std::log(2.0));     // a measured step predicts the next within 2x
}
