// RMSNorm kernels. Rows up to 8192 wide (4096 for the backward) with 16-byte aligned bf16 take the
// register path: a group of lanes (8 for rows up to 128 wide, such as Qwen3's per-head q/k norms,
// else a warp; in the backward two warps for rows over 2048 wide, so that a lane holds at most 128
// registers of dy and x and two blocks fit an SM) loads its row(s) once with 16-byte loads, keeps
// them in registers through the reduction and writes the result, so every input crosses HBM once
// and each thread has 128-256 bytes of loads in flight. The backward is one pass: it writes dx and
// accumulates the weight gradient of its chunk of rows into per-group shared-memory columns,
// summed per chunk in a fixed order (deterministic, no atomics), then a second launch sums the
// chunks' partials; on sm_90+ both launch as programmatic dependents of the kernel before them,
// and what reads nothing the kernel just before them writes runs before their wait (the one-pass
// kernel zeroes its shared columns; the sum loads grad_w, which only kernels that completed before
// the one-pass kernel's wait returned can have written).
// Other widths and alignments take the looped path (one warp per row, two passes over the row, a
// separate weight-gradient column reduction). Contract in include/oom/kernels/rmsnorm.hpp.
//
// Measured and not kept (H200, 2026-12-01): feeding the one-pass backward through per-lane
// cp.async stage rings (2-3 rows of each group in flight through ~200 KiB of shared memory, the
// weight-gradient columns in registers) ran at 41-46% of the copy at 4096 x 2048 against 51-56%
// (one block an SM: no more bytes in flight than two register-path blocks) and 51% at
// 65536 x 4096 against 73%. Also measured and not kept (2026-12-01,
// scripts/diag/rmsnorm_fused_sum.cu, 4096 x 2048 in place, 20 back-to-back launches): summing the
// partials in the one-pass kernel after a grid-wide barrier (cooperative launch, same bits) took as
// long as the second launch (17.3-17.7 us against 17.4-17.7); lighter partial sums (256 threads a
// block; 128 threads and 32 registers, which fit an SM beside two one-pass blocks) were no faster
// and up to 2.5 us slower (17.5-20 us); a float4 partial write cost the q-norm rows 3 points; the
// scheduling trigger right after the one-pass kernel's wait instead of after its rows cost the
// q-norm rows 2 us alone (it must stay after the wait in any case: the sum's early grad_w load
// relies on it); an L2 bulk prefetch of each group's next row was slower everywhere (65536 x
// 2048: 68.5% against 85.8%). With the trigger after the rows, the zeroing and the grad_w load
// before the waits: 16.7-17.0 us (69.6-71.1% of the 1 GiB copy) against 17.4-17.7 (66.8-68.1%).
// Also measured and not kept (2026-12-02, scripts/diag/rmsnorm_one_launch.cu): one launch, clusters
// of 8 / 4 / 2 blocks adding their partials through distributed shared memory and the last cluster
// (a zeroed ticket) summing into grad_w: 26.9-29.0 us at 4096 x 2048 against 16.9 (only 30 of 32
// clusters of 8 fit at once; smaller clusters leave the last sum to too few SMs), and the 65536-row
// grids 12-18% slower in their rows.
#include <type_traits>

#include "bf16_device.cuh"
#include "oom/kernels/rmsnorm.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::pack_bf16;
using detail::store_bf16;
using detail::unpack_bf16;
using detail::warp_sum;

constexpr int warps_per_block = 8;

/// Programmatic dependent launch (sm_90+): a grid launched after this one with
/// programmaticStreamSerializationAllowed may start its blocks once every block of this grid has
/// called allow_dependent_launch (or exited), and wait_for_prerequisite_grid then blocks until this
/// grid has completed and its writes are visible. Elsewhere both are no-ops and the launch is
/// ordinary stream order.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the stream's
/// previous kernel where the code loaded for it was compiled for sm_90+ (PTX version >= 9.0): its
/// launch and block scheduling overlap that kernel's end, and the kernel calls
/// wait_for_prerequisite_grid before it touches memory. Not from the device's compute capability: a
/// build for sm_80 running JIT-compiled on an H200 has no wait in its code, and the attribute would
/// let it read before the previous kernel's writes are visible.
template <class... Params, class... Args>
cudaError_t launch_as_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                                Args... args) {
  cudaFuncAttributes compiled{};
  if (const cudaError_t e = cudaFuncGetAttributes(&compiled, kernel); e != cudaSuccess) return e;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = compiled.ptxVersion >= 90 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// ----- register path -----

constexpr int block_threads = 256;
constexpr std::int64_t max_register_dim_forward = 8192;   // 32 x 16-byte quads per lane: 128 registers
constexpr std::int64_t max_register_dim_backward = 4096;  // dy and x: 2 x 64 registers per lane

/// Butterfly sum over the G lanes of an aligned group; G == 32 is warp_sum, bit for bit. Every lane
/// of the warp must call it.
template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = G / 2; offset >= 1; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float row_rstd(float ss, std::int64_t dim, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(dim)), eps)));
}

