// The Gated DeltaNet's conv, gates and gated norm. Contract in include/oom/kernels/deltanet.hpp;
// the math is oom::reference's (src/reference/gated_delta.cpp), in fp32.
//
// Elementwise work is a thread per element (the conv's K taps, the gates) or a warp per row (the
// norm). Parameter gradients sum over tokens in two steps: each block writes its partial sums over
// a fixed range of tokens to the workspace, then finish_partials adds the blocks' partials in
// block order: the same bits whatever the launch timing.
#include <algorithm>

#include "bf16_device.cuh"
#include "oom/kernels/deltanet.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;
using detail::warp_sum;

constexpr int threads = 256;
constexpr std::int64_t conv_tokens_per_block = 256;   // dw partials: tokens a block sums
constexpr std::int64_t gate_tokens_per_block = 64;   // dA_log, ddt_bias partials: 64 blocks at 4K tokens
constexpr std::int64_t norm_rows_per_warp = 128;      // dw partials of the norm: rows a warp sums (1,024 partials at 4K x 32 heads)
constexpr int norm_warps = 8;
constexpr int max_conv_kernel = 8;
constexpr std::int64_t max_norm_dim = 1024;

using detail::sigmoid;
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/// Blocks of per_block for n items; callers check it against the grid's limit before launching.
std::int64_t blocks_for(std::int64_t n, std::int64_t per_block) { return (n + per_block - 1) / per_block; }
constexpr std::int64_t max_blocks = 0x7fffffff;

/// out[i] = sum over b < blocks of partials[b * n + i], in block order.
__global__ void finish_partials(const float* partials, std::int64_t blocks, std::int64_t n, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (i >= n) return;
  float s = 0;
  for (std::int64_t b = 0; b < blocks; ++b) s += partials[b * n + i];
  out[i] = s;
}

cudaError_t finish(const float* partials, std::int64_t blocks, std::int64_t n, float* out, cudaStream_t stream) {
  finish_partials<<<static_cast<unsigned>(blocks_for(n, threads)), threads, 0, stream>>>(partials, blocks, n, out);
  return cudaGetLastError();
}

// ---- conv ---------------------------------------------------------------------------------------

/// Token t's (global row's) position in its sequence: t itself for one sequence (a part's future
/// rows run past seq_len), else t mod seq_len.
__device__ std::int64_t conv_pos(const ConvDims& d, std::int64_t t) { return d.sequences == 1 ? t : t % d.seq_len; }

/// The conv's value before the SiLU at token t (global row), channel c: the taps within t's
/// sequence, reaching `history` rows before it.
__device__ float conv_pre(const ConvDims& d, const std::uint16_t* x, const std::uint16_t* w, std::int64_t t, std::int64_t c) {
  const std::int64_t pos = conv_pos(d, t);
  float acc = 0;
  for (std::int64_t j = 0; j < d.kernel; ++j) {
    const std::int64_t back = d.kernel - 1 - j;  // tokens before t
    if (pos + d.history >= back)
      acc = __fmaf_rn(bf16_to_float(w[c * d.kernel + j]), bf16_to_float(x[(t - back) * d.x_stride + c]), acc);
  }
  return acc;
}

__global__ void conv_forward(ConvDims d, const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.sequences * d.seq_len * d.channels) return;
  const std::int64_t t = e / d.channels, c = e % d.channels;
  const float p = conv_pre(d, x, w, t, c);
  y[e] = float_to_bf16(p * sigmoid(p));
}

/// dL/d pre at (t, c): dy silu'(pre).
__device__ float conv_dpre(const ConvDims& d, const std::uint16_t* x, const std::uint16_t* w, const std::uint16_t* dy,
                           std::int64_t t, std::int64_t c) {
  return bf16_to_float(dy[t * d.channels + c]) * silu_grad(conv_pre(d, x, w, t, c));
}

__global__ void conv_backward_dx(ConvDims d, const std::uint16_t* x, const std::uint16_t* w, const std::uint16_t* dy,
                                 std::uint16_t* dx) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.sequences * d.seq_len * d.channels) return;
  const std::int64_t t = e / d.channels, c = e % d.channels, pos = conv_pos(d, t);
  float acc = 0;
  for (std::int64_t j = 0; j < d.kernel; ++j) {
    const std::int64_t ahead = d.kernel - 1 - j;  // x[t] is tap j of token t + ahead
    if (pos + ahead < d.seq_len + d.future) acc = __fmaf_rn(bf16_to_float(w[c * d.kernel + j]), conv_dpre(d, x, w, dy, t + ahead, c), acc);
  }
  dx[t * d.x_stride + c] = float_to_bf16(acc);
}

