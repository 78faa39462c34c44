// oom-custom-layer: how little code plugs your own layer into offloaded training. The layer is the
// user's (a residual MLP block, y = x + W2 silu(W1 x): residual_mlp.hpp on the CPU,
// residual_mlp_cuda.hpp on the GPU); OOM plans its stack against a GPU budget (LayerStackPlanner:
// what to keep resident, what to stream, offload or recompute, in which chunks) and trains it with
// the plan, which computes the same step as keeping everything on the GPU: on the host reference
// backend (HostExecutor, the default) or on the GPU (--backend cuda: CudaLayerExecutor).
// The planner prices a layer's declared FLOPs at the profile's GEMM rate, which describes neither
// the CPU layer nor the CUDA one's plain kernels; so a trial run of the first plan records a step,
// the layers' own rates are read from it (with_measured_rates) and the stack is planned again
// with them before training (--no-measure: the declared FLOPs alone).
//   oom-custom-layer [--backend host|cuda] [--layers N] [--hidden H] [--inter I] [--tokens T] [--steps S]
//                    [--gpu-budget BYTES] [--host-budget BYTES] [--profile FILE.json] [--retention NAME] [--no-measure]
//                    [--lr X] [--layer plain|cublas]  (the CUDA layer: plain kernels, or cuBLAS GEMMs on the tensor cores)
//                    [--trace FILE.json]  (the last step's work per resource as a Chrome trace, the plan's
//                                          predicted one beside it, and their busy times side by side)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/cli_numbers.hpp"
#include "common/config_layers.hpp"
#include "common/output_path.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/plan/layer_stack_planner.hpp"
#include "oom/runtime/host_executor.hpp"
#include "oom/runtime/timeline.hpp"
#include "custom_layer/residual_mlp.hpp"
#if OOM_CUSTOM_LAYER_HAS_CUDA
#include "custom_layer/residual_mlp_cublas.hpp"
#include "custom_layer/residual_mlp_cuda.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/cuda/device.hpp"
#include "oom/runtime/cuda_layer_executor.hpp"
#include <cuda_runtime_api.h>
#endif

