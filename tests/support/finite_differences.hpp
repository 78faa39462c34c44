// Test support: a backward checked against central finite differences of its forward, the loss
// evaluated in double from fp32 inputs.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <functional>
#include <string>
#include <span>
#include <vector>

#include "support/compare.hpp"

namespace oom::test {

inline double dot(std::span<const float> a, std::span<const float> b) {
  double acc = 0;
  for (std::size_t i = 0; i < a.size(); ++i) acc += static_cast<double>(a[i]) * b[i];
  return acc;
}

/// Central differences of `loss` with respect to every element of `v` (perturbed in place and
/// restored), compared with `grad`. The step divides by the actually representable perturbation.
/// Tolerance: fp32 forward values (~1e-7 relative) over a 2e-3 step, plus O(eps^2) curvature.
inline void check_fd(std::vector<float>& v, std::span<const float> grad, const std::function<double()>& loss, const char* what,
                     float eps = 1e-3f, double rtol = 2e-3, double atol = 2e-4) {
  REQUIRE(grad.size() == v.size());
  std::vector<double> fd(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float x0 = v[i];
    const float xp = x0 + eps, xm = x0 - eps;
    v[i] = xp;
    const double lp = loss();
    v[i] = xm;
    const double lm = loss();
    v[i] = x0;
    fd[i] = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
  }
  const auto r = oom::test::compare(grad, std::span<const double>(fd), rtol, atol, what);
  INFO(std::string(what) << ": max abs err " << r.max_abs_err << "\n" << r.first);
  CHECK(r.ok());
}

}  // namespace oom::test
