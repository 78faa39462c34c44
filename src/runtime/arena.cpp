// Arena accounting.
#include "oom/runtime/arena.hpp"

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"

namespace oom {

void Arena::take(Claimant claimant, Bytes bytes) {
  std::lock_guard lock(mutex_);
  if (in_use_ + bytes > budget_)
    OOM_THROW(Errc::out_of_budget, fmt::format("{}: {} asks for {} with {} in use; the budget is {}", name_,
                                               to_string(claimant), bytes, in_use_, budget_));
  in_use_ += bytes;
  peak_ = max(peak_, in_use_);
  auto& c = by_claimant_[static_cast<std::size_t>(claimant)];
  c += bytes;
  auto& p = peak_by_claimant_[static_cast<std::size_t>(claimant)];
  p = max(p, c);
}

void Arena::give(Claimant claimant, Bytes bytes) {
  std::lock_guard lock(mutex_);
  auto& c = by_claimant_[static_cast<std::size_t>(claimant)];
  if (bytes > c) OOM_THROW(Errc::internal, fmt::format("{}: {} returns {} but holds {}", name_, to_string(claimant), bytes, c));
  c -= bytes;
  in_use_ -= bytes;
}

Bytes Arena::in_use() const {
  std::lock_guard lock(mutex_);
  return in_use_;
}
Bytes Arena::peak() const {
  std::lock_guard lock(mutex_);
  return peak_;
}
Bytes Arena::in_use(Claimant c) const {
  std::lock_guard lock(mutex_);
  return by_claimant_[static_cast<std::size_t>(c)];
}
Bytes Arena::peak(Claimant c) const {
  std::lock_guard lock(mutex_);
  return peak_by_claimant_[static_cast<std::size_t>(c)];
}

}  // namespace oom
