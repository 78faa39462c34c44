// FirstFitHeap: random allocate/free sequences never overlap, stay in bounds and aligned, and
// coalesce back to one free range; the high-water mark is the highest end handed out. With it,
// the Arena's budget check: sizes near 2^64 are refused by both, not wrapped into small ones.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>

#include "oom/core/error.hpp"
#include "oom/runtime/arena.hpp"
#include "oom/runtime/first_fit.hpp"

using namespace oom;
using namespace oom::literals;

TEST_CASE("random allocate/free: disjoint, aligned, in bounds, fully coalesced at the end") {
  std::mt19937_64 rng(5);
  FirstFitHeap heap(64_MiB, 256);
  std::map<std::uint64_t, std::uint64_t> live;  // offset -> requested bytes
  std::uint64_t reached = 0;                     // the highest end handed out
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const Bytes want{1 + rng() % (1 << 20)};
      if (auto at = heap.allocate(want)) {
        CHECK(*at % 256 == 0);
        CHECK(*at + want.count() <= (64_MiB).count());
        auto next = live.lower_bound(*at);
        if (next != live.end()) CHECK(*at + want.count() <= next->first);
        if (next != live.begin()) {
          auto prev = std::prev(next);
          CHECK(prev->first + prev->second <= *at);
        }
        live.emplace(*at, want.count());
        reached = std::max(reached, *at + want.align_up(256).count());
        CHECK(heap.high_water() == Bytes{reached});
      } else {
        CHECK(heap.largest_free() < want.align_up(256));
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      heap.free(it->first);
      live.erase(it);
    }
  }
  for (const auto& [at, n] : live) heap.free(at);
  CHECK(heap.used() == 0_B);
  CHECK(heap.largest_free() == 64_MiB);
  CHECK(heap.high_water() == Bytes{reached});  // frees do not lower it
  CHECK_THROWS_AS(heap.free(12345), Error);
}

TEST_CASE("a request near 2^64 bytes is refused, not rounded up past 2^64 into a small one") {
  FirstFitHeap heap(1_MiB, 256);
  const auto small = heap.allocate(1_KiB);
  REQUIRE(small);
  for (const std::uint64_t huge : {~std::uint64_t{0}, ~std::uint64_t{0} - 10, ~std::uint64_t{0} - 255}) {
    CAPTURE(huge);
    CHECK_FALSE(heap.allocate(Bytes{huge}));  // was offset 0 (then 1 KiB) with 256 B more in use
    CHECK(heap.used() == 1_KiB);
  }
  CHECK_FALSE(heap.allocate(1_MiB));  // what is left is 1 MiB - 1 KiB
  CHECK(heap.allocate(1_MiB - 1_KiB));
}

TEST_CASE("Arena refuses a size that would wrap its total past 2^64") {
  Arena arena("test", 1_KiB);
  arena.take(Claimant::worksets, 16_B);
  for (const std::uint64_t huge : {~std::uint64_t{0} - 7, ~std::uint64_t{0} - 15, ~std::uint64_t{0}}) {
    CAPTURE(huge);
    try {
      arena.take(Claimant::worksets, Bytes{huge});  // 16 + (2^64 - 8) wrapped to 8, within the budget
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::out_of_budget);
      CHECK(e.message().find("the budget is 1.00 KiB") != std::string::npos);
    }
    CHECK_THROWS_AS(arena.take_when_free(Claimant::worksets, Bytes{huge}, [] { return false; }), Error);
  }
  CHECK(arena.in_use() == 16_B);
  arena.take(Claimant::worksets, 1_KiB - 16_B);  // exactly the budget still fits
  CHECK(arena.in_use() == 1_KiB);
  CHECK_THROWS_AS(arena.take(Claimant::worksets, 1_B), Error);
}
