// The chunked gated delta rule's decay products computed tile by tile on and below the diagonal
// (src/kernels/gated_delta_tiles.hpp): every tile that holds an element the rule reads (column <=
// row) is computed exactly once, by one warp, in runs within one strip of at most lower_run_most
// tiles; every tile left out lies wholly above the diagonal (zeroed once, never written); and the
// warps' shares are even.
#include <doctest/doctest.h>

#include <map>
#include <tuple>

#include "kernels/gated_delta_tiles.hpp"

using oom::kernels::detail::lower_run_most;
using oom::kernels::detail::LowerRun;
using oom::kernels::detail::LowerTiles;

TEST_CASE("the decay products' lower tiles: each once, in short runs within a strip, the rest above the diagonal") {
  for (const int warps : {8, 4, 16, 3}) {
    for (int n = 1; n <= 64; ++n) {
      CAPTURE(warps);
      CAPTURE(n);
      const LowerTiles tiles(n, warps);
      std::map<std::tuple<int, int, int>, int> owner;  // (product, strip, column tile) -> warp
      int most_a_warp = 0;
      for (int w = 0; w < warps; ++w) {
        int work = 0;
        for (int t = tiles.begin(w), end = tiles.end(w); t < end;) {
          const LowerRun run = tiles.run_at(t, end);
          REQUIRE(run.count >= 1);
          CHECK(run.count <= lower_run_most);
          CHECK((run.product == 0 || run.product == 1));
          CHECK(run.first + run.count <= tiles.in_strip(run.strip));  // within its strip's lower tiles
          for (int y = 0; y < run.count; ++y) CHECK(owner.emplace(std::tuple{run.product, run.strip, run.first + y}, w).second);
          work += run.count;
          t += run.count;
        }
        most_a_warp = std::max(most_a_warp, work);
      }
      CHECK(static_cast<int>(owner.size()) == tiles.total());
      // Even shares: no warp more than its ceiling share of the tiles.
      CHECK(most_a_warp == (tiles.total() + warps - 1) / warps);
      for (int product = 0; product < 2; ++product)
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < n; ++j) {
            const bool computed = owner.count({product, i / 16, j / 8}) == 1;
            if (j <= i) CHECK_MESSAGE(computed, "element (" << i << ", " << j << ") of product " << product << " not computed");
            if (!computed) CHECK(j >= 16 * (i / 16 + 1));  // its whole tile lies above the diagonal
          }
    }
  }
  // A 64-token chunk: 20 of each product's 32 tiles, 5 a warp over the kernels' 8.
  const LowerTiles full(64, 8);
  CHECK(full.total() == 40);
  CHECK(full.end(0) - full.begin(0) == 5);
}
