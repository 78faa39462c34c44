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
// Backward: a block per (sequence, value head), every column (dq and dk sum over them): per chunk
// from the last, the chunk's states are recomputed from the one the forward kept (the same
// arithmetic as the forward: the same bits) into this block's scratch, then the tokens are walked
// backwards with the state's gradient dS beside the state in registers; the sums over columns
// (dq, dk, d alpha, d beta) reduce-scatter over a warp's 8 columns by shuffles, then add the warps'
// partials in warp order through shared memory. A last kernel sums dq and dk over the value heads
// of each key head, in head order, and takes them back through the l2norm.
#include <algorithm>
#include <type_traits>

#include "bf16_device.cuh"
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

__host__ __device__ constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
// GatedDeltaDims' chunks() and tokens(), for device code (the header's are host functions).
__device__ std::int64_t chunks_of(const GatedDeltaDims& d) { return (d.seq_len + d.chunk - 1) / d.chunk; }
__device__ std::int64_t tokens_of(const GatedDeltaDims& d) { return d.sequences * d.seq_len; }

/// Rows a thread holds: dk / P rounded up to 8, 16 or 32 (the reduce-scatter halves it three times).
int rows_per_thread(std::int64_t dk) { return dk <= 32 ? 8 : dk <= 64 ? 16 : 32; }
/// The forward's blocks per (sequence, head): one per forward_columns columns of the state.
__host__ __device__ std::int64_t column_blocks(std::int64_t dv) { return (dv + forward_columns - 1) / forward_columns; }

// The recurrence's steps, spelled out (explicit fma and uncontracted products) so that the
// forward and the backward's recomputation round alike whatever the compiler contracts.
__device__ __forceinline__ float dot_step(float acc, float s, float k) { return __fmaf_rn(s, k, acc); }
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
  float u = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) u = dot_step(u, s[r], kk[r]);
  const float delta = delta_of(tile.beta[tt], tile.v[tt * vcols + jl], a, column_sum(u));
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
__global__ void __launch_bounds__(forward_columns * parts) forward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
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
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = 0.0f;
  float* my_states = states + static_cast<std::size_t>(bh) * (chunks_of(d) + 1) * dk * dv;
  for (std::int64_t t0 = 0; t0 < S; t0 += tile_tokens) {
    const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), S - t0));
    __syncthreads();
    stage(d, tile, b, h, t0, n, j0, forward_columns, q, k, v, g, beta, nullptr);
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      const std::int64_t t = t0 + tt;
      if (t % d.chunk == 0 && owner) save_rows(s, my_states + (t / d.chunk) * dk * dv, dk, dv, j, p);
      recur(s, tile, tt, jl, p, forward_columns);
      const float* qq = tile.qn + tt * Tile<R>::row + p * (R + 1);
      float o = 0;
#pragma unroll
      for (int r = 0; r < R; ++r) o = dot_step(o, s[r], qq[r]);
      o = column_sum(o);
      if (owner && p == 0) out[((b * S + t) * H + h) * dv + j] = float_to_bf16(o);
    }
  }
  if (owner) save_rows(s, my_states + chunks_of(d) * dk * dv, dk, dv, j, p);
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

