// oom-custom-layer: how little code plugs your own layer into offloaded training. The layer below
// is the user's (a residual MLP block, y = x + W2 silu(W1 x)); OOM plans its stack against a GPU
// budget (LayerStackPlanner: what to keep resident, what to stream, offload or recompute, in
// which chunks) and trains it on the host reference backend (HostExecutor) with the plan, which
// computes the same step as keeping everything on the GPU.
//   oom-custom-layer [--layers N] [--hidden H] [--inter I] [--tokens T] [--steps S]
//                    [--gpu-budget BYTES] [--host-budget BYTES] [--profile FILE.json] [--retention NAME]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/cli_numbers.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/plan/layer_stack_planner.hpp"
#include "oom/runtime/host_executor.hpp"

namespace {

// ---- the user's layer: everything OOM needs from it ----
class ResidualMlp {
 public:
  ResidualMlp(int index, std::uint64_t hidden, std::uint64_t inter) : h_(hidden), i_(inter) {
    const std::string p = "blocks." + std::to_string(index);
    // One segment: the unit OOM keeps resident or streams (one DMA burst), its tensors back to back.
    segs_.push_back({p, oom::SegmentRole::dense_mlp, index, -1, {{p + ".w1", {i_, h_}}, {p + ".w2", {h_, i_}}}});
  }

  // What the planner reads: state, and cost for a workload (FLOPs, what backward needs, temporaries).
  const std::vector<oom::StateSegment>& segments() const { return segs_; }
  oom::LayerCost cost(const oom::Workload& w) const {
    const std::uint64_t t = w.tokens();
    oom::LayerCost c;
    c.forward_flops = 4.0 * static_cast<double>(t * h_ * i_);
    c.backward_flops = 2 * c.forward_flops;
    c.activations.push_back({oom::ActivationClass::other, oom::Bytes{t * i_ * sizeof(float)}, c.forward_flops / 2});
    c.workset = oom::Bytes{t * i_ * sizeof(float)};
    c.output = oom::Bytes{t * h_ * sizeof(float)};
    return c;
  }
  // Tokens are independent: the plan may run the layer in token chunks.
  oom::ChunkDependency chunking() const { return oom::ChunkDependency::independent; }

  // What the HostExecutor reads: the boundary's width and the floats saved per activation class.
  std::uint64_t hidden() const { return h_; }
  std::uint64_t saved_floats(oom::ActivationClass c, std::uint64_t tokens) const {
    return c == oom::ActivationClass::other ? tokens * i_ : 0;
  }

  // Forward and backward over tokens [begin, end), weights bound where the plan put them.
  void forward(oom::HostLayerContext& ctx) const {
    const auto& w = ctx.weights[0];
    std::vector<float> pre(i_);
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      for (std::uint64_t j = 0; j < i_; ++j) {
        float s = 0;
        for (std::uint64_t k = 0; k < h_; ++k) s += oom::to_float(w[j * h_ + k]) * x[k];
        pre[j] = s;
      }
      if (float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)])
        std::copy(pre.begin(), pre.end(), saved + t * i_);
      if (ctx.output == nullptr) continue;  // recomputing the saved activation only
      for (std::uint64_t k = 0; k < h_; ++k) {
        float s = x[k];
        for (std::uint64_t j = 0; j < i_; ++j) s += oom::to_float(w[i_ * h_ + k * i_ + j]) * silu(pre[j]);
        ctx.output[t * h_ + k] = s;
      }
    }
  }
  void backward(oom::HostLayerContext& ctx) const {
    const auto& w = ctx.weights[0];
    auto& g = ctx.weight_grads[0];
    const float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)];
    std::vector<float> da(i_);
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      const float* dy = ctx.grad_output + t * h_;
      const float* pre = saved + t * i_;
      float* dx = ctx.grad_input + t * h_;
      std::fill(da.begin(), da.end(), 0.0f);
      for (std::uint64_t k = 0; k < h_; ++k) {
        dx[k] = dy[k];
        for (std::uint64_t j = 0; j < i_; ++j) {
          g[i_ * h_ + k * i_ + j] += dy[k] * silu(pre[j]);
          da[j] += oom::to_float(w[i_ * h_ + k * i_ + j]) * dy[k];
        }
      }
      for (std::uint64_t j = 0; j < i_; ++j) {
        const float s = 1.0f / (1.0f + std::exp(-pre[j]));
        const float dpre = da[j] * s * (1.0f + pre[j] * (1.0f - s));
        for (std::uint64_t k = 0; k < h_; ++k) {
          g[j * h_ + k] += dpre * x[k];
          dx[k] += oom::to_float(w[j * h_ + k]) * dpre;
        }
      }
    }
  }

 private:
  static float silu(float v) { return v / (1.0f + std::exp(-v)); }
  std::uint64_t h_, i_;
  std::vector<oom::StateSegment> segs_;
};
static_assert(oom::host_layer<ResidualMlp>);

