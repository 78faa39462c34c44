// CudaCausalLm: see include/oom/runtime/cuda_causal_lm.hpp.
#include "oom/runtime/cuda_causal_lm.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <ranges>
#include <chrono>
#include <cmath>
#include <thread>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>

#include <fmt/format.h>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/core/numeric.hpp"
#include "oom/core/nvtx.hpp"
#include "oom/kernels/adamw_gpu.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/model/cuda_lm_ends.hpp"
#include "oom/optim/cpu_adamw.hpp"
#include "oom/optim/thread_pool.hpp"
#include "oom/runtime/timeline.hpp"

namespace oom {
namespace {

constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

/// What happens to a layer's saved buffer between its forward and its backward: kept on the GPU,
/// offloaded whole, recomputed whole, or `refill`: recomputed around the attention's output and
/// LSE, which alone are kept or offloaded (Layer::attn) — the attention kernel does not run again.
enum class Keep : unsigned char { keep, offload, recompute, refill };

bool is_attention_state(int c) { return is_attention_result(static_cast<ActivationClass>(c)); }

/// The saved buffer's one decision for a row of per-class decisions; `attn` gets where the
/// attention state goes for Keep::refill (only with `keep_attention_state`, and never for a
/// Gated DeltaNet layer, `linear`, which has no attention state: its recompute runs it all).
Keep blob_retention(const std::array<RetentionDecision, activation_class_count>& row, bool keep_attention_state = false,
                    Keep* attn = nullptr, bool linear = false) {
  keep_attention_state = keep_attention_state && !linear;
  bool offload = false, recompute = false, attn_recomputed = false, attn_offloaded = false;
  for (int c = 1; c < activation_class_count; ++c) {
    const auto a = row[static_cast<std::size_t>(c)].action;
    recompute |= a == Retention::recompute;
    offload |= a == Retention::offload;
    if (is_attention_state(c)) {
      attn_recomputed |= a == Retention::recompute;
      attn_offloaded |= a == Retention::offload;
    }
  }
  if (recompute && keep_attention_state && !attn_recomputed) {
    if (attn) *attn = attn_offloaded ? Keep::offload : Keep::keep;
    return Keep::refill;
  }
  if (recompute) return Keep::recompute;
  return offload ? Keep::offload : Keep::keep;
}

/// DeltaNetShape::chunk as DeltaNetShape::from_spec sets it: the interval of the layers CudaCausalLm
/// builds (a part that is no multiple of a layer's own interval is refused by its shape).
constexpr std::uint64_t linear_state_interval = 64;
/// A linear-attention layer's part of `tokens` (the plan's chunk) as the Gated DeltaNet block runs
/// it: rounded down to a multiple of the rule's state interval, at least one interval.
std::uint64_t linear_part(std::uint64_t tokens) {
  return std::max(linear_state_interval, tokens / linear_state_interval * linear_state_interval);
}
/// A softmax-attention layer's query chunk of `tokens` as the decoder layer runs it
/// (DecoderLayerShape::attention_chunk_tokens): rounded down to the planner's attention
/// granularity, 128 tokens, at least 128.
constexpr std::uint64_t query_chunk_granularity = 128;
std::uint64_t query_chunk(std::uint64_t tokens) {
  return std::max(query_chunk_granularity, tokens / query_chunk_granularity * query_chunk_granularity);
}
/// The token part a layer of kind `kind` runs its attention half in, given the plan's chunk ends
/// over a sequence of S tokens (0: whole, also where the rounding reaches S). A linear layer: its first chunk (the planner's parts of
/// a carried state are equal but the last). A softmax layer: its first chunk where the chunks are
/// equal but the last (as cut_attention_parts writes them), else the sequence split evenly into as
/// many chunks as the plan has (the planner's causal-prefix chunks shrink as the prefix grows; the
/// decoder layer's are equal, its dK/dV and d xn1 T-wide whatever the chunk).
std::uint64_t planned_part(AttentionKind kind, std::uint64_t S, const std::vector<std::uint64_t>& ends) {
  if (ends.size() <= 1) return 0;
  std::uint64_t part = 0;
  if (kind == AttentionKind::linear) {
    part = linear_part(ends.front());
  } else {
    bool equal = true;
    for (std::size_t i = 1; i + 1 < ends.size(); ++i) equal &= ends[i] - ends[i - 1] == ends.front();
    part = query_chunk(equal ? ends.front() : (S + ends.size() - 1) / ends.size());
  }
  return part < S ? part : 0;  // rounded up to a whole sequence: the layer runs it whole
}
/// What a part of at most `tokens` is for a layer of `kind` (linear_part or query_chunk).
std::uint64_t part_of(AttentionKind kind, std::uint64_t tokens) {
  return kind == AttentionKind::linear ? linear_part(tokens) : query_chunk(tokens);
}

}  // namespace

struct CudaCausalLm::Impl {
  struct Segment {
    std::string name;
    std::uint64_t n = 0;
    bool resident = false;
    // A routed expert's: its gradient is written by the layer's backward (DecoderLayerGrads::
    // overwrite_experts), never zeroed beforehand.
    bool expert = false;
    int expert_index = -1;  // its expert in the layer (expert segments)
    // This step's gradient is zero and its buffer unwritten: an expert no token reached, left
    // alone by its layer's backward (CudaCausalLmOptions::leave_unrouted_expert_grads).
    bool grad_zero = false;
    std::uint64_t slot_offset = 0;  // elements into its layer's weight/gradient slot (streamed)
    // AdamW moments m and v are fp32 or bf16 as the plan says (Impl::moments_bf16()): untyped here,
    // typed by moment<M>() where they are used.
    // resident (device)
    bf16* dw = nullptr;
    float *dmaster = nullptr, *dgrad = nullptr;
    void *dm = nullptr, *dv = nullptr;
    // streamed (pinned host, one block)
    bf16* hw = nullptr;
    float *hmaster = nullptr, *hgrad = nullptr;
    void *hm = nullptr, *hv = nullptr;
  };
  /// A segment's moment array as `M` (float or bf16, as moments_bf16() says).
  template <class M>
  static M* moment(void* p) { return static_cast<M*>(p); }
  // The CPU AdamW of one layer's streamed segments, run by a host function on the cpu stream.
  struct CpuUpdate {
    Impl* self = nullptr;
    std::vector<Segment*> segments;
    optim::AdamWStepScalars scalars;
  };
  struct Layer {
    std::vector<std::size_t> segments;  // indices into segs
    std::uint64_t streamed = 0;         // elements streamed per pass
    bool experts_resident = true;       // every routed expert's segment GPU-resident
    model::DecoderLayerShape shape;
    Keep boundary = Keep::keep, blob = Keep::keep;
    int ring = -1;             // its gradient staging buffer in the ring (grad_staging_layers > 0)
    Keep attn = Keep::keep;    // Keep::refill: where its attention output and LSE wait (keep or offload)
    std::byte* attn_keep = nullptr;  // ... on the GPU: O then LSE (attn_bytes)
    std::byte* attn_host = nullptr;  // ... offloaded
    bf16* x_keep = nullptr;    // kept boundary (input of this layer)
    bf16* x_host = nullptr;    // offloaded boundary
    std::byte* saved_keep = nullptr;
    std::byte* saved_host = nullptr;
    CudaBackend::Event updated, offloaded, forward_done;
    CudaBackend::Event restored, backward_done, grads_landed;  // the backward's, re-recorded every step
    CpuUpdate update;
    std::vector<std::int32_t> expert_counts;  // the forward's, for the backward (no second read-back)
  };
  struct Slot {
    bf16* ptr = nullptr;
    CudaBackend::Event free;   ///< after the last compute that read it
    CudaBackend::Event ready;  ///< after the copy of the layer it holds now
  };

