// Test support: comparing computed arrays with references under a tolerance justified by dtype,
// reporting the first mismatches (index, got, expected) like llm.c's checks.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace oom::test {

struct CompareReport {
  std::size_t checked = 0;
  std::size_t mismatches = 0;
  std::size_t non_finite = 0;  ///< NaN/Inf where the reference is finite (e.g. unwritten poisoned output)
  double max_abs_err = 0;
  double max_rel_err = 0;  ///< over elements with |expected| > atol
  std::string first;       ///< the first few mismatches, one per line
  [[nodiscard]] bool ok() const { return mismatches == 0 && non_finite == 0; }
};

/// |got - expected| <= atol + rtol * |expected| for every element. For bf16 results, rtol = 2^-7
/// (one bf16 ulp at most of rounding) times a small factor for accumulated error.
template <class A, class B>
CompareReport compare(std::span<const A> got, std::span<const B> expected, double rtol, double atol, const char* what = "") {
  CompareReport r;
  const std::size_t n = std::min(got.size(), expected.size());
  if (got.size() != expected.size()) {
    r.mismatches = 1;
    r.first = std::string(what) + ": sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(expected.size()) + "\n";
    return r;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]);
    const double e = static_cast<double>(expected[i]);
    ++r.checked;
    const bool bad_value = !std::isfinite(g) && std::isfinite(e);
    const double err = std::abs(g - e);
    if (std::isfinite(err)) {
      r.max_abs_err = std::max(r.max_abs_err, err);
      if (std::abs(e) > atol) r.max_rel_err = std::max(r.max_rel_err, err / std::abs(e));
    }
    if (bad_value) ++r.non_finite;
    if (bad_value || !(err <= atol + rtol * std::abs(e))) {
      ++r.mismatches;
      if (r.mismatches <= 5) {
        char line[160];
        std::snprintf(line, sizeof line, "%s[%zu]: got %.8g expected %.8g (err %.3g)\n", what, i, g, e, err);
        r.first += line;
      }
    }
  }
  return r;
}

template <class A, class B>
CompareReport compare(const std::vector<A>& got, const std::vector<B>& expected, double rtol, double atol, const char* what = "") {
  return compare(std::span<const A>(got), std::span<const B>(expected), rtol, atol, what);
}

/// ||got - expected|| / ||expected|| (the absolute norm when expected is all zero); NaN when any
/// element of got is not finite or the sizes differ, so every bound fails.
inline double rel_l2(std::span<const float> got, std::span<const float> expected) {
  if (got.size() != expected.size()) return std::nan("");
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::nan("");
    const double d = static_cast<double>(got[i]) - static_cast<double>(expected[i]);
    num += d * d;
    den += static_cast<double>(expected[i]) * static_cast<double>(expected[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// Fills with N(0, stddev) from a fixed seed (fresh inputs per test, reproducible on failure).
inline std::vector<float> random_normal(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace oom::test
