// CPU reference of RoPE (oom/kernels/rope.hpp): HF rotate-half convention, full or partial
// rotary, per-token positions. The angle is computed exactly as the kernel does (fp64 pow rounded
// to fp32, one fp32 multiply), so host and device rotate by the same fp32 angle; cos and sin are
// then taken in Real. `Real` is float for comparisons with the kernels and double for the
// finite-difference checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

namespace oom::reference {

/// inv_freq[j] = 1 / theta^(2j / rotary_dim), in fp64 rounded to fp32 once.
inline float rope_inv_freq(float theta, std::int64_t rotary_dim, std::int64_t j) {
  return static_cast<float>(1.0 / std::pow(static_cast<double>(theta),
                                           static_cast<double>(2 * j) / static_cast<double>(rotary_dim)));
}

/// The fp32 angle of pair j at `position` (one IEEE fp32 multiply, as HF's fp32 freqs).
inline float rope_angle(std::int32_t position, float theta, std::int64_t rotary_dim, std::int64_t j) {
  return static_cast<float>(position) * rope_inv_freq(theta, rotary_dim, j);
}

/// Rotates each head's pairs (j, j + rotary_dim/2) by +angle (forward) or -angle (backward =
/// transpose, since the rotation is orthogonal); dimensions past rotary_dim are copied.
template <class Real>
void rope_rotate(std::span<const Real> x,                 // (T, heads, head_dim)
                 std::span<const std::int32_t> positions,  // (T)
                 std::span<Real> y,                       // (T, heads, head_dim)
                 std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, float theta, bool inverse) {
  const std::int64_t half = rotary_dim / 2;
  for (std::size_t t = 0; t < positions.size(); ++t) {
    for (std::int64_t j = 0; j < half; ++j) {
      const Real angle = static_cast<Real>(rope_angle(positions[t], theta, rotary_dim, j));
      const Real c = std::cos(angle);
      const Real s = inverse ? -std::sin(angle) : std::sin(angle);
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::size_t base = (t * heads + h) * head_dim;
        const Real a = x[base + j];
        const Real b = x[base + j + half];
        y[base + j] = a * c - b * s;
        y[base + j + half] = b * c + a * s;
      }
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::size_t base = (t * heads + h) * head_dim;
      for (std::int64_t d = rotary_dim; d < head_dim; ++d) y[base + d] = x[base + d];
    }
  }
}

template <class Real>
void rope_forward(std::span<const Real> x, std::span<const std::int32_t> positions, std::span<Real> y,
                  std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, float theta) {
  rope_rotate(x, positions, y, heads, head_dim, rotary_dim, theta, false);
}

template <class Real>
void rope_backward(std::span<const Real> grad_y, std::span<const std::int32_t> positions, std::span<Real> grad_x,
                   std::int64_t heads, std::int64_t head_dim, std::int64_t rotary_dim, float theta) {
  rope_rotate(grad_y, positions, grad_x, heads, head_dim, rotary_dim, theta, true);
}

}  // namespace oom::reference
