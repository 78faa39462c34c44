// The gated delta rule a chunk of up to 64 tokens at a time: the math of oom::reference::
// gated_delta_rule_chunked_forward / _chunked_backward (src/reference/gated_delta.cpp), with the
// products of a chunk as small matrix products in shared memory, every value fp32 and the products
// at fp32 accuracy on the tensor cores (block_mma: each operand a pair of tf32 values).
//
// Per chunk of n tokens with G the decay summed from its start, S the state entering it,
// A = strict lower (exp(G_i - G_j) k_i . k_j) and Q = lower (exp(G_i - G_j) q_i . k_j):
//   X = V - diag(exp G) K S;  R_i = X_i - sum_{j<i} A_ij D_j, D = diag(beta) R (the deltas);
//   out = diag(exp G) Q' S + Q D   (Q' the normalised, scaled q rows);
//   S' = exp(G_last) S + K^T diag(exp(G_last - G)) D.
// The state's columns never meet, so the passes that carry it from chunk to chunk run a block per
// (sequence, value head, 32 columns), as the recurrent forward does, and do per chunk a few
// products of (64 x 128) by (128 x 32) where the recurrence did 64 dependent steps.
//
// Forward: one kernel, the state carried in shared memory, kept every chunk as the recurrent
// kernels keep it. Backward: a pass from the last chunk carries the gradient dS of the state
// leaving each chunk (dD = diag(w) K dS + Q^T dO, back substitution through A for dR and h =
// diag(beta) dR, dS_before = exp(G_last) dS + Q'^T diag(exp G) dO - K^T diag(exp G) h) and writes
// dv = h and every chunk's dS; then a block per chunk recomputes the chunk from its kept state
// and its dS and sums what crosses the columns: dq and dk of the normalised rows (per value head,
// for the l2norm's backward in gated_delta.cu), dbeta = sum_e dR R, and dg through the decays.
// That block solves the triangular system once, for M = (I + diag(beta) A)^-1 diag(beta), and
// takes D = M X, R = X - A D, h = M^T dD and dR = dD - A^T h as products, 16 columns at a time.
// The carrying blocks solve theirs 16 rows at a time, 8 lanes a column, the rows after a block
// taking its result as one product (solve_deltas, solve_delta_grads).
// Deterministic: every sum in a fixed order, no atomics.
#include <algorithm>
#include <cstdio>
#include <cstdint>

#include "bf16_device.cuh"
#include "gated_delta_chunked.hpp"

namespace oom::kernels::detail {
namespace {

constexpr int threads = 256;
constexpr int max_rows = static_cast<int>(chunked_max_chunk);  // a chunk's tokens
constexpr int max_dim = 128;                                    // dk and dv
// Row strides in shared memory: a token's row of q or k (ldk) and a chunk x chunk matrix's row
// (ldc). The carrying kernels' rows are 4 banks apart, so the tensor-core fragments' 8 rows x 4
// columns fall in 32 distinct banks; the per-chunk kernel keeps odd strides (its per-row loops
// read a row a thread) and has no shared memory to spare for more.
constexpr int carry_ldk = max_dim + 4, carry_ldc = max_rows + 4;
constexpr int grad_ldk = max_dim + 1, grad_ldc = max_rows + 1;
constexpr int carry_cols = 32;                                  // the state's columns a carrying block owns
constexpr int ldt = carry_cols + 8;                             // 8 banks apart: a fragment's 4 rows x 8 columns distinct
constexpr int chunk_cols = 16;                                  // the columns the per-chunk backward takes at once
constexpr int ldu = chunk_cols + 1;
constexpr float l2_eps = 1e-6f;                                 // as the recurrent kernels' (FLA's) l2norm

// Products on the FMA pipes (block_gemm) where the device has no tf32 tensor cores, or where a
// build for kernel work asks for them (-DOOM_GATED_DELTA_FMA); else on the tensor cores (block_mma).
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800) || defined(OOM_GATED_DELTA_FMA)
#define OOM_GATED_DELTA_ON_FMA 1
#else
#define OOM_GATED_DELTA_ON_FMA 0
#endif

// Phase marks: each is a barrier. Built with -DOOM_GATED_DELTA_PHASES (kernel development), block
// 0 also prints the cycles since the mark before, summed over its chunks, by the marks' numbers.
#ifdef OOM_GATED_DELTA_PHASES
#define PHASES_BEGIN \
  long long phase_cycles[8] = {0, 0, 0, 0, 0, 0, 0, 0}; \
  long long phase_last = clock64();
#define PHASE(k)                                \
  do {                                          \
    __syncthreads();                            \
    const long long phase_now = clock64();      \
    phase_cycles[k] += phase_now - phase_last;  \
    phase_last = phase_now;                     \
  } while (0)
#define PHASES_PRINT(name)                                                                                                  \
  do {                                                                                                                      \
    if (threadIdx.x == 0 && blockIdx.x == 0)                                                                                \
      printf("%s, kcycles by phase: %lld %lld %lld %lld %lld %lld\n", name, phase_cycles[0] / 1000, phase_cycles[1] / 1000, \
             phase_cycles[2] / 1000, phase_cycles[3] / 1000, phase_cycles[4] / 1000, phase_cycles[5] / 1000);                \
  } while (0)
#else
#define PHASES_BEGIN
#define PHASE(k) __syncthreads()
#define PHASES_PRINT(name)
#endif

__device__ int rows_in(const GatedDeltaDims& d, std::int64_t ci) { return static_cast<int>(min(d.chunk, d.seq_len - ci * d.chunk)); }  // chunk ci's tokens
/// The carrying kernels' blocks a (sequence, value head): one per carry_cols columns of the state.
__host__ __device__ std::int64_t carry_tiles(std::int64_t dv) { return (dv + carry_cols - 1) / carry_cols; }

/// C(i, j) = sum_{l < L} A(i, l) B(l, j) for i < M, j < N, handed to out(i, j, C), with A(i, l) at
/// a[i AR + l AC] and B(l, j) at b[l BR + j BC] (strides known at compile time, so the unrolled
/// loop's loads take immediate offsets): each thread a TM x TN tile of C whose rows and columns are
/// mt and nt apart (consecutive threads take consecutive columns: a row-major B is read without bank
/// conflicts, A as a broadcast). Two calls of the same M, N, TM and TN give each thread the same
/// elements, so they may add into one output without a barrier between them.
template <int TM, int TN, int AR, int AC, int BR, int BC, class Out>
__device__ __forceinline__ void block_gemm(int M, int N, int L, const float* a, const float* b, Out out) {
  const int mt = (M + TM - 1) / TM, nt = (N + TN - 1) / TN;
  for (int t = threadIdx.x; t < mt * nt; t += blockDim.x) {
    const int it = t / nt, jt = t % nt;
    const float* ar[TM];
    const float* bc[TN];
#pragma unroll
    for (int x = 0; x < TM; ++x) ar[x] = a + min(it + x * mt, M - 1) * AR;  // rows past M read row M - 1, not stored
#pragma unroll
    for (int y = 0; y < TN; ++y) bc[y] = b + min(jt + y * nt, N - 1) * BC;
    float acc[TM][TN];
#pragma unroll
    for (int x = 0; x < TM; ++x)
#pragma unroll
      for (int y = 0; y < TN; ++y) acc[x][y] = 0.0f;
#pragma unroll 4
    for (int l = 0; l < L; ++l) {
      float av[TM], bv[TN];
#pragma unroll
      for (int x = 0; x < TM; ++x) av[x] = ar[x][l * AC];
#pragma unroll
      for (int y = 0; y < TN; ++y) bv[y] = bc[y][l * BR];
#pragma unroll
      for (int x = 0; x < TM; ++x)
#pragma unroll
        for (int y = 0; y < TN; ++y) acc[x][y] = __fmaf_rn(av[x], bv[y], acc[x][y]);
    }
#pragma unroll
    for (int x = 0; x < TM; ++x)
#pragma unroll
      for (int y = 0; y < TN; ++y)
        if (it + x * mt < M && jt + y * nt < N) out(it + x * mt, jt + y * nt, acc[x][y]);
  }
}

/// x as a tf32 pair, hi + lo == x to within 2^-20 |x|: hi its 10 leading mantissa bits and lo those
/// of the rest, each cut (a mask, on the full-rate integer pipe; cvt.rna.tf32 costs more and
/// measured slower), so exact tf32 values, and x - hi exact in fp32.
__device__ __forceinline__ void split_tf32(float x, std::uint32_t& hi, std::uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}

/// c += a b for one m16n8k8 tile on the tensor cores, tf32 in, fp32 out.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#if !OOM_GATED_DELTA_ON_FMA
/// One warp's (16 WM) x (8 WN) tile of C = A B at (m0, n0) on the tensor cores at fp32 accuracy:
/// block_mma's tile, which says the rest.
template <int WM, int WN, int AR, int AC, int BR, int BC, class Out>
__device__ __forceinline__ void warp_mma(int M, int N, int L, const float* a, const float* b, int m0, int n0, Out out) {
  const int lane = threadIdx.x % 32, gr = lane / 4, tg = lane % 4;
  const float* ar[WM][2];  // the fragment's rows gr and gr + 8 of each 16-row tile
  const float* bc[WN];     // its column gr of each 8-column tile
#pragma unroll
  for (int x = 0; x < WM; ++x)
#pragma unroll
    for (int h = 0; h < 2; ++h) ar[x][h] = a + min(m0 + 16 * x + 8 * h + gr, M - 1) * AR;
#pragma unroll
  for (int y = 0; y < WN; ++y) bc[y] = b + min(n0 + 8 * y + gr, N - 1) * BC;
  float acc[WM][WN][4];
#pragma unroll
  for (int x = 0; x < WM; ++x)
#pragma unroll
    for (int y = 0; y < WN; ++y)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[x][y][r] = 0.0f;
  const auto step = [&](int k0, bool tail) {
    std::uint32_t ahi[WM][4], alo[WM][4], bhi[WN][2], blo[WN][2];
#pragma unroll
    for (int x = 0; x < WM; ++x)
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a_r: row gr (+ 8 for odd r), column tg (+ 4 for r >= 2)
        const int l = k0 + tg + 4 * (r / 2);
        split_tf32(!tail || l < L ? ar[x][r % 2][l * AC] : 0.0f, ahi[x][r], alo[x][r]);
      }
#pragma unroll
    for (int y = 0; y < WN; ++y)
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // b_r: row tg (+ 4 for r = 1), column gr
        const int l = k0 + tg + 4 * r;
        split_tf32(!tail || l < L ? bc[y][l * BR] : 0.0f, bhi[y][r], blo[y][r]);
      }
#pragma unroll
    for (int x = 0; x < WM; ++x)
#pragma unroll
      for (int y = 0; y < WN; ++y) {
        mma_tf32(acc[x][y], alo[x], bhi[y]);
        mma_tf32(acc[x][y], ahi[x], blo[y]);
        mma_tf32(acc[x][y], ahi[x], bhi[y]);
      }
  };
  const int whole = L / 8 * 8;
