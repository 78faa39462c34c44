// A Qwen3-MoE, Qwen3-Next or Qwen3.5-MoE decoder layer on the GPU; contract in
// include/oom/model/cuda_decoder_layer.hpp.
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
#include <type_traits>
#include <utility>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/attention.hpp"
#include "oom/kernels/cast.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/kernels/output_gate.hpp"
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
/// q_proj's rows: Hq D, or 2 Hq D with the output gate ([q | gate] per head).
std::int64_t q_proj_rows(const DecoderLayerShape& s) { return (s.output_gate ? 2 : 1) * q_width(s); }
std::int64_t rotary(const DecoderLayerShape& s) { return s.rotary_dim > 0 ? s.rotary_dim : s.head_dim; }
bool has_shared(const DecoderLayerShape& s) { return s.shared_intermediate > 0; }
std::int64_t kv_width(const DecoderLayerShape& s) { return s.heads_kv * s.head_dim; }
/// Tokens per MoE chunk: moe_chunk_tokens, or T when the MoE half runs whole (0 or >= T).
std::int64_t moe_chunk(const DecoderLayerShape& s) {
  return s.moe_chunk_tokens > 0 && s.moe_chunk_tokens < s.tokens ? s.moe_chunk_tokens : s.tokens;
}
bool chunked(const DecoderLayerShape& s) { return moe_chunk(s) < s.tokens; }
/// N: rows of one chunk's expert GEMMs (the largest chunk's).
std::int64_t chunk_slots(const DecoderLayerShape& s) { return moe_chunk(s) * s.top_k; }
/// A softmax-attention layer's query chunk (DecoderLayerShape::attention_chunk_tokens), at most a
/// sequence; attention_chunked: shorter than one.
std::int64_t attention_chunk(const DecoderLayerShape& s) {
  const std::int64_t S = s.tokens / s.sequences, c = s.attention_chunk_tokens;
  return c > 0 && c < S ? c : S;
}
bool attention_chunked(const DecoderLayerShape& s) { return !s.linear && attention_chunk(s) < s.tokens / s.sequences; }

/// The q or k RMSNorm over `tokens` tokens of `heads` heads: rows of head_dim per head, or one row
/// of heads * head_dim per token over the whole projection (QkNorm::full_width); none: 0 rows.
struct NormRows {
  std::int64_t rows = 0, width = 0;
};
NormRows qk_norm_rows(const DecoderLayerShape& s, std::int64_t tokens, std::int64_t heads) {
  switch (s.qk_norm) {
    case QkNorm::per_head: return {tokens * heads, s.head_dim};
    case QkNorm::full_width: return {tokens, heads * s.head_dim};
    case QkNorm::none: break;
  }
  return {};
}
/// The norm's saved rstd values per token (the offset of a token's first).
std::int64_t rstd_per_token(const DecoderLayerShape& s, std::int64_t heads) { return qk_norm_rows(s, 1, heads).rows; }

/// q or k before RoPE from its projection `raw` (tokens, heads, D): normed as s.qk_norm says, or
/// copied where the model has no q/k norm.
void qk_norm_forward(const DecoderLayerShape& s, const bf16* raw, const bf16* weight, bf16* out, float* rstd, std::int64_t tokens,
                     std::int64_t heads, cudaStream_t st, std::string_view step) {
  const NormRows r = qk_norm_rows(s, tokens, heads);
  if (r.rows == 0) {
    check(cudaMemcpyAsync(out, raw, static_cast<std::size_t>(tokens * heads * s.head_dim) * sizeof(bf16), cudaMemcpyDeviceToDevice, st),
          step);
    return;
  }
  check(kernels::rmsnorm_forward(raw, weight, out, rstd, r.rows, r.width, s.rms_norm_eps, st, s.norm_offset), step);
}

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
  // The shared expert's, over the chunk's n tokens in token order (null without one).
  bf16* s_gate_up;            // (n, 2Is)
  bf16* s_act;                // (n, Is)
  bf16* s_y;                  // (n, H)          its MLP's output before the sigmoid gate
  float* s_logit;             // (n)             the gate's logit xn2 . shared_expert_gate
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
  if (has_shared(s)) {
    const auto n = moe_chunk(s), Is = s.shared_intermediate;
    r.s_gate_up = c.take<bf16>(n * 2 * Is);
    r.s_act = c.take<bf16>(n * Is);
    r.s_y = c.take<bf16>(n * H);
    r.s_logit = c.take<float>(n);
  }
  return r;
}

/// What the forward keeps for the backward, in this order in `saved`. A linear layer keeps its
/// block's `deltanet` buffer in place of the softmax attention's q_raw ... lse (null there).
struct Saved {
  float* rstd1;            // (T)
  bf16* xn1;               // (T, H)          rms1(x) * w
  void* deltanet;          // linear: deltanet_saved_bytes
  bf16* q_raw;             // (T, Hq, D)      xn1 Wq^T (input of q_norm); gated: q_proj's q halves
  bf16* gate;              // (T, Hq, D)      gated only: q_proj's gate halves, packed
  bf16* k_raw;             // (T, Hkv, D)
  float* q_rstd;           // (T * Hq) per head, (T) over the projection, none without a q/k norm
  float* k_rstd;           // (T * Hkv), (T), none
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
  if (s.linear) {
    v.deltanet = c.take_bytes(deltanet_saved_bytes(s.deltanet));
  } else {
    v.q_raw = c.take<bf16>(T * q_width(s));
    if (s.output_gate) v.gate = c.take<bf16>(T * q_width(s));
    v.k_raw = c.take<bf16>(T * kv_width(s));
    v.q_rstd = c.take<float>(qk_norm_rows(s, T, s.heads_q).rows);
    v.k_rstd = c.take<float>(qk_norm_rows(s, T, s.heads_kv).rows);
    v.q = c.take<bf16>(T * q_width(s));
    v.k = c.take<bf16>(T * kv_width(s));
    v.v = c.take<bf16>(T * kv_width(s));
    v.attn = c.take<bf16>(T * q_width(s));
    v.lse = c.take<float>(s.heads_q * T);
  }
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

/// One sequence's query rows [q0, q0 + n): the attention problem of a query chunk (batch 1; the
/// caller points the tensors at the sequence).
kernels::AttentionProblem chunk_problem(const DecoderLayerShape& s, std::int64_t q0, std::int64_t n) {
  kernels::AttentionProblem p = attention_problem(s);
  p.batch = 1;
  p.q_begin = static_cast<int>(q0);
  p.q_end = static_cast<int>(q0 + n);
  return p;
}

/// `rows` shifted back `by` rows of `width` elements: the view a query-chunk kernel call indexes
/// with the sequence's row numbers, for a chunk buffer that holds rows [by, by + n) from its start.
/// Only the chunk's rows are read or written through it (address arithmetic, never dereferenced
/// outside the buffer).
template <class T>
T* rows_from(T* rows, std::int64_t by, std::int64_t width) {
  return reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(rows) - static_cast<std::uintptr_t>(by * width) * sizeof(T));
}