template <int R>
__global__ void __launch_bounds__(max_backward_threads) backward_kernel(
    GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* g,
    const float* beta, const std::uint16_t* d_out, const float* states, std::uint16_t* dv_out, float* dg, float* dbeta,
    float* scratch, float* dq_part, float* dk_part) {
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
  const float* my_states = states + static_cast<std::size_t>(blockIdx.x) * (chunks + 1) * dk * dv;
  float* my_scratch = scratch + static_cast<std::size_t>(blockIdx.x) * min(d.chunk, S) * R * blockDim.x;
  float s[R], ds[R], x[R];
#pragma unroll
  for (int r = 0; r < R; ++r) ds[r] = 0.0f;
  for (std::int64_t c = chunks - 1; c >= 0; --c) {
    const std::int64_t c0 = c * d.chunk, c1 = min(S, c0 + d.chunk);
    // The chunk's states, from the kept one: the state before token t to scratch[t - c0] (r-major).
    if (owner) load_rows(s, my_states + c * dk * dv, dk, dv, jl, p);
    else
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = 0.0f;
    for (std::int64_t t0 = c0; t0 < c1; t0 += tile_tokens) {
      const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), c1 - t0));
      __syncthreads();
      stage(d, tile, b, h, t0, n, 0, vcols, q, k, v, g, beta, nullptr);
      __syncthreads();
      for (int tt = 0; tt < n; ++tt) {
        float* to = my_scratch + (t0 + tt - c0) * R * blockDim.x + threadIdx.x;
#pragma unroll
        for (int r = 0; r < R; ++r) to[r * blockDim.x] = s[r];
        recur(s, tile, tt, jl, p, vcols);
      }
    }
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
        const float* from = my_scratch + (t - c0) * R * blockDim.x + threadIdx.x;
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = from[r * blockDim.x];
        const float* kk = tile.kn + tt * Tile<R>::row + p * (R + 1);
        const float* qq = tile.qn + tt * Tile<R>::row + p * (R + 1);
        const float a = tile.alpha[tt], bb = tile.beta[tt], vj = tile.v[tt * vcols + jl], doj = tile.dout[tt * vcols + jl];
        // Columns: u = S^T k (before the decay), delta; dS += q do^T; dd = dS^T k.
        float u = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) u = dot_step(u, s[r], kk[r]);
        u = column_sum(u);
        const float delta = delta_of(bb, vj, a, u);
        float dd = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          ds[r] = __fmaf_rn(qq[r], doj, ds[r]);
          dd = dot_step(dd, ds[r], kk[r]);
        }
        dd = column_sum(dd);
        const float du = -bb * dd;
        const int buf = static_cast<int>(t & 1);
        // Rows: dq = S_t do with S_t = a S + k delta^T; dk = dS delta + a S du.
#pragma unroll
        for (int r = 0; r < R; ++r) x[r] = update(s[r], a, kk[r], delta) * doj;
        reduce_scatter_columns(x, lane);
        float* dq_row = dq_w + (buf * warps + warp) * parts * R + p * R + scatter_offset<R>(lane);
#pragma unroll
        for (int m2 = 0; m2 < R / 8; ++m2) dq_row[m2] = x[m2];
#pragma unroll
        for (int r = 0; r < R; ++r) x[r] = __fmaf_rn(ds[r], delta, a * s[r] * du);
        reduce_scatter_columns(x, lane);
        float* dk_row = dk_w + (buf * warps + warp) * parts * R + p * R + scatter_offset<R>(lane);