  const ModelSpec* spec;
  Plan plan;
  CudaCausalLmOptions opt;
  std::optional<CudaBackend> backend;  // absent when only sizing (footprint())
  bool sizing = false;
  std::array<Bytes, claimant_count> need{};  // what take() handed out, by claimant
  Bytes largest_pinned;                      // the largest single pinned request
  std::uint64_t T = 0, H = 0, V = 0;
  std::uint64_t K = 1;  // micro-batches per step (plan.micro_batches), T tokens each
  std::vector<Segment> segs;
  std::vector<Layer> layers;
  // AdamW moments in bf16 (plan.precision.moments), else fp32: every segment's, on either side.
  bool moments_bf16() const { return plan.precision.moments == DType::bf16; }
  std::size_t moment_bytes() const { return size_of(plan.precision.moments); }
  std::size_t emb = 0, norm = 0, head = 0;  // segment indices of the ends (head == emb when tied)
  CudaBackend::Stream cs, h2d, d2h, cpu;
  CudaBackend::Stream us;  // resident AdamW beside the backward (options.overlap_updates), lowest priority
  CudaBackend::Event ends_done, updates_done;
  bool overlapped_updates() const { return opt.overlap_updates && !clipping(); }
  cublasHandle_t blas = nullptr;
  std::unique_ptr<kernels::ExpertGemmStreams> expert_streams;
  optim::ThreadPool pool;
  std::mutex error_mutex;
  std::exception_ptr cpu_error;
  std::vector<Slot> slots;
  std::size_t next_slot = 0;
  cudaEvent_t step_begin = nullptr, step_end = nullptr;  // timed
  // Activation buffers.
  std::size_t saved_bytes = 0;
  std::vector<bf16*> x_rot;                  // rotating boundaries (offloaded or passing through)
  std::vector<CudaBackend::Event> x_rot_free;
  std::vector<std::byte*> blob_rot;          // rotating saved buffers (offloaded or recomputed)
  std::vector<CudaBackend::Event> blob_rot_free;
  bf16 *y_scratch = nullptr, *dy = nullptr, *dx = nullptr;
  std::vector<float*> grad_slots;
  std::vector<CudaBackend::Event> grad_slot_free;
  std::vector<float*> grad_ring;                // pinned gradient staging ring (options.grad_staging_layers)
  std::vector<CudaBackend::Event> grad_ring_free;  // recorded on the cpu stream after each user's update
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::int32_t *d_ids = nullptr, *d_targets = nullptr, *d_positions = nullptr, *d_invalid = nullptr, *d_valid = nullptr;
  float* d_loss = nullptr;
  // transformers' load-balancing loss (output_router_logits): each micro-batch's forward adds
  // every layer's router to it; d_aux holds each micro-batch's coefficient x aux / K.
  std::optional<model::CudaRouterBalance> balance;
  double* d_aux = nullptr;
  // Clipping by global norm (options.max_grad_norm > 0): each segment's gradient sum of squares,
  // taken on the GPU as its gradients are made, and the kernel's scratch.
  double* d_sumsq = nullptr;
  void* sumsq_workspace = nullptr;
  std::size_t sumsq_workspace_bytes = 0;
  bool clipping() const { return opt.max_grad_norm > 0; }
  // The gradient check without clipping (CudaCausalLmOptions::check_gradients): flags set by the
  // resident AdamW (one per segment: [0, segs)) or by one pass over a streamed layer's gradient
  // slot (one per layer: segs + l), read after the step.
  bool checking() const { return opt.check_gradients && !clipping(); }
  int* d_nonfinite = nullptr;
  int* h_nonfinite = nullptr;  // pinned
  std::size_t flag_count() const { return segs.size() + layers.size(); }
  /// In the last micro-batch, once layer l's backward is done, before `done`: its streamed
  /// gradients (the slot's [0, streamed), the sum over the micro-batches: a NaN or infinity in any
  /// of them stays one) in one pass.
  void check_streamed(std::size_t l, const float* gslot, cudaStream_t s) {
    if (checking() && layers[l].streamed > 0)
      OOM_CUDA_CHECK(kernels::flag_nonfinite(gslot, static_cast<std::int64_t>(layers[l].streamed), d_nonfinite + segs.size() + l, s));
  }
  /// The test hook (CudaCausalLmOptions::poison_gradient), in the first micro-batch once the
  /// gradients of `which` are written: a NaN at the named segment's first element.
  template <class Range>
  void poison(const Range& which, float* gslot, cudaStream_t s) {
    if (opt.poison_gradient.empty()) return;
    for (const std::size_t sidx : which) {
      const Segment& g = segs[sidx];
      if (g.name != opt.poison_gradient || g.grad_zero) continue;
      float* grad = g.resident ? g.dgrad : gslot + g.slot_offset;
      OOM_CUDA_CHECK(cudaMemsetAsync(grad, 0xff, sizeof(float), s));  // 0xffffffff: a NaN
    }
  }
  void sum_of_squares(std::size_t sidx, const float* grads, cudaStream_t s) {
    const auto n = segs[sidx].grad_zero ? 0 : static_cast<std::int64_t>(segs[sidx].n);  // a zero gradient: 0
    OOM_CUDA_CHECK(kernels::grad_sum_of_squares(grads, n, d_sumsq + sidx, sumsq_workspace, sumsq_workspace_bytes, s));
  }
  /// The AdamW steps of the resident segments among `which` on the GPU, in one launch (a zero
  /// gradient not read: null grads).
  template <class Range>
  void adamw_resident(const optim::AdamWStepScalars& scalars, const Range& which, cudaStream_t s) {
    if (moments_bf16()) adamw_resident_as<bf16>(scalars, which, s);
    else adamw_resident_as<float>(scalars, which, s);
  }
  template <class M, class Range>
  void adamw_resident_as(const optim::AdamWStepScalars& scalars, const Range& which, cudaStream_t s) {
    std::vector<kernels::AdamWSegmentOf<M>> list;
    for (const std::size_t sidx : which) {
      const Segment& g = segs[sidx];
      if (g.resident)
        list.push_back({g.dmaster, moment<M>(g.dm), moment<M>(g.dv), g.grad_zero ? nullptr : g.dgrad, g.dw,
                        static_cast<std::int64_t>(g.n), checking() ? d_nonfinite + sidx : nullptr});
    }
    OOM_CUDA_CHECK(kernels::adamw_update_many(scalars, std::span<const kernels::AdamWSegmentOf<M>>(list), s));
  }
  std::int32_t* h_tokens = nullptr;  // pinned: ids then targets
  std::int64_t steps = 0;
  double last_seconds = 0;
  std::vector<std::pair<void*, std::pair<MemorySpace, std::pair<Bytes, Claimant>>>> owned;
  // Recording of one step (record_next_step): timed event pairs, resolved after the step.
  Timeline* timeline = nullptr;
  LayerProgressFn on_layer;
  struct Mark {
    std::string name;
    Resource resource;
    cudaEvent_t begin = nullptr, end = nullptr;
    // A decoder layer's call: the event it records between its halves (DecoderLayerContext::
    // halves), and the names of the spans before and after it, nested in this one.
    cudaEvent_t mid = nullptr;
    std::string first, second;
  };
  std::vector<Mark> marks;
  int span_begin(CudaBackend::Stream& st, Resource r, std::string name) {
    if (timeline == nullptr) return -1;
    Mark m;
    m.name = std::move(name);
    m.resource = r;
    OOM_CUDA_CHECK(cudaEventCreate(&m.begin));
    OOM_CUDA_CHECK(cudaEventCreate(&m.end));
    OOM_CUDA_CHECK(cudaEventRecord(m.begin, raw(st)));
    marks.push_back(std::move(m));
    return static_cast<int>(marks.size()) - 1;
  }
  /// The event for the layer call that span `mark` times to record between its halves (nullptr
  /// when not recording): the step's trace then also has "<what>.<first> <layer>" and
  /// "<what>.<second> <layer>" within it, the planner's op names (fwd.attention, bwd.mlp, ...).
  cudaEvent_t halves(int mark, std::string_view what, std::string_view first, std::string_view second, std::size_t l) {
    if (mark < 0) return nullptr;
    auto& m = marks[static_cast<std::size_t>(mark)];
    OOM_CUDA_CHECK(cudaEventCreate(&m.mid));
    m.first = fmt::format("{}.{} {}", what, first, label(l));
    m.second = fmt::format("{}.{} {}", what, second, label(l));
    return m.mid;
  }
  void span_end(CudaBackend::Stream& st, int mark) {
    if (mark >= 0) OOM_CUDA_CHECK(cudaEventRecord(marks[static_cast<std::size_t>(mark)].end, raw(st)));
  }
  void resolve_marks() {  // after the step's streams are drained
    flush_kernel_spans();
    for (auto& m : marks) {
      if (timeline != nullptr) {
        float b = 0, e = 0, h = 0;
        const bool whole = cudaEventElapsedTime(&b, step_begin, m.begin) == cudaSuccess &&
                           cudaEventElapsedTime(&e, step_begin, m.end) == cudaSuccess;
        const bool halves = whole && m.mid != nullptr && cudaEventElapsedTime(&h, step_begin, m.mid) == cudaSuccess;
        if (whole) timeline->add(m.name, m.resource, b / 1e3, e / 1e3);
        if (halves) {
          timeline->add(m.first, m.resource, b / 1e3, h / 1e3);
          timeline->add(m.second, m.resource, h / 1e3, e / 1e3);
        }
        // An event the step never recorded (a call that threw before it) answers with an error
        // the runtime also keeps as the thread's last: taken here, not reported by the next
        // launch's check.
        if (!whole || (m.mid != nullptr && !halves)) (void)cudaGetLastError();
      }
      (void)cudaEventDestroy(m.begin);
      (void)cudaEventDestroy(m.end);
      if (m.mid != nullptr) (void)cudaEventDestroy(m.mid);
    }
    marks.clear();
    timeline = nullptr;
  }
  std::string label(std::size_t l) const { return "layers." + std::to_string(l); }
  // The issuing thread's own time in a recorded step (from when it recorded step_begin, which the
  // idle compute stream reaches at once): where it waited, and how long issuing a layer took.
  std::chrono::steady_clock::time_point host_t0;
  double host_now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - host_t0).count(); }
  std::vector<kernels::HostSpan> kernel_spans;  // the expert launchers' waits and GEMM issues (traced step)
  /// The recorded kernel spans as host spans (once the step's spans are resolved or abandoned).
  void flush_kernel_spans() {
    kernels::record_host_spans(nullptr);
    if (timeline != nullptr)
      for (auto& w : kernel_spans)
        timeline->add_host(std::move(w.what), std::chrono::duration<double>(w.begin - host_t0).count(),
                           std::chrono::duration<double>(w.end - host_t0).count());
    kernel_spans.clear();
  }
  void host_span(std::string name, double begin_s) {
    if (timeline != nullptr) timeline->add_host(std::move(name), begin_s, host_now());
  }

  Impl(const ModelSpec& s, const Plan& p, CudaCausalLmOptions o, bool sizing_only)
      : spec(&s), plan(p), opt(o), sizing(sizing_only), pool(sizing_only ? 1 : optim::optimizer_threads(o.cpu_threads)) {
    if (sizing) return;
    // Size everything first: a plan the arena cannot hold is refused here, by claimant, before
    // any memory is taken; pinned slabs are made large enough for the largest single buffer.
    Impl probe(s, p, o, /*sizing_only=*/true);
    probe.build(nullptr);
    const Bytes reserve = reservation(o, p);
    const auto [device_need, host_need] = gpu_and_host(probe.need);
    if (reserve < device_need)
      OOM_THROW(Errc::out_of_budget,
                fmt::format("the plan needs {} of GPU memory with the CUDA executor (resident state {}, retained activations {}, "
                            "worksets {}), {} can be reserved (the plan's budget {}, at most the GPU's free memory less 1 GiB)",
                            device_need, probe.need[0], probe.need[1], probe.need[2], reserve,
                            o.device_budget.count() ? o.device_budget : p.gpu_budget));
    const Bytes pinned_budget = o.pinned_budget.count() ? o.pinned_budget : p.host_budget;
    if (pinned_budget < host_need)
      OOM_THROW(Errc::out_of_budget,
                fmt::format("the plan needs {} of pinned host memory with the CUDA executor (state {}, staging {}, offload {}), "
                            "the host budget is {}",
                            host_need, probe.need[3], probe.need[4], probe.need[5], pinned_budget));
    // Slabs are whole 4 KiB pages and at least 1 GiB; one must hold the largest single buffer.
    const Bytes slab{std::max<std::uint64_t>(std::uint64_t{1} << 30, probe.largest_pinned.align_up(4096).count())};
    // Reserve what the buffers take (plus slack for the sub-allocator's alignment), not the whole
    // budget: what is left of the GPU stays free for cuBLAS and the CUDA context.
    const Bytes slack{std::uint64_t{16} << 20};
    const Bytes take_bytes = device_need + slack < reserve ? device_need + slack : reserve;
    backend.emplace(CudaBackend::Options{o.device, take_bytes, o.pinned_budget.count() ? o.pinned_budget : p.host_budget, slab, Bytes{}});
  }

  // The device arena reserved up front: the plan's budget, but never the last GiB of the GPU, which
  // the CUDA context, cuBLAS and the expert GEMMs' side handles allocate from on their own. Should
  // the plan's buffers not fit what is reserved, the arena says so, naming the claimant.
  static Bytes reservation(const CudaCausalLmOptions& o, const Plan& p) {
    const Bytes want = o.device_budget.count() ? o.device_budget : p.gpu_budget;
    OOM_CUDA_CHECK(cudaSetDevice(o.device));
    std::size_t free_b = 0, total_b = 0;
    OOM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const Bytes avail{free_b > gpu_headroom.count() ? free_b - gpu_headroom.count() : 0};
    return want < avail ? want : avail;
  }

  void* take(MemorySpace where, std::size_t bytes, Claimant c) {
    const Bytes b{align_up(std::max<std::size_t>(bytes, 1))};
    need[static_cast<std::size_t>(c)] = need[static_cast<std::size_t>(c)] + b;
    if (!where.is_device() && largest_pinned < b) largest_pinned = b;
    if (sizing) return reinterpret_cast<void*>(std::uintptr_t{256});  // never dereferenced
    void* p = backend->allocate(where, b, c);
    owned.push_back({p, {where, {b, c}}});
    return p;
  }
  template <class T_>
  T_* dev(std::uint64_t count, Claimant c) { return static_cast<T_*>(take(MemorySpace::device(opt.device), count * sizeof(T_), c)); }
  template <class T_>
  T_* pinned(std::uint64_t count, Claimant c) { return static_cast<T_*>(take(MemorySpace::pinned_host(), count * sizeof(T_), c)); }

  cudaStream_t raw(const CudaBackend::Stream& s) const { return CudaBackend::raw(s); }

  /// Layer L's calls keep its expert counts from the forward for the backward.
  model::DecoderLayerContext layer_ctx(Layer& L, cudaEvent_t halves = nullptr) {
    return {raw(cs), blas, expert_streams.get(), &L.expert_counts, halves, balance ? &*balance : nullptr};
  }
  model::LmEndsContext ends_ctx() const { return {raw(cs), blas}; }

  static void CUDART_CB cpu_update(void* p);
  /// Layer L's CPU AdamW with `scalars`, on the cpu stream once its gradients have landed.
  void cpu_update_after(Layer& L, const optim::AdamWStepScalars& scalars) {
    backend->wait(cpu, L.grads_landed);
    L.update.scalars = scalars;
    const int cm = span_begin(cpu, Resource::cpu, "adamw " + label(static_cast<std::size_t>(&L - layers.data())));
    OOM_CUDA_CHECK(cudaLaunchHostFunc(raw(cpu), &Impl::cpu_update, &L.update));
    span_end(cpu, cm);
    backend->record(L.updated, cpu);
    if (L.ring >= 0) backend->record(grad_ring_free[static_cast<std::size_t>(L.ring)], cpu);
  }
  double last_grad_norm = -1;
  /// Clipping, after the backward: the global norm from the segments' sums of squares, added in
  /// segment order (so every plan gets the same factor), then every update of the step scaled by
  /// the factor: resident segments on the GPU, streamed layers by the CPU AdamW in forward order.
  /// A NaN or infinite sum throws before anything is updated.
  void apply_clipped_updates() {
    const cudaStream_t s = raw(cs);
    std::vector<double> sums(segs.size());
    OOM_CUDA_CHECK(cudaMemcpyAsync(sums.data(), d_sumsq, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, s));
    OOM_CUDA_CHECK(cudaStreamSynchronize(s));
    double total = 0;
    for (const double v : sums) total += v;  // every segment once (a tied head is the embedding)
    if (!std::isfinite(total)) {
      sync_all();
      resolve_marks();
      OOM_THROW(Errc::invalid_argument, fmt::format("step {}: the gradients' sum of squares is {} (a NaN or infinite gradient); "
                                                    "nothing was updated",
                                                    steps + 1, total));
    }
    last_grad_norm = std::sqrt(total);
    const auto scalars = optim::adamw_step_scalars(opt.adamw, steps + 1, optim::clip_grad_scale(total, opt.max_grad_norm));
    const int mk = span_begin(cs, Resource::gpu_compute, "adamw resident (clipped)");
    adamw_resident(scalars, std::views::iota(std::size_t{0}, segs.size()), s);
    span_end(cs, mk);
    Layer* last = nullptr;
    for (auto& L : layers)
      if (L.streamed > 0) cpu_update_after(*(last = &L), scalars);
    if (last != nullptr) backend->wait(cs, last->updated);  // the step (step_end) ends with its updates
  }
  void build(const SegmentWeightSource* weights);  // nullptr: sizing (the constructor requires a source)
  CudaBackend::Event event() { return sizing ? CudaBackend::Event{} : backend->make_event(); }
  void release() noexcept;
  /// Starts layer l's streamed weights down into the next slot (after its last reader); the
  /// compute waits for them with use_weights(). With two or more slots the executor issues a
  /// layer's load before the previous layer's compute, whose issue blocks mid-layer on the expert
  /// counts: issued after it, the copy started too late to hide (about 10 ms of idle GPU per
  /// streamed forward layer at 32K on the 5.13B model).
  Slot& load_weights(std::size_t l);
  void use_weights(std::size_t l, Slot& slot);
  bool prefetch_ahead() const { return slots.size() > 1; }
  /// A refill layer's attention output and LSE between its saved buffer `blob` and `store` (O,
  /// then the LSE at the next 256-byte boundary), on stream `on`.
  void copy_attention_state(const Layer& L, std::byte* blob, std::byte* store, bool into_store, CudaBackend::Stream& on) {
    const auto a = model::decoder_layer_attention_state(L.shape, blob);
    std::byte* o = store;
    std::byte* lse = store + align_up(a.output_bytes);
    if (into_store) {
      backend->copy(o, a.output, Bytes{a.output_bytes}, on);
      backend->copy(lse, a.lse, Bytes{a.lse_bytes}, on);
    } else {
      backend->copy(a.output, o, Bytes{a.output_bytes}, on);
      backend->copy(a.lse, lse, Bytes{a.lse_bytes}, on);
    }
  }
  std::vector<const bf16*> weight_bases(std::size_t l, const Slot& slot) const;
  std::vector<float*> grad_bases(std::size_t l, float* gslot) const;
  /// Zeroes layer L's streamed gradients in `gslot` but the routed experts' (which its backward
  /// overwrites), contiguous runs in one memset each.
  void zero_streamed_grads(const Layer& L, float* gslot, cudaStream_t s) const;
  /// A step: K micro-batches, each forward(), loss(), backward_layer() for the layers last to
  /// first and backward_ends(), then finish_step(). Everything is issued on the streams; the host
  /// waits only for a micro-batch's loss (skip_nonfinite_loss) and at the end.
  StepResult run_step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets);
  /// Micro-batch mb's embedding and layers' forward; the last layer's output goes to y_scratch.
  void forward(std::size_t mb, const model::LmEndsShape& ends);
  /// The LM head's loss and its backward into dy; starts the last layer's weights down into
  /// `upcoming`. Returns the mean loss when it is not finite (the step is then skipped), else nothing.
  std::optional<double> loss(std::size_t mb, const model::LmEndsShape& ends, Slot*& upcoming);
  /// Layer li's backward from dy into dx (then swapped), its weights in `upcoming` (which then
  /// names the next layer's): its activations back, any recompute, its streamed gradients summed
  /// in their slot and sent home, and in the last micro-batch its updates.
  void backward_layer(std::size_t li, std::size_t mb, const optim::AdamWStepScalars& scalars, Slot*& upcoming);
  /// The embedding's backward, then in the last micro-batch the ends' updates (or sums of squares).
  void backward_ends(std::size_t mb, const model::LmEndsShape& ends, const optim::AdamWStepScalars& scalars);
  /// The clipped updates if any, the step's time, its losses and the gradient check's verdict.
  StepResult finish_step();
  /// Every stream the step issues on (drained by sync_all, release and a failed step).
  std::array<CudaBackend::Stream*, 5> streams() { return {&cs, &us, &h2d, &d2h, &cpu}; }
  void sync_all() {
    for (auto* s : streams()) backend->synchronize(*s);
    std::lock_guard lock(error_mutex);
    if (cpu_error) std::rethrow_exception(std::exchange(cpu_error, nullptr));
  }
};

