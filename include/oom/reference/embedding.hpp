// CPU reference of the token embedding (oom/kernels/embedding.hpp): gather forward, scatter-add
// backward with each vocabulary row's sum accumulated in fp64 in token order. `Real` is float for
// comparisons with the kernels and double for the finite-difference checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

/// out[t, :] = table[ids[t], :]; an id outside [0, V) gives a zero row. Returns how many ids were
/// invalid (the kernels' invalid_count).
template <class Real>
std::int64_t embedding_forward(std::span<const std::int32_t> ids,  // (T)
                               std::span<const Real> table,        // (V, H)
                               std::span<Real> out,                // (T, H)
                               std::int64_t vocab, std::int64_t hidden) {
  std::int64_t invalid = 0;
  for (std::size_t t = 0; t < ids.size(); ++t) {
    const bool valid = ids[t] >= 0 && ids[t] < vocab;
    invalid += valid ? 0 : 1;
    for (std::int64_t c = 0; c < hidden; ++c) {
      out[t * hidden + c] = valid ? table[static_cast<std::size_t>(ids[t] * hidden + c)] : Real(0);
    }
  }
  return invalid;
}

/// grad_table[v, :] += sum over t with ids[t] == v of grad_out[t, :] (fp64 sum in token order,
/// added once). Invalid ids are skipped; returns how many there were.
template <class Real>
std::int64_t embedding_backward(std::span<const std::int32_t> ids,  // (T)
                                std::span<const Real> grad_out,     // (T, H)
                                std::span<Real> grad_table,         // (V, H), accumulated into
                                std::int64_t vocab, std::int64_t hidden) {
  std::vector<double> sum(static_cast<std::size_t>(vocab * hidden), 0.0);
  std::vector<bool> touched(static_cast<std::size_t>(vocab), false);
  std::int64_t invalid = 0;
  for (std::size_t t = 0; t < ids.size(); ++t) {
    const std::int32_t id = ids[t];
    if (id < 0 || id >= vocab) {
      ++invalid;
      continue;
    }
    touched[id] = true;
    for (std::int64_t c = 0; c < hidden; ++c) sum[id * hidden + c] += static_cast<double>(grad_out[t * hidden + c]);
  }
  for (std::int64_t v = 0; v < vocab; ++v) {
    if (!touched[v]) continue;
    for (std::int64_t c = 0; c < hidden; ++c) {
      grad_table[v * hidden + c] += static_cast<Real>(sum[v * hidden + c]);
    }
  }
  return invalid;
}

}  // namespace oom::reference
