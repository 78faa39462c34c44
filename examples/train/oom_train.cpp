// oom-train: the example trainer. Reads a Hugging Face config.json (or uses the built-in tiny
// Qwen3-MoE), plans the step (or takes --plan), and trains on a token file (or the built-in
// corpus), printing progress, writing metrics as JSON lines and checkpoints that resume the same run.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "host_lm.hpp"
#include "common/cli_numbers.hpp"
#include "common/config_layers.hpp"
#include "common/grad_staging.hpp"
#include "common/host_budget.hpp"
#include "common/least_budget.hpp"
#include "common/output_path.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/io/checkpoint.hpp"
#include "oom/io/corpus.hpp"
#include "oom/io/json.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/io/token_file.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/plan/planner.hpp"
#include "oom/runtime/progress.hpp"
#include "oom/runtime/timeline.hpp"
#if OOM_TRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "oom/cuda/device.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/runtime/cuda_causal_lm.hpp"
#endif

namespace fs = std::filesystem;
using namespace oom;

namespace {

using oom::examples::default_host_budget;
using oom::examples::HostBudget;
using oom::examples::parse_moments;
using oom::examples::parse_count;
using oom::examples::parse_int_count;
using oom::examples::parse_real;
using oom::examples::parse_size;
using oom::examples::path_argument;
using oom::examples::require_output_file;

// Console lines that outlive their reader. With `oom-train ... | tee run.log`, Ctrl-C ends tee at
// once, so the next line (the checkpoint's) went into a closed pipe and its SIGPIPE killed the run
// before that checkpoint was named. SIGPIPE is ignored (main), and a stream a write fails on is
// not written again: the run goes on, its record in metrics.jsonl and its checkpoints.
bool g_stdout_lost = false, g_stderr_lost = false;
void say_to(std::FILE* f, std::string_view text) {
  bool& lost = f == stderr ? g_stderr_lost : g_stdout_lost;
  if (lost) return;
  if (std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0) return;
  lost = true;
  if (f != stderr)
    say_to(stderr, fmt::format("oom-train: writing to standard output failed ({}); the run goes on without its lines there "
                               "(metrics.jsonl has every step)\n", std::strerror(errno)));
}
template <class... T>
void say(fmt::format_string<T...> format, T&&... args) {
  say_to(stdout, fmt::format(format, std::forward<T>(args)...));
}
template <class... T>
void say(std::FILE* f, fmt::format_string<T...> format, T&&... args) {
  say_to(f, fmt::format(format, std::forward<T>(args)...));
}

// The built-in model: a 4-layer Qwen3-MoE with 8 experts over byte-level tokens (3.9M parameters),
// small enough to learn the built-in corpus on a laptop CPU in a minute.
constexpr std::string_view builtin_config = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "model_type": "qwen3_moe",
  "vocab_size": 256,
  "hidden_size": 256,
  "intermediate_size": 512,
  "moe_intermediate_size": 128,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 2,
  "head_dim": 32,
  "num_experts": 8,
  "num_experts_per_tok": 2,
  "norm_topk_prob": true,
  "decoder_sparse_step": 1,
  "mlp_only_layers": [],
  "hidden_act": "silu",
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "max_position_embeddings": 4096,
  "attention_bias": false,
  "tie_word_embeddings": false,
  "router_aux_loss_coef": 0.001,
  "torch_dtype": "float32"
}
)";

constexpr const char* usage = R"(usage: oom-train [options]
Model and data
  --config PATH        Hugging Face config.json (default: the one beside --init-from's weights, else
                       the built-in 4-layer, 8-expert Qwen3-MoE)
  --layers N           the config's widths at N decoder layers (layer i of the kinds of its layer
                       i mod its count; `oom-plan --most-layers` finds the most that run); the
                       checkpoints' config.json says N
  --data PATH          token file (OOMTOK01; see include/oom/io/token_file.hpp)
                       (default: the built-in corpus, generated into the run directory)
  --init-from PATH     start from these weights instead of a random init: a safetensors file, a
                       sharded checkpoint's model.safetensors.index.json, or a Hugging Face model
                       directory holding either (HF tensor names)
  --seq N              tokens per sequence (default 256)
  --batch B            sequences per micro-batch, run together (default 1): each its own window
                       of the data, attention within each; weights cross PCIe once for all B
  --micro-batches K    micro-batches per optimizer step, run one after another, their gradients
                       accumulated (default 1); a step trains on K x B sequences, as many
                       windows of the data, which must hold that many windows of --seq
  --steps N            optimizer steps to reach (default 200)
  --seed N             initial weights and data order (default 0)
Optimizer (AdamW, as torch.optim.AdamW over all parameters)
  --lr X               learning rate (default 3e-3)
  --weight-decay X     (default 0.01)
  --warmup N           linear warmup over the first N updates: update t uses lr * min(1, t / N) (default 0)
  --schedule NAME      constant (default) or cosine: after the warmup, min-lr + (lr - min-lr) * 0.5
                       (1 + cos(pi p)) with p going from 0 to 1 over the remaining updates up to --steps
  --min-lr X           the cosine schedule's floor (default 0; at most --lr; cosine only)
  --max-grad-norm X    clip the global gradient norm to X as torch.nn.utils.clip_grad_norm_ (default 0:
                       no clipping; the updates then wait for the whole backward; on cuda the gradients
                       are staged per parameter, as --grad-staging 0)
  --moments DTYPE      AdamW moments kept in fp32 (default) or bf16: 4 bytes a parameter less of
                       host (streamed) or GPU (resident) state, 18 -> 14 with the fp32 gradient; the
                       moments are rounded to bf16 after each update (the step is then not the fp32
                       one). --resume keeps the checkpoint's moments (another --moments is refused)
Plan
  --plan PATH          use this plan (from oom-plan --json, for this model, one GPU) instead of
                       planning; it runs within its own budgets (not with --gpu-mem / --host-mem)
  --retention NAME     plan only with this retention template and its mixes nearer the loss (as
                       oom-plan --retention: keep-all, checkpoint, offload-checkpoint, keep-attention,
                       offload-attention, hybrid-regenerate for hybrid models); cuda runs a plan that
                       regenerates boundaries checkpointed (its executor does not regenerate yet)
  --profile PATH       calibrated machine profile for the planner (default: built-in, see --machine)
  --machine NAME       built-in profile: h200 (default), h100-80gb, rtx4090
  --gpu-mem SIZE       device memory budget (default: the profile's GPU memory on cuda, 1GiB on host)
  --host-mem SIZE      host memory budget (default: the profile's, or this machine's (its memory
                       cgroup's limit) where it has less, less what building the model holds
                       (cuda: one segment; host: the fp32 initial weights) and a tenth (at least
                       4 GiB, at most a quarter) for the process and the OS)
                       A SIZE is bytes, or a number with a unit: KiB to PiB, KB to PB, e.g. 3.84GiB
                       or 0.5 GB (as oom-plan prints sizes); a fraction of a byte is rounded down
  --backend NAME       auto (default: cuda when this build has CUDA and a GPU is present, else host),
                       cuda, or host (the CPU reference backend; small models)
  --grad-staging N     cuda: stage gradients on the host in a ring of N layers' pinned buffers
                       (default 3; 0: one pinned fp32 buffer per streamed parameter)
  --no-keep-attention-state  cuda: where the plan keeps (or offloads) a layer's attention output
                       and softmax statistics but recomputes the rest, rerun the whole layer
                       (attention too) instead of rerunning the layer around them (the default,
                       --keep-attention-state)
  --planned-residency  cuda: keep the planner's resident segments where checkpointing a plan for
                       the CUDA executor leaves GPU memory unused, instead of making more segments
                       resident, in the planner's order, as far as they fit and shorten the
                       predicted step (the default)
  --no-bucketed-expert-gemms  cuda: issue the per-expert GEMMs of varying size through
                       cublasGemmEx, which picks an algorithm on the host for every row count it
                       has not seen, instead of through cuBLASLt with one algorithm per
                       power-of-two size bucket (the default, --bucketed-expert-gemms)
  --zero-unrouted-expert-grads  cuda: zero the gradient of every routed expert no token reached
                       and let the optimizer read those zeros, instead of leaving it unwritten
                       and updating the expert with a zero gradient unread (the default,
                       --leave-unrouted-expert-grads; the same bits either way)
  --no-gradient-check  cuda: do not look for NaN or infinite gradients (the default checks every
                       gradient as the optimizer reads it, and each streamed layer's in one more
                       pass on the GPU, and stops with the segment or layer named; with
                       --max-grad-norm the norm check refuses them before any update anyway)
  --no-overlap-updates  cuda: run each layer's resident AdamW on the compute stream after its
                       backward, instead of on a lower-priority stream beside the next layers'
                       backward (the default without --max-grad-norm; the same bits either way)
Run
  --out DIR            run directory: checkpoints, metrics.jsonl (default runs/oom-train)
  --resume             continue from the run directory's latest checkpoint
  --overwrite          start afresh even if the run directory holds checkpoints (they are removed
                       once the new model is built: a run refused before then leaves them)
  --checkpoint-every N steps between checkpoints (default 50; one is always written at the end;
                       0: none at all, e.g. for throughput runs of large models)
  --keep N             checkpoints kept (default 2)
  --log-every N        steps between progress lines (default 10)
  --step-progress S    a step still running after S whole seconds reports its layer passes, at most
                       every S/2 seconds (default 30; 0: every pass)
  --trace-step N       record step N's work per resource: Chrome trace JSON (--trace, default
                       <out>/trace-step-N.json) and measured vs predicted busy time per resource
  --trace PATH         where --trace-step writes
  --save-initial       also write checkpoint 0 (the initial weights) before the first step
  --dump-batches PATH  write every step's window (seq + 1 tokens) to a token file, for reference
                       runs (scripts/compare_train_pytorch.py)
  --on-nonfinite WHAT  skip (default) or stop when a step's loss is NaN/Inf
  --max-skips N        consecutive skipped steps before the run stops anyway (default 5)
Exit status: 0 done, 2 bad input, 3 no plan fits the budget, 4 stopped on a non-finite loss,
130 interrupted (a checkpoint is written first).
)";

struct Args {
  std::string config, data, init_from, plan, profile, machine = "h200", backend = "auto", retention;
  bool machine_given = false;
  std::optional<int> layers;  // --layers: the config at another depth
  std::uint64_t seq = 256, batch = 1, steps = 200, seed = 0, micro_batches = 1;
  float lr = 3e-3f, weight_decay = 0.01f, max_grad_norm = 0.0f, min_lr = 0.0f;
  std::optional<oom::DType> moments;  // AdamW moments: fp32 (default) or bf16
  std::uint64_t warmup = 0;
  bool cosine = false;
  bool min_lr_given = false;
  std::optional<Bytes> gpu_mem, host_mem;
  std::optional<std::uint64_t> grad_staging;  // CUDA: pinned gradient staging ring of this many layers (0: per parameter)
  std::optional<bool> keep_attention_state;   // CUDA: recompute around kept attention output + LSE
  std::optional<bool> bucketed_expert_gemms;  // CUDA: one cuBLASLt algorithm per size bucket
  std::optional<bool> leave_unrouted_expert_grads;  // CUDA: idle experts' gradients not written
  std::optional<bool> overlap_updates;              // CUDA: resident AdamW beside the backward
  std::optional<bool> check_gradients;              // CUDA: flag NaN/inf gradients
  bool planned_residency = false;                   // CUDA: no more resident segments than planned
  double step_progress_s = 30;        // a step running this long reports its layer passes
  fs::path out = "runs/oom-train";
  bool resume = false, overwrite = false, save_initial = false, seed_given = false;
  std::string dump_batches, trace;
  std::uint64_t trace_step = 0;
  std::uint64_t checkpoint_every = 50, log_every = 10, max_skips = 5;
  int keep = 2;
  bool stop_on_nonfinite = false;
};

