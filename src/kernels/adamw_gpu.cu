// GPU AdamW and gradient sum of squares, bit-identical to the CPU optimizer (contract in
// include/oom/kernels/adamw_gpu.hpp). Every operation is an explicit IEEE round-to-nearest
// intrinsic, so neither nvcc's contraction nor any flag can reassociate or fuse differently from
// oom::optim::adamw_element; this file must never be built with --use_fast_math.
#include "bf16_device.cuh"
#include "oom/kernels/adamw_gpu.hpp"
#include "oom/optim/cpu_adamw.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;
using optim::AdamWStepScalars;

constexpr int threads = 256;

/// oom::optim::adamw_element, line for line.
__device__ __forceinline__ void element(const AdamWStepScalars& s, float& p, float& m, float& v, float grad) {
  const float g = __fmul_rn(grad, s.grad_scale);
  const float decayed = __fmul_rn(p, s.decay);
  m = __fmaf_rn(s.beta1, m, __fmul_rn(s.one_minus_beta1, g));
  v = __fmaf_rn(s.beta2, v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  p = __fmaf_rn(s.neg_step_size, __fdiv_rn(m, denom), decayed);
}

__device__ __forceinline__ bool finite4(float4 x) { return isfinite(x.x) && isfinite(x.y) && isfinite(x.z) && isfinite(x.w); }

// Moments as fp32 (float) or bf16 bits (std::uint16_t).
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(std::uint16_t x) { return bf16_to_float(x); }
__device__ __forceinline__ void narrow(float x, float& out) { out = x; }
__device__ __forceinline__ void narrow(float x, std::uint16_t& out) { out = float_to_bf16(x); }

template <class M>
__device__ __forceinline__ void update_one(const AdamWStepScalars& s, float* p, M* m, M* v, const float* g,
                                           std::uint16_t* out, std::int64_t i, int* flag) {
  float pi = p[i], mi = widen(m[i]), vi = widen(v[i]);
  const float gi = g != nullptr ? g[i] : 0.0f;
  if (flag != nullptr && !isfinite(gi)) *flag = 1;
  element(s, pi, mi, vi, gi);
  p[i] = pi;
  narrow(mi, m[i]);
  narrow(vi, v[i]);
  if (out != nullptr) out[i] = float_to_bf16(pi);
}

// Four elements per thread: float4 for p, m (fp32), v (fp32), g; 8-byte uint2 for bf16 moments
// and the bf16 copy. `vec` says every array is aligned for those widths. g null: every gradient
// +0.0f, as if read from zeroed memory (the same operations on the same value: the same bits).
// flag: null, or set to 1 when a gradient read is not finite (AdamWSegment::nonfinite).
template <class M>
__device__ __forceinline__ void update_four(const AdamWStepScalars& s, float* p, M* m, M* v, const float* g, std::uint16_t* out,
                                            std::int64_t n, bool vec, std::int64_t i, int* flag = nullptr) {
  if (i >= n) return;
  if (!vec || i + 4 > n) {
    const std::int64_t end = i + 4 < n ? i + 4 : n;
    for (std::int64_t j = i; j < end; ++j) update_one(s, p, m, v, g, out, j, flag);
    return;
  }
  float4 p4 = *reinterpret_cast<const float4*>(p + i);
  const float4 g4 = g != nullptr ? *reinterpret_cast<const float4*>(g + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (flag != nullptr && !finite4(g4)) *flag = 1;
  float pp[4] = {p4.x, p4.y, p4.z, p4.w};
  const float gg[4] = {g4.x, g4.y, g4.z, g4.w};
  float mm[4], vv[4];
  if constexpr (sizeof(M) == 4) {
    const float4 m4 = *reinterpret_cast<const float4*>(m + i);
    const float4 v4 = *reinterpret_cast<const float4*>(v + i);
    mm[0] = m4.x, mm[1] = m4.y, mm[2] = m4.z, mm[3] = m4.w;
    vv[0] = v4.x, vv[1] = v4.y, vv[2] = v4.z, vv[3] = v4.w;
  } else {
    const uint2 m2 = *reinterpret_cast<const uint2*>(m + i);
    const uint2 v2 = *reinterpret_cast<const uint2*>(v + i);
    mm[0] = __uint_as_float(m2.x << 16), mm[1] = __uint_as_float(m2.x & 0xffff0000u);
    mm[2] = __uint_as_float(m2.y << 16), mm[3] = __uint_as_float(m2.y & 0xffff0000u);
    vv[0] = __uint_as_float(v2.x << 16), vv[1] = __uint_as_float(v2.x & 0xffff0000u);
    vv[2] = __uint_as_float(v2.y << 16), vv[3] = __uint_as_float(v2.y & 0xffff0000u);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) element(s, pp[k], mm[k], vv[k], gg[k]);
  *reinterpret_cast<float4*>(p + i) = make_float4(pp[0], pp[1], pp[2], pp[3]);
  if constexpr (sizeof(M) == 4) {
    *reinterpret_cast<float4*>(m + i) = make_float4(mm[0], mm[1], mm[2], mm[3]);
    *reinterpret_cast<float4*>(v + i) = make_float4(vv[0], vv[1], vv[2], vv[3]);
  } else {
    auto pack = [](float a, float b) {
      return static_cast<unsigned>(float_to_bf16(a)) | (static_cast<unsigned>(float_to_bf16(b)) << 16);
    };
    *reinterpret_cast<uint2*>(m + i) = make_uint2(pack(mm[0], mm[1]), pack(mm[2], mm[3]));
    *reinterpret_cast<uint2*>(v + i) = make_uint2(pack(vv[0], vv[1]), pack(vv[2], vv[3]));
  }
  if (out != nullptr) {
    const unsigned lo = static_cast<unsigned>(float_to_bf16(pp[0])) | (static_cast<unsigned>(float_to_bf16(pp[1])) << 16);
    const unsigned hi = static_cast<unsigned>(float_to_bf16(pp[2])) | (static_cast<unsigned>(float_to_bf16(pp[3])) << 16);
    *reinterpret_cast<uint2*>(out + i) = make_uint2(lo, hi);
  }
}

template <class M>
__global__ void adamw_kernel(AdamWStepScalars s, float* p, M* m, M* v, const float* g, std::uint16_t* out,
                             std::int64_t n, bool vec) {
  update_four(s, p, m, v, g, out, n, vec, (static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x) * 4);
}

// Many segments in one launch, moments M (float, or bf16 bits as std::uint16_t): block b works on
// the segment whose blocks [first_block[k], first_block[k + 1]) hold b, exactly as its own launch's
// block b - first_block[k] would (the same elements, the same operations: the same bits).
constexpr int max_segments = 256;  // per launch: the parameters stay under 17 KiB
template <class M>
struct ManyParams {
  AdamWStepScalars s;
  int count = 0;
  std::int64_t first_block[max_segments + 1];
  float* p[max_segments];
  M* m[max_segments];
  M* v[max_segments];
  const float* g[max_segments];
  std::uint16_t* out[max_segments];
  std::int64_t n[max_segments];
  int* flag[max_segments];
  bool vec[max_segments];
};
static_assert(sizeof(ManyParams<float>) <= 32764 && sizeof(ManyParams<std::uint16_t>) <= 32764);

template <class M>
__global__ void adamw_many_kernel(const __grid_constant__ ManyParams<M> q) {
  const std::int64_t b = blockIdx.x;
  int lo = 0, hi = q.count - 1;  // the last k with first_block[k] <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (q.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const std::int64_t i = ((b - q.first_block[lo]) * threads + threadIdx.x) * 4;
  update_four<M>(q.s, q.p[lo], q.m[lo], q.v[lo], q.g[lo], q.out[lo], q.n[lo], q.vec[lo], i, q.flag[lo]);
}

// Four elements a thread (a float4 where grads is 16-byte aligned), grid-stride.
__global__ void flag_nonfinite_kernel(const float* g, std::int64_t n, int* flag, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * 4;
  bool bad = false;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride) {
    if (vec && i + 4 <= n) {
      bad |= !finite4(*reinterpret_cast<const float4*>(g + i));
    } else {
      for (std::int64_t j = i; j < n && j < i + 4; ++j) bad |= !isfinite(g[j]);
    }
  }
  if (bad) *flag = 1;
}

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

/// Whether update_four may take its vector path: every array aligned for its width (grads and the
/// bf16 copy may be null).
template <class M>
bool vector_aligned(const float* p, const M* m, const M* v, const float* g, const void* out) {
  return aligned(p, 16) && (g == nullptr || aligned(g, 16)) && aligned(m, 4 * sizeof(M)) && aligned(v, 4 * sizeof(M)) &&
         (out == nullptr || aligned(out, 8));
}

template <class M>
cudaError_t launch(const AdamWStepScalars& s, float* p, M* m, M* v, const float* g, std::uint16_t* out,
                   std::int64_t n, cudaStream_t stream) {
  if (n < 0) return detail::refuse("adamw_update: n = ", n, " (must be >= 0)");
  if (n == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("adamw_update", {{"master", p}, {"exp_avg", m}, {"exp_avg_sq", v}});
      e != cudaSuccess)
    return e;
  const unsigned grid = grid_for(n, threads * 4);
  if (grid == 0) return detail::refuse("adamw_update: n = ", n, " needs more than 2^31 - 1 blocks");
  const bool vec = vector_aligned(p, m, v, g, out);
  adamw_kernel<M><<<grid, threads, 0, stream>>>(s, p, m, v, g, out, n, vec);
  return cudaGetLastError();
}

/// adamw_update_many for moments stored as M on the device (float, or std::uint16_t for bf16).
template <class M, class Moment>
cudaError_t launch_many(const AdamWStepScalars& step, std::span<const AdamWSegmentOf<Moment>> segments, cudaStream_t stream) {
  static_assert(sizeof(M) == sizeof(Moment), "the device view of a moment has its bytes");
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const AdamWSegmentOf<Moment>& a = segments[i];
    if (a.n < 0) return detail::refuse("adamw_update_many: segment ", i, ": n = ", a.n, " (must be >= 0)");
    if (a.n > 0 && (a.master == nullptr || a.exp_avg == nullptr || a.exp_avg_sq == nullptr))
      return detail::refuse("adamw_update_many: segment ", i, ": ",
                            a.master == nullptr ? "master" : a.exp_avg == nullptr ? "exp_avg" : "exp_avg_sq",
                            " is null (n = ", a.n, ")");
  }
  ManyParams<M> q;
  q.s = step;
  std::int64_t blocks = 0;
  const auto flush = [&]() -> cudaError_t {
    if (q.count == 0) return cudaSuccess;
    q.first_block[q.count] = blocks;
    const unsigned grid = grid_for(blocks, 1);
    if (grid == 0)  // one segment alone past the grid's limit (launches are cut before 2^31 - 1 blocks otherwise)
      return detail::refuse("adamw_update_many: a launch of ", blocks, " blocks (at most 2^31 - 1)");
    adamw_many_kernel<M><<<grid, threads, 0, stream>>>(q);
    q.count = 0;
    blocks = 0;
    return cudaGetLastError();
  };
  for (const AdamWSegmentOf<Moment>& a : segments) {
    if (a.n == 0) continue;
    const std::int64_t a_blocks = (a.n + threads * 4 - 1) / (threads * 4);
    if (q.count == max_segments || blocks > std::int64_t{0x7fffffff} - a_blocks)
      if (const cudaError_t e = flush(); e != cudaSuccess) return e;
    const int k = q.count++;
    q.first_block[k] = blocks;
    q.p[k] = a.master;
    q.m[k] = reinterpret_cast<M*>(a.exp_avg);
    q.v[k] = reinterpret_cast<M*>(a.exp_avg_sq);
    q.g[k] = a.grads;
    q.out[k] = reinterpret_cast<std::uint16_t*>(a.weights_out);
    q.n[k] = a.n;
    q.flag[k] = a.nonfinite;
    q.vec[k] = vector_aligned(a.master, q.m[k], q.v[k], a.grads, a.weights_out);
    blocks += a_blocks;
  }
  return flush();
}