void CudaCausalLm::Impl::build(const SegmentWeightSource* weights) {
  const auto& all = spec->segments();
  // Before anything is sized or allocated: a plan counted at another precision would miss its memory.
  require_kept_precision(plan.precision, "CudaCausalLm");
  if (plan.gpus != 1)
    OOM_THROW(Errc::unsupported, fmt::format("the CUDA trainer runs on one GPU (the plan has {})", plan.gpus));
  refuse_unrunnable_micro_batch(plan.workload);
  if (plan.micro_batches < 1)
    OOM_THROW(Errc::invalid_argument, fmt::format("the plan has {} micro-batches a step (needs at least 1)", plan.micro_batches));
  K = static_cast<std::uint64_t>(plan.micro_batches);
  if (static_cast<int>(plan.retention.size()) != spec->num_layers())
    OOM_THROW(Errc::invalid_argument, fmt::format("plan covers {} layers, the model has {}", plan.retention.size(), spec->num_layers()));
  T = plan.workload.tokens();
  H = spec->hidden_size();
  V = spec->vocab_size();
  // Stream priorities: 0 is the default and the lowest; with the updates overlapped, the compute
  // stream and the expert GEMMs' side streams take the highest, the update stream 0.
  int lowest_priority = 0, highest_priority = 0;
  if (!sizing) {
    OOM_CUDA_CHECK(cudaSetDevice(opt.device));
    OOM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest_priority, &highest_priority));
  }
  const int compute_priority = overlapped_updates() ? highest_priority : lowest_priority;
  kernels::ExpertGemmStreamsOptions expert_options;
  expert_options.bucketed_algorithms = opt.bucketed_expert_gemms;
  expert_options.priority = compute_priority;
  expert_streams = std::make_unique<kernels::ExpertGemmStreams>(expert_options);
  if (!sizing) {
    cs = backend->make_stream(compute_priority);
    us = backend->make_stream(lowest_priority);
    ends_done = backend->make_event();
    updates_done = backend->make_event();
    h2d = backend->make_stream();
    d2h = backend->make_stream();
    cpu = backend->make_stream();
    OOM_CUBLAS_CHECK(cublasCreate(&blas));
    OOM_CUBLAS_CHECK(cublasSetStream(blas, raw(cs)));
    OOM_CUDA_CHECK(cudaEventCreate(&step_begin));
    OOM_CUDA_CHECK(cudaEventCreate(&step_end));
  }

  std::unordered_set<std::string> resident(plan.resident_segments.begin(), plan.resident_segments.end());
  // Segments: the ends are always resident (their kernels read them in place).
  const auto is_resident = [&](const StateSegment& seg) { return seg.layer < 0 || resident.count(seg.name) > 0; };
  // The gradient staging ring only when it has fewer buffers than there are streamed layers: with
  // as many, each layer-sized buffer would hold one layer's gradients, at least what one pinned
  // buffer per streamed parameter takes.
  std::unordered_set<int> streamed_layers;
  for (const auto& seg : all)
    if (!is_resident(seg)) streamed_layers.insert(seg.layer);
  // Clipping defers every update to the end of the backward, and micro-batches accumulate each
  // layer's gradients in its staging until the last one: no staging buffer could be reused.
  const bool ring = !clipping() && K == 1 && opt.grad_staging_layers > 0 && opt.grad_staging_layers < streamed_layers.size();
  segs.resize(all.size());
  // A resident segment's values on their way up, sized once for the largest (never regrown: what
  // build_buffer_bytes bounds).
  std::uint64_t largest_resident = 0;
  for (const auto& seg : all)
    if (is_resident(seg)) largest_resident = std::max(largest_resident, seg.parameters());
  std::vector<float> w32;
  std::vector<bf16> w16;
  if (!sizing) {
    w32.reserve(largest_resident);
    w16.reserve(largest_resident);
  }
  for (std::size_t s = 0; s < all.size(); ++s) {
    auto& g = segs[s];
    g.name = all[s].name;
    g.n = all[s].parameters();
    g.resident = is_resident(all[s]);
    g.expert = all[s].role == SegmentRole::expert;
    g.expert_index = all[s].expert;
    // One allocation sequence for the real run and for footprint(): sizing stops before the uploads.
    if (g.resident) {
      g.dw = dev<bf16>(g.n, Claimant::resident_state);
      g.dmaster = dev<float>(g.n, Claimant::resident_state);
      g.dm = take(MemorySpace::device(opt.device), g.n * moment_bytes(), Claimant::resident_state);
      g.dv = take(MemorySpace::device(opt.device), g.n * moment_bytes(), Claimant::resident_state);
      g.dgrad = dev<float>(g.n, Claimant::resident_state);
    } else {
      g.hw = pinned<bf16>(g.n, Claimant::host_state);
      g.hmaster = pinned<float>(g.n, Claimant::host_state);
      g.hm = take(MemorySpace::pinned_host(), g.n * moment_bytes(), Claimant::host_state);
      g.hv = take(MemorySpace::pinned_host(), g.n * moment_bytes(), Claimant::host_state);
      if (!ring) g.hgrad = pinned<float>(g.n, Claimant::host_staging);  // else: the ring, below
    }
    if (sizing) continue;
    if (g.resident) {
      w32.resize(g.n);
      w16.resize(g.n);
      (*weights)(s, w32);
      std::transform(w32.begin(), w32.end(), w16.begin(), [](float f) { return to_bf16(f); });
      OOM_CUDA_CHECK(cudaMemcpy(g.dw, w16.data(), g.n * sizeof(bf16), cudaMemcpyHostToDevice));
      OOM_CUDA_CHECK(cudaMemcpy(g.dmaster, w32.data(), g.n * sizeof(float), cudaMemcpyHostToDevice));
      OOM_CUDA_CHECK(cudaMemset(g.dm, 0, g.n * moment_bytes()));  // +0.0 in fp32 and bf16 alike
      OOM_CUDA_CHECK(cudaMemset(g.dv, 0, g.n * moment_bytes()));
    } else {
      (*weights)(s, std::span<float>(g.hmaster, g.n));
      std::transform(g.hmaster, g.hmaster + g.n, g.hw, [](float f) { return to_bf16(f); });
      std::memset(g.hm, 0, g.n * moment_bytes());
      std::memset(g.hv, 0, g.n * moment_bytes());
    }
  }
  emb = 0;
  norm = all.size() - (spec->tied_embeddings() ? 1 : 2);
  head = spec->tied_embeddings() ? emb : all.size() - 1;

  // Layers: shapes, retention, streamed extents.
  const int n = spec->num_layers();
  std::size_t first = 1;
  std::uint64_t max_streamed = 0;
  for (int l = 0; l < n; ++l) {
    Layer L;
    L.shape = model::DecoderLayerShape::from_spec(*spec, l, static_cast<std::int64_t>(T), static_cast<std::int64_t>(plan.workload.sequences));
    // The plan's MoE token chunk (0 or >= T: the MoE half runs whole).
    if (static_cast<std::size_t>(l) < plan.chunks.size())
      L.shape.moe_chunk_tokens = static_cast<std::int64_t>(std::min<std::uint64_t>(plan.chunks[static_cast<std::size_t>(l)].moe_tokens, T));
    // The attention half in the plan's token chunks (planned_part): a linear layer's Gated DeltaNet
    // block runs each sequence in parts of that many tokens (a multiple of the rule's state
    // interval), a softmax layer's backward one query chunk of a sequence at a time.
    if (static_cast<std::size_t>(l) < plan.chunks.size()) {
      const auto part = static_cast<std::int64_t>(
          planned_part(spec->layer(l).attention, plan.workload.seq_len, plan.chunks[static_cast<std::size_t>(l)].attention));
      (L.shape.linear ? L.shape.deltanet.part_tokens : L.shape.attention_chunk_tokens) = part;
    }
    for (std::size_t k = 0; k < spec->layer_segments(l).size(); ++k) {
      const std::size_t s = first + k;
      L.segments.push_back(s);
      if (segs[s].expert && !segs[s].resident) L.experts_resident = false;
      if (!segs[s].resident) {
        segs[s].slot_offset = L.streamed;
        L.streamed += segs[s].n;
      }
    }
    first += spec->layer_segments(l).size();
    const auto& row = plan.retention[static_cast<std::size_t>(l)];
    const auto b = row[static_cast<std::size_t>(ActivationClass::layer_boundary)].action;
    if (b == Retention::recompute)
      OOM_THROW(Errc::unsupported, fmt::format("layer {}: regenerating a boundary through earlier layers is not implemented on CUDA", l));
    L.boundary = b == Retention::offload ? Keep::offload : Keep::keep;
    L.blob = blob_retention(row, opt.keep_attention_state, &L.attn, L.shape.linear);
    L.updated = event();
    L.offloaded = event();
    L.forward_done = event();
    L.restored = event();  // created once: no driver calls for events inside a step
    L.backward_done = event();
    L.grads_landed = event();
    max_streamed = std::max(max_streamed, L.streamed);
    layers.push_back(std::move(L));
  }
  // The gradient staging ring: streamed layers take its buffers in backward order, so the
  // buffer a layer reuses was last filled N streamed layers earlier (or in the previous step).
  if (ring) {
    for (unsigned i = 0; i < opt.grad_staging_layers; ++i) {
      grad_ring.push_back(pinned<float>(max_streamed, Claimant::host_staging));
      grad_ring_free.push_back(event());
    }
    std::size_t next = 0;
    for (std::size_t li = layers.size(); li-- > 0;) {
      auto& L = layers[li];
      if (L.streamed == 0) continue;
      L.ring = static_cast<int>(next++ % grad_ring.size());
      if (sizing) continue;
      for (auto s : L.segments)
        if (!segs[s].resident) segs[s].hgrad = grad_ring[static_cast<std::size_t>(L.ring)] + segs[s].slot_offset;
    }
  }
  // One size for every layer's saved buffer and the one workspace: the largest (layers may chunk
  // their MoE half differently).
  for (const auto& L : layers) saved_bytes = std::max(saved_bytes, model::decoder_layer_saved_bytes(L.shape));
  for (auto& L : layers) {
    if (L.boundary == Keep::keep) L.x_keep = dev<bf16>(T * H, Claimant::retained_activations);
    else L.x_host = pinned<bf16>(T * H, Claimant::host_offload);
    if (L.blob == Keep::keep) L.saved_keep = dev<std::byte>(saved_bytes, Claimant::retained_activations);
    else if (L.blob == Keep::offload) L.saved_host = pinned<std::byte>(saved_bytes, Claimant::host_offload);
    if (L.blob == Keep::refill) {
      const auto a = model::decoder_layer_attention_state(L.shape, nullptr);
      const std::size_t bytes = align_up(a.output_bytes) + align_up(a.lse_bytes);
      if (L.attn == Keep::keep) L.attn_keep = dev<std::byte>(bytes, Claimant::retained_activations);
      else L.attn_host = pinned<std::byte>(bytes, Claimant::host_offload);
    }
    L.update.self = this;
    for (auto s : L.segments)
      if (!segs[s].resident) L.update.segments.push_back(&segs[s]);
  }
  // Rotating buffers: boundaries that are not kept pass through x_rot (3 deep: written by layer
  // l-1, read by layer l and the D2H, reused by layer l+2 once both are done); saved buffers that are
  // offloaded or recomputed use blob_rot (2 deep).
  const bool any_x_rot = std::any_of(layers.begin(), layers.end(), [](const Layer& L) { return L.boundary != Keep::keep; });
  const bool any_blob_rot = std::any_of(layers.begin(), layers.end(), [](const Layer& L) { return L.blob != Keep::keep; });
  for (int i = 0; i < (any_x_rot ? 3 : 0); ++i) {
    x_rot.push_back(dev<bf16>(T * H, Claimant::retained_activations));
    x_rot_free.push_back(event());
  }
  for (int i = 0; i < (any_blob_rot ? 2 : 0); ++i) {
    blob_rot.push_back(dev<std::byte>(saved_bytes, Claimant::retained_activations));
    blob_rot_free.push_back(event());
  }
  y_scratch = dev<bf16>(T * H, Claimant::worksets);  // the last layer's output, and recompute's throwaway output
  dy = dev<bf16>(T * H, Claimant::worksets);
  dx = dev<bf16>(T * H, Claimant::worksets);
  // Weight slots and gradient slots for the streamed segments.
  if (max_streamed > 0) {
    for (int i = 0; i < std::max(plan.prefetch_depth, 1); ++i)
      slots.push_back({dev<bf16>(max_streamed, Claimant::worksets), event(), event()});
    for (int i = 0; i < 2; ++i) {
      grad_slots.push_back(dev<float>(max_streamed, Claimant::worksets));
      grad_slot_free.push_back(event());
    }
  } else {
    slots.push_back({nullptr, event(), event()});
  }
  const auto ends = model::LmEndsShape::from_spec(*spec, static_cast<std::int64_t>(T));
  workspace_bytes = model::lm_ends_workspace_bytes(ends);
  for (const auto& L : layers) workspace_bytes = std::max(workspace_bytes, model::decoder_layer_workspace_bytes(L.shape, *expert_streams));
  workspace = take(MemorySpace::device(opt.device), workspace_bytes, Claimant::worksets);
  d_ids = dev<std::int32_t>(T, Claimant::worksets);
  d_targets = dev<std::int32_t>(T, Claimant::worksets);
  d_positions = dev<std::int32_t>(T, Claimant::worksets);
  d_invalid = dev<std::int32_t>(1, Claimant::worksets);
  d_valid = dev<std::int32_t>(1, Claimant::worksets);
  d_loss = dev<float>(K, Claimant::worksets);  // each micro-batch's loss sum
  if (const double coef = spec->moe().router_aux_loss_coef; coef > 0 && !layers.empty()) {
    const auto E = static_cast<std::int64_t>(spec->moe().experts);
    const std::size_t bytes = model::CudaRouterBalance::device_bytes(E, static_cast<std::int64_t>(T));
    void* at = take(MemorySpace::device(opt.device), bytes, Claimant::worksets);
    balance.emplace(static_cast<int>(layers.size()), E, static_cast<std::int64_t>(spec->moe().top_k), static_cast<std::int64_t>(T), coef,
                    1.0 / static_cast<double>(K), at, bytes);
    d_aux = dev<double>(K, Claimant::worksets);
  }
  if (clipping()) {
    std::uint64_t largest = 0;
    for (const auto& g : segs) largest = std::max<std::uint64_t>(largest, g.n);
    d_sumsq = dev<double>(segs.size(), Claimant::worksets);
    sumsq_workspace_bytes = kernels::grad_sum_of_squares_workspace_bytes(static_cast<std::int64_t>(largest));
    sumsq_workspace = take(MemorySpace::device(opt.device), sumsq_workspace_bytes, Claimant::worksets);
  }
  h_tokens = pinned<std::int32_t>(2 * K * T, Claimant::host_staging);  // per micro-batch: ids, then targets
  // The gradient check's flags (a few KiB; taken whatever the options, so that they move no
  // other figure).
  d_nonfinite = dev<int>(flag_count(), Claimant::worksets);
  h_nonfinite = pinned<int>(flag_count(), Claimant::host_staging);
  if (sizing) return;
  std::vector<std::int32_t> pos(T);  // each sequence's positions from 0
  for (std::uint64_t i = 0; i < T; ++i) pos[i] = static_cast<std::int32_t>(i % plan.workload.seq_len);
  OOM_CUDA_CHECK(cudaMemcpy(d_positions, pos.data(), T * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  // The uploads above ran on the legacy default stream, which the executor's non-blocking
  // streams do not wait for.
  OOM_CUDA_CHECK(cudaDeviceSynchronize());
}

void CudaCausalLm::Impl::release() noexcept {
  if (sizing) return;
  for (auto* s : streams())
    if (*s) (void)cudaStreamSynchronize(raw(*s));
  for (auto it = owned.rbegin(); it != owned.rend(); ++it) {
    try {
      backend->free(it->first, it->second.first, it->second.second.first, it->second.second.second);
    } catch (...) {
    }
  }
  owned.clear();
  if (blas) (void)cublasDestroy(blas);
  blas = nullptr;
  if (step_begin) (void)cudaEventDestroy(step_begin);
  if (step_end) (void)cudaEventDestroy(step_end);
  step_begin = step_end = nullptr;
}

// Brings layer l's streamed weights into the next slot, after the slot's last reader and the
// layer's last CPU update; compute waits for them.
CudaCausalLm::Impl::Slot& CudaCausalLm::Impl::load_weights(std::size_t l) {
  auto& L = layers[l];
  Slot& slot = slots[next_slot];
  next_slot = (next_slot + 1) % slots.size();
  if (L.streamed == 0) return slot;
  backend->wait(h2d, slot.free);
  backend->wait(h2d, L.updated);
  const int wm = span_begin(h2d, Resource::h2d, "h2d weights " + label(l));
  if (opt.drop_weight_wait) {
    // The test hook also slows the link (2 ms before each load), so a compute that does not wait
    // for its weights surely reads the slot's previous contents.
    OOM_CUDA_CHECK(cudaLaunchHostFunc(raw(h2d), [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }, nullptr));
  }
  for (auto* g : L.update.segments) backend->copy(slot.ptr + g->slot_offset, g->hw, Bytes{g->n * sizeof(bf16)}, h2d);
  span_end(h2d, wm);
  backend->record(slot.ready, h2d);
  return slot;
}

void CudaCausalLm::Impl::use_weights(std::size_t l, Slot& slot) {
  if (layers[l].streamed > 0 && !opt.drop_weight_wait) backend->wait(cs, slot.ready);
}

std::vector<const bf16*> CudaCausalLm::Impl::weight_bases(std::size_t l, const Slot& slot) const {
  std::vector<const bf16*> b;
  for (auto s : layers[l].segments) b.push_back(segs[s].resident ? segs[s].dw : slot.ptr + segs[s].slot_offset);
  return b;
}

void CudaCausalLm::Impl::zero_streamed_grads(const Layer& L, float* gslot, cudaStream_t s) const {
  std::uint64_t begin = 0, end = 0;  // the run [begin, end) of elements gathered so far
  const auto flush = [&] {
    if (end > begin) OOM_CUDA_CHECK(cudaMemsetAsync(gslot + begin, 0, (end - begin) * sizeof(float), s));
  };
  for (auto sidx : L.segments) {
    const auto& g = segs[sidx];
    if (g.resident || g.expert) continue;
    if (g.slot_offset != end) {
      flush();
      begin = g.slot_offset;
    }
    end = g.slot_offset + g.n;
  }
  flush();
}

std::vector<float*> CudaCausalLm::Impl::grad_bases(std::size_t l, float* gslot) const {
  std::vector<float*> b;
  for (auto s : layers[l].segments) b.push_back(segs[s].resident ? segs[s].dgrad : gslot + segs[s].slot_offset);
  return b;
}

void CUDART_CB CudaCausalLm::Impl::cpu_update(void* p) {
  OOM_NVTX_SCOPE("oom cpu adamw");
  auto* u = static_cast<CudaCausalLm::Impl::CpuUpdate*>(p);
  try {
    const auto update = [&]<class M>(Segment* g) {
      optim::AdamWSpan<M> span{{g->hmaster, g->n}, {moment<M>(g->hm), g->n}, {moment<M>(g->hv), g->n}, {g->hgrad, g->n}, {g->hw, g->n}};
      optim::adamw_update(span, u->scalars, u->self->pool);
    };
    for (auto* g : u->segments) {
      if (u->self->moments_bf16()) update.template operator()<bf16>(g);
      else update.template operator()<float>(g);
    }
  } catch (...) {
    std::lock_guard lock(u->self->error_mutex);
    if (!u->self->cpu_error) u->self->cpu_error = std::current_exception();
  }
}

CudaCausalLm::StepResult CudaCausalLm::Impl::run_step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets) {
  if (inputs.size() != K * T || targets.size() != K * T)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("a step takes {} x {} tokens (the plan's micro-batches x tokens), got {} inputs and {} targets", K, T,
                          inputs.size(), targets.size()));
  for (std::size_t i = 0; i < K * T; ++i)
    if (inputs[i] >= V || targets[i] >= V)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("token id {} at position {} is >= the model's vocab {}", std::max(inputs[i], targets[i]), i, V));
  const cudaStream_t s = raw(cs);
  OOM_CUDA_CHECK(cudaEventRecord(step_begin, s));
  host_t0 = std::chrono::steady_clock::now();
  if (timeline != nullptr) kernels::record_host_spans(&kernel_spans);
  for (std::size_t mb = 0; mb < K; ++mb)
    for (std::size_t i = 0; i < T; ++i) {
      h_tokens[2 * T * mb + i] = static_cast<std::int32_t>(inputs[T * mb + i]);
      h_tokens[2 * T * mb + T + i] = static_cast<std::int32_t>(targets[T * mb + i]);
    }
  OOM_CUDA_CHECK(cudaMemsetAsync(d_invalid, 0, sizeof(std::int32_t), s));
  if (checking()) OOM_CUDA_CHECK(cudaMemsetAsync(d_nonfinite, 0, flag_count() * sizeof(int), s));
  for (auto& g : segs)  // (the routed experts' are written by their layer's first backward)
    if (g.resident && !g.expert) OOM_CUDA_CHECK(cudaMemsetAsync(g.dgrad, 0, g.n * sizeof(float), s));
  // Each micro-batch's gradient carries 1 / (K T): their sum is the gradient of the mean over the
  // step's K T tokens.
  auto ends = model::LmEndsShape::from_spec(*spec, static_cast<std::int64_t>(T));
  ends.loss_tokens = static_cast<std::int64_t>(K * T);
  const auto scalars = optim::adamw_step_scalars(opt.adamw, steps + 1);

  OOM_NVTX_SCOPE("oom step");
  // Gradient accumulation: the micro-batches run one after another, each a whole forward and
  // backward. The first writes the gradients (zeroed above, or overwritten: the routed experts');
  // a later one adds to them: a resident segment's in place, a streamed layer's in its gradient
  // slot, refilled from the host's staging (which holds the sum so far) before the layer's
  // backward. So every plan sums in the same order, and the updates run in the last micro-batch.
  for (std::size_t mb = 0; mb < K; ++mb) {
    OOM_CUDA_CHECK(cudaMemcpyAsync(d_ids, h_tokens + 2 * T * mb, T * sizeof(std::int32_t), cudaMemcpyHostToDevice, s));
    OOM_CUDA_CHECK(cudaMemcpyAsync(d_targets, h_tokens + 2 * T * mb + T, T * sizeof(std::int32_t), cudaMemcpyHostToDevice, s));
    forward(mb, ends);
    Slot* upcoming = nullptr;  // the slot of the next layer the backward runs
    if (const auto skipped = loss(mb, ends, upcoming)) return {*skipped, true};
    for (std::size_t li = layers.size(); li-- > 0;) backward_layer(li, mb, scalars, upcoming);
    backward_ends(mb, ends, scalars);
  }
  return finish_step();
}

