// AVX-512 AdamW and sum-of-squares kernels (built with -mavx512f -mavx2 -mfma; only called after
// cpu_supports(CpuIsa::avx512)). Span cascade: 16 floats per vector, then one 8-wide AVX2 block,
// then a scalar tail; all three perform adamw_element's operations in its order.
#include "simd_common.hpp"

namespace oom::optim::kernels {
namespace {

struct Vec16 {
  __m512 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  explicit Vec16(const Scalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)), decay(_mm512_set1_ps(s.decay)),
        beta1(_mm512_set1_ps(s.beta1)), one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)),
        beta2(_mm512_set1_ps(s.beta2)), one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        bc2_sqrt(_mm512_set1_ps(s.bias_correction2_sqrt)), eps(_mm512_set1_ps(s.eps)),
        neg_step(_mm512_set1_ps(s.neg_step_size)) {}
};

inline void step16(const Vec16& k, __m512& p, __m512& m, __m512& v, __m512 grad) {
  const __m512 g = _mm512_mul_ps(grad, k.grad_scale);
  const __m512 decayed = _mm512_mul_ps(p, k.decay);
  m = _mm512_fmadd_ps(k.beta1, m, _mm512_mul_ps(k.one_minus_beta1, g));
  v = _mm512_fmadd_ps(k.beta2, v, _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.bc2_sqrt), k.eps);
  p = _mm512_fmadd_ps(k.neg_step, _mm512_div_ps(m, denom), decayed);
}

// to_bf16 on 16 lanes, as to_bf16_8 (integer round-to-nearest-even, NaN quieted; not
// VCVTNEPS2BF16, which flushes subnormals).
inline __m256i to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}
inline __m512 from_bf16_16(const std::uint16_t* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store_bf16_16(std::uint16_t* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16_16(x));
}

inline void block16(const Vec16& k, const Fp32Moments& r, std::size_t i) {
  __m512 p = _mm512_loadu_ps(r.p + i);
  __m512 m = _mm512_loadu_ps(r.m + i);
  __m512 v = _mm512_loadu_ps(r.v + i);
  step16(k, p, m, v, _mm512_loadu_ps(r.g + i));
  _mm512_storeu_ps(r.p + i, p);
  _mm512_storeu_ps(r.m + i, m);
  _mm512_storeu_ps(r.v + i, v);
  if (r.out != nullptr) store_bf16_16(r.out + i, p);
}
inline void block16(const Vec16& k, const Bf16Moments& r, std::size_t i) {
  __m512 p = _mm512_loadu_ps(r.p + i);
  __m512 m = from_bf16_16(r.m + i);
  __m512 v = from_bf16_16(r.v + i);
  step16(k, p, m, v, _mm512_loadu_ps(r.g + i));
  _mm512_storeu_ps(r.p + i, p);
  store_bf16_16(r.m + i, m);
  store_bf16_16(r.v + i, v);
  if (r.out != nullptr) store_bf16_16(r.out + i, p);
}

template <class Range>
void adamw_range(const Scalars& s, const Range& r) {
  const Vec16 k16(s);
  std::size_t i = 0;
  for (; i + 16 <= r.n; i += 16) block16(k16, r, i);
  if (i + 8 <= r.n) {
    block8(Vec8(s), r, i);
    i += 8;
  }
  for (; i < r.n; ++i) element1(s, r, i);
}

}  // namespace

void adamw_avx512(const Scalars& s, const Fp32Moments& r) { adamw_range(s, r); }
void adamw_avx512(const Scalars& s, const Bf16Moments& r) { adamw_range(s, r); }

double sum_of_squares_avx512(const float* g, std::size_t n) {
  // Two registers of 8 doubles are lanes 0-7 and 8-15 (see sum_of_squares_avx2 on exactness).
  __m512d lo = _mm512_setzero_pd();
  __m512d hi = _mm512_setzero_pd();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512d x0 = _mm512_cvtps_pd(_mm256_loadu_ps(g + i));
    const __m512d x1 = _mm512_cvtps_pd(_mm256_loadu_ps(g + i + 8));
    lo = _mm512_add_pd(lo, _mm512_mul_pd(x0, x0));
    hi = _mm512_add_pd(hi, _mm512_mul_pd(x1, x1));
  }
  double lane[16];
  _mm512_storeu_pd(lane, lo);
  _mm512_storeu_pd(lane + 8, hi);
  for (; i < n; ++i) {
    const double x = g[i];
    lane[i % 16] += x * x;
  }
  OOM_OPTIM_COMBINE_16_LANES(lane);
  return lane[0];
}

}  // namespace oom::optim::kernels