/// The weight a norm applies: w, or w + offset in fp32 for the (1 + w) norms of Qwen3-Next and
/// Qwen3.5 (offset 1); untouched when the offset is 0, so those norms keep their bits.
template <int N>
__device__ __forceinline__ void apply_offset(float (&wv)[N], float offset) {
  if (offset != 0.0f) {
#pragma unroll
    for (int k = 0; k < N; ++k) wv[k] += offset;
  }
}

/// G lanes per row, each holding V 16-byte quads (8 bf16; quad j of lane l is columns
/// (j G + l) 8 .. + 7, so each quad index is one coalesced G x 16-byte access); R rows per group
/// loaded together. Lane sums run over a lane's quads in order, as the looped path's do.
template <int G, int V, int R>
__global__ void __launch_bounds__(block_threads)
    forward_rows_in_registers(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                              std::int64_t rows, int dim, float eps, float w_offset) {
  constexpr int groups = block_threads / G;
  const int lane = threadIdx.x % G;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * (groups * R) + threadIdx.x / G;
  uint4 xq[R][V];
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const std::int64_t row = first + k * groups;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = (j * G + lane) * 8;
      xq[k][j] = row < rows && c < dim ? *reinterpret_cast<const uint4*>(x + row * dim + c) : make_uint4(0, 0, 0, 0);
    }
  }
  float r[R];
#pragma unroll
  for (int k = 0; k < R; ++k) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if ((j * G + lane) * 8 >= dim) continue;
      float v[8];
      unpack_bf16(xq[k][j], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = __fmaf_rn(v[e], v[e], ss);
    }
    r[k] = row_rstd(group_sum<G>(ss), dim, eps);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = (j * G + lane) * 8;
    if (c >= dim) continue;
    float wv[8];
    unpack_bf16(__ldg(reinterpret_cast<const uint4*>(w + c)), wv);
    apply_offset(wv, w_offset);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const std::int64_t row = first + k * groups;
      if (row >= rows) continue;
      float v[8], out[8];
      unpack_bf16(xq[k][j], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = (v[e] * r[k]) * wv[e];
      *reinterpret_cast<uint4*>(y + row * dim + c) = pack_bf16(out);
    }
  }
  if (lane == 0 && rstd != nullptr) {
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (first + k * groups < rows) rstd[first + k * groups] = r[k];
    }
  }
}

/// The sum of a row's G lane values, G = 8 or 32 by shuffles; G = 64 (a row over two warps, warps
/// 2g and 2g + 1): each warp's sum, exchanged through `pair_sums` (groups x 2 parities x 2 halves)
/// under the pair's named barrier (id 1 + g), then half 0 + half 1. `parity` alternates per row so
/// a warp never overwrites a value its partner may still be reading. Every lane of the group must
/// call it.
template <int G>
__device__ __forceinline__ float row_sum(float x, float* pair_sums, int group, int parity) {
  if constexpr (G <= 32) {
    return group_sum<G>(x);
  } else {
    static_assert(G == 64, "a row over one warp or two");
    const float half = warp_sum(x);
    float* slot = pair_sums + (group * 2 + parity) * 2;
    const int warp_in_pair = (threadIdx.x / 32) % 2;
    if (threadIdx.x % 32 == 0) slot[warp_in_pair] = half;
    asm volatile("bar.sync %0, 64;" ::"r"(1 + group) : "memory");
    return slot[0] + slot[1];
  }
}

