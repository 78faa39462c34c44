// One Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, OLMoE or Qwen2-MoE decoder layer on the GPU,
// forward and backward, composed from OOM's kernels (include/oom/kernels/) and cuBLAS. The math is transformers'
// Qwen3MoeDecoderLayer (the hybrid families' differences below):
//
//   xn1 = rms(x) * input_layernorm
//   q   = rope(rms_head(xn1 Wq^T) * q_norm)     (T, Hq, D)   per-head RMSNorm, then RoPE
//   k   = rope(rms_head(xn1 Wk^T) * k_norm)     (T, Hkv, D)
//   v   = xn1 Wv^T                              (T, Hkv, D)
//   h   = x + attn(q, k, v) Wo^T                causal GQA, scale 1/sqrt(D)
//   xn2 = rms(h) * post_attention_layernorm
//   p   = softmax(xn2 Wr^T) (fp32); top-k experts, weights renormalised when norm_topk_prob
//   y   = h + sum_j w_j down_e(silu(gate_e xn2) * up_e xn2)
//
// No dropout. The load-balancing loss (output_router_logits) is the caller's CudaRouterBalance
// (DecoderLayerShape::router_aux_loss_coef, DecoderLayerContext::balance); T tokens in DecoderLayerShape::sequences sequences (positions given per token).
//
// The hybrid families (Qwen3-Next, Qwen3.5-MoE; transformers' Qwen3NextDecoderLayer and
// Qwen3_5MoeDecoderLayer) differ in five ways, each a field of DecoderLayerShape:
//   - linear: a Gated DeltaNet layer, whose attention half is h = x + deltanet(xn1)
//     (oom/model/cuda_deltanet.hpp) in place of the softmax attention above;
//   - output_gate: q_proj yields per head [q (D) | gate (D)] side by side, and the attention
//     output is ctx * sigmoid(gate) before o_proj (kernels/output_gate.hpp);
//   - rotary_dim < D: RoPE rotates only the first rotary_dim dimensions of each head;
//   - norm_offset = 1: every RMSNorm of the layer (input, post-attention, q and k) scales by
//     (1 + w), the 1 added in fp32 inside the kernel;
//   - shared_intermediate > 0: a shared expert beside the routed ones,
//     y = h + routed + sigmoid(xn2 . shared_expert_gate) * down(silu(gate xn2) * up xn2).
// Mixtral and OLMoE differ only in their q/k norms (QkNorm) and OLMoE in norm_topk_prob; Qwen2-MoE
// (Qwen1.5-MoE) has no q/k norm, a shared expert and qkv_bias: q, k and v are xn1 W^T + b, the
// bias under each GEMM's fp32 sum and rounded with it once (the GEMM adds onto the bias repeated
// in its output rows, beta = 1), each bias's gradient the column sums of its projection's output
// gradient (a GEMM with a row of ones, fp32, accumulated like the weights').
//
// Dtypes: activations and weights bf16, every accumulation fp32 (cuBLAS with CUBLAS_COMPUTE_32F,
// fp32 statistics). Parameter gradients are fp32 and ACCUMULATED (+=) into what the caller passes
// (zero them once per step): the projections' weight gradients are cuBLAS GEMMs with an fp32 C and
// beta = 1, the norms', router's and experts' come from their kernels likewise. Activation
// gradients (dx and everything inside) are bf16.
//
// Calls: everything is issued on the caller's stream and cuBLAS handle (whose stream is set to
// it); no allocation: the caller gives `saved` (kept from forward to backward) and `workspace`
// (scratch of one call). The expert GEMMs (ExpertGemmMethod::row_chunked) need each expert's row
// count on the HOST: forward and backward each copy the E counts down once per MoE chunk
// (cudaMemcpyAsync + cudaStreamSynchronize(stream)): the only host syncs inside. The backward
// copies them again from device memory so nothing but it carries state between the calls.
//
// MoE token chunks (DecoderLayerShape::moe_chunk_tokens = C < T): the attention half, the
// post-attention norm and the router run over all T; the experts (permute, gate/up, SwiGLU, down,
// combine) run over tokens [0, C), [C, 2C), ... in that order. `saved` then keeps only the routing
// (expert ids, weights, router probabilities) of the MoE half, not the permuted tokens and expert
// activations (O(T*k*(H + I))); the backward recomputes them chunk by chunk from the saved xn2 and
// routing, so saved and workspace bytes of the MoE half scale with C, not T. The results equal the
// whole layer's up to the expert GEMMs' summation order (cuBLAS picks kernels by shape; the shared
// expert's GEMMs see chunk-sized shapes too, and its gate's dW adds the chunks' partial sums in
// chunk order); for one C they are deterministic run to run.
//
// Weights may live anywhere in device memory, e.g. in per-segment blocks laid out as ModelSpec's
// segments (tensors of one segment back to back, in TensorSpec order): bind_decoder_layer_params()
// resolves every tensor from the layer's segments and one base pointer per segment. The only
// layout requirement: each expert's up_proj must directly follow its gate_proj (as in its segment),
// since the expert GEMM reads [gate_proj; up_proj] as one (2I, H) matrix; the same for gradients,
// and for the shared expert's (2Is, H). Qwen3.5's stacked experts.gate_up_proj slices are that
// layout already.
//
// Errors: oom::Error (Errc::invalid_argument for bad shapes/pointers/workspace sizes naming what is
// wrong, Errc::cuda / Errc::cublas naming the failed call).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oom/core/numeric.hpp"
#include "oom/model/cuda_deltanet.hpp"
#include "oom/model/cuda_router_balance.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom {
class ModelSpec;
struct StateSegment;
namespace kernels {
class ExpertGemmStreams;
}
}  // namespace oom

