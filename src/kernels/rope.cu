// RoPE kernels: one block per token computes that token's cos/sin once into shared memory (shared
// by all heads), then rotates every head's pairs (j, j + rotary_dim/2). Forward and backward are
// one kernel: the backward rotates by -angle. Contract in include/oom/kernels/rope.hpp.
#include "bf16_device.cuh"
#include "oom/kernels/rope.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::store_bf16;

constexpr int threads = 128;

template <int N>
__device__ void rotate_token(const std::uint16_t* x, std::uint16_t* y, const float* cos_s, const float* sin_s,
                             std::int64_t heads, std::int64_t head_dim, std::int64_t half) {
  const std::int64_t per_head = half / N;
  for (std::int64_t e = threadIdx.x; e < heads * per_head; e += threads) {
    const std::int64_t h = e / per_head;
    const std::int64_t j = (e % per_head) * N;
    const std::uint16_t* xh = x + h * head_dim;
    float a[N], b[N], ya[N], yb[N];
    load_bf16<N>(xh + j, a);
    load_bf16<N>(xh + j + half, b);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float c = cos_s[j + k];
      const float s = sin_s[j + k];
      ya[k] = a[k] * c - b[k] * s;  // rotate_half(x)[j] = -x[j + half]
      yb[k] = b[k] * c + a[k] * s;  // rotate_half(x)[j + half] = x[j]
    }
    std::uint16_t* yh = y + h * head_dim;
    store_bf16<N>(yh + j, ya);
    store_bf16<N>(yh + j + half, yb);
  }
  // Dimensions past rotary_dim pass through (partial rotary); nothing to do in place.
  if (x == y) return;
  const std::int64_t pass = head_dim - 2 * half;
  const std::int64_t pass_chunks = pass / N;
  for (std::int64_t e = threadIdx.x; e < heads * pass_chunks; e += threads) {
    const std::int64_t h = e / pass_chunks;
    const std::int64_t j = 2 * half + (e % pass_chunks) * N;
    float v[N];
    load_bf16<N>(x + h * head_dim + j, v);
    store_bf16<N>(y + h * head_dim + j, v);  // bf16 -> fp32 -> bf16 is exact
  }
}

__global__ void rope_tokens(const std::uint16_t* x, const std::int32_t* positions, std::uint16_t* y,
                            std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, double theta,
                            float sin_sign, bool vec) {
  __shared__ float cos_s[rope_max_head_dim / 2];
  __shared__ float sin_s[rope_max_head_dim / 2];
  const std::int64_t t = blockIdx.x;
  const std::int64_t half = rotary_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  for (std::int64_t j = threadIdx.x; j < half; j += threads) {
    // fp64 pow rounded once to fp32, as the reference does; then one IEEE fp32 multiply, so the
    // angle has the same bits on the host and the device.
    const float inv_freq = static_cast<float>(1.0 / pow(theta, static_cast<double>(2 * j) / static_cast<double>(rotary_dim)));
    const float angle = __fmul_rn(pos, inv_freq);
    float s, c;
    sincosf(angle, &s, &c);
    cos_s[j] = c;
    sin_s[j] = sin_sign * s;
  }
  __syncthreads();
  const std::int64_t off = t * heads * head_dim;
  if (vec) {
    rotate_token<8>(x + off, y + off, cos_s, sin_s, heads, head_dim, half);
  } else {
    rotate_token<1>(x + off, y + off, cos_s, sin_s, heads, head_dim, half);
  }
}

cudaError_t launch(const bf16* x, const std::int32_t* positions, bf16* y, std::int64_t tokens, std::int64_t heads,
                   std::int64_t head_dim, std::int64_t rotary_dim, float theta, float sin_sign, cudaStream_t stream) {
  const bool forward = sin_sign > 0.0f;
  const char* name = forward ? "rope_forward" : "rope_backward";
  if (tokens < 0 || tokens > 0x7fffffff) return detail::refuse(name, ": tokens = ", tokens, " (must be 0 .. 2^31 - 1)");
  if (heads < 1) return detail::refuse(name, ": heads = ", heads, " (must be >= 1)");
  if (head_dim < 2 || head_dim > rope_max_head_dim)
    return detail::refuse(name, ": head_dim = ", head_dim, " (must be 2 .. ", rope_max_head_dim, ")");
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    return detail::refuse(name, ": rotary_dim = ", rotary_dim, " (must be even, 2 .. head_dim = ", head_dim, ")");
  if (!(theta > 0.0f)) return detail::refuse(name, ": theta = ", theta, " (must be > 0)");
  if (tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{forward ? "x" : "grad_y", x},
                                                       {"positions", positions},
                                                       {forward ? "y" : "grad_x", y}});
      e != cudaSuccess)
    return e;
  // Vector path: pairs of 8-element chunks, and a pass-through that is whole chunks too.
  const bool vec = (rotary_dim / 2) % 8 == 0 && head_dim % 8 == 0 && aligned_16(x, y);
  rope_tokens<<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
      reinterpret_cast<const std::uint16_t*>(x), positions, reinterpret_cast<std::uint16_t*>(y), heads, head_dim,
      rotary_dim, static_cast<double>(theta), sin_sign, vec);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_forward(const bf16* x, const std::int32_t* positions, bf16* y, std::int64_t tokens,
                         std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, float theta,
                         cudaStream_t stream) {
  return launch(x, positions, y, tokens, heads, head_dim, rotary_dim, theta, 1.0f, stream);
}

cudaError_t rope_backward(const bf16* grad_y, const std::int32_t* positions, bf16* grad_x, std::int64_t tokens,
                          std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, float theta,
                          cudaStream_t stream) {
  return launch(grad_y, positions, grad_x, tokens, heads, head_dim, rotary_dim, theta, -1.0f, stream);
}

}  // namespace oom::kernels