#pragma unroll 2
  for (int k0 = 0; k0 < whole; k0 += 8) step(k0, false);
  if (whole < L) step(whole, true);
#pragma unroll
  for (int x = 0; x < WM; ++x)
#pragma unroll
    for (int y = 0; y < WN; ++y)
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // c_r: row gr (+ 8 for r >= 2), column 2 tg (+ 1 for odd r)
        const int i = m0 + 16 * x + gr + 8 * (r / 2), j = n0 + 8 * y + 2 * tg + r % 2;
        if (i < M && j < N) out(i, j, acc[x][y][r]);
      }
}
#endif

/// block_gemm's product on the tensor cores at fp32 accuracy: each operand split into a tf32 pair
/// and the three products that matter summed (a_lo b_hi + a_hi b_lo + a_hi b_hi, smallest first;
/// a_lo b_lo, below 2^-20 of the product, left out), accumulated in fp32. Each warp a (16 WM) x
/// (8 WN) tile of C; out(i, j, C) by the thread the tile's fragment gives (i, j). The same M, N, WM
/// and WN give each thread the same elements, so two calls may add into one output without a
/// barrier between them. Inner indices past L read as zeros in both operands; rows past M and
/// columns past N read row M - 1 and column N - 1 and are not stored.
template <int WM, int WN, int AR, int AC, int BR, int BC, class Out>
__device__ __forceinline__ void block_mma(int M, int N, int L, const float* a, const float* b, Out out) {
#if OOM_GATED_DELTA_ON_FMA
  block_gemm<2, 2, AR, AC, BR, BC>(M, N, L, a, b, out);  // no tf32 tensor cores (or, for kernel work, the FMA pipes asked for)
#else
  const int mt = (M + 16 * WM - 1) / (16 * WM), nt = (N + 8 * WN - 1) / (8 * WN);
  for (int tile = threadIdx.x / 32; tile < mt * nt; tile += blockDim.x / 32)
    warp_mma<WM, WN, AR, AC, BR, BC>(M, N, L, a, b, tile / nt * 16 * WM, tile % nt * 8 * WN, out);
#endif
}

/// The rows a triangular solve takes one after another; the rows after them take the block's
/// result at once, as a product on the tensor cores.
constexpr int solve_rows = 16;