/// partials[block][c][j]: the block's tokens' dpre(t, c) x[t - K + 1 + j, c], in token order.
__global__ void conv_backward_dw(ConvDims d, const std::uint16_t* x, const std::uint16_t* w, const std::uint16_t* dy,
                                 float* partials) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * threads + threadIdx.x;
  if (c >= d.channels) return;
  const std::int64_t T = d.sequences * d.seq_len, t0 = static_cast<std::int64_t>(blockIdx.x) * conv_tokens_per_block;
  const std::int64_t t1 = min(T, t0 + conv_tokens_per_block);
  float acc[max_conv_kernel] = {};
  for (std::int64_t t = t0; t < t1; ++t) {
    const float g = conv_dpre(d, x, w, dy, t, c);
    const std::int64_t pos = conv_pos(d, t);
#pragma unroll
    for (int j = 0; j < max_conv_kernel; ++j) {
      const std::int64_t back = d.kernel - 1 - j;
      if (j < d.kernel && pos + d.history >= back) acc[j] = __fmaf_rn(g, bf16_to_float(x[(t - back) * d.x_stride + c]), acc[j]);
    }
  }
  float* out = partials + (static_cast<std::int64_t>(blockIdx.x) * d.channels + c) * d.kernel;
#pragma unroll
  for (int j = 0; j < max_conv_kernel; ++j)
    if (j < d.kernel) out[j] = acc[j];
}

cudaError_t check_conv(const char* name, const ConvDims& d) {
  if (d.sequences < 0 || d.seq_len < 0) return detail::refuse(name, ": sequences = ", d.sequences, ", seq_len = ", d.seq_len, " (must be >= 0)");
  if (d.channels < 1) return detail::refuse(name, ": channels = ", d.channels, " (must be >= 1)");
  if (d.kernel < 1 || d.kernel > max_conv_kernel)
    return detail::refuse(name, ": kernel = ", d.kernel, " (need 1..", max_conv_kernel, ")");
  if (d.x_stride < d.channels) return detail::refuse(name, ": x_stride = ", d.x_stride, " is less than channels = ", d.channels);
  if (d.history < 0 || d.future < 0 || d.history > d.kernel - 1 || d.future > d.kernel - 1)
    return detail::refuse(name, ": history = ", d.history, ", future = ", d.future, " (need 0..kernel - 1 = ", d.kernel - 1, ")");
  if ((d.history > 0 || d.future > 0) && d.sequences != 1)
    return detail::refuse(name, ": history and future rows need one sequence (a part of it), got sequences = ", d.sequences);
  if (blocks_for(d.channels, threads) > 65535) return detail::refuse(name, ": channels = ", d.channels, " (at most 65535 x 256)");
  if (blocks_for(d.tokens() * d.channels, threads) > max_blocks)
    return detail::refuse(name, ": ", d.tokens(), " tokens x ", d.channels, " channels need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

// ---- gates --------------------------------------------------------------------------------------

__global__ void gates_forward(GateDims d, const std::uint16_t* a, const std::uint16_t* b, const std::uint16_t* a_log,
                              const std::uint16_t* dt_bias, float* g, float* beta) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.tokens * d.heads) return;
  const std::int64_t t = e / d.heads, h = e % d.heads;
  beta[e] = sigmoid(bf16_to_float(b[t * d.ab_stride + h]));
  g[e] = -expf(bf16_to_float(a_log[h])) * softplus(bf16_to_float(a[t * d.ab_stride + h]) + bf16_to_float(dt_bias[h]));
}