/// Forward scratch.
struct ForwardScratch {
  bf16* qg;         // gated: (T, 2 Hq D) q_proj's output, split into saved q_raw and gate
  bf16* go;         // gated: (T, Hq D) ctx * sigmoid(gate), o_proj's input
  void* deltanet_ws;  // linear: the block's
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
  if (s.linear) {
    f.deltanet_ws = c.take_bytes(deltanet_workspace_bytes(s.deltanet));
  } else if (s.output_gate) {  // a chunk's rows (attention_chunk_tokens), or all T
    const std::int64_t rows = attention_chunked(s) ? attention_chunk(s) : s.tokens;
    f.qg = c.take<bf16>(rows * q_proj_rows(s));
    f.go = c.take<bf16>(rows * q_width(s));
  }
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
  bf16* s_dy;          // (C, H)   the shared expert's MLP output gradient (and a chunked recompute's throwaway)
  bf16* s_d_act;       // (C, Is)
  bf16* s_d_gate_up;   // (C, 2Is)
  void* shared_ws;     // shared_expert_gate_backward's
  std::size_t shared_bytes;
  // Attention phase (a linear layer: only deltanet_ws, dxn1_f32, dxn1). R rows: T, or in query
  // chunks one chunk's (attention_chunk_tokens).
  void* deltanet_ws;
  bf16* go;            // gated: (R, Hq D) ctx * sigmoid(gate) again, o_proj's input
  bf16* d_gate;        // gated: (R, Hq D) packed
  bf16* d_qg;          // gated: (R, 2 Hq D) [dq | d_gate] per head, q_proj's output gradient
  bf16* d_attn;        // (R, Hq, D)
  bf16* dq;            // (R, Hq, D)
  bf16* dk;            // (T, Hkv, D)
  bf16* dv;            // (T, Hkv, D)
  float* dk_sum;       // in query chunks: (T, Hkv, D) fp32, dK summed over the chunks
  float* dv_sum;       // in query chunks: (T, Hkv, D) fp32
  void* attn_ws;
  std::size_t attn_bytes;
  float* dxn1_f32;     // (T, H)   the three projections' dx summed in fp32
  bf16* dxn1;          // (T, H)   then, in place, the attention branch's d x
  bf16* ones;          // qkv_bias: (T) ones, the row the biases' gradients are summed with
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
  b.norm_bytes = kernels::rmsnorm_backward_workspace_bytes(T, H);
  if (!s.linear && s.qk_norm != QkNorm::none) {  // the q and k norms
    const NormRows q = qk_norm_rows(s, T, s.heads_q), k = qk_norm_rows(s, T, s.heads_kv);
    b.norm_bytes = std::max({b.norm_bytes, kernels::rmsnorm_backward_workspace_bytes(q.rows, q.width),
                             kernels::rmsnorm_backward_workspace_bytes(k.rows, k.width)});
  }
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
  if (has_shared(s)) {
    const auto C = moe_chunk(s), Is = s.shared_intermediate;
    b.s_dy = c.take<bf16>(C * H);
    b.s_d_act = c.take<bf16>(C * Is);
    b.s_d_gate_up = c.take<bf16>(C * 2 * Is);
    b.shared_bytes = kernels::shared_expert_gate_backward_workspace_bytes(C, H);
    b.shared_ws = c.take_bytes(b.shared_bytes);
  }

  c.rewind(phases);
  if (s.linear) {
    b.deltanet_ws = c.take_bytes(deltanet_workspace_bytes(s.deltanet));
  } else {
    const std::int64_t R = attention_chunked(s) ? attention_chunk(s) : T;
    if (s.output_gate) {
      b.go = c.take<bf16>(R * q_width(s));
      b.d_gate = c.take<bf16>(R * q_width(s));
      b.d_qg = c.take<bf16>(R * q_proj_rows(s));
    }
    b.d_attn = c.take<bf16>(R * q_width(s));
    b.dq = c.take<bf16>(R * q_width(s));
    b.dk = c.take<bf16>(T * kv_width(s));
    b.dv = c.take<bf16>(T * kv_width(s));
    if (attention_chunked(s)) {
      b.dk_sum = c.take<float>(T * kv_width(s));
      b.dv_sum = c.take<float>(T * kv_width(s));
    }
    b.attn_bytes = kernels::attention_backward_workspace_bytes(chunk_problem(s, 0, R));
    b.attn_ws = c.take_bytes(b.attn_bytes);
  }
  b.dxn1_f32 = c.take<float>(T * H);
  b.dxn1 = c.take<bf16>(T * H);
  if (s.qkv_bias) b.ones = c.take<bf16>(T);
  if (total) *total = c.size();
  return b;
}

/// With qkv_bias: `bias` repeated into each of the `rows` rows of `out` (width wide), for the
/// projection's GEMM to add onto (the beta returned: 1); without, nothing (beta 0).
float bias_under(const DecoderLayerShape& s, const bf16* bias, bf16* out, std::int64_t rows, std::int64_t width, cudaStream_t st,
                 std::string_view step) {
  if (!s.qkv_bias) return 0.0f;
  check(kernels::repeat_row_bf16(bias, width, out, rows, st), step);
  return 1.0f;
}

/// With qkv_bias: grad_bias (width) += the column sums of d (rows, width), fp32, as a GEMM of a
/// row of ones (b.ones, filled as the attention phase begins) with d: deterministic as the
/// weights' gradients are.
void bias_backward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const BackwardScratch& b, const bf16* d,
                   std::int64_t rows, std::int64_t width, float* grad_bias, std::string_view step) {
  if (!s.qkv_bias) return;
  gemm(ctx.blas, false, false, 1, width, rows, b.ones, rows, d, width, grad_bias, CUDA_R_32F, width, 1.0f, step);
}

