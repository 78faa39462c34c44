// Token permutation kernels and launchers; see oom/kernels/permute.hpp.
#include "oom/kernels/permute.hpp"

#include <cub/device/device_histogram.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>

#include "bf16_device.cuh"
#include "moe_blas.cuh"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::align_up;

constexpr int row_threads = 256;
constexpr int max_top_k = 32;

int key_bits(std::int64_t experts) {
  int bits = 1;
  while ((std::int64_t{1} << bits) < experts) ++bits;
  return bits;
}

/// What the kernels reject in s (and in hidden, for the launchers that move rows), or "" when they
/// take it.
std::string shape_issue(const PermuteShape& s, std::int64_t hidden = 1) {
  using detail::concat;
  if (s.tokens < 0) return concat("tokens = ", s.tokens, " (must be >= 0)");
  if (s.top_k < 1 || s.top_k > max_top_k) return concat("top_k = ", s.top_k, " (must be 1 .. ", max_top_k, ")");
  if (s.experts < 1 || s.experts >= INT_MAX) return concat("experts = ", s.experts, " (must be 1 .. 2^31 - 2)");
  if (s.tokens * s.top_k > INT_MAX) return concat("tokens x top_k = ", s.tokens * s.top_k, " (must be <= 2^31 - 1)");
  if (hidden < 1) return concat("hidden = ", hidden, " (must be >= 1)");
  return {};
}

bool valid(const PermuteShape& s) { return shape_issue(s).empty(); }

/// cudaSuccess, or a refusal naming what shape_issue finds.
cudaError_t check_shape(const char* name, const PermuteShape& s, std::int64_t hidden = 1) {
  if (std::string why = shape_issue(s, hidden); !why.empty()) return detail::refuse(name, ": ", why);
  return cudaSuccess;
}

/// CUB's temporary storage for the sort, the histogram and the scan (run one after the other).
std::size_t cub_temp_bytes(const PermuteShape& s) {
  const int n = static_cast<int>(s.tokens * s.top_k), E = static_cast<int>(s.experts);
  std::size_t sort = 0, hist = 0, scan = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
                                  static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), n, 0,
                                  key_bits(s.experts));
  cub::DeviceHistogram::HistogramEven(nullptr, hist, static_cast<const std::int32_t*>(nullptr),
                                      static_cast<std::int32_t*>(nullptr), E + 1, 0, E, n);
  cub::DeviceScan::InclusiveSum(nullptr, scan, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), E);
  return std::max({sort, hist, scan, std::size_t{1}});
}

__global__ void iota_kernel(std::int32_t* v, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

__global__ void invert_kernel(const std::int32_t* __restrict__ row_to_slot, std::int32_t* __restrict__ slot_to_row, int n) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) slot_to_row[row_to_slot[r]] = r;
}

