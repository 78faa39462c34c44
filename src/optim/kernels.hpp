// Private interface between the dispatcher (cpu_adamw.cpp) and the per-ISA kernel translation
// units. Deliberately free of inline functions and standard headers with inline code: an inline
// function emitted by a TU built with -mavx512f could be the copy the linker keeps for every
// caller, and then crash a CPU without AVX-512 (one definition rule across ISA flags).
#pragma once

#include <cstddef>
#include <cstdint>

namespace oom::optim::kernels {

/// AdamWStepScalars, field for field (kept separate so kernel TUs do not include <cmath>).
struct Scalars {
  float grad_scale;
  float decay;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;
};

/// One contiguous range of elements. bf16 values are their raw bits; `out` may be null.
struct Fp32Moments {
  float* p;
  float* m;
  float* v;
  const float* g;
  std::uint16_t* out;
  std::size_t n;
};
struct Bf16Moments {
  float* p;
  std::uint16_t* m;
  std::uint16_t* v;
  const float* g;
  std::uint16_t* out;
  std::size_t n;
};

void adamw_scalar(const Scalars& s, const Fp32Moments& r);
void adamw_scalar(const Scalars& s, const Bf16Moments& r);
void adamw_avx2(const Scalars& s, const Fp32Moments& r);
void adamw_avx2(const Scalars& s, const Bf16Moments& r);
void adamw_avx512(const Scalars& s, const Fp32Moments& r);
void adamw_avx512(const Scalars& s, const Bf16Moments& r);

/// Sum of squares of g[0..n) in the 16-lane order documented at grad_sum_of_squares().
double sum_of_squares_scalar(const float* g, std::size_t n);
double sum_of_squares_avx2(const float* g, std::size_t n);
double sum_of_squares_avx512(const float* g, std::size_t n);

/// The fixed combination of the 16 lanes: pairwise, lane i with lane i+8, then +4, +2, +1.
/// Written out in every TU (as a macro, not an inline function, for the reason above).
#define OOM_OPTIM_COMBINE_16_LANES(lane)                                    \
  do {                                                                      \
    for (int half_ = 8; half_ >= 1; half_ /= 2)                             \
      for (int i_ = 0; i_ < half_; ++i_) (lane)[i_] = (lane)[i_] + (lane)[i_ + half_]; \
  } while (0)

}  // namespace oom::optim::kernels