void CudaCausalLm::Impl::forward(std::size_t mb, const model::LmEndsShape& ends) {
  const std::size_t n = layers.size();
  // Where layer l's input lives during the forward: its kept buffer or a rotating one.
  std::vector<bf16*> x_at(n + 1, nullptr);
  std::vector<int> x_rot_index(n + 1, -1);
  int next_x_rot = 0;
  auto place_boundary = [&](std::size_t l) {  // l in [0, n): layer l's input
    if (layers[l].boundary == Keep::keep) {
      x_at[l] = layers[l].x_keep;
    } else {
      const int r = next_x_rot;
      next_x_rot = (next_x_rot + 1) % static_cast<int>(x_rot.size());
      backend->wait(cs, x_rot_free[static_cast<std::size_t>(r)]);  // its last D2H and reader are done
      x_at[l] = x_rot[static_cast<std::size_t>(r)];
      x_rot_index[l] = r;
    }
  };
  place_boundary(0);
  if (balance) balance->begin(raw(cs));
  int mk = span_begin(cs, Resource::gpu_compute, "embedding");
  model::lm_embed_forward(ends_ctx(), ends, segs[emb].dw, d_ids, x_at[0], d_invalid);
  span_end(cs, mk);
  int next_blob = 0;
  Slot* upcoming = n > 0 ? &load_weights(0) : nullptr;  // the next layer's weights
  for (std::size_t l = 0; l < n; ++l) {
    OOM_NVTX_SCOPE("oom forward layer");
    if (on_layer) on_layer({false, static_cast<int>(l), static_cast<int>(n), static_cast<int>(mb)});
    const double issued = host_now();
    auto& L = layers[l];
    Slot& slot = *upcoming;
    use_weights(l, slot);
    if (l + 1 < n && prefetch_ahead()) upcoming = &load_weights(l + 1);
    const auto params = model::bind_decoder_layer_params(*spec, static_cast<int>(l), weight_bases(l, slot));
    if (l + 1 < n) place_boundary(l + 1);
    bf16* y = l + 1 < n ? x_at[l + 1] : y_scratch;
    std::byte* saved = L.saved_keep;
    int blob = -1;
    if (L.blob != Keep::keep) {
      blob = next_blob;
      next_blob = (next_blob + 1) % 2;
      backend->wait(cs, blob_rot_free[static_cast<std::size_t>(blob)]);
      saved = blob_rot[static_cast<std::size_t>(blob)];
    }
    mk = span_begin(cs, Resource::gpu_compute, "fwd " + label(l));
    const double called = host_now();
    model::decoder_layer_forward(layer_ctx(L, halves(mk, "fwd", "attention", "mlp", l)), L.shape, params, d_positions, x_at[l], y, saved, saved_bytes, workspace, workspace_bytes);
    host_span("decoder_layer_forward " + label(l), called);
    span_end(cs, mk);
    // A refill layer keeps its attention output and LSE on the GPU (copied out before the blob
    // is reused) or sends them home with the offloads below.
    const bool attn_home = L.blob == Keep::refill && L.attn == Keep::offload;
    if (L.blob == Keep::refill && L.attn == Keep::keep) copy_attention_state(L, saved, L.attn_keep, true, cs);
    backend->record(L.forward_done, cs);
    backend->record(slot.free, cs);
    // Offload: the boundary (this layer's input) and the saved buffer go home once written.
    if (L.boundary == Keep::offload || L.blob == Keep::offload || attn_home) {
      backend->wait(d2h, L.forward_done);
      const int om = span_begin(d2h, Resource::d2h, "d2h activations " + label(l));
      if (L.boundary == Keep::offload) backend->copy(L.x_host, x_at[l], Bytes{T * H * sizeof(bf16)}, d2h);
      if (L.blob == Keep::offload) backend->copy(L.saved_host, saved, Bytes{saved_bytes}, d2h);
      if (attn_home) copy_attention_state(L, saved, L.attn_host, true, d2h);
      span_end(d2h, om);
      backend->record(L.offloaded, d2h);
    }
    if (L.boundary == Keep::offload) backend->record(x_rot_free[static_cast<std::size_t>(x_rot_index[l])], d2h);
    if (blob >= 0)
      backend->record(blob_rot_free[static_cast<std::size_t>(blob)], L.blob == Keep::offload || attn_home ? d2h : cs);
    if (l + 1 < n && !prefetch_ahead()) upcoming = &load_weights(l + 1);  // one slot: after its reader
    host_span("issue fwd " + label(l), issued);
  }
  if (balance) balance->finish(raw(cs), d_aux + mb);
}