/// R_i = X_i - sum_{j<i} A_ij D_j and D_i = beta_i R_i for `cols` columns of row stride LD (A's rows
/// LDA apart), 16 rows at a time: within a block GROUPS consecutive lanes take a column (cols x
/// GROUPS <= blockDim), each holding every GROUPS-th of its rows in registers, and once D_j is
/// known (from the lane holding row j, by a shuffle) every row of the block takes it at once; then
/// the rows below take the block's D as one product. A is strictly lower (zeros on and above the
/// diagonal for the chunk's n rows). R goes into X, or with `w` given w_i D_i (what the forward's
/// state update takes). The arrays do not overlap. Every thread of the block must call it (it
/// synchronises).
template <int LD, int LDA, int GROUPS>
__device__ void solve_deltas(int n, int cols, const float* __restrict__ A, float* __restrict__ X, float* __restrict__ D,
                             const float* __restrict__ beta, const float* __restrict__ w = nullptr) {
  static_assert(32 % GROUPS == 0 && solve_rows % GROUPS == 0, "a column's lanes in one warp");
  constexpr int per = solve_rows / GROUPS;
  const int grp = static_cast<int>(threadIdx.x) % GROUPS, col = static_cast<int>(threadIdx.x) / GROUPS;
  const bool active = static_cast<int>(threadIdx.x & ~31u) / GROUPS < cols;  // the warp has a column (uniform)
  const bool mine = col < cols;
  for (int r0 = 0; r0 < n; r0 += solve_rows) {
    const int rows = min(solve_rows, n - r0);
    if (active) {
      float r[per];  // rows r0 + grp + GROUPS x
#pragma unroll
      for (int x = 0; x < per; ++x) r[x] = mine && grp + GROUPS * x < rows ? X[(r0 + grp + GROUPS * x) * LD + col] : 0.0f;
#pragma unroll
      for (int j = 0; j < solve_rows; ++j) {
        if (j < rows) {
          const float rj = __shfl_sync(0xffffffffu, r[j / GROUPS], j % GROUPS, GROUPS);
          const float dj = beta[r0 + j] * rj;
          if (mine && grp == j % GROUPS) {
            D[(r0 + j) * LD + col] = dj;
            X[(r0 + j) * LD + col] = w != nullptr ? w[r0 + j] * dj : rj;
          }
#pragma unroll
          for (int x = 0; x < per; ++x) r[x] = __fmaf_rn(-A[(r0 + grp + GROUPS * x) * LDA + r0 + j], dj, r[x]);
        }
      }
    }
    __syncthreads();
    if (r0 + solve_rows < n) {  // the rows below: X -= A[below, block] D[block]
      const int below = r0 + solve_rows;
      block_mma<1, 1, LDA, 1, LD, 1>(n - below, cols, solve_rows, A + below * LDA + r0, D + r0 * LD,
                                     [&](int i, int j, float x) { X[(below + i) * LD + j] -= x; });
      __syncthreads();
    }
  }
}

/// Its transpose, from the last block: dR_i = dD_i - sum_{l>i} A_li h_l (into dD) and h_i = beta_i
/// dR_i, the lanes and rows as above (row l of A is zero from column l on); the rows above take the
/// block's h as one product. Every thread of the block must call it.
template <int LD, int LDA, int GROUPS>
__device__ void solve_delta_grads(int n, int cols, const float* __restrict__ A, float* __restrict__ dD, float* __restrict__ H,
                                  const float* __restrict__ beta) {
  static_assert(32 % GROUPS == 0 && solve_rows % GROUPS == 0, "a column's lanes in one warp");
  constexpr int per = solve_rows / GROUPS;
  const int grp = static_cast<int>(threadIdx.x) % GROUPS, col = static_cast<int>(threadIdx.x) / GROUPS;
  const bool active = static_cast<int>(threadIdx.x & ~31u) / GROUPS < cols;
  const bool mine = col < cols;
  for (int r0 = (n - 1) / solve_rows * solve_rows; r0 >= 0; r0 -= solve_rows) {
    const int rows = min(solve_rows, n - r0);
    if (active) {
      float r[per];
#pragma unroll
      for (int x = 0; x < per; ++x) r[x] = mine && grp + GROUPS * x < rows ? dD[(r0 + grp + GROUPS * x) * LD + col] : 0.0f;
#pragma unroll
      for (int l = solve_rows - 1; l >= 0; --l) {
        if (l < rows) {
          const float rl = __shfl_sync(0xffffffffu, r[l / GROUPS], l % GROUPS, GROUPS);
          const float hl = beta[r0 + l] * rl;
          if (mine && grp == l % GROUPS) {
            dD[(r0 + l) * LD + col] = rl;
            H[(r0 + l) * LD + col] = hl;
          }
#pragma unroll
          for (int x = 0; x < per; ++x) r[x] = __fmaf_rn(-A[(r0 + l) * LDA + r0 + grp + GROUPS * x], hl, r[x]);
        }
      }
    }
    __syncthreads();
    if (r0 > 0) {  // the rows above: dD -= A[block, above]^T h[block]
      block_mma<1, 1, 1, LDA, LD, 1>(r0, cols, rows, A + r0 * LDA, H + r0 * LD, [&](int i, int j, float x) { dD[i * LD + j] -= x; });
      __syncthreads();
    }
  }
}

/// A chunk's per-token quantities in shared memory: the l2-normalised k rows and q rows (q also by
/// 1 / sqrt(dk)), G, exp(G), w = exp(G_last - G), beta, and A and Q as the header says.
struct Chunk {
  float *kn, *qn, *A, *Q, *G, *eg, *w, *beta;
};

/// Whether a chunk's q and k rows load as 16-byte vectors with each row's vectors in consecutive
/// lanes of one warp: rows of 8, 16, 32, 64 or 128 values (a power of two of vectors, at most 16),
/// rows 16 bytes apart, 16-byte aligned arrays.
__device__ bool rows_vectorised(const GatedDeltaDims& d, const std::uint16_t* q, const std::uint16_t* k) {
  const std::int64_t per_row = d.k_dim / 8;
  return d.k_dim % 8 == 0 && (per_row & (per_row - 1)) == 0 && d.qk_stride % 8 == 0 &&
         (reinterpret_cast<std::uintptr_t>(q) | reinterpret_cast<std::uintptr_t>(k)) % 16 == 0;
}

constexpr int row_vectors = 2 * max_rows * (max_dim / 8) / threads;  // a thread's share of a chunk's q and k vectors
constexpr int tile_values = max_rows * carry_cols / threads;         // and of a carrying block's v or d_out tile
static_assert(row_vectors * threads == 2 * max_rows * (max_dim / 8) && tile_values * threads == max_rows * carry_cols);

/// What a thread reads of a chunk from global memory, held in registers: the carrying kernels load
/// the next chunk's while this one computes, so its latency is off their sequential path.
struct Loads {
  uint4 qk[row_vectors];          // the q rows' vectors, then the k rows' (rows_vectorised)
  std::uint16_t x[tile_values];   // the carrying block's columns of v (forward) or d_out (carry)
  float g = 0.0f, beta = 0.0f;    // token threadIdx.x's
};

/// Loads tokens [t0, t0 + n) of (sequence b, value head h): with g given, g and beta; with `vec`, the q rows (and
/// with `which` 2 the k rows) of its key head; with x given, columns [j0, j0 + carry_cols) of x
/// (rows x_stride apart).
__device__ void fetch(const GatedDeltaDims& d, std::int64_t b, std::int64_t h, std::int64_t t0, int n, bool vec, int which,
                      const std::uint16_t* q, const std::uint16_t* k, const float* g, const float* beta, const std::uint16_t* x,
                      std::int64_t x_stride, std::int64_t j0, Loads& p) {
  const std::int64_t H = d.v_heads, row0 = (b * d.seq_len + t0) * H + h;
  const int tid = static_cast<int>(threadIdx.x);
  if (g != nullptr && tid < n) {
    p.g = g[row0 + tid * H];
    p.beta = beta[row0 + tid * H];
  }
  if (x != nullptr)
#pragma unroll
    for (int u = 0; u < tile_values; ++u) {
      const int e = tid + u * threads, i = e / carry_cols, j = e % carry_cols;
      if (i < n && j0 + j < d.v_dim) p.x[u] = x[(b * d.seq_len + t0 + i) * x_stride + h * d.v_dim + j0 + j];
    }
  if (!vec) return;
  const int dk = static_cast<int>(d.k_dim), per_row = dk / 8, vectors = which * n * per_row;
  const std::int64_t first = (b * d.seq_len + t0) * d.qk_stride + h / (d.v_heads / d.k_heads) * dk;
#pragma unroll
  for (int u = 0; u < row_vectors; ++u) {
    const int e = tid + u * threads, row = e / per_row, i = row % n;
    if (e < vectors) p.qk[u] = *reinterpret_cast<const uint4*>((row < n ? q : k) + first + i * d.qk_stride + e % per_row * 8);
  }
}