namespace oom::model {

/// The RMSNorm on q and k before RoPE: Qwen's per head (rows of head_dim), OLMoE's over the whole
/// projection (rows of heads * head_dim), Mixtral's none.
enum class QkNorm : unsigned char { per_head, full_width, none };

struct DecoderLayerShape {
  std::int64_t tokens = 0;        ///< T, all the sequences' tokens (positions are given per token)
  /// B: T holds B sequences of T / B tokens, one after another; attention is causal within each
  /// (no token attends to another sequence's), everything else works on the T tokens as rows.
  std::int64_t sequences = 1;
  std::int64_t hidden = 0;        ///< H
  std::int64_t heads_q = 0;       ///< Hq
  std::int64_t heads_kv = 0;      ///< Hkv (divides Hq)
  std::int64_t head_dim = 0;      ///< D: 128 or 256 (the attention kernel's)
  std::int64_t experts = 0;       ///< E
  std::int64_t top_k = 0;         ///< k
  std::int64_t intermediate = 0;  ///< I, moe_intermediate_size
  bool norm_topk_prob = true;
  QkNorm qk_norm = QkNorm::per_head;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 1e6f;
  /// Tokens per chunk of the MoE half (the plan's LayerChunks::moe_tokens); 0 or >= tokens: one
  /// chunk of all T, whose permutation and expert activations are kept in `saved`.
  std::int64_t moe_chunk_tokens = 0;
  /// Query tokens per chunk of a softmax-attention layer (the plan's LayerChunks::attention); 0 or
  /// >= tokens / sequences: each sequence whole. In chunks, the attention half's scratch that grows
  /// with the tokens (the gated q_proj output and o_proj input; in the backward the output-gate
  /// and attention output gradients, dq, [dq | d gate]) is held for one chunk of one sequence, and
  /// dK/dV are summed in fp32 over the chunks (kernels::attention_backward_dkv_sum) and rounded
  /// once: the backward then holds, T-wide, only dK/dV (bf16 and fp32) and d xn1 (fp32 and bf16).
  /// The results equal the whole layer's up to summation order (dK/dV over chunks; o_proj's and
  /// q_proj's weight gradients over chunks; cuBLAS kernels picked by shape).
  std::int64_t attention_chunk_tokens = 0;
  /// The hybrid families' fields (see the top of this file); Qwen3-MoE's layers leave them so.
  bool output_gate = false;              ///< q_proj is (2 Hq D, H): per head [q | gate]
  /// q_proj, k_proj and v_proj add biases (Qwen2-MoE's qkv_bias; o_proj has none). Not with
  /// output_gate, as the host layer.
  bool qkv_bias = false;
  std::int64_t rotary_dim = 0;           ///< dimensions RoPE rotates per head; 0: all D
  float norm_offset = 0.0f;              ///< 1 for (1 + w) RMSNorms
  std::int64_t shared_intermediate = 0;  ///< Is of the shared expert; 0: none
  /// A Gated DeltaNet layer: `deltanet` (its tokens and sequences those above) replaces the
  /// softmax attention, whose fields (heads, head_dim, rope, output_gate) are then not used.
  bool linear = false;
  DeltaNetShape deltanet;
  /// transformers' load-balancing loss coefficient (router_aux_loss_coef with output_router_logits,
  /// ModelSpec's MoeSpec); > 0: forward and backward need DecoderLayerContext::balance, built with
  /// this coefficient. 0: no such loss.
  double router_aux_loss_coef = 0;