std::optional<double> CudaCausalLm::Impl::loss(std::size_t mb, const model::LmEndsShape& ends, Slot*& upcoming) {
  const cudaStream_t s = raw(cs);
  const std::size_t n = layers.size();
  const int mk = span_begin(cs, Resource::gpu_compute, "loss");
  model::lm_head_forward_backward(ends_ctx(), ends, y_scratch, segs[norm].dw, segs[head].dw, d_targets, d_loss + mb, d_valid, dy,
                                  segs[norm].dgrad, segs[head].dgrad, workspace, workspace_bytes);
  span_end(cs, mk);
  // The last layer's weights start down before the host waits for the loss: the backward needs
  // them first, and a skipped step loses nothing by it (the slot is simply refilled later).
  upcoming = n > 0 ? &load_weights(n - 1) : nullptr;
  if (opt.skip_nonfinite_loss) {
    // A micro-batch's non-finite loss skips the whole step: nothing has been updated yet, and the
    // next step writes its gradients afresh.
    float loss_sum = 0;
    double aux = 0;
    const double waited = host_now();
    OOM_CUDA_CHECK(cudaMemcpyAsync(&loss_sum, d_loss + mb, sizeof(float), cudaMemcpyDeviceToHost, s));
    if (balance) OOM_CUDA_CHECK(cudaMemcpyAsync(&aux, d_aux + mb, sizeof(double), cudaMemcpyDeviceToHost, s));
    sync_all();
    host_span("wait for the loss", waited);
    const double mean = static_cast<double>(loss_sum) / static_cast<double>(K * T) + aux;
    if (!std::isfinite(mean)) {
      resolve_marks();
      return mean;
    }
  }
  return std::nullopt;
}