namespace {

using oom::examples::ResidualMlp;

// ---- the driver ----
struct Options {
  int layers = 8, steps = 20;
  std::uint64_t hidden = 64, inter = 256, tokens = 256;
  // The GPU budget, 3 MiB unless given (8 MiB for --layer cublas, whose passes each take cuBLAS's
  // 4 MiB workspace): the default stack then streams and offloads.
  std::optional<oom::Bytes> gpu_budget;
  oom::Bytes host_budget{std::uint64_t{1} << 30};
  [[nodiscard]] oom::Bytes gpu_bytes() const { return gpu_budget.value_or(oom::Bytes{(layer == "cublas" ? std::uint64_t{8} : std::uint64_t{3}) << 20}); }
  std::string profile;
  std::string retention;  // only this retention template and its mixes (LayerStackPlanner's names)
  std::string backend = "host";
  bool measure = true;  // re-plan with the layers' rates measured on a trial step
  std::string layer = "plain";  // the CUDA layer: plain kernels (chunkable) or cuBLAS GEMMs
  float lr = 3e-3f;
  std::string trace;  // where the last training step's Chrome trace goes (empty: not recorded)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--help" || arg == "-h") {
      std::puts("oom-custom-layer [--backend host|cuda] [--layers N] [--hidden H] [--inter I] [--tokens T] [--steps S] [--gpu-budget BYTES, default 3 MiB, 8 MiB with --layer cublas] "
                "[--host-budget BYTES] (BYTES: a count, or a number with a unit, KiB to PiB or KB to PB, e.g. 1.5MiB; a fraction of a byte rounded down) [--profile FILE.json] [--retention NAME, e.g. 'offload-checkpoint, boundaries "
                "regenerated in groups of 2'] [--no-measure: plan with the declared FLOPs at the profile's GEMM rate, no trial step] "
                "[--layer plain|cublas: the CUDA layer's kernels, plain or cuBLAS GEMMs] [--lr X, default 3e-3] "
                "[--trace FILE.json: the last step's work per resource as a Chrome trace, FILE.predicted.json the plan's, and "
                "their busy times side by side]");
      std::exit(0);
    }
    if (arg == "--layer") {
      if (a + 1 >= argc) OOM_THROW(oom::Errc::invalid_argument, "--layer needs a value (plain or cublas)");
      const std::string v = argv[++a];
      if (v != "plain" && v != "cublas") OOM_THROW(oom::Errc::invalid_argument, fmt::format("--layer is plain or cublas, not '{}'", v));
#if !OOM_CUSTOM_LAYER_HAS_CUDA
      if (v == "cublas") OOM_THROW(oom::Errc::unsupported, "--layer cublas: this build has no CUDA (configure with -DOOM_ENABLE_CUDA=ON)");
#endif
      o.layer = v;
      continue;
    }
    if (arg == "--no-measure") {
      o.measure = false;
      continue;
    }
    const char* text = oom::examples::option_value(argc, argv, a, arg,
                                                   {"--layers", "--hidden", "--inter", "--tokens", "--steps", "--gpu-budget",
                                                    "--host-budget", "--profile", "--trace", "--lr", "--retention", "--backend"});
    const std::string v = text;
    if (arg == "--layers") {
      // As oom-train's --layers: a stack of more is not one a node trains (10^6 layers had built
      // for minutes, silently, at ~7 GB).
      o.layers = oom::examples::parse_int_count(arg, text);
      if (o.layers > oom::examples::max_config_layers)
        OOM_THROW(oom::Errc::invalid_argument,
                  fmt::format("--layers {} is more than {}, the most this example builds", o.layers, oom::examples::max_config_layers));
    }
    else if (arg == "--hidden") o.hidden = oom::examples::parse_count(arg, text);
    else if (arg == "--inter") o.inter = oom::examples::parse_count(arg, text);
    else if (arg == "--tokens") o.tokens = oom::examples::parse_count(arg, text);
    else if (arg == "--steps") o.steps = oom::examples::parse_int_count(arg, text, /*allow_zero=*/true);
    else if (arg == "--gpu-budget") o.gpu_budget = oom::examples::parse_size(arg, text);
    else if (arg == "--host-budget") o.host_budget = oom::examples::parse_size(arg, text);
    else if (arg == "--profile") o.profile = oom::examples::path_argument(arg, v);
    else if (arg == "--trace") {
      if (v.empty()) OOM_THROW(oom::Errc::invalid_argument, "--trace needs a file name");
      o.trace = v;
    }
    else if (arg == "--lr") {
      o.lr = oom::examples::parse_real(arg, text);
      if (!(o.lr > 0)) OOM_THROW(oom::Errc::invalid_argument, fmt::format("--lr must be positive, got '{}'", v));
    }
    else if (arg == "--retention") o.retention = v;
    else if (arg == "--backend") {
      if (v != "host" && v != "cuda") OOM_THROW(oom::Errc::invalid_argument, fmt::format("--backend is host or cuda, not '{}'", v));
#if !OOM_CUSTOM_LAYER_HAS_CUDA
      if (v == "cuda") OOM_THROW(oom::Errc::unsupported, "--backend cuda: this build has no CUDA (configure with -DOOM_ENABLE_CUDA=ON)");
#endif
      o.backend = v;
    }
    else OOM_THROW(oom::Errc::invalid_argument, fmt::format("unknown option '{}' (--help lists them)", arg));
  }
  if (!o.trace.empty())
    oom::examples::refuse_overlapping_paths({{"--trace", o.trace}, {"--trace (its prediction)", oom::predicted_trace_path(o.trace)}},
                                            {{"--profile", o.profile}});
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

