// Device helpers shared by the elementwise and row kernels (embedding, rmsnorm, rope, swiglu,
// cast, adamw_gpu): bf16 <-> fp32 by bit manipulation, 16-byte vector loads and stores, warp sums.
// bf16 is handled as its raw 16 bits, so a kernel's rounding is exactly oom::to_bf16 (round to
// nearest even, NaN kept quiet with its sign and upper payload) on every architecture: the
// hardware's cvt.rn where it exists, its canonical NaN replaced.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace oom::kernels::detail {

__device__ __forceinline__ float bf16_to_float(std::uint16_t b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }

/// oom::to_bf16's bits for a NaN: quiet, with its sign and the top of its payload.
__device__ __forceinline__ unsigned quiet_nan_bf16(float f) { return (__float_as_uint(f) >> 16) | 0x40u; }

/// Same bits as oom::to_bf16 (include/oom/core/numeric.hpp). From sm_80 the hardware's
/// round-to-nearest-even cvt (the same bits for every value but NaN, which it makes canonical)
/// with NaNs patched; before, the rounding by integer arithmetic.
__device__ __forceinline__ std::uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return f != f ? static_cast<std::uint16_t>(quiet_nan_bf16(f)) : h;
#else
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>(quiet_nan_bf16(f));
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
#endif
}

/// Two values as bf16x2, `lo` in the low half: float_to_bf16 of each, one cvt for both from sm_80.
__device__ __forceinline__ unsigned float2_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));  // the first source is the high half
  if (lo != lo) w = (w & 0xffff0000u) | quiet_nan_bf16(lo);
  if (hi != hi) w = (w & 0x0000ffffu) | (quiet_nan_bf16(hi) << 16);
  return w;
#else
  return static_cast<unsigned>(float_to_bf16(lo)) | (static_cast<unsigned>(float_to_bf16(hi)) << 16);
#endif
}

/// Eight bf16 values held in a 16-byte register quad, widened to fp32 / rounded back.
__device__ __forceinline__ void unpack_bf16(const uint4& r, float (&f)[8]) {
  const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack_bf16(const float (&f)[8]) {
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = float2_to_bf16x2(f[2 * k], f[2 * k + 1]);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// N consecutive bf16 values widened to fp32. N == 8 is one 16-byte load (p 16-byte aligned).
template <int N>
__device__ __forceinline__ void load_bf16(const std::uint16_t* p, float (&f)[N]) {
  if constexpr (N == 8) {
    unpack_bf16(*reinterpret_cast<const uint4*>(p), f);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = bf16_to_float(p[k]);
  }
}

/// N fp32 values rounded to bf16 and stored. N == 8 is one 16-byte store (p 16-byte aligned).
template <int N>
__device__ __forceinline__ void store_bf16(std::uint16_t* p, const float (&f)[N]) {
  if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(p) = pack_bf16(f);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = float_to_bf16(f[k]);
  }
}

/// N consecutive fp32 values; N == 8 is two 16-byte loads (p 16-byte aligned).
template <int N>
__device__ __forceinline__ void load_f32(const float* p, float (&f)[N]) {
  if constexpr (N == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = p[k];
  }
}

template <int N>
__device__ __forceinline__ void store_f32(float* p, const float (&f)[N]) {
  if constexpr (N == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = f[k];
  }
}

/// 1 / (1 + exp(-x)) in fp32 (expf, not __expf: within ~2 ulp of the references' std::exp, far
/// below a bf16 rounding), shared by the gates, SwiGLU, the SiLUs and the attention output gate.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/// Butterfly sum over a full warp; every lane gets the same result (same order on every lane).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace oom::kernels::detail

namespace oom::kernels {

/// Host side: whether every pointer is 16-byte aligned (the vector paths need it).
template <class... P>
inline bool aligned_16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

/// Blocks for `items` work items of `per_block` each; 0 when the grid would exceed CUDA's limit.
inline unsigned grid_for(std::int64_t items, std::int64_t per_block) {
  const std::int64_t blocks = (items + per_block - 1) / per_block;
  return blocks > 0x7fffffff ? 0u : static_cast<unsigned>(blocks);
}

}  // namespace oom::kernels
