// A Qwen3-MoE decoder layer on the GPU; contract in include/oom/model/cuda_decoder_layer.hpp.
// Host code only (the kernels are OOM's launchers and cuBLAS), so it is a .cpp: fmt builds the
// error messages here.
#include "oom/model/cuda_decoder_layer.hpp"

#include "cuda_layer_util.hpp"

#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/attention.hpp"
#include "oom/kernels/cast.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/kernels/permute.hpp"
#include "oom/kernels/rmsnorm.hpp"
#include "oom/kernels/rope.hpp"
#include "oom/kernels/router.hpp"
#include "oom/kernels/swiglu.hpp"
#include "oom/model/model_spec.hpp"

namespace oom::model {
namespace {

using kernels::ExpertGemmMethod;
constexpr ExpertGemmMethod expert_method = ExpertGemmMethod::row_chunked;

[[noreturn]] void invalid(const std::string& what) { throw Error(Errc::invalid_argument, "decoder layer: " + what); }

/// A launcher's status: the step that failed and why (oom::detail::check_launch); each entry point
/// forgets any reason left on this thread too (oom/kernels/refusal.hpp).
void check(cudaError_t status, std::string_view step) { ::oom::detail::check_launch(status, "decoder layer", step); }
void check(cublasStatus_t status, std::string_view step) { detail::check_cublas(status, "decoder layer", step); }
void gemm(cublasHandle_t blas, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
          std::int64_t lda, const void* b, std::int64_t ldb, void* c, cudaDataType_t c_type, std::int64_t ldc, float beta,
          std::string_view step) {
  detail::gemm_bf16(blas, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, c_type, ldc, beta, "decoder layer", step);
}
using detail::Carver;

std::int64_t q_width(const DecoderLayerShape& s) { return s.heads_q * s.head_dim; }
std::int64_t kv_width(const DecoderLayerShape& s) { return s.heads_kv * s.head_dim; }
/// Tokens per MoE chunk: moe_chunk_tokens, or T when the MoE half runs whole (0 or >= T).
std::int64_t moe_chunk(const DecoderLayerShape& s) {
  return s.moe_chunk_tokens > 0 && s.moe_chunk_tokens < s.tokens ? s.moe_chunk_tokens : s.tokens;
}
bool chunked(const DecoderLayerShape& s) { return moe_chunk(s) < s.tokens; }
/// N: rows of one chunk's expert GEMMs (the largest chunk's).
std::int64_t chunk_slots(const DecoderLayerShape& s) { return moe_chunk(s) * s.top_k; }

/// One MoE chunk's permutation and expert activations (N = n*k rows for a chunk of n tokens). Whole:
/// kept in `saved` for the backward; chunked: in the workspace, recomputed by the backward per chunk.
struct ExpertRows {
  std::int32_t* row_to_slot;  // (N)
  std::int32_t* slot_to_row;  // (N)
  std::int32_t* counts;       // (E)
  std::int32_t* offsets;      // (E + 1)
  bf16* x_perm;               // (N, H)
  bf16* gate_up;              // (N, 2I)
  bf16* act;                  // (N, I)          silu(gate) * up
  bf16* y_perm;               // (N, H)          expert outputs before the weighted combine
};

ExpertRows carve_expert_rows(const DecoderLayerShape& s, Carver& c) {
  const auto N = chunk_slots(s), H = s.hidden, I = s.intermediate;
  ExpertRows r{};
  r.row_to_slot = c.take<std::int32_t>(N);
  r.slot_to_row = c.take<std::int32_t>(N);
  r.counts = c.take<std::int32_t>(s.experts);
  r.offsets = c.take<std::int32_t>(s.experts + 1);
  r.x_perm = c.take<bf16>(N * H);
  r.gate_up = c.take<bf16>(N * 2 * I);
  r.act = c.take<bf16>(N * I);
  r.y_perm = c.take<bf16>(N * H);
  return r;
}

/// What the forward keeps for the backward, in this order in `saved`.
struct Saved {
  float* rstd1;            // (T)
  bf16* xn1;               // (T, H)          rms1(x) * w
  bf16* q_raw;             // (T, Hq, D)      xn1 Wq^T (input of q_norm)
  bf16* k_raw;             // (T, Hkv, D)
  float* q_rstd;           // (T * Hq)
  float* k_rstd;           // (T * Hkv)
  bf16* q;                 // (T, Hq, D)      rope(q_norm(q_raw)), the attention's Q
  bf16* k;                 // (T, Hkv, D)
  bf16* v;                 // (T, Hkv, D)
  bf16* attn;              // (T, Hq, D)      the attention's output O
  float* lse;              // (B, Hq, S): Hq T values
  bf16* h;                 // (T, H)          x + O Wo^T
  float* rstd2;            // (T)
  bf16* xn2;               // (T, H)          rms2(h) * w
  float* probs;            // (T, E)
  std::int32_t* expert_ids;  // (T, k)
  float* weights;          // (T, k)
  ExpertRows rows;         // whole MoE only (chunked: all null)
};

Saved carve_saved(const DecoderLayerShape& s, void* base, std::size_t* total = nullptr) {
  Carver c(base);
  const auto T = s.tokens, H = s.hidden, E = s.experts;
  Saved v{};
  v.rstd1 = c.take<float>(T);
  v.xn1 = c.take<bf16>(T * H);
  v.q_raw = c.take<bf16>(T * q_width(s));
  v.k_raw = c.take<bf16>(T * kv_width(s));
  v.q_rstd = c.take<float>(T * s.heads_q);
  v.k_rstd = c.take<float>(T * s.heads_kv);
  v.q = c.take<bf16>(T * q_width(s));
  v.k = c.take<bf16>(T * kv_width(s));
  v.v = c.take<bf16>(T * kv_width(s));
  v.attn = c.take<bf16>(T * q_width(s));
  v.lse = c.take<float>(s.heads_q * T);
  v.h = c.take<bf16>(T * H);
  v.rstd2 = c.take<float>(T);
  v.xn2 = c.take<bf16>(T * H);
  v.probs = c.take<float>(T * E);
  v.expert_ids = c.take<std::int32_t>(T * s.top_k);
  v.weights = c.take<float>(T * s.top_k);
  if (!chunked(s)) v.rows = carve_expert_rows(s, c);
  if (total) *total = c.size();
  return v;
}

kernels::RouterShape router_shape(const DecoderLayerShape& s) {
  return {s.tokens, s.hidden, s.experts, s.top_k, s.norm_topk_prob};
}
/// The permutation of a chunk of n tokens.
kernels::PermuteShape permute_shape(const DecoderLayerShape& s, std::int64_t n) { return {n, s.top_k, s.experts}; }
kernels::ExpertGemmShape expert_shape(const DecoderLayerShape& s) {
  return {s.hidden, s.intermediate, s.experts, chunk_slots(s)};
}
/// permute_plan's CUB scratch for every chunk size that occurs (a full chunk and the tail).
std::size_t plan_workspace_bytes(const DecoderLayerShape& s) {
  const auto C = moe_chunk(s), tail = s.tokens % C;
  return std::max(kernels::permute_plan_workspace_bytes(permute_shape(s, C)),
                  kernels::permute_plan_workspace_bytes(permute_shape(s, tail > 0 ? tail : C)));
}
kernels::AttentionProblem attention_problem(const DecoderLayerShape& s) {
  kernels::AttentionProblem p;
  p.batch = static_cast<int>(s.sequences);
  p.seq = static_cast<int>(s.tokens / s.sequences);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.head_dim = static_cast<int>(s.head_dim);
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));  // HF: head_dim ** -0.5
  return p;
}

