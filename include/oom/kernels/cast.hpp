// Precision casts and gradient accumulation on the GPU. fp32 -> bf16 rounds to nearest even with
// exactly oom::to_bf16's bits (NaN included); bf16 -> fp32 is exact; the scaled accumulate is
// acc = fma(scale, grad, acc), one rounding, i.e. std::fma(scale, grad, acc) on the host, for
// summing micro-batch gradients (scale = 1/micro_batches or a loss-scale inverse) in fp32; the bf16
// add is the residual connection (fp32 sum, rounded once); a row repeated and a fill lay out
// biases and the ones their gradients are summed with (Qwen2-MoE's q/k/v biases).
// Kernels in src/kernels/cast.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

cudaError_t cast_fp32_to_bf16(const float* in,  // (n) fp32
                              bf16* out,        // (n) bf16
                              std::int64_t n, cudaStream_t stream);

cudaError_t cast_bf16_to_fp32(const bf16* in,  // (n) bf16
                              float* out,      // (n) fp32
                              std::int64_t n, cudaStream_t stream);

/// acc[i] = fma(scale, float(grad[i]), acc[i]).
cudaError_t accumulate_scaled(float* acc,        // (n) fp32, accumulated into
                              const bf16* grad,  // (n) bf16
                              float scale, std::int64_t n, cudaStream_t stream);
cudaError_t accumulate_scaled(float* acc,         // (n) fp32, accumulated into
                              const float* grad,  // (n) fp32
                              float scale, std::int64_t n, cudaStream_t stream);

/// out[i] = bf16(float(a[i]) + float(b[i])): one rounding (residual connections). out may equal a
/// or b (in place).
cudaError_t add_bf16(const bf16* a,  // (n) bf16
                     const bf16* b,  // (n) bf16
                     bf16* out,      // (n) bf16
                     std::int64_t n, cudaStream_t stream);

/// out[r * width + c] = row[c] for r in [0, rows): a bias repeated under each token's row, for a
/// GEMM to add its product onto (beta = 1: bias and product summed in fp32, rounded once).
/// out must not overlap row.
cudaError_t repeat_row_bf16(const bf16* row,  // (width) bf16
                            std::int64_t width,
                            bf16* out,        // (rows, width) bf16
                            std::int64_t rows, cudaStream_t stream);

/// out[i] = value rounded to bf16 (oom::to_bf16), for i in [0, n).
cudaError_t fill_bf16(bf16* out, std::int64_t n, float value, cudaStream_t stream);

}  // namespace oom::kernels
