// The hybrid models' linear-attention block (Gated DeltaNet) on the GPU, forward and backward,
// composed from OOM's kernels (oom/kernels/deltanet.hpp, gated_delta.hpp) and cuBLAS. The math is
// transformers' Qwen3NextGatedDeltaNet / Qwen3_5MoeGatedDeltaNet on whole sequences without a
// cache, as oom::reference::gated_deltanet_forward computes it:
//
//   [q k v z] = x Wqkvz^T, [b a] = x Wba^T     (Qwen3-Next's fused rows unfused first)
//   [q k v]   = silu(causal_conv1d([q k v]))   (per channel, kernel K, within each sequence)
//   beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
//   o = gated_delta_rule(q, k, v, g, beta)      (l2-normalised q, k; a zero state per sequence)
//   out = (norm_w o rstd silu(z)) Wout^T         (the gated RMSNorm per value head)
//
// Dtypes as the decoder layer's (oom/model/cuda_decoder_layer.hpp): activations and weights bf16,
// accumulations fp32; parameter gradients fp32 and ACCUMULATED (+=); dx fp32 (overwritten). The
// caller gives `saved` (forward to backward) and `workspace` (one call's scratch); everything runs
// on the caller's stream and cuBLAS handle; no allocation, no host synchronisation. Errors:
// oom::Error naming the step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom {
class ModelSpec;
}

namespace oom::model {

struct DeltaNetShape {
  std::int64_t tokens = 0, sequences = 1;  ///< T rows, sequences of T / sequences tokens each
  std::int64_t hidden = 0;
  std::int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  std::int64_t conv_kernel = 4;
  float eps = 1e-6f;
  bool fused = true;       ///< Qwen3-Next's per-key-head interleaved projection rows (false: Qwen3.5's stacked)
  std::int64_t chunk = 64;  ///< tokens between the recurrent states kept for the backward
  /// Run each sequence in parts of at most this many tokens (a multiple of `chunk`; 0: whole
  /// sequences at once), the rule's state, its gradient and the conv's edge rows carried between
  /// them (docs/hybrid.md, slice 6): the workspace is O(part) instead of O(tokens); `saved` is
  /// unchanged. The same results as whole sequences up to the projections' fp32 sums (their
  /// weight gradients added a part at a time); bit-identical run to run.
  std::int64_t part_tokens = 0;

  /// Layer `layer` of `spec` (a linear-attention layer of a qwen3_next or qwen3_5_moe model), for
  /// `tokens` rows in `sequences` sequences. Errc::invalid_argument naming the layer otherwise.
  static DeltaNetShape from_spec(const ModelSpec& spec, int layer, std::int64_t tokens, std::int64_t sequences = 1);

  [[nodiscard]] std::int64_t key_width() const { return k_heads * k_dim; }
  [[nodiscard]] std::int64_t value_width() const { return v_heads * v_dim; }
  [[nodiscard]] std::int64_t conv_channels() const { return 2 * key_width() + value_width(); }
  [[nodiscard]] std::int64_t projection_width() const { return conv_channels() + value_width(); }  ///< [q k v z]
  [[nodiscard]] std::int64_t seq_len() const { return tokens / sequences; }
  /// Whether the block runs in parts (part_tokens set and shorter than a sequence).
  [[nodiscard]] bool in_parts() const { return part_tokens > 0 && part_tokens < seq_len(); }
};

/// The block's weights (bf16), each as its tensor in the linear_attention segment (ModelSpec's
/// order: in_proj_qkvz (or in_proj_qkv then in_proj_z), in_proj_ba (or in_proj_b then in_proj_a),
/// conv1d, dt_bias, A_log, norm, out_proj), or the gradients' (fp32) at the same offsets.
template <class T>
struct DeltaNetTensors {
  T* in_proj_qkvz = nullptr;  ///< (2 kw + 2 vw, hidden)
  T* in_proj_ba = nullptr;    ///< (2 v_heads, hidden)
  T* conv = nullptr;          ///< (conv channels, K)
  T* dt_bias = nullptr;       ///< (v_heads)
  T* a_log = nullptr;         ///< (v_heads)
  T* norm = nullptr;          ///< (v_dim)
  T* out_proj = nullptr;      ///< (hidden, vw)
};
using DeltaNetParams = DeltaNetTensors<const bf16>;
using DeltaNetGrads = DeltaNetTensors<float>;

/// The tensors of one linear_attention segment laid out back to back from `base`.
DeltaNetParams bind_deltanet_params(const DeltaNetShape& s, const bf16* base);
DeltaNetGrads bind_deltanet_grads(const DeltaNetShape& s, float* base);
/// Elements of the segment: what bind_* covers.
[[nodiscard]] std::int64_t deltanet_parameters(const DeltaNetShape& s);

/// `saved`: the unfused projections [q k v z] and [b a], the rule's output (bf16), the gates and
/// the norm's rstd (fp32), and each sequence's state every `chunk` tokens and at its end; the
/// conv's and the norm's outputs are made again in the backward's workspace (one per device, not
/// one per kept layer). `workspace`: one call's scratch, forward or backward, both layouts.
[[nodiscard]] std::size_t deltanet_saved_bytes(const DeltaNetShape& s);
[[nodiscard]] std::size_t deltanet_workspace_bytes(const DeltaNetShape& s);

/// out (T, hidden) bf16 from x (T, hidden) bf16; fills `saved`.
void deltanet_forward(cublasHandle_t blas, cudaStream_t stream, const DeltaNetShape& s, const DeltaNetParams& w, const bf16* x,
                      bf16* out, void* saved, void* workspace);

/// From d_out (T, hidden) bf16: dx (T, hidden) fp32 (overwritten) and every parameter's gradient
/// added into `grads`. Reads the forward's `saved` and x.
void deltanet_backward(cublasHandle_t blas, cudaStream_t stream, const DeltaNetShape& s, const DeltaNetParams& w, const bf16* x,
                       const bf16* d_out, float* dx, const DeltaNetGrads& grads, const void* saved, void* workspace);

}  // namespace oom::model
