// RMSNorm kernels: forward and input-gradient with one warp per row (rows are as short as a
// 128-wide head, so a block per row would idle most of its threads), and the weight gradient as a
// separate column reduction into per-chunk partials summed in a fixed order (deterministic, no
// atomics). Contract in include/oom/kernels/rmsnorm.hpp.
#include "bf16_device.cuh"
#include "oom/kernels/rmsnorm.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::store_bf16;
using detail::warp_sum;

constexpr int warps_per_block = 8;

template <int N>
__device__ void forward_row(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                            std::int64_t dim, float eps, int lane) {
  float ss = 0.0f;
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float v[N];
    load_bf16<N>(x + c, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ss = __fmaf_rn(v[k], v[k], ss);
  }
  ss = warp_sum(ss);
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(dim)), eps)));
  // Second read of the row: it was just loaded by this warp and is served from L1/L2.
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float v[N], wv[N], out[N];
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = (v[k] * r) * wv[k];
    store_bf16<N>(y + c, out);
  }
  if (lane == 0 && rstd != nullptr) *rstd = r;
}

__global__ void forward_rows(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                             std::int64_t rows, std::int64_t dim, float eps, bool vec) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t off = row * dim;
  float* r = rstd == nullptr ? nullptr : rstd + row;
  if (vec) {
    forward_row<8>(x + off, w, y + off, r, dim, eps, lane);
  } else {
    forward_row<1>(x + off, w, y + off, r, dim, eps, lane);
  }
}

template <int N>
__device__ void grad_x_row(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w, float r,
                           std::uint16_t* dx, std::int64_t dim, int lane) {
  float dot = 0.0f;
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float g[N], v[N], wv[N];
    load_bf16<N>(dy + c, g);
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) dot = __fmaf_rn(g[k] * wv[k], v[k] * r, dot);
  }
  const float mean_dot = warp_sum(dot) / static_cast<float>(dim);
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float g[N], v[N], wv[N], out[N];
    load_bf16<N>(dy + c, g);
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = r * (g[k] * wv[k] - (v[k] * r) * mean_dot);
    store_bf16<N>(dx + c, out);
  }
}

__global__ void grad_x_rows(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                            const float* rstd, std::uint16_t* dx, std::int64_t rows, std::int64_t dim, bool vec) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t off = row * dim;
  const float r = rstd[row];
  if (vec) {
    grad_x_row<8>(dy + off, x + off, w, r, dx + off, dim, lane);
  } else {
    grad_x_row<1>(dy + off, x + off, w, r, dx + off, dim, lane);
  }
}

// Weight-gradient partials: block (32 columns-vectors, 8 row slices) over one chunk of rows.
// Slice y sums rows chunk_begin + y, + 8, ... in order; slices are then added 0..7 in order.
constexpr int slices = 8;

template <int N>
__device__ void grad_w_partial(const std::uint16_t* dy, const std::uint16_t* x, const float* rstd, float* partial,
                               std::int64_t rows, std::int64_t dim, std::int64_t rows_per_partial) {
  __shared__ float acc_s[slices][32][8];
  const std::int64_t c = (static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x) * N;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_partial;
  const std::int64_t end = begin + rows_per_partial < rows ? begin + rows_per_partial : rows;
  float acc[N] = {};
  if (c < dim) {
    for (std::int64_t row = begin + threadIdx.y; row < end; row += slices) {
      float g[N], v[N];
      load_bf16<N>(dy + row * dim + c, g);
      load_bf16<N>(x + row * dim + c, v);
      const float r = rstd[row];
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = __fmaf_rn(g[k], v[k] * r, acc[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) acc_s[threadIdx.y][threadIdx.x][k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < dim) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float s = acc_s[0][threadIdx.x][k];
      for (int y = 1; y < slices; ++y) s += acc_s[y][threadIdx.x][k];
      partial[static_cast<std::int64_t>(blockIdx.y) * dim + c + k] = s;
    }
  }
}

__global__ void grad_w_partials(const std::uint16_t* dy, const std::uint16_t* x, const float* rstd, float* partial,
                                std::int64_t rows, std::int64_t dim, std::int64_t rows_per_partial, bool vec) {
  if (vec) {
    grad_w_partial<8>(dy, x, rstd, partial, rows, dim, rows_per_partial);
  } else {
    grad_w_partial<1>(dy, x, rstd, partial, rows, dim, rows_per_partial);
  }
}

__global__ void sum_partials(const float* partial, float* grad_w, std::int64_t partials, std::int64_t dim) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= dim) return;
  float s = 0.0f;
  for (std::int64_t p = 0; p < partials; ++p) s += partial[p * dim + c];
  grad_w[c] += s;
}

