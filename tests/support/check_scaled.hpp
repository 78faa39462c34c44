// Test support: a doctest check that every element of `got` is within rtol of `want` plus
// atol_frac of want's largest magnitude (an absolute floor in proportion to the tensor's scale,
// for elements that cancel to near zero), with the first mismatches reported.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "support/compare.hpp"

namespace oom::test {

inline void check_scaled(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol_frac, const char* what) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::abs(w)));
  const auto r = compare(std::span<const float>(got), std::span<const float>(want), rtol, atol_frac * scale, what);
  INFO(what << ": max abs err " << r.max_abs_err << " (scale " << scale << ")\n" << r.first);
  CHECK(r.checked == want.size());
  CHECK(r.ok());
}

}  // namespace oom::test