/// The l2norm's scale of a row whose squares this lane summed (a run of 8 values, in order) and
/// whose other lanes are the `group` lanes around it (a power of two): the runs summed by a tree of
/// shuffles, the same sums in the same order whatever the group (lanes past the row add zeros).
__device__ __forceinline__ float l2_scale(float ss, int group, float scale) {
  for (int o = group / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return 1.0f / sqrtf(ss + l2_eps) * scale;
}

/// The q rows (and with `which` 2 the k rows) normalised into qn (q also by 1 / sqrt(dk)) and kn
/// (LDK apart): from the vectors `fetch` loaded, or where the rows are not vectorised, loaded here
/// and normalised a warp a row with the same sums. Synchronises before returning.
template <int LDK>
__device__ void store_normalised(const GatedDeltaDims& d, std::int64_t b, std::int64_t h, std::int64_t t0, int n, bool vec,
                                 int which, const std::uint16_t* q, const std::uint16_t* k, const Loads& p, float* qn, float* kn) {
  const int dk = static_cast<int>(d.k_dim), lane = static_cast<int>(threadIdx.x % 32);
  const float scale = 1.0f / sqrtf(static_cast<float>(dk));
  if (vec) {
    const int per_row = dk / 8, vectors = which * n * per_row;
#pragma unroll
    for (int u = 0; u < row_vectors; ++u) {
      if (static_cast<int>(threadIdx.x) - lane + u * threads >= vectors) break;  // uniform: the warp's rows are all past
      const int e = static_cast<int>(threadIdx.x) + u * threads, row = e / per_row, i = row % n;
      float f[8];
      float ss = 0.0f;
      if (e < vectors) {  // a row's lanes are all in or all out
        unpack_bf16(p.qk[u], f);
#pragma unroll
        for (int x = 0; x < 8; ++x) ss = __fmaf_rn(f[x], f[x], ss);
      }
      const float inv = l2_scale(ss, per_row, row < n ? scale : 1.0f);
      if (e >= vectors) continue;
      float* dst = (row < n ? qn : kn) + i * LDK + e % per_row * 8;
      if constexpr (LDK % 4 == 0) {  // rows 16-byte aligned: two 16-byte stores
        reinterpret_cast<float4*>(dst)[0] = make_float4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
        reinterpret_cast<float4*>(dst)[1] = make_float4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv);
      } else {
#pragma unroll
        for (int x = 0; x < 8; ++x) dst[x] = f[x] * inv;
      }
    }
    __syncthreads();
    return;
  }
  const std::int64_t first = (b * d.seq_len + t0) * d.qk_stride + h / (d.v_heads / d.k_heads) * dk;
  for (int e = static_cast<int>(threadIdx.x); e < which * n * dk; e += blockDim.x) {
    const int r = e / dk, a = e % dk, i = r % n;
    (r < n ? qn : kn)[i * LDK + a] = bf16_to_float((r < n ? q : k)[first + i * d.qk_stride + a]);
  }
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
  for (int r = warp; r < which * n; r += warps) {
    float* row = (r < n ? qn : kn) + (r % n) * LDK;
    float ss = 0.0f;
    for (int x = 0; x < 8; ++x)
      if (lane * 8 + x < dk) ss = __fmaf_rn(row[lane * 8 + x], row[lane * 8 + x], ss);
    const float inv = l2_scale(ss, 32, r < n ? scale : 1.0f);
    __syncwarp();  // every lane's reads of the row before any lane's writes
    for (int a = lane; a < dk; a += 32) row[a] *= inv;
  }
  __syncthreads();
}

/// Fills c for tokens [t0, t0 + n) from what `fetch` loaded (`x`, if given, into the carrying
/// block's tile, ldt apart, zeros past dv), all but A and Q (decay_products). Synchronises before
/// returning.
template <int LDK>
__device__ void prepare(const GatedDeltaDims& d, std::int64_t b, std::int64_t h, std::int64_t t0, int n, bool vec,
                        const std::uint16_t* q, const std::uint16_t* k, const Loads& p, std::int64_t j0, float* x, const Chunk& c) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < n) {
    c.eg[tid] = p.g;
    c.beta[tid] = p.beta;
  }
  if (x != nullptr)
#pragma unroll
    for (int u = 0; u < tile_values; ++u) {
      const int e = tid + u * threads, i = e / carry_cols, j = e % carry_cols;
      if (i < n) x[i * ldt + j] = j0 + j < d.v_dim ? bf16_to_float(p.x[u]) : 0.0f;
    }
  store_normalised<LDK>(d, b, h, t0, n, vec, 2, q, k, p, c.qn, c.kn);  // synchronises
  if (threadIdx.x < 32) {  // G, the gates summed from the chunk's start: a scan over the warp, rows l and l + 32 a lane
    const int l = static_cast<int>(threadIdx.x);
    float lo = l < n ? c.eg[l] : 0.0f, hi = l + 32 < n ? c.eg[l + 32] : 0.0f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float up_lo = __shfl_up_sync(0xffffffffu, lo, o), up_hi = __shfl_up_sync(0xffffffffu, hi, o);
      if (l >= o) {
        lo += up_lo;
        hi += up_hi;
      }
    }
    hi += __shfl_sync(0xffffffffu, lo, 31);
    const float last = __shfl_sync(0xffffffffu, n > 32 ? hi : lo, (n - 1) % 32);
    if (l < n) {
      c.G[l] = lo;
      c.eg[l] = expf(lo);
      c.w[l] = expf(last - lo);
    }
    if (l + 32 < n) {
      c.G[l + 32] = hi;
      c.eg[l + 32] = expf(hi);
      c.w[l + 32] = expf(last - hi);
    }
  }
  __syncthreads();
}

/// A and Q of the chunk `prepare` filled (k rows, and q rows, by k rows, with the decays), whole:
/// the elements above the diagonal are written as zeros. (Taking only the tiles on and below it,
/// 20 of a 64-token chunk's 32 a product dealt to the warps in runs, made the forward 1.21x slower
/// on the H100, 2026-12-05: docs/performance.md, forty-sixth section.) Synchronises before
/// returning.
template <int LDK, int LDC>
__device__ void decay_products(int n, int dk, const Chunk& c) {
  const auto write = [&](float* m, bool strict) {
    return [&c, m, strict](int i, int j, float x) { m[i * LDC + j] = (strict ? j < i : j <= i) ? expf(c.G[i] - c.G[j]) * x : 0.0f; };
  };
  block_mma<2, 2, LDK, 1, 1, LDK>(n, n, dk, c.kn, c.kn, write(c.A, true));
  block_mma<2, 2, LDK, 1, 1, LDK>(n, n, dk, c.qn, c.kn, write(c.Q, false));
  __syncthreads();
}

/// Carves the chunk's arrays from `at`; returns the next free float.
template <int LDK, int LDC>
__device__ float* carve(Chunk& c, float* at, bool with_q_rows) {
  c.kn = at;
  at += max_rows * LDK;
  if (with_q_rows) {
    c.qn = at;
    at += max_rows * LDK;
  }
  c.A = at;
  c.Q = at + max_rows * LDC;
  at += 2 * max_rows * LDC;
  c.G = at;
  c.eg = at + max_rows;
  c.w = at + 2 * max_rows;
  c.beta = at + 3 * max_rows;
  return at + 4 * max_rows;
}
template <int LDK, int LDC>
constexpr std::size_t chunk_floats(bool with_q_rows) {
  return static_cast<std::size_t>((with_q_rows ? 2 : 1) * max_rows * LDK + 2 * max_rows * LDC + 4 * max_rows);
}

