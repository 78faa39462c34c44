// Scalar AdamW and sum-of-squares kernels: the portable fallback, built with the baseline flags.
// They call the public reference math (adamw_element, to_bf16) so the documented formula and
// this kernel cannot drift apart; the vector kernels reproduce it lane by lane.
#include <cstring>

#include "kernels.hpp"
#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"

namespace oom::optim::kernels {
namespace {

AdamWStepScalars to_step(const Scalars& s) {
  return {s.grad_scale, s.decay, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
          s.bias_correction2_sqrt, s.eps, s.neg_step_size};
}

}  // namespace

void adamw_scalar(const Scalars& s, const Fp32Moments& r) {
  const AdamWStepScalars step = to_step(s);
  for (std::size_t i = 0; i < r.n; ++i) {
    float p = r.p[i];
    float m = r.m[i];
    float v = r.v[i];
    adamw_element(step, p, m, v, r.g[i]);
    r.p[i] = p;
    r.m[i] = m;
    r.v[i] = v;
    if (r.out != nullptr) r.out[i] = to_bf16(p).bits;
  }
}

void adamw_scalar(const Scalars& s, const Bf16Moments& r) {
  const AdamWStepScalars step = to_step(s);
  for (std::size_t i = 0; i < r.n; ++i) {
    float p = r.p[i];
    float m = to_float(bf16{r.m[i]});
    float v = to_float(bf16{r.v[i]});
    adamw_element(step, p, m, v, r.g[i]);
    r.p[i] = p;
    r.m[i] = to_bf16(m).bits;
    r.v[i] = to_bf16(v).bits;
    if (r.out != nullptr) r.out[i] = to_bf16(p).bits;
  }
}

double sum_of_squares_scalar(const float* g, std::size_t n) {
  double lane[16] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const double x = g[i];
    lane[i % 16] += x * x;  // exact square; only the addition rounds
  }
  OOM_OPTIM_COMBINE_16_LANES(lane);
  return lane[0];
}

}  // namespace oom::optim::kernels
