// What the executor tests compare: weights (or any per-segment vectors) bit for bit, and whether
// a plan moves any activation a given way. Shared by the host, planner and GPU executor tests.
#pragma once

#include <cstring>
#include <vector>

#include "oom/plan/plan.hpp"

namespace oom::test {

/// Same sizes and the same bits, vector by vector.
inline bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  return true;
}

/// Whether any layer's class is planned `r`.
inline bool any_retention(const Plan& p, Retention r) {
  for (const auto& row : p.retention)
    for (const auto& d : row)
      if (d.action == r) return true;
  return false;
}

}  // namespace oom::test
