// Token embedding kernels: gather forward, deterministic sorted scatter-add backward (see
// include/oom/kernels/embedding.hpp for the contract and why the backward sorts).
#include <cub/device/device_radix_sort.cuh>

#include <bit>
#include <type_traits>

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

/// The backward sums each run of equal ids (stably sorted, so in token order) over fixed segments
/// of `segment_rows` sorted positions, whatever the runs: one block a segment (and a slice of
/// columns). A run inside one segment is summed there and added to the table; a run that crosses
/// segments leaves one partial sum per segment in the workspace (the segment's slot 1 where the
/// run starts, slot 0 where it goes on), which join_runs adds in segment order. So the sum order
/// is fixed by the sorted positions alone, and an id in very many tokens is summed by many blocks.
constexpr int segment_rows = 64;
constexpr int rows_in_flight = 4;  // row loads issued before their sums

template <int N>
__global__ void __launch_bounds__(threads_per_row) sum_segments(const std::uint32_t* __restrict__ keys,
                                                                const std::int32_t* __restrict__ tok,
                                                                const std::uint16_t* __restrict__ grad_out,
                                                                float* __restrict__ grad_table, float* __restrict__ partial,
                                                                std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  // skey[0] and skey[n + 1]: the keys just before and after the segment (none: ~0u, no id).
  __shared__ std::uint32_t skey[segment_rows + 2];
  __shared__ std::int32_t stok[segment_rows];
  const std::int64_t p0 = static_cast<std::int64_t>(blockIdx.x) * segment_rows;
  const int n = static_cast<int>(min(static_cast<std::int64_t>(segment_rows), tokens - p0));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    skey[i + 1] = keys[p0 + i];
    stok[i] = tok[p0 + i];
  }
  if (threadIdx.x == 0) {
    skey[0] = p0 > 0 ? keys[p0 - 1] : ~0u;
    skey[n + 1] = p0 + n < tokens ? keys[p0 + n] : ~0u;
  }
  __syncthreads();
  const std::int64_t c = (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (c >= hidden) return;
  float acc[N] = {}, cur[N] = {};
  int start = 0;
  for (int j0 = 0; j0 < n; j0 += rows_in_flight) {
    float g[rows_in_flight][N];
#pragma unroll
    for (int r = 0; r < rows_in_flight; ++r)
      if (j0 + r < n && skey[j0 + r + 1] < vocab) load_bf16<N>(grad_out + static_cast<std::int64_t>(stok[j0 + r]) * hidden + c, g[r]);
#pragma unroll
    for (int r = 0; r < rows_in_flight; ++r) {
      const int j = j0 + r;
      if (j >= n) break;
      const std::uint32_t key = skey[j + 1];
      if (key >= vocab) return;  // invalid ids sort last: nothing after them
      if (j == start) load_f32<N>(grad_table + static_cast<std::int64_t>(key) * hidden + c, cur);  // ahead of its add
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += g[r][k];
      if (skey[j + 2] == key && j + 1 < n) continue;  // the run goes on in this segment
      const bool head = start == 0 && skey[0] == key;  // began in an earlier segment
      const bool tail = j == n - 1 && skey[n + 1] == key;  // goes on in the next
      if (!head && !tail) {
#pragma unroll
        for (int k = 0; k < N; ++k) cur[k] += acc[k];
        store_f32<N>(grad_table + static_cast<std::int64_t>(key) * hidden + c, cur);
      } else {
        store_f32<N>(partial + (static_cast<std::int64_t>(blockIdx.x) * 2 + (head ? 0 : 1)) * hidden + c, acc);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = 0.0f;
      start = j + 1;
    }
  }
}

/// For each run that crosses segments, the block of the segment it starts in: its partial sums in
/// segment order, then one add into the table.
template <int N>
__global__ void __launch_bounds__(threads_per_row) join_runs(const std::uint32_t* __restrict__ keys,
                                                             const float* __restrict__ partial, float* __restrict__ grad_table,
                                                             std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  const std::int64_t seg = blockIdx.x, p0 = seg * segment_rows, last = min(p0 + segment_rows, tokens) - 1;
  const std::uint32_t key = keys[last];
  if (key >= vocab || last + 1 >= tokens || keys[last + 1] != key) return;  // no run goes on past this segment
  if (p0 > 0 && keys[p0] == key && keys[p0 - 1] == key) return;  // it began in an earlier one, which joins it
  // The run's end: the first position after it (keys are sorted; keys[lo] == key, keys[hi] != key or hi == tokens).
  std::int64_t lo = last + 1, hi = tokens;
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == key) lo = mid;
    else hi = mid;
  }
  const std::int64_t last_seg = (hi - 1) / segment_rows;
  const std::int64_t c = (static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (c >= hidden) return;
  float acc[N], cur[N];
  load_f32<N>(grad_table + static_cast<std::int64_t>(key) * hidden + c, cur);
  load_f32<N>(partial + (seg * 2 + 1) * hidden + c, acc);
#pragma unroll 4
  for (std::int64_t s = seg + 1; s <= last_seg; ++s) {
    float g[N];
    load_f32<N>(partial + s * 2 * hidden + c, g);
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] += g[k];
  }
