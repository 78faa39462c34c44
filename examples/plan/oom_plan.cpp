// oom-plan: plans a training step of a model on a machine within GPU and host budgets, and explains
// the plan: memory per claimant, policies, predicted time per resource, why it beat the runner-up.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "common/cli_numbers.hpp"
#include "common/config_layers.hpp"
#include "common/grad_staging.hpp"
#include "common/host_budget.hpp"
#include "common/least_budget.hpp"
#include "common/output_path.hpp"
#include "oom/core/error.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/core/log.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/plan/planner.hpp"
#if OOM_PLAN_HAS_CUDA
#include "oom/core/log.hpp"
#include "oom/runtime/cuda_causal_lm.hpp"
#else
#include "oom/model/host_decoder_layer.hpp"
#endif

namespace {

using oom::examples::parse_count;
using oom::examples::parse_int_count;
using oom::examples::parse_real;
using oom::examples::parse_size;

constexpr const char* usage = R"(usage: oom-plan --model config.json [options]
  --model PATH        Hugging Face config.json of the model (required)
  --gpus N            GPUs in the node (default 1)
  --gpu-mem SIZE      GPU memory budget per GPU, e.g. 80GiB (default: the profile's usable memory)
  --host-mem SIZE     host memory budget of the node, e.g. 1TiB (default: the profile's)
                      A SIZE is bytes, or a number with a unit: KiB to PiB, KB to PB, e.g. 3.84GiB or
                      0.5 GB (as the sizes printed here read); a fraction of a byte is rounded down
  --seq N             tokens per sequence (default 4096)
  --batch N           sequences per GPU per micro-batch (default 1)
  --micro-batches N   gradient accumulation steps (default 1)
  --max-grad-norm X   plan for clipping by global norm (as oom-train --max-grad-norm; 0, the
                      default, plans without): every update waits for the whole backward
  --moments DTYPE     AdamW moment precision: fp32 (default) or bf16, as oom-train --moments
  --profile PATH      calibrated MachineProfile JSON (from oom-calibrate)
  --machine NAME      built-in profile when no --profile: h200 (default), h100-80gb, rtx4090
  --candidates N      plans to show (default 3)
  --retention NAME    only plans of this retention template and its mixes nearer the loss (keep-all,
                      checkpoint, offload-checkpoint, keep-attention, offload-attention, and for
                      hybrid models hybrid-regenerate): what it would cost, or the least memory it needs
  --json PATH         write the chosen plan as JSON (the trainer's --plan input)
  --trace PATH        write the chosen plan's simulated step as Chrome trace JSON
  --grad-staging N    (CUDA builds) the CUDA executor's footprint with a pinned gradient staging
                      ring of N layers (default 3; 0: per parameter), as oom-train --grad-staging
  --no-keep-attention-state  (CUDA builds) its footprint and prediction rerunning the whole layer
                      where the plan keeps the attention state (the default recomputes around it),
                      as oom-train --no-keep-attention-state; the line saying what oom-train
                      would run then weighs no checkpoint around kept attention state
  --longest           (CUDA builds, one GPU) instead of planning --seq: the longest sequence, in
                      multiples of 1024 tokens, for which oom-train --backend cuda would find a plan
                      within the budgets (doubling from --seq, then bisection: a shorter sequence
                      is taken to fit where a longer one does), with that plan and its predicted step
  --most-layers       (CUDA builds, one GPU) instead of planning the config's depth: the most layers
                      of its widths for which oom-train --backend cuda would find a plan at --seq x
                      --batch within the budgets (doubling from the config's count, then bisection),
                      with that plan; layer i takes layer (i mod the config's count)'s kinds
)";

struct Args {
  std::string model;
  int gpus = 1;
  std::optional<oom::Bytes> gpu_mem, host_mem;
  std::uint64_t seq = 4096, batch = 1;
  int micro_batches = 1;
  double max_grad_norm = 0;
  oom::DType moments = oom::DType::fp32;
  std::string profile, machine = "h200";
  bool machine_given = false;
  int candidates = 3;
  std::string retention;
  std::string json_out, trace_out;
  std::optional<unsigned> grad_staging;  // the CUDA executor's options, for its footprint and prediction
  std::optional<bool> keep_attention_state;
  bool longest = false;
  bool most_layers = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (flag == "--longest") {
      a.longest = true;
      continue;
    }
    if (flag == "--most-layers") {
      a.most_layers = true;
      continue;
    }
    if (flag == "--keep-attention-state" || flag == "--no-keep-attention-state") {
      a.keep_attention_state = flag == "--keep-attention-state";
      continue;
    }
    const char* v = oom::examples::option_value(argc, argv, i, flag,
                                                {"--model", "--gpus", "--gpu-mem", "--host-mem", "--seq", "--batch", "--micro-batches",
                                                 "--max-grad-norm", "--moments", "--profile", "--machine", "--candidates",
                                                 "--retention", "--json", "--trace", "--grad-staging"});
    if (flag == "--model") a.model = oom::examples::path_argument(flag, v);
    else if (flag == "--gpus") a.gpus = parse_int_count(flag, v);
    else if (flag == "--gpu-mem") a.gpu_mem = parse_size(flag, v);
    else if (flag == "--host-mem") a.host_mem = parse_size(flag, v);
    else if (flag == "--seq") a.seq = parse_count(flag, v);
    else if (flag == "--batch") a.batch = parse_count(flag, v);
    else if (flag == "--micro-batches") a.micro_batches = parse_int_count(flag, v);
    else if (flag == "--max-grad-norm") a.max_grad_norm = parse_real(flag, v);
    else if (flag == "--moments") a.moments = oom::examples::parse_moments(flag, v);
    else if (flag == "--profile") a.profile = oom::examples::path_argument(flag, v);
    else if (flag == "--machine") {
      a.machine = v;
      a.machine_given = true;
    }
    else if (flag == "--candidates") a.candidates = parse_int_count(flag, v);
    else if (flag == "--retention") {
      if (*v == '\0') OOM_THROW(oom::Errc::invalid_argument, "--retention needs a template name (see --help)");
      a.retention = v;
    }
    else if (flag == "--json") oom::examples::require_output_file(flag, a.json_out = v);
    else if (flag == "--trace") oom::examples::require_output_file(flag, a.trace_out = v);
    else if (flag == "--grad-staging") a.grad_staging = static_cast<unsigned>(parse_int_count(flag, v, /*allow_zero=*/true));
    else OOM_THROW(oom::Errc::invalid_argument, fmt::format("unknown option '{}' (see --help)", flag));
  }
  if (a.model.empty()) OOM_THROW(oom::Errc::invalid_argument, "--model config.json is required (see --help)");
  if (a.machine_given && !a.profile.empty())
    OOM_THROW(oom::Errc::invalid_argument, fmt::format("--profile {} and --machine {} both name the machine: give one", a.profile, a.machine));
  oom::examples::refuse_overlapping_paths({{"--json", a.json_out}, {"--trace", a.trace_out}},
                                          {{"--model", a.model}, {"--profile", a.profile}});
  return a;
}

#if OOM_PLAN_HAS_CUDA
constexpr std::uint64_t longest_granule = 1024;
constexpr std::uint64_t longest_ceiling = std::uint64_t{1} << 27;  // 128M tokens: far past any GPU's memory
/// The search's ceiling for `batch` sequences: longest_ceiling, or less where batch of them would
/// pass the tokens a micro-batch may hold (oom::max_workload_tokens).
std::uint64_t longest_ceiling_for(std::uint64_t batch) {
  return std::min(longest_ceiling, oom::max_workload_tokens / batch / longest_granule * longest_granule);
}


// The largest value, a multiple of `granule` up to `ceiling`, for which `weigh(v)` is true (it
// prints each as it is weighed): from `start` doubling while it holds, or from the granule where
// `start` does not; then bisection between the last that held and the first that did not (a
// smaller value is taken to hold where a larger one does). lo 0: none held; hi 0: none failed.
struct LargestFound {
  std::uint64_t lo = 0, hi = 0;
};
template <class Weigh>
LargestFound largest_fitting(std::uint64_t start, std::uint64_t granule, std::uint64_t ceiling, Weigh&& weigh) {
  LargestFound f;
  if (weigh(start)) {
    for (f.lo = start; f.lo * 2 <= ceiling; f.lo *= 2)
      if (!weigh(f.lo * 2)) {
        f.hi = f.lo * 2;
        break;
      }
  } else {
    f.hi = start;
    if (start > granule && weigh(granule)) f.lo = granule;
  }
  if (f.lo == 0) return f;
  while (f.hi != 0 && f.hi - f.lo > granule) {
    const std::uint64_t mid = f.lo + (f.hi - f.lo) / granule / 2 * granule;
    if (weigh(mid)) f.lo = mid;
    else f.hi = mid;
  }
  return f;
}

constexpr std::uint64_t most_layers_ceiling = oom::examples::max_config_layers;

// --longest: the longest sequence, a multiple of longest_granule tokens, for which
// `would_run(seq, &line)` finds a plan (`line` then describes it, else says why none runs). From --seq (rounded up to the granule): doubling while it
// fits; where --seq itself does not, from the granule up to it. Then bisection between the last that
// fitted and the first that did not. Each sequence is printed as it is weighed. `would_run` returns
// the error's code (none: a plan); any but out_of_budget (a model the executor cannot run) ends the
// search as that error. Exit status 0 with a plan, 3 when none fits.
template <class WouldRun>
int longest_sequence(const Args& a, const std::string& budget_note, WouldRun&& would_run) {
  constexpr std::uint64_t granule = longest_granule;
  // What would_run said of the last sequence found to fit and the last found not to: every fit
  // weighed becomes lo below and every miss hi, so these are lo's plan and why hi has none.
  std::string fit_line, miss_line;
  const auto weigh = [&](std::uint64_t seq) {
    std::string line;
    const std::optional<oom::Errc> code = would_run(seq, &line);
    if (code && *code != oom::Errc::out_of_budget) OOM_THROW(*code, line);
    fmt::print("  {:>10} tokens x {}: {}\n", seq, a.batch, code ? fmt::format("nothing ({})", line) : std::string("fits"));
    std::fflush(stdout);
    (code ? miss_line : fit_line) = std::move(line);
    return !code;
  };
  const std::uint64_t start = (a.seq + granule - 1) / granule * granule;
  const auto [lo, hi] = largest_fitting(start, granule, longest_ceiling_for(a.batch), weigh);
  if (lo == 0) {
    fmt::print("\nlongest sequence oom-train --backend cuda would run ({}): none, not even {} tokens\n", budget_note,
               std::min(start, granule));
    return 3;
  }
  if (hi == 0) fmt::print("\nevery sequence up to {} tokens fits: the search stops there\n", lo);
  fmt::print("\nlongest sequence oom-train --backend cuda would run ({}): {} tokens x {} sequence(s): {}\n", budget_note, lo,
             a.batch, fit_line);
  if (hi != 0) fmt::print("{} tokens: nothing ({})\n", hi, miss_line);
  if (const std::uint64_t max_pos = oom::examples::max_position_embeddings(oom::read_json_file(a.model)); max_pos > 0 && lo > max_pos)
    fmt::print("note: longer than the config's max_position_embeddings ({}), the positions the model was trained for\n",
               max_pos);
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  oom::examples::fail_oversized_writes_with_errors();
  try {
    const Args a = parse(argc, argv);
#if !OOM_PLAN_HAS_CUDA
    if (a.grad_staging || a.keep_attention_state || a.longest || a.most_layers)
      OOM_THROW(oom::Errc::unsupported, "--grad-staging / --[no-]keep-attention-state / --longest / --most-layers describe the CUDA "
                                        "executor, which this build does not have (configure with -DOOM_ENABLE_CUDA=ON)");
#endif
    // The pairs oom-train refuses: no line may say it would run them.
    oom::examples::refuse_grad_staging_pairs(a.grad_staging.value_or(0), a.max_grad_norm,
                                             static_cast<std::uint64_t>(a.micro_batches));
    if (a.longest && a.gpus != 1)
      OOM_THROW(oom::Errc::invalid_argument, fmt::format("--longest searches what oom-train runs on one GPU; --gpus {} given", a.gpus));
    if (a.longest && (!a.json_out.empty() || !a.trace_out.empty()))
      OOM_THROW(oom::Errc::invalid_argument, "--longest only prints the longest sequence; plan it with --seq N for --json or --trace");
    if (a.most_layers && a.longest)
      OOM_THROW(oom::Errc::invalid_argument, "--most-layers and --longest exclude each other: one searches the depth at --seq, the "
                                             "other the sequence at the config's depth");
    if (a.most_layers && a.gpus != 1)
      OOM_THROW(oom::Errc::invalid_argument, fmt::format("--most-layers searches what oom-train runs on one GPU; --gpus {} given", a.gpus));
    if (a.most_layers && (!a.json_out.empty() || !a.trace_out.empty()))
      OOM_THROW(oom::Errc::invalid_argument, "--most-layers only prints the most layers; plan a config of that depth for --json or --trace");
#if OOM_PLAN_HAS_CUDA
    if (a.longest && a.seq > longest_ceiling_for(a.batch))
      OOM_THROW(oom::Errc::invalid_argument, fmt::format("--longest searches up to {} tokens a sequence at --batch {}; --seq {} starts past it",
                                                         longest_ceiling_for(a.batch), a.batch, a.seq));
#endif
    const auto spec = oom::ModelSpec::from_file(a.model);
    const auto profile = a.profile.empty() ? oom::MachineProfile::builtin(a.machine, a.gpus) : oom::MachineProfile::from_file(a.profile);

    oom::PlanRequest req;
    req.gpus = a.gpus;
    req.gpu_budget = a.gpu_mem.value_or(profile.gpu_memory);
    req.host_budget = a.host_mem.value_or(profile.host_memory);
    req.workload = {a.batch, a.seq};
    req.micro_batches = a.micro_batches;
    req.clip_grad_norm = a.max_grad_norm > 0;
    req.precision.moments = a.moments;
    req.candidates = a.candidates;
    req.retention = a.retention;

    fmt::print("model {}: {} layers, {} parameters ({} active), {} segments\n", a.model, spec.num_layers(),
               oom::examples::count_label(spec.total_parameters()), oom::examples::count_label(spec.active_parameters()),
               spec.segments().size());
    fmt::print("machine {} x{}; budgets: {} per GPU, {} host; workload {} x {} tokens per GPU, {} micro-batch(es){}\n\n",
               profile.name, a.gpus, req.gpu_budget, req.host_budget, a.batch, a.longest ? std::string("(longest)") : std::to_string(a.seq),
               a.micro_batches, req.clip_grad_norm ? ", gradients clipped by global norm" : "");

#if !OOM_PLAN_HAS_CUDA
    // The planner plans any model the config describes; this build's oom-train runs it on the host
    // decoder layer alone, which refuses some (sliding windows, attention biases, dense layers):
    // say so before the plans, as the CUDA build's "would run: nothing" line does.
    try {
      for (int l = 0; l < spec.num_layers(); ++l) (void)oom::HostDecoderLayer(spec, l);
    } catch (const oom::Error& e) {
      if (e.code() != oom::Errc::unsupported) throw;
      fmt::print("note: this build's oom-train (host backend only) cannot train this model: {}\n\n", e.message());
    }
#endif
    // A budget past the machine's is planned as asked (a bigger machine's plan, say), but what
    // oom-train runs on this profile's machine is held to its memory: say so before the plan.
    if (req.gpu_budget > profile.gpu_memory)
      fmt::print("note: --gpu-mem {} is more than the profile's GPU memory ({}): the plans below are for a GPU that large; oom-train "
                 "holds its budget to the device's free memory\n\n",
                 req.gpu_budget, profile.gpu_memory);
    if (req.host_budget > profile.host_memory)
      fmt::print("note: --host-mem {} is more than the profile's host memory ({}): the plans below are for a host that large\n\n",
                 req.host_budget, profile.host_memory);
    const oom::Planner planner(spec, profile, a.model, a.profile);
#if OOM_PLAN_HAS_CUDA
    oom::CudaCausalLmOptions executor;
    if (a.grad_staging) executor.grad_staging_layers = *a.grad_staging;
    if (a.keep_attention_state) executor.keep_attention_state = *a.keep_attention_state;
    executor.max_grad_norm = a.max_grad_norm;  // clipping stages every streamed gradient
    const auto executed_step_of = [&](const oom::ModelSpec& m, const oom::Planner& p, const oom::Plan& plan) {
      return p.simulate(oom::CudaCausalLm::as_executed(m, plan, executor)).step_s;
    };
    const auto executed_step = [&](const oom::Plan& p) { return executed_step_of(spec, planner, p); };
    // What oom-train --backend cuda would run (CudaCausalLm::fit) with the same model, sequences and
    // GPU budget at `seq` tokens a sequence: its request (one GPU, --batch sequences, 6 candidates,
    // its default host budget unless --host-mem) and its GPU headroom (1 GiB of the free memory,
    // here of the profile's). One line: the plan, or "nothing" and why.
    oom::PlanRequest train_req = req;  // at --moments: oom-train keeps fp32 or bf16 moments as asked
    train_req.candidates = 6;
    // oom-train's default host budget for model `m` (its build buffers depend on it), or why there
    // is none (a profile with too little host memory).
    const auto host_budget_for = [&](const oom::ModelSpec& m, std::string* error) {
      if (a.host_mem) return *a.host_mem;
      try {
        return oom::examples::default_host_budget(profile, oom::CudaCausalLm::build_buffer_bytes(m)).budget;
      } catch (const oom::Error& e) {
        *error = e.message();
        return oom::Bytes{};
      }
    };
    std::string host_error;
    train_req.host_budget = host_budget_for(spec, &host_error);
    const std::uint64_t headroom = oom::CudaCausalLm::gpu_headroom.count();
    const std::uint64_t usable = profile.gpu_memory.count() > headroom ? profile.gpu_memory.count() - headroom : 0;
    const oom::Bytes gpu_avail{std::min<std::uint64_t>(train_req.gpu_budget.count(), usable)};
    // The same for model `m` (planned by `p`) at `seq` tokens a sequence.
    const auto would_run_on = [&](const oom::ModelSpec& m, const oom::Planner& p, std::uint64_t seq,
                                  std::string* line) -> std::optional<oom::Errc> {
      try {
        std::string m_host_error;
        oom::PlanRequest r = train_req;
        r.host_budget = host_budget_for(m, &m_host_error);
        if (!m_host_error.empty()) OOM_THROW(oom::Errc::out_of_budget, m_host_error);
        r.workload = {a.batch, seq};
        const auto train_set = p.plan(r);
        oom::CudaFitOptions how;
        how.predict_step = [&](const oom::Plan& plan) { return executed_step_of(m, p, plan); };
        how.residency_order = p.residency_order(train_set.plans.front());
        const auto fit = oom::CudaCausalLm::fit(m, train_set.plans, gpu_avail, r.host_budget, executor, how);
        const auto [gpu, host] = oom::gpu_and_host(fit.footprint);
        const double step_s = executed_step_of(m, p, fit.plan);
        *line = fmt::format("its candidate plan {} ({}; {}; {} of {} segments resident, {} planned), {} on the GPU and {} pinned; "
                            "predicted step {} s",
                            fit.candidate + 1, fit.plan.retention_name,
                            oom::describe_chunks(m, fit.plan),
                            fit.plan.resident_segments.size(), m.segments().size(),
                            train_set.plans[fit.candidate].resident_segments.size(), gpu, host, oom::seconds_label(step_s));
        return std::nullopt;
      } catch (const oom::Error& e) {
        *line = e.message();  // why nothing runs
        return e.code();
      }
    };
    const auto would_run = [&](std::uint64_t seq, std::string* line) { return would_run_on(spec, planner, seq, line); };
    // oom-train keeps fp32 moments unless asked: the lines say what it would run with the flag.
    const std::string budget_note = fmt::format("host budget {}{}{}", train_req.host_budget, a.host_mem ? "" : ", its default on the profile's machine",
                                                a.moments == oom::DType::bf16 ? "; with --moments bf16" : "");
    if (a.longest) return longest_sequence(a, budget_note, would_run);
    if (a.most_layers) {
      // Each count's model is built from the config (its errors named), planned and fitted as
      // oom-train would; the host budget is oom-train's default for each (its build buffers grow
      // with the model) unless --host-mem.
      const oom::Json config = oom::read_json_file(a.model);
      const auto n = static_cast<std::uint64_t>(spec.num_layers());
      std::string fit_line, miss_line;
      const auto weigh = [&](std::uint64_t layers) {
        const std::string source = fmt::format("{} at {} layers", a.model, layers);
        const auto m = oom::ModelSpec::from_json(oom::examples::with_layers(config, static_cast<int>(layers)), source);
        const oom::Planner p(m, profile, source, a.profile);
        std::string line;
        const std::optional<oom::Errc> code = would_run_on(m, p, a.seq, &line);
        if (code && *code != oom::Errc::out_of_budget) OOM_THROW(*code, line);
        fmt::print("  {:>5} layers ({} parameters): {}\n", layers, oom::examples::count_label(m.total_parameters()),
                   code ? fmt::format("nothing ({})", line) : std::string("fits"));
        std::fflush(stdout);
        (code ? miss_line : fit_line) = fmt::format("{} parameters ({} active): {}", oom::examples::count_label(m.total_parameters()),
                                                    oom::examples::count_label(m.active_parameters()), line);
        return !code;
      };
      fmt::print("most layers of these widths oom-train --backend cuda would run at {} tokens x {} sequence(s):\n", a.seq, a.batch);
      const auto [lo, hi] = largest_fitting(n, 1, most_layers_ceiling, weigh);
      const std::string note = fmt::format("host budget {}{}", a.host_mem ? fmt::format("{}", *a.host_mem) : "oom-train's default for each",
                                           a.moments == oom::DType::bf16 ? "; with --moments bf16" : "");
      if (lo == 0) {
        fmt::print("\nmost layers oom-train --backend cuda would run ({}): none, not even 1\n", note);
        return 3;
      }
      if (hi == 0) fmt::print("\nevery count up to {} layers fits: the search stops there\n", lo);
      fmt::print("\nmost layers oom-train --backend cuda would run ({}): {} layers, {}\n", note, lo, fit_line);
      if (hi != 0) fmt::print("{} layers: nothing ({})\n", hi, miss_line);
      // With what this search planned with, so that oom-train plans the same way.
      std::string same;
      if (!a.profile.empty()) same += fmt::format(" --profile {}", a.profile);
      else if (a.machine != "h200") same += fmt::format(" --machine {}", a.machine);
      if (a.gpu_mem) same += fmt::format(" --gpu-mem {}B", a.gpu_mem->count());
      if (a.host_mem) same += fmt::format(" --host-mem {}B", a.host_mem->count());
      if (a.moments == oom::DType::bf16) same += " --moments bf16";
      if (a.micro_batches != 1) same += fmt::format(" --micro-batches {}", a.micro_batches);
      if (a.max_grad_norm > 0) same += fmt::format(" --max-grad-norm {}", a.max_grad_norm);
      if (a.grad_staging) same += fmt::format(" --grad-staging {}", *a.grad_staging);
      if (a.keep_attention_state) same += *a.keep_attention_state ? " --keep-attention-state" : " --no-keep-attention-state";
      fmt::print("train it: oom-train --backend cuda --config {} --layers {} --seq {} --batch {}{}\n", a.model, lo, a.seq, a.batch, same);
      return 0;
    }
#endif
    const auto set = oom::examples::plan_or_say_least(planner, req);
    fmt::print("searched {} candidates ({} within budget) in {:.3f} s\n\n", set.evaluated, set.feasible, set.search_s);
    for (std::size_t i = 0; i < set.plans.size(); ++i) {
      fmt::print("=== plan {}{} ===\n{}\n", i + 1, i == 0 ? " (chosen)" : "", planner.describe(set.plans[i]));
#if OOM_PLAN_HAS_CUDA
      // What OOM's own CUDA executor would take for this plan (exact, computed without a GPU).
      try {
        const auto fp = oom::CudaCausalLm::footprint(spec, set.plans[i], executor);
        const auto [gpu, host] = oom::gpu_and_host(fp);
        // Both against their budgets: the GPU's, and the pinned memory against oom-train's host
        // budget (its default, or --host-mem); without one, the pinned bytes are not judged.
        const bool gpu_over = gpu > req.gpu_budget, pinned_over = host_error.empty() && host > train_req.host_budget;
        std::string verdict;
        if (!host_error.empty())
          verdict = fmt::format("{} the GPU budget, the pinned bytes unjudged (no host budget: {})", gpu_over ? "OVER" : "within", host_error);
        else if (!gpu_over && !pinned_over)
          verdict = "within the budgets";
        else
          verdict = fmt::format("OVER {}{}{}", gpu_over ? "the GPU budget" : "", gpu_over && pinned_over ? " and " : "",
                                pinned_over ? fmt::format("the pinned budget of {}", train_req.host_budget) : "");
        fmt::print("CUDA executor (oom-train --backend cuda) would take {} on the GPU (resident {}, activations {}, worksets {}) "
                   "and {} pinned: {}; as it runs the plan, predicted step {} s\n\n",
                   gpu, fp[0], fp[1], fp[2], host, verdict, oom::seconds_label(executed_step(set.plans[i])));
      } catch (const oom::Error& e) {
        fmt::print("CUDA executor: cannot run this plan as it is ({})\n\n", e.message());
      }
#endif
    }
#if OOM_PLAN_HAS_CUDA
    if (a.gpus == 1) {
      std::string line;
      if (!would_run(a.seq, &line)) fmt::print("oom-train --backend cuda would run ({}): {}\n\n", budget_note, line);
      else fmt::print("oom-train --backend cuda would run: nothing ({})\n\n", line);
    }
#endif
    if (set.plans.size() > 1) fmt::print("why plan 1: {}", oom::Planner::compare(set.plans[0], set.plans[1]));
    if (!a.json_out.empty()) {
      oom::write_file_atomically(a.json_out, set.plans.front().to_json().dump(2) + "\n");
      fmt::print("plan written to {}\n", a.json_out);
    }
    if (!a.trace_out.empty()) {
      const auto graph = planner.step_graph(set.plans.front());
      oom::write_file_atomically(a.trace_out, oom::chrome_trace(graph, oom::simulate(graph)));
      fmt::print("simulated step trace written to {} (open in https://ui.perfetto.dev)\n", a.trace_out);
    }
    return 0;
  } catch (const oom::Error& e) {
    std::fflush(stdout);  // what was printed before it comes first, also through a pipe
    std::fprintf(stderr, "oom-plan: %s\n", oom::user_message(e).c_str());
    return e.code() == oom::Errc::out_of_budget ? 3 : 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "oom-plan: %s\n", e.what());
    return 2;
  }
}