/// One pass over a chunk of rmsnorm_rows_per_partial rows (blockIdx.x = chunk): group g handles
/// rows begin + g, + groups, ... in order, writes dx and adds dy * xhat into its own shared-memory
/// columns; the chunk's partial is then groups 0, 1, ... added in order (sum_group_columns). With
/// G = 32 (8 groups) this is the looped path's order (8 row slices), so both give the same
/// weight-gradient bits. In place is safe: each lane reads its quads of dy and x before it writes
/// the same quads of dx. The kernel's rows, a function so that scripts/diag/rmsnorm_fused_sum.cu
/// and rmsnorm_one_launch.cu can run them with other tails; acc_shared is the kernel's dynamic
/// shared memory: (groups, dim) fp32, then G = 64's pair sums.
template <int G, int V>
__device__ __forceinline__ void backward_chunk_rows(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                                                    const float* rstd, std::uint16_t* dx, std::int64_t rows, int dim,
                                                    std::int64_t rows_per_partial, float4* acc_shared, float w_offset = 0.0f) {
  constexpr int groups = block_threads / G;
  static_assert(G != 64 || groups <= 15, "one named barrier per pair");
  float* pair_sums = reinterpret_cast<float*>(acc_shared) + static_cast<std::int64_t>(groups) * dim;
  const int lane = threadIdx.x % G;
  const int group = threadIdx.x / G;
  float* acc = reinterpret_cast<float*>(acc_shared) + static_cast<std::int64_t>(group) * dim;
  // Shared memory only, so before the wait: it overlaps the previous kernel's end.
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = (j * G + lane) * 8;
    if (c >= dim) continue;
    reinterpret_cast<float4*>(acc + c)[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    reinterpret_cast<float4*>(acc + c)[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  wait_for_prerequisite_grid();  // launched as a dependent of the stream's previous kernel
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * rows_per_partial;
  const std::int64_t end = begin + rows_per_partial < rows ? begin + rows_per_partial : rows;
  // The trip count is uniform over the block, so every lane reaches the shuffles.
  int parity = 0;
  for (std::int64_t base = begin; base < end; base += groups, parity ^= 1) {
    const std::int64_t row = base + group;
    const bool valid = row < end;
    uint4 gq[V], xq[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = (j * G + lane) * 8;
      const bool live = valid && c < dim;
      gq[j] = live ? *reinterpret_cast<const uint4*>(dy + row * dim + c) : make_uint4(0, 0, 0, 0);
      xq[j] = live ? *reinterpret_cast<const uint4*>(x + row * dim + c) : make_uint4(0, 0, 0, 0);
    }
    const float r = valid ? rstd[row] : 0.0f;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = (j * G + lane) * 8;
      if (c >= dim) continue;
      float g[8], v[8], wv[8];
      unpack_bf16(gq[j], g);
      unpack_bf16(xq[j], v);
      unpack_bf16(__ldg(reinterpret_cast<const uint4*>(w + c)), wv);
      apply_offset(wv, w_offset);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = __fmaf_rn(g[e] * wv[e], v[e] * r, dot);
    }
    const float mean_dot = row_sum<G>(dot, pair_sums, group, parity) / static_cast<float>(dim);
    if (!valid) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = (j * G + lane) * 8;
      if (c >= dim) continue;
      float g[8], v[8], wv[8], out[8];
      unpack_bf16(gq[j], g);
      unpack_bf16(xq[j], v);
      unpack_bf16(__ldg(reinterpret_cast<const uint4*>(w + c)), wv);
      apply_offset(wv, w_offset);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = r * (g[e] * wv[e] - (v[e] * r) * mean_dot);
      *reinterpret_cast<uint4*>(dx + row * dim + c) = pack_bf16(out);
      float4* a = reinterpret_cast<float4*>(acc + c);
      float4 a0 = a[0], a1 = a[1];
      a0.x = __fmaf_rn(g[0], v[0] * r, a0.x);
      a0.y = __fmaf_rn(g[1], v[1] * r, a0.y);
      a0.z = __fmaf_rn(g[2], v[2] * r, a0.z);
      a0.w = __fmaf_rn(g[3], v[3] * r, a0.w);
      a1.x = __fmaf_rn(g[4], v[4] * r, a1.x);
      a1.y = __fmaf_rn(g[5], v[5] * r, a1.y);
      a1.z = __fmaf_rn(g[6], v[6] * r, a1.z);
      a1.w = __fmaf_rn(g[7], v[7] * r, a1.w);
      a[0] = a0;
      a[1] = a1;
    }
  }
  // The partial sum may be scheduled now. It waits for this grid before reading the partials; it
  // reads grad_w before that wait, which is safe because no block of this grid triggers before its
  // own wait above (so every kernel before this one is complete when the sum starts): keep this
  // trigger after the wait.
  allow_dependent_launch();
}

