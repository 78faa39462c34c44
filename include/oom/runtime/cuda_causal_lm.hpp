// CudaCausalLm: a Qwen3-MoE causal LM trained on one GPU as a Plan says — the CUDA counterpart of
// the HostExecutor (plus the embedding, final norm and LM head the example trainer adds there).
//
// State: a segment the plan makes resident lives on the GPU (bf16 weights, fp32 master, moments,
// gradient) and is updated there by the GPU AdamW; every other decoder-layer segment lives in pinned
// host memory as one block per segment (bf16 working copy, fp32 master, moments, gradient staging)
// and is streamed into one of `prefetch_depth` weight slots for each forward and backward, its
// gradient sent back after the layer's backward and applied by the CPU AdamW (on a host thread,
// ordered by a CUDA stream through cudaLaunchHostFunc) while the backward goes on. The embedding,
// final norm and LM head stay resident.
//
// Activations, per layer and per the plan: the layer's input (boundary) is kept on the GPU or
// offloaded to pinned host memory and brought back for the backward; the layer's saved buffer
// (everything its backward reads) is kept, offloaded, or recomputed from the boundary. The CUDA
// decoder layer saves one buffer, so the plan's per-class decisions map onto it: recompute when
// any class is recomputed, else offload when any is offloaded, else keep. Device memory comes
// from the backend's reserved arena; buffers are laid out once at construction (the step's
// allocation pattern is fixed), rotating buffers for offloaded and recomputed activations guarded
// by events, so the measured peak per claimant is the plan's memory, not an allocator's.
//
// Streams: compute, h2d (weights in, activations back, a later micro-batch's gradient sums back),
// d2h (activations out, gradients home), cpu (host functions running the CPU AdamW). Every step
// ends with all four drained.
//
// Every plan computes the same step: residency moves an update between the GPU and the CPU AdamW
// (bit-identical by construction), retention moves bytes, and the kernels are deterministic; the
// GPU tests compare weights bit for bit across plans.
//
// Precision: bf16 working weights, fp32 master weights and gradients, and AdamW moments as
// plan.precision.moments says: fp32 (the default) or bf16 (any other precision, in any field, is
// Errc::unsupported). bf16 moments hold every segment's m and v in bf16 where they live, on the GPU
// or in pinned host memory: 14 bytes of state a parameter instead of 18 (resident: bf16 weights,
// fp32 master and gradient, bf16 m and v; streamed: 10 of host state plus the gradient staging),
// as footprint() counts them. A step widens each m and v exactly to fp32, updates them in fp32,
// uses them unrounded for this step's weight, and stores them rounded to nearest even: the GPU
// AdamW (kernels::AdamWSegmentBf16) and the CPU AdamW (optim::AdamWSpan<bf16>) give the same
// bits, so every plan still computes the same step. The state API stays fp32 (state(),
// state_views(), load() and so checkpoints): moments are exported widened exactly, and loaded
// rounded to nearest even (to_bf16), which gives back the very bits for state exported from a
// model of bf16 moments.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "oom/model/model_spec.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/optim/segment_state.hpp"
#include "oom/plan/plan.hpp"
#include "oom/runtime/cuda_backend.hpp"
#include "oom/runtime/progress.hpp"
#include "oom/runtime/timeline.hpp"