/// Rows of a (dk, dv) state's columns [j0, j0 + cols) to or from a shared tile (ld apart), zeros
/// past dv.
__device__ void load_state(const GatedDeltaDims& d, const float* m, std::int64_t j0, int cols, int ld, float* tile) {
  for (int e = threadIdx.x; e < d.k_dim * cols; e += blockDim.x) {
    const int a = e / cols, j = e % cols;
    tile[a * ld + j] = j0 + j < d.v_dim ? m[a * d.v_dim + j0 + j] : 0.0f;
  }
}
__device__ void save_state(const GatedDeltaDims& d, const float* tile, std::int64_t j0, int cols, int ld, float* m) {
  for (int e = threadIdx.x; e < d.k_dim * cols; e += blockDim.x) {
    const int a = e / cols, j = e % cols;
    if (j0 + j < d.v_dim) m[a * d.v_dim + j0 + j] = tile[a * ld + j];
  }
}
// ---- forward ------------------------------------------------------------------------------------

constexpr std::size_t forward_floats = chunk_floats<carry_ldk, carry_ldc>(true) + max_dim * ldt + 3 * max_rows * ldt;

__global__ void __launch_bounds__(threads, 1) chunked_forward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                                                  const std::uint16_t* v, const float* g, const float* beta,
                                                                  std::uint16_t* out, float* states) {
  extern __shared__ __align__(16) float smem[];  // 16-byte stores into the q and k rows
  Chunk c;
  constexpr int ldk = carry_ldk, ldc = carry_ldc;
  float* S = carve<ldk, ldc>(c, smem, true);
  float* X = S + max_dim * ldt;
  float* D = X + max_rows * ldt;
  float* O = D + max_rows * ldt;
  const std::int64_t H = d.v_heads, tiles = carry_tiles(d.v_dim);
  const std::int64_t bh = blockIdx.x / tiles, b = bh / H, h = bh % H, j0 = blockIdx.x % tiles * carry_cols;
  const int dk = static_cast<int>(d.k_dim);
  float* kept = states + bh * d.states_stride;
  if (d.from_kept_state) load_state(d, kept, j0, carry_cols, ldt, S);
  else
    for (int e = threadIdx.x; e < max_dim * ldt; e += blockDim.x) S[e] = 0.0f;
  const std::int64_t chunks = chunks_of(d);
  const bool vec = rows_vectorised(d, q, k);
  Loads p;  // the chunk's reads, issued a chunk ahead
  fetch(d, b, h, 0, rows_in(d, 0), vec, 2, q, k, g, beta, v, d.v_stride, j0, p);
  PHASES_BEGIN
  for (std::int64_t ci = 0; ci < chunks; ++ci) {
    __syncthreads();
    save_state(d, S, j0, carry_cols, ldt, kept + ci * d.k_dim * d.v_dim);
    const std::int64_t t0 = ci * d.chunk;
    const int n = rows_in(d, ci);
    PHASE(0);
    prepare<ldk>(d, b, h, t0, n, vec, q, k, p, j0, X, c);
    if (ci + 1 < chunks) fetch(d, b, h, t0 + d.chunk, rows_in(d, ci + 1), vec, 2, q, k, g, beta, v, d.v_stride, j0, p);
    PHASE(5);
    decay_products<ldk, ldc>(n, dk, c);
    PHASE(1);
    // X -= diag(exp G) K S; O = diag(exp G) Q' S.
    block_mma<1, 2, ldk, 1, ldt, 1>(n, carry_cols, dk, c.kn, S, [&](int i, int j, float x) { X[i * ldt + j] -= c.eg[i] * x; });
    block_mma<1, 2, ldk, 1, ldt, 1>(n, carry_cols, dk, c.qn, S, [&](int i, int j, float x) { O[i * ldt + j] = c.eg[i] * x; });
    PHASE(2);
    solve_deltas<ldt, ldc, 8>(n, carry_cols, c.A, X, D, c.beta, c.w);  // X = diag(w) D; 32 columns x 8 lanes = the block
    PHASE(3);
    // out = O + Q D; S = exp(G_last) S + K^T diag(w) D.
    std::uint16_t* o = out + ((b * d.seq_len + t0) * H + h) * d.v_dim + j0;
    block_mma<1, 2, ldc, 1, ldt, 1>(n, carry_cols, n, c.Q, D, [&](int i, int j, float x) {
      if (j0 + j < d.v_dim) o[i * H * d.v_dim + j] = float_to_bf16(O[i * ldt + j] + x);
    });
    const float last = c.eg[n - 1];
    block_mma<2, 2, 1, ldk, ldt, 1>(dk, carry_cols, n, c.kn, X,
                                      [&](int a, int j, float x) { S[a * ldt + j] = __fmaf_rn(last, S[a * ldt + j], x); });
    PHASE(4);
  }
  PHASES_PRINT("forward (0 the kept state, 5 the rows and gates, 1 A and Q, 2 K S and Q S, 3 solve, 4 out and the state)");
  __syncthreads();
  save_state(d, S, j0, carry_cols, ldt, kept + chunks * d.k_dim * d.v_dim);
}

// ---- backward: the state's gradient from the last chunk -------------------------------------------

constexpr std::size_t carry_floats = chunk_floats<carry_ldk, carry_ldc>(true) + max_dim * ldt + 3 * max_rows * ldt;
static_assert(forward_floats * sizeof(float) <= 227 * 1024 && carry_floats * sizeof(float) <= 227 * 1024,
              "the carrying kernels fit an SM's shared memory");

