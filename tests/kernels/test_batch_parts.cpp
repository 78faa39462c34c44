// The split of the expert GEMMs' batch counts (src/kernels/batch_parts.hpp): every count covered
// exactly, in order, by parts from a small fixed set of sizes.
#include <doctest/doctest.h>

#include <cstddef>
#include <set>
#include <vector>

#include "kernels/batch_parts.hpp"

using oom::kernels::detail::batch_cap;
using oom::kernels::detail::for_each_batch_part;

TEST_CASE("a batch count splits into consecutive parts of recurring sizes") {
  std::set<std::size_t> sizes;
  for (std::size_t count = 0; count <= 5000; ++count) {
    CAPTURE(count);
    std::size_t next = 0;
    std::vector<std::size_t> parts;
    for_each_batch_part(count, [&](std::size_t first, std::size_t n) {
      CHECK(first == next);  // consecutive, in order, no gap or overlap
      CHECK(n >= 1);
      CHECK(n <= batch_cap);
      next = first + n;
      parts.push_back(n);
      sizes.insert(n);
    });
    CHECK(next == count);  // all of it
    // Full parts of the cap first, then strictly decreasing sizes.
    for (std::size_t i = 1; i < parts.size(); ++i)
      if (parts[i - 1] != batch_cap || parts[i] != batch_cap) CHECK(parts[i] < parts[i - 1]);
  }
  // 5001 different counts, 20 different part sizes: 256, 128, 64, 32, 16 and 1..15.
  CHECK(sizes.size() == 20);
  for (std::size_t n : {256u, 128u, 64u, 32u, 16u}) CHECK(sizes.count(n) == 1);
  for (std::size_t n = 1; n < 16; ++n) CHECK(sizes.count(n) == 1);
}
