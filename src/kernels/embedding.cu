// Token embedding kernels: gather forward, deterministic sorted scatter-add backward (see
// include/oom/kernels/embedding.hpp for the contract and why the backward sorts).
#include <cub/device/device_radix_sort.cuh>

#include <bit>

#include "bf16_device.cuh"
#include "oom/kernels/embedding.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::load_f32;
using detail::store_bf16;
using detail::store_f32;

constexpr int threads_per_row = 128;

__global__ void gather_rows(const std::int32_t* ids, const std::uint16_t* table, std::uint16_t* out,
                            std::int32_t* invalid_count, std::int64_t vocab, std::int64_t hidden, bool vec) {
  const std::int64_t t = blockIdx.x;
  const std::int32_t id = ids[t];
  const bool valid = id >= 0 && id < vocab;
  if (!valid && threadIdx.x == 0) atomicAdd(invalid_count, 1);
  const std::uint16_t* src = table + (valid ? id : 0) * hidden;
  std::uint16_t* dst = out + t * hidden;
  if (vec) {
    for (std::int64_t c = threadIdx.x * 8; c < hidden; c += threads_per_row * 8) {
      const uint4 v = valid ? *reinterpret_cast<const uint4*>(src + c) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(dst + c) = v;
    }
  } else {
    for (std::int64_t c = threadIdx.x; c < hidden; c += threads_per_row) dst[c] = valid ? src[c] : std::uint16_t{0};
  }
}

/// Sort keys: the id, or `vocab` for an invalid id (sorted last, then skipped).
__global__ void make_sort_keys(const std::int32_t* ids, std::uint32_t* keys, std::int32_t* tokens_idx,
                               std::int32_t* invalid_count, std::int64_t tokens, std::int64_t vocab) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const std::int32_t id = ids[t];
  const bool valid = id >= 0 && id < vocab;
  if (!valid) atomicAdd(invalid_count, 1);
  keys[t] = valid ? static_cast<std::uint32_t>(id) : static_cast<std::uint32_t>(vocab);
  tokens_idx[t] = static_cast<std::int32_t>(t);
}

/// One block per sorted position; the block at the first position of each run of equal ids sums
/// the run's gradient rows in (stable-sorted, hence token) order and adds the sum to the table.
template <int N>
__device__ void sum_run(const std::uint32_t* keys, const std::int32_t* tok, std::int64_t begin, std::int64_t tokens,
                        const std::uint16_t* grad_out, float* grad_row, std::int64_t hidden) {
  const std::uint32_t key = keys[begin];
  for (std::int64_t c = threadIdx.x * N; c < hidden; c += threads_per_row * N) {
    float acc[N] = {};
    for (std::int64_t j = begin; j < tokens && keys[j] == key; ++j) {
      float g[N];
      load_bf16<N>(grad_out + static_cast<std::int64_t>(tok[j]) * hidden + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += g[k];
    }
    float cur[N];
    load_f32<N>(grad_row + c, cur);
#pragma unroll
    for (int k = 0; k < N; ++k) cur[k] += acc[k];
    store_f32<N>(grad_row + c, cur);
  }
}

__global__ void scatter_add_runs(const std::uint32_t* keys, const std::int32_t* tok, const std::uint16_t* grad_out,
                                 float* grad_table, std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                                 bool vec) {
  const std::int64_t i = blockIdx.x;
  const std::uint32_t key = keys[i];
  if (key >= vocab) return;                      // invalid ids (counted already)
  if (i > 0 && keys[i - 1] == key) return;       // not the first of its run
  float* grad_row = grad_table + static_cast<std::int64_t>(key) * hidden;
  if (vec) {
    sum_run<8>(keys, tok, i, tokens, grad_out, grad_row, hidden);
  } else {
    sum_run<1>(keys, tok, i, tokens, grad_out, grad_row, hidden);
  }
}

/// What the kernels reject in these sizes, or "" when they take them.
std::string shape_issue(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  using detail::concat;
  if (tokens < 0 || tokens >= 0x7fffffff) return concat("tokens = ", tokens, " (must be 0 .. 2^31 - 2)");
  if (vocab < 1 || vocab >= 0x7fffffff) return concat("vocab = ", vocab, " (must be 1 .. 2^31 - 2)");
  if (hidden < 1) return concat("hidden = ", hidden, " (must be >= 1)");
  return {};
}

bool shape_ok(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) { return shape_issue(tokens, vocab, hidden).empty(); }

cudaError_t check_args(const char* name, std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                       const std::int32_t* invalid_count) {
  if (std::string why = shape_issue(tokens, vocab, hidden); !why.empty()) return detail::refuse(name, ": ", why);
  if (invalid_count == nullptr) return detail::refuse(name, ": invalid_count is null");
  return cudaSuccess;
}

int key_bits(std::int64_t vocab) {
  // Keys go up to `vocab` itself (the invalid marker).
  return std::max(1, static_cast<int>(std::bit_width(static_cast<std::uint64_t>(vocab))));
}

constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

struct Layout {
  std::size_t keys_in = 0, keys_out = 0, tok_in = 0, tok_out = 0, cub = 0, cub_bytes = 0, total = 0;
};

Layout layout(std::int64_t tokens, std::int64_t vocab) {
  Layout l;
  const std::size_t arr = align_up(static_cast<std::size_t>(tokens) * 4);
  l.keys_in = 0;
  l.keys_out = arr;
  l.tok_in = 2 * arr;
  l.tok_out = 3 * arr;
  l.cub = 4 * arr;
  cub::DeviceRadixSort::SortPairs(nullptr, l.cub_bytes, static_cast<const std::uint32_t*>(nullptr),
                                  static_cast<std::uint32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                  static_cast<std::int32_t*>(nullptr), static_cast<int>(tokens), 0, key_bits(vocab));
  l.total = l.cub + align_up(l.cub_bytes);
  return l;
}

}  // namespace