/// Forward scratch.
struct ForwardScratch {
  float* logits;    // (T, E)
  void* plan_ws;    // permute_plan's
  std::size_t plan_bytes;
  bf16* moe_out;    // (C, H)   one chunk's combined expert outputs
  void* gemm_ws;    // the expert GEMMs'
  std::size_t gemm_bytes;
  ExpertRows rows;  // chunked MoE only (whole: in `saved`)
};

ForwardScratch carve_forward(const DecoderLayerShape& s, const kernels::ExpertGemmStreams& streams, void* base,
                             std::size_t* total = nullptr) {
  Carver c(base);
  ForwardScratch f{};
  f.logits = c.take<float>(s.tokens * s.experts);
  f.plan_bytes = plan_workspace_bytes(s);
  f.plan_ws = c.take_bytes(f.plan_bytes);
  f.moe_out = c.take<bf16>(moe_chunk(s) * s.hidden);
  f.gemm_bytes = kernels::expert_gemm_workspace_bytes(expert_shape(s), expert_method, &streams);
  f.gemm_ws = c.take_bytes(f.gemm_bytes);
  if (chunked(s)) f.rows = carve_expert_rows(s, c);
  if (total) *total = c.size();
  return f;
}

/// Backward scratch. The MoE phase (all chunks, then the router backward) and the attention phase
/// that follows share storage; what crosses from one to the other lives outside both.
struct BackwardScratch {
  // Both phases.
  float* d_weights;    // (T, k)
  bf16* dxn2;          // (T, H)   then, in place, the MoE branch's d h, then d h = dy + it
  float* d_logits;     // (T, E)
  void* router_ws;
  std::size_t router_bytes;
  void* norm_ws;       // the largest of the four rmsnorm backwards'
  std::size_t norm_bytes;
  void* gemm_ws;
  std::size_t gemm_bytes;
  void* plan_ws;       // chunked: the recomputed permute plans'
  std::size_t plan_bytes;
  // MoE phase (N = chunk_slots rows).
  ExpertRows rows;     // chunked: one chunk's recomputed forward
  bf16* dy_perm;       // (N, max(H, 2I))
  bf16* d_gate_up;     // (N, 2I)  in dy_perm's storage: written after the down backward read dy_perm
  bf16* d_act;         // (N, I)
  bf16* dx_perm;       // (N, H)   chunked: in rows.y_perm's storage, whose last reader is the combine backward
  // Attention phase.
  bf16* d_attn;        // (T, Hq, D)
  bf16* dq;            // (T, Hq, D)
  bf16* dk;            // (T, Hkv, D)
  bf16* dv;            // (T, Hkv, D)
  void* attn_ws;
  std::size_t attn_bytes;
  float* dxn1_f32;     // (T, H)   the three projections' dx summed in fp32
  bf16* dxn1;          // (T, H)   then, in place, the attention branch's d x
};