void CudaCausalLm::Impl::backward_layer(std::size_t li, std::size_t mb, const optim::AdamWStepScalars& scalars, Slot*& upcoming) {
  const cudaStream_t s = raw(cs);
  const bool last_mb = mb + 1 == K;
  int mk = 0;
  OOM_NVTX_SCOPE("oom backward layer");
  if (on_layer) on_layer({true, static_cast<int>(li), static_cast<int>(layers.size()), static_cast<int>(mb)});
  const double issued = host_now();
  auto& L = layers[li];
  Slot& slot = *upcoming;
  const auto params = model::bind_decoder_layer_params(*spec, static_cast<int>(li), weight_bases(li, slot));
  // The layer's input and saved buffer, back on the device.
  const bf16* x = L.x_keep;
  const std::byte* saved = L.saved_keep;
  const int r = static_cast<int>(li % 2);
  bf16* x_restore = nullptr;
  if (L.boundary == Keep::offload) {
    x_restore = x_rot[static_cast<std::size_t>(r)];
    backend->wait(h2d, x_rot_free[static_cast<std::size_t>(r)]);
    backend->wait(h2d, L.offloaded);
    backend->copy(x_restore, L.x_host, Bytes{T * H * sizeof(bf16)}, h2d);
    x = x_restore;
  }
  std::byte* blob = nullptr;
  const int rm = span_begin(h2d, Resource::h2d, "h2d activations " + label(li));
  if (L.blob != Keep::keep) {
    blob = blob_rot[static_cast<std::size_t>(r)];
    if (L.blob == Keep::offload || (L.blob == Keep::refill && L.attn == Keep::offload)) {
      backend->wait(h2d, blob_rot_free[static_cast<std::size_t>(r)]);
      backend->wait(h2d, L.offloaded);
      if (L.blob == Keep::offload) backend->copy(blob, L.saved_host, Bytes{saved_bytes}, h2d);
      else copy_attention_state(L, blob, L.attn_host, false, h2d);
    }
    saved = blob;
  }
  span_end(h2d, rm);
  // The layer's streamed gradients: a later micro-batch adds to the sum so far, brought back from
  // the host's staging into the slot once the previous micro-batch's have landed there.
  float* gslot = L.streamed > 0 ? grad_slots[li % 2] : nullptr;
  if (gslot != nullptr && mb > 0) {
    backend->wait(h2d, grad_slot_free[li % 2]);
    backend->wait(h2d, L.grads_landed);
    const int gm = span_begin(h2d, Resource::h2d, "h2d grads " + label(li));
    for (auto* g : L.update.segments) backend->copy(gslot + g->slot_offset, g->hgrad, Bytes{g->n * sizeof(float)}, h2d);
    span_end(h2d, gm);
  }
  auto& restored = L.restored;
  backend->record(restored, h2d);
  backend->wait(cs, restored);
  use_weights(li, slot);
  // The next layer's weights go down behind this layer's activations, before this layer's
  // compute is issued (a forward's issue blocks on the expert counts; the backward's takes the
  // forward's, kept in L.expert_counts).
  if (li > 0 && prefetch_ahead()) upcoming = &load_weights(li - 1);
  if (L.blob == Keep::recompute) {
    backend->wait(cs, blob_rot_free[static_cast<std::size_t>(r)]);
    mk = span_begin(cs, Resource::gpu_compute, "recompute " + label(li));
    model::decoder_layer_recompute(layer_ctx(L, halves(mk, "recompute", "attention", "mlp", li)), L.shape, params, d_positions, x, y_scratch, blob, saved_bytes, workspace,
                                   workspace_bytes, /*attention_state_kept=*/false);
    span_end(cs, mk);
  } else if (L.blob == Keep::refill) {
    // The kept attention state back into the blob (an offloaded one came in on h2d above), then
    // everything around it again; the attention kernel does not run.
    backend->wait(cs, blob_rot_free[static_cast<std::size_t>(r)]);
    if (L.attn == Keep::keep) copy_attention_state(L, blob, L.attn_keep, false, cs);
    mk = span_begin(cs, Resource::gpu_compute, "recompute (attention kept) " + label(li));
    model::decoder_layer_recompute(layer_ctx(L, halves(mk, "recompute", "attention", "mlp", li)), L.shape, params, d_positions, x, y_scratch, blob, saved_bytes, workspace,
                                   workspace_bytes, /*attention_state_kept=*/true);
    span_end(cs, mk);
  }
  if (gslot != nullptr && mb == 0) {
    backend->wait(cs, grad_slot_free[li % 2]);
    zero_streamed_grads(L, gslot, s);
  }
  auto grads = model::bind_decoder_layer_grads(*spec, static_cast<int>(li), grad_bases(li, gslot));
  // The first micro-batch's backward writes the experts' gradients (no zeroing); later ones add.
  grads.overwrite_experts = mb == 0;
  std::vector<std::uint8_t> unrouted;  // (filled as the backward is issued, from the expert counts)
  // An expert left unwritten holds garbage a later micro-batch would add to: only with one.
  if (opt.leave_unrouted_expert_grads && L.experts_resident && K == 1) grads.unrouted_experts = &unrouted;
  mk = span_begin(cs, Resource::gpu_compute, "bwd " + label(li));
  const double called = host_now();
  model::decoder_layer_backward(layer_ctx(L, halves(mk, "bwd", "mlp", "attention", li)), L.shape, params, d_positions, x, dy, saved, saved_bytes, dx, grads, workspace,
                                workspace_bytes);
  host_span("decoder_layer_backward " + label(li), called);
  for (auto sidx : L.segments) {
    auto& g = segs[sidx];
    g.grad_zero = g.expert && !unrouted.empty() && unrouted.at(static_cast<std::size_t>(g.expert_index)) != 0;
  }
  span_end(cs, mk);
  if (mb == 0) poison(L.segments, gslot, s);
  // The gradient check of the streamed segments, and with clipping the gradients' sums of
  // squares instead of the updates (every update once the norm is known), both before `done`:
  // the gradient slot's next user (a later micro-batch's refill on h2d, behind this layer's
  // D2H, which waits for `done`) must not overwrite what they read.
  if (last_mb) check_streamed(li, gslot, s);
  if (last_mb && clipping()) {
    mk = span_begin(cs, Resource::gpu_compute, "gradient sums of squares " + label(li));
    for (auto sidx : L.segments) sum_of_squares(sidx, segs[sidx].resident ? segs[sidx].dgrad : gslot + segs[sidx].slot_offset, s);
    span_end(cs, mk);
  }
  auto& done = L.backward_done;
  backend->record(done, cs);
  backend->record(slot.free, cs);
  if (x_restore != nullptr) backend->record(x_rot_free[static_cast<std::size_t>(r)], cs);
  if (blob != nullptr) backend->record(blob_rot_free[static_cast<std::size_t>(r)], cs);
  std::swap(dy, dx);
  // Resident segments update on the GPU; streamed gradients go home and the CPU AdamW applies them.
  if (!last_mb || clipping()) {
    // (the sums so far stay where they are: the updates wait for the last micro-batch, or the norm)
  } else if (overlapped_updates()) {
    backend->wait(us, done);
    mk = span_begin(us, Resource::gpu_compute, "adamw resident (beside the backward) " + label(li));
    adamw_resident(scalars, L.segments, raw(us));
    span_end(us, mk);
  } else {
    mk = span_begin(cs, Resource::gpu_compute, "adamw resident " + label(li));
    adamw_resident(scalars, L.segments, s);
    span_end(cs, mk);
  }
  if (L.streamed > 0) {
    backend->wait(d2h, done);
    if (L.ring >= 0) backend->wait(d2h, grad_ring_free[static_cast<std::size_t>(L.ring)]);
    const int gm = span_begin(d2h, Resource::d2h, "d2h grads " + label(li));
    for (auto* g : L.update.segments) backend->copy(g->hgrad, gslot + g->slot_offset, Bytes{g->n * sizeof(float)}, d2h);
    span_end(d2h, gm);
    auto& landed = L.grads_landed;
    backend->record(landed, d2h);
    backend->record(grad_slot_free[li % 2], d2h);
    if (last_mb && !clipping()) cpu_update_after(L, scalars);
  }
  if (li > 0 && !prefetch_ahead()) upcoming = &load_weights(li - 1);  // one slot: after its reader
  host_span("issue bwd " + label(li), issued);
}

void CudaCausalLm::Impl::backward_ends(std::size_t mb, const model::LmEndsShape& ends, const optim::AdamWStepScalars& scalars) {
  const cudaStream_t s = raw(cs);
  const bool last_mb = mb + 1 == K;
  // Embedding backward (dy now holds dL/dx of layer 0's input), then the ends' updates.
  const bool ends_beside = overlapped_updates();
  int mk = span_begin(cs, Resource::gpu_compute,
                      clipping() || ends_beside || !last_mb ? "embedding backward" : "embedding backward + adamw ends");
  model::lm_embed_backward(ends_ctx(), ends, d_ids, dy, segs[emb].dgrad, d_invalid, workspace, workspace_bytes);
  std::vector<std::size_t> ends_segs = {emb, norm};
  if (head != emb) ends_segs.push_back(head);
  if (mb == 0) poison(ends_segs, nullptr, s);
  if (!last_mb) {
    // (the next micro-batch adds to the ends' gradients)
  } else if (clipping()) {
    for (const auto sidx : ends_segs) sum_of_squares(sidx, segs[sidx].dgrad, s);
  } else if (!ends_beside) {
    adamw_resident(scalars, ends_segs, s);
  }
  span_end(cs, mk);
  if (ends_beside && last_mb) {
    // The ends' update behind the layers' on the update stream; the step ends when it has.
    backend->record(ends_done, cs);
    backend->wait(us, ends_done);
    mk = span_begin(us, Resource::gpu_compute, "adamw ends");
    adamw_resident(scalars, ends_segs, raw(us));
    span_end(us, mk);
    backend->record(updates_done, us);
    backend->wait(cs, updates_done);
  }
}

CudaCausalLm::StepResult CudaCausalLm::Impl::finish_step() {
  const cudaStream_t s = raw(cs);
  if (clipping()) apply_clipped_updates();
  OOM_CUDA_CHECK(cudaEventRecord(step_end, s));
  std::vector<float> loss_sums(K);
  std::vector<double> aux(K, 0.0);
  OOM_CUDA_CHECK(cudaMemcpyAsync(loss_sums.data(), d_loss, K * sizeof(float), cudaMemcpyDeviceToHost, s));
  if (balance) OOM_CUDA_CHECK(cudaMemcpyAsync(aux.data(), d_aux, K * sizeof(double), cudaMemcpyDeviceToHost, s));
  if (checking()) OOM_CUDA_CHECK(cudaMemcpyAsync(h_nonfinite, d_nonfinite, flag_count() * sizeof(int), cudaMemcpyDeviceToHost, s));
  sync_all();
  ++steps;  // counted once the whole step, updates included, is done
  if (checking()) {
    std::vector<std::string> where;  // resident segments by name, streamed ones by layer
    for (std::size_t i = 0; i < segs.size(); ++i)
      if (h_nonfinite[i] != 0) where.push_back(fmt::format("segment '{}'", segs[i].name));
    for (std::size_t l = 0; l < layers.size(); ++l)
      if (h_nonfinite[segs.size() + l] != 0) where.push_back(fmt::format("the streamed segments of {}", label(l)));
    if (!where.empty()) {
      resolve_marks();
      OOM_THROW(Errc::invalid_argument,
                fmt::format("step {}: non-finite gradient (NaN or infinite) in {}{}; this step's updates ran with it (counted: "
                            "optimizer_steps() {}), so the model state is not usable: go back to the last checkpoint",
                            steps, where.front(), where.size() > 1 ? fmt::format(" and {} more", where.size() - 1) : std::string(),
                            steps));
    }
  }
  float ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&ms, step_begin, step_end));
  last_seconds = ms / 1e3;
  resolve_marks();
  double loss_sum = 0, aux_sum = 0;
  for (std::size_t mb = 0; mb < K; ++mb) {  // in micro-batch order
    loss_sum += static_cast<double>(loss_sums[mb]);
    aux_sum += aux[mb];
  }
  // The training loss as transformers gives it: the mean cross-entropy plus coefficient x aux.
  return {loss_sum / static_cast<double>(K * T) + aux_sum, false, clipping() ? last_grad_norm : -1.0};
}

Plan CudaCausalLm::as_executed(const ModelSpec& spec, const Plan& plan, const CudaCausalLmOptions& options) {
  (void)footprint(spec, plan, options);  // the same checks the constructor makes
  Plan out = plan;
  out.grad_accumulation = GradAccumulation::device;  // a later micro-batch refills each streamed layer's gradient slot
  // The ends (embedding, final norm, LM head) are resident whatever the plan lists: the kernels
  // read them in place and they are updated on the GPU. Listed in ModelSpec order, as plans are.
  const std::unordered_set<std::string> listed(plan.resident_segments.begin(), plan.resident_segments.end());
  out.resident_segments.clear();
  for (const auto& seg : spec.segments())
    if (seg.layer < 0 || listed.contains(seg.name)) out.resident_segments.push_back(seg.name);
  const std::uint64_t T = plan.workload.tokens();
  // The LM head runs in the chunks its workspace rule gives, whatever rows the plan names.
  out.loss_rows = static_cast<std::uint64_t>(model::lm_head_chunk_rows(model::LmEndsShape::from_spec(spec, static_cast<std::int64_t>(T))));
  for (std::size_t l = 0; l < out.retention.size(); ++l) {
    auto& row = out.retention[l];
    Keep attn = Keep::keep;
    const Keep blob = blob_retention(row, options.keep_attention_state, &attn,
                                     spec.layer(static_cast<int>(l)).attention == AttentionKind::linear);
    const auto recompute = RetentionDecision::recompute(static_cast<int>(l));
    const auto shared = blob == Keep::recompute || blob == Keep::refill ? recompute
                        : blob == Keep::offload                         ? RetentionDecision::offload()
                                                                        : RetentionDecision::keep();
    for (int c = 1; c < activation_class_count; ++c)
      row[static_cast<std::size_t>(c)] =
          blob == Keep::refill && is_attention_state(c)
              ? (attn == Keep::offload ? RetentionDecision::offload() : RetentionDecision::keep())
              : shared;
    const std::uint64_t chunk = l < out.chunks.size() ? out.chunks[l].moe_tokens : 0;
    if (chunk > 0 && chunk < T && blob != Keep::recompute)
      for (auto c : {ActivationClass::permuted_tokens, ActivationClass::expert_intermediate})
        row[static_cast<std::size_t>(c)] = recompute;
  }
  return out;
}

