// Precision casts and gradient accumulation on the GPU. fp32 -> bf16 rounds to nearest even with
// exactly oom::to_bf16's bits (NaN included); bf16 -> fp32 is exact; the scaled accumulate is
// acc = fma(scale, grad, acc), one rounding, i.e. std::fma(scale, grad, acc) on the host, for
// summing micro-batch gradients (scale = 1/micro_batches or a loss-scale inverse) in fp32; the bf16
// add is the residual connection (fp32 sum, rounded once).
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

}  // namespace oom::kernels