std::int64_t partial_count(std::int64_t rows) {
  const std::int64_t per = rmsnorm_rows_per_partial(rows);
  return (rows + per - 1) / per;
}

}  // namespace

cudaError_t rmsnorm_forward(const bf16* x, const bf16* weight, bf16* y, float* rstd, std::int64_t rows,
                            std::int64_t dim, float eps, cudaStream_t stream) {
  if (rows < 0 || dim < 1 || !(eps >= 0.0f)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const unsigned grid = grid_for(rows, warps_per_block);
  if (grid == 0) return cudaErrorInvalidValue;
  const bool vec = dim % 8 == 0 && aligned_16(x, weight, y);
  forward_rows<<<grid, warps_per_block * 32, 0, stream>>>(
      reinterpret_cast<const std::uint16_t*>(x), reinterpret_cast<const std::uint16_t*>(weight),
      reinterpret_cast<std::uint16_t*>(y), rstd, rows, dim, eps, vec);
  return cudaGetLastError();
}

std::size_t rmsnorm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim) {
  if (rows <= 0 || dim < 1) return 0;
  return static_cast<std::size_t>(partial_count(rows) * dim) * sizeof(float);
}

cudaError_t rmsnorm_backward(const bf16* grad_y, const bf16* x, const bf16* weight, const float* rstd, bf16* grad_x,
                             float* grad_weight, std::int64_t rows, std::int64_t dim, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream) {
  if (rows < 0 || dim < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (workspace == nullptr || workspace_bytes < rmsnorm_backward_workspace_bytes(rows, dim)) return cudaErrorInvalidValue;
  const auto* dy = reinterpret_cast<const std::uint16_t*>(grad_y);
  const auto* xb = reinterpret_cast<const std::uint16_t*>(x);
  const auto* wb = reinterpret_cast<const std::uint16_t*>(weight);
  auto* partial = static_cast<float*>(workspace);
  const std::int64_t partials = partial_count(rows);
  const std::int64_t per = rmsnorm_rows_per_partial(rows);
  if (partials > 65535) return cudaErrorInvalidValue;  // grid.y limit; cannot happen with <= 256 partials

  // Weight gradient first, so grad_x may overwrite grad_y or x afterwards.
  const bool vec_w = dim % 8 == 0 && aligned_16(grad_y, x);
  const unsigned col_blocks = grid_for(dim, 32 * (vec_w ? 8 : 1));
  grad_w_partials<<<dim3(col_blocks, static_cast<unsigned>(partials)), dim3(32, slices), 0, stream>>>(
      dy, xb, rstd, partial, rows, dim, per, vec_w);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  sum_partials<<<grid_for(dim, 256), 256, 0, stream>>>(partial, grad_weight, partials, dim);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

  const unsigned grid = grid_for(rows, warps_per_block);
  if (grid == 0) return cudaErrorInvalidValue;
  const bool vec = dim % 8 == 0 && aligned_16(grad_y, x, weight, grad_x);
  grad_x_rows<<<grid, warps_per_block * 32, 0, stream>>>(dy, xb, wb, rstd, reinterpret_cast<std::uint16_t*>(grad_x),
                                                          rows, dim, vec);
  return cudaGetLastError();
}

}  // namespace oom::kernels