// No file the run writes outside its run directory (--trace and the prediction beside it,
// --dump-batches) may be one it reads or another it writes: refused before any work.
void refuse_overlapping_paths(const Args& a) {
  std::vector<oom::examples::PathArgument> inputs = {
      {"--config", a.config}, {"--data", a.data}, {"--plan", a.plan}, {"--profile", a.profile}, {"--init-from", a.init_from}};
  if (!a.init_from.empty()) {
    // What --init-from reads where it names a directory, and the config beside its weights that
    // stands in for --config.
    std::error_code ec;
    const fs::path from(a.init_from);
    const bool is_dir = fs::is_directory(from, ec);
    const fs::path dir = is_dir ? from : from.parent_path();
    if (is_dir)
      for (const char* weights : {"model.safetensors", "model.safetensors.index.json"}) inputs.push_back({"--init-from", dir / weights});
    if (a.config.empty()) inputs.push_back({"--init-from (its config.json)", dir / "config.json"});
  }
  // The run directory's own files: the built-in corpus the run trains on, its metrics, `latest`
  // and the lock (a --dump-batches onto the corpus had left a run that could not resume).
  if (a.data.empty()) inputs.push_back({"the built-in corpus (--out)", a.out / "builtin-corpus.tok"});
  for (const char* own : {"metrics.jsonl", "latest", ".lock"}) inputs.push_back({fmt::format("the run's {} (--out)", own), a.out / own});
  const fs::path predicted = a.trace.empty() ? fs::path() : predicted_trace_path(a.trace);
  const std::vector<oom::examples::PathArgument> outputs = {
      {"--trace", a.trace}, {"--trace (its prediction)", predicted}, {"--dump-batches", a.dump_batches}};
  oom::examples::refuse_overlapping_paths(outputs, inputs);
  // Nor a checkpoint's name or inside one ("checkpoint-<digits>", and the ".partial" and ".old" a
  // save makes of it), which the run writes whole, replaces and prunes.
  const auto checkpoint_like = [](const std::string& name) {
    std::string_view n = name;
    for (const std::string_view suffix : {".partial", ".old"})
      if (n.ends_with(suffix)) n.remove_suffix(suffix.size());
    return checkpoint_step(n).has_value();
  };
  std::error_code ec;
  const fs::path run = fs::weakly_canonical(fs::absolute(a.out, ec), ec);
  for (const auto& o : outputs) {
    if (o.path.empty()) continue;
    const fs::path at = fs::weakly_canonical(fs::absolute(o.path, ec), ec);
    const fs::path rel = at.lexically_relative(run);
    if (!rel.empty() && checkpoint_like(rel.begin()->string()))
      OOM_THROW(Errc::invalid_argument, fmt::format("{} {} is the run's checkpoint {} or inside it, which the run writes whole, replaces "
                                                    "and prunes: name a file elsewhere", o.flag, o.path.string(), (run / *rel.begin()).string()));
  }
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (flag == "--resume") { a.resume = true; continue; }
    if (flag == "--overwrite") { a.overwrite = true; continue; }
    if (flag == "--save-initial") { a.save_initial = true; continue; }
    if (flag == "--keep-attention-state") { a.keep_attention_state = true; continue; }
    if (flag == "--no-keep-attention-state") { a.keep_attention_state = false; continue; }
    if (flag == "--bucketed-expert-gemms") { a.bucketed_expert_gemms = true; continue; }
    if (flag == "--no-bucketed-expert-gemms") { a.bucketed_expert_gemms = false; continue; }
    if (flag == "--leave-unrouted-expert-grads") { a.leave_unrouted_expert_grads = true; continue; }
    if (flag == "--zero-unrouted-expert-grads") { a.leave_unrouted_expert_grads = false; continue; }
    if (flag == "--no-overlap-updates") { a.overlap_updates = false; continue; }
    if (flag == "--no-gradient-check") { a.check_gradients = false; continue; }
    if (flag == "--planned-residency") { a.planned_residency = true; continue; }
    const char* v = oom::examples::option_value(
        argc, argv, i, flag,
        {"--config", "--layers", "--data", "--init-from", "--seq", "--micro-batches", "--batch", "--steps", "--seed", "--lr", "--weight-decay",
         "--max-grad-norm", "--moments", "--warmup", "--min-lr", "--schedule", "--plan", "--retention", "--profile", "--machine",
         "--gpu-mem", "--host-mem", "--grad-staging", "--backend", "--dump-batches", "--trace-step", "--trace", "--out",
         "--checkpoint-every", "--keep", "--log-every", "--step-progress", "--max-skips", "--on-nonfinite"});
    if (flag == "--config") a.config = path_argument(flag, v);
    else if (flag == "--layers") a.layers = parse_int_count(flag, v);
    else if (flag == "--data") a.data = path_argument(flag, v);
    else if (flag == "--init-from") a.init_from = path_argument(flag, v);
    else if (flag == "--seq") a.seq = parse_count(flag, v);
    else if (flag == "--micro-batches") a.micro_batches = static_cast<std::uint64_t>(parse_int_count(flag, v));
    else if (flag == "--batch") a.batch = parse_count(flag, v);
    else if (flag == "--steps") a.steps = parse_count(flag, v);
    else if (flag == "--seed") a.seed = parse_count(flag, v, true), a.seed_given = true;
    else if (flag == "--lr") a.lr = parse_real(flag, v);
    else if (flag == "--weight-decay") a.weight_decay = parse_real(flag, v);
    else if (flag == "--max-grad-norm") a.max_grad_norm = parse_real(flag, v);
    else if (flag == "--moments") a.moments = parse_moments(flag, v);
    else if (flag == "--warmup") a.warmup = parse_count(flag, v, /*allow_zero=*/true);
    else if (flag == "--min-lr") {
      a.min_lr = parse_real(flag, v);
      a.min_lr_given = true;
    }
    else if (flag == "--schedule") {
      const std::string_view w = v;
      if (w != "constant" && w != "cosine") OOM_THROW(Errc::invalid_argument, fmt::format("--schedule is constant or cosine, got '{}'", w));
      a.cosine = w == "cosine";
    }
    else if (flag == "--plan") a.plan = path_argument(flag, v);
    else if (flag == "--retention") {
      if (*v == '\0') OOM_THROW(Errc::invalid_argument, "--retention needs a template name (see --help)");
      a.retention = v;
    }
    else if (flag == "--profile") a.profile = path_argument(flag, v);
    else if (flag == "--machine") {
      a.machine = v;
      a.machine_given = true;
    }
    else if (flag == "--gpu-mem") a.gpu_mem = parse_size(flag, v);
    else if (flag == "--host-mem") a.host_mem = parse_size(flag, v);
    else if (flag == "--grad-staging") a.grad_staging = static_cast<std::uint64_t>(parse_int_count(flag, v, /*allow_zero=*/true));
    else if (flag == "--backend") a.backend = v;
    else if (flag == "--dump-batches") a.dump_batches = path_argument(flag, v);
    else if (flag == "--trace-step") a.trace_step = parse_count(flag, v);
    else if (flag == "--trace") a.trace = path_argument(flag, v);
    else if (flag == "--out") a.out = path_argument(flag, v);
    else if (flag == "--checkpoint-every") a.checkpoint_every = parse_count(flag, v, /*allow_zero=*/true);
    else if (flag == "--keep") a.keep = parse_int_count(flag, v);
    else if (flag == "--log-every") a.log_every = parse_count(flag, v);
    else if (flag == "--step-progress") a.step_progress_s = static_cast<double>(parse_count(flag, v, /*allow_zero=*/true));
    else if (flag == "--max-skips") a.max_skips = parse_count(flag, v);
    else if (flag == "--on-nonfinite") {
      const std::string_view w = v;
      if (w != "skip" && w != "stop") OOM_THROW(Errc::invalid_argument, fmt::format("--on-nonfinite is skip or stop, got '{}'", w));
      a.stop_on_nonfinite = w == "stop";
    } else OOM_THROW(Errc::invalid_argument, fmt::format("unknown option '{}' (see --help)", flag));
  }
  if (a.backend != "host" && a.backend != "cuda" && a.backend != "auto")
    OOM_THROW(Errc::invalid_argument, fmt::format("--backend is auto, cuda or host, got '{}'", a.backend));
  if (a.resume && a.overwrite) OOM_THROW(Errc::invalid_argument, "--resume and --overwrite exclude each other");
  if (a.machine_given && !a.profile.empty())
    OOM_THROW(Errc::invalid_argument, fmt::format("--profile {} and --machine {} both name the machine: give one", a.profile, a.machine));
  if (a.resume && !a.init_from.empty())
    OOM_THROW(Errc::invalid_argument, "--resume and --init-from exclude each other: a resumed run's weights are its checkpoint's");
  // The cosine schedule's floor: without it there is none, and above --lr it would be a climb.
  if (a.min_lr_given && !a.cosine)
    OOM_THROW(Errc::invalid_argument, "--min-lr is the cosine schedule's floor; the constant schedule has none (add --schedule cosine)");
  if (a.min_lr > a.lr)
    OOM_THROW(Errc::invalid_argument, fmt::format("--min-lr {} is above --lr {}: the cosine schedule would raise the learning rate to it",
                                                  a.min_lr, a.lr));
  if (a.resume && (a.save_initial || !a.dump_batches.empty()))
    OOM_THROW(Errc::invalid_argument, "--save-initial and --dump-batches describe a run from its start; not with --resume");
  // Output paths are refused now, not after the training they would end.
  if (!a.trace.empty() && a.trace_step == 0)
    OOM_THROW(Errc::invalid_argument, "--trace names where --trace-step's trace goes; pass --trace-step N as well");
  if (a.trace_step > a.steps)
    OOM_THROW(Errc::invalid_argument, fmt::format("--trace-step {} is past the run's last step (--steps {})", a.trace_step, a.steps));
  if (!a.plan.empty() && (a.gpu_mem || a.host_mem))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: a plan given with --plan runs within the budgets it was made for; plan "
                                                  "again with oom-plan to change them", a.gpu_mem ? "--gpu-mem" : "--host-mem"));
  refuse_overlapping_paths(a);
  return a;
}

