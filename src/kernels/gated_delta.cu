// The gated delta rule, recurrent, its state in registers. Contract in
// include/oom/kernels/gated_delta.hpp; the math, line by line, is oom::reference::
// gated_delta_rule_forward / _backward (src/reference/gated_delta.cpp).
//
// Layout (both passes): thread (j, p) holds rows p R .. p R + R - 1 of column j of the dk x dv
// state (P = 4 parts of R = dk / 4 rows, padded to 8, 16 or 32), the four parts of a column in
// adjacent lanes: a sum over rows (S^T k, S^T q, dS^T k) is the thread's R terms in order, then two
// xor shuffles, so the forward needs no other thread but its column's. Tokens are staged a tile at
// a time in shared memory, q and k l2-normalised by warps.
// Forward: a block per (sequence, value head, 32 columns): the columns of the state never meet.
// Backward: per chunk from the last, the chunk's states are recomputed from the one the forward
// kept (the same arithmetic as the forward: the same bits) into the block's scratch, then the
// tokens are walked backwards with the state's gradient dS beside the state in registers; the sums
// over columns (dq, dk, d alpha, d beta) reduce-scatter over a warp's 8 columns by shuffles, then
// add the warps' partials in warp order. On Hopper and later a cluster of blocks per (sequence,
// value head), 32 columns a block as in the forward, adds them a tile of tokens at a time through
// distributed shared memory; before it, one block per (sequence, value head) holds every column
// and adds them a token at a time through its shared memory. Only the one-block path existed
// until the thirty-seventh session: at one sequence of 32 value heads it kept 32 of the H200's 132
// SMs busy. A last kernel sums dq and dk over the value heads
// of each key head, in head order, and takes them back through the l2norm.
#include <cooperative_groups.h>

#include <algorithm>
#include <type_traits>

#include "bf16_device.cuh"
#include "gated_delta_chunked.hpp"
#include "oom/kernels/gated_delta.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;
using detail::warp_sum;

constexpr float l2_eps = 1e-6f;       // transformers' (FLA's) l2norm
constexpr int parts = 4;              // P: threads a column's rows are split over (adjacent lanes)
constexpr int tile_tokens = 16;       // tokens staged at once
constexpr int forward_columns = 32;   // columns a forward block owns
constexpr int norm_threads = 128;     // the l2norm backward: a warp per (token, key head) row
constexpr int max_backward_threads = 512;  // 4 x dv <= 128 columns
constexpr int cluster_threads = forward_columns * parts;  // the cluster backward's blocks: 32 columns each

__host__ __device__ constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
// GatedDeltaDims' tokens(), for device code (the header's is a host function; chunks(): detail::chunks_of).
__device__ std::int64_t tokens_of(const GatedDeltaDims& d) { return d.sequences * d.seq_len; }
using detail::chunks_of;
using detail::reserve_smem;

/// Rows a thread holds: dk / P rounded up to 8, 16 or 32 (the reduce-scatter halves it three times).
int rows_per_thread(std::int64_t dk) { return dk <= 32 ? 8 : dk <= 64 ? 16 : 32; }
/// The forward's blocks per (sequence, head): one per forward_columns columns of the state.
__host__ __device__ std::int64_t column_blocks(std::int64_t dv) { return (dv + forward_columns - 1) / forward_columns; }

// The recurrence's steps, spelled out (explicit fma and uncontracted products) so that the
// forward and the backward's recomputation round alike whatever the compiler contracts.
/// sum_r s[r] k[r] over a thread's R rows as four interleaved fma chains added pairwise: a quarter
/// of one chain's dependent latency (the recurrence runs a warp per scheduler, so latency is its
/// time). Every pass computes its sums through this one order, so the forward and the backward's
/// recomputation agree bit for bit.
template <int R>
__device__ __forceinline__ float dot(const float (&s)[R], const float* k) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r % 4] = __fmaf_rn(s[r], k[r], acc[r % 4]);
  return __fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3]));
}
__device__ __forceinline__ float delta_of(float beta, float v, float alpha, float u) {
  return __fmul_rn(beta, __fsub_rn(v, __fmul_rn(alpha, u)));
}
__device__ __forceinline__ float update(float s, float alpha, float k, float delta) { return __fmaf_rn(k, delta, __fmul_rn(alpha, s)); }
/// The sum over a column's P = 4 parts (lanes p ^ 1, p ^ 2): every part gets the same value.
__device__ __forceinline__ float column_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// A tile of tokens in shared memory: q and k normalised (q also by 1 / sqrt(dk)), each row as P
/// parts of R + 1 floats (the pad puts the parts' r-th values in different banks), zero past dk;
/// v and d_out as (tile, dv); exp(g) and beta.
template <int R>
struct Tile {
  static constexpr int row = parts * (R + 1);
  float* qn;  // (tile, row)
  float* kn;
  float* v;   // (tile, vcols)
  float* dout;
  float* alpha;  // (tile)
  float* beta;
  __host__ __device__ static std::size_t floats(std::int64_t vcols) { return static_cast<std::size_t>(tile_tokens * (2 * row + 2 * vcols + 2)); }
  __device__ static Tile carve(float* at, std::int64_t vcols) {
    Tile t;
    t.qn = at;
    t.kn = t.qn + tile_tokens * row;
    t.v = t.kn + tile_tokens * row;
    t.dout = t.v + tile_tokens * vcols;
    t.alpha = t.dout + tile_tokens * vcols;
    t.beta = t.alpha + tile_tokens;
    return t;
  }
  __device__ static int at(std::int64_t i) { return static_cast<int>(i / R) * (R + 1) + static_cast<int>(i % R); }
};