  /// Layer `layer` of a Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, OLMoE or Qwen2-MoE config with T =
  /// tokens in `sequences` sequences. Errc::invalid_argument when the layer is not one this class
  /// implements (a dense MLP, an o_proj bias (attention_bias), a sliding window, OLMoE's clip_qkv, Mixtral's
  /// router jitter, a hybrid attention without the output gate, an odd rotary dimension, a
  /// head_dim the attention kernel does not take) or the tokens do not split into the sequences.
  [[nodiscard]] static DecoderLayerShape from_spec(const ModelSpec& spec, int layer, std::int64_t tokens, std::int64_t sequences = 1);
  /// Throws Errc::invalid_argument naming the first field out of range.
  void validate() const;
};

/// Device pointers to the layer's weights (bf16), shapes as the HF tensors.
struct DecoderLayerParams {
  const bf16* input_layernorm = nullptr;           ///< (H)
  const bf16* q_proj = nullptr;                    ///< (Hq*D, H); with output_gate (2*Hq*D, H), [q | gate] per head
  const bf16* k_proj = nullptr;                    ///< (Hkv*D, H)
  const bf16* v_proj = nullptr;                    ///< (Hkv*D, H)
  const bf16* o_proj = nullptr;                    ///< (H, Hq*D)
  const bf16* q_bias = nullptr;                    ///< (Hq*D) with qkv_bias
  const bf16* k_bias = nullptr;                    ///< (Hkv*D)
  const bf16* v_bias = nullptr;                    ///< (Hkv*D)
  const bf16* q_norm = nullptr;                    ///< (D)
  const bf16* k_norm = nullptr;                    ///< (D)
  const bf16* post_attention_layernorm = nullptr;  ///< (H)
  const bf16* router = nullptr;                    ///< (E, H) mlp.gate.weight
  std::vector<const bf16*> expert_gate_proj;       ///< E pointers, (I, H) each
  std::vector<const bf16*> expert_up_proj;         ///< E pointers, (I, H) each; == gate_proj + I*H
  std::vector<const bf16*> expert_down_proj;       ///< E pointers, (H, I) each
  const bf16* shared_gate_proj = nullptr;          ///< (Is, H), up_proj (Is, H) directly after it
  const bf16* shared_down_proj = nullptr;          ///< (H, Is)
  const bf16* shared_expert_gate = nullptr;        ///< (1, H)
  DeltaNetParams deltanet;                         ///< a linear layer's block (q/k/v/o_proj and q/k_norm unused)
};

/// Device pointers to the layer's parameter gradients, fp32, same shapes, accumulated into (the
/// routed experts': overwritten instead with `overwrite_experts`).
struct DecoderLayerGrads {
  float* input_layernorm = nullptr;
  float* q_proj = nullptr;
  float* k_proj = nullptr;
  float* v_proj = nullptr;
  float* o_proj = nullptr;
  float* q_bias = nullptr;  ///< with qkv_bias
  float* k_bias = nullptr;
  float* v_bias = nullptr;
  float* q_norm = nullptr;
  float* k_norm = nullptr;
  float* post_attention_layernorm = nullptr;
  float* router = nullptr;
  std::vector<float*> expert_gate_proj;  ///< E pointers, (I, H) each
  std::vector<float*> expert_up_proj;    ///< E pointers, (I, H) each; == gate_proj + I*H
  std::vector<float*> expert_down_proj;  ///< E pointers, (H, I) each
  float* shared_gate_proj = nullptr;     ///< (Is, H), up_proj's directly after it
  float* shared_down_proj = nullptr;
  float* shared_expert_gate = nullptr;
  DeltaNetGrads deltanet;
  /// The routed experts' gradients are set, not added to: their old contents are never read (the
  /// caller need not zero them) and an expert no token reaches gets zeros. The MoE block's first
  /// token chunk writes them (kernels::GradWrite::overwrite), later chunks add. Half the memory
  /// traffic of the experts' weight gradients, and no zeroing beforehand, for a caller that
  /// runs one backward per step; the other gradients are accumulated either way.
  bool overwrite_experts = false;
  /// With overwrite_experts, where set: the routed experts no token reaches in this backward are
  /// left unwritten instead of zeroed (kernels::GradWrite::overwrite_routed) and flagged here,
  /// resized to E: 1 = no token reached the expert, its gradient is zero and its buffers hold
  /// whatever they held; 0 = written. A chunked MoE half zeroes an expert's gradients before the
  /// first chunk after the first that reaches it. The caller applies a flagged expert's gradient
  /// as zeros without reading it (kernels::adamw_update with null grads). Why: zeroing them took
  /// 10.3 ms of the 5.13B model's 4K step on an H200 (26-54 of 64 experts per layer idle in its
  /// early steps), and the optimizer read those zeros again.
  std::vector<std::uint8_t>* unrouted_experts = nullptr;
};

/// Resolves every tensor of layer `layer` from its segments (spec.layer_segments(layer)) and one
/// device base pointer per segment (in that order), each segment's tensors back to back in
/// TensorSpec order with `element_bytes` per element (2 for bf16 weights, 4 for fp32 gradients).
/// Errc::invalid_argument when a tensor is missing or the number of bases differs.
[[nodiscard]] DecoderLayerParams bind_decoder_layer_params(const ModelSpec& spec, int layer,
                                                           std::span<const bf16* const> segment_bases);
[[nodiscard]] DecoderLayerGrads bind_decoder_layer_grads(const ModelSpec& spec, int layer,
                                                         std::span<float* const> segment_bases);

/// Where the calls run. `expert_streams` (side streams and handles of the row_chunked expert
/// GEMMs) belongs to the caller: one per device and per concurrently launching stream.
struct DecoderLayerContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  kernels::ExpertGemmStreams* expert_streams = nullptr;
  /// Optional host copy of the layer's expert counts (E per MoE chunk, chunk after chunk). The
  /// forward (and a recompute that runs the experts) refills it as it reads the counts back; the
  /// backward of the same `saved` then takes them from here instead of reading them back again:
  /// one stream synchronization per chunk fewer, so the issuing thread stays ahead of the GPU.
  /// It must be the vector that the forward of this `saved` filled (counts of another routing
  /// would size the expert GEMMs wrongly; a recompute routes bit for bit as the forward did, so a
  /// chunked one, which reads no counts, leaves them as they are). A forward empties it first, so
  /// one that fails leaves none. A vector of another size is ignored (read back as without it);
  /// counts that are negative or do not sum to their chunk's rows are refused
  /// (Errc::invalid_argument) before the backward launches anything. nullptr: the backward reads
  /// them back.
  std::vector<std::int32_t>* expert_counts = nullptr;
  /// Optional event recorded on `stream` where the layer passes from one half to the other: in
  /// the forward (and a recompute) after the token mixer (attention or Gated DeltaNet block and
  /// its residual), before the post-attention norm; in the backward after the MoE half (the
  /// router's and the post-attention norm's backward and the residual included), before the token
  /// mixer's. A profiler (CudaCausalLm's recorded step) times each half with it. nullptr: none.
  cudaEvent_t halves = nullptr;
  /// The micro-batch's load-balancing loss, for a shape with router_aux_loss_coef > 0 (refused
  /// without it, and with it for a shape without the loss): the forward (not a recompute) adds its
  /// router's probabilities and its chunks' counts; the backward takes its global counts and
  /// gradient scale, so it must come after the micro-batch's finish().
  CudaRouterBalance* balance = nullptr;
};