BackwardScratch carve_backward(const DecoderLayerShape& s, const kernels::ExpertGemmStreams& streams, void* base,
                               std::size_t* total = nullptr) {
  Carver c(base);
  const auto T = s.tokens, H = s.hidden, N = chunk_slots(s), I = s.intermediate;
  BackwardScratch b{};
  b.d_weights = c.take<float>(T * s.top_k);
  b.dxn2 = c.take<bf16>(T * H);
  b.d_logits = c.take<float>(T * s.experts);
  b.router_bytes = kernels::router_backward_workspace_bytes(router_shape(s));
  b.router_ws = c.take_bytes(b.router_bytes);
  b.norm_bytes = std::max({kernels::rmsnorm_backward_workspace_bytes(T, H),
                           kernels::rmsnorm_backward_workspace_bytes(T * s.heads_q, s.head_dim),
                           kernels::rmsnorm_backward_workspace_bytes(T * s.heads_kv, s.head_dim)});
  b.norm_ws = c.take_bytes(b.norm_bytes);
  b.gemm_bytes = kernels::expert_gemm_workspace_bytes(expert_shape(s), expert_method, &streams);
  b.gemm_ws = c.take_bytes(b.gemm_bytes);
  b.plan_bytes = chunked(s) ? plan_workspace_bytes(s) : 0;
  b.plan_ws = chunked(s) ? c.take_bytes(b.plan_bytes) : nullptr;

  const std::size_t phases = c.mark();
  if (chunked(s)) b.rows = carve_expert_rows(s, c);
  b.dy_perm = c.take<bf16>(N * std::max(H, 2 * I));
  b.d_gate_up = b.dy_perm;
  b.d_act = c.take<bf16>(N * I);
  b.dx_perm = chunked(s) ? b.rows.y_perm : c.take<bf16>(N * H);

  c.rewind(phases);
  b.d_attn = c.take<bf16>(T * q_width(s));
  b.dq = c.take<bf16>(T * q_width(s));
  b.dk = c.take<bf16>(T * kv_width(s));
  b.dv = c.take<bf16>(T * kv_width(s));
  b.attn_bytes = kernels::attention_backward_workspace_bytes(attention_problem(s));
  b.attn_ws = c.take_bytes(b.attn_bytes);
  b.dxn1_f32 = c.take<float>(T * H);
  b.dxn1 = c.take<bf16>(T * H);
  if (total) *total = c.size();
  return b;
}

template <class P>
void check_experts(const DecoderLayerShape& s, const std::vector<P>& gate, const std::vector<P>& up, const std::vector<P>& down,
                   const char* what) {
  const auto E = static_cast<std::size_t>(s.experts);
  if (gate.size() != E || up.size() != E || down.size() != E)
    invalid(fmt::format("{}: expert pointer arrays have {}/{}/{} entries (gate/up/down) for {} experts", what, gate.size(),
                        up.size(), down.size(), E));
  for (std::size_t e = 0; e < E; ++e) {
    if (!gate[e] || !up[e] || !down[e]) invalid(fmt::format("{}: expert {} has a null pointer", what, e));
    if (up[e] != gate[e] + s.intermediate * s.hidden)
      invalid(fmt::format("{}: expert {}'s up_proj does not directly follow its gate_proj (the expert GEMM reads "
                          "[gate_proj; up_proj] as one (2I, H) matrix; lay them out as in the expert's segment)",
                          what, e));
  }
}

void check_params(const DecoderLayerShape& s, const DecoderLayerParams& p) {
  const std::pair<const bf16*, const char*> named[] = {
      {p.input_layernorm, "input_layernorm"}, {p.q_proj, "q_proj"},   {p.k_proj, "k_proj"},
      {p.v_proj, "v_proj"},                   {p.o_proj, "o_proj"},   {p.q_norm, "q_norm"},
      {p.k_norm, "k_norm"},                   {p.post_attention_layernorm, "post_attention_layernorm"},
      {p.router, "router (mlp.gate)"}};
  for (const auto& [ptr, name] : named)
    if (!ptr) invalid(fmt::format("params: {} is null", name));
  check_experts(s, p.expert_gate_proj, p.expert_up_proj, p.expert_down_proj, "params");
}

void check_grads(const DecoderLayerShape& s, const DecoderLayerGrads& g) {
  const std::pair<const float*, const char*> named[] = {
      {g.input_layernorm, "input_layernorm"}, {g.q_proj, "q_proj"},   {g.k_proj, "k_proj"},
      {g.v_proj, "v_proj"},                   {g.o_proj, "o_proj"},   {g.q_norm, "q_norm"},
      {g.k_norm, "k_norm"},                   {g.post_attention_layernorm, "post_attention_layernorm"},
      {g.router, "router (mlp.gate)"}};
  for (const auto& [ptr, name] : named)
    if (!ptr) invalid(fmt::format("grads: {} is null", name));
  check_experts(s, g.expert_gate_proj, g.expert_up_proj, g.expert_down_proj, "grads");
}

void check_buffers(const void* saved, std::size_t saved_bytes, std::size_t saved_needed, const void* workspace,
                   std::size_t workspace_bytes, std::size_t workspace_needed) {
  if (!saved || saved_bytes < saved_needed)
    invalid(fmt::format("saved buffer {} with {} bytes; needs {} (decoder_layer_saved_bytes)", saved ? "given" : "null",
                        saved_bytes, saved_needed));
  if (!workspace || workspace_bytes < workspace_needed)
    invalid(fmt::format("workspace {} with {} bytes; needs {} (decoder_layer_workspace_bytes)", workspace ? "given" : "null",
                        workspace_bytes, workspace_needed));
}

void check_context(const DecoderLayerContext& ctx) {
  kernels::clear_refusal();  // see check()
  if (!ctx.blas) invalid("context has no cuBLAS handle");
  if (!ctx.expert_streams) invalid("context has no ExpertGemmStreams (the row_chunked expert GEMMs need one)");
}

/// One chunk's E per-expert row counts are sane: none negative, summing to `rows` = n*k.
void check_counts(const DecoderLayerShape& s, std::span<const std::int32_t> counts, std::int64_t rows, Errc code,
                  std::string_view source) {
  std::int64_t total = 0;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] < 0) throw Error(code, fmt::format("decoder layer: {}: expert {} has {} rows", source, e, counts[e]));
    total += counts[e];
  }
  if (static_cast<std::int64_t>(counts.size()) != s.experts || total != rows)
    throw Error(code, fmt::format("decoder layer: {}: {} expert counts sum to {}, expected {} summing to tokens*k = {}",
                                  source, counts.size(), total, s.experts, rows));
}