/// Stages tokens [t0, t0 + n) of sequence b for value head h, columns [j0, j0 + vcols) of v (and
/// of d_out when given). The caller synchronises before (the last tile is read) and after.
template <int R>
__device__ void stage(const GatedDeltaDims& d, const Tile<R>& tile, std::int64_t b, std::int64_t h, std::int64_t t0, int n,
                      std::int64_t j0, std::int64_t vcols, const std::uint16_t* q, const std::uint16_t* k,
                      const std::uint16_t* v, const float* g, const float* beta, const std::uint16_t* d_out) {
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads, kh = h / (H / d.k_heads);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float scale = 1.0f / sqrtf(static_cast<float>(dk));
  for (int r = warp; r < 2 * n; r += warps) {
    const int tt = r / 2;
    const std::uint16_t* src = (r % 2 == 0 ? q : k) + (b * S + t0 + tt) * d.qk_stride + kh * dk;
    float ss = 0;
    for (std::int64_t i = lane; i < dk; i += 32) {
      const float x = bf16_to_float(src[i]);
      ss += x * x;
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) + l2_eps) * (r % 2 == 0 ? scale : 1.0f);
    float* dst = (r % 2 == 0 ? tile.qn : tile.kn) + tt * Tile<R>::row;
    for (std::int64_t i = lane; i < parts * R; i += 32) dst[Tile<R>::at(i)] = i < dk ? bf16_to_float(src[i]) * inv : 0.0f;
  }
  for (std::int64_t e = threadIdx.x; e < n * vcols; e += blockDim.x) {
    const std::int64_t tt = e / vcols, c = j0 + e % vcols;
    const std::int64_t row = b * S + t0 + tt;
    tile.v[e] = c < dv ? bf16_to_float(v[row * d.v_stride + h * dv + c]) : 0.0f;
    if (d_out != nullptr) tile.dout[e] = c < dv ? bf16_to_float(d_out[(row * H + h) * dv + c]) : 0.0f;
  }
  if (threadIdx.x < n) {
    const std::int64_t gi = (b * S + t0 + threadIdx.x) * H + h;
    tile.alpha[threadIdx.x] = expf(g[gi]);
    tile.beta[threadIdx.x] = beta[gi];
  }
}

/// One token of the recurrence for thread (column jl of the tile's columns, part p): S = a S +
/// k delta^T with delta = beta (v - a S^T k). Returns delta.
template <int R>
__device__ __forceinline__ float recur(float (&s)[R], const Tile<R>& tile, int tt, int jl, int p, std::int64_t vcols) {
  const float* kk = tile.kn + tt * Tile<R>::row + p * (R + 1);
  const float a = tile.alpha[tt];
  const float delta = delta_of(tile.beta[tt], tile.v[tt * vcols + jl], a, column_sum(dot(s, kk)));
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = update(s[r], a, kk[r], delta);
  return delta;
}

/// The state's rows of thread part p to or from (dk, dv) row-major `m` (column j).
template <int R>
__device__ void save_rows(const float (&s)[R], float* m, std::int64_t dk, std::int64_t dv, std::int64_t j, int p) {
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (p * R + r < dk) m[(p * R + r) * dv + j] = s[r];
}
template <int R>
__device__ void load_rows(float (&s)[R], const float* m, std::int64_t dk, std::int64_t dv, std::int64_t j, int p) {
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = p * R + r < dk ? m[(p * R + r) * dv + j] : 0.0f;
}

// ---- forward ------------------------------------------------------------------------------------

template <int R>
__global__ void __launch_bounds__(forward_columns * parts, 4) forward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                                                           const std::uint16_t* v, const float* g, const float* beta,
                                                                           std::uint16_t* out, float* states) {
  extern __shared__ float smem[];
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads;
  const std::int64_t blocks_per_head = column_blocks(dv);
  const std::int64_t bh = blockIdx.x / blocks_per_head, b = bh / H, h = bh % H;
  const std::int64_t j0 = (blockIdx.x % blocks_per_head) * forward_columns;
  const Tile<R> tile = Tile<R>::carve(smem, forward_columns);
  const int jl = threadIdx.x / parts, p = threadIdx.x % parts;
  const std::int64_t j = j0 + jl;
  const bool owner = j < dv;
  float* kept = states + static_cast<std::size_t>(bh) * d.states_stride;  // the next state to keep
  float s[R];
  if (d.from_kept_state && owner) load_rows(s, kept, dk, dv, j, p);
  else
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.0f;
  std::int64_t keep_at = 0;
  std::uint16_t* my_out = out + (b * S * H + h) * dv + j;  // token t's at t H dv
  for (std::int64_t t0 = 0; t0 < S; t0 += tile_tokens) {
    const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), S - t0));
    __syncthreads();
    stage(d, tile, b, h, t0, n, j0, forward_columns, q, k, v, g, beta, nullptr);
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      const std::int64_t t = t0 + tt;
      if (t == keep_at) {
        if (owner) save_rows(s, kept, dk, dv, j, p);
        kept += dk * dv;
        keep_at += d.chunk;
      }
      recur(s, tile, tt, jl, p, forward_columns);
      const float* qq = tile.qn + tt * Tile<R>::row + p * (R + 1);
      const float o = column_sum(dot(s, qq));
      if (owner && p == 0) my_out[t * H * dv] = float_to_bf16(o);
    }
  }
  if (owner) save_rows(s, kept, dk, dv, j, p);  // the final state, after chunks() kept ones
}

// ---- backward -----------------------------------------------------------------------------------

/// x's R values summed over the warp's 8 columns (lane bits 2..4), scattered: lane (c, p) ends with
/// the sums of rows p R + offset(c) + m, m < R / 8, in x[0 .. R / 8), where offset(c) = c's bits
/// read as R/2, R/4, R/8 (c = lane >> 2). Each stage adds the kept half to the partner's.
template <int R, int Half, int Offset>
__device__ __forceinline__ void reduce_scatter_stage(float (&x)[R], int lane) {
  const bool upper = (lane & Offset) != 0;
#pragma unroll
  for (int m = 0; m < Half; ++m) {
    const float lo = x[m], hi = x[m + Half];
    const float recv = __shfl_xor_sync(0xffffffffu, upper ? lo : hi, Offset);
    x[m] = (upper ? hi : lo) + recv;
  }
}
template <int R>
__device__ __forceinline__ void reduce_scatter_columns(float (&x)[R], int lane) {
  reduce_scatter_stage<R, R / 2, 16>(x, lane);
  reduce_scatter_stage<R, R / 4, 8>(x, lane);
  reduce_scatter_stage<R, R / 8, 4>(x, lane);
}
template <int R>
__device__ __forceinline__ int scatter_offset(int lane) {
  return ((lane & 16) ? R / 2 : 0) + ((lane & 8) ? R / 4 : 0) + ((lane & 4) ? R / 8 : 0);
}

