// Cast and scaled-accumulate kernels: elementwise over n, 8 elements per thread (16-byte bf16 or
// 2 x 16-byte fp32 accesses) when every array is 16-byte aligned, scalar otherwise and for the
// tail. Contract in include/oom/kernels/cast.hpp.
#include "bf16_device.cuh"
#include "oom/kernels/cast.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::load_f32;
using detail::store_bf16;
using detail::store_f32;

constexpr int threads = 256;

enum class Op : int { f32_to_bf16, bf16_to_f32, acc_bf16, acc_f32 };

template <int N>
__device__ void apply(Op op, const void* in, void* out, float scale, std::int64_t i) {
  float v[N];
  if (op == Op::f32_to_bf16 || op == Op::acc_f32) {
    load_f32<N>(static_cast<const float*>(in) + i, v);
  } else {
    load_bf16<N>(static_cast<const std::uint16_t*>(in) + i, v);
  }
  if (op == Op::f32_to_bf16) {
    store_bf16<N>(static_cast<std::uint16_t*>(out) + i, v);
  } else if (op == Op::bf16_to_f32) {
    store_f32<N>(static_cast<float*>(out) + i, v);
  } else {
    float* acc = static_cast<float*>(out) + i;
    float a[N];
    load_f32<N>(acc, a);
#pragma unroll
    for (int k = 0; k < N; ++k) a[k] = __fmaf_rn(scale, v[k], a[k]);
    store_f32<N>(acc, a);
  }
}

// One kernel for the four operations (a uniform branch on `op`) keeps the instantiations few.
__global__ void elementwise(Op op, const void* in, void* out, float scale, std::int64_t n, bool vec) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x) * 8;
  if (i >= n) return;
  if (vec && i + 8 <= n) {
    apply<8>(op, in, out, scale, i);
  } else {
    const std::int64_t end = i + 8 < n ? i + 8 : n;
    for (std::int64_t j = i; j < end; ++j) apply<1>(op, in, out, scale, j);
  }
}

cudaError_t check_count(const char* name, std::int64_t n) {
  if (n < 0) return detail::refuse(name, ": n = ", n, " (must be >= 0)");
  if (grid_for(n, threads * 8) == 0 && n > 0) return detail::refuse(name, ": n = ", n, " needs more than 2^31 - 1 blocks");
  return cudaSuccess;
}

cudaError_t launch(const char* name, Op op, const void* in, void* out, float scale, std::int64_t n, cudaStream_t stream) {
  if (const cudaError_t e = check_count(name, n); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  const bool acc = op == Op::acc_bf16 || op == Op::acc_f32;
  if (const cudaError_t e = detail::refuse_null(name, {{acc ? "grad" : "in", in}, {acc ? "acc" : "out", out}}); e != cudaSuccess)
    return e;
  const unsigned grid = grid_for(n, threads * 8);
  elementwise<<<grid, threads, 0, stream>>>(op, in, out, scale, n, aligned_16(in, out));
  return cudaGetLastError();
}

// out = a + b in fp32, rounded once; each thread reads its elements of a and b before writing them.
__global__ void add_bf16_kernel(const std::uint16_t* a, const std::uint16_t* b, std::uint16_t* out, std::int64_t n, bool vec) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x) * 8;
  if (i >= n) return;
  if (vec && i + 8 <= n) {
    float x[8], y[8];
    load_bf16<8>(a + i, x);
    load_bf16<8>(b + i, y);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] += y[k];
    store_bf16<8>(out + i, x);
  } else {
    const std::int64_t end = i + 8 < n ? i + 8 : n;
    for (std::int64_t j = i; j < end; ++j) {
      float x[1], y[1];
      load_bf16<1>(a + j, x);
      load_bf16<1>(b + j, y);
      x[0] += y[0];
      store_bf16<1>(out + j, x);
    }
  }
}