// V consecutive bf16 elements as loaded: one 16-byte access when V = 8 (the caller checked the
// alignment), one element when V = 1. Loads of a token's k rows are issued together into these,
// then converted, so that k loads are in flight per thread instead of one; converted with
// bf16_device.cuh's helpers, so a NaN keeps its sign and payload as everywhere else in the kernels
// (oom::to_bf16's bits).
template <int V>
struct Chunk;
template <>
struct Chunk<8> {
  uint4 raw;
  __device__ static Chunk load(const __nv_bfloat16* p) { return {*reinterpret_cast<const uint4*>(p)}; }
  __device__ void store(__nv_bfloat16* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  __device__ void to_floats(float (&v)[8]) const { detail::unpack_bf16(raw, v); }
  __device__ static Chunk from_floats(const float (&v)[8]) { return {detail::pack_bf16(v)}; }
};
template <>
struct Chunk<1> {
  __nv_bfloat16 raw;
  __device__ static Chunk load(const __nv_bfloat16* p) { return {*p}; }
  __device__ void store(__nv_bfloat16* p) const { *p = raw; }
  __device__ void to_floats(float (&v)[1]) const { v[0] = detail::bf16_to_float(__bfloat16_as_ushort(raw)); }
  __device__ static Chunk from_floats(const float (&v)[1]) {
    return {__ushort_as_bfloat16(detail::float_to_bf16(v[0]))};
  }
};

// Rows whose every access may be 16 bytes: width a multiple of 8 elements, every base aligned.
template <class... P>
bool rows_vectorizable(std::int64_t hidden, const P*... bases) {
  return hidden % 8 == 0 && aligned_16(bases...);
}

// A token's k rows are taken this many at a time (their loads in flight together, their dot
// products in registers).
constexpr int row_group = 8;

// The gather's grid: this many blocks per SM at most, striding over the tokens.
constexpr int gather_blocks_per_sm = 4;

// The block's token's rows (slot_to_row) and weights (1 without weights) into shared memory.
__device__ void load_routes(const std::int32_t* __restrict__ slot_to_row, const float* __restrict__ weights,
                            std::int64_t t, int top_k, std::int32_t* row, float* w) {
  if (threadIdx.x < top_k) {
    row[threadIdx.x] = slot_to_row[t * top_k + threadIdx.x];
    if (w) w[threadIdx.x] = weights ? weights[t * top_k + threadIdx.x] : 1.0f;
  }
  __syncthreads();
}

// Blocks stride over tokens: each token's x row read once, V elements at a time, and written to
// its k rows.
template <int V>
__global__ void __launch_bounds__(row_threads) gather_kernel(const std::int32_t* __restrict__ slot_to_row,
                                                             const __nv_bfloat16* __restrict__ x,
                                                             __nv_bfloat16* __restrict__ x_perm, int top_k,
                                                             std::int64_t tokens, std::int64_t hidden) {
  __shared__ std::int32_t row[2][max_top_k];
  int buf = 0;
  for (std::int64_t t = blockIdx.x; t < tokens; t += gridDim.x, buf ^= 1) {
    // Two buffers: a slow thread may still read the previous token's rows while these are written.
    if (threadIdx.x < top_k) row[buf][threadIdx.x] = slot_to_row[t * top_k + threadIdx.x];
    __syncthreads();
    for (std::int64_t c = threadIdx.x; c < hidden / V; c += row_threads) {
      const auto v = Chunk<V>::load(x + t * hidden + c * V);
      for (int j = 0; j < top_k; ++j) v.store(x_perm + row[buf][j] * hidden + c * V);
    }
  }
}

// One block per token: sum (optionally weighted) of its k permuted rows, V elements per access.
// Each element sums its k products in order j = 0..k-1 in fp32, whatever V: the same bits.
template <int V>
__global__ void __launch_bounds__(row_threads) combine_kernel(const std::int32_t* __restrict__ slot_to_row,
                                                              const __nv_bfloat16* __restrict__ rows,
                                                              const float* __restrict__ weights,
                                                              __nv_bfloat16* __restrict__ out, int top_k,
                                                              std::int64_t hidden) {
  __shared__ std::int32_t row[max_top_k];
  __shared__ float w[max_top_k];
  const std::int64_t t = blockIdx.x;
  load_routes(slot_to_row, weights, t, top_k, row, w);
  for (std::int64_t c = threadIdx.x; c < hidden / V; c += row_threads) {
    float acc[V] = {};
    for (int j0 = 0; j0 < top_k; j0 += row_group) {
      const int group = min(row_group, top_k - j0);
      Chunk<V> y[row_group];
#pragma unroll
      for (int jj = 0; jj < row_group; ++jj)
        if (jj < group) y[jj] = Chunk<V>::load(rows + row[j0 + jj] * hidden + c * V);
#pragma unroll
      for (int jj = 0; jj < row_group; ++jj) {
        if (jj < group) {
          float f[V];
          y[jj].to_floats(f);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += w[j0 + jj] * f[e];
        }
      }
    }
    Chunk<V>::from_floats(acc).store(out + t * hidden + c * V);
  }
}

// One block per token, its k rows taken row_group at a time: dy_perm row_j = w_j * d_out row, and
// d_weights[j] = <d_out row, y_perm row_j>. Each thread reads its V-element chunks of the d_out
// row once per group and keeps the group's dot products in registers (fp32, its chunks in order,
// each chunk's elements in order); then one reduction for the group: xor shuffles within each warp,
// the warps' sums in warp order. Deterministic run to run; the partition of a row among threads
// depends on V, so the d_weights bits differ between the 16-byte and the scalar paths.
// History (T = 4096, k = 8, H = 2048 on the H200): all 32 possible dot products per thread in one
// pass (168 registers) 0.66 ms; one j at a time from a row staged in shared memory, one block_sum
// per j, element accesses: ~0.26 ms.
template <int V>
__global__ void __launch_bounds__(row_threads, 3) combine_backward_kernel(
    const std::int32_t* __restrict__ slot_to_row, const __nv_bfloat16* __restrict__ d_out,
    const __nv_bfloat16* __restrict__ y_perm, const float* __restrict__ weights, __nv_bfloat16* __restrict__ dy_perm,
    float* __restrict__ d_weights, int top_k, std::int64_t hidden) {
  __shared__ std::int32_t row[max_top_k];
  __shared__ float w[max_top_k];
  __shared__ float partial[row_threads / 32][row_group];
  const std::int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_routes(slot_to_row, weights, t, top_k, row, w);
  for (int j0 = 0; j0 < top_k; j0 += row_group) {
    const int group = min(row_group, top_k - j0);
    float dot[row_group] = {};
    for (std::int64_t c = threadIdx.x; c < hidden / V; c += row_threads) {
      float g[V];
      Chunk<V>::load(d_out + t * hidden + c * V).to_floats(g);
      Chunk<V> y[row_group];
#pragma unroll
      for (int jj = 0; jj < row_group; ++jj)
        if (jj < group) y[jj] = Chunk<V>::load(y_perm + row[j0 + jj] * hidden + c * V);
#pragma unroll
      for (int jj = 0; jj < row_group; ++jj) {
        if (jj < group) {
          float f[V], dy[V];
          y[jj].to_floats(f);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            dy[e] = w[j0 + jj] * g[e];
            dot[jj] += g[e] * f[e];
          }
          Chunk<V>::from_floats(dy).store(dy_perm + row[j0 + jj] * hidden + c * V);
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < row_group; ++jj) dot[jj] = detail::warp_sum(dot[jj]);
    if (lane == 0)
#pragma unroll
      for (int jj = 0; jj < row_group; ++jj) partial[warp][jj] = dot[jj];
    __syncthreads();
    if (threadIdx.x < group) {
      float total = 0.0f;
      for (int k = 0; k < row_threads / 32; ++k) total += partial[k][threadIdx.x];
      d_weights[t * top_k + j0 + threadIdx.x] = total;
    }
    __syncthreads();  // the next group rewrites partial
  }
}

}  // namespace

std::size_t permute_plan_workspace_bytes(const PermuteShape& s) {
  if (!valid(s)) return 0;
  const auto n = static_cast<std::size_t>(s.tokens * s.top_k);
  if (n == 0) return 0;  // no sort, histogram or scan: permute_plan only zeroes the counts and offsets
  return 2 * align_up(n * sizeof(std::int32_t)) + align_up(cub_temp_bytes(s));
}

cudaError_t permute_plan(cudaStream_t stream, const PermuteShape& s, const std::int32_t* expert_ids,
                         std::int32_t* row_to_slot, std::int32_t* slot_to_row, std::int32_t* expert_counts,
                         std::int32_t* expert_offsets, void* workspace, std::size_t workspace_bytes) {
  OOM_KERNEL_TRY(check_shape("permute_plan", s));
  // The arrays before the workspace: its size asks CUB, which calls the runtime.
  OOM_KERNEL_TRY(
      detail::refuse_null("permute_plan", {{"expert_counts", expert_counts}, {"expert_offsets", expert_offsets}}));
  if (s.tokens > 0)
    OOM_KERNEL_TRY(detail::refuse_null("permute_plan", {{"expert_ids", expert_ids},
                                                        {"row_to_slot", row_to_slot},
                                                        {"slot_to_row", slot_to_row},
                                                        {"workspace", workspace}}));
  if (const std::size_t need = permute_plan_workspace_bytes(s); workspace_bytes < need)
    return detail::refuse_workspace("permute_plan", workspace, workspace_bytes, need, "permute_plan_workspace_bytes");
  const int n = static_cast<int>(s.tokens * s.top_k), E = static_cast<int>(s.experts);
  if (n == 0) {  // no workspace, no CUB
    OOM_KERNEL_TRY(cudaMemsetAsync(expert_counts, 0, E * sizeof(std::int32_t), stream));
    return cudaMemsetAsync(expert_offsets, 0, (E + 1) * sizeof(std::int32_t), stream);
  }
  auto* base = static_cast<char*>(workspace);
  auto* sorted_keys = reinterpret_cast<std::int32_t*>(base);
  auto* slots = reinterpret_cast<std::int32_t*>(base + align_up(n * sizeof(std::int32_t)));
  void* temp = base + 2 * align_up(n * sizeof(std::int32_t));
  std::size_t temp_bytes = align_up(cub_temp_bytes(s));
  OOM_KERNEL_TRY(cudaMemsetAsync(expert_offsets, 0, sizeof(std::int32_t), stream));
  const unsigned blocks = static_cast<unsigned>(std::min(1024, (n + 255) / 256));
  iota_kernel<<<blocks, 256, 0, stream>>>(slots, n);
  OOM_KERNEL_TRY(cudaGetLastError());
  // Radix sort is stable: equal experts keep increasing slot order, hence (expert, slot) order.
  OOM_KERNEL_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, expert_ids, sorted_keys, slots, row_to_slot, n, 0,
                                                 key_bits(s.experts), stream));
  invert_kernel<<<blocks, 256, 0, stream>>>(row_to_slot, slot_to_row, n);
  OOM_KERNEL_TRY(cudaGetLastError());
  temp_bytes = align_up(cub_temp_bytes(s));
  OOM_KERNEL_TRY(cub::DeviceHistogram::HistogramEven(temp, temp_bytes, expert_ids, expert_counts, E + 1, 0, E, n, stream));
  temp_bytes = align_up(cub_temp_bytes(s));
  return cub::DeviceScan::InclusiveSum(temp, temp_bytes, expert_counts, expert_offsets + 1, E, stream);
}

