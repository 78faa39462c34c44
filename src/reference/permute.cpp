// CPU reference of the token permutation; see oom/reference/permute.hpp.
#include "oom/reference/permute.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "oom/core/error.hpp"

namespace oom::reference {

PermutePlan permute_plan(std::span<const std::int32_t> expert_ids, std::int64_t tokens, std::int64_t top_k,
                         std::int64_t experts) {
  const auto n = tokens * top_k;
  if (static_cast<std::int64_t>(expert_ids.size()) != n || top_k < 1 || experts < 1)
    OOM_THROW(Errc::invalid_argument, "permute_plan: expert_ids must hold T*k ids, k >= 1, E >= 1");
  PermutePlan p;
  p.expert_counts.assign(static_cast<std::size_t>(experts), 0);
  for (const auto e : expert_ids) {
    if (e < 0 || e >= experts) OOM_THROW(Errc::invalid_argument, "permute_plan: expert id " + std::to_string(e) + " out of range");
    ++p.expert_counts[static_cast<std::size_t>(e)];
  }
  p.expert_offsets.assign(static_cast<std::size_t>(experts + 1), 0);
  std::partial_sum(p.expert_counts.begin(), p.expert_counts.end(), p.expert_offsets.begin() + 1);
  p.row_to_slot.resize(static_cast<std::size_t>(n));
  std::iota(p.row_to_slot.begin(), p.row_to_slot.end(), 0);
  std::stable_sort(p.row_to_slot.begin(), p.row_to_slot.end(),
                   [&](std::int32_t a, std::int32_t b) { return expert_ids[a] < expert_ids[b]; });
  p.slot_to_row.resize(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) p.slot_to_row[p.row_to_slot[r]] = static_cast<std::int32_t>(r);
  return p;
}

std::vector<float> permute_rows(const PermutePlan& p, std::span<const float> x, std::int64_t top_k, std::int64_t hidden) {
  const auto n = static_cast<std::int64_t>(p.row_to_slot.size());
  std::vector<float> out(static_cast<std::size_t>(n * hidden));
  for (std::int64_t r = 0; r < n; ++r) {
    const auto t = p.row_to_slot[r] / top_k;
    std::copy_n(&x[t * hidden], hidden, &out[r * hidden]);
  }
  return out;
}

std::vector<float> permute_rows_backward(const PermutePlan& p, std::span<const float> dx_perm, std::int64_t top_k,
                                         std::int64_t hidden) {
  const auto tokens = static_cast<std::int64_t>(p.slot_to_row.size()) / top_k;
  std::vector<float> dx(static_cast<std::size_t>(tokens * hidden));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < hidden; ++h) {
      double acc = 0;
      for (std::int64_t j = 0; j < top_k; ++j) acc += dx_perm[p.slot_to_row[t * top_k + j] * hidden + h];
      dx[t * hidden + h] = static_cast<float>(acc);
    }
  return dx;
}

std::vector<float> unpermute_combine(const PermutePlan& p, std::span<const float> y_perm, std::span<const float> weights,
                                     std::int64_t top_k, std::int64_t hidden) {
  const auto tokens = static_cast<std::int64_t>(p.slot_to_row.size()) / top_k;
  std::vector<float> out(static_cast<std::size_t>(tokens * hidden));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < hidden; ++h) {
      double acc = 0;
      for (std::int64_t j = 0; j < top_k; ++j)
        acc += static_cast<double>(weights[t * top_k + j]) * y_perm[p.slot_to_row[t * top_k + j] * hidden + h];
      out[t * hidden + h] = static_cast<float>(acc);
    }
  return out;
}

CombineGrads unpermute_combine_backward(const PermutePlan& p, std::span<const float> d_out, std::span<const float> y_perm,
                                        std::span<const float> weights, std::int64_t top_k, std::int64_t hidden) {
  const auto n = static_cast<std::int64_t>(p.slot_to_row.size());
  const auto tokens = n / top_k;
  CombineGrads g;
  g.dy_perm.resize(static_cast<std::size_t>(n * hidden));
  g.d_weights.resize(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < top_k; ++j) {
      const auto r = p.slot_to_row[t * top_k + j];
      const double w = weights[t * top_k + j];
      double dot = 0;
      for (std::int64_t h = 0; h < hidden; ++h) {
        g.dy_perm[r * hidden + h] = static_cast<float>(w * d_out[t * hidden + h]);
        dot += static_cast<double>(d_out[t * hidden + h]) * y_perm[r * hidden + h];
      }
      g.d_weights[t * top_k + j] = static_cast<float>(dot);
    }
  return g;
}

}  // namespace oom::reference