/// The chunk's partial from backward_chunk_rows' group columns: groups 0, 1, ... added in order.
/// Column c goes to `sink(c, sum)`.
template <int G, class Sink>
__device__ __forceinline__ void sum_group_columns(const float4* acc_shared, int dim, Sink sink) {
  constexpr int groups = block_threads / G;
  __syncthreads();
  const float* all = reinterpret_cast<const float*>(acc_shared);
  for (int c = threadIdx.x; c < dim; c += block_threads) {
    float s = all[c];
    for (int q = 1; q < groups; ++q) s += all[static_cast<std::int64_t>(q) * dim + c];
    sink(c, s);
  }
}

/// backward_chunk_rows, then the chunk's partial into `partial` (row blockIdx.x): the two-launch
/// backward's first kernel.
template <int G, int V>
__device__ __forceinline__ void backward_chunk(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                                               const float* rstd, std::uint16_t* dx, float* partial, std::int64_t rows,
                                               int dim, std::int64_t rows_per_partial, float4* acc_shared,
                                               float w_offset = 0.0f) {
  backward_chunk_rows<G, V>(dy, x, w, rstd, dx, rows, dim, rows_per_partial, acc_shared, w_offset);
  float* out = partial + static_cast<std::int64_t>(blockIdx.x) * dim;
  sum_group_columns<G>(acc_shared, dim, [out](int c, float s) { out[c] = s; });
}

template <int G, int V>
__global__ void __launch_bounds__(block_threads)
    backward_rows_in_registers(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                               const float* rstd, std::uint16_t* dx, float* partial, std::int64_t rows, int dim,
                               std::int64_t rows_per_partial, float w_offset) {
  extern __shared__ float4 acc_shared[];
  backward_chunk<G, V>(dy, x, w, rstd, dx, partial, rows, dim, rows_per_partial, acc_shared, w_offset);
}

/// R = rows per group loaded together: enough that each thread has >= 128 bytes of loads in flight.
template <int G, int V>
cudaError_t launch_forward(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                           std::int64_t rows, std::int64_t dim, float eps, float w_offset, cudaStream_t stream) {
  constexpr int R = V >= 8 ? 1 : 8 / V;
  const unsigned grid = grid_for(rows, block_threads / G * R);
  if (grid == 0) return detail::refuse("rmsnorm_forward: ", rows, " rows need more than 2^31 - 1 blocks");
  forward_rows_in_registers<G, V, R>
      <<<grid, block_threads, 0, stream>>>(x, w, y, rstd, rows, static_cast<int>(dim), eps, w_offset);
  return cudaGetLastError();
}

/// backward_chunk's dynamic shared memory: (groups, dim) fp32 columns, then G = 64's pair sums.
template <int G>
constexpr std::size_t backward_smem_bytes(std::int64_t dim) {
  constexpr std::size_t groups = block_threads / G;
  return groups * static_cast<std::size_t>(dim) * sizeof(float) + (G == 64 ? groups * 4 * sizeof(float) : 0);
}

/// Lets `kernel` launch with `smem` bytes of dynamic shared memory (over 48 KiB needs the opt-in).
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, std::size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

template <int G, int V>
cudaError_t launch_backward(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                            const float* rstd, std::uint16_t* dx, float* partial, std::int64_t rows,
                            std::int64_t dim, std::int64_t partials, std::int64_t rows_per_partial,
                            cudaStream_t stream, float w_offset = 0.0f) {
  const auto kernel = backward_rows_in_registers<G, V>;
  const std::size_t smem = backward_smem_bytes<G>(dim);
  if (const cudaError_t e = allow_dynamic_smem(kernel, smem); e != cudaSuccess) return e;
  return launch_as_dependent(kernel, dim3(static_cast<unsigned>(partials)), dim3(block_threads), smem, stream, dy, x, w,
                             rstd, dx, partial, rows, static_cast<int>(dim), rows_per_partial, w_offset);
}