// out[i] = row[i % width]; vec: width a multiple of 8 and both 16-byte aligned, so a thread's 8
// elements lie in one row.
__global__ void repeat_row_kernel(const std::uint16_t* row, std::int64_t width, std::uint16_t* out, std::int64_t n, bool vec) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x) * 8;
  if (i >= n) return;
  if (vec) {
    *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(row + i % width);
  } else {
    const std::int64_t end = i + 8 < n ? i + 8 : n;
    for (std::int64_t j = i; j < end; ++j) out[j] = row[j % width];
  }
}

__global__ void fill_kernel(std::uint16_t* out, std::int64_t n, std::uint16_t bits) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x) * 8;
  const std::int64_t end = i + 8 < n ? i + 8 : n;
  for (std::int64_t j = i; j < end; ++j) out[j] = bits;
}

}  // namespace

cudaError_t repeat_row_bf16(const bf16* row, std::int64_t width, bf16* out, std::int64_t rows, cudaStream_t stream) {
  if (width < 0 || rows < 0)
    return detail::refuse("repeat_row_bf16: width = ", width, ", rows = ", rows, " (must be >= 0)");
  if (width > 0 && rows > INT64_MAX / width) return detail::refuse("repeat_row_bf16: rows x width overflows");
  const std::int64_t n = rows * width;
  if (const cudaError_t e = check_count("repeat_row_bf16", n); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("repeat_row_bf16", {{"row", row}, {"out", out}}); e != cudaSuccess) return e;
  const auto* r = reinterpret_cast<const std::uint16_t*>(row);
  auto* o = reinterpret_cast<std::uint16_t*>(out);
  if (o < r + width && r < o + n) return detail::refuse("repeat_row_bf16: out overlaps row");
  repeat_row_kernel<<<grid_for(n, threads * 8), threads, 0, stream>>>(r, width, o, n, width % 8 == 0 && aligned_16(row, out));
  return cudaGetLastError();
}

cudaError_t fill_bf16(bf16* out, std::int64_t n, float value, cudaStream_t stream) {
  if (const cudaError_t e = check_count("fill_bf16", n); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("fill_bf16", {{"out", out}}); e != cudaSuccess) return e;
  fill_kernel<<<grid_for(n, threads * 8), threads, 0, stream>>>(reinterpret_cast<std::uint16_t*>(out), n, oom::to_bf16(value).bits);
  return cudaGetLastError();
}

cudaError_t add_bf16(const bf16* a, const bf16* b, bf16* out, std::int64_t n, cudaStream_t stream) {
  if (const cudaError_t e = check_count("add_bf16", n); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("add_bf16", {{"a", a}, {"b", b}, {"out", out}}); e != cudaSuccess) return e;
  const unsigned grid = grid_for(n, threads * 8);
  add_bf16_kernel<<<grid, threads, 0, stream>>>(reinterpret_cast<const std::uint16_t*>(a), reinterpret_cast<const std::uint16_t*>(b),
                                                reinterpret_cast<std::uint16_t*>(out), n, aligned_16(a, b, out));
  return cudaGetLastError();
}

cudaError_t cast_fp32_to_bf16(const float* in, bf16* out, std::int64_t n, cudaStream_t stream) {
  return launch("cast_fp32_to_bf16", Op::f32_to_bf16, in, out, 0.0f, n, stream);
}
cudaError_t cast_bf16_to_fp32(const bf16* in, float* out, std::int64_t n, cudaStream_t stream) {
  return launch("cast_bf16_to_fp32", Op::bf16_to_f32, in, out, 0.0f, n, stream);
}
cudaError_t accumulate_scaled(float* acc, const bf16* grad, float scale, std::int64_t n, cudaStream_t stream) {
  return launch("accumulate_scaled", Op::acc_bf16, grad, acc, scale, n, stream);
}
cudaError_t accumulate_scaled(float* acc, const float* grad, float scale, std::int64_t n, cudaStream_t stream) {
  return launch("accumulate_scaled", Op::acc_f32, grad, acc, scale, n, stream);
}

}  // namespace oom::kernels