#pragma unroll
  for (int k = 0; k < N; ++k) cur[k] += acc[k];
  store_f32<N>(grad_table + static_cast<std::int64_t>(key) * hidden + c, cur);
}

/// What the kernels reject in these sizes, or "" when they take them.
std::string shape_issue(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  using detail::concat;
  if (tokens < 0 || tokens >= 0x7fffffff) return concat("tokens = ", tokens, " (must be 0 .. 2^31 - 2)");
  if (vocab < 1 || vocab >= 0x7fffffff) return concat("vocab = ", vocab, " (must be 1 .. 2^31 - 2)");
  // The backward's grid takes the columns in slices of threads_per_row (x 8 where it can): at most
  // 65535 slices, checked for the one-column path's (the 8-column path would take 8x more).
  if (hidden < 1 || hidden > std::int64_t{65535} * threads_per_row)
    return concat("hidden = ", hidden, " (must be 1 .. ", std::int64_t{65535} * threads_per_row, ")");
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
  std::size_t keys_in = 0, keys_out = 0, tok_in = 0, tok_out = 0, partial = 0, cub = 0, cub_bytes = 0, total = 0;
};

Layout layout(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  Layout l;
  const std::size_t arr = align_up(static_cast<std::size_t>(tokens) * 4);
  l.keys_in = 0;
  l.keys_out = arr;
  l.tok_in = 2 * arr;
  l.tok_out = 3 * arr;
  l.partial = 4 * arr;  // two partial sums (H fp32) a segment
  l.cub = l.partial + align_up(static_cast<std::size_t>(grid_for(tokens, segment_rows)) * 2 * static_cast<std::size_t>(hidden) * sizeof(float));
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

std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden) {
  if (!shape_ok(tokens, vocab, hidden)) return 0;
  return layout(tokens, vocab, hidden).total;
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
  Layout l = layout(tokens, vocab, hidden);
  if (workspace == nullptr || workspace_bytes < l.total)
    return detail::refuse_workspace("embedding_backward", workspace, workspace_bytes, l.total,
                                    "embedding_backward_workspace_bytes(", tokens, ", ", vocab, ", ", hidden, ")");
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
  auto* partial = reinterpret_cast<float*>(base + l.partial);
  const auto* rows = reinterpret_cast<const std::uint16_t*>(grad_out);
  const auto launch = [&](auto n) {
    constexpr int N = decltype(n)::value;
    const dim3 grid(grid_for(tokens, segment_rows), grid_for(hidden, threads_per_row * N));
    sum_segments<N><<<grid, threads_per_row, 0, stream>>>(keys_out, tok_out, rows, grad_table, partial, tokens, vocab, hidden);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    join_runs<N><<<grid, threads_per_row, 0, stream>>>(keys_out, partial, grad_table, tokens, vocab, hidden);
    return cudaGetLastError();
  };
  if (hidden % 8 == 0 && aligned_16(grad_out, grad_table)) return launch(std::integral_constant<int, 8>{});
  return launch(std::integral_constant<int, 1>{});
}

}  // namespace oom::kernels