/// f(std::integral_constant<int, G>, std::integral_constant<int, V>) for the register path's
/// backward at rows `dim` wide (<= max_register_dim_backward): lanes per row and quads per lane.
template <class F>
cudaError_t with_backward_width(std::int64_t dim, F&& f) {
  using std::integral_constant;
  if (dim <= 64) return f(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  if (dim <= 128) return f(integral_constant<int, 8>{}, integral_constant<int, 2>{});
  if (dim <= 256) return f(integral_constant<int, 32>{}, integral_constant<int, 1>{});
  if (dim <= 512) return f(integral_constant<int, 32>{}, integral_constant<int, 2>{});
  if (dim <= 1024) return f(integral_constant<int, 32>{}, integral_constant<int, 4>{});
  if (dim <= 2048) return f(integral_constant<int, 32>{}, integral_constant<int, 8>{});
  return f(integral_constant<int, 64>{}, integral_constant<int, 8>{});
}

cudaError_t launch_backward_for_width(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                                      const float* rstd, std::uint16_t* dx, float* partial, std::int64_t rows,
                                      std::int64_t dim, std::int64_t partials, std::int64_t rows_per_partial,
                                      cudaStream_t stream, float w_offset = 0.0f) {
  return with_backward_width(dim, [&](auto g, auto v) {
    return launch_backward<decltype(g)::value, decltype(v)::value>(dy, x, w, rstd, dx, partial, rows, dim, partials,
                                                                   rows_per_partial, stream, w_offset);
  });
}

// ----- looped path: any width, any alignment -----

template <int N>
__device__ void forward_row(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                            std::int64_t dim, float eps, int lane, float w_offset) {
  float ss = 0.0f;
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float v[N];
    load_bf16<N>(x + c, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ss = __fmaf_rn(v[k], v[k], ss);
  }
  ss = warp_sum(ss);
  const float r = row_rstd(ss, dim, eps);
  // Second read of the row: it was just loaded by this warp and is served from L1/L2.
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float v[N], wv[N], out[N];
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
    apply_offset(wv, w_offset);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = (v[k] * r) * wv[k];
    store_bf16<N>(y + c, out);
  }
  if (lane == 0 && rstd != nullptr) *rstd = r;
}

__global__ void forward_rows(const std::uint16_t* x, const std::uint16_t* w, std::uint16_t* y, float* rstd,
                             std::int64_t rows, std::int64_t dim, float eps, bool vec, float w_offset) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t off = row * dim;
  float* r = rstd == nullptr ? nullptr : rstd + row;
  if (vec) {
    forward_row<8>(x + off, w, y + off, r, dim, eps, lane, w_offset);
  } else {
    forward_row<1>(x + off, w, y + off, r, dim, eps, lane, w_offset);
  }
}

template <int N>
__device__ void grad_x_row(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w, float r,
                           std::uint16_t* dx, std::int64_t dim, int lane, float w_offset) {
  float dot = 0.0f;
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float g[N], v[N], wv[N];
    load_bf16<N>(dy + c, g);
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
    apply_offset(wv, w_offset);
#pragma unroll
    for (int k = 0; k < N; ++k) dot = __fmaf_rn(g[k] * wv[k], v[k] * r, dot);
  }
  const float mean_dot = warp_sum(dot) / static_cast<float>(dim);
  for (std::int64_t c = lane * N; c < dim; c += 32 * N) {
    float g[N], v[N], wv[N], out[N];
    load_bf16<N>(dy + c, g);
    load_bf16<N>(x + c, v);
    load_bf16<N>(w + c, wv);
    apply_offset(wv, w_offset);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = r * (g[k] * wv[k] - (v[k] * r) * mean_dot);
    store_bf16<N>(dx + c, out);
  }
}

