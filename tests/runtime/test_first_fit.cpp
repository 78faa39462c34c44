// FirstFitHeap: random allocate/free sequences never overlap, stay in bounds and aligned, and
// coalesce back to one free range; the high-water mark is the highest end handed out.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>

#include "oom/core/error.hpp"
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