namespace {

/// How CudaCausalLm::fit checkpoints a candidate's layers.
enum class Checkpoint : unsigned char { around_attention, whole, whole_offloaded_boundaries };

/// `p` with every layer checkpointed: its boundary kept (or offloaded), the attention output and
/// LSE kept (around_attention) and every other class recomputed from the layer's own boundary.
Plan checkpointed(Plan p, Checkpoint how) {
  for (std::size_t l = 0; l < p.retention.size(); ++l)
    for (int c = 0; c < activation_class_count; ++c) {
      auto& d = p.retention[l][static_cast<std::size_t>(c)];
      if (c == 0)
        d = how == Checkpoint::whole_offloaded_boundaries ? RetentionDecision::offload() : RetentionDecision::keep();
      else if (how == Checkpoint::around_attention && is_attention_state(c))
        d = RetentionDecision::keep();
      else
        d = RetentionDecision::recompute(static_cast<int>(l));
    }
  p.retention_name += how == Checkpoint::around_attention ? ", as checkpoint around kept attention state for the CUDA executor"
                      : how == Checkpoint::whole         ? ", as checkpoint for the CUDA executor"
                                                         : ", as checkpoint with offloaded boundaries for the CUDA executor";
  return p;
}

/// `p` with the boundaries of its first `j` layers offloaded and the rest as they are.
Plan with_offloaded_boundaries(Plan p, std::size_t j) {
  for (std::size_t l = 0; l < j && l < p.retention.size(); ++l)
    p.retention[l][static_cast<std::size_t>(ActivationClass::layer_boundary)] = RetentionDecision::offload();
  p.retention_name += fmt::format(", the first {} of {} boundaries offloaded", std::min(j, p.retention.size()), p.retention.size());
  return p;
}

/// Whether a layer of `p` runs its attention half in parts longer than part_of(tokens) (a whole
/// sequence counting as one part): what cutting them to `tokens` would still shrink. `softmax`
/// false: the linear layers' only.
bool attention_parts_longer(const ModelSpec& spec, const Plan& p, std::uint64_t tokens, bool softmax = true) {
  const std::uint64_t S = p.workload.seq_len;
  for (std::size_t l = 0; l < p.chunks.size(); ++l) {
    const AttentionKind kind = spec.layer(static_cast<int>(l)).attention;
    if (!softmax && kind != AttentionKind::linear) continue;
    const std::uint64_t part = planned_part(kind, S, p.chunks[l].attention);
    if (std::min(S, part > 0 ? part : S) > part_of(kind, tokens)) return true;
  }
  return false;
}
/// Every layer's attention half cut into parts of at most `tokens` (a linear layer's Gated DeltaNet
/// block: a multiple of the rule's state interval; a softmax layer's query chunks: of 128), where
/// the plan has them longer: their workspaces grow with them as the MoE half's does with its chunk.
/// `softmax` false: the linear layers' only.
void cut_attention_parts(const ModelSpec& spec, Plan& p, std::uint64_t tokens, bool softmax = true) {
  const std::uint64_t S = p.workload.seq_len;
  for (std::size_t l = 0; l < p.chunks.size(); ++l) {
    const AttentionKind kind = spec.layer(static_cast<int>(l)).attention;
    if (!softmax && kind != AttentionKind::linear) continue;
    const std::uint64_t part = part_of(kind, tokens), now = planned_part(kind, S, p.chunks[l].attention);
    if (part >= S || (now > 0 && now <= part)) continue;
    auto& ends = p.chunks[l].attention;
    ends.clear();
    for (std::uint64_t e = part; e < S; e += part) ends.push_back(e);
    ends.push_back(S);
  }
}

}  // namespace

std::string describe_chunks(const ModelSpec& spec, const Plan& p) {
  const std::uint64_t chunk = p.largest_moe_chunk();
  std::string s = chunk < p.workload.tokens() ? fmt::format("MoE in chunks of {} tokens", chunk) : std::string("MoE whole");
  std::uint64_t linear = 0, full = 0;
  for (std::size_t l = 0; l < p.chunks.size() && l < static_cast<std::size_t>(spec.num_layers()); ++l) {
    const AttentionKind kind = spec.layer(static_cast<int>(l)).attention;
    auto& part = kind == AttentionKind::linear ? linear : full;
    part = std::max(part, planned_part(kind, p.workload.seq_len, p.chunks[l].attention));
  }
  if (full > 0) s += fmt::format(", attention in query chunks of {} tokens", full);
  if (linear > 0) s += fmt::format(", linear attention in parts of {} tokens", linear);
  return s;
}

CudaPlanFit CudaCausalLm::fit(const ModelSpec& spec, std::span<const Plan> candidates, Bytes gpu_available,
                              Bytes host_budget, const CudaCausalLmOptions& options, const CudaFitOptions& fit) {
  if (candidates.empty()) OOM_THROW(Errc::invalid_argument, "CudaCausalLm::fit: no candidate plans");
  std::unordered_set<std::string> known;
  for (const auto& seg : spec.segments()) known.insert(seg.name);
  for (const auto& name : fit.residency_order)
    if (!known.contains(name))
      OOM_THROW(Errc::invalid_argument, fmt::format("CudaCausalLm::fit: the residency order names '{}', no segment of the model", name));
  Bytes least_gpu{~std::uint64_t{0}}, least_host{~std::uint64_t{0}};
  std::vector<Checkpoint> ways;
  if (options.keep_attention_state) ways.push_back(Checkpoint::around_attention);  // else the same as whole
  ways.push_back(Checkpoint::whole);
  ways.push_back(Checkpoint::whole_offloaded_boundaries);
  constexpr std::uint64_t smallest_moe_chunk = 4096;
  const auto fits = [&](const std::array<Bytes, claimant_count>& fp) {
    const auto [gpu, host] = gpu_and_host(fp);
    return gpu <= gpu_available && host <= host_budget;
  };
  // `p` with the first `extra` segments of the residency order it does not hold made resident
  // (names kept in ModelSpec order, as the planner writes them).
  const auto with_more_resident = [&](const Plan& p, std::size_t extra) {
    std::unordered_set<std::string> resident(p.resident_segments.begin(), p.resident_segments.end());
    for (const auto& name : fit.residency_order) {
      if (extra == 0) break;
      if (resident.insert(name).second) --extra;
    }
    Plan out = p;
    out.resident_segments.clear();
    for (const auto& s : spec.segments())
      if (resident.contains(s.name)) out.resident_segments.push_back(s.name);
    return out;
  };
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    std::vector<CudaPlanFit> fitting;
    // Weighs `p`: its GPU bytes; kept in `fitting` when it fits.
    const auto weigh_footprint = [&](const Plan& p, const std::array<Bytes, claimant_count>& fp) {
      const auto [gpu, host] = gpu_and_host(fp);
      least_gpu = std::min(least_gpu, gpu);
      least_host = std::min(least_host, host);
      const bool ok = fits(fp);
      if (fit.report) fit.report(i, p, fp, ok);
      if (ok) fitting.push_back({p, i, fp});
      return gpu;
    };
    const auto weigh = [&](const Plan& p) { return weigh_footprint(p, footprint(spec, p, options)); };
    // The first fit in the documented order, unless a predictor ranks them all.
    const auto enough = [&] { return !fit.predict_step && !fitting.empty(); };
    // A plan that regenerates boundaries through earlier layers (the planner's hybrid-regenerate)
    // is not run as planned here: only its checkpointed variants, which keep or offload them all.
    const bool regenerates = std::any_of(candidates[i].retention.begin(), candidates[i].retention.end(), [](const auto& row) {
      return row[static_cast<std::size_t>(ActivationClass::layer_boundary)].action == Retention::recompute;
    });
    if (!regenerates) weigh(candidates[i]);
    std::vector<std::pair<Bytes, bool>> whole_moe;  // each way with the planned chunks: GPU bytes, fits
    for (const Checkpoint how : ways) {
      if (enough()) break;
      const std::size_t before = fitting.size();
      const Bytes gpu = weigh(checkpointed(candidates[i], how));
      whole_moe.emplace_back(gpu, fitting.size() > before);
    }
    // Each way that does not fit with the planned chunks, weighed again with halved ones: its
    // variants that did not fit, in the order weighed (largest chunk first), and whether any did.
    std::vector<std::vector<Plan>> by_chunk(whole_moe.size());
    std::vector<bool> way_fits(whole_moe.size());
    for (std::size_t k = 0; k < whole_moe.size(); ++k) {
      way_fits[k] = whole_moe[k].second;
      if (way_fits[k] || enough()) continue;  // smaller chunks than a fitting variant's only cost time
      Plan p = checkpointed(candidates[i], ways[k]);
      by_chunk[k].push_back(p);
      Bytes last = whole_moe[k].first;
      for (std::uint64_t c = p.largest_moe_chunk() / 2; c >= smallest_moe_chunk; c /= 2) {
        for (auto& lc : p.chunks) lc.moe_tokens = c;
        // A softmax layer in query chunks holds dK/dV's fp32 sums T-wide (DecoderLayerShape::
        // attention_chunk_tokens): with as many key heads as query heads (OLMoE, Qwen1.5-MoE)
        // they take more than the rows the chunks spare, and where the layer's peak is elsewhere
        // they spare nothing. Its queries are cut with the chunk only where that weighs less.
        // (Weighed both ways only where some softmax layer's queries run longer than c.)
        cut_attention_parts(spec, p, c, /*softmax=*/false);
        auto fp = footprint(spec, p, options);
        bool cut_softmax = false;
        if (attention_parts_longer(spec, p, c)) {
          Plan all_cut = p;
          cut_attention_parts(spec, all_cut, c);
          auto all_cut_fp = footprint(spec, all_cut, options);
          cut_softmax = gpu_and_host(all_cut_fp).gpu < gpu_and_host(fp).gpu;
          if (cut_softmax) {
            p = std::move(all_cut);
            fp = all_cut_fp;
          }
        }
        const std::size_t before = fitting.size();
        const Bytes gpu = weigh_footprint(p, fp);
        if (fitting.size() > before) {
          way_fits[k] = true;
          break;
        }
        // Smaller chunks no longer help (the attention half dominates), unless a layer's attention
        // parts are still longer than the next chunk: cutting them may (their workspace). That is
        // the linear layers', and the softmax layers' only where cutting them weighed less here.
        if (!(gpu < last) && !attention_parts_longer(spec, p, c / 2, /*softmax=*/cut_softmax)) break;
        last = gpu;
        by_chunk[k].push_back(p);
      }
    }
    // A way that keeps every boundary and fits in none of those chunks, between keeping them all
    // (too much GPU memory) and offloading them all (too much pinned memory): the fewest offloaded,
    // from the first layer on, that bring the GPU within its budget. The first offload adds the
    // three rotating boundary buffers (T·H bf16 each), every further one frees a kept boundary
    // (T·H) and pins one: from one on, the GPU bytes fall and the pinned bytes rise with the count,
    // so a bisection finds the fewest that fit the GPU, which cost the least pinned memory and PCIe
    // traffic. All offloaded is not tried here: for the whole-layer checkpoint that is way 3, and
    // around the kept attention state it needs more GPU memory than way 3 for the same pinned.
    // The first layers' boundaries go first: they are written earliest in the forward and read
    // last in the backward, so their copies have the most time to hide. The chunks are tried
    // largest first, down to the first that fits: smaller ones cost host syncs.
    for (std::size_t k = 0; k < whole_moe.size() && !enough(); ++k) {
      if (ways[k] == Checkpoint::whole_offloaded_boundaries || way_fits[k]) continue;
      for (const Plan& base : by_chunk[k]) {
        const std::size_t layers = base.retention.size();
        const auto gpu_fits = [&](std::size_t j) {
          return gpu_and_host(footprint(spec, with_offloaded_boundaries(base, j), options)).gpu <= gpu_available;
        };
        if (layers < 2 || !gpu_fits(layers - 1)) continue;
        std::size_t lo = 1, hi = layers - 1;  // hi fits the GPU
        while (lo < hi) {
          const std::size_t mid = lo + (hi - lo) / 2;
          if (gpu_fits(mid)) hi = mid;
          else lo = mid + 1;
        }
        const std::size_t before = fitting.size();
        weigh(with_offloaded_boundaries(base, hi));
        if (fitting.size() > before) break;  // more offloaded with a larger chunk would not fit the pinned budget
      }
    }
    // The fitting variants with more segments resident: the most of the order's prefix that fits,
    // by bisection over how many more. The footprint never shrinks with each one: its resident state
    // (18 bytes a parameter, 14 with bf16 moments) at least equals the weight and gradient slots it
    // may shrink ((2 x depth + 8) bytes a parameter of the largest streamed layer, at most 14 for
    // the planner's depths of 2 and 3), and pinned host memory only shrinks.
    if (!fit.residency_order.empty() && !enough()) {
      const std::size_t found = fitting.size();
      for (std::size_t v = 0; v < found; ++v) {
        const Plan base = fitting[v].plan;
        const std::unordered_set<std::string> held(base.resident_segments.begin(), base.resident_segments.end());
        std::unordered_set<std::string> more;
        for (const auto& name : fit.residency_order)
          if (!held.contains(name)) more.insert(name);
        std::size_t lo = 0, hi = more.size();  // lo more fit
        while (lo < hi) {
          const std::size_t mid = lo + (hi - lo + 1) / 2;
          if (fits(footprint(spec, with_more_resident(base, mid), options))) lo = mid;
          else hi = mid - 1;
        }
        if (lo > 0) weigh(with_more_resident(base, lo));
      }
    }
    if (fitting.empty()) continue;
    if (!fit.predict_step) return fitting.front();
    std::size_t best = 0;
    double best_s = fit.predict_step(fitting[0].plan);
    for (std::size_t k = 1; k < fitting.size(); ++k)
      if (const double s = fit.predict_step(fitting[k].plan); s < best_s) best = k, best_s = s;
    return fitting[best];
  }
  OOM_THROW(Errc::out_of_budget, fmt::format("no candidate plan fits the CUDA executor: the least GPU memory any needs is {}, "
                                             "{} is available; the least pinned host memory {}, budget {}{}",
                                             least_gpu, gpu_available, least_host, host_budget,
                                             least_gpu <= gpu_available && least_host <= host_budget
                                                 ? " (each within its budget, but no variant within both)"
                                                 : ""));
}