/// Bytes of the buffer kept from forward to backward (the list is in docs/kernels.md): O(T*(H +
/// heads*D)) for the attention half (plus T*Hq*D for the gate with output_gate; a linear layer's
/// is deltanet_saved_bytes instead), plus O(T*k*(H + I) + T*(H + Is)) for the MoE half when it
/// runs whole.
[[nodiscard]] std::size_t decoder_layer_saved_bytes(const DecoderLayerShape& s);
/// Scratch bytes of forward and of backward (the larger of the two); depends on the expert
/// streams' options (their cuBLAS workspaces are carved from it). The MoE half's part scales with
/// the chunk (C*k rows), the attention backward's with T.
[[nodiscard]] std::size_t decoder_layer_workspace_bytes(const DecoderLayerShape& s, const kernels::ExpertGemmStreams& streams);

/// y = layer(x). `positions` (T) int32 on the device (0..S-1 in each sequence of S). x is read again
/// by the backward, so keep it unchanged until then. y must not alias x. Writes `saved`.
/// All device buffers 256-byte aligned is the safe choice (16 bytes is required).
void decoder_layer_forward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                           const std::int32_t* positions,  // (T) int32
                           const bf16* x,                  // (T, H)
                           bf16* y,                        // (T, H) out
                           void* saved, std::size_t saved_bytes, void* workspace, std::size_t workspace_bytes);