/// da, db per (t, h); partials[block][0][h] = the block's tokens' dg g (dA_log), [1][h] = da (ddt_bias).
__global__ void gates_backward(GateDims d, const std::uint16_t* a, const std::uint16_t* b, const std::uint16_t* a_log,
                               const std::uint16_t* dt_bias, const float* dg, const float* dbeta, std::uint16_t* da,
                               std::uint16_t* db, float* partials) {
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * gate_tokens_per_block, t1 = min(d.tokens, t0 + gate_tokens_per_block);
  for (std::int64_t h = threadIdx.x; h < d.heads; h += blockDim.x) {
    const float A = expf(bf16_to_float(a_log[h])), bias = bf16_to_float(dt_bias[h]);
    float s_alog = 0, s_bias = 0;
    for (std::int64_t t = t0; t < t1; ++t) {
      const std::int64_t e = t * d.heads + h, at = t * d.ab_stride + h;
      const float xa = bf16_to_float(a[at]) + bias;
      const float sp = softplus(xa), spg = xa > 20.0f ? 1.0f : sigmoid(xa);
      const float ga = dg[e] * -A * spg;  // d g / d (a + dt_bias)
      const float sb = sigmoid(bf16_to_float(b[at]));
      da[at] = float_to_bf16(ga);
      db[at] = float_to_bf16(dbeta[e] * sb * (1.0f - sb));
      s_alog = __fmaf_rn(dg[e], -A * sp, s_alog);  // g = -exp(A_log) sp: d g / d A_log = g
      s_bias += ga;
    }
    partials[(static_cast<std::int64_t>(blockIdx.x) * 2) * d.heads + h] = s_alog;
    partials[(static_cast<std::int64_t>(blockIdx.x) * 2 + 1) * d.heads + h] = s_bias;
  }
}

/// The two partial rows [dA_log | ddt_bias] of every block summed into da_log and ddt_bias.
__global__ void finish_gates(const float* partials, std::int64_t blocks, std::int64_t heads, float* da_log, float* ddt_bias) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (i >= 2 * heads) return;
  float s = 0;
  for (std::int64_t b = 0; b < blocks; ++b) s += partials[b * 2 * heads + i];
  (i < heads ? da_log[i] : ddt_bias[i - heads]) = s;
}