cudaError_t embedding_forward(const std::int32_t* ids, const bf16* table, bf16* out, std::int32_t* invalid_count,
                              std::int64_t tokens, std::int64_t vocab, std::int64_t hidden, cudaStream_t stream) {
  if (const cudaError_t e = check_args("embedding_forward", tokens, vocab, hidden, invalid_count); e != cudaSuccess)
    return e;
  if (tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("embedding_forward", {{"ids", ids}, {"table", table}, {"out", out}});
      e != cudaSuccess)
    return e;
  const bool vec = hidden % 8 == 0 && aligned_16(table, out);
  gather_rows<<<static_cast<unsigned>(tokens), threads_per_row, 0, stream>>>(
      ids, reinterpret_cast<const std::uint16_t*>(table), reinterpret_cast<std::uint16_t*>(out), invalid_count, vocab,
      hidden, vec);
  return cudaGetLastError();
}

std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab) {
  if (!shape_ok(tokens, vocab, 1)) return 0;
  return layout(tokens, vocab).total;
}

cudaError_t embedding_backward(const std::int32_t* ids, const bf16* grad_out, float* grad_table,
                               std::int32_t* invalid_count, std::int64_t tokens, std::int64_t vocab,
                               std::int64_t hidden, void* workspace, std::size_t workspace_bytes,
                               cudaStream_t stream) {
  if (const cudaError_t e = check_args("embedding_backward", tokens, vocab, hidden, invalid_count); e != cudaSuccess)
    return e;
  if (tokens == 0) return cudaSuccess;
  if (const cudaError_t e =
          detail::refuse_null("embedding_backward", {{"ids", ids}, {"grad_out", grad_out}, {"grad_table", grad_table}});
      e != cudaSuccess)
    return e;
  Layout l = layout(tokens, vocab);
  if (workspace == nullptr || workspace_bytes < l.total)
    return detail::refuse_workspace("embedding_backward", workspace, workspace_bytes, l.total,
                                    "embedding_backward_workspace_bytes(", tokens, ", ", vocab, ")");
  auto* base = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(base + l.keys_in);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(base + l.keys_out);
  auto* tok_in = reinterpret_cast<std::int32_t*>(base + l.tok_in);
  auto* tok_out = reinterpret_cast<std::int32_t*>(base + l.tok_out);

  make_sort_keys<<<grid_for(tokens, 256), 256, 0, stream>>>(ids, keys_in, tok_in, invalid_count, tokens, vocab);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  // LSD radix sort is stable: equal ids keep token order, which fixes the summation order.
  if (const cudaError_t e = cub::DeviceRadixSort::SortPairs(base + l.cub, l.cub_bytes, keys_in, keys_out, tok_in,
                                                           tok_out, static_cast<int>(tokens), 0, key_bits(vocab),
                                                           stream);
      e != cudaSuccess) {
    return e;
  }
  const bool vec = hidden % 8 == 0 && aligned_16(grad_out, grad_table);
  scatter_add_runs<<<static_cast<unsigned>(tokens), threads_per_row, 0, stream>>>(
      keys_out, tok_out, reinterpret_cast<const std::uint16_t*>(grad_out), grad_table, tokens, vocab, hidden, vec);
  return cudaGetLastError();
}

}  // namespace oom::kernels