namespace {
// Checked before the executor touches a device.
void require(const SegmentWeightSource& weights) {
  if (!weights) OOM_THROW(Errc::invalid_argument, "CudaCausalLm: no weight source");
}

// In-memory weights as a source, their counts checked first.
SegmentWeightSource checked_source(const ModelSpec& spec, const std::vector<std::vector<float>>& weights) {
  const auto& all = spec.segments();
  if (weights.size() != all.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("{} weight blocks for a model of {} segments", weights.size(), all.size()));
  for (std::size_t s = 0; s < all.size(); ++s)
    if (weights[s].size() != all[s].parameters())
      OOM_THROW(Errc::invalid_argument,
                fmt::format("segment '{}': {} values for {} parameters", all[s].name, weights[s].size(), all[s].parameters()));
  return [&weights](std::size_t s, std::span<float> out) { std::copy(weights[s].begin(), weights[s].end(), out.begin()); };
}
}  // namespace

CudaCausalLm::CudaCausalLm(const ModelSpec& spec, const Plan& plan, const SegmentWeightSource& weights, CudaCausalLmOptions options)
    : impl_((require(weights), std::make_unique<Impl>(spec, plan, options, /*sizing_only=*/false))) {
  try {
    impl_->build(&weights);
  } catch (...) {
    impl_->release();
    throw;
  }
}

CudaCausalLm::CudaCausalLm(const ModelSpec& spec, const Plan& plan, const std::vector<std::vector<float>>& weights,
                           CudaCausalLmOptions options)
    : CudaCausalLm(spec, plan, checked_source(spec, weights), options) {}

Bytes CudaCausalLm::build_buffer_bytes(const ModelSpec& spec) {
  std::uint64_t largest = 0;
  for (const auto& seg : spec.segments()) largest = std::max(largest, seg.parameters());
  return Bytes{largest * (sizeof(float) + sizeof(bf16))};
}

CudaCausalLm::~CudaCausalLm() { impl_->release(); }

CudaCausalLm::StepResult CudaCausalLm::step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets) {
  try {
    return impl_->run_step(inputs, targets);
  } catch (...) {
    for (auto* s : impl_->streams()) (void)cudaStreamSynchronize(CudaBackend::raw(*s));
    impl_->resolve_marks();  // frees a recording's events (its spans may be partial)
    {
      std::lock_guard lock(impl_->error_mutex);
      impl_->cpu_error = nullptr;  // reported (or superseded) by what is propagating now
    }
    throw;
  }
}

StateSnapshot CudaCausalLm::state_views() {
  impl_->sync_all();
  StateSnapshot snap;
  const bool bf16_moments = impl_->moments_bf16();
  for (auto& g : impl_->segs) {
    if (!g.resident && !bf16_moments) {
      snap.views.emplace_back(std::span<const float>(g.hmaster, g.n), std::span<const float>(Impl::moment<float>(g.hm), g.n),
                              std::span<const float>(Impl::moment<float>(g.hv), g.n));
      continue;
    }
    if (!g.resident) {
      // bf16 moments in the pinned state: read a range at a time, the master as it is, each moment
      // widened exactly to fp32 (no copy of the segment's moments as fp32).
      const float* master = g.hmaster;
      const std::array<const bf16*, 2> moments{Impl::moment<bf16>(g.hm), Impl::moment<bf16>(g.hv)};
      snap.views.emplace_back(g.n, [master, moments](StateArray a, std::size_t offset, std::span<float> out) {
        if (a == StateArray::master) {
          std::copy_n(master + offset, out.size(), out.begin());
          return;
        }
        moments_to_fp32(DType::bf16, moments[a == StateArray::exp_avg ? 0 : 1] + offset, out);
      });
      continue;
    }
    // Read from the GPU a range at a time, as the reader asks (a checkpoint: 8 MiB pieces), so a
    // model resident on the GPU is written without a host copy of its state (61.6 GB at 5.13B).
    // The pointers are the model's: valid while it takes no step and loads nothing (StateSnapshot).
    // SegmentStateView::copy checks the range before it asks. bf16 moments come down as bf16, the
    // range alone (into a buffer of this call's: views may be read from several threads), and are
    // widened exactly.
    // The reader may run on another thread than this one (a checkpoint's writer fills its pieces
    // on threads of its own), so it names the model's GPU itself.
    const std::array<const void*, 3> arrays{g.dmaster, g.dm, g.dv};  // in StateArray order
    snap.views.emplace_back(g.n, [arrays, bf16_moments, device = impl_->opt.device](StateArray a, std::size_t offset, std::span<float> out) {
      OOM_CUDA_CHECK(cudaSetDevice(device));
      const void* from = arrays[static_cast<std::size_t>(a)];
      if (a == StateArray::master || !bf16_moments) {
        OOM_CUDA_CHECK(cudaMemcpy(out.data(), static_cast<const float*>(from) + offset, out.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost));
        return;
      }
      std::vector<bf16> narrow(out.size());
      OOM_CUDA_CHECK(cudaMemcpy(narrow.data(), static_cast<const bf16*>(from) + offset, out.size() * sizeof(bf16),
                                cudaMemcpyDeviceToHost));
      moments_to_fp32(DType::bf16, narrow.data(), out);
    });
  }
  return snap;
}

std::vector<SegmentOptimizerState> CudaCausalLm::state() {
  const StateSnapshot snap = state_views();
  std::vector<SegmentOptimizerState> out;
  for (const auto& view : snap.views) {
    SegmentOptimizerState& st = out.emplace_back();
    for (auto [a, dst] : {std::pair{StateArray::master, &st.master}, {StateArray::exp_avg, &st.exp_avg},
                          {StateArray::exp_avg_sq, &st.exp_avg_sq}}) {
      dst->resize(view.size(a));
      view.copy(a, 0, *dst);
    }
  }
  return out;
}

void CudaCausalLm::load(const std::vector<SegmentOptimizerState>& state, std::int64_t optimizer_steps) {
  auto& segs = impl_->segs;
  if (state.size() != segs.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("state of {} segments for a model of {}", state.size(), segs.size()));
  for (std::size_t i = 0; i < segs.size(); ++i)
    if (state[i].master.size() != segs[i].n || state[i].exp_avg.size() != segs[i].n || state[i].exp_avg_sq.size() != segs[i].n)
      OOM_THROW(Errc::invalid_argument, fmt::format("state of segment '{}': sizes do not match its {} parameters", segs[i].name, segs[i].n));
  load([&](std::size_t i, std::span<float> w, std::span<float> m, std::span<float> v) {
    std::copy(state[i].master.begin(), state[i].master.end(), w.begin());
    std::copy(state[i].exp_avg.begin(), state[i].exp_avg.end(), m.begin());
    std::copy(state[i].exp_avg_sq.begin(), state[i].exp_avg_sq.end(), v.begin());
  }, optimizer_steps);
}

void CudaCausalLm::load(const SegmentStateSource& source, std::int64_t optimizer_steps) {
  auto& segs = impl_->segs;
  const bool bf16_moments = impl_->moments_bf16();
  impl_->sync_all();
  // A resident segment's values on their way to the GPU; with bf16 moments, also a streamed one's
  // moments on their way to rounding.
  std::vector<float> w, m, v;
  std::vector<bf16> w16, m16, v16;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    auto& g = segs[i];
    if (g.resident) {
      w.resize(g.n), m.resize(g.n), v.resize(g.n), w16.resize(g.n);
      source(i, w, m, v);
      std::transform(w.begin(), w.end(), w16.begin(), [](float f) { return to_bf16(f); });
      OOM_CUDA_CHECK(cudaMemcpy(g.dmaster, w.data(), g.n * sizeof(float), cudaMemcpyHostToDevice));
      if (bf16_moments) {
        m16.resize(g.n), v16.resize(g.n);
        moments_from_fp32(DType::bf16, m, m16.data());  // rounded to nearest even
        moments_from_fp32(DType::bf16, v, v16.data());
        OOM_CUDA_CHECK(cudaMemcpy(g.dm, m16.data(), g.n * sizeof(bf16), cudaMemcpyHostToDevice));
        OOM_CUDA_CHECK(cudaMemcpy(g.dv, v16.data(), g.n * sizeof(bf16), cudaMemcpyHostToDevice));
      } else {
        OOM_CUDA_CHECK(cudaMemcpy(g.dm, m.data(), g.n * sizeof(float), cudaMemcpyHostToDevice));
        OOM_CUDA_CHECK(cudaMemcpy(g.dv, v.data(), g.n * sizeof(float), cudaMemcpyHostToDevice));
      }
      OOM_CUDA_CHECK(cudaMemcpy(g.dw, w16.data(), g.n * sizeof(bf16), cudaMemcpyHostToDevice));
    } else if (bf16_moments) {  // the master straight into the pinned state, the moments through fp32
      m.resize(g.n), v.resize(g.n);
      source(i, {g.hmaster, g.n}, m, v);
      moments_from_fp32(DType::bf16, m, g.hm);
      moments_from_fp32(DType::bf16, v, g.hv);
      std::transform(g.hmaster, g.hmaster + g.n, g.hw, [](float f) { return to_bf16(f); });
    } else {  // straight into the pinned state
      source(i, {g.hmaster, g.n}, {Impl::moment<float>(g.hm), g.n}, {Impl::moment<float>(g.hv), g.n});
      std::transform(g.hmaster, g.hmaster + g.n, g.hw, [](float f) { return to_bf16(f); });
    }
  }
  OOM_CUDA_CHECK(cudaDeviceSynchronize());  // the copies above ran on the legacy default stream
  impl_->steps = optimizer_steps;
}

std::int64_t CudaCausalLm::optimizer_steps() const { return impl_->steps; }
void CudaCausalLm::set_learning_rate(float lr) { impl_->opt.adamw.lr = lr; }

std::array<Bytes, claimant_count> CudaCausalLm::footprint(const ModelSpec& spec, const Plan& plan,
                                                           const CudaCausalLmOptions& options) {
  Impl sizing(spec, plan, options, /*sizing_only=*/true);
  sizing.build(nullptr);
  return sizing.need;
}
CudaBackend& CudaCausalLm::backend() { return *impl_->backend; }
double CudaCausalLm::last_step_seconds() const { return impl_->last_seconds; }
void CudaCausalLm::record_next_step(Timeline* timeline) { impl_->timeline = timeline; }
void CudaCausalLm::on_layer(LayerProgressFn fn) { impl_->on_layer = std::move(fn); }

}  // namespace oom