std::string read_text(const fs::path& p) {
  // (An ifstream opens a directory and reads nothing from it: a --config naming one had been
  // reported as JSON ending at its first byte.)
  if (std::error_code ec; fs::is_directory(p, ec)) OOM_THROW(Errc::io, fmt::format("{}: is a directory, not a file", p.string()));
  std::ifstream f(p, std::ios::binary);
  if (!f) OOM_THROW(Errc::io, fmt::format("{}: cannot open", p.string()));
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::atomic<int> g_signal{0};
// The first SIGINT/SIGTERM stops the run after the step in flight, with a checkpoint; a second one
// ends it at once (the default action again: a step may run for minutes). A checkpoint being
// written when it comes is a .partial directory `latest` never names.
extern "C" void on_signal(int sig) {
  const int saved_errno = errno;  // the interrupted code's, which write() may change
  g_signal.store(sig);
  std::signal(sig, SIG_DFL);
  static constexpr char note[] = "\noom-train: stopping after this step; signal again to stop at once\n";
  (void)!::write(STDERR_FILENO, note, sizeof note - 1);  // async-signal-safe, unlike stdio
  errno = saved_errno;
}

/// The process's resident set now (VmRSS) and its high-water mark (VmHWM, what the peer baselines
/// report as their host memory peak), read in one pass so the peak is never below the current;
/// zeros where /proc does not say.
struct HostRss {
  Bytes now, peak;
};
HostRss host_rss() {
  HostRss r;
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmRSS:", 0) == 0) r.now = Bytes{std::stoull(line.substr(6)) * 1024};
    if (line.rfind("VmHWM:", 0) == 0) r.peak = Bytes{std::stoull(line.substr(6)) * 1024};
  }
  return r;
}

std::string duration(double s) {
  const auto t = static_cast<long long>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{}:{:02}", t / 60, t % 60);
}

std::string mib(Bytes b) { return fmt::format("{:.1f}", static_cast<double>(b.count()) / (1 << 20)); }

// Keeps the metrics lines of steps <= `step` (a resumed run rewrites what the killed one logged past
// its last checkpoint), atomically. A line that is not a record with a step is dropped and counted:
// a last line without its newline is a write a kill cut short; any other is damage, and the
// history after it is kept (it had ended the scan, dropping every later step without a word).
struct MetricsKept {
  std::uint64_t damaged = 0;     ///< complete lines dropped as unreadable
  std::uint64_t first_line = 0;  ///< the first of them, counted from 1
};
MetricsKept truncate_metrics(const fs::path& path, std::uint64_t step) {
  MetricsKept r;
  std::error_code ec;
  if (!fs::exists(path, ec)) return r;
  std::ifstream in(path);
  std::string line, kept;
  for (std::uint64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const bool complete = !in.eof();  // getline stopped at a newline
    try {
      const Json j = Json::parse(line, path.string());
      const Json* s = j.find("step");
      if (s == nullptr) OOM_THROW(Errc::parse, "no step");
      if (s->as_uint64() <= step) kept += line + "\n";
    } catch (const Error&) {
      if (complete && r.damaged++ == 0) r.first_line = number;
    }
  }
  write_file_atomically(path, kept);
  return r;
}

#if OOM_TRAIN_HAS_CUDA
CudaCausalLmOptions cuda_options(const Args& a) {
  CudaCausalLmOptions o;
  if (a.grad_staging) o.grad_staging_layers = static_cast<unsigned>(*a.grad_staging);
  o.max_grad_norm = a.max_grad_norm;
  if (a.keep_attention_state) o.keep_attention_state = *a.keep_attention_state;
  if (a.bucketed_expert_gemms) o.bucketed_expert_gemms = *a.bucketed_expert_gemms;
  if (a.leave_unrouted_expert_grads) o.leave_unrouted_expert_grads = *a.leave_unrouted_expert_grads;
  if (a.overlap_updates) o.overlap_updates = *a.overlap_updates;
  if (a.check_gradients) o.check_gradients = *a.check_gradients;
  return o;
}

// The device's free memory; nothing where it cannot be read.
std::optional<Bytes> free_gpu_memory() {
  std::size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return std::nullopt;
  return Bytes{free_b};
}

// The GPU bytes the executor may take under `budget`: the budget, or the device's free memory less
// CudaCausalLm::gpu_headroom (cuBLAS workspaces and module loads outside the arena) where that is less.
Bytes usable_gpu_memory(Bytes budget, std::optional<Bytes> free) {
  if (!free) return budget;
  const Bytes h = CudaCausalLm::gpu_headroom;
  const Bytes usable{free->count() > h.count() ? free->count() - h.count() : 0};
  return usable < budget ? usable : budget;
}

// The planner's memory model is per activation class; the CUDA executor keeps, offloads or
// recomputes a layer's saved buffer as a whole, so it may need more than the plan predicts:
// CudaCausalLm::fit takes the candidates' variants that fit the GPU's free memory (less 1 GiB)
// and the host budget, and of the first candidate with any, the one with the shortest step as the
// executor runs it. Every variant weighed is printed.
Plan fit_cuda_executor(const ModelSpec& spec, const Planner& planner, const std::vector<Plan>& plans, const PlanRequest& req,
                       const CudaCausalLmOptions& options, bool planned_residency) {
  const Bytes gpu_avail = usable_gpu_memory(req.gpu_budget, free_gpu_memory());
  const auto predict = [&](const Plan& p) { return planner.simulate(CudaCausalLm::as_executed(spec, p, options)).step_s; };
  const auto report = [&](std::size_t i, const Plan& p, const std::array<Bytes, claimant_count>& fp, bool fits) {
    const auto [gpu, host] = gpu_and_host(fp);
    const std::string moe = describe_chunks(spec, p);
    say("candidate plan {} ({}; {}; {} segments resident): the CUDA executor needs {} on the GPU (resident {}, "
        "activations {}, worksets {}) and {} pinned: {}\n",
        i + 1, p.retention_name, moe, p.resident_segments.size(), gpu, fp[0], fp[1], fp[2], host,
        fits ? fmt::format("fits, predicted step {} s", seconds_label(predict(p))) : std::string("does not fit"));
  };
  try {
    CudaFitOptions how;
    how.report = report;
    how.predict_step = predict;
    if (!planned_residency) how.residency_order = planner.residency_order(plans.front());
    const CudaPlanFit fit = CudaCausalLm::fit(spec, plans, gpu_avail, req.host_budget, options, how);
    const Plan& planned = plans[fit.candidate];
    if (fit.plan.retention_name != planned.retention_name || fit.plan.largest_moe_chunk() != planned.largest_moe_chunk() ||
        fit.plan.resident_segments != planned.resident_segments)
      say("taken: candidate plan {} ({}; {} of {} segments resident, {} planned; the shortest predicted step of those "
          "that fit)\n",
          fit.candidate + 1, fit.plan.retention_name, fit.plan.resident_segments.size(), spec.segments().size(),
          planned.resident_segments.size());
    return fit.plan;
  } catch (const Error& e) {
    if (e.code() != Errc::out_of_budget) throw;
    OOM_THROW(Errc::out_of_budget, fmt::format("{} (available on the GPU: the lesser of its budget {} and its free memory less {})",
                                               e.message(), req.gpu_budget, CudaCausalLm::gpu_headroom));
  }
}
#endif

// The learning rate of update t (1-based): linear warmup, then constant or cosine down to min_lr
// at --steps. A pure function of t, so a resumed run follows the same schedule.
float learning_rate(const Args& a, std::uint64_t t) {
  double f = 1.0;
  if (a.warmup > 0 && t < a.warmup) f = static_cast<double>(t) / static_cast<double>(a.warmup);
  if (a.cosine && t > a.warmup && a.steps > a.warmup) {
    const double p = std::min(1.0, static_cast<double>(t - a.warmup) / static_cast<double>(a.steps - a.warmup));
    const double cos_f = 0.5 * (1.0 + std::cos(3.141592653589793 * p));
    return static_cast<float>(a.min_lr + (a.lr - a.min_lr) * cos_f);
  }
  return static_cast<float>(a.lr * f);
}

int g_lock_fd = -1;  // the run directory's .lock, open (and locked) until the process ends

// One oom-train at a time in a run directory, held until the process ends: two runs in one
// directory had each rotated the other's checkpoints away and interleaved `latest` and
// metrics.jsonl (an flock: released by the kernel however the holder ends, SIGKILL included).
// Taken before `latest` is read where the directory exists (a --resume started while the last run
// still writes its checkpoint waits for nothing and must not read the older one), else once it is
// made; a second call does nothing. A filesystem without flock (Lustre without it, NFS without
// lockd) runs unlocked, with a warning.
void lock_run_directory(const fs::path& out) {
  static bool locked = false;
  if (locked) return;
  const fs::path path = out / ".lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) OOM_THROW(Errc::io, fmt::format("{}: cannot open: {}", path.string(), std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const auto n = ::pread(fd, pid, sizeof pid - 1, 0);
    ::close(fd);
    std::string holder(pid, n > 0 ? static_cast<std::size_t>(n) : 0);
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    if (err == EWOULDBLOCK)
      OOM_THROW(Errc::invalid_argument, fmt::format("{} is in use by another oom-train{}; one run at a time in a run directory",
                                                    out.string(), holder.empty() ? std::string() : " (process " + holder + ")"));
    if (err != ENOSYS && err != ENOLCK && err != EOPNOTSUPP)
      OOM_THROW(Errc::io, fmt::format("{}: cannot lock: {}", path.string(), std::strerror(err)));
    say(stderr, "oom-train: warning: {}: this filesystem takes no lock ({}); nothing stops a second run in {}\n", path.string(),
        std::strerror(err), out.string());
    locked = true;
    g_lock_fd = fd;
    return;
  }
  locked = true;
  g_lock_fd = fd;
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note of who holds it.
  }
  // What killed runs left: each kill while one of these was being replaced left its temporary
  // (the built-in corpus's 4 MiB a time), never read and never removed.
  for (const char* own : {"builtin-corpus.tok", "metrics.jsonl", "latest"}) (void)remove_stale_temporaries(out / own);
}

// The run directory is still at --out, by its .lock's identity. Moved (mv) or removed (rm -r) while
// the run trained, the next checkpoint had made a new directory at the old path, without the run's
// metrics, data or lock (a second run could take it, and the run's files were split between the
// two), or the metrics had gone into a removed file, and the run said "done". Checked before each
// step's metrics line and each checkpoint: the run stops, naming where its files now are.
void require_run_directory(const fs::path& out) {
  struct stat held {}, now {};
  if (g_lock_fd < 0 || ::fstat(g_lock_fd, &held) != 0) return;
  if (::stat((out / ".lock").c_str(), &now) == 0 && now.st_dev == held.st_dev && now.st_ino == held.st_ino) return;
  const std::string elsewhere = fmt::format("a checkpoint at {} would start another run directory", out.string());
  std::error_code ec;
  if (held.st_nlink > 0) {
    // Linux names the open file where it is now.
    const fs::path moved = fs::read_symlink(fmt::format("/proc/self/fd/{}", g_lock_fd), ec).parent_path();
    if (!ec)
      OOM_THROW(Errc::io, fmt::format("{} was moved to {} while the run trained; the run stops ({}): its checkpoints and metrics "
                                      "are in {}, where --out {} --resume continues from its latest", out.string(),
                                      moved.string(), elsewhere, moved.string(), moved.string()));
    OOM_THROW(Errc::io, fmt::format("{} was moved while the run trained; the run stops ({})", out.string(), elsewhere));
  }
  if (!fs::exists(out, ec))
    OOM_THROW(Errc::io, fmt::format("{} was removed while the run trained, with its checkpoints and metrics; the run stops ({}, "
                                    "without the run's metrics, data or lock)", out.string(), elsewhere));
  // The lock alone gone, or the directory being removed (rm -r deletes .lock before the directory).
  OOM_THROW(Errc::io, fmt::format("{}, this run's lock on the directory, was removed while the run trained (the directory being "
                                  "removed, or its .lock deleted); the run stops (another oom-train could take the directory): where {} "
                                  "still holds its checkpoints, --resume continues from its latest",
                                  (out / ".lock").string(), out.string()));
}