namespace oom {

struct CudaCausalLmOptions {
  int device = 0;
  Bytes device_budget;  ///< the reserved device arena; default (0): the plan's GPU budget
  Bytes pinned_budget;  ///< pinned host memory for streamed state and offloads; default (0): the plan's host budget
  optim::AdamWConfig adamw;
  /// Threads of the CPU AdamW (the CUDA callback thread that runs it included); 0: one fewer than
  /// the hardware threads, so the thread issuing the GPU work (which waits on each layer's expert
  /// counts mid-layer) is never queued behind optimizer threads.
  unsigned cpu_threads = 0;
  /// kernels::ExpertGemmStreamsOptions::bucketed_algorithms for the layers' expert GEMMs (on;
  /// `oom-train --no-bucketed-expert-gemms` turns it off).
  bool bucketed_expert_gemms = true;
  /// Pinned fp32 gradient staging on the host: 0, one buffer per streamed parameter (18 bytes of
  /// pinned host memory a streamed parameter in all, 14 with bf16 moments); N >= 1, a ring of N
  /// layer-sized buffers that the backward's layers take in turn, a layer's gradients going down
  /// only once the CPU update of the buffer's previous layer has run (14 bytes a parameter, 10 with
  /// bf16 moments, plus N layers: at 32K on the 5.13B
  /// model 17.4 GiB of staging becomes ~3.6 GiB with N = 3, and the step ran no slower on the
  /// H200). N at least the number of streamed layers stages as 0 does (a ring that large takes no
  /// less pinned memory); so do plans of several micro-batches (the staging holds each layer's sum
  /// until the last one) and clipping (below).
  unsigned grad_staging_layers = 3;
  /// A layer whose plan recomputes some classes but keeps (or offloads) the attention output and
  /// softmax statistics: true, its backward reruns the layer around that kept attention state
  /// (decoder_layer_recompute: no attention kernel; 2 bytes a token per q-head dim kept per layer);
  /// false, the whole layer forward is rerun (what as_executed() then predicts).
  bool keep_attention_state = true;
  /// A step whose loss (any micro-batch's) is NaN or infinite ends after that loss: no backward of
  /// that micro-batch, none after it, no update (earlier micro-batches' gradients are dropped).
  bool skip_nonfinite_loss = true;
  /// In a layer whose routed experts are all GPU-resident, an expert no token reached this step
  /// gets no gradient buffer pass: the backward leaves it unwritten
  /// (model::DecoderLayerGrads::unrouted_experts) and its AdamW step takes zeros without reading
  /// one (the same bits as a zeroed buffer; clipping counts it as 0). False: zeroed and read as
  /// before. On the H200 at 4K with the 5.13B model (26-54 of 64 experts idle per layer in the
  /// first steps) the zeroing alone took 10.3 ms of a 115 ms step. One micro-batch a step only:
  /// with more, a later one would add to the unwritten buffer, so they are zeroed.
  bool leave_unrouted_expert_grads = true;
  /// Without clipping, a layer's resident AdamW steps run on a stream of their own, each as soon as
  /// its layer's backward has ended, beside the next layers' backward; the compute stream (and the
  /// expert GEMMs' side streams) get a higher priority, so the block scheduler serves the backward's
  /// kernels first and the memory-bound update fills what they leave. The same launches with the
  /// same inputs: the same bits. False: each layer's update on the compute stream after its
  /// backward, as before 2026-12-01.
  bool overlap_updates = true;
  /// > 0: clip the global gradient norm to this, as torch.nn.utils.clip_grad_norm_ (factor
  /// min(1, max / (norm + 1e-6)) on every gradient). Each segment's sum of squares is taken on the
  /// GPU as its gradients are made (no pass over weights or host memory); every update then waits
  /// for the end of the backward, so the CPU AdamW no longer overlaps it, and gradients are staged
  /// one pinned buffer per streamed parameter (grad_staging_layers is not used: a ring buffer is
  /// reused only after its layer's update). A NaN or infinite norm throws before any update.
  double max_grad_norm = 0;
  /// Without clipping (whose norm already refuses a NaN or infinite gradient before any update):
  /// every gradient is checked for NaN and infinity, the resident ones by their GPU AdamW as it
  /// reads them, the streamed ones by one GPU pass over the layer's gradient slot before they go
  /// home. The updates are not held back for it (that would cost the overlap with the backward),
  /// so a flagged step throws Errc::invalid_argument at its end, naming the resident segment (or
  /// the layer, for streamed ones): its updates ran with the bad values (and count in
  /// optimizer_steps()), and the run must go back to its last checkpoint.
  bool check_gradients = true;
  /// Test hook: compute does not wait for a layer's weights to arrive. Only for showing that the
  /// equivalence tests catch a broken schedule.
  bool drop_weight_wait = false;
  /// Test hook: the named segment's gradient gets a NaN (its first element) once the first
  /// micro-batch has written it, each step. Only for showing the gradient check at work.
  std::string poison_gradient;
};

/// How `p` chunks what this executor runs in chunks, for a report line: "MoE in chunks of N
/// tokens" (or "MoE whole"), ", attention in query chunks of Q tokens" where a softmax-attention
/// layer runs its backward in query chunks, and ", linear attention in parts of M tokens" where a
/// linear-attention layer runs its Gated DeltaNet block in parts.
[[nodiscard]] std::string describe_chunks(const ModelSpec& spec, const Plan& p);

/// The variant of a planner candidate CudaCausalLm::fit chose, and what it takes.
struct CudaPlanFit {
  Plan plan;                                   ///< the variant (retention_name says which)
  std::size_t candidate = 0;                   ///< its index among the candidates given
  std::array<Bytes, claimant_count> footprint{};  ///< CudaCausalLm::footprint of `plan`
};
/// How CudaCausalLm::fit weighs and ranks the variants of the planner's candidates.
struct CudaFitOptions {
  /// Called for every variant weighed: the candidate's index, the variant, its footprint, whether
  /// it fits.
  std::function<void(std::size_t candidate, const Plan& variant, const std::array<Bytes, claimant_count>& footprint, bool fits)>
      report;
  /// A variant's predicted step seconds as the executor runs it (e.g. the planner's simulate of
  /// CudaCausalLm::as_executed(variant)); empty: the first variant that fits is taken.
  std::function<double(const Plan& variant)> predict_step;
  /// Segment names in the order the planner makes segments resident (Planner::residency_order);
  /// empty: residency as planned. Given together with predict_step, each variant that fits is also
  /// weighed with the longest prefix of this order resident that still fits (the planned resident
  /// segments stay), and ranked with the rest: checkpointing can leave tens of GiB of the GPU that
  /// the planner, pricing activations per class, gave to activations. Without a predictor the
  /// first variant that fits is taken as it is.
  std::vector<std::string> residency_order;
};

class CudaCausalLm {
 public:
  /// The last GiB of the GPU's free memory, which the device arena never takes: the CUDA
  /// context, cuBLAS and the expert GEMMs' side handles allocate from it on their own. Callers
  /// sizing a plan for a device's free memory leave it too.
  static constexpr Bytes gpu_headroom{std::uint64_t{1} << 30};