__global__ void __launch_bounds__(threads, 1) chunked_carry_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                                                const float* g, const float* beta, const std::uint16_t* d_out,
                                                                std::uint16_t* dv_out, float* d_state, float* dS_all) {
  extern __shared__ __align__(16) float smem[];  // 16-byte stores into the q and k rows
  Chunk c;
  constexpr int ldk = carry_ldk, ldc = carry_ldc;
  float* dS = carve<ldk, ldc>(c, smem, true);
  float* dO = dS + max_dim * ldt;
  float* dD = dO + max_rows * ldt;
  float* Hh = dD + max_rows * ldt;
  const std::int64_t H = d.v_heads, tiles = carry_tiles(d.v_dim), chunks = chunks_of(d);
  const std::int64_t bh = blockIdx.x / tiles, b = bh / H, h = bh % H, j0 = blockIdx.x % tiles * carry_cols;
  const std::int64_t state = d.k_dim * d.v_dim;
  const int dk = static_cast<int>(d.k_dim);
  if (d_state != nullptr) load_state(d, d_state + bh * state, j0, carry_cols, ldt, dS);
  else
    for (int e = threadIdx.x; e < max_dim * ldt; e += blockDim.x) dS[e] = 0.0f;
  const bool vec = rows_vectorised(d, q, k);
  Loads p;  // the chunk's reads, issued a chunk ahead
  fetch(d, b, h, (chunks - 1) * d.chunk, rows_in(d, chunks - 1), vec, 2, q, k, g, beta, d_out, H * d.v_dim, j0, p);
  PHASES_BEGIN
  for (std::int64_t ci = chunks - 1; ci >= 0; --ci) {
    __syncthreads();
    save_state(d, dS, j0, carry_cols, ldt, dS_all + (bh * chunks + ci) * state);
    const std::int64_t t0 = ci * d.chunk;
    const int n = rows_in(d, ci);
    PHASE(0);
    prepare<ldk>(d, b, h, t0, n, vec, q, k, p, j0, dO, c);
    if (ci > 0) fetch(d, b, h, t0 - d.chunk, rows_in(d, ci - 1), vec, 2, q, k, g, beta, d_out, H * d.v_dim, j0, p);
    PHASE(5);
    decay_products<ldk, ldc>(n, dk, c);
    PHASE(1);
    // dD = diag(w) K dS + Q^T dO (the same threads' elements in both).
    block_mma<1, 2, ldk, 1, ldt, 1>(n, carry_cols, dk, c.kn, dS, [&](int i, int j, float x) { dD[i * ldt + j] = c.w[i] * x; });
    block_mma<1, 2, 1, ldc, ldt, 1>(n, carry_cols, n, c.Q, dO, [&](int i, int j, float x) { dD[i * ldt + j] += x; });
    PHASE(2);
    solve_delta_grads<ldt, ldc, 8>(n, carry_cols, c.A, dD, Hh, c.beta);  // 32 columns x 8 lanes = the block
    PHASE(3);
    // dv = h; then dO and h scaled by exp G (into dD and h) for the state's gradient.
    for (int e = threadIdx.x; e < n * carry_cols; e += blockDim.x) {
      const int i = e / carry_cols, j = e % carry_cols;
      const float hv = Hh[i * ldt + j];
      if (j0 + j < d.v_dim) dv_out[(b * d.seq_len + t0 + i) * d.v_stride + h * d.v_dim + j0 + j] = float_to_bf16(hv);
      dD[i * ldt + j] = c.eg[i] * dO[i * ldt + j];
      Hh[i * ldt + j] = -(c.eg[i] * hv);
    }
    __syncthreads();
    // dS = exp(G_last) dS + Q'^T diag(exp G) dO - K^T diag(exp G) h.
    const float last = c.eg[n - 1];
    block_mma<2, 2, 1, ldk, ldt, 1>(dk, carry_cols, n, c.qn, dD,
                                      [&](int a, int j, float x) { dS[a * ldt + j] = __fmaf_rn(last, dS[a * ldt + j], x); });
    block_mma<2, 2, 1, ldk, ldt, 1>(dk, carry_cols, n, c.kn, Hh, [&](int a, int j, float x) { dS[a * ldt + j] += x; });
    PHASE(4);
  }
  PHASES_PRINT("carry (0 the kept gradient, 5 the rows and gates, 1 A and Q, 2 dD, 3 solve, 4 the state's gradient)");
  __syncthreads();
  if (d_state != nullptr) save_state(d, dS, j0, carry_cols, ldt, d_state + bh * state);
}

// ---- backward: each chunk from its kept state and its dS --------------------------------------------

// The per-chunk tiles (chunk_cols columns): S0 and dS (dk rows); X (then R), U = K S0, D, P = K dS,
// dD (then dR), h, dO (chunk rows). The q rows share their space: loaded before and after the tiles.
constexpr std::size_t tile_floats = 2 * max_dim * ldu + 7 * max_rows * ldu;
static_assert(tile_floats >= static_cast<std::size_t>(max_rows * grad_ldk), "the q rows fit the tiles' space");
constexpr int ldq = max_dim;  // the dq' and dk accumulators' rows (written and read along rows only)
constexpr std::size_t chunk_grad_floats =
    chunk_floats<grad_ldk, grad_ldc>(false) + 2 * max_rows * ldq + 3 * max_rows * grad_ldc + tile_floats + 3 * max_rows + max_dim + 2;
static_assert(chunk_grad_floats * sizeof(float) <= 227 * 1024, "the per-chunk backward fits an SM's shared memory");
static_assert(tile_floats >= static_cast<std::size_t>(max_rows * grad_ldc), "the identity for M fits the tiles' space");

constexpr int state_tile_values = max_dim * chunk_cols / threads;  // a thread's share of a (dk x chunk_cols) state tile
constexpr int row_tile_values = max_rows * chunk_cols / threads;   // and of a (chunk x chunk_cols) v or d_out tile
static_assert(state_tile_values * threads == max_dim * chunk_cols && row_tile_values * threads == max_rows * chunk_cols);

/// A thread's reads of one column tile of the per-chunk kernel, held in registers.
struct TileLoads {
  float s0[state_tile_values], ds[state_tile_values];  // the kept state's and its gradient's
  std::uint16_t x[row_tile_values], o[row_tile_values];  // v's and d_out's
};

/// Loads columns [j0, j0 + chunk_cols) of the chunk's kept state and state gradient (zeros past dk
/// and dv) and of its v and d_out rows.
__device__ void fetch_tile(const GatedDeltaDims& d, const float* S0, const float* dS, const std::uint16_t* v, const std::uint16_t* d_out,
                           std::int64_t b, std::int64_t h, std::int64_t t0, int n, std::int64_t j0, TileLoads& p) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int u = 0; u < state_tile_values; ++u) {
    const int e = tid + u * threads, a = e / chunk_cols, j = e % chunk_cols;
    const bool in = a < d.k_dim && j0 + j < d.v_dim;
    p.s0[u] = in ? S0[a * d.v_dim + j0 + j] : 0.0f;
    p.ds[u] = in ? dS[a * d.v_dim + j0 + j] : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < row_tile_values; ++u) {
    const int e = tid + u * threads, i = e / chunk_cols, j = e % chunk_cols;
    const bool in = i < n && j0 + j < d.v_dim;
    const std::int64_t token = b * d.seq_len + t0 + i;
    p.x[u] = in ? v[token * d.v_stride + h * d.v_dim + j0 + j] : std::uint16_t{0};
    p.o[u] = in ? d_out[(token * d.v_heads + h) * d.v_dim + j0 + j] : std::uint16_t{0};
  }
}

/// The tile `fetch_tile` loaded into the shared tiles (ldu apart; the chunk's n rows of X and dO).
__device__ void store_tile(int n, const TileLoads& p, float* S0, float* dS, float* X, float* dO) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int u = 0; u < state_tile_values; ++u) {
    const int e = tid + u * threads, a = e / chunk_cols, j = e % chunk_cols;
    S0[a * ldu + j] = p.s0[u];
    dS[a * ldu + j] = p.ds[u];
  }
#pragma unroll
  for (int u = 0; u < row_tile_values; ++u) {
    const int e = tid + u * threads, i = e / chunk_cols, j = e % chunk_cols;
    if (i < n) {
      X[i * ldu + j] = bf16_to_float(p.x[u]);
      dO[i * ldu + j] = bf16_to_float(p.o[u]);
    }
  }
}