/// The config.json beside --init-from's weights (a model directory, or the directory of its file or
/// index), when --config is not given: a Hugging Face model or one of our checkpoints is one path.
/// A directory without one is refused (its weights would meet the built-in model).
std::string config_beside(const std::string& init_from) {
  if (init_from.empty()) return {};
  std::error_code ec;
  const fs::path p(init_from);
  const bool is_dir = fs::is_directory(p, ec);
  const fs::path config = (is_dir ? p : p.parent_path()) / "config.json";
  if (fs::is_regular_file(config, ec)) return config.string();
  if (is_dir)
    OOM_THROW(Errc::invalid_argument, fmt::format("--init-from {}: the directory has no config.json; pass --config with the "
                                                  "model's", init_from));
  return {};
}

// A checkpoint's config.json, parsed, as its save wrote it; Errc::parse (the checkpoint is damaged)
// when it cannot be read or parsed, or is not the text its checksums.json lists (an edit that still
// parses: taken as the run's model, it had made every older checkpoint "another model's").
Json read_checkpoint_config(const fs::path& dir) {
  const fs::path path = dir / "config.json";
  try {
    Json config = Json::parse(read_text(path), path.string());
    check_saved_file(dir, "config.json");
    return config;
  } catch (const Error& e) {
    if (e.code() == Errc::parse) throw;
    throw Error(Errc::parse, e.message(), e.file(), e.line());
  }
}

int run(Args a) {
  if (std::error_code ec; fs::is_directory(a.out, ec)) lock_run_directory(a.out);  // before `latest` is read
  if (a.config.empty()) {
    // A resumed run's model is its checkpoint's; a new one's the config beside --init-from's weights.
    const auto resumed = a.resume ? latest_checkpoint(a.out) : std::nullopt;
    const auto readable_config = [](const fs::path& dir) {
      try {
        (void)read_checkpoint_config(dir);
        return true;
      } catch (const Error&) {
        return false;
      }
    };
    if (resumed && readable_config(*resumed)) {
      a.config = (*resumed / "config.json").string();
      say("config {} (the checkpoint's; --config picks another)\n", a.config);
    } else if (resumed) {
      // The latest checkpoint's config.json is lost or damaged (said below, with the older one to
      // resume from): the run's model is the newest older checkpoint's, not the built-in (nor a
      // bare parse error before any advice).
      const auto all = complete_checkpoints(a.out);
      for (auto it = all.rbegin(); it != all.rend() && a.config.empty(); ++it)
        if (it->second.filename() != resumed->filename() && readable_config(it->second)) {
          a.config = (it->second / "config.json").string();
          say("config {} (the latest checkpoint's is missing or damaged; --config picks another)\n", a.config);
        }
    } else {
      a.config = config_beside(a.init_from);
      if (!a.config.empty()) say("config {} (beside --init-from; --config picks another)\n", a.config);
    }
  }
  // ---- model, data, plan: every input checked before anything is written ----
  std::string config_text = a.config.empty() ? std::string(builtin_config) : read_text(a.config);
  std::string config_name = a.config.empty() ? std::string("built-in tiny Qwen3-MoE") : a.config;
  if (a.layers) {  // the config at that depth, as the checkpoints will hold it (a resumed run's is already)
    const Json config = Json::parse(config_text, config_name);
    try {
      config_text = oom::examples::with_layers(config, *a.layers).dump(2) + "\n";
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("--layers {}: {} ({})", *a.layers, e.message(), config_name), e.file(), e.line());
    }
    config_name = fmt::format("{} at {} layers (--layers)", config_name, *a.layers);
  }
  const Json config = Json::parse(config_text, config_name);
  const ModelSpec spec = ModelSpec::from_json(config, config_name);

  std::error_code ec;
  // An --overwrite'n run reads nothing of the old one: a `latest` naming a missing checkpoint
  // must not stop it (it had, until removed by hand).
  std::optional<fs::path> latest;
  if (!a.overwrite) {
    try {
      latest = latest_checkpoint(a.out);
    } catch (const Error& e) {
      if (a.resume) throw;
      throw Error(e.code(), e.message() + "; --overwrite starts afresh", e.file(), e.line());
    }
  }
  if (latest && !a.resume && !a.overwrite)
    OOM_THROW(Errc::invalid_argument, fmt::format("{} already holds a run (latest {}); pass --resume to continue it or "
                                                  "--overwrite to start afresh", a.out.string(), latest->filename().string()));
  if (a.resume && !latest) OOM_THROW(Errc::invalid_argument, fmt::format("--resume: no checkpoint in {}", a.out.string()));
  // The checkpoint a resumed run continues, opened (every tensor checked) before it is planned: its
  // trainer_state says which moments to plan with, and a damaged one is said before any planning.
  // Read only into the model, segment by segment: no copy of the whole optimizer state in memory
  // beside the model's own.
  std::optional<CheckpointReader> ckpt;
  std::function<Error(const Error&)> damaged_checkpoint;  // the error, with which older checkpoint opens
  if (a.resume) {
    // The config it was trained with, compared as JSON values (the same model written otherwise,
    // its members in another order or 1e6 as 1000000.0, is the same: the built-in one is
    // tiny-moe.json's), then its files and tensors. A config.json that
    // cannot be read is a damaged checkpoint like a tensor file cut short.
    const auto open_checkpoint = [&](const fs::path& dir) {
      // Damage before the comparison: an edited config.json is not "another model's".
      const Json saved_config = read_checkpoint_config(dir);
      if (const std::string diff = first_difference(saved_config, Json::parse(config_text, config_name)); !diff.empty())
        throw Error(Errc::invalid_argument, fmt::format("--resume: {} was trained with another config.json than {} ({}; the "
                                                        "checkpoint's first)",
                                                        dir.string(), config_name, diff));
      return CheckpointReader(dir, spec);
    };
    // A damaged latest checkpoint: say which older one opens, and how to resume from it.
    damaged_checkpoint = [&, open_checkpoint](const Error& e) {
      std::string older;
      const auto all = complete_checkpoints(a.out);
      const auto named = std::find_if(all.begin(), all.end(), [&](const auto& c) { return c.second.filename() == latest->filename(); });
      for (auto it = std::make_reverse_iterator(named); it != all.rend(); ++it) {  // older than latest's, newest first
        try {
          (void)open_checkpoint(it->second);
          older = fmt::format("; {} opens (its files, tensor shapes and small files' checksums check out): to resume from it, "
                              "`echo {} > {}`", it->second.string(),
                              it->second.filename().string(), (a.out / "latest").string());
        } catch (const Error&) {
          continue;  // damaged too (or another model's): look further back
        }
        break;
      }
      return Error(e.code(), fmt::format("--resume: {}{}", e.message(), older.empty() ? "; no older checkpoint here opens" : older),
                   e.file(), e.line());
    };
    try {
      ckpt.emplace(open_checkpoint(*latest));
    } catch (const Error& e) {
      if (e.code() == Errc::invalid_argument) throw;  // another model's checkpoint, not a damaged one
      throw damaged_checkpoint(e);
    }
  }

  // A resumed run keeps the checkpoint's AdamW moments unless --moments (or a plan) says which: it
  // is planned with them (a trainer_state without "moments" is from before --moments: fp32).
  if (ckpt && !a.moments && a.plan.empty()) {
    const JsonCursor c(ckpt->trainer_state(), (*latest / "trainer_state.json").string());
    a.moments = c["moments"].present() ? parse_moments(c["moments"].path(), c["moments"].as_string()) : DType::fp32;
  }

  fs::path data_path = a.data;
  if (a.data.empty()) data_path = a.out / "builtin-corpus.tok";
  else if (!fs::exists(data_path, ec)) OOM_THROW(Errc::io, fmt::format("{}: no such data file", data_path.string()));
  // The data's absolute path goes into every checkpoint's trainer_state.json: one that JSON cannot
  // hold (bytes that are not UTF-8) had trained until the first save, which then stopped the run.
  const std::string data_absolute = fs::absolute(data_path, ec).lexically_normal().string();
  try {
    (void)Json::parse(Json(data_absolute).dump());
  } catch (const Error&) {
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: the path is not UTF-8, and a checkpoint's trainer_state.json (JSON) names the "
                                                  "data by it; rename it or link to it by another name", data_absolute));
  }
  std::optional<TokenFile> tokens;
  if (!a.data.empty()) {
    try {
      tokens.emplace(TokenFile::open(data_path));
    } catch (const Error& e) {
      // Not a token file at all: most likely text, the first file a new user tries. (A damaged
      // token file's error stands alone.)
      if (e.code() != Errc::parse || starts_as_token_file(data_path)) throw;
      throw Error(e.code(),
                  e.message() + "; --data reads a token file (docs/trainer.md): text becomes one by `python3 scripts/make_token_file.py "
                                "--bytes --out FILE.tok TEXT` (its bytes as tokens) or with --tokenizer DIR (a Hugging Face tokenizer)",
                  e.file(), e.line());
    }
    if (tokens->vocab_size() > spec.vocab_size()) {
      // The file's vocab is larger than the model's: every token must still fit the model.
      const auto n = tokens->size();
      std::vector<std::uint32_t> buf(1 << 16);
      for (std::uint64_t b = 0; b < n; b += buf.size()) {
        const auto k = std::min<std::uint64_t>(buf.size(), n - b);
        tokens->read(b, std::span(buf).first(k));
        for (std::uint64_t i = 0; i < k; ++i)
          if (buf[i] >= spec.vocab_size())
            OOM_THROW(Errc::invalid_argument, fmt::format("{}: token {} at position {} is >= the model's vocab {} ({})",
                                                          data_path.string(), buf[i], b + i, spec.vocab_size(), config_name));
      }
    }
  } else if (spec.vocab_size() < builtin_corpus_vocab) {
    OOM_THROW(Errc::invalid_argument, fmt::format("the built-in corpus needs a vocab of {} (byte tokens); {} has {}",
                                                  builtin_corpus_vocab, config_name, spec.vocab_size()));
  }

  bool use_cuda = false;
#if OOM_TRAIN_HAS_CUDA
  use_cuda = a.backend == "cuda" || (a.backend == "auto" && cuda::device_count() > 0);
  if (a.backend == "cuda" && cuda::device_count() == 0)
    OOM_THROW(Errc::unsupported, cuda::backend_cuda_refusal(cuda::why_no_device()));
  if (use_cuda) {
    try {  // the CUDA decoder layer takes Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE MoE layers, attention head_dim 128 or 256
      for (int l = 0; l < spec.num_layers(); ++l)
        (void)model::DecoderLayerShape::from_spec(spec, l, static_cast<std::int64_t>(a.seq * a.batch), static_cast<std::int64_t>(a.batch));
    } catch (const Error& e) {
      if (a.backend == "cuda") throw;
      say("backend auto: the host backend, since the CUDA decoder layer does not take this model ({})\n", e.message());
      use_cuda = false;
    }
  }
#else
  if (a.backend == "cuda") OOM_THROW(Errc::unsupported, "--backend cuda: this build has no CUDA (configure with -DOOM_ENABLE_CUDA=ON)");
