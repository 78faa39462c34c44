// DependencyPartitioner: over many random work items and budgets, every partition honours the
// contract (coverage, budget, dependency order), is minimal where that is checkable, and the
// boundary between feasible and infeasible is exactly min_budget.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "oom/core/error.hpp"
#include "oom/plan/dependency_partitioner.hpp"

using namespace oom;
using namespace oom::literals;

namespace {
WorkItem random_item(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> dep(0, 3);
  std::uniform_int_distribution<std::uint64_t> extent(0, 300000), gran(1, 256), fixed(0, 64 << 20), unit(0, 64 << 10),
      prefix(0, 8 << 10);
  WorkItem w;
  w.dependency = static_cast<ChunkDependency>(dep(rng));
  w.extent = extent(rng) >> (rng() % 12);  // many small extents too
  w.granularity = gran(rng);
  w.fixed = Bytes{fixed(rng)};
  w.per_unit = Bytes{unit(rng)};
  if (w.dependency == ChunkDependency::causal_prefix) w.per_prefix_unit = Bytes{prefix(rng)};
  if (rng() % 3 == 0) w.split_fixed = Bytes{fixed(rng)};  // held only while split
  return w;
}
}  // namespace

TEST_CASE("random work items: contract holds, and feasibility is exactly min_budget") {
  std::mt19937_64 rng(2026);
  const DependencyPartitioner part;
  int feasible = 0, infeasible = 0;
  for (int i = 0; i < 20000; ++i) {
    const WorkItem w = random_item(rng);
    const Bytes need = DependencyPartitioner::min_budget(w);
    const Bytes whole = live_bytes(w, 0, w.extent);
    // Budgets below, at and above the minimum, up to "everything fits at once".
    const Bytes span = whole > need ? whole - need : 0_B;
    const Bytes budget = (i % 5 == 0) ? need : (i % 5 == 1 && need > 0_B) ? need - 1_B : need + Bytes{rng() % (span.count() + 1)};
    CAPTURE(i);
    CAPTURE(static_cast<int>(w.dependency));
    CAPTURE(w.extent);
    CAPTURE(budget.count());
    if (budget < need) {
      ++infeasible;
      try {
        (void)part.partition(w, budget);
        FAIL("a budget below min_budget was accepted");
      } catch (const Error& e) {
        CHECK(e.code() == Errc::out_of_budget);
        CHECK(std::string(e.what()).find(to_string(need)) != std::string::npos);
      }
      continue;
    }
    ++feasible;
    const Partition p = part.partition(w, budget);
    REQUIRE(satisfies_partition_contract(w, p, budget));
    if (budget >= whole && w.extent > 0) CHECK(p.chunks.size() == 1);
    if (w.dependency == ChunkDependency::independent && w.per_unit > 0_B && w.extent > 0) {
      // Minimal: one chunk fewer could not hold the work within the budget.
      const std::uint64_t n = p.chunks.size();
      if (n > 1) {
        const std::uint64_t g = w.granularity;
        const std::uint64_t fewer = (w.extent + (n - 1) - 1) / (n - 1);
        CHECK(live_bytes(w, 0, (fewer + g - 1) / g * g) > budget);
      }
    }
  }
  CHECK(feasible > 10000);
  CHECK(infeasible > 1000);
}

TEST_CASE("split_fixed: held only in a split; the whole extent wherever it fits, even where a split would not") {
  // A query-chunked attention backward's fp32 dK/dV sums: 16 KiB a token, 8 KiB a token of rows.
  WorkItem w{ChunkDependency::causal_prefix, 65536, 128, 1_GiB, 8_KiB, 0_B, 1_GiB};
  const Bytes whole = live_bytes(w, 0, w.extent);
  CHECK(whole == 1_GiB + 512_MiB);
  CHECK(live_bytes(w, 0, 128) == 2_GiB + 1_MiB);  // a chunk short of the whole: with the sums
  CHECK(live_bytes(w, 128, 65536) == 2_GiB + 512_MiB - 1_MiB);
  // Whole fits below any split's need: min_budget is the whole's, and that budget gives one chunk.
  CHECK(DependencyPartitioner::min_budget(w) == whole);
  const Partition one = DependencyPartitioner{}.partition(w, whole);
  REQUIRE(one.chunks.size() == 1);
  CHECK(one.peak == whole);
  CHECK_THROWS_AS((void)DependencyPartitioner{}.partition(w, whole - 1_B), Error);
  // With less per token held by the split than the whole spares, a split fits where the whole does not.
  w.split_fixed = 64_MiB;
  CHECK(DependencyPartitioner::min_budget(w) == live_bytes(w, 65536 - 128, 65536));
  const Bytes budget = 1_GiB + 64_MiB + 128_MiB;
  const Partition p = DependencyPartitioner{}.partition(w, budget);
  REQUIRE(satisfies_partition_contract(w, p, budget));
  REQUIRE(p.chunks.size() == 4);  // 16384 tokens of rows each, every chunk holding the sums
  for (const auto& c : p.chunks) CHECK(c.live == 1_GiB + 64_MiB + 8_KiB * (c.end - c.begin));
}

TEST_CASE("causal chunks shrink as their prefix grows") {
  // 128K query tokens, 64 KiB per token in flight, 16 KiB per earlier token of keys/values.
  WorkItem w{ChunkDependency::causal_prefix, 131072, 128, 256_MiB, 64_KiB, 16_KiB, {}};
  const Bytes budget = 4_GiB;
  const Partition p = DependencyPartitioner{}.partition(w, budget);
  REQUIRE(p.chunks.size() > 2);
  CHECK(p.chunks.front().end - p.chunks.front().begin > p.chunks[p.chunks.size() - 2].end - p.chunks[p.chunks.size() - 2].begin);
  for (const auto& c : p.chunks) {
    CHECK(c.live <= budget);
    if (c.end != w.extent) CHECK((c.end - c.begin) % 128 == 0);
  }
}

TEST_CASE("the loss over rows splits evenly") {
  // 1M rows, each with a 32000-wide fp32 logits row in flight: must not materialise it all.
  WorkItem loss{ChunkDependency::independent, 1 << 20, 1, 512_MiB, Bytes{32000 * 4}, {}, {}};
  const Partition p = DependencyPartitioner{}.partition(loss, 8_GiB);
  CHECK(p.chunks.size() == 17);  // ceil(2^20 / floor(7.5 GiB / 128000 B)) = ceil(2^20 / 62914) = 17
  const auto size0 = p.chunks.front().end - p.chunks.front().begin;
  for (const auto& c : p.chunks) CHECK(c.end - c.begin <= size0);
  CHECK(p.peak <= 8_GiB);
}

TEST_CASE("unchunkable work fits whole or fails naming the bytes") {
  WorkItem w{ChunkDependency::none, 1000, 1, 1_GiB, 1_MiB, {}, {}};
  CHECK(DependencyPartitioner{}.partition(w, 2_GiB).chunks.size() == 1);
  CHECK_THROWS_WITH_AS((void)DependencyPartitioner{}.partition(w, 1_GiB),
                       doctest::Contains("needs 1.98 GiB but the budget is 1.00 GiB"), Error);
}
