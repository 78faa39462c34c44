// Which 16 x 8 tiles of a chunk's two decay products (A and Q, n x n, n <= 64 tokens) the chunked
// gated delta rule computes, and how its warps share them (src/kernels/gated_delta_chunked.cu,
// decay_products). Host and device code alike, so the walk is tested on the CPU
// (tests/kernels/test_gated_delta_tiles.cpp).
#pragma once

#ifdef __CUDACC__
#define OOM_TILES_HD __host__ __device__
#else
#define OOM_TILES_HD
#endif

namespace oom::kernels::detail {

/// A warp's tiles at most in one run (a 64-token chunk's 40 lower tiles over 8 warps: 5).
inline constexpr int lower_run_most = 5;

/// Consecutive column tiles [first, first + count) of strip `strip` (rows 16 strip .. 16 strip +
/// 15) of product `product` (0: A, 1: Q).
struct LowerRun {
  int product, strip, first, count;
};

/// The lower tiles of both products: in strip r of an n x n product, the column tiles that hold a
/// column <= a row, 0 .. 2 r + 1 as far as n reaches (20 of 32 at n = 64); every other element of
/// the product lies above the diagonal. Ordered product by product, each's strips from the last,
/// and dealt to `warps` warps in equal shares of consecutive tiles, which a warp takes in runs
/// within one strip (a run shares its rows' fragments).
class LowerTiles {
 public:
  OOM_TILES_HD LowerTiles(int n, int warps) : n_(n), strips_((n + 15) / 16) {
    for (int r = 0; r < strips_; ++r) per_product_ += in_strip(r);
    per_warp_ = (2 * per_product_ + warps - 1) / warps;
  }
  /// Column tiles of strip r that hold a column <= a row.
  [[nodiscard]] OOM_TILES_HD int in_strip(int r) const {
    const int lower = 2 * r + 2, across = (n_ + 7) / 8;
    return lower < across ? lower : across;
  }
  [[nodiscard]] OOM_TILES_HD int total() const { return 2 * per_product_; }
  [[nodiscard]] OOM_TILES_HD int begin(int warp) const { return least(warp * per_warp_, total()); }
  [[nodiscard]] OOM_TILES_HD int end(int warp) const { return least((warp + 1) * per_warp_, total()); }
  /// The run that starts at tile t of a warp's share ending at `end`: to the end of t's strip, of
  /// the share, or lower_run_most tiles, whichever comes first.
  [[nodiscard]] OOM_TILES_HD LowerRun run_at(int t, int end) const {
    int u = t % per_product_, r = strips_ - 1;
    while (u >= in_strip(r)) u -= in_strip(r--);
    return {t / per_product_, r, u, least(least(in_strip(r) - u, end - t), lower_run_most)};
  }

 private:
  OOM_TILES_HD static int least(int a, int b) { return a < b ? a : b; }
  int n_, strips_, per_product_ = 0, per_warp_ = 0;
};

}  // namespace oom::kernels::detail

#undef OOM_TILES_HD
