// CudaResidualMlp's kernels and their launchers: y = x + W2 silu(W1 x), forward and backward, fp32
// with bf16 weights; the 0.5 x mean squared error loss. Errors are built in residual_mlp_cuda.cpp.
#include "custom_layer/residual_mlp_kernels.hpp"

#include <cuda_runtime.h>

namespace oom::examples {
namespace {

using u64 = std::uint64_t;

__device__ float weight(const oom::bf16* w, u64 i) { return __uint_as_float(static_cast<unsigned>(w[i].bits) << 16); }
__device__ float silu(float v) { return v / (1.0f + expf(-v)); }

// pre[r, j] = sum_k w1[j, k] x[b + r, k], r < rows.
__global__ void pre_activation(const oom::bf16* w, const float* x, float* pre, u64 b, u64 rows, u64 h, u64 inter) {
  const u64 j = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  const u64 r = blockIdx.y;
  if (j >= inter || r >= rows) return;
  const float* xr = x + (b + r) * h;
  float s = 0;
  for (u64 k = 0; k < h; ++k) s += weight(w, j * h + k) * xr[k];
  pre[r * inter + j] = s;
}

// y[b + r, k] = x[b + r, k] + sum_j w2[k, j] silu(pre[r, j]).
__global__ void output(const oom::bf16* w, const float* x, const float* pre, float* y, u64 b, u64 rows, u64 h, u64 inter) {
  const u64 k = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  const u64 r = blockIdx.y;
  if (k >= h || r >= rows) return;
  const oom::bf16* w2 = w + inter * h;
  float s = x[(b + r) * h + k];
  for (u64 j = 0; j < inter; ++j) s += weight(w2, k * inter + j) * silu(pre[r * inter + j]);
  y[(b + r) * h + k] = s;
}

// dpre[r, j] = (sum_k w2[k, j] dy[b + r, k]) silu'(pre[r, j]).
__global__ void pre_gradient(const oom::bf16* w, const float* dy, const float* pre, float* dpre, u64 b, u64 rows, u64 h, u64 inter) {
  const u64 j = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  const u64 r = blockIdx.y;
  if (j >= inter || r >= rows) return;
  const oom::bf16* w2 = w + inter * h;
  float da = 0;
  for (u64 k = 0; k < h; ++k) da += weight(w2, k * inter + j) * dy[(b + r) * h + k];
  const float p = pre[r * inter + j];
  const float s = 1.0f / (1.0f + expf(-p));
  dpre[r * inter + j] = da * s * (1.0f + p * (1.0f - s));
}

// dx[b + r, k] = dy[b + r, k] + sum_j w1[j, k] dpre[r, j].
__global__ void input_gradient(const oom::bf16* w, const float* dy, const float* dpre, float* dx, u64 b, u64 rows, u64 h, u64 inter) {
  const u64 k = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  const u64 r = blockIdx.y;
  if (k >= h || r >= rows) return;
  float s = dy[(b + r) * h + k];
  for (u64 j = 0; j < inter; ++j) s += weight(w, j * h + k) * dpre[r * inter + j];
  dx[(b + r) * h + k] = s;
}

// One thread per weight, tokens in order, added onto what earlier chunks left:
// g1[j, k] += dpre[r, j] x[b + r, k]; g2[k, j] += dy[b + r, k] silu(pre[r, j]).
__global__ void weight_gradients(const float* x, const float* dy, const float* pre, const float* dpre, float* g, u64 b, u64 rows,
                                 u64 h, u64 inter) {
  const u64 i = blockIdx.x * static_cast<u64>(blockDim.x) + threadIdx.x;
  if (i >= 2 * inter * h) return;
  float acc = g[i];
  if (i < inter * h) {
    const u64 j = i / h, k = i % h;
    for (u64 r = 0; r < rows; ++r) acc += dpre[r * inter + j] * x[(b + r) * h + k];
  } else {
    const u64 k = (i - inter * h) / inter, j = (i - inter * h) % inter;
    for (u64 r = 0; r < rows; ++r) acc += dy[(b + r) * h + k] * silu(pre[r * inter + j]);
  }
  g[i] = acc;
}

// One block: grad = (y - target) / tokens; *loss = 0.5 x sum (y - target)^2 / tokens, summed in
// fp64 by 256 lanes each over a fixed stride, then the lanes in order.
__global__ void mse(const float* y, const float* target, float* grad, u64 n, u64 tokens, double* loss) {
  __shared__ double part[256];
  double s = 0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = y[i] - target[i];
    grad[i] = d / static_cast<float>(tokens);
    s += 0.5 * static_cast<double>(d) * d;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int l = 0; l < 256; ++l) total += part[l];
    *loss = total / static_cast<double>(tokens);
  }
}

dim3 grid(u64 width, u64 rows) { return dim3(static_cast<unsigned>((width + 127) / 128), static_cast<unsigned>(rows)); }

}  // namespace

namespace residual_mlp_kernels {

int forward(const oom::bf16* w, const float* x, float* pre, float* y, u64 b, u64 rows, u64 h, u64 inter, void* stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  pre_activation<<<grid(inter, rows), 128, 0, s>>>(w, x, pre, b, rows, h, inter);
  if (y != nullptr) output<<<grid(h, rows), 128, 0, s>>>(w, x, pre, y, b, rows, h, inter);
  return cudaGetLastError();
}

int backward(const oom::bf16* w, const float* x, const float* dy, const float* pre, float* dpre, float* dx, float* g, u64 b, u64 rows,
             u64 h, u64 inter, void* stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  pre_gradient<<<grid(inter, rows), 128, 0, s>>>(w, dy, pre, dpre, b, rows, h, inter);
  input_gradient<<<grid(h, rows), 128, 0, s>>>(w, dy, dpre, dx, b, rows, h, inter);
  weight_gradients<<<grid(2 * inter * h, 1), 128, 0, s>>>(x, dy, pre, dpre, g, b, rows, h, inter);
  return cudaGetLastError();
}

int mse_loss(const float* y, const float* target, float* grad, u64 tokens, u64 hidden, double* loss, void* stream) {
  mse<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(y, target, grad, tokens * hidden, tokens, loss);
  return cudaGetLastError();
}

}  // namespace residual_mlp_kernels
}  // namespace oom::examples