// ----- sum of squares, in oom::optim::grad_sum_of_squares's order -----

constexpr std::int64_t tile = static_cast<std::int64_t>(optim::sum_of_squares_tile_elements);
constexpr int lanes = 16;  // the CPU's 16 interleaved lanes
static_assert(tile % lanes == 0, "a tile must hold whole rounds of the 16 lanes");
static_assert(tile / lanes <= 0x7fffffff, "a lane's element count must fit an int");
constexpr int tile_threads = 128;
constexpr int tiles_per_block = tile_threads / lanes;
/// Elements each thread loads ahead: a lane's chain of adds is serial, so the bandwidth comes from
/// the loads in flight. While one batch is added the next one is already loading: up to 2 x 64
/// floats per thread, 64 KB per SM at the 256 threads per SM that 128M floats give (2048 tiles).
constexpr int batch = 64;

/// 16 threads per tile; thread `lane` sums elements lane, lane + 16, ... of its tile in order, as
/// the CPU's lane does. fma(d, d, acc) is the CPU's acc + d * d bit for bit: the square of a float
/// is exact in fp64 (48 significant bits, no underflow), so only the addition rounds in either.
__global__ void __launch_bounds__(tile_threads) tile_sums(const float* g, std::int64_t n, double* partial,
                                                          std::int64_t tiles) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * tiles_per_block + threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  double acc = 0.0;
  if (t < tiles) {
    const std::int64_t begin = t * tile;
    const int len = static_cast<int>(n - begin < tile ? n - begin : tile);
    const float* x = g + begin + lane;
    const int count = len > lane ? (len - lane + lanes - 1) / lanes : 0;  // this lane's elements
    const int full = count / batch;
    float cur[batch];
    if (full > 0) {
#pragma unroll
      for (int k = 0; k < batch; ++k) cur[k] = x[k * lanes];
    }
    for (int b = 0; b < full; ++b) {
      float next[batch];
      const bool more = b + 1 < full;
      if (more) {
        const float* p = x + static_cast<std::int64_t>(b + 1) * batch * lanes;
#pragma unroll
        for (int k = 0; k < batch; ++k) next[k] = p[k * lanes];
      }
#pragma unroll
      for (int k = 0; k < batch; ++k) {
        const double d = cur[k];
        acc = __fma_rn(d, d, acc);
      }
      if (more) {
#pragma unroll
        for (int k = 0; k < batch; ++k) cur[k] = next[k];
      }
    }
    for (int i = full * batch; i < count; ++i) {
      const double d = x[static_cast<std::int64_t>(i) * lanes];
      acc = __fma_rn(d, d, acc);
    }
  }
  // Lane l += lane l + half for half = 8, 4, 2, 1: OOM_OPTIM_COMBINE_16_LANES's order. Lanes whose
  // partner is beyond the 16 read garbage, but lane 0's chain only depends on valid ones.