/// The E per-expert row counts of one chunk on the host (the expert GEMMs' m/k arguments): one
/// read-back + sync. `rows` = n*k, what they must sum to.
std::vector<std::int32_t> download_counts(const DecoderLayerShape& s, const std::int32_t* counts, std::int64_t rows,
                                          cudaStream_t stream, kernels::ExpertGemmStreams& streams) {
  std::vector<std::int32_t> host(static_cast<std::size_t>(s.experts));
  check(kernels::expert_counts_to_host(stream, counts, s.experts, streams, host.data()), "read-back of the expert counts");
  check_counts(s, host, rows, Errc::internal, "read-back");
  return host;
}

/// Permutation of tokens [c0, c0 + n) by their (saved) expert ids into r. Deterministic, so the
/// backward's recomputation gives the forward's permutation.
void plan_rows(const DecoderLayerShape& s, cudaStream_t st, const std::int32_t* expert_ids, std::int64_t c0,
               std::int64_t n, const ExpertRows& r, void* plan_ws, std::size_t plan_bytes) {
  check(kernels::permute_plan(st, permute_shape(s, n), expert_ids + c0 * s.top_k, r.row_to_slot, r.slot_to_row, r.counts,
                              r.offsets, plan_ws, plan_bytes),
        "permute plan");
}

/// Whether the caller's host copy of the forward's counts (DecoderLayerContext::expert_counts) is
/// there to use: one of E per chunk; every chunk's then checked, before anything is launched.
bool counts_kept(const DecoderLayerContext& ctx, const DecoderLayerShape& s) {
  const std::int64_t C = moe_chunk(s), chunks = (s.tokens + C - 1) / C;
  if (ctx.expert_counts == nullptr || ctx.expert_counts->size() != static_cast<std::size_t>(chunks * s.experts))
    return false;
  const std::span<const std::int32_t> all(*ctx.expert_counts);
  for (std::int64_t index = 0; index < chunks; ++index) {
    const std::int64_t n = std::min(C, s.tokens - index * C);
    check_counts(s, all.subspan(static_cast<std::size_t>(index * s.experts), static_cast<std::size_t>(s.experts)),
                 n * s.top_k, Errc::invalid_argument, fmt::format("DecoderLayerContext::expert_counts, chunk {}", index));
  }
  return true;
}

/// The experts of one chunk of n tokens, from its rows of xn2 to r.y_perm: gather, gate/up GEMMs,
/// SwiGLU, down GEMMs. The forward and the backward's recomputation issue exactly these launches.
void experts_forward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                     const std::vector<std::int32_t>& counts, const bf16* xn2_rows, std::int64_t n, const ExpertRows& r,
                     void* gemm_ws, std::size_t gemm_bytes) {
  const cudaStream_t st = ctx.stream;
  const auto es = expert_shape(s);
  check(kernels::permute_rows(st, permute_shape(s, n), s.hidden, r.slot_to_row, xn2_rows, r.x_perm), "permute rows");
  check(kernels::expert_gate_up_forward(ctx.blas, st, es, counts.data(), r.x_perm, params.expert_gate_proj.data(), r.gate_up,
                                        expert_method, gemm_ws, gemm_bytes, ctx.expert_streams),
        "expert gate_up forward GEMMs");
  check(kernels::swiglu_forward(r.gate_up, r.act, n * s.top_k, s.intermediate, st), "swiglu forward");
  check(kernels::expert_down_forward(ctx.blas, st, es, counts.data(), r.act, params.expert_down_proj.data(), r.y_perm,
                                     expert_method, gemm_ws, gemm_bytes, ctx.expert_streams),
        "expert down forward GEMMs");
}

}  // namespace

// ---- shape ----------------------------------------------------------------------------------------

void DecoderLayerShape::validate() const {
  const auto need = [](bool ok, const std::string& what) {
    if (!ok) invalid("shape: " + what);
  };
  need(tokens >= 1 && tokens <= 0x7fffffff, fmt::format("tokens = {} must be in [1, 2^31)", tokens));
  need(sequences >= 1 && tokens % sequences == 0,
       fmt::format("tokens = {} must be a whole number of sequences = {} (each sequence's tokens one after another)", tokens,
                   sequences));
  need(sequences <= 65535, fmt::format("sequences = {}: the attention kernels take at most 65535 (their grid's batch dimension)", sequences));
  need(hidden >= 1, fmt::format("hidden = {} must be positive", hidden));
  need(heads_q >= 1 && heads_kv >= 1 && heads_q % heads_kv == 0,
       fmt::format("heads_q = {} must be a positive multiple of heads_kv = {}", heads_q, heads_kv));
  need(head_dim == 128 || head_dim == 256,
       fmt::format("head_dim = {}: the attention kernel takes 128 or 256 (include/oom/kernels/attention.hpp)", head_dim));
  need(hidden % 8 == 0, fmt::format("hidden = {} must be a multiple of 8 (16-byte rows)", hidden));
  need(experts >= 1 && experts <= kernels::router_max_experts,
       fmt::format("experts = {} must be in [1, {}]", experts, kernels::router_max_experts));
  need(top_k >= 1 && top_k <= experts && top_k <= kernels::router_max_top_k,
       fmt::format("top_k = {} must be in [1, min(experts, {})]", top_k, kernels::router_max_top_k));
  need(intermediate >= 1, fmt::format("intermediate = {} must be positive", intermediate));
  need(tokens * top_k <= 0x7fffffff, "tokens * top_k must fit in int32");
  need(moe_chunk_tokens >= 0,
       fmt::format("moe_chunk_tokens = {} must be >= 0 (0: the MoE half runs over all tokens at once)", moe_chunk_tokens));
  need(rms_norm_eps > 0 && rope_theta > 0, "rms_norm_eps and rope_theta must be positive");
  need(kernels::attention_can_implement(attention_problem(*this)), "the attention kernel rejects this problem");
}

