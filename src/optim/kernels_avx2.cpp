// AVX2+FMA AdamW and sum-of-squares kernels (built with -mavx2 -mfma; only called after
// cpu_supports(CpuIsa::avx2)). 8 floats per vector, then a scalar tail; every operation is the
// one adamw_element performs, in the same order, so results match the scalar kernel bit for bit.
#include "simd_common.hpp"

namespace oom::optim::kernels {
namespace {

template <class Range>
void adamw_range(const Scalars& s, const Range& r) {
  const Vec8 k(s);
  std::size_t i = 0;
  for (; i + 8 <= r.n; i += 8) block8(k, r, i);
  for (; i < r.n; ++i) element1(s, r, i);
}

}  // namespace

void adamw_avx2(const Scalars& s, const Fp32Moments& r) { adamw_range(s, r); }
void adamw_avx2(const Scalars& s, const Bf16Moments& r) { adamw_range(s, r); }

double sum_of_squares_avx2(const float* g, std::size_t n) {
  // Four registers of 4 doubles are lanes 0-3, 4-7, 8-11, 12-15. Squares are exact in double, so
  // fused or not, each lane adds exactly the value the scalar kernel adds.
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int q = 0; q < 4; ++q) {
      const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * q));
      acc[q] = _mm256_add_pd(acc[q], _mm256_mul_pd(x, x));
    }
  }
  double lane[16];
  for (int q = 0; q < 4; ++q) _mm256_storeu_pd(lane + 4 * q, acc[q]);
  for (; i < n; ++i) {
    const double x = g[i];
    lane[i % 16] += x * x;
  }
  OOM_OPTIM_COMBINE_16_LANES(lane);
  return lane[0];
}

}  // namespace oom::optim::kernels
