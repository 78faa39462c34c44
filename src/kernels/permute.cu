// Token permutation kernels and launchers; see oom/kernels/permute.hpp.
#include "oom/kernels/permute.hpp"

#include <cub/device/device_histogram.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>

#include "moe_blas.cuh"

namespace oom::kernels {
namespace {

using detail::align_up;
using detail::block_sum;

constexpr int row_threads = 256;
constexpr int max_top_k = 32;  // per-thread dot accumulators in the combine backward

int key_bits(std::int64_t experts) {
  int bits = 1;
  while ((std::int64_t{1} << bits) < experts) ++bits;
  return bits;
}

bool valid(const PermuteShape& s) {
  return s.tokens >= 0 && s.top_k >= 1 && s.top_k <= max_top_k && s.experts >= 1 && s.tokens * s.top_k <= INT_MAX &&
         s.experts < INT_MAX;
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

// One block per permuted row: 16-byte copies when rows are 16-byte multiples, elements otherwise.
__global__ void gather_kernel(const std::int32_t* __restrict__ row_to_slot, const __nv_bfloat16* __restrict__ x,
                              __nv_bfloat16* __restrict__ x_perm, int top_k, std::int64_t hidden, bool vectorized) {
  const std::int64_t r = blockIdx.x;
  const std::int64_t t = row_to_slot[r] / top_k;
  if (vectorized) {
    const auto* src = reinterpret_cast<const uint4*>(x + t * hidden);
    auto* dst = reinterpret_cast<uint4*>(x_perm + r * hidden);
    for (std::int64_t i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) x_perm[r * hidden + i] = x[t * hidden + i];
  }
}

// One block per token: sum (optionally weighted) of its k permuted rows.
__global__ void combine_kernel(const std::int32_t* __restrict__ slot_to_row, const __nv_bfloat16* __restrict__ rows,
                               const float* __restrict__ weights, __nv_bfloat16* __restrict__ out, int top_k,
                               std::int64_t hidden) {
  __shared__ std::int32_t row[max_top_k];
  __shared__ float w[max_top_k];
  const std::int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) {
    row[threadIdx.x] = slot_to_row[t * top_k + threadIdx.x];
    w[threadIdx.x] = weights ? weights[t * top_k + threadIdx.x] : 1.0f;
  }
  __syncthreads();
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j) acc += w[j] * __bfloat162float(rows[row[j] * hidden + i]);
    out[t * hidden + i] = __float2bfloat16(acc);
  }
}

// One block per token: for each of its k rows j (in order), dy_perm row_j = w_j * d_out row, and
// d_weights[j] = <d_out row, y_perm row_j>: each thread sums its elements i = tid, tid + blockDim,
// ... in order, then block_sum, one j at a time. The d_out row is staged in shared memory (bf16,
// when it fits in 48 KiB) since every j reads it. Why one j at a time: the first version kept all
// max_top_k dot products per thread in registers across one pass (168 registers, one block per
// SM: 0.66 ms at T = 4096, k = 8, H = 2048 on the H200, a quarter of the 5.13B layer's backward);
// each j's additions are the same ones in the same order, so the results are its bits.
// Staged up to this many elements: the dynamic staging plus the kernel's static arrays (row, w,
// scratch: 384 bytes) must stay within the 48 KiB a launch gets without opting in.
constexpr int combine_backward_staged_max = (48 * 1024 - 1024) / 2;

__global__ void combine_backward_kernel(const std::int32_t* __restrict__ slot_to_row, const __nv_bfloat16* __restrict__ d_out,
                                        const __nv_bfloat16* __restrict__ y_perm, const float* __restrict__ weights,
                                        __nv_bfloat16* __restrict__ dy_perm, float* __restrict__ d_weights, int top_k,
                                        std::int64_t hidden) {
  extern __shared__ __nv_bfloat16 g_staged[];  // hidden elements, or none (read from d_out)
  __shared__ std::int32_t row[max_top_k];
  __shared__ float w[max_top_k];
  __shared__ float scratch[32];
  static_assert(sizeof(row) + sizeof(w) + sizeof(scratch) <= 1024, "the static arrays outgrew combine_backward_staged_max's room");
  const std::int64_t t = blockIdx.x;
  const bool staged = hidden <= combine_backward_staged_max;
  if (threadIdx.x < top_k) {
    row[threadIdx.x] = slot_to_row[t * top_k + threadIdx.x];
    w[threadIdx.x] = weights[t * top_k + threadIdx.x];
  }
  const __nv_bfloat16* const g_row = staged ? g_staged : d_out + t * hidden;
  if (staged)
    for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) g_staged[i] = d_out[t * hidden + i];
  __syncthreads();
  for (int j = 0; j < top_k; ++j) {
    const std::int64_t r = row[j] * hidden;
    const float wj = w[j];
    float dot = 0.0f;
    for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float g = __bfloat162float(g_row[i]);
      dy_perm[r + i] = __float2bfloat16(wj * g);
      dot += g * __bfloat162float(y_perm[r + i]);
    }
    const float total = block_sum(dot, scratch);
    if (threadIdx.x == 0) d_weights[t * top_k + j] = total;
  }
}

}  // namespace

