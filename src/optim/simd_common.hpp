// The 8-wide (AVX2+FMA) building blocks and the scalar tail shared by the AVX2 and AVX-512 kernel
// TUs. Include only from TUs built with at least -mavx2 -mfma. Everything here has internal
// linkage (anonymous namespace), so no ISA-specific copy can leak into another TU.
#pragma once

#include <immintrin.h>

#include "kernels.hpp"

namespace oom::optim::kernels {
namespace {

// Scalar tail: adamw_element and to_bf16 restated with builtins (no <cmath> inline copies in a TU
// built with ISA flags; see kernels.hpp).
float tail_element(const Scalars& s, float& p, float& m, float& v, float grad) {
  const float g = grad * s.grad_scale;
  const float decayed = p * s.decay;
  m = __builtin_fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = __builtin_fmaf(s.beta2, v, (s.one_minus_beta2 * g) * g);
  const float denom = __builtin_sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p = __builtin_fmaf(s.neg_step_size, m / denom, decayed);
  return p;
}
std::uint16_t tail_bf16(float f) {
  std::uint32_t u = 0;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float tail_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f = 0;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

struct Vec8 {
  __m256 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  explicit Vec8(const Scalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)), decay(_mm256_set1_ps(s.decay)),
        beta1(_mm256_set1_ps(s.beta1)), one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)),
        beta2(_mm256_set1_ps(s.beta2)), one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        bc2_sqrt(_mm256_set1_ps(s.bias_correction2_sqrt)), eps(_mm256_set1_ps(s.eps)),
        neg_step(_mm256_set1_ps(s.neg_step_size)) {}
};

inline void step8(const Vec8& k, __m256& p, __m256& m, __m256& v, __m256 grad) {
  const __m256 g = _mm256_mul_ps(grad, k.grad_scale);
  const __m256 decayed = _mm256_mul_ps(p, k.decay);
  m = _mm256_fmadd_ps(k.beta1, m, _mm256_mul_ps(k.one_minus_beta1, g));
  v = _mm256_fmadd_ps(k.beta2, v, _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bc2_sqrt), k.eps);
  p = _mm256_fmadd_ps(k.neg_step, _mm256_div_ps(m, denom), decayed);
}

// to_bf16 on 8 lanes: round to nearest even by integer add, quiet NaNs as to_bf16 does. Not
// VCVTNEPS2BF16: it flushes subnormal inputs to zero, and to_bf16 does not.
inline __m128i to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  // |u| as int32 is non-negative, so the signed compare is the unsigned one here.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m256 from_bf16_8(const std::uint16_t* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// One 8-element block at index i (the AVX2 kernel's body, the AVX-512 kernel's narrower step).
inline void block8(const Vec8& k, const Fp32Moments& r, std::size_t i) {
  __m256 p = _mm256_loadu_ps(r.p + i);
  __m256 m = _mm256_loadu_ps(r.m + i);
  __m256 v = _mm256_loadu_ps(r.v + i);
  step8(k, p, m, v, _mm256_loadu_ps(r.g + i));
  _mm256_storeu_ps(r.p + i, p);
  _mm256_storeu_ps(r.m + i, m);
  _mm256_storeu_ps(r.v + i, v);
  if (r.out != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(r.out + i), to_bf16_8(p));
}
inline void block8(const Vec8& k, const Bf16Moments& r, std::size_t i) {
  __m256 p = _mm256_loadu_ps(r.p + i);
  __m256 m = from_bf16_8(r.m + i);
  __m256 v = from_bf16_8(r.v + i);
  step8(k, p, m, v, _mm256_loadu_ps(r.g + i));
  _mm256_storeu_ps(r.p + i, p);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(r.m + i), to_bf16_8(m));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(r.v + i), to_bf16_8(v));
  if (r.out != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(r.out + i), to_bf16_8(p));
}

// One element at index i, for the tails.
inline void element1(const Scalars& s, const Fp32Moments& r, std::size_t i) {
  const float p = tail_element(s, r.p[i], r.m[i], r.v[i], r.g[i]);
  if (r.out != nullptr) r.out[i] = tail_bf16(p);
}
inline void element1(const Scalars& s, const Bf16Moments& r, std::size_t i) {
  float m = tail_float(r.m[i]);
  float v = tail_float(r.v[i]);
  const float p = tail_element(s, r.p[i], m, v, r.g[i]);
  r.m[i] = tail_bf16(m);
  r.v[i] = tail_bf16(v);
  if (r.out != nullptr) r.out[i] = tail_bf16(p);
}

}  // namespace

}  // namespace oom::optim::kernels
