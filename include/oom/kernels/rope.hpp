// Rotary position embedding on the GPU, HF Qwen3/Llama convention (rotate half):
//   y[:r] = x[:r] * cos + rotate_half(x[:r]) * sin,  y[r:] = x[r:]   (r = rotary_dim <= head_dim)
// with rotate_half(a) = cat(-a[r/2:], a[:r/2]) and, for pair j < r/2,
//   inv_freq[j] = 1 / theta^(2j / r)   (in fp64, rounded to fp32 once)
//   angle       = float(position) * inv_freq[j]  (one fp32 multiply, as HF's fp32 matmul)
//   cos, sin    = of that fp32 angle, in fp32 (sincosf, full range reduction: no fast math)
// computed in the kernel per token: no table to keep in sync with positions, and positions are
// given per token so packed/chunked sequences (positions restarting or offset) just work.
// Kernels in src/kernels/rope.cu, CPU reference in oom/reference/rope.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

/// Largest head_dim the kernels take (cos/sin of one token live in shared memory).
inline constexpr std::int64_t rope_max_head_dim = 1024;

/// y = rope(x). y may equal x (in place). rotary_dim must be even, 2 <= rotary_dim <= head_dim
/// <= rope_max_head_dim, theta > 0; otherwise cudaErrorInvalidValue.
cudaError_t rope_forward(const bf16* x,                 // (T, heads, head_dim) bf16
                         const std::int32_t* positions,  // (T) int32
                         bf16* y,                       // (T, heads, head_dim) bf16
                         std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim,
                         float theta, cudaStream_t stream);

/// grad_x = rope^T(grad_y): the rotation by -angle (rope is orthogonal). grad_x may equal grad_y.
cudaError_t rope_backward(const bf16* grad_y,            // (T, heads, head_dim) bf16
                          const std::int32_t* positions,  // (T) int32
                          bf16* grad_x,                  // (T, heads, head_dim) bf16
                          std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim,
                          float theta, cudaStream_t stream);

}  // namespace oom::kernels