// ---- the driver ----
struct Options {
  int layers = 8, steps = 20;
  std::uint64_t hidden = 64, inter = 256, tokens = 256;
  oom::Bytes gpu_budget{std::uint64_t{3} << 20}, host_budget{std::uint64_t{1} << 30};
  std::string profile;
  std::string retention;  // only this retention template and its mixes (LayerStackPlanner's names)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--help" || arg == "-h") {
      std::puts("oom-custom-layer [--layers N] [--hidden H] [--inter I] [--tokens T] [--steps S] [--gpu-budget BYTES] "
                "[--host-budget BYTES] [--profile FILE.json] [--retention NAME, e.g. 'offload-checkpoint, boundaries "
                "regenerated in groups of 2']");
      std::exit(0);
    }
    if (a + 1 >= argc) OOM_THROW(oom::Errc::invalid_argument, fmt::format("{} needs a value", arg));
    const char* text = argv[++a];
    const std::string v = text;
    if (arg == "--layers") o.layers = oom::examples::parse_int_count(arg, text);
    else if (arg == "--hidden") o.hidden = oom::examples::parse_count(arg, text);
    else if (arg == "--inter") o.inter = oom::examples::parse_count(arg, text);
    else if (arg == "--tokens") o.tokens = oom::examples::parse_count(arg, text);
    else if (arg == "--steps") o.steps = oom::examples::parse_int_count(arg, text, /*allow_zero=*/true);
    else if (arg == "--gpu-budget") o.gpu_budget = oom::parse_bytes(v);
    else if (arg == "--host-budget") o.host_budget = oom::parse_bytes(v);
    else if (arg == "--profile") o.profile = v;
    else if (arg == "--retention") o.retention = v;
    else OOM_THROW(oom::Errc::invalid_argument, fmt::format("unknown option '{}' (--help lists them)", arg));
  }
  return o;
}

std::vector<float> noise(std::uint64_t n, std::uint64_t seed, float scale) {
  std::vector<float> v(n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {  // a small xorshift, uniform in [-scale, scale]
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = scale * (static_cast<float>(s >> 40) / static_cast<float>(1ull << 24) * 2.0f - 1.0f);
  }
  return v;
}

int run(const Options& o) {
  std::vector<ResidualMlp> layers;
  for (int l = 0; l < o.layers; ++l) layers.emplace_back(l, o.hidden, o.inter);
  const oom::MachineProfile profile = o.profile.empty() ? oom::MachineProfile::h200(1) : oom::MachineProfile::from_file(o.profile);

  oom::PlanRequest req;
  req.gpu_budget = o.gpu_budget;
  req.host_budget = o.host_budget;
  req.workload = {1, o.tokens};
  req.retention = o.retention;
  const oom::LayerStackPlanner planner(oom::describe_layers(layers), profile, "residual MLP stack");
  const auto set = planner.plan(req);
  const oom::Plan& plan = set.plans.front();
  fmt::print("planned {} layers of {} x {} for {} tokens in {} of GPU memory ({} candidates, {} fit, {:.1f} ms):\n{}", o.layers,
             o.hidden, o.inter, o.tokens, o.gpu_budget, set.evaluated, set.feasible, set.search_s * 1e3, planner.describe(plan));

  std::vector<std::vector<float>> init;
  for (const auto& l : layers) init.push_back(noise(l.segments()[0].parameters(), init.size() + 1, 1.0f / std::sqrt(static_cast<float>(o.hidden))));
  // The host backend's arenas are what the plan predicts it needs, within the budgets asked for:
  // the executor's buffers come out of them, and one that does not fit yet waits for the frees
  // queued before it. A byte past the prediction would be refused (Errc::out_of_budget).
  oom::HostBackend backend({plan.predicted.gpu_peak, plan.predicted.host_peak, /*expose_races=*/false});
  oom::HostExecutorOptions eo;
  eo.adamw.lr = 3e-3f;
  oom::HostExecutor<ResidualMlp> exec(backend, layers, plan, init, eo);
  // Learn a fixed map: targets from inputs through a random residual transform.
  const auto mix = noise(o.hidden * o.hidden, 999, 1.0f / std::sqrt(static_cast<float>(o.hidden)));
  double first = 0, last = 0;
  for (int step = 1; step <= o.steps; ++step) {
    const auto x = noise(o.tokens * o.hidden, 1000 + static_cast<std::uint64_t>(step), 1.0f);
    std::vector<float> y(x);
    for (std::uint64_t t = 0; t < o.tokens; ++t)
      for (std::uint64_t k = 0; k < o.hidden; ++k)
        for (std::uint64_t j = 0; j < o.hidden; ++j) y[t * o.hidden + k] += mix[k * o.hidden + j] * std::tanh(x[t * o.hidden + j]);
    const double loss = exec.step(x, y);
    if (step == 1) first = loss;
    last = loss;
    fmt::print("step {:>3}/{}  loss {:.5f}\n", step, o.steps, loss);
  }
  if (o.steps == 0) return 0;
  fmt::print("loss {:.5f} -> {:.5f} over {} steps\n", first, last, o.steps);
  fmt::print("GPU arena peak {} (predicted {}); pinned peak {} (predicted {})\n", backend.device_arena().peak(),
             plan.predicted.gpu_peak, backend.pinned_arena().peak(), plan.predicted.host_peak);
  return std::isfinite(last) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const oom::Error& e) {
    std::fprintf(stderr, "oom-custom-layer: %s\n", e.what());
    return e.code() == oom::Errc::invalid_argument || e.code() == oom::Errc::parse ? 2 : 1;
  }
}