/// One token t of the backward for thread (column jl of the tile's, part p): s holds the state
/// before the token's update, ds the state's gradient after it and leaves with the gradient
/// before it. The warp's partial sums over its 8 columns of the dq and dk rows go to dq_row and
/// dk_row (P R floats each, every row written once), its partials of d alpha and d beta come back
/// (every lane the same), and the column's dv.
template <int R>
__device__ __forceinline__ void backward_token(const float (&s)[R], float (&ds)[R], const Tile<R>& tile, int tt, int jl, int p,
                                               int lane, std::int64_t vcols, float* dq_row, float* dk_row, float& dalpha,
                                               float& dbeta_term, float& dvj) {
  float x[R];
  const float* kk = tile.kn + tt * Tile<R>::row + p * (R + 1);
  const float* qq = tile.qn + tt * Tile<R>::row + p * (R + 1);
  const float a = tile.alpha[tt], bb = tile.beta[tt], vj = tile.v[tt * vcols + jl], doj = tile.dout[tt * vcols + jl];
  // Columns: u = S^T k (before the decay), delta; dS += q do^T; dd = dS^T k.
  const float u = column_sum(dot(s, kk));
  const float delta = delta_of(bb, vj, a, u);
#pragma unroll
  for (int r = 0; r < R; ++r) ds[r] = __fmaf_rn(qq[r], doj, ds[r]);
  const float dd = column_sum(dot(ds, kk));
  const float du = -bb * dd;
  // Rows: dq = S_t do with S_t = a S + k delta^T; dk = dS delta + a S du.
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = update(s[r], a, kk[r], delta) * doj;
  reduce_scatter_columns(x, lane);
  dq_row += p * R + scatter_offset<R>(lane);
#pragma unroll
  for (int m = 0; m < R / 8; ++m) dq_row[m] = x[m];
#pragma unroll
  for (int r = 0; r < R; ++r) x[r] = __fmaf_rn(ds[r], delta, a * s[r] * du);
  reduce_scatter_columns(x, lane);
  dk_row += p * R + scatter_offset<R>(lane);
#pragma unroll
  for (int m = 0; m < R / 8; ++m) dk_row[m] = x[m];
  // dS' = dS + k du^T; d alpha = <dS', S>; the gradient entering the previous token is a dS'.
  float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dot()'s order
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float y = __fmaf_rn(kk[r], du, ds[r]);
    da[r % 4] = __fmaf_rn(y, s[r], da[r % 4]);
    ds[r] = a * y;
  }
  dalpha = warp_sum(__fadd_rn(__fadd_rn(da[0], da[1]), __fadd_rn(da[2], da[3])));
  dbeta_term = warp_sum(p == 0 ? dd * (vj - __fmul_rn(a, u)) : 0.0f);
  dvj = bb * dd;
}

/// The chunk's states, from the one the forward kept: the state before token t to this thread's
/// scratch[t - c0] (r-major, `threads` apart), in the forward's arithmetic (the same bits).
/// Columns [j0, j0 + vcols) of the state; s holds the chunk's first state on entry.
template <int R>
__device__ void recompute_chunk(const GatedDeltaDims& d, float (&s)[R], const Tile<R>& tile, std::int64_t b, std::int64_t h,
                                std::int64_t c0, std::int64_t c1, std::int64_t j0, std::int64_t vcols, const std::uint16_t* q,
                                const std::uint16_t* k, const std::uint16_t* v, const float* g, const float* beta,
                                float* my_scratch) {
  const int jl = threadIdx.x / parts, p = threadIdx.x % parts;
  for (std::int64_t t0 = c0; t0 < c1; t0 += tile_tokens) {
    const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), c1 - t0));
    __syncthreads();
    stage(d, tile, b, h, t0, n, j0, vcols, q, k, v, g, beta, nullptr);
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      float* to = my_scratch + (t0 + tt - c0) * R * blockDim.x + threadIdx.x;
#pragma unroll
      for (int r = 0; r < R; ++r) to[r * blockDim.x] = s[r];
      recur(s, tile, tt, jl, p, vcols);
    }
  }
}

template <int R>
__device__ __forceinline__ void load_scratch(float (&s)[R], const float* my_scratch, std::int64_t i) {
  const float* from = my_scratch + i * R * blockDim.x + threadIdx.x;
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = from[r * blockDim.x];
}
/// The state before token t (loaded one token ahead, in `next`) to s, and the load of token t - 1's
/// issued (within the chunk from c0): its latency passes under token t's arithmetic.
template <int R>
__device__ __forceinline__ void next_state(float (&s)[R], float (&next)[R], const float* my_scratch, std::int64_t t, std::int64_t c0) {
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = next[r];
  if (t > c0) load_scratch(next, my_scratch, t - 1 - c0);
}