__global__ void grad_x_rows(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                            const float* rstd, std::uint16_t* dx, std::int64_t rows, std::int64_t dim, bool vec,
                            float w_offset) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t off = row * dim;
  const float r = rstd[row];
  if (vec) {
    grad_x_row<8>(dy + off, x + off, w, r, dx + off, dim, lane, w_offset);
  } else {
    grad_x_row<1>(dy + off, x + off, w, r, dx + off, dim, lane, w_offset);
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

/// grad_w += the partials' sum, block (32 columns, partial_ranges ranges of partials): range y sums
/// its contiguous partials in order, then the ranges' sums are added 0..partial_ranges-1 in order.
/// 32 ranges: a 128-wide q-norm weight is 4 blocks, so each thread sums at most 16 of 512 partials.
constexpr int partial_ranges = 32;

/// Column c's sum over the partials of range `range` (partials / partial_ranges of them, rounded
/// up; the last range shorter), in order from 0.0f. Eight loads in flight, then their additions in
/// order: a load per addition would leave the thread waiting out one memory latency per partial.
/// ThroughL2: __ldcg, for partials written by other blocks of the same grid.
template <bool ThroughL2>
__device__ __forceinline__ float sum_partial_range(const float* partial, std::int64_t partials, std::int64_t dim,
                                                   std::int64_t c, int range) {
  const std::int64_t per = (partials + partial_ranges - 1) / partial_ranges;
  const std::int64_t begin = range * per, end = begin + per < partials ? begin + per : partials;
  float s = 0.0f;
  constexpr int batch = 8;
  for (std::int64_t p0 = begin; p0 < end; p0 += batch) {
    float v[batch];
#pragma unroll
    for (int i = 0; i < batch; ++i) {
      if constexpr (ThroughL2)
        v[i] = p0 + i < end ? __ldcg(partial + (p0 + i) * dim + c) : 0.0f;
      else
        v[i] = p0 + i < end ? partial[(p0 + i) * dim + c] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < batch; ++i)
      if (p0 + i < end) s += v[i];
  }
  return s;
}

__global__ void __launch_bounds__(32 * partial_ranges) sum_partials(const float* partial, float* grad_w, std::int64_t partials,
                                                            std::int64_t dim) {
  __shared__ float range_sum[partial_ranges][32];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  // grad_w before the wait: the partials' kernel does not write it, and every kernel before that
  // one is complete by now (it triggers this launch only after its own wait, or was launched in
  // plain stream order). Through L2 (__ldcg), which every SM sees coherently: no line of an
  // earlier grid can be stale.
  const float before = threadIdx.y == 0 && c < dim ? __ldcg(grad_w + c) : 0.0f;
  wait_for_prerequisite_grid();  // the partials' kernel, when launched as its dependent
  allow_dependent_launch();      // and the stream's next kernel may be scheduled (it waits for this one)
  range_sum[threadIdx.y][threadIdx.x] =
      c < dim ? sum_partial_range<false>(partial, partials, dim, c, static_cast<int>(threadIdx.y)) : 0.0f;
  __syncthreads();
  if (threadIdx.y == 0 && c < dim) {
    float total = range_sum[0][threadIdx.x];
    for (int y = 1; y < partial_ranges; ++y) total += range_sum[y][threadIdx.x];
    grad_w[c] = before + total;
  }
}

/// A programmatic dependent of the partials' kernel (sm_90+): its launch overlaps that kernel's
/// last blocks instead of following them (about 1 us of a 25-us backward at T = 4096).
cudaError_t launch_sum_partials(const float* partial, float* grad_w, std::int64_t partials, std::int64_t dim,
                                cudaStream_t stream) {
  return launch_as_dependent(sum_partials, dim3(grid_for(dim, 32)), dim3(32, partial_ranges), 0, stream, partial, grad_w,
                             partials, dim);
}

std::int64_t partial_count(std::int64_t rows) {
  const std::int64_t per = rmsnorm_rows_per_partial(rows);
  return (rows + per - 1) / per;
}

}  // namespace

cudaError_t rmsnorm_forward(const bf16* x, const bf16* weight, bf16* y, float* rstd, std::int64_t rows,
                            std::int64_t dim, float eps, cudaStream_t stream, float weight_offset) {
  if (rows < 0) return detail::refuse("rmsnorm_forward: rows = ", rows, " (must be >= 0)");
  if (dim < 1) return detail::refuse("rmsnorm_forward: dim = ", dim, " (must be >= 1)");
  if (!(eps >= 0.0f)) return detail::refuse("rmsnorm_forward: eps = ", eps, " (must be >= 0)");
  if (rows == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("rmsnorm_forward", {{"x", x}, {"weight", weight}, {"y", y}}); e != cudaSuccess)
    return e;
  const auto* xb = reinterpret_cast<const std::uint16_t*>(x);
  const auto* wb = reinterpret_cast<const std::uint16_t*>(weight);
  auto* yb = reinterpret_cast<std::uint16_t*>(y);
  const bool vec = dim % 8 == 0 && aligned_16(x, weight, y);
  if (vec && dim <= max_register_dim_forward) {
    if (dim <= 64) return launch_forward<8, 1>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 128) return launch_forward<8, 2>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 256) return launch_forward<32, 1>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 512) return launch_forward<32, 2>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 1024) return launch_forward<32, 4>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 2048) return launch_forward<32, 8>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    if (dim <= 4096) return launch_forward<32, 16>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
    return launch_forward<32, 32>(xb, wb, yb, rstd, rows, dim, eps, weight_offset, stream);
  }
  const unsigned grid = grid_for(rows, warps_per_block);
  if (grid == 0) return detail::refuse("rmsnorm_forward: ", rows, " rows need more than 2^31 - 1 blocks");
  forward_rows<<<grid, warps_per_block * 32, 0, stream>>>(xb, wb, yb, rstd, rows, dim, eps, vec, weight_offset);
  return cudaGetLastError();
}