/// d raw from d (normed q or k), in place in `d` (tokens, heads, D), the norm's weight gradient
/// accumulated into `grad_weight`; nothing where the model has no q/k norm (d is then d raw).
void qk_norm_backward(const DecoderLayerShape& s, bf16* d, const bf16* raw, const bf16* weight, const float* rstd, float* grad_weight,
                      std::int64_t tokens, std::int64_t heads, const BackwardScratch& b, cudaStream_t st, std::string_view step) {
  const NormRows r = qk_norm_rows(s, tokens, heads);
  if (r.rows == 0) return;
  check(kernels::rmsnorm_backward(d, raw, weight, rstd, d, grad_weight, r.rows, r.width, b.norm_ws, b.norm_bytes, st, s.norm_offset),
        step);
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

/// Every tensor the layer's kind reads is there (params or grads alike: same member names).
template <class Tensors>
void check_tensors(const DecoderLayerShape& s, const Tensors& p, const char* what) {
  std::vector<std::pair<const void*, const char*>> named = {
      {p.input_layernorm, "input_layernorm"}, {p.post_attention_layernorm, "post_attention_layernorm"},
      {p.router, "router (mlp.gate)"}};
  if (s.linear) {
    const auto& d = p.deltanet;
    // (Qwen3.5's separate in_proj_qkv and in_proj_z, in_proj_b and in_proj_a bind as one each.)
    named.insert(named.end(), {{d.in_proj_qkvz, "linear_attn in_proj_qkvz (or in_proj_qkv, in_proj_z)"},
                               {d.in_proj_ba, "linear_attn in_proj_ba (or in_proj_b, in_proj_a)"},
                               {d.conv, "linear_attn conv1d"}, {d.dt_bias, "linear_attn dt_bias"},
                               {d.a_log, "linear_attn A_log"}, {d.norm, "linear_attn norm"},
                               {d.out_proj, "linear_attn out_proj"}});
  } else {
    named.insert(named.end(), {{p.q_proj, "q_proj"}, {p.k_proj, "k_proj"}, {p.v_proj, "v_proj"}, {p.o_proj, "o_proj"}});
    if (s.qk_norm != QkNorm::none) named.insert(named.end(), {{p.q_norm, "q_norm"}, {p.k_norm, "k_norm"}});
    if (s.qkv_bias) named.insert(named.end(), {{p.q_bias, "q_proj bias"}, {p.k_bias, "k_proj bias"}, {p.v_bias, "v_proj bias"}});
  }
  if (has_shared(s)) {
    named.insert(named.end(), {{p.shared_gate_proj, "shared_expert gate_proj"}, {p.shared_down_proj, "shared_expert down_proj"},
                               {p.shared_expert_gate, "shared_expert_gate"}});
  }
  for (const auto& [ptr, name] : named)
    if (!ptr) invalid(fmt::format("{}: {} is null", what, name));
  check_experts(s, p.expert_gate_proj, p.expert_up_proj, p.expert_down_proj, what);
}

void check_params(const DecoderLayerShape& s, const DecoderLayerParams& p) { check_tensors(s, p, "params"); }
void check_grads(const DecoderLayerShape& s, const DecoderLayerGrads& g) { check_tensors(s, g, "grads"); }

void check_buffers(const void* saved, std::size_t saved_bytes, std::size_t saved_needed, const void* workspace,
                   std::size_t workspace_bytes, std::size_t workspace_needed) {
  if (!saved || saved_bytes < saved_needed)
    invalid(fmt::format("saved buffer {} with {} bytes; needs {} (decoder_layer_saved_bytes)", saved ? "given" : "null",
                        saved_bytes, saved_needed));
  if (!workspace || workspace_bytes < workspace_needed)
    invalid(fmt::format("workspace {} with {} bytes; needs {} (decoder_layer_workspace_bytes)", workspace ? "given" : "null",
                        workspace_bytes, workspace_needed));
}

void check_context(const DecoderLayerContext& ctx, const DecoderLayerShape& s) {
  kernels::clear_refusal();  // see check()
  if (!ctx.blas) invalid("context has no cuBLAS handle");
  if (!ctx.expert_streams) invalid("context has no ExpertGemmStreams (the row_chunked expert GEMMs need one)");
  if (s.router_aux_loss_coef > 0 && ctx.balance == nullptr)
    invalid(fmt::format("the shape has the load-balancing loss (router_aux_loss_coef {}) and the context no CudaRouterBalance",
                        s.router_aux_loss_coef));
  if (ctx.balance != nullptr && ctx.balance->coefficient() != s.router_aux_loss_coef)
    invalid(fmt::format("the context's CudaRouterBalance has coefficient {}, the shape's router_aux_loss_coef is {}",
                        ctx.balance->coefficient(), s.router_aux_loss_coef));
  if (ctx.balance != nullptr &&
      (ctx.balance->tokens() != s.tokens || ctx.balance->experts() != s.experts || ctx.balance->top_k() != s.top_k))
    invalid(fmt::format("the context's CudaRouterBalance is for {} tokens a layer, {} experts, top {}; the shape has {}, {}, top {}",
                        ctx.balance->tokens(), ctx.balance->experts(), ctx.balance->top_k(), s.tokens, s.experts, s.top_k));
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
/// SwiGLU, down GEMMs; and the shared expert's MLP over the same rows to r.s_y (its gate comes
/// later: combine_shared). The forward and the backward's recomputation issue exactly these launches.
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
  if (has_shared(s)) {
    const auto H = s.hidden, Is = s.shared_intermediate;
    gemm(ctx.blas, false, true, n, 2 * Is, H, xn2_rows, H, params.shared_gate_proj, H, r.s_gate_up, CUDA_R_16BF, 2 * Is, 0.0f,
         "shared expert gate_up forward GEMM");
    check(kernels::swiglu_forward(r.s_gate_up, r.s_act, n, Is, st), "shared expert swiglu forward");
    gemm(ctx.blas, false, true, n, H, Is, r.s_act, Is, params.shared_down_proj, Is, r.s_y, CUDA_R_16BF, H, 0.0f,
         "shared expert down forward GEMM");
  }
}

/// out = routed + sigmoid(xn2 . shared_expert_gate) * s_y over a chunk's n rows, its logit into
/// r.s_logit; `routed` null: out = the gated shared output alone.
void combine_shared(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                    const bf16* xn2_rows, std::int64_t n, const ExpertRows& r, const bf16* routed, bf16* out) {
  check(kernels::shared_expert_gate_forward(ctx.stream, n, s.hidden, xn2_rows, params.shared_expert_gate, r.s_y, routed,
                                            r.s_logit, out),
        "shared expert gate forward");
}

/// q_proj's (tokens, Hq, 2D) output [q | gate] per head split into packed (tokens, Hq, D) q and gate, or
/// (`merge`) packed ones put back side by side: strided copies of D elements a row.
void split_heads(const DecoderLayerShape& s, std::int64_t tokens, cudaStream_t st, bf16* qg, bf16* q, bf16* gate, bool merge) {
  const auto D = static_cast<std::size_t>(s.head_dim), rows = static_cast<std::size_t>(tokens * s.heads_q);
  const std::size_t packed = D * sizeof(bf16), wide = 2 * packed;
  for (const auto& [half, offset] : {std::pair{q, std::size_t{0}}, std::pair{gate, D}}) {
    if (merge)
      check(cudaMemcpy2DAsync(qg + offset, wide, half, packed, packed, rows, cudaMemcpyDeviceToDevice, st),
            "merge of dq and d gate into q_proj's rows");
    else
      check(cudaMemcpy2DAsync(half, packed, qg + offset, wide, packed, rows, cudaMemcpyDeviceToDevice, st),
            "split of q_proj's rows into q and the gate");
  }
}

kernels::OutputGateDims gate_dims(const DecoderLayerShape& s, std::int64_t rows) {
  return {rows, s.heads_q, s.head_dim, q_width(s), s.head_dim};
}
kernels::OutputGateDims gate_dims(const DecoderLayerShape& s) { return gate_dims(s, s.tokens); }

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
  if (linear) {
    need(deltanet.tokens == tokens && deltanet.sequences == sequences && deltanet.hidden == hidden,
         fmt::format("deltanet has tokens {}, sequences {}, hidden {}; the layer {}, {}, {}", deltanet.tokens,
                     deltanet.sequences, deltanet.hidden, tokens, sequences, hidden));
    need(!qkv_bias, "qkv_bias on a Gated DeltaNet layer (it has no q/k/v projections of its own)");
  } else {
    need(!(qkv_bias && output_gate), "qkv_bias beside an output gate (no family has both; the host layer refuses it too)");
    need(heads_q >= 1 && heads_kv >= 1 && heads_q % heads_kv == 0,
         fmt::format("heads_q = {} must be a positive multiple of heads_kv = {}", heads_q, heads_kv));
    need(head_dim == 128 || head_dim == 256,
         fmt::format("head_dim = {}: the attention kernel takes 128 or 256 (include/oom/kernels/attention.hpp)", head_dim));
    need(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
         fmt::format("rotary_dim = {} must be even and in [0, head_dim = {}] (0: all of it)", rotary_dim, head_dim));
  }
  need(std::isfinite(norm_offset), "norm_offset must be finite");
  need(shared_intermediate >= 0, fmt::format("shared_intermediate = {} must be >= 0 (0: no shared expert)", shared_intermediate));
  need(hidden % 8 == 0, fmt::format("hidden = {} must be a multiple of 8 (16-byte rows)", hidden));
  need(experts >= 1 && experts <= kernels::router_max_experts,
       fmt::format("experts = {} must be in [1, {}]", experts, kernels::router_max_experts));
  need(top_k >= 1 && top_k <= experts && top_k <= kernels::router_max_top_k,
       fmt::format("top_k = {} must be in [1, min(experts, {})]", top_k, kernels::router_max_top_k));
  need(intermediate >= 1, fmt::format("intermediate = {} must be positive", intermediate));
  need(tokens * top_k <= 0x7fffffff, "tokens * top_k must fit in int32");
  need(moe_chunk_tokens >= 0,
       fmt::format("moe_chunk_tokens = {} must be >= 0 (0: the MoE half runs over all tokens at once)", moe_chunk_tokens));
  need(attention_chunk_tokens >= 0,
       fmt::format("attention_chunk_tokens = {} must be >= 0 (0: each sequence's queries at once)", attention_chunk_tokens));
  need(rms_norm_eps > 0 && rope_theta > 0, "rms_norm_eps and rope_theta must be positive");
  need(router_aux_loss_coef >= 0 && std::isfinite(router_aux_loss_coef),
       fmt::format("router_aux_loss_coef = {} must be finite and >= 0 (0: no load-balancing loss)", router_aux_loss_coef));
  if (!linear) need(kernels::attention_can_implement(attention_problem(*this)), "the attention kernel rejects this problem");
}