__global__ void __launch_bounds__(threads, 1) chunked_grad_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                                               const std::uint16_t* v, const float* g, const float* beta,
                                                               const std::uint16_t* d_out, const float* states, const float* dS_all,
                                                               float* dg, float* dbeta, float* dq_part, float* dk_part) {
  extern __shared__ __align__(16) float smem[];  // 16-byte stores into the q and k rows
  Chunk c;
  constexpr int ldk = grad_ldk, ldc = grad_ldc;
  float* dQ = carve<ldk, ldc>(c, smem, false);  // d loss / d q' rows (n, dk)
  float* dK = dQ + max_rows * ldq;
  float* dqk = dK + max_rows * ldq;   // d loss / d Q (before the decays), (n, n)
  float* dkk = dqk + max_rows * ldc;  // d loss / d A
  float* M = dkk + max_rows * ldc;    // (I + diag(beta) A)^-1 diag(beta): D = M X, h = M^T dD
  float* area = M + max_rows * ldc;
  float* S0 = area;
  float* dS = S0 + max_dim * ldu;
  float* X = dS + max_dim * ldu;
  float* U = X + max_rows * ldu;
  float* D = U + max_rows * ldu;
  float* P = D + max_rows * ldu;
  float* dD = P + max_rows * ldu;
  float* Hh = dD + max_rows * ldu;
  float* dO = Hh + max_rows * ldu;
  float* dG = area + tile_floats;  // (n): d loss / d G
  float* dB = dG + max_rows;       // (n): d loss / d beta
  float* dQo = dB + max_rows;      // (n): the out term of dG, q' . dq'
  float* part = dQo + max_rows;    // (dk): S0 . dS by rows of the state
  float* last_grad = part + max_dim;  // d loss / d G_last from the state's terms
  c.qn = area;

  const std::int64_t H = d.v_heads, chunks = chunks_of(d), state = d.k_dim * d.v_dim;
  const std::int64_t bh = blockIdx.x / chunks, ci = blockIdx.x % chunks, b = bh / H, h = bh % H;
  const std::int64_t t0 = ci * d.chunk;
  const int n = static_cast<int>(min(d.chunk, d.seq_len - t0)), dk = static_cast<int>(d.k_dim);
  const bool vec = rows_vectorised(d, q, k);
  PHASES_BEGIN
  {
    Loads p;
    fetch(d, b, h, t0, n, vec, 2, q, k, g, beta, nullptr, 0, 0, p);
    prepare<ldk>(d, b, h, t0, n, vec, q, k, p, 0, nullptr, c);
  }
  decay_products<ldk, ldc>(n, dk, c);
  PHASE(0);
  for (int e = threadIdx.x; e < max_rows * ldq; e += blockDim.x) dQ[e] = dK[e] = 0.0f;
  for (int e = threadIdx.x; e < max_rows * ldc; e += blockDim.x) {
    dqk[e] = dkk[e] = 0.0f;
    area[e] = e / ldc == e % ldc ? 1.0f : 0.0f;  // the identity, solved for M
  }
  if (threadIdx.x < max_rows) dG[threadIdx.x] = dB[threadIdx.x] = 0.0f;
  // dG_last's two terms, summed over the tiles by the threads that own their rows: w_i D_i . P_i
  // (thread i) and S0_a . dS_a (thread 128 + a); added up once, after the tiles.
  float last_rows = 0.0f, last_state = 0.0f;
  const float* S0_all = states + bh * d.states_stride + ci * state;
  const float* dS_chunk = dS_all + (bh * chunks + ci) * state;
  TileLoads tl;  // a tile's reads, issued a tile ahead (the first during the solve)
  fetch_tile(d, S0_all, dS_chunk, v, d_out, b, h, t0, n, 0, tl);
  __syncthreads();
  solve_deltas<ldc, ldc, 4>(n, n, c.A, area, M, c.beta);  // the chunk's one triangular solve: n <= 64 columns x 4 lanes
  for (std::int64_t j0 = 0; j0 < d.v_dim; j0 += chunk_cols) {
    __syncthreads();
    store_tile(n, tl, S0, dS, X, dO);
    if (j0 + chunk_cols < d.v_dim) fetch_tile(d, S0_all, dS_chunk, v, d_out, b, h, t0, n, j0 + chunk_cols, tl);
    __syncthreads();
    PHASE(1);
    // U = K S0, X -= diag(exp G) U; P = K dS.
    block_mma<1, 1, ldk, 1, ldu, 1>(n, chunk_cols, dk, c.kn, S0, [&](int i, int j, float x) {
      U[i * ldu + j] = x;
      X[i * ldu + j] -= c.eg[i] * x;
    });
    block_mma<1, 1, ldk, 1, ldu, 1>(n, chunk_cols, dk, c.kn, dS, [&](int i, int j, float x) { P[i * ldu + j] = x; });
    PHASE(2);
    // D = M X and dD = diag(w) P + Q^T dO; then R = X - A D and h = M^T dD; then dR = dD - A^T h.
    block_mma<1, 1, ldc, 1, ldu, 1>(n, chunk_cols, n, M, X, [&](int i, int j, float x) { D[i * ldu + j] = x; });
    block_mma<1, 1, 1, ldc, ldu, 1>(n, chunk_cols, n, c.Q, dO,
                                      [&](int i, int j, float x) { dD[i * ldu + j] = __fmaf_rn(c.w[i], P[i * ldu + j], x); });
    PHASE(3);
    block_mma<1, 1, ldc, 1, ldu, 1>(n, chunk_cols, n, c.A, D, [&](int i, int j, float x) { X[i * ldu + j] -= x; });
    block_mma<1, 1, 1, ldc, ldu, 1>(n, chunk_cols, n, M, dD, [&](int i, int j, float x) { Hh[i * ldu + j] = x; });
    PHASE(3);
    block_mma<1, 1, 1, ldc, ldu, 1>(n, chunk_cols, n, c.A, Hh, [&](int i, int j, float x) { dD[i * ldu + j] -= x; });
    PHASE(3);
    // The sums over this tile's columns: dbeta_i += dR_i . R_i; dG_i -= exp(G_i) U_i . h_i + w_i D_i . P_i,
    // and dG_last gains w_i D_i . P_i and exp(G_last) S0 . dS. Only the thread of a row writes or
    // reads what it sums into, and the products below write none of what it reads: no barrier.
    if (threadIdx.x < n) {
      const int i = threadIdx.x;
      float r1 = 0, r2 = 0, r3 = 0;
      for (int j = 0; j < chunk_cols; ++j) {
        r1 = __fmaf_rn(dD[i * ldu + j], X[i * ldu + j], r1);
        r2 = __fmaf_rn(U[i * ldu + j], Hh[i * ldu + j], r2);
        r3 = __fmaf_rn(D[i * ldu + j], P[i * ldu + j], r3);
      }
      dB[i] += r1;
      dG[i] -= c.eg[i] * r2 + c.w[i] * r3;
      last_rows += c.w[i] * r3;
    } else if (threadIdx.x >= 128 && threadIdx.x - 128 < dk) {
      const int a = threadIdx.x - 128;
      float s = 0;
      for (int j = 0; j < chunk_cols; ++j) s = __fmaf_rn(S0[a * ldu + j], dS[a * ldu + j], s);
      last_state += s;
    }
    // dq' += diag(exp G) dO S0^T; dk += diag(w) D dS^T - diag(exp G) h S0^T;
    // d Q += dO D^T; d A -= h D^T (the masks applied after the tiles).
    block_mma<2, 4, ldu, 1, 1, ldu>(n, dk, chunk_cols, dO, S0,
                                      [&](int i, int a, float x) { dQ[i * ldq + a] = __fmaf_rn(c.eg[i], x, dQ[i * ldq + a]); });
    block_mma<2, 4, ldu, 1, 1, ldu>(n, dk, chunk_cols, D, dS, [&](int i, int a, float x) { dK[i * ldq + a] += c.w[i] * x; });
    block_mma<2, 4, ldu, 1, 1, ldu>(n, dk, chunk_cols, Hh, S0, [&](int i, int a, float x) { dK[i * ldq + a] -= c.eg[i] * x; });
    block_mma<2, 2, ldu, 1, 1, ldu>(n, n, chunk_cols, dO, D, [&](int i, int j, float x) { dqk[i * ldc + j] += x; });
    block_mma<2, 2, ldu, 1, 1, ldu>(n, n, chunk_cols, Hh, D, [&](int i, int j, float x) { dkk[i * ldc + j] -= x; });
    PHASE(4);
  }
  if (threadIdx.x < n) dQo[threadIdx.x] = last_rows;
  else if (threadIdx.x >= 128 && threadIdx.x - 128 < dk) part[threadIdx.x - 128] = last_state;
  __syncthreads();
  if (threadIdx.x < 32) {  // dG_last's terms summed by one warp, in a fixed order
    const int lane = static_cast<int>(threadIdx.x);
    float state_sum = 0.0f, rows_sum = 0.0f;
    for (int a = lane; a < dk; a += 32) state_sum += part[a];
    for (int i = lane; i < n; i += 32) rows_sum += dQo[i];
    state_sum = warp_sum(state_sum);
    rows_sum = warp_sum(rows_sum);
    if (lane == 0) *last_grad = c.eg[n - 1] * state_sum + rows_sum;
  }
  {  // the q rows again, over the tiles (store_normalised's barrier orders the sums above before dQo's reuse)
    Loads p;
    fetch(d, b, h, t0, n, vec, 1, q, k, nullptr, nullptr, nullptr, 0, 0, p);
    store_normalised<ldk>(d, b, h, t0, n, vec, 1, q, k, p, c.qn, nullptr);  // synchronises
  }
  // dG from out's S0 term (q' . dq' so far) and from the decays of Q and A, before the masks.
  {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int i = warp; i < n; i += blockDim.x / 32) {
      float s = 0;
      for (int a = lane; a < dk; a += 32) s = __fmaf_rn(c.qn[i * ldk + a], dQ[i * ldq + a], s);
      s = warp_sum(s);
      if (lane == 0) dQo[i] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x < n) {
    const int i = threadIdx.x;
    float rows = 0, cols = 0;
    for (int l = 0; l < n; ++l) {
      rows += dqk[i * ldc + l] * c.Q[i * ldc + l] + dkk[i * ldc + l] * c.A[i * ldc + l];
      cols += dqk[l * ldc + i] * c.Q[l * ldc + i] + dkk[l * ldc + i] * c.A[l * ldc + i];
    }
    dG[i] += dQo[i] + rows - cols;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
    const int i = e / n, j = e % n;
    const float gamma = j <= i ? expf(c.G[i] - c.G[j]) : 0.0f;
    dqk[i * ldc + j] *= gamma;
    dkk[i * ldc + j] = j < i ? dkk[i * ldc + j] * gamma : 0.0f;
  }
  __syncthreads();
  // dq'_i += sum_j dQ_ij K_j; dk_j += sum_i dQ_ij q'_i + sum_i dA_ij k_i + sum_l dA_jl k_l.
  block_mma<2, 4, ldc, 1, ldk, 1>(n, dk, n, dqk, c.kn, [&](int i, int a, float x) { dQ[i * ldq + a] += x; });
  block_mma<2, 4, 1, ldc, ldk, 1>(n, dk, n, dqk, c.qn, [&](int j, int a, float x) { dK[j * ldq + a] += x; });
  block_mma<2, 4, 1, ldc, ldk, 1>(n, dk, n, dkk, c.kn, [&](int j, int a, float x) { dK[j * ldq + a] += x; });
  block_mma<2, 4, ldc, 1, ldk, 1>(n, dk, n, dkk, c.kn, [&](int j, int a, float x) { dK[j * ldq + a] += x; });
  __syncthreads();
  for (int e = threadIdx.x; e < n * dk; e += blockDim.x) {
    const int i = e / dk, a = e % dk;
    const std::int64_t row = ((b * d.seq_len + t0 + i) * H + h) * d.k_dim;
    dq_part[row + a] = dQ[i * ldq + a];
    dk_part[row + a] = dK[i * ldq + a];
  }
  PHASE(5);
  PHASES_PRINT("chunks (0 prepare, 1 tile loads, 2 U and P, 3 D, R, h, dR, 4 the tiles' sums, 5 the masks and dk)");
  if (threadIdx.x == 0) {
    dG[n - 1] += *last_grad;
    float tail = 0;
    for (int i = n - 1; i >= 0; --i) {
      tail += dG[i];
      const std::int64_t gi = (b * d.seq_len + t0 + i) * H + h;
      dg[gi] = tail;
      dbeta[gi] = dB[i];
    }
  }
}


}  // namespace