  /// `weights(s, out)` fills the fp32 values of spec.segments()[s], called once per segment in spec
  /// order: a streamed segment's straight into its pinned master, a resident one's into one
  /// segment-sized buffer that is uploaded and reused, so building needs no copy of the whole
  /// model's weights in host memory (the 5.13B model's are 19.1 GiB). Errc::unsupported for layers
  /// the CUDA decoder layer does not implement or a state precision it does not keep (naming the
  /// field, e.g. "CudaCausalLm: precision.moments is fp16; it keeps fp32 or bf16 moments"), Errc::out_of_budget (naming the claimant) when the
  /// buffers the plan needs do not fit the device arena; what the source throws propagates.
  CudaCausalLm(const ModelSpec& spec, const Plan& plan, const SegmentWeightSource& weights, CudaCausalLmOptions options);
  /// The same from weights in memory: `weights[s]` holds spec.segments()[s]'s values
  /// (Errc::invalid_argument, before anything is allocated, for a wrong count of segments or values).
  CudaCausalLm(const ModelSpec& spec, const Plan& plan, const std::vector<std::vector<float>>& weights,
               CudaCausalLmOptions options);
  /// The most host memory the source-fed constructor takes beside the plan's while it builds, an
  /// upper bound: the largest segment's fp32 values and their bf16 copy (freed once built).
  [[nodiscard]] static Bytes build_buffer_bytes(const ModelSpec& spec);
  ~CudaCausalLm();
  CudaCausalLm(const CudaCausalLm&) = delete;
  CudaCausalLm& operator=(const CudaCausalLm&) = delete;