/// One block per (sequence, value head), every column; the column sums added a token at a time
/// through shared memory (the path before compute capability 9.0).
template <int R>
__global__ void __launch_bounds__(max_backward_threads) backward_kernel(
    GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* g,
    const float* beta, const std::uint16_t* d_out, const float* states, std::uint16_t* dv_out, float* dg, float* dbeta,
    float* d_state, float* scratch, float* dq_part, float* dk_part) {
  extern __shared__ float smem[];
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads;
  const std::int64_t vcols = round_up(dv, 8);  // 8 columns a warp
  const std::int64_t b = blockIdx.x / H, h = blockIdx.x % H;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Tile<R> tile = Tile<R>::carve(smem, vcols);
  // Per token parity: the warps' partial sums of dq and dk rows (warps, P R) and of d alpha, d beta.
  float* dq_w = smem + Tile<R>::floats(vcols);
  float* dk_w = dq_w + 2 * warps * parts * R;
  float* scal_w = dk_w + 2 * warps * parts * R;  // (2, warps, 2)
  const int jl = threadIdx.x / parts, p = threadIdx.x % parts;
  const bool owner = jl < dv;
  const std::int64_t chunks = chunks_of(d);
  const float* my_states = states + static_cast<std::size_t>(blockIdx.x) * d.states_stride;
  float* my_scratch = scratch + static_cast<std::size_t>(blockIdx.x) * min(d.chunk, S) * R * blockDim.x;
  float* my_d_state = d_state == nullptr ? nullptr : d_state + static_cast<std::size_t>(blockIdx.x) * dk * dv;
  float s[R], ds[R];
  if (my_d_state != nullptr && owner) load_rows(ds, my_d_state, dk, dv, jl, p);
  else
#pragma unroll
    for (int r = 0; r < R; ++r) ds[r] = 0.0f;
  for (std::int64_t c = chunks - 1; c >= 0; --c) {
    const std::int64_t c0 = c * d.chunk, c1 = min(S, c0 + d.chunk);
    if (owner) load_rows(s, my_states + c * dk * dv, dk, dv, jl, p);
    else
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = 0.0f;
    recompute_chunk(d, s, tile, b, h, c0, c1, 0, vcols, q, k, v, g, beta, my_scratch);
    // Backwards over the chunk, a tile at a time from its last.
    const std::int64_t tiles = (c1 - c0 + tile_tokens - 1) / tile_tokens;
    for (std::int64_t m = tiles - 1; m >= 0; --m) {
      const std::int64_t t0 = c0 + m * tile_tokens;
      const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), c1 - t0));
      __syncthreads();
      stage(d, tile, b, h, t0, n, 0, vcols, q, k, v, g, beta, d_out);
      __syncthreads();
      for (int tt = n - 1; tt >= 0; --tt) {
        const std::int64_t t = t0 + tt;
        const int buf = static_cast<int>(t & 1);
        load_scratch(s, my_scratch, t - c0);  // (no prefetch: 128 registers a thread at 512 threads)
        float dalpha, dbeta_term, dvj;
        backward_token(s, ds, tile, tt, jl, p, lane, vcols, dq_w + (buf * warps + warp) * parts * R,
                       dk_w + (buf * warps + warp) * parts * R, dalpha, dbeta_term, dvj);
        if (lane == 0) {
          scal_w[(buf * warps + warp) * 2] = dalpha;
          scal_w[(buf * warps + warp) * 2 + 1] = dbeta_term;
        }
        if (owner && p == 0) dv_out[(b * S + t) * d.v_stride + h * dv + jl] = float_to_bf16(dvj);
        __syncthreads();
        // The warps' partials in warp order (the other parity's buffers take the next token).
        const std::int64_t prow = ((b * S + t) * H + h) * dk;
        for (std::int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
          float sq = 0, sk = 0;
          for (int w = 0; w < warps; ++w) {
            sq += dq_w[(buf * warps + w) * parts * R + i];
            sk += dk_w[(buf * warps + w) * parts * R + i];
          }
          dq_part[prow + i] = sq;
          dk_part[prow + i] = sk;
        }
        if (threadIdx.x == blockDim.x - 1) {
          float da = 0, db = 0;
          for (int w = 0; w < warps; ++w) {
            da += scal_w[(buf * warps + w) * 2];
            db += scal_w[(buf * warps + w) * 2 + 1];
          }
          dg[(b * S + t) * H + h] = da * tile.alpha[tt];
          dbeta[(b * S + t) * H + h] = db;
        }
      }
    }
  }
  if (my_d_state != nullptr && owner) save_rows(ds, my_d_state, dk, dv, jl, p);  // the state's gradient before the first token
}

