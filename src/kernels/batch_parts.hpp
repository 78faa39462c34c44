// How the row-chunked expert GEMMs split a batch count (host code, no CUDA).
#pragma once

#include <cstddef>

namespace oom::kernels::detail {

inline constexpr std::size_t batch_granule = 16;
inline constexpr std::size_t batch_cap = 256;

/// Calls f(first, n) for consecutive parts of [0, count), in order, whose sizes recur from call to
/// call and stay small: parts of batch_cap, then the powers of two below it down to batch_granule,
/// then the rest (< batch_granule) in one part; nothing for count 0. Every count splits into sizes
/// from {256, 128, 64, 32, 16} and 1..15.
///
/// Why: cuBLAS chooses cublasGemmBatchedEx's algorithm on the host for every (shape, batch count)
/// it has not seen: 3.5-4 ms a call on the H200 at the 5.13B widths for counts up to 256,
/// 100-119 ms for 2047 or 2048 (the 32K backward), 15 us once seen (scripts/diag/
/// batched_issue.cu). The routing changes every step, so a count issued whole is often new.
template <class F>
void for_each_batch_part(std::size_t count, F&& f) {
  std::size_t done = 0;
  for (; count - done >= batch_cap; done += batch_cap) f(done, batch_cap);
  for (std::size_t part = batch_cap / 2; part >= batch_granule; part /= 2)
    if (count - done >= part) {
      f(done, part);
      done += part;
    }
  if (count > done) f(done, count - done);
}

}  // namespace oom::kernels::detail
