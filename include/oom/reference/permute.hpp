// CPU reference of the token permutation by expert: slots (t, j) = t*k + j are ordered stably by
// (expert, slot), rows of x are gathered into that order for the expert GEMMs, and the experts'
// outputs are combined back per token with the router weights. Forward and backward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

struct PermutePlan {
  std::vector<std::int32_t> row_to_slot;     // (T*k) permuted row r holds slot row_to_slot[r] (token slot / k)
  std::vector<std::int32_t> slot_to_row;     // (T*k) inverse of row_to_slot
  std::vector<std::int32_t> expert_counts;   // (E) rows of each expert (may be 0)
  std::vector<std::int32_t> expert_offsets;  // (E+1) first row of each expert; [E] = T*k
};

PermutePlan permute_plan(std::span<const std::int32_t> expert_ids, std::int64_t tokens, std::int64_t top_k,
                         std::int64_t experts);

/// x_perm[r] = x[row_to_slot[r] / k]: (T*k, H) from (T, H).
std::vector<float> permute_rows(const PermutePlan& p, std::span<const float> x, std::int64_t top_k, std::int64_t hidden);
/// dx[t] = sum_j dx_perm[slot_to_row[t*k+j]]: (T, H) from (T*k, H).
std::vector<float> permute_rows_backward(const PermutePlan& p, std::span<const float> dx_perm, std::int64_t top_k,
                                         std::int64_t hidden);

/// out[t] = sum_j weights[t, j] * y_perm[slot_to_row[t*k+j]]: (T, H) from (T*k, H) and (T, k).
std::vector<float> unpermute_combine(const PermutePlan& p, std::span<const float> y_perm, std::span<const float> weights,
                                     std::int64_t top_k, std::int64_t hidden);

struct CombineGrads {
  std::vector<float> dy_perm;    // (T*k, H) row slot_to_row[t*k+j] = weights[t, j] * d_out[t]
  std::vector<float> d_weights;  // (T, k) <d_out[t], y_perm[slot_to_row[t*k+j]]>
};
CombineGrads unpermute_combine_backward(const PermutePlan& p, std::span<const float> d_out, std::span<const float> y_perm,
                                        std::span<const float> weights, std::int64_t top_k, std::int64_t hidden);

}  // namespace oom::reference