/// The forward again from the same x, to regenerate `saved` for the backward: bit for bit what
/// decoder_layer_forward left there (every kernel is deterministic), doing only what `saved` needs.
/// With `attention_state_kept` the attention kernel is not run: the attention output O and its LSE
/// must already be in `saved` (put back where decoder_layer_attention_state() says, from a copy
/// taken after the original forward) — at 512K on the 5.13B model 4.4 s of a layer's 4.5 s forward
/// is attention. A chunked MoE half stops after the router (the backward regenerates each chunk's
/// expert rows), leaving y unwritten; a whole one writes y (throwaway) on the way.
void decoder_layer_recompute(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                             const std::int32_t* positions, const bf16* x, bf16* y, void* saved, std::size_t saved_bytes,
                             void* workspace, std::size_t workspace_bytes, bool attention_state_kept);

/// Where the attention's output O (T, Hq, D bf16) and LSE (Hq, T fp32) sit in `saved`: what a
/// caller keeps (or offloads) to regenerate the rest with decoder_layer_recompute(). A linear
/// layer has none (null, 0 bytes): its recompute runs the whole block whatever
/// `attention_state_kept` says.
struct DecoderLayerAttentionState {
  bf16* output = nullptr;
  std::size_t output_bytes = 0;
  float* lse = nullptr;
  std::size_t lse_bytes = 0;
};
[[nodiscard]] DecoderLayerAttentionState decoder_layer_attention_state(const DecoderLayerShape& s, void* saved);

/// dx = d layer / dx . dy, and every parameter gradient accumulated into `grads` (the experts'
/// overwritten with DecoderLayerGrads::overwrite_experts). `x` and `saved`
/// as the forward left them (saved is left unchanged). dx must not alias x or dy.
void decoder_layer_backward(const DecoderLayerContext& ctx, const DecoderLayerShape& s, const DecoderLayerParams& params,
                            const std::int32_t* positions,  // (T) int32
                            const bf16* x,                  // (T, H), the forward's input
                            const bf16* dy,                 // (T, H)
                            const void* saved, std::size_t saved_bytes,
                            bf16* dx,                       // (T, H) out
                            const DecoderLayerGrads& grads, void* workspace, std::size_t workspace_bytes);

/// The router's decisions of the last forward, from `saved` (for checks and statistics): expert
/// ids (T, k) int32 and weights (T, k) fp32, device pointers into `saved`.
struct DecoderLayerRouting {
  const std::int32_t* expert_ids = nullptr;
  const float* weights = nullptr;
};
[[nodiscard]] DecoderLayerRouting decoder_layer_routing(const DecoderLayerShape& s, const void* saved);

}  // namespace oom::model
