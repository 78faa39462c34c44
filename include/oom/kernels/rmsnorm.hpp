// RMSNorm on the GPU (Qwen3 / Llama): y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per
// row, bf16 in and out, fp32 statistics and fp32 weight gradient. The same launchers serve the
// hidden-state norms (rows = T, D = hidden) and Qwen3's per-head q/k norms (a contiguous
// (T, heads, head_dim) tensor is rows = T * heads of D = head_dim sharing one weight).
// Kernels in src/kernels/rmsnorm.cu, CPU reference in oom/reference/rmsnorm.hpp.
//
// Unlike HF (which rounds x * rstd to bf16 before multiplying by the weight) the product is
// rounded once, at the output.
//
// weight_offset: the norm applies weight + weight_offset, added in fp32 (Qwen3-Next's and
// Qwen3.5's (1 + w) norms: offset 1, ModelSpec::norm_weight_offset; rounding 1 + w to bf16 would
// lose every w below 2^-8). 0, the default, leaves every bit as it was. grad_weight is the same
// either way (the offset is a constant).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

/// A row is read once and kept in registers (8 lanes per row up to 128 wide, a warp up to 8192;
/// wider or unaligned rows loop over the row twice). rstd may be null when the backward will not
/// run (inference).
cudaError_t rmsnorm_forward(const bf16* x,       // (R, D) bf16
                            const bf16* weight,  // (D) bf16
                            bf16* y,             // (R, D) bf16
                            float* rstd,         // (R) fp32, saved for the backward, or null
                            std::int64_t rows, std::int64_t dim, float eps, cudaStream_t stream,
                            float weight_offset = 0.0f);

/// Rows summed into one partial weight gradient: a function of the row count only (not of the
/// device), so the reduction order, and the bits of grad_weight, depend only on the shape and on
/// the path taken. The register path (16-byte aligned rows up to 4096 wide, the width a multiple
/// of 8) gives the looped path's bits at 129-2048 columns; up to 128 it sums the rows in other
/// slices, and at 2049-4096 dx differs too (a row's dot product is two warps' sums added). At most
/// 512 partials, at least 16 rows each (one partial is one block of the backward: 4096 rows make
/// 256 blocks, two per H200 SM). 512 rather than 1024 (until 2026-12-01): at 65536 rows, 128 rows a
/// partial ran the 4096-wide backward at 72% of the copy bandwidth against 70% with 64 and the
/// 128-wide q-norm rows at 58% against 52% (H200, scripts/diag/rmsnorm_partials.cu), and the
/// workspace halves.
inline constexpr std::int64_t rmsnorm_rows_per_partial(std::int64_t rows) {
  const std::int64_t spread = (rows + 511) / 512;
  return spread > 16 ? spread : 16;
}

/// Scratch bytes rmsnorm_backward needs: the fp32 partial weight gradients, (partials, D).
std::size_t rmsnorm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim);

/// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)) with xhat = x*rstd; grad_weight += sum over rows
/// of dy*xhat, reduced in a fixed order (rows within a chunk, then chunks in order). grad_x may
/// equal grad_y or x (in place): every element of dy and x is read before the same element of dx
/// is written, by the same thread (rows up to 4096 wide with 16-byte aligned arrays: one pass that
/// also accumulates the weight gradient), or the weight-gradient pass runs before the dx pass.
/// grad_weight must not overlap grad_x, grad_y, x or the workspace: on sm_90+ its old value is
/// loaded while the first kernel may still be writing grad_x and the workspace.
cudaError_t rmsnorm_backward(const bf16* grad_y,   // (R, D) bf16
                             const bf16* x,        // (R, D) bf16, the forward's input
                             const bf16* weight,   // (D) bf16
                             const float* rstd,    // (R) fp32, from the forward
                             bf16* grad_x,         // (R, D) bf16
                             float* grad_weight,   // (D) fp32, accumulated into
                             std::int64_t rows, std::int64_t dim, void* workspace, std::size_t workspace_bytes,
                             cudaStream_t stream, float weight_offset = 0.0f);

}  // namespace oom::kernels