#endif
  if (use_cuda) oom::examples::refuse_grad_staging_pairs(a.grad_staging.value_or(0), a.max_grad_norm, a.micro_batches);
  if (!use_cuda && a.bucketed_expert_gemms)
    OOM_THROW(Errc::invalid_argument,
              "--bucketed-expert-gemms / --no-bucketed-expert-gemms: the host backend has no cuBLAS (it applies to --backend cuda)");
  if (!use_cuda && a.leave_unrouted_expert_grads)
    OOM_THROW(Errc::invalid_argument, "--leave-unrouted-expert-grads / --zero-unrouted-expert-grads: the host backend keeps "
                                      "no expert gradient buffers on a GPU (it applies to --backend cuda)");
  if (!use_cuda && a.overlap_updates)
    OOM_THROW(Errc::invalid_argument, "--no-overlap-updates: the host backend runs no GPU optimizer (it applies to --backend cuda)");
  if (!use_cuda && a.check_gradients)
    OOM_THROW(Errc::invalid_argument, "--no-gradient-check: the host backend always checks each gradient as it lands (it applies to --backend cuda)");
  if (!use_cuda && a.planned_residency)
    OOM_THROW(Errc::invalid_argument, "--planned-residency: the host backend runs every plan as planned (it applies to --backend cuda)");
  if (a.planned_residency && !a.plan.empty())
    OOM_THROW(Errc::invalid_argument, "--planned-residency: a plan given with --plan runs as written");
  if (!a.retention.empty() && !a.plan.empty())
    OOM_THROW(Errc::invalid_argument, "--retention: a plan given with --plan runs as written");
  if (!use_cuda && a.grad_staging)
    OOM_THROW(Errc::invalid_argument, "--grad-staging: the host backend has no pinned gradient staging (it applies to --backend cuda)");
  if (!use_cuda && a.keep_attention_state)
    OOM_THROW(Errc::invalid_argument,
              "--keep-attention-state / --no-keep-attention-state: the host backend already keeps, offloads or recomputes each class as planned "
              "(it applies to --backend cuda)");
  const MachineProfile profile = a.profile.empty() ? MachineProfile::builtin(a.machine, 1) : MachineProfile::from_file(a.profile);
  Plan plan;
  // Each claimant's own peak in the plan as simulated on this model and profile (the host
  // backend's pinned arena is sized from them).
  std::array<Bytes, claimant_count> plan_peaks{};
  const Planner planner(spec, profile, config_name, a.profile);
  if (!a.plan.empty()) {
    plan = Plan::from_json(read_json_file(a.plan), a.plan);
    // The model it was made for: by its fingerprint, the same for one config wherever it is read
    // from (oom-plan records the path as typed; this run's config may be built in or a
    // checkpoint's). A plan from before the fingerprint names its config: the same JSON is the
    // same model (the built-in one is examples/configs/tiny-moe.json's).
    const std::string& fingerprint = planner.model_fingerprint();
    if (!plan.model_fingerprint.empty() && plan.model_fingerprint != fingerprint)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: made for another model ('{}', model_fingerprint {}); {}'s is {} (plan again with oom-plan for this model)",
                            a.plan, plan.model, plan.model_fingerprint, config_name, fingerprint));
    const auto names_this_config = [&] {
      try {
        return plan.model == config_name ||
               (fs::is_regular_file(plan.model, ec) && Json::parse(read_text(plan.model), plan.model) == Json::parse(config_text, config_name));
      } catch (const Error&) {
        return false;  // unreadable or not JSON: not this config
      }
    };
    if (plan.model_fingerprint.empty() && !names_this_config())
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: made for model '{}', this run trains {} (a plan without model_fingerprint, from before oom-plan "
                            "wrote one, names its config; plan again with oom-plan for this model)",
                            a.plan, plan.model, config_name));
    if (plan.workload.seq_len != a.seq || plan.workload.sequences != a.batch || plan.micro_batches != static_cast<int>(a.micro_batches))
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: planned for {} micro-batch(es) of {} x {} tokens, the run asks for {} of {} x {} (--micro-batches, "
                            "--batch, --seq)",
                            a.plan, plan.micro_batches, plan.workload.sequences, plan.workload.seq_len, a.micro_batches, a.batch, a.seq));
    if (plan.clip_grad_norm != (a.max_grad_norm > 0))
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: planned {} clipping, the run asks for {} (--max-grad-norm {}; oom-plan --max-grad-norm plans for it)", a.plan,
                            plan.clip_grad_norm ? "with" : "without", a.max_grad_norm > 0 ? "it" : "none", a.max_grad_norm));
    if (plan.gpus != 1)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: planned for {} GPUs; oom-train runs on one (oom-plan --gpus 1)", a.plan, plan.gpus));
    // The state is kept at the plan's precisions (a plan counted at others would run with other
    // bytes than it counted): bf16 weights, fp32 master and gradients, fp32 or bf16 moments.
    try {
      require_kept_precision(plan.precision, "its plan");
    } catch (const Error& e) {
      throw Error(Errc::invalid_argument,
                  fmt::format("{}: {} (plan again with oom-plan, whose plans keep these: its --moments is fp32 or bf16)", a.plan,
                              e.message()));
    }
    if (a.moments && *a.moments != plan.precision.moments)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: planned for {} AdamW moments, the run asks for {} (--moments; oom-plan --moments "
                                                    "plans for it)", a.plan, name(plan.precision.moments), name(*a.moments)));
    // Without --moments the plan's are taken: said, since the default is fp32 (it showed only in
    // the state line).
    if (!a.moments && plan.precision.moments != DType::fp32)
      say("AdamW moments {}: the plan's ({} was planned with oom-plan --moments {})\n", name(plan.precision.moments), a.plan,
          name(plan.precision.moments));
    // Checked whole against the model (simulate: its layers, segments, chunks, recomputes), its
    // errors naming the file. Then the state it keeps on each side, which depends on the model and
    // the plan's residency alone, not on the profile's timings: another sum than when it was
    // planned is another model's plan (one without a fingerprint) or an edited one.
    SimResult sim;
    try {
      sim = planner.simulate(plan);
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("{}: {}", a.plan, e.message()));
    }
    plan_peaks = sim.peak;
    for (const Claimant c : {Claimant::resident_state, Claimant::host_state}) {
      const Bytes saved = plan.predicted.peak[static_cast<std::size_t>(c)];
      const Bytes here = sim.peak[static_cast<std::size_t>(c)];
      if (saved.count() != 0 && saved != here)
        OOM_THROW(Errc::invalid_argument,
                  fmt::format("{}: its {} was {} when planned, the same plan on {} is {}: made for another model ('{}') or edited "
                              "since (plan again with oom-plan for this model)", a.plan, to_string(c), saved, config_name, here, plan.model));
    }
  } else {
    PlanRequest req;
    req.gpus = 1;
    req.gpu_budget = a.gpu_mem.value_or(use_cuda ? profile.gpu_memory : Bytes{std::uint64_t{1} << 30});
#if OOM_TRAIN_HAS_CUDA
    // Plan for the memory the GPU has: another process may hold some of it (planned for the whole
    // profile, every candidate kept all 86 GiB of the 5.13B model resident and none fit a GPU with
    // 78.6 GiB free: H200, 2026-12-03).
    // Only where the device has less free memory than the budget: the profile's GPU memory is
    // already what a fresh device has free after the CUDA context.
    if (const auto free = use_cuda ? free_gpu_memory() : std::nullopt; free && *free < req.gpu_budget) {
      const Bytes usable = usable_gpu_memory(req.gpu_budget, free);
      say("GPU budget {}: the device has {} free, less {} (the {} says {})\n", usable, *free, CudaCausalLm::gpu_headroom,
          a.gpu_mem ? "--gpu-mem" : "profile", req.gpu_budget);
      req.gpu_budget = usable;
    }
#endif
    if (a.host_mem) {
      req.host_budget = *a.host_mem;
    } else {
      Bytes held_while_building = oom::examples::whole_initial_weights(spec);
#if OOM_TRAIN_HAS_CUDA
      if (use_cuda) held_while_building = CudaCausalLm::build_buffer_bytes(spec);
#endif
      // This machine's memory where it has less than the profile says (a built-in profile names
      // another machine), as the GPU budget is held to the device's free memory above.
      const Bytes basis = oom::examples::host_memory_basis(profile, oom::examples::machine_host_memory());
      const bool machine_less = basis < profile.host_memory;
      const HostBudget hb = default_host_budget(profile, held_while_building, machine_less ? std::optional<Bytes>(basis) : std::nullopt);
      req.host_budget = hb.budget;
      say("host budget {} ({} less {} held while the model is built and {} headroom; --host-mem sets it)\n", hb.budget,
          machine_less ? fmt::format("this machine's {}, below the profile's {},", basis, profile.host_memory)
                       : fmt::format("the profile's {}", profile.host_memory),
          hb.held_while_building, hb.headroom);
    }
    req.workload = {a.batch, a.seq};
    req.micro_batches = static_cast<int>(a.micro_batches);
    req.clip_grad_norm = a.max_grad_norm > 0;
    req.precision.moments = a.moments.value_or(oom::DType::fp32);
    req.candidates = use_cuda ? 6 : 2;
    req.retention = a.retention;
    const auto set = oom::examples::plan_or_say_least(planner, req);
    plan = set.plans.front();
    plan_peaks = plan.predicted.peak;  // the returned plans are simulated whole
#if OOM_TRAIN_HAS_CUDA
    if (use_cuda) plan = fit_cuda_executor(spec, planner, set.plans, req, cuda_options(a), a.planned_residency);
#endif
  }

  // The initial weights as a source, made or read segment by segment into the model: the CUDA model
  // holds no copy of all of them beside its own state (19.1 GiB for the 5.13B model); the host model
  // takes them whole. --init-from's file is checked here, every tensor, before anything is built.
  // Released once the model is built (the generator's threads, the file's mapping).
  SegmentWeightSource init = a.init_from.empty() ? train::initial_weight_source(spec, a.seed) : weight_source(a.init_from, spec);
  optim::AdamWConfig adamw;
  adamw.lr = a.lr;
  adamw.weight_decay = a.weight_decay;
  // The first update's scalars now, not at step 1 after --overwrite removed the old run: step 1
  // has the largest step size (lr / (1 - beta1)), and the schedules never pass --lr.
  try {
    (void)optim::adamw_step_scalars(adamw, 1);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("--lr {} / --weight-decay {}: {}", a.lr, a.weight_decay, e.message()), e.file(), e.line());
  }
  std::uint64_t start_step = 0;
  // Each step draws batch x micro-batches windows; the sampler's epochs are whole steps of them.
  const std::uint64_t step_windows = a.batch * a.micro_batches;
  SamplerState sampler_state{a.seed, 0, step_windows};
  std::uint64_t resumed_skips = 0;                  // a resumed run's non-finite steps in a row at its checkpoint
  std::optional<std::uint64_t> saved_data_tokens;  // a resumed run's data file's token count
  std::optional<fs::path> data_trained_on;  // a resumed run's trained-on --data, where this run reads another path
  std::optional<std::string> saved_data_fingerprint;  // and its TokenFile::sample_fingerprint (absent before session 55)
  if (ckpt) {
    // Errors name the checkpoint's file, not only "trainer_state.json" (every checkpoint has one).
    const JsonCursor ts(ckpt->trainer_state(), (*latest / "trainer_state.json").string());
    auto require_same = [&](const char* field, auto have) {
      const auto saved = ts[field].as_uint64();
      if (saved != static_cast<std::uint64_t>(have))
        OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} holds {} = {}, this run asks for {}", latest->string(), field,
                                                      saved, have));
    };
    require_same("seq", a.seq);
    if (ts["micro_batches"].present()) require_same("micro_batches", a.micro_batches);
    const std::uint64_t saved_batch = ts["batch"].present() ? ts["batch"].as_uint64() : 1;  // absent: one sequence a micro-batch
    if (saved_batch != a.batch)
      OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} holds batch = {}, this run asks for {} (--batch)", latest->string(),
                                                    saved_batch, a.batch));
    // (Printed as the fp32 values the flags are: "0.003", not the double 0.003000000026077032.)
    const double saved_clip = ts["max_grad_norm"].present() ? ts["max_grad_norm"].as_double() : 0.0;
    if (ts["lr"].as_double() != static_cast<double>(a.lr) || ts["weight_decay"].as_double() != static_cast<double>(a.weight_decay) ||
        saved_clip != static_cast<double>(a.max_grad_norm))
      OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} used lr {}, weight decay {} and max grad norm {}; pass the same",
                                                    latest->string(), static_cast<float>(ts["lr"].as_double()),
                                                    static_cast<float>(ts["weight_decay"].as_double()), static_cast<float>(saved_clip)));
    // The moments the checkpoint's run kept (absent: before --moments, fp32). Its state would load
    // into the other precision (rounded, or widened), but that is another run than the one saved.
    const std::string saved_moments = ts["moments"].present() ? ts["moments"].as_string() : "fp32";
    if (saved_moments != name(plan.precision.moments))
      OOM_THROW(Errc::invalid_argument,
                fmt::format("--resume: {} kept AdamW moments in {}, this run keeps them in {}; {}", latest->string(), saved_moments,
                            name(plan.precision.moments),
                            a.plan.empty() ? fmt::format("pass --moments {} (or none: a resumed run keeps the checkpoint's)", saved_moments)
                                           : fmt::format("use a plan of {} moments (oom-plan --moments {})", saved_moments, saved_moments)));
    const std::string saved_schedule = ts["schedule"].present() ? ts["schedule"].as_string() : "constant";
    const std::uint64_t saved_warmup = ts["warmup"].present() ? ts["warmup"].as_uint64() : 0;
    const std::uint64_t saved_total = ts["total_steps"].present() ? ts["total_steps"].as_uint64() : a.steps;
    if (saved_schedule != (a.cosine ? "cosine" : "constant") || saved_warmup != a.warmup ||
        (a.cosine && saved_total != a.steps))
      OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} used the {} schedule with warmup {} over {} steps; pass the same "
                                                    "--schedule, --warmup and (cosine) --steps", latest->string(), saved_schedule,
                                                    saved_warmup, saved_total));
    if (a.cosine && ts["min_lr"].present() && ts["min_lr"].as_double() != static_cast<double>(a.min_lr))
      OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} used the cosine schedule down to {}; pass the same --min-lr",
                                                    latest->string(), static_cast<float>(ts["min_lr"].as_double())));
    // The sampler's state is a place in one token file: another file would silently draw other
    // windows (and another count of them). The built-in corpus lives in the run directory, which
    // may have moved; a file of --data may have moved too, so a path that differs only warns where
    // the token count and the sampled fingerprint still agree (checked once the file is open, below).
    if (ts["data_fingerprint"].present()) saved_data_fingerprint = ts["data_fingerprint"].as_string();
    if (ts["data"].present()) {
      const fs::path saved = ts["data"].as_string();
      const bool saved_builtin = ts["data_builtin"].present() ? ts["data_builtin"].as_bool() : saved.filename() == "builtin-corpus.tok";
      if (saved_builtin != a.data.empty())
        OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} was trained on {}, this run reads {}{}", latest->string(),
                                                      saved_builtin ? "the built-in corpus" : saved.string(),
                                                      a.data.empty() ? "the built-in corpus" : data_path.string(),
                                                      a.data.empty() ? " (pass the same --data)" : " (--data)"));
      if (!a.data.empty() && !fs::equivalent(saved, data_path, ec))  // false too where the trained-on file is gone
        data_trained_on = saved;  // said once the file is open and found the same (or not)
    }
    saved_data_tokens = ts["data_tokens"].present() ? std::optional(ts["data_tokens"].as_uint64()) : std::nullopt;
    start_step = ts["step"].as_uint64();
    // The step the directory is named for (the loop counts from it: 2^64 - 1 had wrapped it to 0,
    // overwriting this checkpoint), and an optimizer step count it could have reached.
    if (checkpoint_name(start_step) != latest->filename().string())
      OOM_THROW(Errc::parse, fmt::format("{}: step is {}, in a checkpoint named {}", (*latest / "trainer_state.json").string(),
                                         start_step, latest->filename().string()));
    if (const auto opt = ts["optimizer_steps"].as_int64(); opt < 0 || static_cast<std::uint64_t>(opt) > start_step)
      OOM_THROW(Errc::parse, fmt::format("{}: optimizer_steps is {}; a checkpoint of step {} has made 0 to {} updates",
                                         (*latest / "trainer_state.json").string(), opt, start_step, start_step));
    if (a.trace_step != 0 && a.trace_step <= start_step)
      OOM_THROW(Errc::invalid_argument, fmt::format("--trace-step {}: the run resumes after step {}", a.trace_step, start_step));
    // A checkpoint from before the sampler's epochs were whole steps has no step_windows: it goes on
    // in the order it started in, each epoch every window, a step sometimes across two epochs.
    sampler_state = SamplerState::from_json(ts["sampler"].value(), ts["sampler"].path());
    // Whole steps of this run's windows (or 1: a checkpoint from before), else the first draw would
    // fail once the metrics are opened.
    if (sampler_state.step_windows != 1 && sampler_state.step_windows != step_windows)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: sampler step_windows is {}, but the run's steps draw {} (--batch {} x --micro-batches {})",
                            (*latest / "trainer_state.json").string(), sampler_state.step_windows,
                            examples::counted(step_windows, "window"), a.batch, a.micro_batches));
    // Every step draws its --batch x --micro-batches windows (a skipped step too; the checkpoint's
    // batch and micro-batches are the run's, checked above), so a checkpoint of step s is at window
    // s x step_windows: another position (an edit, a damaged file) had resumed silently on other
    // data, replaying earlier windows or, near 2^64, wrapping to the first. (Not the sampler's own
    // step_windows: a run continued from a checkpoint older than it keeps 1 there.) A checkpoint
    // without step_windows is older than this rule and is taken as it is.
    const bool past_2_64 = start_step > std::numeric_limits<std::uint64_t>::max() / step_windows;
    if (ts["sampler"]["step_windows"].present() && (past_2_64 || sampler_state.position != start_step * step_windows))
      OOM_THROW(Errc::parse, fmt::format("{}: sampler position is {}, but a checkpoint of step {} drawing {} a step is at "
                                         "window {}", (*latest / "trainer_state.json").string(), sampler_state.position, start_step,
                                         examples::counted(step_windows, "window"),
                                         past_2_64 ? std::string("past 2^64") : std::to_string(start_step * step_windows)));
    if (a.seed_given && a.seed != sampler_state.seed)
      OOM_THROW(Errc::invalid_argument, fmt::format("--resume: {} draws its windows with seed {}; --seed {} would change nothing "
                                                    "(drop it, or start afresh)", latest->string(), sampler_state.seed, a.seed));
    resumed_skips = ts["consecutive_skips"].present() ? ts["consecutive_skips"].as_uint64() : 0;  // absent before session 53
  }

  // One step's windows of data, checked before the run directory is made: the file of --data is
  // open; the built-in corpus, written below where it is not there yet, is one token per byte (one
  // already in the run directory is checked once open, below). A step of more windows than the
  // file holds must hold some tokens twice, whatever the order they are drawn in: they had been
  // counted twice in its gradient without a word.
  const auto refuse_short_data = [&](const std::string& name, std::uint64_t n) {
    if (n < a.seq + 1)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: {} tokens cannot make a window of sequence length {} (+1 for the target)", name, n, a.seq));
    if (const std::uint64_t windows = BatchSampler::windows_in(n, a.seq); windows < step_windows)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: {} tokens hold {} of --seq {}, fewer than the {} a step trains on (--batch {} x "
                            "--micro-batches {}), so a step would train on a window twice; {}", name, n,
                            examples::counted(windows, "window"), a.seq, step_windows,
                            a.batch, a.micro_batches,
                            a.resume ? "the run cannot resume on it (its checkpoint pins the data and the step): start a new run "
                                       "with a longer file (--data) or a smaller --batch, --micro-batches or --seq"
                                     : "use a longer file (--data) or a smaller --batch, --micro-batches or --seq"));
  };
  if (tokens) refuse_short_data(data_path.string(), tokens->size());
  else if (!fs::exists(data_path, ec)) refuse_short_data("the built-in corpus", builtin_corpus_bytes);

  // ---- from here on the run directory is written (an --overwrite'n run's files are removed only once
  // the new model is built: train_with) ----
  fs::create_directories(a.out, ec);
  if (ec) OOM_THROW(Errc::io, fmt::format("{}: cannot create the run directory: {}", a.out.string(), ec.message()));
  lock_run_directory(a.out);
  // Output paths refused now, not after the training they would end (checked once the run
  // directory exists: they may lie in it).
  if (!a.trace.empty()) require_output_file("--trace", a.trace);
  if (!a.dump_batches.empty()) require_output_file("--dump-batches", a.dump_batches);
  if (a.data.empty()) {
    // It is generated, the same tokens each time: written where missing, and written again where
    // damaged, not a stop with an error to puzzle over (a resumed run checks their fingerprint below).
    const auto write_and_open = [&] {
      tokens.reset();
      (void)write_builtin_corpus(data_path, builtin_corpus_bytes, 0);
      tokens.emplace(TokenFile::open(data_path));
    };
    if (!fs::exists(data_path, ec)) (void)write_builtin_corpus(data_path, builtin_corpus_bytes, 0);
    try {
      tokens.emplace(TokenFile::open(data_path));
    } catch (const Error& e) {
      if (e.code() != Errc::parse && e.code() != Errc::io) throw;
      say(stderr, "oom-train: warning: the built-in corpus {} is damaged ({}); writing it again (the same tokens)\n",
          data_path.string(), e.message());
      write_and_open();
    }
    // Damage that leaves a readable file (tokens changed within the vocabulary): a resumed run's
    // count or fingerprint tells, and the corpus is written again the same way (the checks below
    // then hold, or name a checkpoint of another corpus; "pass the file it was trained on" cannot
    // be followed for a file the run writes itself).
    if ((saved_data_tokens && *saved_data_tokens != tokens->size()) ||
        (saved_data_fingerprint && *saved_data_fingerprint != fmt::format("{:016x}", tokens->sample_fingerprint()))) {
      say(stderr, "oom-train: warning: the built-in corpus {} holds other tokens than {} was trained on; writing it again (the same "
                  "tokens as then)\n", data_path.string(), latest->string());
      write_and_open();
    }
    refuse_short_data(data_path.string(), tokens->size());
  }
  // Where the path differs, the file trained on is named as such, not as this one.
  const std::string trained_on =
      data_trained_on ? fmt::format("{} was trained on {}", latest->string(), data_trained_on->string()) : std::string();
  if (saved_data_tokens && *saved_data_tokens != tokens->size())
    OOM_THROW(Errc::invalid_argument,
              data_trained_on ? fmt::format("--resume: {}, which held {} tokens; {} holds {}", trained_on, *saved_data_tokens,
                                            data_path.string(), tokens->size())
                              : fmt::format("--resume: {} held {} tokens when {} was trained on it, it holds {} now", data_path.string(),
                                            *saved_data_tokens, latest->string(), tokens->size()));
  // The same count is not the same data: a file rewritten in place (re-tokenised, shuffled, another
  // corpus cut to the same length) would resume the sampler on other windows without a word.
  const std::string data_fingerprint = fmt::format("{:016x}", tokens->sample_fingerprint());
  if (saved_data_fingerprint && *saved_data_fingerprint != data_fingerprint)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("--resume: {} (the same {} tokens in number; sampled fingerprint {} then, {} now): pass the file it was "
                          "trained on, or start afresh (--overwrite)",
                          data_trained_on ? fmt::format("{}, and {} holds other tokens", trained_on, data_path.string())
                                          : fmt::format("{} holds other tokens than when {} was trained on it", data_path.string(),
                                                        latest->string()),
                          tokens->size(), *saved_data_fingerprint, data_fingerprint));
  if (data_trained_on)
    say(stderr, "oom-train: warning: --resume: {}, this run reads {} (taken as the same data: {})\n", trained_on, data_path.string(),
        saved_data_fingerprint ? "the same token count and sampled fingerprint" : "the same token count");
  BatchSampler sampler(*tokens, a.seq, sampler_state);

  say("oom-train: model {}: {} layers, {} experts (top {}), {} parameters ({} active)\n", config_name, spec.num_layers(),
      spec.moe().experts, spec.moe().top_k, oom::examples::count_label(spec.total_parameters()),
      oom::examples::count_label(spec.active_parameters()));
  // Longer windows than the positions the model was trained for run (RoPE has no limit), but a
  // pretrained model's quality past them is its own question: said, not refused.
  if (const std::uint64_t max_pos = oom::examples::max_position_embeddings(config); max_pos > 0 && a.seq > max_pos)
    say("note: --seq {} is longer than the config's max_position_embeddings ({}), the positions the model was trained for\n",
        a.seq, max_pos);
  if (a.warmup > 0 && a.warmup >= a.steps)
    say("note: --warmup {} takes the whole run (--steps {}): the learning rate {} --lr {}{}\n", a.warmup, a.steps,
        a.warmup == a.steps ? "reaches" : "never reaches", a.lr, a.warmup == a.steps ? " only at the last update" : "");
  if (const double coef = spec.moe().router_aux_loss_coef; coef > 0)
    say("loss: mean cross-entropy + {} x transformers' load-balancing loss over every layer's router "
        "(the config's output_router_logits and router_aux_loss_coef)\n", coef);
  std::string epoch_steps;  // where a step draws several windows: an epoch's whole steps
  if (const std::uint64_t k = sampler.state().step_windows; k > 1) {
    const std::uint64_t left = sampler.windows_per_epoch() % k;
    epoch_steps = fmt::format(", {} of {}", examples::counted(sampler.steps_per_epoch(), "step"), k) +
                  (left == 0 ? std::string() : fmt::format(" (and {} left over, others each epoch)", left));
  }
  say("data {}: {} tokens (vocab {}), {} of {} per epoch{}\n", data_path.string(), tokens->size(), tokens->vocab_size(),
      examples::counted(sampler.windows_per_epoch(), "window"), a.seq, epoch_steps);
  if (use_cuda) say("backend: cuda (GPU {})\n", 0);
  else
    say("backend: host (the CPU reference backend; its \"device\" is an accounted arena of twice the plan's GPU budget: it "
        "computes in fp32 where the plan counts bf16)\n");
  say("=== the plan ({}) ===\n{}\n", a.plan.empty() ? "chosen by the planner" : a.plan, planner.describe(plan));
  // What --trace-step's measured step is compared with: the plan, or on CUDA the plan as that
  // executor carries it out (one saved buffer per layer; MoE chunks regenerated in the backward).
  Plan predicted_plan = plan;