/// A cluster of column_blocks(dv) blocks per (sequence, value head), block `rank` owning columns
/// [32 rank, 32 rank + 32) (Hopper and later). Per tile of tokens, each warp's partial column sums
/// of every token go to its block's shared memory; after a cluster barrier the cluster's threads
/// add them, each sum over the blocks in rank order and their warps in order (the one-block
/// kernel's order: the same bits), reading the other blocks' shared memory.
template <int R>
__global__ void __launch_bounds__(cluster_threads) backward_cluster_kernel(
    GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* g,
    const float* beta, const std::uint16_t* d_out, const float* states, std::uint16_t* dv_out, float* dg, float* dbeta,
    float* d_state, float* scratch, float* dq_part, float* dk_part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // never launched there: the launcher takes the one-block kernel below compute capability 9.0
#else
  namespace cg = cooperative_groups;
  extern __shared__ float smem[];
  const cg::cluster_group cluster = cg::this_cluster();
  constexpr int warps = cluster_threads / 32, row = parts * R;
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads;
  const int blocks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const std::int64_t bh = blockIdx.x / blocks, b = bh / H, h = bh % H, j0 = static_cast<std::int64_t>(rank) * forward_columns;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Tile<R> tile = Tile<R>::carve(smem, forward_columns);
  // The tile's partials: (token, warp) rows of [dq (P R) | dk (P R)], then (token, warp) pairs of
  // d alpha, d beta.
  float* part = smem + Tile<R>::floats(forward_columns);
  float* scal = part + tile_tokens * warps * 2 * row;
  const int jl = threadIdx.x / parts, p = threadIdx.x % parts;
  const std::int64_t j = j0 + jl;
  const bool owner = j < dv;
  const std::int64_t chunks = chunks_of(d);
  const float* my_states = states + static_cast<std::size_t>(bh) * d.states_stride;
  float* my_scratch = scratch + static_cast<std::size_t>(blockIdx.x) * min(d.chunk, S) * R * blockDim.x;
  float* my_d_state = d_state == nullptr ? nullptr : d_state + static_cast<std::size_t>(bh) * dk * dv;
  float s[R], s_next[R], ds[R];
  if (my_d_state != nullptr && owner) load_rows(ds, my_d_state, dk, dv, j, p);
  else
#pragma unroll
    for (int r = 0; r < R; ++r) ds[r] = 0.0f;
  for (std::int64_t c = chunks - 1; c >= 0; --c) {
    const std::int64_t c0 = c * d.chunk, c1 = min(S, c0 + d.chunk);
    if (owner) load_rows(s, my_states + c * dk * dv, dk, dv, j, p);
    else
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = 0.0f;
    recompute_chunk(d, s, tile, b, h, c0, c1, j0, forward_columns, q, k, v, g, beta, my_scratch);
    load_scratch(s_next, my_scratch, c1 - 1 - c0);
    const std::int64_t tiles = (c1 - c0 + tile_tokens - 1) / tile_tokens;
    for (std::int64_t m = tiles - 1; m >= 0; --m) {
      const std::int64_t t0 = c0 + m * tile_tokens;
      const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), c1 - t0));
      cluster.sync();  // every block is done reading the last tile's partials (ours too) and its tile
      stage(d, tile, b, h, t0, n, j0, forward_columns, q, k, v, g, beta, d_out);
      __syncthreads();
      for (int tt = n - 1; tt >= 0; --tt) {
        const std::int64_t t = t0 + tt;
        next_state(s, s_next, my_scratch, t, c0);
        float dalpha, dbeta_term, dvj;
        float* at = part + (tt * warps + warp) * 2 * row;
        backward_token(s, ds, tile, tt, jl, p, lane, forward_columns, at, at + row, dalpha, dbeta_term, dvj);
        if (lane == 0) {
          scal[(tt * warps + warp) * 2] = dalpha;
          scal[(tt * warps + warp) * 2 + 1] = dbeta_term;
        }
        if (owner && p == 0) dv_out[(b * S + t) * d.v_stride + h * dv + j] = float_to_bf16(dvj);
      }
      cluster.sync();  // the tile's partials of every block written
      // The n tokens' 2 dk row sums, then their 2 scalar sums, shared over the cluster's threads.
      const std::int64_t sums = n * 2 * dk;
      for (std::int64_t e = static_cast<std::int64_t>(rank) * blockDim.x + threadIdx.x; e < sums + n;
           e += static_cast<std::int64_t>(blocks) * blockDim.x) {
        if (e < sums) {
          const int tt = static_cast<int>(e / (2 * dk));
          const std::int64_t rest = e % (2 * dk), which = rest / dk, i = rest % dk;
          float sum = 0;
          for (int r = 0; r < blocks; ++r) {
            const float* from = cluster.map_shared_rank(part, r) + tt * warps * 2 * row + which * row + i;
#pragma unroll
            for (int w = 0; w < warps; ++w) sum += from[w * 2 * row];
          }
          (which == 0 ? dq_part : dk_part)[((b * S + t0 + tt) * H + h) * dk + i] = sum;
        } else {
          const int tt = static_cast<int>(e - sums);
          float da = 0, db = 0;
          for (int r = 0; r < blocks; ++r) {
            const float* from = cluster.map_shared_rank(scal, r) + tt * warps * 2;
#pragma unroll
            for (int w = 0; w < warps; ++w) {
              da += from[w * 2];
              db += from[w * 2 + 1];
            }
          }
          const std::int64_t gi = (b * S + t0 + tt) * H + h;
          dg[gi] = da * tile.alpha[tt];
          dbeta[gi] = db;
        }
      }
    }
  }
  if (my_d_state != nullptr && owner) save_rows(ds, my_d_state, dk, dv, j, p);  // the state's gradient before the first token
  cluster.sync();  // no block leaves while another may still read its shared memory
#endif
}