cudaError_t check_gates(const char* name, const GateDims& d) {
  if (d.tokens < 0) return detail::refuse(name, ": tokens = ", d.tokens, " (must be >= 0)");
  if (d.heads < 1) return detail::refuse(name, ": heads = ", d.heads, " (must be >= 1)");
  if (d.ab_stride < d.heads) return detail::refuse(name, ": ab_stride = ", d.ab_stride, " is less than heads = ", d.heads);
  if (blocks_for(d.tokens * d.heads, threads) > max_blocks)
    return detail::refuse(name, ": ", d.tokens, " tokens x ", d.heads, " heads need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

// ---- gated RMSNorm ------------------------------------------------------------------------------

constexpr int norm_per_lane = max_norm_dim / 32;

__global__ void norm_forward(GatedNormDims d, const std::uint16_t* x, const std::uint16_t* z, const std::uint16_t* w,
                             std::uint16_t* y, float* rstd) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * norm_warps + threadIdx.x / 32;
  if (row >= d.tokens * d.heads) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t t = row / d.heads, h = row % d.heads;
  const std::uint16_t* xr = x + row * d.dim;
  const std::uint16_t* zr = z + t * d.z_stride + h * d.dim;
  float ss = 0;
  for (std::int64_t i = lane; i < d.dim; i += 32) {
    const float v = bf16_to_float(xr[i]);
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(d.dim) + d.eps);
  if (lane == 0) rstd[row] = r;
  for (std::int64_t i = lane; i < d.dim; i += 32) {
    const float zv = bf16_to_float(zr[i]);
    y[row * d.dim + i] = float_to_bf16(bf16_to_float(w[i]) * (bf16_to_float(xr[i]) * r) * (zv * sigmoid(zv)));
  }
}

/// A warp per run of norm_rows_per_warp rows: dx and dz per row; its rows' dw terms summed in row
/// order into partials[warp][dim].
__global__ void norm_backward(GatedNormDims d, const std::uint16_t* x, const std::uint16_t* z, const std::uint16_t* w,
                              const float* rstd, const std::uint16_t* dy, std::uint16_t* dx, std::uint16_t* dz, float* partials) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * norm_warps + threadIdx.x / 32;
  const std::int64_t rows = d.tokens * d.heads, r0 = warp * norm_rows_per_warp;
  if (r0 >= rows) return;
  const int lane = threadIdx.x % 32;
  float acc[norm_per_lane] = {};
  for (std::int64_t row = r0; row < min(rows, r0 + norm_rows_per_warp); ++row) {
    const std::int64_t t = row / d.heads, h = row % d.heads;
    const std::uint16_t* zr = z + t * d.z_stride + h * d.dim;
    const float r = rstd[row];
    float dot = 0;  // sum of dn n
#pragma unroll
    for (int m = 0; m < norm_per_lane; ++m) {
      const std::int64_t i = lane + 32 * m;
      if (i < d.dim) {
        const float n = bf16_to_float(x[row * d.dim + i]) * r, zv = bf16_to_float(zr[i]);
        dot = __fmaf_rn(bf16_to_float(dy[row * d.dim + i]) * bf16_to_float(w[i]) * (zv * sigmoid(zv)), n, dot);
      }
    }
    const float mean = warp_sum(dot) / static_cast<float>(d.dim);
#pragma unroll
    for (int m = 0; m < norm_per_lane; ++m) {
      const std::int64_t i = lane + 32 * m;
      if (i < d.dim) {
        const float n = bf16_to_float(x[row * d.dim + i]) * r, zv = bf16_to_float(zr[i]), g = bf16_to_float(dy[row * d.dim + i]);
        const float wi = bf16_to_float(w[i]), s = zv * sigmoid(zv);
        const float dn = g * wi * s;
        dx[row * d.dim + i] = float_to_bf16(r * (dn - n * mean));
        dz[t * d.z_stride + h * d.dim + i] = float_to_bf16(g * wi * n * silu_grad(zv));
        acc[m] = __fmaf_rn(g * n, s, acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < norm_per_lane; ++m) {
    const std::int64_t i = lane + 32 * m;
    if (i < d.dim) partials[warp * d.dim + i] = acc[m];
  }
}

std::int64_t norm_partials(const GatedNormDims& d) { return (d.tokens * d.heads + norm_rows_per_warp - 1) / norm_rows_per_warp; }

cudaError_t check_norm(const char* name, const GatedNormDims& d) {
  if (d.tokens < 0) return detail::refuse(name, ": tokens = ", d.tokens, " (must be >= 0)");
  if (d.heads < 1 || d.dim < 1 || d.dim > max_norm_dim)
    return detail::refuse(name, ": heads = ", d.heads, ", dim = ", d.dim, " (need heads >= 1, dim 1..", max_norm_dim, ")");
  if (d.z_stride < d.heads * d.dim)
    return detail::refuse(name, ": z_stride = ", d.z_stride, " is less than heads x dim = ", d.heads * d.dim);
  if (!(d.eps > 0.0f)) return detail::refuse(name, ": eps = ", d.eps, " (must be > 0)");
  if (blocks_for(d.tokens * d.heads, norm_warps) > max_blocks)
    return detail::refuse(name, ": ", d.tokens * d.heads, " rows need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

// ---- Qwen3-Next's fused projections ------------------------------------------------------------

/// Column `c` of the fused qkvz row (group g = c / group width) as a column of [q | k | v | z].
__device__ std::int64_t unfused_qkvz(const FusedProjectionDims& d, std::int64_t c) {
  const std::int64_t r = d.v_heads / d.k_heads, kw = d.k_heads * d.k_dim, vw = d.v_heads * d.v_dim;
  const std::int64_t width = 2 * d.k_dim + 2 * r * d.v_dim, g = c / width, o = c % width;
  if (o < d.k_dim) return g * d.k_dim + o;
  if (o < 2 * d.k_dim) return kw + g * d.k_dim + (o - d.k_dim);
  if (o < 2 * d.k_dim + r * d.v_dim) return 2 * kw + g * r * d.v_dim + (o - 2 * d.k_dim);
  return 2 * kw + vw + g * r * d.v_dim + (o - 2 * d.k_dim - r * d.v_dim);
}

__global__ void unfuse(FusedProjectionDims d, const std::uint16_t* qkvz_src, const std::uint16_t* ba_src, std::uint16_t* qkvz_dst,
                       std::uint16_t* ba_dst, bool inverse) {
  const std::int64_t r = d.v_heads / d.k_heads;
  const std::int64_t wide = 2 * d.k_heads * d.k_dim + 2 * d.v_heads * d.v_dim, narrow = 2 * d.v_heads;
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.tokens * (wide + narrow)) return;
  const std::int64_t t = e / (wide + narrow), c = e % (wide + narrow);
  if (c < wide) {
    const std::int64_t u = unfused_qkvz(d, c);
    if (inverse) qkvz_dst[t * wide + c] = qkvz_src[t * wide + u];
    else qkvz_dst[t * wide + u] = qkvz_src[t * wide + c];
  } else {
    const std::int64_t f = c - wide, g = f / (2 * r), o = f % (2 * r);
    const std::int64_t u = o < r ? g * r + o : d.v_heads + g * r + (o - r);  // [b_g | a_g] -> [b | a]
    if (inverse) ba_dst[t * narrow + f] = ba_src[t * narrow + u];
    else ba_dst[t * narrow + u] = ba_src[t * narrow + f];
  }
}

}  // namespace

cudaError_t deltanet_unfuse_projections(const FusedProjectionDims& d, const bf16* qkvz_src, const bf16* ba_src, bf16* qkvz_dst,
                                        bf16* ba_dst, bool inverse, cudaStream_t stream) {
  constexpr const char* name = "deltanet_unfuse_projections";
  if (d.tokens < 0 || d.k_heads < 1 || d.v_heads < 1 || d.v_heads % d.k_heads != 0 || d.k_dim < 1 || d.v_dim < 1)
    return detail::refuse(name, ": tokens = ", d.tokens, ", k_heads = ", d.k_heads, ", v_heads = ", d.v_heads, ", k_dim = ", d.k_dim,
                          ", v_dim = ", d.v_dim, " (need tokens >= 0, the rest >= 1, v_heads a multiple of k_heads)");
  if (d.tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"qkvz_src", qkvz_src}, {"ba_src", ba_src}, {"qkvz_dst", qkvz_dst}, {"ba_dst", ba_dst}});
      e != cudaSuccess)
    return e;
  if (qkvz_src == qkvz_dst || ba_src == ba_dst) return detail::refuse(name, ": the source and destination are the same array");
  const std::int64_t n = d.tokens * (2 * d.k_heads * d.k_dim + 2 * d.v_heads * d.v_dim + 2 * d.v_heads);
  if (blocks_for(n, threads) > max_blocks) return detail::refuse(name, ": ", n, " elements need more than 2^31 - 1 blocks");
  unfuse<<<static_cast<unsigned>(blocks_for(n, threads)), threads, 0, stream>>>(d, reinterpret_cast<const std::uint16_t*>(qkvz_src),
                                                         reinterpret_cast<const std::uint16_t*>(ba_src),
                                                         reinterpret_cast<std::uint16_t*>(qkvz_dst), reinterpret_cast<std::uint16_t*>(ba_dst),
                                                         inverse);
  return cudaGetLastError();
}

