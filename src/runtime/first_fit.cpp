// FirstFitHeap.
#include "oom/runtime/first_fit.hpp"

#include <iterator>

#include "oom/core/error.hpp"

namespace oom {

FirstFitHeap::FirstFitHeap(Bytes capacity, std::uint64_t alignment) : capacity_(capacity), alignment_(alignment) {
  if (alignment == 0) OOM_THROW(Errc::invalid_argument, "FirstFitHeap alignment must be > 0");
  if (capacity.count() > 0) free_.emplace(0, capacity.count());
}

std::optional<std::uint64_t> FirstFitHeap::allocate(Bytes bytes) {
  if (bytes > capacity_) return std::nullopt;  // before rounding up, which cannot round a size near 2^64
  const std::uint64_t n = std::max<std::uint64_t>(bytes.align_up(alignment_).count(), alignment_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const std::uint64_t at = it->first;
    const std::uint64_t rest = it->second - n;
    free_.erase(it);
    if (rest > 0) free_.emplace(at + n, rest);
    taken_.emplace(at, n);
    used_ += Bytes{n};
    high_water_ = std::max(high_water_, Bytes{at + n});
    return at;
  }
  return std::nullopt;
}

void FirstFitHeap::free(std::uint64_t offset) {
  const auto t = taken_.find(offset);
  if (t == taken_.end()) OOM_THROW(Errc::internal, "FirstFitHeap::free of offset " + std::to_string(offset) + ", which is not allocated");
  std::uint64_t at = t->first, size = t->second;
  taken_.erase(t);
  used_ -= Bytes{size};
  auto next = free_.lower_bound(at);
  if (next != free_.end() && at + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      prev->second += size;
      return;
    }
  }
  free_.emplace(at, size);
}

Bytes FirstFitHeap::largest_free() const {
  std::uint64_t m = 0;
  for (const auto& [at, size] : free_) m = std::max(m, size);
  return Bytes{m};
}

}  // namespace oom
