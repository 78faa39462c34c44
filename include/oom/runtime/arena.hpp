// Arena: a memory budget with accounting by claimant and a measured peak. Exceeding the budget is
// an error naming the claimant, the bytes asked for, what is in use and the budget: the plan said
// it would fit, so a miss is a bug the tests must see, never a silent fallback.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>

#include "oom/core/bytes.hpp"
#include "oom/plan/simulator.hpp"

namespace oom {

class Arena {
 public:
  Arena(std::string name, Bytes budget) : name_(std::move(name)), budget_(budget) {}

  /// Records `bytes` taken by `claimant`; throws Errc::out_of_budget when the total would exceed
  /// the budget.
  void take(Claimant claimant, Bytes bytes);
  /// As take(), but while the bytes do not fit and `pending()` says queued work may still give
  /// some back, waits for it (give() wakes the waiter): the budget then holds in the order the
  /// work runs, not the order it was queued. Throws Errc::out_of_budget once nothing is pending
  /// and the bytes still do not fit. `pending` is called with the arena locked: it must not
  /// call back into the arena.
  void take_when_free(Claimant claimant, Bytes bytes, const std::function<bool()>& pending);
  void give(Claimant claimant, Bytes bytes);

  [[nodiscard]] Bytes budget() const { return budget_; }
  [[nodiscard]] Bytes in_use() const;
  [[nodiscard]] Bytes peak() const;
  [[nodiscard]] Bytes in_use(Claimant c) const;
  [[nodiscard]] Bytes peak(Claimant c) const;
  [[nodiscard]] const std::string& name() const { return name_; }

 private:
  void take_locked(Claimant claimant, Bytes bytes);
  [[noreturn]] void refuse(Claimant claimant, Bytes bytes, const char* when) const;

  std::string name_;
  Bytes budget_;
  mutable std::mutex mutex_;
  std::condition_variable given_;
  Bytes in_use_, peak_;
  std::array<Bytes, claimant_count> by_claimant_{}, peak_by_claimant_{};
};

}  // namespace oom