// ---- launchers ----------------------------------------------------------------------------------

cudaError_t causal_conv1d_silu_forward(const ConvDims& d, const bf16* x, const bf16* w, bf16* y, cudaStream_t stream) {
  constexpr const char* name = "causal_conv1d_silu_forward";
  if (const cudaError_t e = check_conv(name, d); e != cudaSuccess) return e;
  if (d.future != 0) return detail::refuse(name, ": future = ", d.future, " (the rows after a part are the backward's; 0 here)");
  if (d.tokens() == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"x", x}, {"w", w},
                                  {"y", y}});
      e != cudaSuccess)
    return e;
  conv_forward<<<static_cast<unsigned>(blocks_for(d.tokens() * d.channels, threads)), threads, 0, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(x), reinterpret_cast<const std::uint16_t*>(w), reinterpret_cast<std::uint16_t*>(y));
  return cudaGetLastError();
}

std::size_t causal_conv1d_silu_backward_workspace_bytes(const ConvDims& d) {
  if (d.tokens() <= 0 || d.channels < 1 || d.kernel < 1) return 0;
  return static_cast<std::size_t>(blocks_for(d.tokens(), conv_tokens_per_block) * d.channels * d.kernel) * sizeof(float);
}

cudaError_t causal_conv1d_silu_backward(const ConvDims& d, const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw,
                                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* name = "causal_conv1d_silu_backward";
  if (const cudaError_t e = check_conv(name, d); e != cudaSuccess) return e;
  if (d.tokens() == 0) {  // no tokens: a zero gradient of w
    if (dw == nullptr) return detail::refuse(name, ": dw is null");
    return cudaMemsetAsync(dw, 0, static_cast<std::size_t>(d.channels * d.kernel) * sizeof(float), stream);
  }
  if (const cudaError_t e = detail::refuse_null(name, {{"x", x}, {"w", w},
                                  {"dy", dy}, {"dx", dx},
                                  {"dw", dw}});
      e != cudaSuccess)
    return e;
  const std::size_t need = causal_conv1d_silu_backward_workspace_bytes(d);
  if (workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace(name, workspace, workspace_bytes, need, "causal_conv1d_silu_backward_workspace_bytes(dims)");
  const auto* xb = reinterpret_cast<const std::uint16_t*>(x);
  const auto* wb = reinterpret_cast<const std::uint16_t*>(w);
  const auto* dyb = reinterpret_cast<const std::uint16_t*>(dy);
  conv_backward_dx<<<static_cast<unsigned>(blocks_for(d.tokens() * d.channels, threads)), threads, 0, stream>>>(d, xb, wb, dyb,
                                                                                        reinterpret_cast<std::uint16_t*>(dx));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const auto token_blocks = static_cast<unsigned>(blocks_for(d.tokens(), conv_tokens_per_block));
  auto* partials = static_cast<float*>(workspace);
  conv_backward_dw<<<dim3(token_blocks, static_cast<unsigned>(blocks_for(d.channels, threads))), threads, 0, stream>>>(d, xb, wb, dyb,
                                                                                                                  partials);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return finish(partials, token_blocks, d.channels * d.kernel, dw, stream);
}

cudaError_t delta_gates_forward(const GateDims& d, const bf16* a, const bf16* b, const bf16* a_log, const bf16* dt_bias,
                                float* g, float* beta, cudaStream_t stream) {
  constexpr const char* name = "delta_gates_forward";
  if (const cudaError_t e = check_gates(name, d); e != cudaSuccess) return e;
  if (d.tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"a", a}, {"b", b},
                                  {"A_log", a_log},
                                  {"dt_bias", dt_bias}, {"g", g},
                                  {"beta", beta}});
      e != cudaSuccess)
    return e;
  gates_forward<<<static_cast<unsigned>(blocks_for(d.tokens * d.heads, threads)), threads, 0, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(a), reinterpret_cast<const std::uint16_t*>(b),
      reinterpret_cast<const std::uint16_t*>(a_log), reinterpret_cast<const std::uint16_t*>(dt_bias), g, beta);
  return cudaGetLastError();
}