/// Per (token, key head) row: the value heads' gradients of the normalised q and k summed in head
/// order, then through q / sqrt(dk) and the l2norm: dx = r dy - x r^3 (x . dy).
__global__ void l2norm_backward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                       const float* dq_part, const float* dk_part, std::uint16_t* dq, std::uint16_t* dk_out) {
  const std::int64_t rows = tokens_of(d) * d.k_heads, dk = d.k_dim, group = d.v_heads / d.k_heads;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (norm_threads / 32) + threadIdx.x / 32;
  if (row >= 2 * rows) return;
  const bool is_q = row < rows;
  const std::int64_t r = is_q ? row : row - rows, t = r / d.k_heads, kh = r % d.k_heads;
  const int lane = threadIdx.x % 32;
  const std::uint16_t* x = (is_q ? q : k) + t * d.qk_stride + kh * dk;
  const float* part = is_q ? dq_part : dk_part;
  const float scale = is_q ? 1.0f / sqrtf(static_cast<float>(dk)) : 1.0f;
  float ss = 0, xdy = 0;
  for (std::int64_t i = lane; i < dk; i += 32) {
    float dy = 0;
    for (std::int64_t gh = 0; gh < group; ++gh) dy += part[((t * d.v_heads) + kh * group + gh) * dk + i];
    const float xi = bf16_to_float(x[i]);
    ss += xi * xi;
    xdy += xi * dy * scale;
  }
  const float inv = 1.0f / sqrtf(warp_sum(ss) + l2_eps);
  xdy = warp_sum(xdy);
  std::uint16_t* out = (is_q ? dq : dk_out) + t * d.qk_stride + kh * dk;
  for (std::int64_t i = lane; i < dk; i += 32) {
    float dy = 0;
    for (std::int64_t gh = 0; gh < group; ++gh) dy += part[((t * d.v_heads) + kh * group + gh) * dk + i];
    const float xi = bf16_to_float(x[i]);
    out[i] = float_to_bf16(inv * dy * scale - xi * inv * inv * inv * xdy);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

constexpr std::int64_t max_dim = 128;  // dk: R <= 32 rows a thread; dv: the backward's 4 dv threads <= 512

cudaError_t check_dims(const char* name, const GatedDeltaDims& d) {
  if (d.sequences < 0 || d.seq_len < 0)
    return detail::refuse(name, ": sequences = ", d.sequences, ", seq_len = ", d.seq_len, " (must be >= 0)");
  if (d.k_heads < 1 || d.v_heads < 1 || d.v_heads % d.k_heads != 0)
    return detail::refuse(name, ": k_heads = ", d.k_heads, ", v_heads = ", d.v_heads,
                          " (need >= 1 each, v_heads a multiple of k_heads)");
  if (d.k_dim < 1 || d.k_dim > max_dim || d.v_dim < 1 || d.v_dim > max_dim)
    return detail::refuse(name, ": k_dim = ", d.k_dim, ", v_dim = ", d.v_dim, " (need 1..", max_dim, " each: the recurrent kernels' rows and "
                          "columns are held in registers)");
  if (d.chunk < 1) return detail::refuse(name, ": chunk = ", d.chunk, " (must be >= 1)");
  using Path = GatedDeltaDims::Backward;
  if (d.backward != Path::automatic && d.backward != Path::cluster && d.backward != Path::one_block)
    return detail::refuse(name, ": backward = ", static_cast<int>(d.backward), " is none of automatic (0), cluster (1), one_block (2)");
  using Form = GatedDeltaDims::Form;
  if (d.form != Form::automatic && d.form != Form::chunked && d.form != Form::recurrent)
    return detail::refuse(name, ": form = ", static_cast<int>(d.form), " is none of automatic (0), chunked (1), recurrent (2)");
  if (d.form == Form::chunked && d.chunk > detail::chunked_max_chunk)
    return detail::refuse(name, ": form = chunked takes chunk <= ", detail::chunked_max_chunk, ", not ", d.chunk,
                          " (a chunk's tokens are one block's rows; use automatic or recurrent)");
  if (d.states_stride != 0 && d.states_stride < (d.chunks() + 1) * d.k_dim * d.v_dim)
    return detail::refuse(name, ": states_stride = ", d.states_stride, " is less than (chunks + 1) x k_dim x v_dim = ",
                          (d.chunks() + 1) * d.k_dim * d.v_dim, " (a sequence's own kept states)");
  if (d.qk_stride != 0 && d.qk_stride < d.k_heads * d.k_dim)
    return detail::refuse(name, ": qk_stride = ", d.qk_stride, " is less than k_heads x k_dim = ", d.k_heads * d.k_dim);
  if (d.v_stride != 0 && d.v_stride < d.v_heads * d.v_dim)
    return detail::refuse(name, ": v_stride = ", d.v_stride, " is less than v_heads x v_dim = ", d.v_heads * d.v_dim);
  if (d.sequences * d.v_heads * column_blocks(d.v_dim) > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences, " sequences x ", d.v_heads, " value heads need more than 2^31 - 1 blocks");
  if (d.chunk > 0 && d.sequences * d.v_heads * d.chunks() > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences, " sequences x ", d.v_heads, " value heads x ", d.chunks(),
                          " chunks need more than 2^31 - 1 blocks");
  if ((2 * d.sequences * d.seq_len * d.k_heads + norm_threads / 32 - 1) / (norm_threads / 32) > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences * d.seq_len, " tokens x ", d.k_heads, " key heads need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

/// The dims as the kernels read them: a stride of 0 is the packed one.
GatedDeltaDims with_strides(GatedDeltaDims d) {
  if (d.qk_stride == 0) d.qk_stride = d.k_heads * d.k_dim;
  if (d.v_stride == 0) d.v_stride = d.v_heads * d.v_dim;
  if (d.states_stride == 0) d.states_stride = (d.chunks() + 1) * d.k_dim * d.v_dim;
  return d;
}

std::int64_t backward_threads(const GatedDeltaDims& d) { return round_up(d.v_dim, 8) * parts; }
/// Floats of the backward's scratch: each block's states of one chunk as its threads hold them,
/// the larger of the two paths' (they differ where dv is no multiple of 32), so the workspace does
/// not depend on the device.
std::int64_t scratch_floats(const GatedDeltaDims& d) {
  const std::int64_t threads = std::max(backward_threads(d), column_blocks(d.v_dim) * cluster_threads);
  return round_up(d.sequences * d.v_heads * std::min(d.chunk, d.seq_len) * rows_per_thread(d.k_dim) * threads, 64);
}

/// Whether the chunked form may run for these dims (GatedDeltaDims::Form), whatever the device.
bool chunk_fits(const GatedDeltaDims& d) { return d.chunk <= detail::chunked_max_chunk; }

/// Whether the current device has what the chunked kernels take (gated_delta_chunked_supported),
/// and its SMs.
cudaError_t chunked_device(bool* supported, int* sms) {
  int device = 0, major = 0, smem = 0;
  *supported = false;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device); e != cudaSuccess)
    return e;
  *supported = major >= 9 && static_cast<std::size_t>(smem) >= detail::gated_delta_chunked_smem_bytes();
  return cudaSuccess;
}

/// Whether the dims' `pass` (forward or backward) runs the chunked form on the current device.
/// `automatic` takes it where the chunk fits and the device can run it: for the backward always,
/// for the forward where its carrying blocks (sequences x value heads x 32-column blocks, one an
/// SM) run in at most two waves (bench_gated_delta on the H200, the Qwen3-Next layer, forty-first
/// session: the chunked backward 2.6x, 2.1x, 1.21x and 1.20x the recurrent one at 1, 2, 4 and 8
/// sequences; its forward 1.9x and 1.05x at one and two, 0.64x from four, where the recurrent
/// kernels' smaller blocks share the SMs better). A backward takes the states either forward kept
/// (the state entering each chunk, the same quantity in fp32). An explicit `chunked` on a device
/// that cannot run it is refused, named.
enum class Pass : std::uint8_t { forward, backward };
cudaError_t runs_chunked(const char* name, const GatedDeltaDims& d, Pass pass, bool* chunked) {
  using Form = GatedDeltaDims::Form;
  *chunked = false;
  if (d.form == Form::recurrent || !chunk_fits(d)) return cudaSuccess;
  bool supported = false;
  int sms = 0;
  if (const cudaError_t e = chunked_device(&supported, &sms); e != cudaSuccess) return e;
  if (d.form == Form::chunked) {
    if (!supported)
      return detail::refuse(name, ": form = chunked needs compute capability 9.0 or later and ", detail::gated_delta_chunked_smem_bytes(),
                            " bytes of shared memory a block, which this device has not (use automatic or recurrent)");
    *chunked = true;
    return cudaSuccess;
  }
  *chunked = supported && (pass == Pass::backward || d.sequences * d.v_heads * column_blocks(d.v_dim) <= 2 * static_cast<std::int64_t>(sms));
  return cudaSuccess;
}

/// Floats of the backward's scratch before the per-head dq and dk, from the dims alone (so the
/// workspace does not depend on the device): the form's, or under `automatic` (either may run)
/// the larger of the two.
std::int64_t form_scratch_floats(const GatedDeltaDims& d) {
  using Form = GatedDeltaDims::Form;
  const auto chunked = static_cast<std::int64_t>(detail::gated_delta_chunked_scratch_floats(d));
  if (d.form == Form::chunked) return round_up(chunked, 64);
  if (d.form == Form::recurrent || !chunk_fits(d)) return scratch_floats(d);
  return round_up(std::max(chunked, scratch_floats(d)), 64);
}

template <int R>
std::size_t backward_smem_bytes(const GatedDeltaDims& d) {
  const std::int64_t warps = backward_threads(d) / 32;
  return (Tile<R>::floats(round_up(d.v_dim, 8)) + static_cast<std::size_t>(4 * warps * parts * R + 4 * warps)) * sizeof(float);
}
/// The cluster kernel's: its tile of 32 columns and the tile's partials (tokens, warps, 2 P R + 2).
template <int R>
std::size_t cluster_smem_bytes() {
  return (Tile<R>::floats(forward_columns) + static_cast<std::size_t>(tile_tokens * (cluster_threads / 32) * (2 * parts * R + 2))) *
         sizeof(float);
}

/// Whether the backward runs as clusters on the current device (GatedDeltaDims::Backward).
cudaError_t use_clusters(const GatedDeltaDims& d, bool* clustered) {
  using Path = GatedDeltaDims::Backward;  // a valid one: check_dims
  *clustered = false;
  if (d.backward == Path::one_block) return cudaSuccess;
  int device = 0, major = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  if (d.backward == Path::cluster && major < 9)
    return detail::refuse("gated_delta_backward: backward = cluster needs thread-block clusters (compute capability 9.0 and "
                          "later); device ", device, " is compute capability ", major, ".x (use automatic or one_block)");
  // A build without sm_90 code (CMAKE_CUDA_ARCHITECTURES 80 or 89 only) runs on Hopper from older
  // PTX, where the cluster kernel is a trap: take one block a head there.
  bool built = false;
  if (major >= 9) {
    cudaFuncAttributes a{};
    if (const cudaError_t e = cudaFuncGetAttributes(&a, backward_cluster_kernel<32>); e != cudaSuccess) return e;
    built = a.ptxVersion >= 90;
  }
  if (d.backward == Path::cluster && !built)
    return detail::refuse("gated_delta_backward: backward = cluster, but this build has no sm_90 code for it (its PTX is for "
                          "compute capability below 9.0: add 90 to CMAKE_CUDA_ARCHITECTURES; or use automatic or one_block)");
  *clustered = d.backward == Path::cluster ||
               (d.backward == Path::automatic && built && d.sequences * d.v_heads * column_blocks(d.v_dim) <= sms);
  return cudaSuccess;
}

/// fn(std::integral_constant<int, R>) for the rows a thread holds at this dk.
template <class Fn>
cudaError_t with_rows(std::int64_t dk, Fn&& fn) {
  switch (rows_per_thread(dk)) {
    case 8: return fn(std::integral_constant<int, 8>{});
    case 16: return fn(std::integral_constant<int, 16>{});
    default: return fn(std::integral_constant<int, 32>{});
  }
}

/// The recurrent form's backward kernels: dv, dg, dbeta, d_state and the per-value-head dq_part, dk_part.
cudaError_t recurrent_backward(const GatedDeltaDims& d, const std::uint16_t* qb, const std::uint16_t* kb, const bf16* v, const float* g,
                               const float* beta, const bf16* d_out, const float* states, bf16* dv, float* dg, float* dbeta,
                               float* d_state, float* scratch, float* dq_part, float* dk_part, cudaStream_t stream) {
  bool clustered = false;
  if (const cudaError_t e = use_clusters(d, &clustered); e != cudaSuccess) return e;
  return with_rows(d.k_dim, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if (clustered) {
      const std::size_t smem = cluster_smem_bytes<R>();
      if (const cudaError_t e = reserve_smem(backward_cluster_kernel<R>, smem); e != cudaSuccess) return e;
      const auto blocks = static_cast<unsigned>(column_blocks(d.v_dim));  // <= 4: within the portable cluster size of 8
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(d.sequences * d.v_heads) * blocks);
      config.blockDim = dim3(cluster_threads);
      config.dynamicSmemBytes = smem;
      config.stream = stream;
      cudaLaunchAttribute cluster{};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = blocks;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      config.attrs = &cluster;
      config.numAttrs = 1;
      return cudaLaunchKernelEx(&config, backward_cluster_kernel<R>, d, qb, kb, reinterpret_cast<const std::uint16_t*>(v), g, beta,
                                reinterpret_cast<const std::uint16_t*>(d_out), states, reinterpret_cast<std::uint16_t*>(dv), dg,
                                dbeta, d_state, scratch, dq_part, dk_part);
    }
    const std::size_t smem = backward_smem_bytes<R>(d);
    if (const cudaError_t e = reserve_smem(backward_kernel<R>, smem); e != cudaSuccess) return e;
    backward_kernel<R><<<static_cast<unsigned>(d.sequences * d.v_heads), static_cast<unsigned>(backward_threads(d)), smem, stream>>>(
        d, qb, kb, reinterpret_cast<const std::uint16_t*>(v), g, beta, reinterpret_cast<const std::uint16_t*>(d_out), states,
        reinterpret_cast<std::uint16_t*>(dv), dg, dbeta, d_state, scratch, dq_part, dk_part);
    return cudaGetLastError();
  });
}

}  // namespace

