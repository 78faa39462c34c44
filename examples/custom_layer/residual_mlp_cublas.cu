// CublasResidualMlp's elementwise kernels: the casts of the GEMMs' bf16 operands, silu and its
// gradient, computed as the CPU layer computes them (residual_mlp.hpp) before the rounding.
#include "custom_layer/residual_mlp_cublas_kernels.hpp"

#include <cuda_runtime.h>

namespace oom::examples::residual_mlp_cublas_kernels {
namespace {

using u64 = std::uint64_t;

__device__ oom::bf16 round_bf16(float v) {  // nearest even; NaN stays a NaN
  const unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return oom::bf16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  return oom::bf16{static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
__device__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

__global__ void cast(const float* in, oom::bf16* out, u64 n) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<u64>(gridDim.x) * blockDim.x)
    out[i] = round_bf16(in[i]);
}
__global__ void silu(const float* pre, oom::bf16* a, u64 n) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<u64>(gridDim.x) * blockDim.x)
    a[i] = round_bf16(pre[i] / (1.0f + expf(-pre[i])));
}
__global__ void silu_grad(const float* da, const float* pre, oom::bf16* dpre, u64 n) {
  for (u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<u64>(gridDim.x) * blockDim.x) {
    const float s = sigmoid(pre[i]);
    dpre[i] = round_bf16(da[i] * s * (1.0f + pre[i] * (1.0f - s)));
  }
}

unsigned blocks(u64 n) { return static_cast<unsigned>(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096); }

}  // namespace

int to_bf16(const float* in, oom::bf16* out, std::uint64_t n, void* stream) {
  cast<<<blocks(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(in, out, n);
  return cudaGetLastError();
}
int silu_bf16(const float* pre, oom::bf16* a, std::uint64_t n, void* stream) {
  silu<<<blocks(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(pre, a, n);
  return cudaGetLastError();
}
int silu_grad_bf16(const float* da, const float* pre, oom::bf16* dpre, std::uint64_t n, void* stream) {
  silu_grad<<<blocks(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(da, pre, dpre, n);
  return cudaGetLastError();
}

}  // namespace oom::examples::residual_mlp_cublas_kernels