std::size_t delta_gates_backward_workspace_bytes(const GateDims& d) {
  if (d.tokens <= 0 || d.heads < 1) return 0;
  return static_cast<std::size_t>(blocks_for(d.tokens, gate_tokens_per_block) * 2 * d.heads) * sizeof(float);
}

cudaError_t delta_gates_backward(const GateDims& d, const bf16* a, const bf16* b, const bf16* a_log, const bf16* dt_bias,
                                 const float* dg, const float* dbeta, bf16* da, bf16* db, float* da_log, float* ddt_bias,
                                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* name = "delta_gates_backward";
  if (const cudaError_t e = check_gates(name, d); e != cudaSuccess) return e;
  if (const cudaError_t e = detail::refuse_null(name, {{"dA_log", da_log},
                                  {"ddt_bias", ddt_bias}});
      e != cudaSuccess)
    return e;
  if (d.tokens == 0) {
    if (const cudaError_t e = cudaMemsetAsync(da_log, 0, static_cast<std::size_t>(d.heads) * sizeof(float), stream); e != cudaSuccess)
      return e;
    return cudaMemsetAsync(ddt_bias, 0, static_cast<std::size_t>(d.heads) * sizeof(float), stream);
  }
  if (const cudaError_t e = detail::refuse_null(name, {{"a", a}, {"b", b},
                                  {"A_log", a_log},
                                  {"dt_bias", dt_bias}, {"dg", dg},
                                  {"dbeta", dbeta}, {"da", da},
                                  {"db", db}});
      e != cudaSuccess)
    return e;
  const std::size_t need = delta_gates_backward_workspace_bytes(d);
  if (workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace(name, workspace, workspace_bytes, need, "delta_gates_backward_workspace_bytes(dims)");
  if (blocks_for(d.tokens, gate_tokens_per_block) > max_blocks)
    return detail::refuse(name, ": ", d.tokens, " tokens need more than 2^31 - 1 blocks of ", gate_tokens_per_block);
  const auto blocks = static_cast<unsigned>(blocks_for(d.tokens, gate_tokens_per_block));
  auto* partials = static_cast<float*>(workspace);
  const auto block_threads = static_cast<unsigned>(std::min<std::int64_t>(1024, (d.heads + 31) / 32 * 32));
  gates_backward<<<blocks, block_threads, 0, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(a), reinterpret_cast<const std::uint16_t*>(b),
      reinterpret_cast<const std::uint16_t*>(a_log), reinterpret_cast<const std::uint16_t*>(dt_bias), dg, dbeta,
      reinterpret_cast<std::uint16_t*>(da), reinterpret_cast<std::uint16_t*>(db), partials);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  finish_gates<<<static_cast<unsigned>(blocks_for(2 * d.heads, threads)), threads, 0, stream>>>(partials, blocks, d.heads, da_log, ddt_bias);
  return cudaGetLastError();
}