bool gated_delta_chunked_supported() {
  bool supported = false;
  int sms = 0;
  return chunked_device(&supported, &sms) == cudaSuccess && supported;
}

std::size_t gated_delta_states_floats(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1) return 0;
  return static_cast<std::size_t>(d.sequences * d.v_heads * (d.chunks() + 1) * d.k_dim * d.v_dim);
}

std::size_t gated_delta_backward_workspace_bytes(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1 || d.k_dim < 1 || d.v_dim < 1) return 0;
  // The chunked form's leaving-state gradients, or each recurrent block's states of one chunk as
  // its threads hold them (R rows each); then dq and dk per value head.
  return static_cast<std::size_t>(form_scratch_floats(d) + 2 * d.tokens() * d.v_heads * d.k_dim) * sizeof(float);
}

cudaError_t gated_delta_forward(const GatedDeltaDims& dims, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                const float* beta, bf16* out, float* states, cudaStream_t stream) {
  constexpr const char* name = "gated_delta_forward";
  if (const cudaError_t e = check_dims(name, dims); e != cudaSuccess) return e;
  const GatedDeltaDims d = with_strides(dims);
  if (d.tokens() == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"out", out},
                                                       {"states", states}});
      e != cudaSuccess)
    return e;
  bool chunk_form = false;
  if (const cudaError_t e = runs_chunked(name, d, Pass::forward, &chunk_form); e != cudaSuccess) return e;
  if (chunk_form)
    return detail::gated_delta_chunked_forward(d, reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
                                               reinterpret_cast<const std::uint16_t*>(v), g, beta,
                                               reinterpret_cast<std::uint16_t*>(out), states, stream);
  const auto blocks = static_cast<unsigned>(d.sequences * d.v_heads * column_blocks(d.v_dim));
  return with_rows(d.k_dim, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const std::size_t smem = Tile<R>::floats(forward_columns) * sizeof(float);
    if (const cudaError_t e = reserve_smem(forward_kernel<R>, smem); e != cudaSuccess) return e;
    forward_kernel<R><<<blocks, forward_columns * parts, smem, stream>>>(
        d, reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
        reinterpret_cast<const std::uint16_t*>(v), g, beta, reinterpret_cast<std::uint16_t*>(out), states);
    return cudaGetLastError();
  });
}

