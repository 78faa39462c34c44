// The attention output gate: a thread per element. Contract in include/oom/kernels/output_gate.hpp.
#include "bf16_device.cuh"
#include "oom/kernels/output_gate.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;

constexpr int threads = 256;

using detail::sigmoid;

/// The gate's offset of packed element e = (t, h, i).
__device__ __forceinline__ std::int64_t gate_at(const OutputGateDims& d, std::int64_t e) {
  const std::int64_t i = e % d.head_dim, th = e / d.head_dim;
  return (th / d.heads) * d.row_stride + (th % d.heads) * d.head_stride + i;
}

__global__ void forward(OutputGateDims d, const std::uint16_t* ctx, const std::uint16_t* gate, std::uint16_t* o) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.tokens * d.heads * d.head_dim) return;
  o[e] = float_to_bf16(bf16_to_float(ctx[e]) * sigmoid(bf16_to_float(gate[gate_at(d, e)])));
}

__global__ void backward(OutputGateDims d, const std::uint16_t* ctx, const std::uint16_t* gate, const std::uint16_t* d_o,
                         std::uint16_t* d_ctx, std::uint16_t* d_gate) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * threads + threadIdx.x;
  if (e >= d.tokens * d.heads * d.head_dim) return;
  const std::int64_t g = gate_at(d, e);
  const float s = sigmoid(bf16_to_float(gate[g])), go = bf16_to_float(d_o[e]), c = bf16_to_float(ctx[e]);
  d_ctx[e] = float_to_bf16(go * s);  // after every read: d_ctx may be ctx or d_o
  d_gate[g] = float_to_bf16(go * c * s * (1.0f - s));
}

cudaError_t check(const char* name, const OutputGateDims& d, unsigned& blocks) {
  if (d.tokens < 0 || d.heads < 1 || d.head_dim < 1)
    return detail::refuse(name, ": tokens = ", d.tokens, ", heads = ", d.heads, ", head_dim = ", d.head_dim,
                          " (need tokens >= 0, heads and head_dim >= 1)");
  if (d.head_stride < d.head_dim || d.row_stride < d.heads * d.head_stride)
    return detail::refuse(name, ": head_stride = ", d.head_stride, ", row_stride = ", d.row_stride,
                          " (need head_stride >= head_dim and row_stride >= heads x head_stride)");
  const std::int64_t n = (d.tokens * d.heads * d.head_dim + threads - 1) / threads;
  if (n > 0x7fffffff) return detail::refuse(name, ": ", d.tokens, " tokens need more than 2^31 - 1 blocks");
  blocks = static_cast<unsigned>(n);
  return cudaSuccess;
}

}  // namespace

cudaError_t output_gate_forward(const OutputGateDims& d, const bf16* ctx, const bf16* gate, bf16* o, cudaStream_t stream) {
  constexpr const char* name = "output_gate_forward";
  unsigned blocks = 0;
  if (const cudaError_t e = check(name, d, blocks); e != cudaSuccess) return e;
  if (blocks == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"ctx", ctx}, {"gate", gate}, {"o", o}}); e != cudaSuccess) return e;
  forward<<<blocks, threads, 0, stream>>>(d, reinterpret_cast<const std::uint16_t*>(ctx), reinterpret_cast<const std::uint16_t*>(gate),
                                          reinterpret_cast<std::uint16_t*>(o));
  return cudaGetLastError();
}

cudaError_t output_gate_backward(const OutputGateDims& d, const bf16* ctx, const bf16* gate, const bf16* d_o, bf16* d_ctx,
                                 bf16* d_gate, cudaStream_t stream) {
  constexpr const char* name = "output_gate_backward";
  unsigned blocks = 0;
  if (const cudaError_t e = check(name, d, blocks); e != cudaSuccess) return e;
  if (blocks == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"ctx", ctx}, {"gate", gate}, {"d_o", d_o}, {"d_ctx", d_ctx}, {"d_gate", d_gate}});
      e != cudaSuccess)
    return e;
  backward<<<blocks, threads, 0, stream>>>(d, reinterpret_cast<const std::uint16_t*>(ctx), reinterpret_cast<const std::uint16_t*>(gate),
                                           reinterpret_cast<const std::uint16_t*>(d_o), reinterpret_cast<std::uint16_t*>(d_ctx),
                                           reinterpret_cast<std::uint16_t*>(d_gate));
  return cudaGetLastError();
}

}  // namespace oom::kernels
