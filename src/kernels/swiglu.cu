// SwiGLU kernels over (T, 2I) [gate | up] rows: elementwise, 8 bf16 (16 bytes) per thread when the
// rows allow it. Contract in include/oom/kernels/swiglu.hpp.
#include "bf16_device.cuh"
#include "oom/kernels/swiglu.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::load_bf16;
using detail::store_bf16;

constexpr int threads = 256;

using detail::sigmoid;

template <int N>
__device__ void forward_chunk(const std::uint16_t* gate_up, std::uint16_t* out, std::int64_t chunk,
                              std::int64_t intermediate) {
  const std::int64_t per_row = intermediate / N;
  const std::int64_t t = chunk / per_row;
  const std::int64_t i = (chunk % per_row) * N;
  const std::uint16_t* row = gate_up + t * 2 * intermediate;
  float g[N], u[N], o[N];
  load_bf16<N>(row + i, g);
  load_bf16<N>(row + intermediate + i, u);
#pragma unroll
  for (int k = 0; k < N; ++k) o[k] = g[k] * sigmoid(g[k]) * u[k];
  store_bf16<N>(out + t * intermediate + i, o);
}

__global__ void forward(const std::uint16_t* gate_up, std::uint16_t* out, std::int64_t tokens,
                        std::int64_t intermediate, bool vec) {
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (vec) {
    if (chunk < tokens * (intermediate / 8)) forward_chunk<8>(gate_up, out, chunk, intermediate);
  } else {
    if (chunk < tokens * intermediate) forward_chunk<1>(gate_up, out, chunk, intermediate);
  }
}

template <int N>
__device__ void backward_chunk(const std::uint16_t* grad_out, const std::uint16_t* gate_up, std::uint16_t* grad_gate_up,
                               std::int64_t chunk, std::int64_t intermediate) {
  const std::int64_t per_row = intermediate / N;
  const std::int64_t t = chunk / per_row;
  const std::int64_t i = (chunk % per_row) * N;
  const std::int64_t in_off = t * 2 * intermediate + i;
  float dout[N], g[N], u[N], dg[N], du[N];
  load_bf16<N>(grad_out + t * intermediate + i, dout);
  load_bf16<N>(gate_up + in_off, g);
  load_bf16<N>(gate_up + in_off + intermediate, u);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float s = sigmoid(g[k]);
    du[k] = dout[k] * (g[k] * s);
    dg[k] = dout[k] * u[k] * (s * (1.0f + g[k] * (1.0f - s)));
  }
  store_bf16<N>(grad_gate_up + in_off, dg);
  store_bf16<N>(grad_gate_up + in_off + intermediate, du);
}

__global__ void backward(const std::uint16_t* grad_out, const std::uint16_t* gate_up, std::uint16_t* grad_gate_up,
                         std::int64_t tokens, std::int64_t intermediate, bool vec) {
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (vec) {
    if (chunk < tokens * (intermediate / 8)) backward_chunk<8>(grad_out, gate_up, grad_gate_up, chunk, intermediate);
  } else {
    if (chunk < tokens * intermediate) backward_chunk<1>(grad_out, gate_up, grad_gate_up, chunk, intermediate);
  }
}

cudaError_t check_shape(const char* name, std::int64_t tokens, std::int64_t intermediate) {
  if (tokens < 0) return detail::refuse(name, ": tokens = ", tokens, " (must be >= 0)");
  if (intermediate < 1) return detail::refuse(name, ": intermediate = ", intermediate, " (must be >= 1)");
  return cudaSuccess;
}

cudaError_t too_many(const char* name, std::int64_t tokens, std::int64_t intermediate) {
  return detail::refuse(name, ": ", tokens, " tokens x ", intermediate, " need more than 2^31 - 1 blocks");
}

}  // namespace

cudaError_t swiglu_forward(const bf16* gate_up, bf16* out, std::int64_t tokens, std::int64_t intermediate,
                           cudaStream_t stream) {
  if (const cudaError_t e = check_shape("swiglu_forward", tokens, intermediate); e != cudaSuccess) return e;
  if (tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("swiglu_forward", {{"gate_up", gate_up}, {"out", out}}); e != cudaSuccess)
    return e;
  const bool vec = intermediate % 8 == 0 && aligned_16(gate_up, out);
  const unsigned grid = grid_for(tokens * (intermediate / (vec ? 8 : 1)), threads);
  if (grid == 0) return too_many("swiglu_forward", tokens, intermediate);
  forward<<<grid, threads, 0, stream>>>(reinterpret_cast<const std::uint16_t*>(gate_up),
                                        reinterpret_cast<std::uint16_t*>(out), tokens, intermediate, vec);
  return cudaGetLastError();
}

cudaError_t swiglu_backward(const bf16* grad_out, const bf16* gate_up, bf16* grad_gate_up, std::int64_t tokens,
                            std::int64_t intermediate, cudaStream_t stream) {
  if (const cudaError_t e = check_shape("swiglu_backward", tokens, intermediate); e != cudaSuccess) return e;
  if (tokens == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null("swiglu_backward",
                                                {{"grad_out", grad_out}, {"gate_up", gate_up}, {"grad_gate_up", grad_gate_up}});
      e != cudaSuccess)
    return e;
  const bool vec = intermediate % 8 == 0 && aligned_16(grad_out, gate_up, grad_gate_up);
  const unsigned grid = grid_for(tokens * (intermediate / (vec ? 8 : 1)), threads);
  if (grid == 0) return too_many("swiglu_backward", tokens, intermediate);
  backward<<<grid, threads, 0, stream>>>(reinterpret_cast<const std::uint16_t*>(grad_out),
                                         reinterpret_cast<const std::uint16_t*>(gate_up),
                                         reinterpret_cast<std::uint16_t*>(grad_gate_up), tokens, intermediate, vec);
  return cudaGetLastError();
}

}  // namespace oom::kernels
