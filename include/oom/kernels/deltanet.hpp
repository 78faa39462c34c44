// The Gated DeltaNet's pieces around the gated delta rule (oom/kernels/gated_delta.hpp) on the
// GPU: the causal depthwise conv1d + SiLU over [q, k, v], the gates, and the gated RMSNorm, each
// forward and backward, as oom::reference::causal_conv1d_silu_*, delta_gates_* and
// gated_rmsnorm_* compute them (include/oom/reference/gated_delta.hpp). Kernels in
// src/kernels/deltanet.cu.
//
// Activations are bf16, read from and written to row-strided (T, ...) arrays so that they can be
// column ranges of a projection's output or gradient (the projections' rows ordered [q | k | v |
// z] and [b | a]); weights are bf16 (the working copy), their gradients fp32 and overwritten;
// gates fp32. Every parameter gradient sums over tokens in a fixed order through a workspace of
// per-block partials (no atomics): the same bits run to run. Sequences are independent: the conv
// sees zeros before each sequence's first token.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

struct ConvDims {
  std::int64_t sequences = 1, seq_len = 0;  ///< T = sequences x seq_len rows, sequence-major
  std::int64_t channels = 0;                ///< C: 2 k_heads dk + v_heads dv ([q | k | v])
  std::int64_t kernel = 4;                  ///< K: linear_conv_kernel_dim, 1..8
  std::int64_t x_stride = 0;                ///< elements between rows of x (and of dx): >= C
  /// A part of one longer sequence (docs/hybrid.md, slice 6; `sequences` must then be 1): `history`
  /// rows of x before the part's first row and `future` rows of x and dy after its last are real
  /// (the parts before and after), and the taps reach into them instead of stopping at the part's
  /// edges: the forward's first rows read the history; the backward's dx takes the future rows'
  /// gradients through the taps (dy then holds seq_len + future rows), its dw sums the part's own
  /// rows only (their taps reaching into the history). Each at most kernel - 1; the forward
  /// refuses `future` (it has no use for it).
  std::int64_t history = 0, future = 0;
  [[nodiscard]] std::int64_t tokens() const { return sequences * seq_len; }
};

/// y (T, C) contiguous = silu(sum_j w[c, j] x[t - K + 1 + j, c]) within each sequence; w: (C, K).
cudaError_t causal_conv1d_silu_forward(const ConvDims& d, const bf16* x, const bf16* w, bf16* y, cudaStream_t stream);

[[nodiscard]] std::size_t causal_conv1d_silu_backward_workspace_bytes(const ConvDims& d);
/// From dy (T, C) contiguous: dx (T, C) at x_stride (overwritten) and dw (C, K) fp32 (overwritten).
cudaError_t causal_conv1d_silu_backward(const ConvDims& d, const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw,
                                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

struct GateDims {
  std::int64_t tokens = 0, heads = 0;  ///< T and the value heads H
  std::int64_t ab_stride = 0;          ///< elements between rows of a and of b (and of da, db): >= H
};

/// beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (softplus(x) = x above 20, as torch),
/// per (t, h); a, b: (T, H) at ab_stride; A_log, dt_bias: (H); g, beta: (T, H) fp32 contiguous.
cudaError_t delta_gates_forward(const GateDims& d, const bf16* a, const bf16* b, const bf16* a_log, const bf16* dt_bias,
                                float* g, float* beta, cudaStream_t stream);

[[nodiscard]] std::size_t delta_gates_backward_workspace_bytes(const GateDims& d);
/// From dg, dbeta (T, H) fp32: da, db (T, H) bf16 at ab_stride, dA_log and ddt_bias (H) fp32; all overwritten.
cudaError_t delta_gates_backward(const GateDims& d, const bf16* a, const bf16* b, const bf16* a_log, const bf16* dt_bias,
                                 const float* dg, const float* dbeta, bf16* da, bf16* db, float* da_log, float* ddt_bias,
                                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

struct GatedNormDims {
  std::int64_t tokens = 0, heads = 0, dim = 0;  ///< rows = T x heads of `dim` (the value head dim, <= 1024)
  std::int64_t z_stride = 0;                    ///< elements between tokens of z (and of dz): >= heads x dim
  float eps = 1e-6f;
};

/// Qwen3NextRMSNormGated: y = w x rstd silu(z), rstd = 1 / sqrt(mean(x^2) + eps), per row of `dim`.
/// x, y: (T, heads, dim) contiguous; z: (T, heads, dim) at z_stride; w: (dim); rstd (T x heads) fp32,
/// kept for the backward.
cudaError_t gated_rmsnorm_forward(const GatedNormDims& d, const bf16* x, const bf16* z, const bf16* w, bf16* y, float* rstd,
                                  cudaStream_t stream);

[[nodiscard]] std::size_t gated_rmsnorm_backward_workspace_bytes(const GatedNormDims& d);
/// From dy: dx (contiguous), dz (at z_stride), dw (dim) fp32; all overwritten.
cudaError_t gated_rmsnorm_backward(const GatedNormDims& d, const bf16* x, const bf16* z, const bf16* w, const float* rstd,
                                   const bf16* dy, bf16* dx, bf16* dz, float* dw, void* workspace, std::size_t workspace_bytes,
                                   cudaStream_t stream);

/// Qwen3-Next's fused projections, per key head g (r = v_heads / k_heads value heads each):
/// in_proj_qkvz's output holds [q_g (dk) | k_g (dk) | v of its r heads | z of its r heads] and
/// in_proj_ba's [b (r) | a (r)] (transformers' fix_query_key_value_ordering). This moves them to
/// [q | k | v | z] (T, 2 kw + 2 vw) and [b | a] (T, 2 v_heads), as Qwen3.5's separate projections
/// give them; `inverse` moves gradients back. Every element is moved once: src and dst must differ.
struct FusedProjectionDims {
  std::int64_t tokens = 0, k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
};
cudaError_t deltanet_unfuse_projections(const FusedProjectionDims& d, const bf16* qkvz_src, const bf16* ba_src, bf16* qkvz_dst,
                                        bf16* ba_dst, bool inverse, cudaStream_t stream);

}  // namespace oom::kernels