  struct StepResult {
    /// mean cross-entropy over the step's tokens, all micro-batches' (nats), plus the
    /// load-balancing loss where the config adds it (router_aux_loss_coef x aux, each
    /// micro-batch's carrying 1/K)
    double loss = 0;
    bool skipped = false;  ///< non-finite loss: no backward, no update
    double grad_norm = -1; ///< with max_grad_norm: the global gradient norm before clipping (else -1)
  };
  /// One optimizer step over plan.micro_batches = K windows (gradient accumulation): inputs ->
  /// targets, K x T tokens each (window by window, T = plan.workload.tokens()). A window holds
  /// plan.workload.sequences sequences of seq_len tokens, one after another: attention is causal
  /// within each, positions restart at 0 in each, a target is whatever the caller put there (the
  /// step does not shift tokens, so a sequence's last target may be the next one's first input).
  /// The windows run one
  /// after another; each one's gradient carries 1/(K T) and is added to the previous ones' in
  /// window order (a streamed layer's sum so far brought back into its GPU gradient slot), and the
  /// updates run after the last. Errc::invalid_argument (nothing run) for a wrong token count or an
  /// id past the vocab.
  StepResult step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets);

  /// Every segment's AdamW state, in spec.segments() order (a copy of all of it), fp32 whatever
  /// the plan's moments (bf16 moments widened exactly).
  [[nodiscard]] std::vector<SegmentOptimizerState> state();
  /// The same as views, with no copy: streamed segments viewed in their pinned host state,
  /// GPU-resident ones read from the GPU a range at a time as the reader asks. What a checkpoint
  /// writes from: at 512K on the 5.13B model a copy of the whole state (61.6 GB) beside the 65.9
  /// GiB pinned took the 125 GiB host out of memory; a copy of the resident segments alone held
  /// 30.9 GiB of RSS for a checkpoint of 8 layers of its widths, all resident. With bf16 moments
  /// streamed segments are read too (their moments widened a range at a time), so every view has
  /// a reader.
  [[nodiscard]] StateSnapshot state_views();
  /// Continues from saved state after `optimizer_steps` updates (sizes checked before any change).
  /// With bf16 moments the fp32 moments given are rounded to nearest even (exact for state this
  /// executor exported with bf16 moments).
  void load(const std::vector<SegmentOptimizerState>& state, std::int64_t optimizer_steps);
  /// The same, segment by segment from `source` (e.g. CheckpointReader::source()): streamed
  /// segments are filled straight into their pinned host state, so resuming needs no copy of the
  /// whole state in memory (at 512K on the 5.13B model that copy and the pinned state together do
  /// not fit a 125 GiB host). With bf16 moments a streamed segment's moments pass through two
  /// buffers of its fp32 values on their way to rounding (as a resident segment's whole state
  /// does). A source that throws leaves the model part-loaded: discard it.
  void load(const SegmentStateSource& source, std::int64_t optimizer_steps);
  [[nodiscard]] std::int64_t optimizer_steps() const;
  /// The learning rate of the steps that follow (a schedule sets it before each step).
  void set_learning_rate(float lr);

  /// The bytes by claimant this executor takes for `plan` (device claimants: its arena's exact
  /// peak, since every buffer is laid out at construction; host claimants: pinned memory), computed
  /// without a GPU. Errc::unsupported / invalid_argument as the constructor would throw.
  [[nodiscard]] static std::array<Bytes, claimant_count> footprint(const ModelSpec& spec, const Plan& plan,
                                                                   const CudaCausalLmOptions& options = {});