#pragma unroll
        for (int m2 = 0; m2 < R / 8; ++m2) dk_row[m2] = x[m2];
        // dS' = dS + k du^T; d alpha = <dS', S>; the gradient entering the previous token is a dS'.
        float dalpha = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float y = __fmaf_rn(kk[r], du, ds[r]);
          dalpha = __fmaf_rn(y, s[r], dalpha);
          ds[r] = a * y;
        }
        dalpha = warp_sum(dalpha);
        const float dbeta_term = warp_sum(p == 0 ? dd * (vj - __fmul_rn(a, u)) : 0.0f);
        if (lane == 0) {
          scal_w[(buf * warps + warp) * 2] = dalpha;
          scal_w[(buf * warps + warp) * 2 + 1] = dbeta_term;
        }
        if (owner && p == 0) dv_out[(b * S + t) * d.v_stride + h * dv + jl] = float_to_bf16(bb * dd);
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
          dg[(b * S + t) * H + h] = da * a;
          dbeta[(b * S + t) * H + h] = db;
        }
      }
    }
  }
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
    return detail::refuse(name, ": k_dim = ", d.k_dim, ", v_dim = ", d.v_dim, " (need 1..", max_dim, " each: the state's rows and "
                          "columns are held in registers)");
  if (d.chunk < 1) return detail::refuse(name, ": chunk = ", d.chunk, " (must be >= 1)");
  if (d.qk_stride != 0 && d.qk_stride < d.k_heads * d.k_dim)
    return detail::refuse(name, ": qk_stride = ", d.qk_stride, " is less than k_heads x k_dim = ", d.k_heads * d.k_dim);
  if (d.v_stride != 0 && d.v_stride < d.v_heads * d.v_dim)
    return detail::refuse(name, ": v_stride = ", d.v_stride, " is less than v_heads x v_dim = ", d.v_heads * d.v_dim);
  if (d.sequences * d.v_heads * column_blocks(d.v_dim) > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences, " sequences x ", d.v_heads, " value heads need more than 2^31 - 1 blocks");
  if ((2 * d.sequences * d.seq_len * d.k_heads + norm_threads / 32 - 1) / (norm_threads / 32) > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences * d.seq_len, " tokens x ", d.k_heads, " key heads need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

/// The dims as the kernels read them: a stride of 0 is the packed one.
GatedDeltaDims with_strides(GatedDeltaDims d) {
  if (d.qk_stride == 0) d.qk_stride = d.k_heads * d.k_dim;
  if (d.v_stride == 0) d.v_stride = d.v_heads * d.v_dim;
  return d;
}

/// The opt-in for `smem` bytes of dynamic shared memory (over 48 KiB).
template <class Kernel>
cudaError_t reserve_smem(Kernel kernel, std::size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

std::int64_t backward_threads(const GatedDeltaDims& d) { return round_up(d.v_dim, 8) * parts; }
/// Floats of the backward's scratch: each block's states of one chunk as its threads hold them.
std::int64_t scratch_floats(const GatedDeltaDims& d) {
  return round_up(d.sequences * d.v_heads * std::min(d.chunk, d.seq_len) * rows_per_thread(d.k_dim) * backward_threads(d), 64);
}

template <int R>
std::size_t backward_smem_bytes(const GatedDeltaDims& d) {
  const std::int64_t warps = backward_threads(d) / 32;
  return (Tile<R>::floats(round_up(d.v_dim, 8)) + static_cast<std::size_t>(4 * warps * parts * R + 4 * warps)) * sizeof(float);
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

}  // namespace

std::size_t gated_delta_states_floats(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1) return 0;
  return static_cast<std::size_t>(d.sequences * d.v_heads * (d.chunks() + 1) * d.k_dim * d.v_dim);
}

std::size_t gated_delta_backward_workspace_bytes(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1 || d.k_dim < 1 || d.v_dim < 1) return 0;
  // Each block's states of one chunk, as its threads hold them (R rows each), then dq and dk per value head.
  return static_cast<std::size_t>(scratch_floats(d) + 2 * d.tokens() * d.v_heads * d.k_dim) * sizeof(float);
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

cudaError_t gated_delta_backward(const GatedDeltaDims& dims, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, void* workspace, std::size_t workspace_bytes,
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
  float* dq_part = scratch + scratch_floats(d);
  float* dk_part = dq_part + d.tokens() * d.v_heads * d.k_dim;
  const auto* qb = reinterpret_cast<const std::uint16_t*>(q);
  const auto* kb = reinterpret_cast<const std::uint16_t*>(k);
  const cudaError_t launched = with_rows(d.k_dim, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const std::size_t smem = backward_smem_bytes<R>(d);
    if (const cudaError_t e = reserve_smem(backward_kernel<R>, smem); e != cudaSuccess) return e;
    backward_kernel<R><<<static_cast<unsigned>(d.sequences * d.v_heads), static_cast<unsigned>(backward_threads(d)), smem, stream>>>(
        d, qb, kb, reinterpret_cast<const std::uint16_t*>(v), g, beta, reinterpret_cast<const std::uint16_t*>(d_out), states,
        reinterpret_cast<std::uint16_t*>(dv), dg, dbeta, scratch, dq_part, dk_part);
    return cudaGetLastError();
  });
  if (launched != cudaSuccess) return launched;
  const std::int64_t rows = 2 * d.tokens() * d.k_heads, per_block = norm_threads / 32;
  const std::int64_t blocks = (rows + per_block - 1) / per_block;  // within 2^31 - 1: check_dims
  l2norm_backward_kernel<<<static_cast<unsigned>(blocks), norm_threads, 0, stream>>>(
      d, qb, kb, dq_part, dk_part, reinterpret_cast<std::uint16_t*>(dq), reinterpret_cast<std::uint16_t*>(dk));
  return cudaGetLastError();
}

}  // namespace oom::kernels