cudaError_t gated_delta_backward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream) {
  return gated_delta_backward(d, q, k, v, g, beta, d_out, states, dq, dk, dv, dg, dbeta, nullptr, workspace, workspace_bytes, stream);
}

cudaError_t gated_delta_backward(const GatedDeltaDims& dims, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, float* d_state, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream) {
  constexpr const char* name = "gated_delta_backward";
  if (const cudaError_t e = check_dims(name, dims); e != cudaSuccess) return e;
  const GatedDeltaDims d = with_strides(dims);
  if (d.tokens() == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"d_out", d_out},
                                                       {"states", states}, {"dq", dq}, {"dk", dk}, {"dv", dv}, {"dg", dg},
                                                       {"dbeta", dbeta}});
      e != cudaSuccess)
    return e;
  const std::size_t need = gated_delta_backward_workspace_bytes(d);
  if (workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace(name, workspace, workspace_bytes, need, "gated_delta_backward_workspace_bytes(dims)");
  auto* scratch = static_cast<float*>(workspace);
  bool chunk_form = false;
  if (const cudaError_t e = runs_chunked(name, d, Pass::backward, &chunk_form); e != cudaSuccess) return e;
  float* dq_part = scratch + form_scratch_floats(d);
  float* dk_part = dq_part + d.tokens() * d.v_heads * d.k_dim;
  const auto* qb = reinterpret_cast<const std::uint16_t*>(q);
  const auto* kb = reinterpret_cast<const std::uint16_t*>(k);
  const cudaError_t launched = chunk_form ? detail::gated_delta_chunked_backward(
                                                d, qb, kb, reinterpret_cast<const std::uint16_t*>(v), g, beta,
                                                reinterpret_cast<const std::uint16_t*>(d_out), states,
                                                reinterpret_cast<std::uint16_t*>(dv), dg, dbeta, d_state, scratch, dq_part, dk_part, stream)
                                          : recurrent_backward(d, qb, kb, v, g, beta, d_out, states, dv, dg, dbeta, d_state, scratch,
                                                               dq_part, dk_part, stream);
  if (launched != cudaSuccess) return launched;
  const std::int64_t rows = 2 * d.tokens() * d.k_heads, per_block = norm_threads / 32;
  const std::int64_t blocks = (rows + per_block - 1) / per_block;  // within 2^31 - 1: check_dims
  l2norm_backward_kernel<<<static_cast<unsigned>(blocks), norm_threads, 0, stream>>>(
      d, qb, kb, dq_part, dk_part, reinterpret_cast<std::uint16_t*>(dq), reinterpret_cast<std::uint16_t*>(dk));
  return cudaGetLastError();
}

}  // namespace oom::kernels