// Step s's data: inputs, and targets from them through a fixed random residual transform (`mix`).
struct StepData {
  std::vector<float> x, y;
};
StepData step_data(const Options& o, const std::vector<float>& mix, int s) {
  StepData d{noise(o.tokens * o.hidden, 1000 + static_cast<std::uint64_t>(s), 1.0f), {}};
  d.y = d.x;
  std::vector<float> tx(d.x.size());
  for (std::size_t i = 0; i < d.x.size(); ++i) tx[i] = std::tanh(d.x[i]);
  for (std::uint64_t t = 0; t < o.tokens; ++t)
    for (std::uint64_t k = 0; k < o.hidden; ++k)
      for (std::uint64_t j = 0; j < o.hidden; ++j) d.y[t * o.hidden + k] += mix[k * o.hidden + j] * tx[t * o.hidden + j];
  return d;
}

std::vector<float> mix_of(const Options& o) { return noise(o.hidden * o.hidden, 999, 1.0f / std::sqrt(static_cast<float>(o.hidden))); }

// What --trace does with the recorded last step: its timeline and its wall seconds.
using TracedFn = std::function<void(const oom::Timeline&, double)>;

// A trial of the plan, or the training: `step(x, targets)` is one optimizer step returning the
// loss. A trial (trial != nullptr) runs two steps quietly and records the second into *trial;
// training runs o.steps, printing each, and with `traced` records the last and hands it over.
template <class Exec, class StepFn, class Report>
int train(const Options& o, Exec& exec, StepFn&& step, Report&& report, oom::Timeline* trial, const TracedFn& traced) {
  const auto mix = mix_of(o);
  if (trial != nullptr) {
    for (int s = 1; s <= 2; ++s) {  // the first warms up (pinning, first launches)
      if (s == 2) exec.record_next_step(trial);
      const StepData d = step_data(o, mix, s);
      const double loss = step(d.x, d.y);
      if (exec.last_step_skipped())
        OOM_THROW(oom::Errc::invalid_argument, fmt::format("the trial step {} had a non-finite loss ({}), so the layers' rates were not "
                                                           "measured: --no-measure plans with their declared FLOPs",
                                                           s, loss));
    }
    return 0;
  }
  double first = 0, last = 0;
  std::vector<double> ms;  // each step's wall time (step() returns once the step's work has run)
  oom::Timeline last_step;
  for (int s = 1; s <= o.steps; ++s) {
    const StepData d = step_data(o, mix, s);
    if (traced && s == o.steps) exec.record_next_step(&last_step);
    const auto t0 = std::chrono::steady_clock::now();
    const double loss = step(d.x, d.y);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (s == 1) first = loss;
    last = loss;
    fmt::print("step {:>3}/{}  loss {:.5f}  ({:.2f} ms)\n", s, o.steps, loss, ms.back());
  }
  if (o.steps == 0) return 0;
  fmt::print("loss {:.5f} -> {:.5f} over {} steps\n", first, last, o.steps);
  if (o.steps >= 2) {  // the first step warms up (pinning, first launches)
    std::vector<double> later(ms.begin() + 1, ms.end());
    std::sort(later.begin(), later.end());
    fmt::print("median step {:.3f} ms over steps 2-{}\n", later[later.size() / 2], o.steps);
  }
  report();
  if (traced) traced(last_step, ms.back() * 1e-3);
  return std::isfinite(last) ? 0 : 1;
}

template <class Backend>
void report_peaks(Backend& backend, const oom::Plan& plan) {
  fmt::print("GPU arena peak {} (predicted {}); pinned peak {} (predicted {})\n", backend.device_arena().peak(), plan.predicted.gpu_peak,
             backend.pinned_arena().peak(), plan.predicted.host_peak);
}