DecoderLayerShape DecoderLayerShape::from_spec(const ModelSpec& spec, int layer, std::int64_t tokens, std::int64_t sequences) {
  const LayerSpec& L = spec.layer(layer);
  const auto& a = spec.attention();
  const std::string where = fmt::format("layer {} of a {} model", layer, to_string(spec.family()));
  if (spec.family() != ModelFamily::qwen3_moe) invalid(where + ": only Qwen3-MoE (model_type qwen3_moe) layers are implemented");
  if (L.attention != AttentionKind::full) invalid(where + " is not a full-attention layer");
  if (!L.moe) invalid(where + " is a dense-MLP layer; only MoE layers are implemented");
  if (!a.qk_norm || a.qk_norm_full_width || a.output_gate || a.bias)
    invalid(where + ": needs per-head q/k norm, no output gate and no attention bias (Qwen3-MoE's attention)");
  if (spec.partial_rotary_factor() != 1.0) invalid(where + ": partial RoPE is not implemented");
  if (spec.moe().shared_expert_intermediate != 0) invalid(where + ": a shared expert is not implemented");
  DecoderLayerShape s;
  s.tokens = tokens;
  s.sequences = sequences;
  s.hidden = static_cast<std::int64_t>(spec.hidden_size());
  s.heads_q = static_cast<std::int64_t>(a.heads);
  s.heads_kv = static_cast<std::int64_t>(a.kv_heads);
  s.head_dim = static_cast<std::int64_t>(a.head_dim);
  s.experts = static_cast<std::int64_t>(spec.moe().experts);
  s.top_k = static_cast<std::int64_t>(spec.moe().top_k);
  s.intermediate = static_cast<std::int64_t>(spec.moe().expert_intermediate);
  s.norm_topk_prob = spec.moe().norm_topk_prob;
  s.rms_norm_eps = static_cast<float>(spec.rms_norm_eps());
  s.rope_theta = static_cast<float>(spec.rope_theta());
  s.validate();
  return s;
}

// ---- binding into segment blocks ------------------------------------------------------------------

namespace {

template <class P, class Out>
void bind(const ModelSpec& spec, int layer, std::span<P const> bases, Out& out, const char* what) {
  const auto segs = spec.layer_segments(layer);
  if (bases.size() != segs.size())
    invalid(fmt::format("bind {}: {} segment bases for the {} segments of layer {}", what, bases.size(), segs.size(), layer));
  const auto E = spec.moe().experts;
  out.expert_gate_proj.assign(E, nullptr);
  out.expert_up_proj.assign(E, nullptr);
  out.expert_down_proj.assign(E, nullptr);
  const auto ends_with = [](const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && std::string_view(s).substr(s.size() - suffix.size()) == suffix;
  };
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const StateSegment& seg = segs[i];
    if (!bases[i]) invalid(fmt::format("bind {}: segment {} has a null base", what, seg.name));
    std::uint64_t offset = 0;
    for (const TensorSpec& t : seg.tensors) {
      if (t.stacked_index >= 0) invalid(fmt::format("bind {}: stacked expert tensors ({}) are not supported", what, t.name));
      P p = bases[i] + offset;
      offset += t.elements();
      if (seg.role == SegmentRole::expert) {
        const auto e = static_cast<std::size_t>(seg.expert);
        if (ends_with(t.name, ".gate_proj.weight")) out.expert_gate_proj[e] = p;
        else if (ends_with(t.name, ".up_proj.weight")) out.expert_up_proj[e] = p;
        else if (ends_with(t.name, ".down_proj.weight")) out.expert_down_proj[e] = p;
        else invalid(fmt::format("bind {}: unexpected expert tensor {}", what, t.name));
        continue;
      }
      if (ends_with(t.name, ".input_layernorm.weight")) out.input_layernorm = p;
      else if (ends_with(t.name, ".post_attention_layernorm.weight")) out.post_attention_layernorm = p;
      else if (ends_with(t.name, ".self_attn.q_proj.weight")) out.q_proj = p;
      else if (ends_with(t.name, ".self_attn.k_proj.weight")) out.k_proj = p;
      else if (ends_with(t.name, ".self_attn.v_proj.weight")) out.v_proj = p;
      else if (ends_with(t.name, ".self_attn.o_proj.weight")) out.o_proj = p;
      else if (ends_with(t.name, ".self_attn.q_norm.weight")) out.q_norm = p;
      else if (ends_with(t.name, ".self_attn.k_norm.weight")) out.k_norm = p;
      else if (ends_with(t.name, ".mlp.gate.weight")) out.router = p;
      else invalid(fmt::format("bind {}: tensor {} is not part of a Qwen3-MoE decoder layer", what, t.name));
    }
  }
}

}  // namespace

DecoderLayerParams bind_decoder_layer_params(const ModelSpec& spec, int layer, std::span<const bf16* const> segment_bases) {
  DecoderLayerParams p;
  bind(spec, layer, segment_bases, p, "params");
  return p;
}

DecoderLayerGrads bind_decoder_layer_grads(const ModelSpec& spec, int layer, std::span<float* const> segment_bases) {
  DecoderLayerGrads g;
  bind(spec, layer, segment_bases, g, "grads");
  return g;
}

// ---- sizes ----------------------------------------------------------------------------------------

std::size_t decoder_layer_saved_bytes(const DecoderLayerShape& s) {
  std::size_t total = 0;
  (void)carve_saved(s, nullptr, &total);
  return total;
}

std::size_t decoder_layer_workspace_bytes(const DecoderLayerShape& s, const kernels::ExpertGemmStreams& streams) {
  std::size_t f = 0, b = 0;
  (void)carve_forward(s, streams, nullptr, &f);
  (void)carve_backward(s, streams, nullptr, &b);
  return std::max(f, b);
}

DecoderLayerRouting decoder_layer_routing(const DecoderLayerShape& s, const void* saved) {
  const Saved v = carve_saved(s, const_cast<void*>(saved));
  return {v.expert_ids, v.weights};
}