std::size_t permute_plan_workspace_bytes(const PermuteShape& s) {
  if (!valid(s)) return 0;
  const auto n = static_cast<std::size_t>(s.tokens * s.top_k);
  return 2 * align_up(n * sizeof(std::int32_t)) + align_up(cub_temp_bytes(s));
}

cudaError_t permute_plan(cudaStream_t stream, const PermuteShape& s, const std::int32_t* expert_ids,
                         std::int32_t* row_to_slot, std::int32_t* slot_to_row, std::int32_t* expert_counts,
                         std::int32_t* expert_offsets, void* workspace, std::size_t workspace_bytes) {
  if (!valid(s) || workspace_bytes < permute_plan_workspace_bytes(s)) return cudaErrorInvalidValue;
  const int n = static_cast<int>(s.tokens * s.top_k), E = static_cast<int>(s.experts);
  auto* base = static_cast<char*>(workspace);
  auto* sorted_keys = reinterpret_cast<std::int32_t*>(base);
  auto* slots = reinterpret_cast<std::int32_t*>(base + align_up(n * sizeof(std::int32_t)));
  void* temp = base + 2 * align_up(n * sizeof(std::int32_t));
  std::size_t temp_bytes = align_up(cub_temp_bytes(s));
  OOM_KERNEL_TRY(cudaMemsetAsync(expert_offsets, 0, sizeof(std::int32_t), stream));
  if (n == 0) {
    OOM_KERNEL_TRY(cudaMemsetAsync(expert_counts, 0, E * sizeof(std::int32_t), stream));
    return cudaMemsetAsync(expert_offsets, 0, (E + 1) * sizeof(std::int32_t), stream);
  }
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

cudaError_t permute_rows(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden, const std::int32_t* row_to_slot,
                         const bf16* x, bf16* x_perm) {
  if (!valid(s) || hidden < 1) return cudaErrorInvalidValue;
  const std::int64_t n = s.tokens * s.top_k;
  if (n == 0) return cudaSuccess;
  const bool vectorized = hidden % 8 == 0 && reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
                          reinterpret_cast<std::uintptr_t>(x_perm) % 16 == 0;
  gather_kernel<<<static_cast<unsigned>(n), row_threads, 0, stream>>>(
      row_to_slot, reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<__nv_bfloat16*>(x_perm),
      static_cast<int>(s.top_k), hidden, vectorized);
  return cudaGetLastError();
}

cudaError_t permute_rows_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                  const std::int32_t* slot_to_row, const bf16* dx_perm, bf16* dx) {
  if (!valid(s) || hidden < 1) return cudaErrorInvalidValue;
  if (s.tokens == 0) return cudaSuccess;
  combine_kernel<<<static_cast<unsigned>(s.tokens), row_threads, 0, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(dx_perm), nullptr, reinterpret_cast<__nv_bfloat16*>(dx),
      static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

cudaError_t unpermute_combine(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                              const std::int32_t* slot_to_row, const bf16* y_perm, const float* weights, bf16* out) {
  if (!valid(s) || hidden < 1 || weights == nullptr) return cudaErrorInvalidValue;
  if (s.tokens == 0) return cudaSuccess;
  combine_kernel<<<static_cast<unsigned>(s.tokens), row_threads, 0, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(y_perm), weights, reinterpret_cast<__nv_bfloat16*>(out),
      static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

cudaError_t unpermute_combine_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                       const std::int32_t* slot_to_row, const bf16* d_out, const bf16* y_perm,
                                       const float* weights, bf16* dy_perm, float* d_weights) {
  if (!valid(s) || hidden < 1) return cudaErrorInvalidValue;
  if (s.tokens == 0) return cudaSuccess;
  const std::size_t staged = hidden <= combine_backward_staged_max ? static_cast<std::size_t>(hidden) * sizeof(bf16) : 0;
  combine_backward_kernel<<<static_cast<unsigned>(s.tokens), row_threads, staged, stream>>>(
      slot_to_row, reinterpret_cast<const __nv_bfloat16*>(d_out), reinterpret_cast<const __nv_bfloat16*>(y_perm), weights,
      reinterpret_cast<__nv_bfloat16*>(dy_perm), d_weights, static_cast<int>(s.top_k), hidden);
  return cudaGetLastError();
}

}  // namespace oom::kernels