#if OOM_CUSTOM_LAYER_HAS_CUDA
// The same stack on the GPU: the CUDA layer, a CudaBackend (one cudaMalloc of the plan's GPU
// bytes, pinned slabs), and the loss on the GPU.
template <class Layer>
int run_on_gpu(const Options& o, const oom::Plan& plan, const std::vector<std::vector<float>>& init, const oom::LayerExecutorOptions& eo,
               oom::Timeline* trial, const TracedFn& traced) {
  if (oom::cuda::device_count() == 0)
    OOM_THROW(oom::Errc::unsupported, oom::cuda::backend_cuda_refusal(oom::cuda::why_no_device(), /*host_runs_it=*/o.layer != "cublas"));
  std::vector<Layer> layers;
  for (int l = 0; l < o.layers; ++l) layers.emplace_back(l, o.hidden, o.inter);
  // As on the host backend, the arenas are exactly what the plan predicts: an allocation that does
  // not fit waits for the frees queued on the streams before it (the GPU runs behind the host).
  oom::CudaBackend::Options bo;
  bo.device_budget = plan.predicted.gpu_peak;
  // The heap's room for fragments (reported below): half the budget again, and two of the layer's
  // workset, which a tight plan's first-fit heap may otherwise find no piece for (the cuBLAS
  // layer's holds cuBLAS's 4 MiB).
  bo.device_reserve = oom::Bytes{plan.predicted.gpu_peak.count() * 3 / 2 + 2 * layers.front().cost(plan.workload).workset.count()};
  bo.pinned_budget = plan.predicted.host_peak;
  // Pinned slabs of 16 MiB, or one segment's fp32 state or boundary if larger (none is split).
  const std::uint64_t largest = std::max(2 * o.hidden * o.inter, o.tokens * std::max(o.hidden, o.inter)) * sizeof(float);
  bo.pinned_slab = oom::Bytes{std::max<std::uint64_t>(std::uint64_t{16} << 20, (largest + 4095) / 4096 * 4096)};
  oom::CudaBackend backend(bo);
  oom::CudaLayerExecutor<Layer> exec(backend, layers, plan, init, eo);
  const auto target = oom::examples::device_floats(o.tokens * o.hidden);
  const std::vector<float>* want = nullptr;  // this step's targets, on the host
  // The loss on the GPU: the targets go up on the compute stream (ordered before the kernel).
  const oom::DeviceLossFn loss = [&](const float* y, float* grad, double* l, void* stream) {
    OOM_CUDA_CHECK(cudaMemcpyAsync(target.get(), want->data(), want->size() * sizeof(float), cudaMemcpyHostToDevice,
                                   static_cast<cudaStream_t>(stream)));
    oom::examples::mse_loss(y, target.get(), grad, o.tokens, o.hidden, l, stream);
  };
  return train(
      o, exec,
      [&](const std::vector<float>& x, const std::vector<float>& y) {
        want = &y;
        return exec.step(x, loss);
      },
      [&] {
        report_peaks(backend, plan);
        fmt::print("device heap: {} reserved, {} reached (the peak and the first-fit heap's fragments)\n", bo.device_reserve,
                   backend.device_high_water());
      },
      trial, traced);
}
int run_on_gpu(const Options& o, const oom::Plan& plan, const std::vector<std::vector<float>>& init, const oom::LayerExecutorOptions& eo,
               oom::Timeline* trial, const TracedFn& traced) {
  if (o.layer == "cublas") return run_on_gpu<oom::examples::CublasResidualMlp>(o, plan, init, eo, trial, traced);
  return run_on_gpu<oom::examples::CudaResidualMlp>(o, plan, init, eo, trial, traced);
}
#else
int run_on_gpu(const Options&, const oom::Plan&, const std::vector<std::vector<float>>&, const oom::LayerExecutorOptions&, oom::Timeline*,
               const TracedFn&) {
  OOM_THROW(oom::Errc::unsupported, "--backend cuda: this build has no CUDA");
}
#endif