cudaError_t permute_rows(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden, const std::int32_t* slot_to_row,
                         const bf16* x, bf16* x_perm) {
  OOM_KERNEL_TRY(check_shape("permute_rows", s, hidden));
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("permute_rows", {{"slot_to_row", slot_to_row}, {"x", x}, {"x_perm", x_perm}}));
  const auto launch = rows_vectorizable(hidden, x, x_perm) ? gather_kernel<8> : gather_kernel<1>;
  int device = 0, sms = 0;
  OOM_KERNEL_TRY(cudaGetDevice(&device));
  OOM_KERNEL_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(s.tokens, std::int64_t{sms} * gather_blocks_per_sm));
  launch<<<blocks, row_threads, 0, stream>>>(slot_to_row, reinterpret_cast<const __nv_bfloat16*>(x),
                                             reinterpret_cast<__nv_bfloat16*>(x_perm), static_cast<int>(s.top_k),
                                             s.tokens, hidden);
  return cudaGetLastError();
}

cudaError_t permute_rows_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                  const std::int32_t* slot_to_row, const bf16* dx_perm, bf16* dx) {
  OOM_KERNEL_TRY(check_shape("permute_rows_backward", s, hidden));
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(
      detail::refuse_null("permute_rows_backward", {{"slot_to_row", slot_to_row}, {"dx_perm", dx_perm}, {"dx", dx}}));
  const auto launch = rows_vectorizable(hidden, dx_perm, dx) ? combine_kernel<8> : combine_kernel<1>;
  launch<<<static_cast<unsigned>(s.tokens), row_threads, 0, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(dx_perm), nullptr, reinterpret_cast<__nv_bfloat16*>(dx),
      static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

cudaError_t unpermute_combine(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                              const std::int32_t* slot_to_row, const bf16* y_perm, const float* weights, bf16* out) {
  OOM_KERNEL_TRY(check_shape("unpermute_combine", s, hidden));
  if (weights == nullptr) return detail::refuse("unpermute_combine: weights is null");
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(
      detail::refuse_null("unpermute_combine", {{"slot_to_row", slot_to_row}, {"y_perm", y_perm}, {"out", out}}));
  const auto launch = rows_vectorizable(hidden, y_perm, out) ? combine_kernel<8> : combine_kernel<1>;
  launch<<<static_cast<unsigned>(s.tokens), row_threads, 0, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(y_perm), weights, reinterpret_cast<__nv_bfloat16*>(out),
      static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

cudaError_t unpermute_combine_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                       const std::int32_t* slot_to_row, const bf16* d_out, const bf16* y_perm,
                                       const float* weights, bf16* dy_perm, float* d_weights) {
  OOM_KERNEL_TRY(check_shape("unpermute_combine_backward", s, hidden));
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("unpermute_combine_backward",
                                     {{"slot_to_row", slot_to_row}, {"d_out", d_out}, {"y_perm", y_perm},
                                      {"weights", weights}, {"dy_perm", dy_perm}, {"d_weights", d_weights}}));
  const auto launch =
      rows_vectorizable(hidden, d_out, y_perm, dy_perm) ? combine_backward_kernel<8> : combine_backward_kernel<1>;
  launch<<<static_cast<unsigned>(s.tokens), row_threads, 0, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(d_out), reinterpret_cast<const __nv_bfloat16*>(y_perm), weights,
      reinterpret_cast<__nv_bfloat16*>(dy_perm), d_weights, static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

}  // namespace oom::kernels