cudaError_t gated_rmsnorm_forward(const GatedNormDims& d, const bf16* x, const bf16* z, const bf16* w, bf16* y, float* rstd,
                                  cudaStream_t stream) {
  constexpr const char* name = "gated_rmsnorm_forward";
  if (const cudaError_t e = check_norm(name, d); e != cudaSuccess) return e;
  if (d.tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"x", x}, {"z", z},
                                  {"w", w}, {"y", y},
                                  {"rstd", rstd}});
      e != cudaSuccess)
    return e;
  norm_forward<<<static_cast<unsigned>(blocks_for(d.tokens * d.heads, norm_warps)), norm_warps * 32, 0, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(x), reinterpret_cast<const std::uint16_t*>(z), reinterpret_cast<const std::uint16_t*>(w),
      reinterpret_cast<std::uint16_t*>(y), rstd);
  return cudaGetLastError();
}

std::size_t gated_rmsnorm_backward_workspace_bytes(const GatedNormDims& d) {
  if (d.tokens <= 0 || d.heads < 1 || d.dim < 1) return 0;
  return static_cast<std::size_t>(norm_partials(d) * d.dim) * sizeof(float);
}

cudaError_t gated_rmsnorm_backward(const GatedNormDims& d, const bf16* x, const bf16* z, const bf16* w, const float* rstd,
                                   const bf16* dy, bf16* dx, bf16* dz, float* dw, void* workspace, std::size_t workspace_bytes,
                                   cudaStream_t stream) {
  constexpr const char* name = "gated_rmsnorm_backward";
  if (const cudaError_t e = check_norm(name, d); e != cudaSuccess) return e;
  if (d.tokens == 0) {
    if (dw == nullptr) return detail::refuse(name, ": dw is null");
    return cudaMemsetAsync(dw, 0, static_cast<std::size_t>(d.dim) * sizeof(float), stream);
  }
  if (const cudaError_t e = detail::refuse_null(name, {{"x", x}, {"z", z},
                                  {"w", w}, {"rstd", rstd},
                                  {"dy", dy}, {"dx", dx},
                                  {"dz", dz}, {"dw", dw}});
      e != cudaSuccess)
    return e;
  const std::size_t need = gated_rmsnorm_backward_workspace_bytes(d);
  if (workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace(name, workspace, workspace_bytes, need, "gated_rmsnorm_backward_workspace_bytes(dims)");
  auto* partials = static_cast<float*>(workspace);
  const std::int64_t warps = norm_partials(d);
  norm_backward<<<static_cast<unsigned>(blocks_for(warps, norm_warps)), norm_warps * 32, 0, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(x), reinterpret_cast<const std::uint16_t*>(z), reinterpret_cast<const std::uint16_t*>(w),
      rstd, reinterpret_cast<const std::uint16_t*>(dy), reinterpret_cast<std::uint16_t*>(dx), reinterpret_cast<std::uint16_t*>(dz),
      partials);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return finish(partials, warps, d.dim, dw, stream);
}

}  // namespace oom::kernels