// --trace: the recorded step as a Chrome trace at `path`, the plan's predicted step (the
// simulator's timeline of the same plan) at path.predicted.json, and their busy seconds per
// resource side by side.
void write_traces(const std::string& path, const oom::Timeline& measured, double wall_s, const oom::LayerStackPlanner& planner,
                  const oom::Plan& plan) {
  const std::string line = oom::write_step_traces(path, "last step", "oom-custom-layer, last step", measured, wall_s, planner.step_graph(plan));
  if (!line.empty()) fmt::print("{}\n", line);
}

int run(const Options& o) {
  if (!o.trace.empty()) {  // refused now, not after the training
    if (o.steps == 0) OOM_THROW(oom::Errc::invalid_argument, "--trace records the last training step, and --steps is 0");
    oom::examples::require_output_file("--trace", o.trace);
  }
  std::vector<ResidualMlp> layers;
  for (int l = 0; l < o.layers; ++l) layers.emplace_back(l, o.hidden, o.inter);
  const oom::MachineProfile profile = o.profile.empty() ? oom::MachineProfile::h200(1) : oom::MachineProfile::from_file(o.profile);

  oom::PlanRequest req;
  req.gpu_budget = o.gpu_bytes();
  req.host_budget = o.host_budget;
  req.workload = {1, o.tokens};
  req.retention = o.retention;
  if (o.layer == "cublas" && o.backend != "cuda")
    OOM_THROW(oom::Errc::invalid_argument, "--layer cublas runs on the GPU: add --backend cuda");
  // The planner's view of the stack: the CPU layer's (the plain CUDA layer's is the same), or the
  // cuBLAS layer's (its own workset, no chunks; parse() refuses it in a build without CUDA).
#if OOM_CUSTOM_LAYER_HAS_CUDA
  std::vector<oom::examples::CublasResidualMlp> gemm_layers;
  if (o.layer == "cublas")
    for (int l = 0; l < o.layers; ++l) gemm_layers.emplace_back(l, o.hidden, o.inter);
  const auto described = o.layer == "cublas" ? oom::describe_layers(gemm_layers) : oom::describe_layers(layers);
#else
  const auto described = oom::describe_layers(layers);
#endif
  const oom::LayerStackPlanner planner(described, profile, "residual MLP stack");
  const auto set = planner.plan(req);
  fmt::print("planned {} layers of {} x {} for {} tokens in {} of GPU memory ({} candidates, {} fit, {:.1f} ms):\n{}", o.layers,
             o.hidden, o.inter, o.tokens, o.gpu_bytes(), set.evaluated, set.feasible, set.search_s * 1e3,
             planner.describe(set.plans.front()));

  std::vector<std::vector<float>> init;
  // Uniform in [-s, s] by each matrix's fan-in (w1: hidden, w2: inter), w2's also over sqrt(2 x
  // layers) so that the residual stream keeps its scale through a deep stack (16 layers of 1024 x
  // 4096 diverged from a loss of 1,090 with w2 at 1 / sqrt(hidden)).
  for (const auto& l : layers) {
    const auto seed = init.size() + 1;
    auto w = noise(o.inter * o.hidden, seed, 1.0f / std::sqrt(static_cast<float>(o.hidden)));
    const auto w2 = noise(o.hidden * o.inter, 1000 + seed,
                          1.0f / std::sqrt(static_cast<float>(o.inter) * 2.0f * static_cast<float>(o.layers)));
    w.insert(w.end(), w2.begin(), w2.end());
    if (w.size() != l.segments()[0].parameters())
      OOM_THROW(oom::Errc::internal, fmt::format("{} initial weights for a segment of {}", w.size(), l.segments()[0].parameters()));
    init.push_back(std::move(w));
  }
  oom::LayerExecutorOptions eo;
  eo.adamw.lr = o.lr;
  // Runs `plan`: a trial that records its second step into *trial, or the training, whose last
  // step --trace records and sets beside the prediction of `pricing` (the planner that chose it).
  auto run_plan = [&](const oom::Plan& plan, oom::Timeline* trial, const oom::LayerStackPlanner& pricing) {
    TracedFn traced;
    if (!o.trace.empty() && trial == nullptr)
      traced = [&](const oom::Timeline& measured, double wall_s) { write_traces(o.trace, measured, wall_s, pricing, plan); };
    if (o.backend == "cuda") return run_on_gpu(o, plan, init, eo, trial, traced);
    // The host backend's arenas are what the plan predicts it needs, within the budgets asked
    // for: the executor's buffers come out of them, and one that does not fit yet waits for the
    // frees queued before it. A byte past the prediction would be refused (Errc::out_of_budget).
    oom::HostBackend backend({plan.predicted.gpu_peak, plan.predicted.host_peak, /*expose_races=*/false});
    oom::HostExecutor<ResidualMlp> exec(backend, layers, plan, init, eo);
    return train(
        o, exec, [&](const std::vector<float>& x, const std::vector<float>& y) { return exec.step(x, y); },
        [&] { report_peaks(backend, plan); }, trial, traced);
  };
  if (!o.measure || o.steps == 0) return run_plan(set.plans.front(), nullptr, planner);

  // The layers' own rates, from a recorded step of the first plan (from the same initial weights;
  // the training below starts from them again), then the stack planned with them.
  oom::Timeline trial;
  (void)run_plan(set.plans.front(), &trial, planner);
  const auto measured = oom::with_measured_rates(described, trial, req.workload);
  double lo_f = 1e300, hi_f = 0, lo_b = 1e300, hi_b = 0;
  for (const auto& d : measured) {
    lo_f = std::min(lo_f, d.measured.forward_flops_per_s);
    hi_f = std::max(hi_f, d.measured.forward_flops_per_s);
    lo_b = std::min(lo_b, d.measured.backward_flops_per_s);
    hi_b = std::max(hi_b, d.measured.backward_flops_per_s);
  }
  const oom::LayerStackPlanner replanner(measured, profile, "residual MLP stack");
  const auto reset = replanner.plan(req);
  const oom::Plan& plan = reset.plans.front();
  fmt::print("measured on a trial step: forward {:.3g}-{:.3g} GFLOP/s, backward {:.3g}-{:.3g} GFLOP/s a layer (the profile's GEMM "
             "rate at {} rows: {:.3g} GFLOP/s); the first plan's step re-priced at them: {:.4g} s (declared: {:.4g} s)\n",
             lo_f * 1e-9, hi_f * 1e-9, lo_b * 1e-9, hi_b * 1e-9, o.tokens, profile.gemm_flops.at(static_cast<double>(o.tokens)) * 1e-9, replanner.simulate(set.plans.front()).step_s,
             set.plans.front().predicted.step_s);
  fmt::print("planned again with the measured rates ({} candidates, {} fit, {:.1f} ms):\n{}", reset.evaluated, reset.feasible,
             reset.search_s * 1e3, replanner.describe(plan));
  return run_plan(plan, nullptr, replanner);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const oom::Error& e) {
    std::fprintf(stderr, "oom-custom-layer: %s\n", oom::user_message(e).c_str());
    // As oom-train and oom-plan: 3 where no plan fits the budgets, 2 for what was asked (an
    // argument, a file, a layer this build cannot run), 1 for a failure while running.
    switch (e.code()) {
      case oom::Errc::out_of_budget: return 3;
      case oom::Errc::invalid_argument:
      case oom::Errc::parse:
      case oom::Errc::unsupported: return 2;
      default: return 1;
    }
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "oom-custom-layer: out of host memory (an allocation failed: fewer or narrower layers, or a smaller "
                         "--host-budget)\n");
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oom-custom-layer: %s\n", e.what());
    return 1;
  }
}
