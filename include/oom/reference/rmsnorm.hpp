// CPU reference of RMSNorm (oom/kernels/rmsnorm.hpp), row-wise over (R, D), fp64 accumulation of
// the row statistics and of the weight gradient. `Real` is float for comparisons with the kernels
// and double for the finite-difference checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

/// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) per row (rounded to Real once).
template <class Real>
void rmsnorm_forward(std::span<const Real> x,       // (R, D)
                     std::span<const Real> weight,  // (D)
                     std::span<Real> y,             // (R, D)
                     std::span<Real> rstd,          // (R)
                     std::int64_t rows, std::int64_t dim, Real eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const Real* xr = x.data() + r * dim;
    double ss = 0.0;
    for (std::int64_t c = 0; c < dim; ++c) ss += static_cast<double>(xr[c]) * static_cast<double>(xr[c]);
    const Real rs = static_cast<Real>(1.0 / std::sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps)));
    rstd[r] = rs;
    for (std::int64_t c = 0; c < dim; ++c) y[r * dim + c] = (xr[c] * rs) * weight[c];
  }
}

/// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)), xhat = x*rstd; grad_weight += sum_rows dy*xhat.
/// `rstd` is the forward's.
template <class Real>
void rmsnorm_backward(std::span<const Real> grad_y,  // (R, D)
                      std::span<const Real> x,       // (R, D)
                      std::span<const Real> weight,  // (D)
                      std::span<const Real> rstd,    // (R)
                      std::span<Real> grad_x,        // (R, D)
                      std::span<Real> grad_weight,   // (D), accumulated into
                      std::int64_t rows, std::int64_t dim) {
  std::vector<double> gw(static_cast<std::size_t>(dim), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    const Real rs = rstd[r];
    const Real* xr = x.data() + r * dim;
    const Real* gr = grad_y.data() + r * dim;
    double dot = 0.0;
    for (std::int64_t c = 0; c < dim; ++c) {
      const Real xhat = xr[c] * rs;
      dot += static_cast<double>(gr[c] * weight[c]) * static_cast<double>(xhat);
      gw[c] += static_cast<double>(gr[c]) * static_cast<double>(xhat);
    }
    const Real mean_dot = static_cast<Real>(dot / static_cast<double>(dim));
    for (std::int64_t c = 0; c < dim; ++c) {
      grad_x[r * dim + c] = rs * (gr[c] * weight[c] - (xr[c] * rs) * mean_dot);
    }
  }
  for (std::int64_t c = 0; c < dim; ++c) grad_weight[c] += static_cast<Real>(gw[c]);
}

}  // namespace oom::reference
