// DependencyPartitioner: OOM's partitioner. Splits a layer's work into the fewest chunks whose
// live bytes fit a budget, in an order its dependencies allow:
//   - independent / carried_state: equal chunks (balanced, multiples of the granularity), in order;
//   - causal_prefix: chunk i reads every earlier unit's keys/values, so later chunks must be
//     smaller; greedy from the front takes the largest chunk that fits each time, which gives
//     the fewest chunks (each chunk's end is as far as the budget allows);
//   - none: one chunk, or an error.
// The whole extent in one chunk wherever it fits (a split adds WorkItem::split_fixed).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "oom/concepts/partitioner.hpp"
#include "oom/core/error.hpp"

namespace oom {

class DependencyPartitioner {
 public:
  /// The least budget for which partition(w, budget) succeeds: the whole extent's, or a split's
  /// into single granules where that is less.
  [[nodiscard]] static Bytes min_budget(const WorkItem& w) {
    if (w.extent == 0) return Bytes{};  // no work, nothing live
    return min(live_bytes(w, 0, w.extent), min_split_budget(w));
  }

  /// See the partitioner concept; throws Errc::out_of_budget naming the bytes needed.
  [[nodiscard]] Partition partition(const WorkItem& w, Bytes budget) const {
    Partition p;
    if (w.extent == 0) return p;
    const Bytes need = min_budget(w);
    if (need > budget)
      OOM_THROW(Errc::out_of_budget,
                "the smallest chunk of this work needs " + to_string(need) + " but the budget is " + to_string(budget) +
                    " (" + std::to_string(w.extent) + " units, " + to_string(w.fixed) + " fixed, " +
                    to_string(w.per_unit) + " per unit" +
                    (w.dependency == ChunkDependency::causal_prefix ? ", " + to_string(w.per_prefix_unit) + " per prefix unit" : "") +
                    (w.split_fixed.count() > 0 ? ", " + to_string(w.split_fixed) + " more in every chunk of a split" : "") + ")");
    const std::uint64_t g = std::max<std::uint64_t>(w.granularity, 1);
    auto add = [&](std::uint64_t b, std::uint64_t e) {
      p.chunks.push_back({b, e, live_bytes(w, b, e)});
      p.peak = max(p.peak, p.chunks.back().live);
    };
    if (live_bytes(w, 0, w.extent) <= budget) {
      add(0, w.extent);
      return p;
    }
    switch (w.dependency) {
      case ChunkDependency::none:  // its least budget is the whole extent's, which fitted above
        OOM_THROW(Errc::internal, "DependencyPartitioner: work that cannot be split reached the split");
      case ChunkDependency::independent:
      case ChunkDependency::carried_state: {
        const std::uint64_t largest = largest_even_chunk(w, budget, g);
        const std::uint64_t count = (w.extent + largest - 1) / largest;
        // Balance: the same number of chunks, as equal as the granularity allows.
        const std::uint64_t size = round_up((w.extent + count - 1) / count, g);
        for (std::uint64_t b = 0; b < w.extent; b += size) add(b, std::min(w.extent, b + size));
        break;
      }
      case ChunkDependency::causal_prefix: {
        std::uint64_t b = 0;
        while (b < w.extent) {
          const std::uint64_t e = largest_causal_end(w, budget, g, b);
          OOM_ASSERT(e > b);
          add(b, e);
          b = e;
        }
        break;
      }
    }
    return p;
  }

 private:
  static std::uint64_t round_up(std::uint64_t n, std::uint64_t g) { return (n + g - 1) / g * g; }

  // The least budget of a split into single granules (the whole extent where one granule covers it).
  static Bytes min_split_budget(const WorkItem& w) {
    const std::uint64_t g = std::max<std::uint64_t>(w.granularity, 1);
    switch (w.dependency) {
      case ChunkDependency::none: return live_bytes(w, 0, w.extent);
      case ChunkDependency::independent:
      case ChunkDependency::carried_state: return live_bytes(w, 0, std::min(g, w.extent));
      case ChunkDependency::causal_prefix: {
        // With chunks of one granule each, live grows with the end: the worst is the last full
        // granule or the final partial one.
        const std::uint64_t tail = w.extent % g == 0 ? g : w.extent % g;
        Bytes worst = live_bytes(w, w.extent - tail, w.extent);
        if (w.extent > tail) worst = max(worst, live_bytes(w, w.extent - tail - std::min(g, w.extent - tail), w.extent - tail));
        return worst;
      }
    }
    return live_bytes(w, 0, w.extent);
  }

  // Largest size, a multiple of g (or the whole extent), with fixed + split_fixed + per_unit*size
  // <= budget (partition() has taken the whole extent where it fits).
  static std::uint64_t largest_even_chunk(const WorkItem& w, Bytes budget, std::uint64_t g) {
    // budget >= min_budget, and the whole extent did not fit: min_budget is the split's, which
    // holds fixed and split_fixed.
    OOM_ASSERT(budget >= w.fixed + w.split_fixed);
    OOM_ASSERT(w.per_unit.count() > 0);  // else every chunk's live bytes are the whole extent's or more
    const std::uint64_t units = (budget - w.fixed - w.split_fixed).count() / w.per_unit.count();
    // fixed + split_fixed + per_unit * extent would be within the budget, and so the whole extent.
    OOM_ASSERT(units < w.extent);
    return std::max<std::uint64_t>(units / g * g, g);
  }

  // Largest end e > b (b + multiple of g, or the extent) with live_bytes(w, b, e) <= budget, in a
  // split (partition() has taken the whole extent where it fits).
  static std::uint64_t largest_causal_end(const WorkItem& w, Bytes budget, std::uint64_t g, std::uint64_t b) {
    // fixed + split_fixed + per_unit*(e-b) + per_prefix*e <= budget
    //   <=>  e <= (budget - fixed - split_fixed + per_unit*b) / (per_unit + per_prefix)
    OOM_ASSERT(budget >= w.fixed + w.split_fixed);  // as in largest_even_chunk
    const std::uint64_t slope = w.per_unit.count() + w.per_prefix_unit.count();
    const std::uint64_t room = (budget - w.fixed - w.split_fixed).count() + w.per_unit.count() * b;
    const std::uint64_t e_max = slope == 0 ? w.extent : room / slope;
    if (e_max >= w.extent) return w.extent;
    const std::uint64_t e = b + (e_max - std::min(e_max, b)) / g * g;
    // The final partial granule may fit where a full one would not.
    if (e == b && w.extent - b < g && live_bytes(w, b, w.extent) <= budget) return w.extent;
    return e;
  }
};

static_assert(partitioner<DependencyPartitioner>);

}  // namespace oom