#pragma unroll
  for (int half = lanes / 2; half >= 1; half /= 2) acc = __dadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, half, lanes));
  if (t < tiles && lane == 0) partial[t] = acc;
}

/// Tiles in order, as the CPU adds its tile sums: the block stages the partials in shared memory so
/// thread 0's serial chain of adds does not also wait on each global load.
constexpr int combine_threads = 256;
constexpr int combine_chunk = 2048;

__global__ void __launch_bounds__(combine_threads) sum_tiles(const double* partial, std::int64_t tiles,
                                                             double* result) {
  __shared__ double staged[combine_chunk];
  double total = 0.0;
  for (std::int64_t base = 0; base < tiles; base += combine_chunk) {
    const int count = static_cast<int>(tiles - base < combine_chunk ? tiles - base : combine_chunk);
    for (int i = threadIdx.x; i < count; i += combine_threads) staged[i] = partial[base + i];
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll 8
      for (int i = 0; i < count; ++i) total = __dadd_rn(total, staged[i]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *result = total;
}

std::int64_t tile_count(std::int64_t n) { return (n + tile - 1) / tile; }

}  // namespace

cudaError_t adamw_update(const optim::AdamWStepScalars& step, float* master, float* exp_avg, float* exp_avg_sq,
                         const float* grads, bf16* weights_out, std::int64_t n, cudaStream_t stream) {
  return launch<float>(step, master, exp_avg, exp_avg_sq, grads, reinterpret_cast<std::uint16_t*>(weights_out), n,
                       stream);
}

cudaError_t adamw_update(const optim::AdamWStepScalars& step, float* master, bf16* exp_avg, bf16* exp_avg_sq,
                         const float* grads, bf16* weights_out, std::int64_t n, cudaStream_t stream) {
  return launch<std::uint16_t>(step, master, reinterpret_cast<std::uint16_t*>(exp_avg),
                               reinterpret_cast<std::uint16_t*>(exp_avg_sq), grads,
                               reinterpret_cast<std::uint16_t*>(weights_out), n, stream);
}

cudaError_t adamw_update_many(const optim::AdamWStepScalars& step, std::span<const AdamWSegment> segments, cudaStream_t stream) {
  return launch_many<float>(step, segments, stream);
}

cudaError_t adamw_update_many(const optim::AdamWStepScalars& step, std::span<const AdamWSegmentBf16> segments,
                              cudaStream_t stream) {
  return launch_many<std::uint16_t>(step, segments, stream);
}

cudaError_t flag_nonfinite(const float* grads, std::int64_t n, int* flag, cudaStream_t stream) {
  if (n < 0) return detail::refuse("flag_nonfinite: n = ", n, " (must be >= 0)");
  if (flag == nullptr) return detail::refuse("flag_nonfinite: flag is null");
  if (n == 0) return cudaSuccess;
  if (grads == nullptr) return detail::refuse("flag_nonfinite: grads is null (n = ", n, ")");
  // Enough blocks to fill the GPU several times over; each thread then strides over the rest.
  const std::int64_t wanted = (n + threads * 4 - 1) / (threads * 4);
  const unsigned grid = static_cast<unsigned>(wanted < 4096 ? wanted : 4096);
  flag_nonfinite_kernel<<<grid, threads, 0, stream>>>(grads, n, flag, aligned(grads, 16));
  return cudaGetLastError();
}

std::size_t grad_sum_of_squares_workspace_bytes(std::int64_t n) {
  return n <= 0 ? 0 : static_cast<std::size_t>(tile_count(n)) * sizeof(double);
}

cudaError_t grad_sum_of_squares(const float* grads, std::int64_t n, double* result, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream) {
  if (n < 0) return detail::refuse("grad_sum_of_squares: n = ", n, " (must be >= 0)");
  if (result == nullptr) return detail::refuse("grad_sum_of_squares: result is null");
  if (n == 0) return cudaMemsetAsync(result, 0, sizeof(double), stream);
  if (grads == nullptr) return detail::refuse("grad_sum_of_squares: grads is null (n = ", n, ")");
  if (const std::size_t need = grad_sum_of_squares_workspace_bytes(n); workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace("grad_sum_of_squares", workspace, workspace_bytes, need,
                                    "grad_sum_of_squares_workspace_bytes(", n, ")");
  const std::int64_t tiles = tile_count(n);
  auto* partial = static_cast<double*>(workspace);
  tile_sums<<<grid_for(tiles, tiles_per_block), tile_threads, 0, stream>>>(grads, n, partial, tiles);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  sum_tiles<<<1, combine_threads, 0, stream>>>(partial, tiles, result);
  return cudaGetLastError();
}

}  // namespace oom::kernels
