// FirstFitHeap: sub-allocates offsets inside one big block (a device arena's cudaMalloc, a pinned
// slab), first fit over an address-ordered free list, coalescing on free. Host-only bookkeeping:
// the memory itself belongs to the caller.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "oom/core/bytes.hpp"

namespace oom {

class FirstFitHeap {
 public:
  FirstFitHeap() = default;
  FirstFitHeap(Bytes capacity, std::uint64_t alignment);

  /// Offset of `bytes` (rounded up to the alignment), or nullopt when no free range is large enough.
  [[nodiscard]] std::optional<std::uint64_t> allocate(Bytes bytes);
  /// Returns a range from allocate(); throws Errc::internal for an offset it did not hand out.
  void free(std::uint64_t offset);

  [[nodiscard]] Bytes capacity() const { return capacity_; }
  [[nodiscard]] Bytes used() const { return used_; }
  [[nodiscard]] Bytes largest_free() const;
  /// The highest end of any range handed out so far (with used(): how fragmented the heap got).
  [[nodiscard]] Bytes high_water() const { return high_water_; }

 private:
  Bytes capacity_;
  std::uint64_t alignment_ = 256;
  Bytes used_;
  Bytes high_water_;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> size, address order
  std::map<std::uint64_t, std::uint64_t> taken_;  // offset -> size
};

}  // namespace oom