std::size_t gated_delta_chunked_smem_bytes() {
  return std::max({forward_floats, carry_floats, chunk_grad_floats}) * sizeof(float);
}

std::size_t gated_delta_chunked_scratch_floats(const GatedDeltaDims& d) {
  return static_cast<std::size_t>(d.sequences * d.v_heads * d.chunks() * d.k_dim * d.v_dim);
}

cudaError_t gated_delta_chunked_forward(const GatedDeltaDims& d, const std::uint16_t* q, const std::uint16_t* k,
                                        const std::uint16_t* v, const float* g, const float* beta, std::uint16_t* out,
                                        float* states, cudaStream_t stream) {
  if (const cudaError_t e = reserve_smem(chunked_forward_kernel, forward_floats * sizeof(float)); e != cudaSuccess) return e;
  const auto blocks = static_cast<unsigned>(d.sequences * d.v_heads * carry_tiles(d.v_dim));
  chunked_forward_kernel<<<blocks, threads, forward_floats * sizeof(float), stream>>>(d, q, k, v, g, beta, out, states);
  return cudaGetLastError();
}

cudaError_t gated_delta_chunked_backward(const GatedDeltaDims& d, const std::uint16_t* q, const std::uint16_t* k,
                                         const std::uint16_t* v, const float* g, const float* beta, const std::uint16_t* d_out,
                                         const float* states, std::uint16_t* dv, float* dg, float* dbeta, float* d_state,
                                         float* scratch, float* dq_part, float* dk_part, cudaStream_t stream) {
  if (const cudaError_t e = reserve_smem(chunked_carry_kernel, carry_floats * sizeof(float)); e != cudaSuccess) return e;
  if (const cudaError_t e = reserve_smem(chunked_grad_kernel, chunk_grad_floats * sizeof(float)); e != cudaSuccess) return e;
  const std::int64_t chunks = d.chunks();
  const auto carriers = static_cast<unsigned>(d.sequences * d.v_heads * carry_tiles(d.v_dim));
  chunked_carry_kernel<<<carriers, threads, carry_floats * sizeof(float), stream>>>(d, q, k, g, beta, d_out, dv, d_state, scratch);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const auto blocks = static_cast<unsigned>(d.sequences * d.v_heads * chunks);
  chunked_grad_kernel<<<blocks, threads, chunk_grad_floats * sizeof(float), stream>>>(d, q, k, v, g, beta, d_out, states, scratch, dg,
                                                                                       dbeta, dq_part, dk_part);
  return cudaGetLastError();
}

}  // namespace oom::kernels::detail