// ---- forward --------------------------------------------------------------------------------------

namespace {

/// The forward; for a recompute (`recompute`), with `reuse_attention` the attention kernel is not
/// run and the O and LSE already in `saved` feed the rest, and a chunked MoE half stops after the
/// router (its expert rows are not in `saved`: the backward regenerates them chunk by chunk).
void forward_impl(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                  const std::int32_t* positions, const bf16* x, bf16* y, void* saved, std::size_t saved_bytes,
                  void* workspace, std::size_t workspace_bytes, bool recompute, bool reuse_attention) {
  // The kept counts are this forward's from here on, none until it has read them (so a forward
  // that fails leaves none to be taken for another's); a chunked recompute reads none and leaves
  // the forward's, which its bit-identical routing reproduces.
  if (ctx.expert_counts != nullptr && !(recompute && chunked(s))) ctx.expert_counts->clear();
  s.validate();
  check_context(ctx);
  check_params(s, params);
  if (!positions || !x || !y) invalid("forward: positions, x and y must be device pointers");
  if (x == y) invalid("forward: y must not alias x (the backward reads x)");
  check_buffers(saved, saved_bytes, decoder_layer_saved_bytes(s), workspace, workspace_bytes,
                decoder_layer_workspace_bytes(s, *ctx.expert_streams));

  const cudaStream_t st = ctx.stream;
  const auto T = s.tokens, S = s.tokens / s.sequences, H = s.hidden, D = s.head_dim, QW = q_width(s), KW = kv_width(s);
  const float eps = s.rms_norm_eps;
  const Saved v = carve_saved(s, saved);
  const ForwardScratch w = carve_forward(s, *ctx.expert_streams, workspace);
  check(cublasSetStream(ctx.blas, st), "cublasSetStream");

  // ---- attention block
  check(kernels::rmsnorm_forward(x, params.input_layernorm, v.xn1, v.rstd1, T, H, eps, st), "input_layernorm forward");
  gemm(ctx.blas, false, true, T, QW, H, v.xn1, H, params.q_proj, H, v.q_raw, CUDA_R_16BF, QW, 0.0f, "q_proj forward GEMM");
  gemm(ctx.blas, false, true, T, KW, H, v.xn1, H, params.k_proj, H, v.k_raw, CUDA_R_16BF, KW, 0.0f, "k_proj forward GEMM");
  gemm(ctx.blas, false, true, T, KW, H, v.xn1, H, params.v_proj, H, v.v, CUDA_R_16BF, KW, 0.0f, "v_proj forward GEMM");
  check(kernels::rmsnorm_forward(v.q_raw, params.q_norm, v.q, v.q_rstd, T * s.heads_q, D, eps, st), "q_norm forward");
  check(kernels::rmsnorm_forward(v.k_raw, params.k_norm, v.k, v.k_rstd, T * s.heads_kv, D, eps, st), "k_norm forward");
  check(kernels::rope_forward(v.q, positions, v.q, T, s.heads_q, D, D, s.rope_theta, st), "rope forward (q)");
  check(kernels::rope_forward(v.k, positions, v.k, T, s.heads_kv, D, D, s.rope_theta, st), "rope forward (k)");
  const kernels::AttentionProblem ap = attention_problem(s);
  if (!reuse_attention)
    check(kernels::attention_forward(ap, {v.q, S * QW, QW}, {v.k, S * KW, KW}, {v.v, S * KW, KW}, {v.attn, S * QW, QW}, v.lse, st),
          "attention forward");
  // h = x + O Wo^T: x copied into h, then the GEMM adds onto it (beta = 1, one rounding).
  check(cudaMemcpyAsync(v.h, x, static_cast<std::size_t>(T * H) * sizeof(bf16), cudaMemcpyDeviceToDevice, st),
        "residual copy x -> h");
  gemm(ctx.blas, false, true, T, H, QW, v.attn, QW, params.o_proj, QW, v.h, CUDA_R_16BF, H, 1.0f, "o_proj forward GEMM");

  // ---- MoE block: the post-attention norm and the router over all T (their state is O(T*(H + E))),
  // then the experts chunk by chunk, rows [c0, c0 + n) of xn2 to the same rows of y. Whole: one
  // chunk whose permutation and activations stay in `saved`.
  check(kernels::rmsnorm_forward(v.h, params.post_attention_layernorm, v.xn2, v.rstd2, T, H, eps, st),
        "post_attention_layernorm forward");
  check(kernels::router_forward(ctx.blas, st, router_shape(s), v.xn2, params.router, w.logits, v.probs, v.expert_ids, v.weights),
        "router forward");
  if (recompute && chunked(s)) return;  // y is not needed, and nothing after the router is saved
  const ExpertRows& r = chunked(s) ? w.rows : v.rows;
  for (std::int64_t c0 = 0, C = moe_chunk(s); c0 < T; c0 += C) {
    const std::int64_t n = std::min(C, T - c0);
    plan_rows(s, st, v.expert_ids, c0, n, r, w.plan_ws, w.plan_bytes);
    const auto counts = download_counts(s, r.counts, n * s.top_k, st, *ctx.expert_streams);
    if (ctx.expert_counts != nullptr) ctx.expert_counts->insert(ctx.expert_counts->end(), counts.begin(), counts.end());
    experts_forward(ctx, s, params, counts, v.xn2 + c0 * H, n, r, w.gemm_ws, w.gemm_bytes);
    check(kernels::unpermute_combine(st, permute_shape(s, n), H, r.slot_to_row, r.y_perm, v.weights + c0 * s.top_k, w.moe_out),
          "unpermute combine");
    check(kernels::add_bf16(v.h + c0 * H, w.moe_out, y + c0 * H, n * H, st), "residual add y = h + moe");
  }
}

}  // namespace