  /// `plan` as this executor carries it out, for predicting its step: the decoder layer keeps one
  /// saved buffer per layer, so a layer's classes other than its boundary share one decision (any
  /// recompute: the whole layer forward is rerun from its own boundary; else any offload: all go
  /// home). With `options.keep_attention_state`, a layer that recomputes but keeps (or offloads)
  /// its attention output and softmax statistics keeps (or offloads) those classes and recomputes
  /// the others: the simulation then charges neither the attention kernel nor the Q/K/V
  /// projections, norms and RoPE the executor does rerun (~14 ms a layer at 512K on the 5.13B
  /// model, against 4.4 s of attention), and holds the planner's Q, K, V and O for the attention
  /// output where the executor keeps O and the LSE. With MoE token chunks the backward regenerates
  /// each chunk's permuted tokens and expert activations. The ends (embedding, final norm, LM
  /// head) are listed resident, as the executor always holds them (the planner may stream the
  /// final norm and LM head). Boundaries, chunks and the layers' residency are as planned;
  /// `predicted` is left as it was (simulate the result to predict).
  /// Errc::unsupported / invalid_argument as the constructor.
  [[nodiscard]] static Plan as_executed(const ModelSpec& spec, const Plan& plan, const CudaCausalLmOptions& options = {});

  /// A plan this executor can run within `gpu_available` (its arena's peak) and `host_budget`
  /// (pinned), from the planner's `candidates` in their order. The planner prices activations per
  /// class while this executor keeps, offloads or recomputes a layer's saved buffer whole, so a
  /// candidate may need more GPU memory here than it was planned with, or less once checkpointed.
  /// Each candidate is weighed as planned, then with every layer checkpointed: boundaries kept and
  /// the rest recomputed around the kept attention output and LSE (only with
  /// options.keep_attention_state: no attention kernel in the recompute), boundaries kept and the
  /// whole layer rerun, boundaries offloaded and the whole layer rerun. A checkpoint variant that
  /// does not fit with the planned MoE chunks is weighed again with the MoE half in token chunks
  /// halved down to 4096, up to the first chunk that fits or while that still shrinks the
  /// footprint (the planner's chunk comes from its own, lower, estimate of the layer's scratch);
  /// a linear-attention layer's token parts are cut to the same length where they are longer
  /// (the Gated DeltaNet block's workspace grows with its part).
  /// Where a checkpoint that keeps its boundaries fits in none of those chunks, it is weighed with
  /// the fewest boundaries offloaded, from the first layer on, that bring it within the GPU (its
  /// chunks tried largest first): at 1M tokens the 5.13B model fits one H200 only so, every
  /// boundary kept being over the GPU and every one offloaded over the pinned budget.
  /// With fit.residency_order and fit.predict_step, every variant that fits is also weighed with
  /// more segments resident (CudaFitOptions). The first candidate with a variant that fits is taken: its fitting
  /// variant with the shortest fit.predict_step (the earlier one on a tie), or without a
  /// predictor, the first that fits in the order above.
  /// Errc::out_of_budget when nothing fits, naming the least GPU and pinned host memory any
  /// variant needs; Errc::invalid_argument for no candidates or a residency order naming an unknown
  /// segment; footprint()'s errors as it throws them (an as-planned variant it refuses ends the
  /// search too).
  [[nodiscard]] static CudaPlanFit fit(const ModelSpec& spec, std::span<const Plan> candidates, Bytes gpu_available,
                                       Bytes host_budget, const CudaCausalLmOptions& options = {},
                                       const CudaFitOptions& fit = {});

  [[nodiscard]] CudaBackend& backend();
  /// Seconds of the last step, measured with CUDA events around the whole step.
  [[nodiscard]] double last_step_seconds() const;
  /// Records the next step()'s work per resource into `timeline` (CUDA events around every load,
  /// forward, backward, recompute, offload, gradient copy and update; the CPU AdamW as the window
  /// its host function holds the cpu stream), from the step's start.
  void record_next_step(Timeline* timeline);
  /// Called before each layer's forward and backward is issued (runtime/progress.hpp); empty: none.
  void on_layer(LayerProgressFn fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oom
