// AdamW with decoupled weight decay (torch.optim.AdamW semantics): the configuration, the per-step
// scalars computed once per step, and the exact per-element fp32 math every implementation (scalar,
// AVX2, AVX-512, later the GPU kernel) must reproduce bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>

namespace oom::optim {

/// Hyper-parameters, as torch.optim.AdamW names them (amsgrad and maximize are not supported).
struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  bool bias_correction = true;  ///< divide m by 1-beta1^t and v by 1-beta2^t, as torch always does

  friend bool operator==(const AdamWConfig&, const AdamWConfig&) = default;
};

/// The scalars of one step, rounded to fp32 once (computed in double from the config) so every
/// element and every implementation uses the very same constants.
struct AdamWStepScalars {
  float grad_scale = 1.0f;             ///< g = grad * grad_scale (global-norm clipping, loss unscaling)
  float decay = 1.0f;                  ///< 1 - lr * weight_decay
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.0f;  ///< sqrt(1 - beta2^t), or 1 without bias correction
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;        ///< -lr / (1 - beta1^t), or -lr without bias correction

  friend bool operator==(const AdamWStepScalars&, const AdamWStepScalars&) = default;
};

/// Scalars for step `step` (1-based, as torch counts after its increment) with gradients scaled by
/// `grad_scale`. Throws oom::Error (invalid_argument) naming the offending value when the config
/// or the step is out of range: step < 1, lr < 0, betas outside [0, 1), eps <= 0, weight decay
/// < 0, or a non-finite or negative grad_scale.
AdamWStepScalars adamw_step_scalars(const AdamWConfig& config, std::int64_t step, float grad_scale = 1.0f);

/// The update of one element, in fp32, in this exact order (each line rounds once; `fma` rounds
/// once for the multiply-add):
///
///     g = grad * grad_scale
///     p = p * decay                                  // decoupled weight decay first, as torch
///     m = fma(beta1, m, one_minus_beta1 * g)         // b1*m + (1-b1)*g
///     v = fma(beta2, v, (one_minus_beta2 * g) * g)   // b2*v + (1-b2)*g*g
///     d = sqrt(v) / bias_correction2_sqrt + eps      // torch's denom: sqrt(v)/sqrt(bc2) + eps
///     p = fma(neg_step_size, m / d, p)               // p - lr/bc1 * m / d
///
/// Mathematically this is torch.optim.AdamW; the roundings differ slightly from torch's own kernels
/// (torch updates m with lerp and does not fuse the last multiply-add), so the tests compare with
/// an fp64 evaluation of the formula, not with torch's bits. Division and sqrt are the exact IEEE
/// operations in every implementation (no reciprocal approximations), and no `a*b+c` appears
/// outside an explicit fma, so compiler contraction cannot change the result.
/// With bf16 moments, m and v are widened exactly, updated as above, used unrounded for this
/// step's p, and stored rounded to nearest even (oom::to_bf16).
inline void adamw_element(const AdamWStepScalars& s, float& p, float& m, float& v, float grad) {
  const float g = grad * s.grad_scale;
  const float decayed = p * s.decay;
  m = std::fma(s.beta1, m, s.one_minus_beta1 * g);
  v = std::fma(s.beta2, v, (s.one_minus_beta2 * g) * g);
  const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  p = std::fma(s.neg_step_size, m / denom, decayed);
}

/// Whether no element of `values` is a NaN or an infinity (one pass, no branch per element).
[[nodiscard]] bool all_finite(std::span<const float> values) noexcept;
/// Errc::invalid_argument "non-finite gradient (value) in <what> at element <i>" at the first NaN
/// or infinity of `grads`: the check every CPU update path makes before it applies them.
/// (cpu_adamw.hpp has the same split over a thread pool.)
void require_finite_gradients(std::span<const float> grads, std::string_view what);

/// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)) with norm =
/// sqrt(sum_of_squares), in double then rounded to fp32 to be used as AdamWStepScalars::grad_scale.
/// Throws oom::Error when max_norm <= 0 or sum_of_squares is negative or NaN.
float clip_grad_scale(double sum_of_squares, double max_norm);

}  // namespace oom::optim