void decoder_layer_forward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                           const std::int32_t* positions, const bf16* x, bf16* y, void* saved, std::size_t saved_bytes,
                           void* workspace, std::size_t workspace_bytes) {
  forward_impl(ctx, s, params, positions, x, y, saved, saved_bytes, workspace, workspace_bytes, /*recompute=*/false,
               /*reuse_attention=*/false);
}

void decoder_layer_recompute(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                             const std::int32_t* positions, const bf16* x, bf16* y, void* saved, std::size_t saved_bytes,
                             void* workspace, std::size_t workspace_bytes, bool attention_state_kept) {
  forward_impl(ctx, s, params, positions, x, y, saved, saved_bytes, workspace, workspace_bytes, /*recompute=*/true,
               attention_state_kept);
}

DecoderLayerAttentionState decoder_layer_attention_state(const DecoderLayerShape& s, void* saved) {
  const Saved v = carve_saved(s, saved);
  const auto T = s.tokens;
  return {v.attn, static_cast<std::size_t>(T * q_width(s)) * sizeof(bf16), v.lse,
          static_cast<std::size_t>(s.heads_q * T) * sizeof(float)};
}

// ---- backward -------------------------------------------------------------------------------------

void decoder_layer_backward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                            const std::int32_t* positions, const bf16* x, const bf16* dy, const void* saved,
                            std::size_t saved_bytes, bf16* dx, const DecoderLayerGrads& grads, void* workspace,
                            std::size_t workspace_bytes) {
  s.validate();
  check_context(ctx);
  check_params(s, params);
  check_grads(s, grads);
  if (!positions || !x || !dy || !dx) invalid("backward: positions, x, dy and dx must be device pointers");
  if (dx == x || dx == dy) invalid("backward: dx must not alias x or dy");
  check_buffers(saved, saved_bytes, decoder_layer_saved_bytes(s), workspace, workspace_bytes,
                decoder_layer_workspace_bytes(s, *ctx.expert_streams));

  const cudaStream_t st = ctx.stream;
  const auto T = s.tokens, S = s.tokens / s.sequences, H = s.hidden, D = s.head_dim, QW = q_width(s), KW = kv_width(s), I = s.intermediate;
  const Saved v = carve_saved(s, const_cast<void*>(saved));  // read only
  const BackwardScratch b = carve_backward(s, *ctx.expert_streams, workspace);
  check(cublasSetStream(ctx.blas, st), "cublasSetStream");
  const auto es = expert_shape(s);

  // ---- MoE block: y = h + combine(experts(permute(xn2))), chunk by chunk in token order (a fixed
  // order: the expert weight gradients accumulate the chunks' GEMMs the same way every run). A
  // chunked layer first recomputes the chunk's permutation and expert activations from the saved
  // xn2 and routing, with the forward's launches (so the forward's bits).
  const ExpertRows& r = chunked(s) ? b.rows : v.rows;
  // Which experts a chunk so far reached (with grads.unrouted_experts only): the first chunk
  // writes those it reaches and leaves the others alone; a later chunk zeroes the gradients of
  // the experts it is the first to reach, then adds like the rest.
  const bool leave_unrouted = grads.overwrite_experts && grads.unrouted_experts != nullptr;
  std::vector<std::uint8_t> reached(leave_unrouted ? static_cast<std::size_t>(s.experts) : 0, 0);
  // The forward's counts, when the caller kept them (DecoderLayerContext::expert_counts): no
  // read-back, so no wait for the GPU, per chunk.
  const std::int64_t C = moe_chunk(s);
  const bool kept = counts_kept(ctx, s);
  for (std::int64_t c0 = 0, index = 0; c0 < T; c0 += C, ++index) {
    const std::int64_t n = std::min(C, T - c0);
    const auto ps = permute_shape(s, n);
    if (chunked(s)) plan_rows(s, st, v.expert_ids, c0, n, r, b.plan_ws, b.plan_bytes);
    const std::vector<std::int32_t> counts =
        kept ? std::vector<std::int32_t>(ctx.expert_counts->begin() + index * s.experts,
                                         ctx.expert_counts->begin() + (index + 1) * s.experts)
             : download_counts(s, r.counts, n * s.top_k, st, *ctx.expert_streams);
    if (chunked(s)) experts_forward(ctx, s, params, counts, v.xn2 + c0 * H, n, r, b.gemm_ws, b.gemm_bytes);
    check(kernels::unpermute_combine_backward(st, ps, H, r.slot_to_row, dy + c0 * H, r.y_perm, v.weights + c0 * s.top_k,
                                              b.dy_perm, b.d_weights + c0 * s.top_k),
          "unpermute combine backward");
    // The first chunk sets the experts' gradients where the caller asked (every expert's: zeros
    // where the chunk routes no token to it, unless left alone), the later ones add.
    auto dw_write = kernels::GradWrite::accumulate;
    if (grads.overwrite_experts && c0 == 0) dw_write = leave_unrouted ? kernels::GradWrite::overwrite_routed : kernels::GradWrite::overwrite;
    if (leave_unrouted) {
      for (std::int64_t e = 0; e < s.experts; ++e) {
        const auto i = static_cast<std::size_t>(e);
        if (counts[i] == 0 || reached[i] != 0) continue;
        reached[i] = 1;
        if (c0 == 0) continue;
        check(cudaMemsetAsync(grads.expert_gate_proj[i], 0, static_cast<std::size_t>(2 * I * H) * sizeof(float), st),
              "zero a newly reached expert's gate_up gradient");
        check(cudaMemsetAsync(grads.expert_down_proj[i], 0, static_cast<std::size_t>(H * I) * sizeof(float), st),
              "zero a newly reached expert's down gradient");
      }
    }
    check(kernels::expert_down_backward(ctx.blas, st, es, counts.data(), b.dy_perm, r.act, params.expert_down_proj.data(),
                                        b.d_act, grads.expert_down_proj.data(), expert_method, b.gemm_ws, b.gemm_bytes,
                                        ctx.expert_streams, dw_write),
          "expert down backward GEMMs");
    check(kernels::swiglu_backward(b.d_act, r.gate_up, b.d_gate_up, n * s.top_k, I, st), "swiglu backward");
    check(kernels::expert_gate_up_backward(ctx.blas, st, es, counts.data(), b.d_gate_up, r.x_perm,
                                           params.expert_gate_proj.data(), b.dx_perm, grads.expert_gate_proj.data(),
                                           expert_method, b.gemm_ws, b.gemm_bytes, ctx.expert_streams, dw_write),
          "expert gate_up backward GEMMs");
    check(kernels::permute_rows_backward(st, ps, H, r.slot_to_row, b.dx_perm, b.dxn2 + c0 * H), "permute rows backward");
  }
  if (leave_unrouted) {
    grads.unrouted_experts->resize(reached.size());
    for (std::size_t e = 0; e < reached.size(); ++e) (*grads.unrouted_experts)[e] = reached[e] == 0 ? 1 : 0;
  }
  // The router over all T. Its expert counts only scale the aux-loss gradient, which is 0 here:
  // a chunked layer passes its last chunk's.
  check(kernels::router_backward(ctx.blas, st, router_shape(s), v.xn2, params.router, v.probs, v.expert_ids, b.d_weights, r.counts,
                                 0.0f, b.d_logits, b.dxn2, /*accumulate_dx=*/true, grads.router, b.router_ws, b.router_bytes),
        "router backward");
  check(kernels::rmsnorm_backward(b.dxn2, v.h, params.post_attention_layernorm, v.rstd2, b.dxn2, grads.post_attention_layernorm,
                                  T, H, b.norm_ws, b.norm_bytes, st),
        "post_attention_layernorm backward");
  bf16* const dh = b.dxn2;
  check(kernels::add_bf16(dy, b.dxn2, dh, T * H, st), "residual add dh = dy + d moe");

  // ---- attention block: h = x + O Wo^T
  gemm(ctx.blas, false, false, T, QW, H, dh, H, params.o_proj, QW, b.d_attn, CUDA_R_16BF, QW, 0.0f, "o_proj dx GEMM");
  gemm(ctx.blas, true, false, H, QW, T, dh, H, v.attn, QW, grads.o_proj, CUDA_R_32F, QW, 1.0f, "o_proj dW GEMM");
  const kernels::AttentionProblem ap = attention_problem(s);
  check(kernels::attention_backward(ap, {v.q, S * QW, QW}, {v.k, S * KW, KW}, {v.v, S * KW, KW}, {v.attn, S * QW, QW},
                                    {b.d_attn, S * QW, QW}, v.lse, {b.dq, S * QW, QW}, {b.dk, S * KW, KW}, {b.dv, S * KW, KW},
                                    /*accumulate_dkv=*/false, b.attn_ws, b.attn_bytes, st),
        "attention backward");
  check(kernels::rope_backward(b.dq, positions, b.dq, T, s.heads_q, D, D, s.rope_theta, st), "rope backward (q)");
  check(kernels::rope_backward(b.dk, positions, b.dk, T, s.heads_kv, D, D, s.rope_theta, st), "rope backward (k)");
  check(kernels::rmsnorm_backward(b.dq, v.q_raw, params.q_norm, v.q_rstd, b.dq, grads.q_norm, T * s.heads_q, D, b.norm_ws,
                                  b.norm_bytes, st),
        "q_norm backward");
  check(kernels::rmsnorm_backward(b.dk, v.k_raw, params.k_norm, v.k_rstd, b.dk, grads.k_norm, T * s.heads_kv, D, b.norm_ws,
                                  b.norm_bytes, st),
        "k_norm backward");
  // d xn1 = dq Wq + dk Wk + dv Wv, summed in fp32 and rounded once.
  gemm(ctx.blas, false, false, T, H, QW, b.dq, QW, params.q_proj, H, b.dxn1_f32, CUDA_R_32F, H, 0.0f, "q_proj dx GEMM");
  gemm(ctx.blas, false, false, T, H, KW, b.dk, KW, params.k_proj, H, b.dxn1_f32, CUDA_R_32F, H, 1.0f, "k_proj dx GEMM");
  gemm(ctx.blas, false, false, T, H, KW, b.dv, KW, params.v_proj, H, b.dxn1_f32, CUDA_R_32F, H, 1.0f, "v_proj dx GEMM");
  gemm(ctx.blas, true, false, QW, H, T, b.dq, QW, v.xn1, H, grads.q_proj, CUDA_R_32F, H, 1.0f, "q_proj dW GEMM");
  gemm(ctx.blas, true, false, KW, H, T, b.dk, KW, v.xn1, H, grads.k_proj, CUDA_R_32F, H, 1.0f, "k_proj dW GEMM");
  gemm(ctx.blas, true, false, KW, H, T, b.dv, KW, v.xn1, H, grads.v_proj, CUDA_R_32F, H, 1.0f, "v_proj dW GEMM");
  check(kernels::cast_fp32_to_bf16(b.dxn1_f32, b.dxn1, T * H, st), "cast d xn1 to bf16");
  check(kernels::rmsnorm_backward(b.dxn1, x, params.input_layernorm, v.rstd1, b.dxn1, grads.input_layernorm, T, H, b.norm_ws,
                                  b.norm_bytes, st),
        "input_layernorm backward");
  check(kernels::add_bf16(dh, b.dxn1, dx, T * H, st), "residual add dx = dh + d attention");
}

}  // namespace oom::model
