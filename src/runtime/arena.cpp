// Arena accounting.
#include "oom/runtime/arena.hpp"

#include <chrono>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"

namespace oom {

void Arena::refuse(Claimant claimant, Bytes bytes, const char* when) const {
  OOM_THROW(Errc::out_of_budget, fmt::format("{}: {} asks for {} with {} in use{}; the budget is {}", name_, to_string(claimant),
                                             bytes, in_use_, when, budget_));
}

void Arena::take(Claimant claimant, Bytes bytes) {
  std::lock_guard lock(mutex_);
  // Compared with what is left, not as a sum: in_use_ + bytes would wrap for a size near 2^64.
  if (bytes > budget_ - in_use_) refuse(claimant, bytes, "");
  take_locked(claimant, bytes);
}

void Arena::take_when_free(Claimant claimant, Bytes bytes, const std::function<bool()>& pending) {
  std::unique_lock lock(mutex_);
  if (bytes > budget_) refuse(claimant, bytes, "");
  for (bool waited = false; bytes > budget_ - in_use_; waited = true) {
    if (!pending()) refuse(claimant, bytes, waited ? " once the queued work had run" : " with no work queued");
    // Timed: a stream that goes idle without giving anything back sends no notification.
    given_.wait_for(lock, std::chrono::milliseconds(1));
  }
  take_locked(claimant, bytes);
}

void Arena::take_locked(Claimant claimant, Bytes bytes) {
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
  given_.notify_all();
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