#if OOM_TRAIN_HAS_CUDA
  if (use_cuda) {
    predicted_plan = CudaCausalLm::as_executed(spec, plan, cuda_options(a));
    const SimResult sim = planner.simulate(predicted_plan);
    if (std::abs(sim.step_s - plan.predicted.step_s) > 0.01 * plan.predicted.step_s)
      say("as the CUDA executor runs it (a layer's saved activations are kept, offloaded or recomputed as one; MoE "
          "chunks regenerated in the backward): predicted step {} s, {:.0f} tokens/s\n\n",
          seconds_label(sim.step_s), static_cast<double>(plan.workload.tokens() * static_cast<std::uint64_t>(plan.micro_batches)) / sim.step_s);
  }
#endif

  auto train_with = [&](auto& model) -> int {
  if (a.overwrite) {  // only now: every input was read and the model built without an error
    for (const auto& e : fs::directory_iterator(a.out, ec))
      if (e.path().filename().string().starts_with("checkpoint-") || e.path().filename() == "latest" ||
          e.path().filename() == "metrics.jsonl")
        fs::remove_all(e.path(), ec);
  }
  if (ckpt) {
    const auto optimizer_steps = ckpt->trainer_state().find("optimizer_steps")->as_int64();  // checked above
    // The values are read (and checked: their checksums, finite, second moments not negative) only
    // now: damage found here gets the same advice as damage found on opening.
    try {
      if constexpr (std::is_same_v<std::decay_t<decltype(model)>, train::HostCausalLm>) {
        model.load(ckpt->read_all(), optimizer_steps);  // the host backend's models are small
      } else {
        model.load(ckpt->source(), optimizer_steps);
      }
    } catch (const Error& e) {
      if (e.code() != Errc::parse) throw;
      throw damaged_checkpoint(e);
    }
    ckpt.reset();  // unmaps the files (each tensor's pages already left the RSS as it was read)
    say("resumed from {} at step {}\n", latest->string(), start_step);
    // `latest` named an older checkpoint than the run has (set by hand, or a damaged newer one):
    // the newer ones are another continuation, replaced as this run saves their steps.
    std::vector<std::string> newer;
    for (const auto& [step, dir] : complete_checkpoints(a.out))
      if (step > start_step) newer.push_back(dir.filename().string());
    if (!newer.empty())
      say(stderr, "oom-train: warning: --resume continues from step {}; {} holds {} newer checkpoint{} ({}{}) of another "
          "continuation: each is replaced when this run saves its step, and metrics.jsonl's lines past step {} are dropped\n",
          start_step, a.out.string(), newer.size(), newer.size() == 1 ? "" : "s", newer.front(),
          newer.size() == 1 ? "" : " .. " + newer.back(), start_step);
  }

  const fs::path metrics_path = a.out / "metrics.jsonl";
  if (a.resume) {
    if (const MetricsKept m = truncate_metrics(metrics_path, start_step); m.damaged > 0)
      say(stderr, "oom-train: warning: {}: {} damaged line{} (not a JSON record with a step; the first is line {}) dropped, "
          "the other steps' lines kept\n", metrics_path.string(), m.damaged, m.damaged == 1 ? "" : "s", m.first_line);
  } else {
    write_file_atomically(metrics_path, "");
  }
  std::ofstream metrics(metrics_path, std::ios::app);
  if (!metrics) OOM_THROW(Errc::io, fmt::format("{}: cannot open for appending: {}", metrics_path.string(), std::strerror(errno)));

  // Non-finite steps in a row up to now (--max-skips), kept in the checkpoint: a resumed run stops
  // where the uninterrupted one would.
  std::uint64_t consecutive_skips = resumed_skips;
  std::optional<std::uint64_t> last_checkpoint;  // the step of the last checkpoint `latest` named
  if (a.resume) last_checkpoint = start_step;
  double save_seconds = 0;  // the checkpoint saves of this run, for its closing line
  auto checkpoint = [&](std::uint64_t step) {
    Json ts = Json::object();
    ts.set("format", "oom-train-1");
    ts.set("step", step);
    ts.set("optimizer_steps", static_cast<long long>(model.optimizer_steps()));
    ts.set("seq", a.seq);
    ts.set("micro_batches", a.micro_batches);
    ts.set("batch", a.batch);
    ts.set("lr", static_cast<double>(a.lr));
    ts.set("weight_decay", static_cast<double>(a.weight_decay));
    ts.set("max_grad_norm", static_cast<double>(a.max_grad_norm));
    ts.set("moments", std::string(name(plan.precision.moments)));
    ts.set("schedule", a.cosine ? "cosine" : "constant");
    ts.set("warmup", a.warmup);
    ts.set("min_lr", static_cast<double>(a.min_lr));
    ts.set("total_steps", a.steps);
    ts.set("sampler", sampler.state().to_json());
    ts.set("data", data_absolute);
    ts.set("data_tokens", tokens->size());
    ts.set("data_fingerprint", data_fingerprint);
    ts.set("data_builtin", a.data.empty());
    ts.set("consecutive_skips", consecutive_skips);
    require_run_directory(a.out);
    const StateSnapshot snap = model.state_views();  // no copy of the streamed state
    fs::path dir;
    // A large model's save takes a while (tens of GB): said before it starts, so a quiet minute is
    // not taken for a hang.
    const Bytes state_bytes = checkpoint_state_bytes(spec);
    if (state_bytes >= Bytes{std::uint64_t{1} << 30}) say("saving step {}'s checkpoint ({} of weights and moments)\n", step, state_bytes);
    const auto save_start = std::chrono::steady_clock::now();
    try {
      dir = save_checkpoint(a.out, spec, std::span<const SegmentStateView>(snap.views),
                            {step, config_text, ts, a.keep, [](const std::string& m) { say(stderr, "oom-train: warning: {}\n", m); }});
    } catch (const std::exception& caught) {
      require_run_directory(a.out);  // moved or removed mid-save: that, rather than the file it failed on
      // What a full disk, a file-size limit or a read-only directory leaves: the run stops, and
      // where it can continue from is said (for any error: memory, a thread that would not start).
      const std::string context = fmt::format("saving step {}'s checkpoint: the run stops; {}", step,
                                              last_checkpoint ? fmt::format("{} is as it was (--resume continues from it)",
                                                                            (a.out / checkpoint_name(*last_checkpoint)).string())
                                                              : std::string("it has no checkpoint to resume from"));
      if (const auto* e = dynamic_cast<const Error*>(&caught)) throw Error(*e).add_context(context);
      OOM_THROW(Errc::io, fmt::format("{}: {}", context, caught.what()));
    }
    last_checkpoint = step;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - save_start).count();
    save_seconds += seconds;
    std::uint64_t bytes = 0;  // the files' sizes as listed (a listing error counts what came before it)
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code size_ec;
      const std::uintmax_t n = it->is_regular_file(size_ec) ? it->file_size(size_ec) : 0;
      if (!size_ec) bytes += n;
    }
    say("checkpoint {} written ({} in {:.1f} s, {}/s)\n", dir.string(), Bytes{bytes}, seconds,
        Bytes{static_cast<std::uint64_t>(static_cast<double>(bytes) / std::max(seconds, 1e-3))});
  };

  if (a.save_initial) checkpoint(0);
  std::vector<std::uint32_t> dumped;  // windows of seq + 1 tokens
  // --dump-batches: the windows of the steps run, also where the run stops early (a signal, a
  // non-finite loss): --resume refuses the flag, so a reference run's windows had been lost.
  const auto write_dump = [&](std::string_view stopped) {
    if (a.dump_batches.empty()) return;
    write_token_file(a.dump_batches, dumped, spec.vocab_size());
    say("{} of {} tokens written to {}{}\n", examples::counted(dumped.size() / (a.seq + 1), "window"), a.seq + 1, a.dump_batches,
        stopped);
  };

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const std::uint64_t step_tokens = a.seq * a.batch * a.micro_batches;
  std::vector<std::uint32_t> in(step_tokens), tgt(step_tokens);
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  std::uint64_t done_since_start = 0;
  double step_seconds = 0;  // the steps' own time (step_s), without the saves and the data between them
  if (start_step >= a.steps) say("the run is already at step {} (--steps {})\n", start_step, a.steps);
  // A long step says where it is: once it has run --step-progress seconds, a line per layer pass
  // at most every half of that (0: every pass). Issued passes; the GPU is at most about a layer behind.
  auto step_start = std::chrono::steady_clock::now(), last_note = step_start;
  std::uint64_t running_step = 0;
  const auto progress_after = std::chrono::duration<double>(a.step_progress_s);
  model.on_layer([&](const LayerProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (now - step_start < progress_after || now - last_note < progress_after / 2) return;
    last_note = now;
    const int issued = p.backward ? p.layers + (p.layers - 1 - p.layer) : p.layer;
    say("  step {}{}: {} layer {} ({} of {} layer passes issued, {} into the step)\n", running_step,
        a.micro_batches > 1 ? fmt::format(" micro-batch {}/{}", p.micro_batch + 1, a.micro_batches) : std::string(),
        p.backward ? "backward" : "forward", p.layer, issued, 2 * p.layers,
        duration(std::chrono::duration<double>(now - step_start).count()));
  });
  for (std::uint64_t step = start_step + 1; step <= a.steps; ++step) {
    // A step's time runs from here: the previous step's metrics, checkpoint and trace are not in it.
    last = std::chrono::steady_clock::now();
    sampler.next(in, tgt);
    const float lr_now = learning_rate(a, static_cast<std::uint64_t>(model.optimizer_steps()) + 1);
    model.set_learning_rate(lr_now);
    Timeline timeline;
    if (step == a.trace_step) model.record_next_step(&timeline);
    if (!a.dump_batches.empty())
      for (std::uint64_t w = 0; w < a.batch * a.micro_batches; ++w) {  // each window: its seq inputs and its last target
        dumped.insert(dumped.end(), in.begin() + static_cast<std::ptrdiff_t>(w * a.seq), in.begin() + static_cast<std::ptrdiff_t>((w + 1) * a.seq));
        dumped.push_back(tgt[(w + 1) * a.seq - 1]);
      }
    running_step = step;
    step_start = last_note = std::chrono::steady_clock::now();
    const auto r = model.step(in, tgt);
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - last).count();
    ++done_since_start;
    step_seconds += dt;
    const double elapsed = std::chrono::duration<double>(now - t0).count();
    const double tok_s = static_cast<double>(step_tokens) / dt;
    auto& dev = model.backend().device_arena();
    auto& pin = model.backend().pinned_arena();
    Json m = Json::object();
    m.set("step", step);
    if (std::isfinite(r.loss)) m.set("loss", r.loss);
    else m.set("loss", nullptr), m.set("loss_nonfinite", std::isnan(r.loss) ? "nan" : (r.loss > 0 ? "inf" : "-inf"));
    m.set("skipped", r.skipped);
    m.set("lr", static_cast<double>(lr_now));
    if constexpr (requires { r.grad_norm; }) {
      if (r.grad_norm >= 0) m.set("grad_norm", r.grad_norm);
    }
    m.set("tokens", step_tokens);
    m.set("step_s", dt);
    m.set("tokens_per_s", tok_s);
    m.set("device_peak_bytes", dev.peak().count());
    m.set("device_retained_activations_peak", dev.peak(Claimant::retained_activations).count());
    m.set("device_worksets_peak", dev.peak(Claimant::worksets).count());
    m.set("device_resident_state", dev.in_use(Claimant::resident_state).count());
    m.set("host_pinned_bytes", pin.in_use().count());
    m.set("host_state_bytes", pin.in_use(Claimant::host_state).count());
    m.set("host_staging_bytes", pin.in_use(Claimant::host_staging).count());
    m.set("host_offload_peak_bytes", pin.peak(Claimant::host_offload).count());
    const HostRss host = host_rss();
    m.set("host_rss_bytes", host.now.count());
    m.set("host_rss_peak_bytes", host.peak.count());
    require_run_directory(a.out);
    metrics << m.dump() << "\n" << std::flush;
    // A full disk had left the file cut mid-line while the run said "done".
    if (!metrics)
      OOM_THROW(Errc::io, fmt::format("{}: step {}'s line could not be written ({}){}", metrics_path.string(), step,
                                      std::strerror(errno),
                                      a.checkpoint_every > 0 ? "; --resume continues from the last checkpoint" : ""));
    if (step == a.trace_step) {
      const fs::path trace_path = a.trace.empty() ? a.out / fmt::format("trace-step-{}.json", step) : fs::path(a.trace);
      // Beside it, the simulator's timeline of the same plan, to compare op by op.
      const std::string line = write_step_traces(trace_path, fmt::format("step {}", step), fmt::format("oom-train step {}", step),
                                                 timeline, dt, planner.step_graph(predicted_plan));
      if (!line.empty()) say("{}\n", line);
    }
    if (r.skipped) {
      say(stderr, "step {}: loss is {}; step skipped (no update)\n", step, r.loss);
      if (a.stop_on_nonfinite) {
        say(stderr, "oom-train: stopping on a non-finite loss at step {} (--on-nonfinite stop)\n", step);
        write_dump(fmt::format(" (the steps up to {}, where the run stopped)", step));
        return 4;
      }
      if (++consecutive_skips >= a.max_skips) {
        say(stderr, "oom-train: {} consecutive non-finite losses; stopping (--max-skips)\n", consecutive_skips);
        write_dump(fmt::format(" (the steps up to {}, where the run stopped)", step));
        return 4;
      }
    } else {
      consecutive_skips = 0;
    }
    if (step == start_step + 1 || step % a.log_every == 0 || step == a.steps) {
      const double eta = elapsed / static_cast<double>(done_since_start) * static_cast<double>(a.steps - step);
      std::string gn;
      if constexpr (requires { r.grad_norm; }) {
        if (r.grad_norm >= 0) gn = fmt::format(" | grad norm {:.3f}", r.grad_norm);
      }
      say("step {:>5}/{} | loss {:.4f}{} | {:.0f} tok/s | device peak {} of its {} MiB arena (activations {}, worksets {}, resident {}) | "
          "host pinned {} MiB (state {}, staging {}, offload {}), RSS {} MiB | ETA {}\n",
          step, a.steps, r.loss, gn, tok_s, mib(dev.peak()), mib(dev.budget()), mib(dev.peak(Claimant::retained_activations)),
          mib(dev.peak(Claimant::worksets)), mib(dev.in_use(Claimant::resident_state)), mib(pin.in_use()),
          mib(pin.in_use(Claimant::host_state)), mib(pin.in_use(Claimant::host_staging)), mib(pin.peak(Claimant::host_offload)), mib(host.now),
          duration(eta));
    }
    const bool checkpoints = a.checkpoint_every > 0;
    if (checkpoints && (step % a.checkpoint_every == 0 || step == a.steps)) checkpoint(step);
    if (const int sig = g_signal.load()) {
      if (checkpoints && step % a.checkpoint_every != 0 && step != a.steps) checkpoint(step);
      if (checkpoints)
        say(stderr, "oom-train: interrupted by signal {} after step {}; resume with --resume\n", sig, step);
      else if (start_step > 0)
        say(stderr, "oom-train: interrupted by signal {} after step {}; no checkpoint since step {} (--checkpoint-every 0), "
                           "where --resume would continue\n", sig, step, start_step);
      else
        say(stderr, "oom-train: interrupted by signal {} after step {}; no checkpoint was written (--checkpoint-every 0)\n", sig, step);
      write_dump(fmt::format(" (the steps up to {}, where the run was interrupted)", step));
      return 130;
    }
  }
  write_dump("");
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Two rates: over the wall clock since the first step began (the saves included), and over the
  // steps' own time, as the step lines and metrics.jsonl's tokens_per_s count it.
  const double run_tokens = static_cast<double>(done_since_start * step_tokens);
  say("done: {} step{} in {} ({:.0f} tok/s; {:.0f} tok/s over the steps alone{}); metrics in {}\n", done_since_start,
      done_since_start == 1 ? "" : "s", duration(total), run_tokens / total, step_seconds > 0 ? run_tokens / step_seconds : 0.0,
      save_seconds > 0 ? fmt::format(", {:.1f} s of checkpoint saves beside them", save_seconds) : std::string(),
      metrics_path.string());
  return 0;
  };

  if (use_cuda) {
#if OOM_TRAIN_HAS_CUDA
    CudaCausalLmOptions co = cuda_options(a);
    co.adamw = adamw;
    CudaCausalLm model(spec, plan, init, co);  // a resumed run overwrites these below
    init = nullptr;
    return train_with(model);
#endif
  }
  // The host backend computes in fp32: its activations take twice the plan's bf16 bytes, so its
  // device arena is twice the plan's budget; and the weights it stages and the activations it
  // offloads in pinned memory are fp32 too, so its pinned arena holds the plan's peaks of those
  // once more (a plan oom-plan had fitted in 64 MiB of host stopped at step 1 without them).
  constexpr std::uint64_t most_accounted = std::uint64_t{1} << 62;
  if (plan.gpu_budget.count() > most_accounted || plan.host_budget.count() > most_accounted)
    OOM_THROW(Errc::invalid_argument, fmt::format("GPU budget {} / host budget {}: the host backend accounts at most {} of each "
                                                  "(twice the plan's)", plan.gpu_budget, plan.host_budget, Bytes{most_accounted}));
  const Bytes fp32_again = plan_peaks[static_cast<std::size_t>(Claimant::host_staging)] +
                           plan_peaks[static_cast<std::size_t>(Claimant::host_offload)];
  HostBackend::Options bo{plan.gpu_budget + plan.gpu_budget, plan.host_budget + fp32_again, /*expose_races=*/false};
  // The weights in memory only while the model is built (a temporary); a resumed run overwrites them below.
  train::HostCausalLm model(spec, plan, train::weights_in_memory(spec, init), adamw, bo, a.max_grad_norm);
  init = nullptr;
  return train_with(model);
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed pipe fails the write instead (say_to)
  oom::examples::fail_oversized_writes_with_errors();
  try {
    return run(parse(argc, argv));
  } catch (const Error& e) {
    std::fprintf(stderr, "oom-train: error: %s\n", oom::user_message(e).c_str());
    return e.code() == Errc::out_of_budget ? 3 : 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "oom-train: error: out of host memory (an allocation failed; --host-mem sets the plan's host budget, "
                         "and the host's own limits, e.g. ulimit -v, apply too)\n");
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oom-train: error: %s\n", e.what());
    return 2;
  }
}