DecoderLayerShape DecoderLayerShape::from_spec(const ModelSpec& spec, int layer, std::int64_t tokens, std::int64_t sequences) {
  const LayerSpec& L = spec.layer(layer);
  const auto& a = spec.attention();
  const std::string where = fmt::format("layer {} of a {} model", layer, to_string(spec.family()));
  const bool hybrid = spec.family() == ModelFamily::qwen3_next || spec.family() == ModelFamily::qwen3_5_moe;
  if (!L.moe) invalid(where + " is a dense-MLP layer; only MoE layers are implemented");
  if (spec.moe().router_jitter_noise > 0)
    invalid(where + fmt::format(": router_jitter_noise {} (random, so no step could be reproduced) is not implemented",
                                spec.moe().router_jitter_noise));
  DecoderLayerShape s;
  s.linear = L.attention == AttentionKind::linear;
  if (!s.linear) {
    if (a.bias) invalid(where + ": attention biases on o_proj (attention_bias) are not implemented");
    s.qkv_bias = a.qkv_bias;
    if (a.sliding_window > 0) invalid(where + fmt::format(": sliding-window attention (sliding_window {}) is not implemented", a.sliding_window));
    if (a.clip_qkv > 0) invalid(where + fmt::format(": clip_qkv {} is not implemented", a.clip_qkv));
    s.qk_norm = !a.qk_norm ? QkNorm::none : a.qk_norm_full_width ? QkNorm::full_width : QkNorm::per_head;
    // transformers gates every Qwen3-Next and Qwen3.5 attention whatever attn_output_gate says.
    if (hybrid != a.output_gate)
      invalid(where + (hybrid ? ": attn_output_gate false (transformers always gates this family's attention)"
                              : ": an output gate on a Qwen3-MoE attention"));
    // transformers: int(head_dim * partial_rotary_factor), rotated as rotate-half pairs.
    s.rotary_dim = static_cast<std::int64_t>(static_cast<double>(a.head_dim) * spec.partial_rotary_factor());
    if (s.rotary_dim < 2 || s.rotary_dim % 2 != 0 || s.rotary_dim > static_cast<std::int64_t>(a.head_dim))
      invalid(where + fmt::format(": a rotary dimension of {} (head_dim {} x partial_rotary_factor {}) is not even in [2, head_dim]",
                                  s.rotary_dim, a.head_dim, spec.partial_rotary_factor()));
  } else {
    s.deltanet = DeltaNetShape::from_spec(spec, layer, tokens, sequences);
  }
  // transformers' Qwen3-MoE, Mixtral and OLMoE rotate the whole head; a partial_rotary_factor
  // there is not their model.
  if (!hybrid && spec.partial_rotary_factor() != 1.0)
    invalid(where + fmt::format(": partial_rotary_factor {} ({} rotates the whole head)", spec.partial_rotary_factor(),
                                to_string(spec.family())));
  s.output_gate = !s.linear && a.output_gate;
  s.norm_offset = spec.zero_centred_norms() ? 1.0f : 0.0f;
  s.shared_intermediate = static_cast<std::int64_t>(spec.moe().shared_expert_intermediate);
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
  s.router_aux_loss_coef = spec.moe().router_aux_loss_coef;
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
  const auto HI = static_cast<std::int64_t>(spec.hidden_size() * spec.moe().expert_intermediate);
  const auto HIs = static_cast<std::int64_t>(spec.hidden_size() * spec.moe().shared_expert_intermediate);
  out.expert_gate_proj.assign(E, nullptr);
  out.expert_up_proj.assign(E, nullptr);
  out.expert_down_proj.assign(E, nullptr);
  const auto ends_with = [](const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && std::string_view(s).substr(s.size() - suffix.size()) == suffix;
  };
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const StateSegment& seg = segs[i];
    if (!bases[i]) invalid(fmt::format("bind {}: segment {} has a null base", what, seg.name));
    if (seg.role == SegmentRole::linear_attention) {  // the block binds its own segment (ModelSpec's tensor order)
      const DeltaNetShape ds = DeltaNetShape::from_spec(spec, layer, 1);
      if (static_cast<std::int64_t>(seg.parameters()) != deltanet_parameters(ds))
        invalid(fmt::format("bind {}: segment {} has {} elements, the Gated DeltaNet block {}", what, seg.name,
                            seg.parameters(), deltanet_parameters(ds)));
      if constexpr (std::is_same_v<P, float*>) out.deltanet = bind_deltanet_grads(ds, bases[i]);
      else out.deltanet = bind_deltanet_params(ds, bases[i]);
      continue;
    }
    std::uint64_t offset = 0;
    for (const TensorSpec& t : seg.tensors) {
      P p = bases[i] + offset;
      offset += t.elements();
      if (seg.role == SegmentRole::expert) {
        const auto e = static_cast<std::size_t>(seg.expert);
        if (t.stacked_index >= 0 && ends_with(t.name, ".experts.gate_up_proj")) {  // Qwen3.5: this expert's [gate; up]
          out.expert_gate_proj[e] = p;
          out.expert_up_proj[e] = p + HI;
        } else if (t.stacked_index >= 0 && ends_with(t.name, ".experts.down_proj")) {
          out.expert_down_proj[e] = p;
        } else if (t.stacked_index < 0 && (ends_with(t.name, ".gate_proj.weight") || ends_with(t.name, ".w1.weight"))) {
          out.expert_gate_proj[e] = p;  // (Mixtral: w1 gate, w3 up, w2 down)
        } else if (t.stacked_index < 0 && (ends_with(t.name, ".up_proj.weight") || ends_with(t.name, ".w3.weight"))) {
          out.expert_up_proj[e] = p;
        } else if (t.stacked_index < 0 && (ends_with(t.name, ".down_proj.weight") || ends_with(t.name, ".w2.weight"))) {
          out.expert_down_proj[e] = p;
        } else {
          invalid(fmt::format("bind {}: unexpected expert tensor {}", what, t.name));
        }
        continue;
      }
      if (t.stacked_index >= 0) invalid(fmt::format("bind {}: unexpected stacked tensor {}", what, t.name));
      if (seg.role == SegmentRole::shared_expert) {
        if (ends_with(t.name, ".shared_expert.gate_proj.weight")) out.shared_gate_proj = p;
        else if (ends_with(t.name, ".shared_expert.up_proj.weight")) {
          if (out.shared_gate_proj == nullptr || p != out.shared_gate_proj + HIs)
            invalid(fmt::format("bind {}: {} does not directly follow the shared expert's gate_proj", what, t.name));
        } else if (ends_with(t.name, ".shared_expert.down_proj.weight")) out.shared_down_proj = p;
        else if (ends_with(t.name, ".shared_expert_gate.weight")) out.shared_expert_gate = p;
        else invalid(fmt::format("bind {}: unexpected shared expert tensor {}", what, t.name));
        continue;
      }
      if (ends_with(t.name, ".input_layernorm.weight")) out.input_layernorm = p;
      else if (ends_with(t.name, ".post_attention_layernorm.weight")) out.post_attention_layernorm = p;
      else if (ends_with(t.name, ".self_attn.q_proj.weight")) out.q_proj = p;
      else if (ends_with(t.name, ".self_attn.k_proj.weight")) out.k_proj = p;
      else if (ends_with(t.name, ".self_attn.v_proj.weight")) out.v_proj = p;
      else if (ends_with(t.name, ".self_attn.o_proj.weight")) out.o_proj = p;
      else if (ends_with(t.name, ".self_attn.q_proj.bias")) out.q_bias = p;
      else if (ends_with(t.name, ".self_attn.k_proj.bias")) out.k_bias = p;
      else if (ends_with(t.name, ".self_attn.v_proj.bias")) out.v_bias = p;
      else if (ends_with(t.name, ".self_attn.q_norm.weight")) out.q_norm = p;
      else if (ends_with(t.name, ".self_attn.k_norm.weight")) out.k_norm = p;
      else if (ends_with(t.name, ".mlp.gate.weight") || ends_with(t.name, ".block_sparse_moe.gate.weight")) out.router = p;
      else invalid(fmt::format("bind {}: tensor {} is not part of a Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, OLMoE or Qwen2-MoE decoder layer",
                               what, t.name));
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
  check_context(ctx, s);
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

  // ---- attention block (a linear layer: h = x + deltanet(xn1), the block's output rounded, then the sum)
  const float offset = s.norm_offset;
  check(kernels::rmsnorm_forward(x, params.input_layernorm, v.xn1, v.rstd1, T, H, eps, st, offset), "input_layernorm forward");
  if (s.linear) {
    deltanet_forward(ctx.blas, st, s.deltanet, params.deltanet, v.xn1, v.h, v.deltanet, w.deltanet_ws);
    check(kernels::add_bf16(x, v.h, v.h, T * H, st), "residual add h = x + deltanet");
  } else {
    // Gated, the row-wise steps around the attention kernel go R rows at a time (one query
    // chunk's, or all T), their scratch sized so.
    const std::int64_t R = attention_chunked(s) ? attention_chunk(s) : T;
    if (s.output_gate) {  // [q | gate] per head, split into the saved q_raw and gate
      for (std::int64_t r0 = 0; r0 < T; r0 += R) {
        const std::int64_t n = std::min(R, T - r0);
        gemm(ctx.blas, false, true, n, q_proj_rows(s), H, v.xn1 + r0 * H, H, params.q_proj, H, w.qg, CUDA_R_16BF, q_proj_rows(s),
             0.0f, "q_proj forward GEMM");
        split_heads(s, n, st, w.qg, v.q_raw + r0 * QW, v.gate + r0 * QW, /*merge=*/false);
      }
    } else {
      const float beta = bias_under(s, params.q_bias, v.q_raw, T, QW, st, "q_proj bias");
      gemm(ctx.blas, false, true, T, QW, H, v.xn1, H, params.q_proj, H, v.q_raw, CUDA_R_16BF, QW, beta, "q_proj forward GEMM");
    }
    float beta = bias_under(s, params.k_bias, v.k_raw, T, KW, st, "k_proj bias");
    gemm(ctx.blas, false, true, T, KW, H, v.xn1, H, params.k_proj, H, v.k_raw, CUDA_R_16BF, KW, beta, "k_proj forward GEMM");
    beta = bias_under(s, params.v_bias, v.v, T, KW, st, "v_proj bias");
    gemm(ctx.blas, false, true, T, KW, H, v.xn1, H, params.v_proj, H, v.v, CUDA_R_16BF, KW, beta, "v_proj forward GEMM");
    qk_norm_forward(s, v.q_raw, params.q_norm, v.q, v.q_rstd, T, s.heads_q, st, "q_norm forward");
    qk_norm_forward(s, v.k_raw, params.k_norm, v.k, v.k_rstd, T, s.heads_kv, st, "k_norm forward");
    check(kernels::rope_forward(v.q, positions, v.q, T, s.heads_q, D, rotary(s), s.rope_theta, st), "rope forward (q)");
    check(kernels::rope_forward(v.k, positions, v.k, T, s.heads_kv, D, rotary(s), s.rope_theta, st), "rope forward (k)");
    const kernels::AttentionProblem ap = attention_problem(s);
    if (!reuse_attention)
      check(kernels::attention_forward(ap, {v.q, S * QW, QW}, {v.k, S * KW, KW}, {v.v, S * KW, KW}, {v.attn, S * QW, QW}, v.lse, st),
            "attention forward");
    // h = x + o_in Wo^T, o_in = O or (gated) O * sigmoid(gate): x copied into h, then the GEMM
    // adds onto it (beta = 1, one rounding).
    check(cudaMemcpyAsync(v.h, x, static_cast<std::size_t>(T * H) * sizeof(bf16), cudaMemcpyDeviceToDevice, st),
          "residual copy x -> h");
    if (s.output_gate) {
      for (std::int64_t r0 = 0; r0 < T; r0 += R) {
        const std::int64_t n = std::min(R, T - r0);
        check(kernels::output_gate_forward(gate_dims(s, n), v.attn + r0 * QW, v.gate + r0 * QW, w.go, st), "output gate forward");
        gemm(ctx.blas, false, true, n, H, QW, w.go, QW, params.o_proj, QW, v.h + r0 * H, CUDA_R_16BF, H, 1.0f, "o_proj forward GEMM");
      }
    } else {
      gemm(ctx.blas, false, true, T, H, QW, v.attn, QW, params.o_proj, QW, v.h, CUDA_R_16BF, H, 1.0f, "o_proj forward GEMM");
    }
  }

  if (ctx.halves != nullptr) check(cudaEventRecord(ctx.halves, st), "cudaEventRecord (the layer's halves)");
  // ---- MoE block: the post-attention norm and the router over all T (their state is O(T*(H + E))),
  // then the experts chunk by chunk, rows [c0, c0 + n) of xn2 to the same rows of y. Whole: one
  // chunk whose permutation and activations stay in `saved`.
  check(kernels::rmsnorm_forward(v.h, params.post_attention_layernorm, v.xn2, v.rstd2, T, H, eps, st, offset),
        "post_attention_layernorm forward");
  check(kernels::router_forward(ctx.blas, st, router_shape(s), v.xn2, params.router, w.logits, v.probs, v.expert_ids, v.weights),
        "router forward");
  // The load-balancing loss adds the forward's rows once; a recompute's routing is the forward's.
  CudaRouterBalance* const balance = recompute ? nullptr : ctx.balance;
  if (balance != nullptr) balance->add_probabilities(st, v.probs, T);
  if (recompute && chunked(s)) return;  // y is not needed, and nothing after the router is saved
  const ExpertRows& r = chunked(s) ? w.rows : v.rows;
  for (std::int64_t c0 = 0, C = moe_chunk(s); c0 < T; c0 += C) {
    const std::int64_t n = std::min(C, T - c0);
    plan_rows(s, st, v.expert_ids, c0, n, r, w.plan_ws, w.plan_bytes);
    const auto counts = download_counts(s, r.counts, n * s.top_k, st, *ctx.expert_streams);
    if (ctx.expert_counts != nullptr) ctx.expert_counts->insert(ctx.expert_counts->end(), counts.begin(), counts.end());
    if (balance != nullptr) balance->add_counts(counts);
    experts_forward(ctx, s, params, counts, v.xn2 + c0 * H, n, r, w.gemm_ws, w.gemm_bytes);
    check(kernels::unpermute_combine(st, permute_shape(s, n), H, r.slot_to_row, r.y_perm, v.weights + c0 * s.top_k, w.moe_out),
          "unpermute combine");
    if (has_shared(s)) combine_shared(ctx, s, params, v.xn2 + c0 * H, n, r, w.moe_out, w.moe_out);
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
  if (s.linear) return {};
  return {v.attn, static_cast<std::size_t>(T * q_width(s)) * sizeof(bf16), v.lse,
          static_cast<std::size_t>(s.heads_q * T) * sizeof(float)};
}

// ---- backward -------------------------------------------------------------------------------------

namespace {

/// The softmax attention's backward from d h down to dq's share of d xn1 (into b.dxn1_f32, beta 0)
/// and the fp32-summed dK/dV rounded into b.dk / b.dv, one query chunk of one sequence at a time
/// (DecoderLayerShape::attention_chunk_tokens), the chunks of a sequence first to last: o_proj's
/// dx and dW, the output gate's backward, the attention backward with dK/dV added to fp32 sums,
/// then RoPE, the q norm and q_proj's dx and dW for the chunk's rows.
void attention_backward_chunked(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                                const std::int32_t* positions, const Saved& v, const BackwardScratch& b, const bf16* dh,
                                const DecoderLayerGrads& grads) {
  const cudaStream_t st = ctx.stream;
  const auto T = s.tokens, S = s.tokens / s.sequences, H = s.hidden, D = s.head_dim, QW = q_width(s), KW = kv_width(s);
  const std::int64_t QP = q_proj_rows(s), C = attention_chunk(s);
  const std::size_t kv_bytes = static_cast<std::size_t>(T * KW) * sizeof(float);
  check(cudaMemsetAsync(b.dk_sum, 0, kv_bytes, st), "zero the dK sums");
  check(cudaMemsetAsync(b.dv_sum, 0, kv_bytes, st), "zero the dV sums");
  for (std::int64_t seq = 0; seq < s.sequences; ++seq) {
    const std::int64_t base = seq * S;  // the sequence's first row
    for (std::int64_t q0 = 0; q0 < S; q0 += C) {
      const std::int64_t n = std::min(C, S - q0), r0 = base + q0;
      const bf16* o_in = v.attn + r0 * QW;
      if (s.output_gate) {
        check(kernels::output_gate_forward(gate_dims(s, n), v.attn + r0 * QW, v.gate + r0 * QW, b.go, st),
              "output gate forward (again)");
        o_in = b.go;
      }
      gemm(ctx.blas, false, false, n, QW, H, dh + r0 * H, H, params.o_proj, QW, b.d_attn, CUDA_R_16BF, QW, 0.0f, "o_proj dx GEMM");
      gemm(ctx.blas, true, false, H, QW, n, dh + r0 * H, H, o_in, QW, grads.o_proj, CUDA_R_32F, QW, 1.0f, "o_proj dW GEMM");
      if (s.output_gate)  // d O in place of d o_in
        check(kernels::output_gate_backward(gate_dims(s, n), v.attn + r0 * QW, v.gate + r0 * QW, b.d_attn, b.d_attn, b.d_gate, st),
              "output gate backward");
      // The sequence's tensors, its query rows [q0, q0 + n) (the chunk buffers viewed at those rows).
      const kernels::AttentionProblem ap = chunk_problem(s, q0, n);
      const kernels::AttentionDkvSums sums{{b.dk_sum + base * KW, S * KW, KW}, {b.dv_sum + base * KW, S * KW, KW}};
      check(kernels::attention_backward_dkv_sum(ap, {v.q + base * QW, S * QW, QW}, {v.k + base * KW, S * KW, KW},
                                                {v.v + base * KW, S * KW, KW}, {v.attn + base * QW, S * QW, QW},
                                                {rows_from(b.d_attn, q0, QW), S * QW, QW}, v.lse + seq * s.heads_q * S,
                                                {rows_from(b.dq, q0, QW), S * QW, QW}, sums, b.attn_ws, b.attn_bytes, st),
            "attention backward (query chunk)");
      check(kernels::rope_backward(b.dq, positions + r0, b.dq, n, s.heads_q, D, rotary(s), s.rope_theta, st), "rope backward (q)");
      qk_norm_backward(s, b.dq, v.q_raw + r0 * QW, params.q_norm, v.q_rstd + r0 * rstd_per_token(s, s.heads_q), grads.q_norm, n,
                       s.heads_q, b, st, "q_norm backward");
      const bf16* dq_rows = b.dq;  // q_proj's output gradient: dq, or (gated) [dq | d gate] per head
      if (s.output_gate) {
        split_heads(s, n, st, b.d_qg, b.dq, b.d_gate, /*merge=*/true);
        dq_rows = b.d_qg;
      }
      gemm(ctx.blas, false, false, n, H, QP, dq_rows, QP, params.q_proj, H, b.dxn1_f32 + r0 * H, CUDA_R_32F, H, 0.0f,
           "q_proj dx GEMM");
      gemm(ctx.blas, true, false, QP, H, n, dq_rows, QP, v.xn1 + r0 * H, H, grads.q_proj, CUDA_R_32F, H, 1.0f, "q_proj dW GEMM");
      bias_backward(ctx, s, b, dq_rows, n, QP, grads.q_bias, "q_proj bias gradient");
    }
  }
  check(kernels::cast_fp32_to_bf16(b.dk_sum, b.dk, T * KW, st), "round the dK sums");
  check(kernels::cast_fp32_to_bf16(b.dv_sum, b.dv, T * KW, st), "round the dV sums");
}

}  // namespace

void decoder_layer_backward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                            const std::int32_t* positions, const bf16* x, const bf16* dy, const void* saved,
                            std::size_t saved_bytes, bf16* dx, const DecoderLayerGrads& grads, void* workspace,
                            std::size_t workspace_bytes) {
  s.validate();
  check_context(ctx, s);
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
    if (chunked(s)) {
      experts_forward(ctx, s, params, counts, v.xn2 + c0 * H, n, r, b.gemm_ws, b.gemm_bytes);
      if (has_shared(s)) combine_shared(ctx, s, params, v.xn2 + c0 * H, n, r, nullptr, b.s_dy);  // for the logit alone
    }
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
    if (has_shared(s)) {  // the shared expert's gate, then its MLP, adding onto the routed experts' d xn2
      const auto Is = s.shared_intermediate;
      const bf16* xn2_rows = v.xn2 + c0 * H;
      bf16* dxn2_rows = b.dxn2 + c0 * H;
      check(kernels::shared_expert_gate_backward(st, n, H, xn2_rows, params.shared_expert_gate, r.s_y, r.s_logit, dy + c0 * H,
                                                 b.s_dy, dxn2_rows, grads.shared_expert_gate, b.shared_ws, b.shared_bytes),
            "shared expert gate backward");
      gemm(ctx.blas, false, false, n, Is, H, b.s_dy, H, params.shared_down_proj, Is, b.s_d_act, CUDA_R_16BF, Is, 0.0f,
           "shared expert down dx GEMM");
      gemm(ctx.blas, true, false, H, Is, n, b.s_dy, H, r.s_act, Is, grads.shared_down_proj, CUDA_R_32F, Is, 1.0f,
           "shared expert down dW GEMM");
      check(kernels::swiglu_backward(b.s_d_act, r.s_gate_up, b.s_d_gate_up, n, Is, st), "shared expert swiglu backward");
      gemm(ctx.blas, false, false, n, H, 2 * Is, b.s_d_gate_up, 2 * Is, params.shared_gate_proj, H, dxn2_rows, CUDA_R_16BF, H,
           1.0f, "shared expert gate_up dx GEMM");
      gemm(ctx.blas, true, false, 2 * Is, H, n, b.s_d_gate_up, 2 * Is, xn2_rows, H, grads.shared_gate_proj, CUDA_R_32F, H, 1.0f,
           "shared expert gate_up dW GEMM");
    }
  }
  if (leave_unrouted) {
    grads.unrouted_experts->resize(reached.size());
    for (std::size_t e = 0; e < reached.size(); ++e) (*grads.unrouted_experts)[e] = reached[e] == 0 ? 1 : 0;
  }
  // The router over all T. With the load-balancing loss, the micro-batch's counts over every layer
  // and the loss's gradient scale (CudaRouterBalance); without, the counts only scale a zero
  // gradient (a chunked layer passes its last chunk's).
  const std::int32_t* const aux_counts = ctx.balance != nullptr ? ctx.balance->device_counts() : r.counts;
  const float aux_grad = ctx.balance != nullptr ? ctx.balance->aux_loss_grad() : 0.0f;
  check(kernels::router_backward(ctx.blas, st, router_shape(s), v.xn2, params.router, v.probs, v.expert_ids, b.d_weights, aux_counts,
                                 aux_grad, b.d_logits, b.dxn2, /*accumulate_dx=*/true, grads.router, b.router_ws, b.router_bytes),
        "router backward");
  const float offset = s.norm_offset;
  check(kernels::rmsnorm_backward(b.dxn2, v.h, params.post_attention_layernorm, v.rstd2, b.dxn2, grads.post_attention_layernorm,
                                  T, H, b.norm_ws, b.norm_bytes, st, offset),
        "post_attention_layernorm backward");
  bf16* const dh = b.dxn2;
  check(kernels::add_bf16(dy, b.dxn2, dh, T * H, st), "residual add dh = dy + d moe");
  if (ctx.halves != nullptr) check(cudaEventRecord(ctx.halves, st), "cudaEventRecord (the layer's halves)");

  // ---- the token mixer's backward, its d xn1 summed in fp32 into dxn1_f32; then the input norm's.
  if (s.linear) {  // linear attention: h = x + deltanet(xn1)
    deltanet_backward(ctx.blas, st, s.deltanet, params.deltanet, v.xn1, dh, b.dxn1_f32, grads.deltanet, v.deltanet, b.deltanet_ws);
  } else {
    // softmax attention: h = x + o_in Wo^T, o_in = O or (gated) O * sigmoid(gate). The biases'
    // ones share storage with the MoE phase's buffers: filled now, once for q, k and v.
    if (s.qkv_bias) check(kernels::fill_bf16(b.ones, T, 1.0f, st), "fill the bias gradients' ones");
    const std::int64_t QP = q_proj_rows(s);
    if (attention_chunked(s)) {
      attention_backward_chunked(ctx, s, params, positions, v, b, dh, grads);
    } else {
      const bf16* o_in = v.attn;
      if (s.output_gate) {
        check(kernels::output_gate_forward(gate_dims(s), v.attn, v.gate, b.go, st), "output gate forward (again)");
        o_in = b.go;
      }
      gemm(ctx.blas, false, false, T, QW, H, dh, H, params.o_proj, QW, b.d_attn, CUDA_R_16BF, QW, 0.0f, "o_proj dx GEMM");
      gemm(ctx.blas, true, false, H, QW, T, dh, H, o_in, QW, grads.o_proj, CUDA_R_32F, QW, 1.0f, "o_proj dW GEMM");
      if (s.output_gate)  // d O in place of d o_in
        check(kernels::output_gate_backward(gate_dims(s), v.attn, v.gate, b.d_attn, b.d_attn, b.d_gate, st), "output gate backward");
      const kernels::AttentionProblem ap = attention_problem(s);
      check(kernels::attention_backward(ap, {v.q, S * QW, QW}, {v.k, S * KW, KW}, {v.v, S * KW, KW}, {v.attn, S * QW, QW},
                                        {b.d_attn, S * QW, QW}, v.lse, {b.dq, S * QW, QW}, {b.dk, S * KW, KW}, {b.dv, S * KW, KW},
                                        /*accumulate_dkv=*/false, b.attn_ws, b.attn_bytes, st),
            "attention backward");
      check(kernels::rope_backward(b.dq, positions, b.dq, T, s.heads_q, D, rotary(s), s.rope_theta, st), "rope backward (q)");
      qk_norm_backward(s, b.dq, v.q_raw, params.q_norm, v.q_rstd, grads.q_norm, T, s.heads_q, b, st, "q_norm backward");
      // q_proj's output gradient: dq, or (gated) [dq | d gate] per head as its rows are.
      const bf16* dq_rows = b.dq;
      if (s.output_gate) {
        split_heads(s, T, st, b.d_qg, b.dq, b.d_gate, /*merge=*/true);
        dq_rows = b.d_qg;
      }
      // d xn1 = dq Wq + dk Wk + dv Wv, summed in fp32 and rounded once (the k and v terms below).
      gemm(ctx.blas, false, false, T, H, QP, dq_rows, QP, params.q_proj, H, b.dxn1_f32, CUDA_R_32F, H, 0.0f, "q_proj dx GEMM");
      gemm(ctx.blas, true, false, QP, H, T, dq_rows, QP, v.xn1, H, grads.q_proj, CUDA_R_32F, H, 1.0f, "q_proj dW GEMM");
      bias_backward(ctx, s, b, dq_rows, T, QP, grads.q_bias, "q_proj bias gradient");
    }
    check(kernels::rope_backward(b.dk, positions, b.dk, T, s.heads_kv, D, rotary(s), s.rope_theta, st), "rope backward (k)");
    qk_norm_backward(s, b.dk, v.k_raw, params.k_norm, v.k_rstd, grads.k_norm, T, s.heads_kv, b, st, "k_norm backward");
    gemm(ctx.blas, false, false, T, H, KW, b.dk, KW, params.k_proj, H, b.dxn1_f32, CUDA_R_32F, H, 1.0f, "k_proj dx GEMM");
    gemm(ctx.blas, false, false, T, H, KW, b.dv, KW, params.v_proj, H, b.dxn1_f32, CUDA_R_32F, H, 1.0f, "v_proj dx GEMM");
    gemm(ctx.blas, true, false, KW, H, T, b.dk, KW, v.xn1, H, grads.k_proj, CUDA_R_32F, H, 1.0f, "k_proj dW GEMM");
    gemm(ctx.blas, true, false, KW, H, T, b.dv, KW, v.xn1, H, grads.v_proj, CUDA_R_32F, H, 1.0f, "v_proj dW GEMM");
    bias_backward(ctx, s, b, b.dk, T, KW, grads.k_bias, "k_proj bias gradient");
    bias_backward(ctx, s, b, b.dv, T, KW, grads.v_bias, "v_proj bias gradient");
  }
  check(kernels::cast_fp32_to_bf16(b.dxn1_f32, b.dxn1, T * H, st), "cast d xn1 to bf16");
  check(kernels::rmsnorm_backward(b.dxn1, x, params.input_layernorm, v.rstd1, b.dxn1, grads.input_layernorm, T, H, b.norm_ws,
                                  b.norm_bytes, st, offset),
        "input_layernorm backward");
  check(kernels::add_bf16(dh, b.dxn1, dx, T * H, st), "residual add dx = dh + d attention");
}

}  // namespace oom::model
