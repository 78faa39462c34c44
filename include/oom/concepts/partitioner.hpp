// partitioner: splits one layer's work into chunks whose live set fits a byte budget, in an order
// that respects the work's dependencies (causal attention, a linear-attention scan, independent
// experts or loss rows).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <utility>
#include <vector>

#include "oom/concepts/layer.hpp"
#include "oom/core/bytes.hpp"

namespace oom {

/// The work to split: `extent` units (tokens, query rows, loss rows) of one layer.
struct WorkItem {
  ChunkDependency dependency = ChunkDependency::independent;
  std::uint64_t extent = 0;      ///< units of work
  std::uint64_t granularity = 1; ///< chunk sizes are multiples of this (e.g. a query tile), except the last
  Bytes fixed;                   ///< live whatever the chunk size (weights in use, carried state)
  Bytes per_unit;                ///< live per unit in the chunk (inputs, outputs, temporaries)
  Bytes per_prefix_unit;         ///< causal_prefix only: live per earlier unit (keys/values it reads)
  /// Live only while the work runs split, in every chunk of a split: what carries across chunks
  /// (a query-chunked attention backward's fp32 dK/dV sums). Not in a chunk of the whole extent.
  Bytes split_fixed;
};

struct Chunk {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;  ///< one past the last unit
  Bytes live;             ///< bytes live while this chunk runs
  friend constexpr bool operator==(const Chunk&, const Chunk&) = default;
};

struct Partition {
  std::vector<Chunk> chunks;  ///< in execution order
  Bytes peak;                 ///< max live over the chunks
};

/// Bytes live while units [begin, end) of `w` run (a chunk short of the whole extent: with
/// split_fixed).
constexpr Bytes live_bytes(const WorkItem& w, std::uint64_t begin, std::uint64_t end) {
  Bytes live = w.fixed + w.per_unit * (end - begin);
  if (begin > 0 || end < w.extent) live += w.split_fixed;
  if (w.dependency == ChunkDependency::causal_prefix) live += w.per_prefix_unit * end;
  return live;
}

/// Requirements, for `const P& p`, `const WorkItem& w` and `Bytes budget`:
///   1. `p.partition(w, budget)` returns a Partition whose chunks cover [0, w.extent) exactly once;
///   2. every chunk's `live` equals live_bytes(w, begin, end) and is <= budget, and `peak` is
///      their maximum;
///   3. the order respects w.dependency: causal_prefix and carried_state chunks run in increasing
///      order of `begin`; independent chunks in any order; `none` is a single chunk;
///   4. when no split fits, it throws oom::Error (Errc::out_of_budget) naming the bytes the
///      smallest chunk needs and the budget.
/// `satisfies_partition_contract` checks 1-3 for a given result.
///
/// **Customization**
/// @code
///   struct EvenSplit {  // n equal chunks, whatever the budget says (fine for tests, not for plans)
///     int n;
///     oom::Partition partition(const oom::WorkItem& w, oom::Bytes budget) const;
///   };
/// @endcode
/// @see tests/concepts/test_policies.cpp
template <class P>
concept partitioner = requires(const P& p, const WorkItem& w, Bytes budget) {
  { p.partition(w, budget) } -> std::same_as<Partition>;
};

inline bool satisfies_partition_contract(const WorkItem& w, const Partition& part, Bytes budget) {
  if (w.extent == 0) return part.chunks.empty();
  if (part.chunks.empty()) return false;
  if (w.dependency == ChunkDependency::none && part.chunks.size() != 1) return false;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  Bytes peak;
  std::uint64_t last_begin = 0;
  bool first = true;
  for (const auto& c : part.chunks) {
    if (c.begin >= c.end || c.end > w.extent) return false;
    if (c.live != live_bytes(w, c.begin, c.end) || c.live > budget) return false;
    const bool ordered = w.dependency == ChunkDependency::causal_prefix || w.dependency == ChunkDependency::carried_state;
    if (ordered && !first && c.begin <= last_begin) return false;
    last_begin = c.begin;
    first = false;
    peak = max(peak, c.live);
    spans.emplace_back(c.begin, c.end);
  }
  std::sort(spans.begin(), spans.end());
  std::uint64_t next = 0;
  for (const auto& [b, e] : spans) {
    if (b != next) return false;
    next = e;
  }
  return next == w.extent && peak == part.peak;
}

}  // namespace oom