std::size_t rmsnorm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim) {
  if (rows <= 0 || dim < 1) return 0;
  return static_cast<std::size_t>(partial_count(rows) * dim) * sizeof(float);
}

cudaError_t rmsnorm_backward(const bf16* grad_y, const bf16* x, const bf16* weight, const float* rstd, bf16* grad_x,
                             float* grad_weight, std::int64_t rows, std::int64_t dim, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream, float weight_offset) {
  if (rows < 0) return detail::refuse("rmsnorm_backward: rows = ", rows, " (must be >= 0)");
  if (dim < 1) return detail::refuse("rmsnorm_backward: dim = ", dim, " (must be >= 1)");
  if (rows == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("rmsnorm_backward", {{"grad_y", grad_y},
                                                                     {"x", x},
                                                                     {"weight", weight},
                                                                     {"rstd", rstd},
                                                                     {"grad_x", grad_x},
                                                                     {"grad_weight", grad_weight}});
      e != cudaSuccess)
    return e;
  if (const std::size_t need = rmsnorm_backward_workspace_bytes(rows, dim); workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace("rmsnorm_backward", workspace, workspace_bytes, need, "rmsnorm_backward_workspace_bytes(",
                                    rows, ", ", dim, ")");
  const auto* dy = reinterpret_cast<const std::uint16_t*>(grad_y);
  const auto* xb = reinterpret_cast<const std::uint16_t*>(x);
  const auto* wb = reinterpret_cast<const std::uint16_t*>(weight);
  auto* dx = reinterpret_cast<std::uint16_t*>(grad_x);
  auto* partial = static_cast<float*>(workspace);
  const std::int64_t partials = partial_count(rows);
  const std::int64_t per = rmsnorm_rows_per_partial(rows);
  if (partials > 65535)  // grid limit; cannot happen with <= 512 partials
    return detail::refuse("rmsnorm_backward: ", partials, " weight-gradient partials exceed the grid's 65535");

  const bool vec = dim % 8 == 0 && aligned_16(grad_y, x, weight, grad_x);
  if (vec && dim <= max_register_dim_backward) {
    const cudaError_t e = launch_backward_for_width(dy, xb, wb, rstd, dx, partial, rows, dim, partials, per, stream, weight_offset);
    if (e != cudaSuccess) return e;
    return launch_sum_partials(partial, grad_weight, partials, dim, stream);
  }

  // Weight gradient first, so grad_x may overwrite grad_y or x afterwards.
  const bool vec_w = dim % 8 == 0 && aligned_16(grad_y, x);
  const unsigned col_blocks = grid_for(dim, 32 * (vec_w ? 8 : 1));
  grad_w_partials<<<dim3(col_blocks, static_cast<unsigned>(partials)), dim3(32, slices), 0, stream>>>(
      dy, xb, rstd, partial, rows, dim, per, vec_w);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (const cudaError_t e = launch_sum_partials(partial, grad_weight, partials, dim, stream); e != cudaSuccess) return e;

  const unsigned grid = grid_for(rows, warps_per_block);
  if (grid == 0) return detail::refuse("rmsnorm_backward: ", rows, " rows need more than 2^31 - 1 blocks");
  grad_x_rows<<<grid, warps_per_block * 32, 0, stream>>>(dy, xb, wb, rstd, dx, rows, dim, vec, weight_offset);
  return cudaGetLastError();
}

}  // namespace oom::kernels
