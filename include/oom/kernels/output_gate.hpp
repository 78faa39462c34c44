// The output gate of Qwen3-Next's and Qwen3.5's full attention on the GPU: o = ctx * sigmoid(gate)
// before o_proj, forward and backward. q_proj yields, per head, [q (head_dim) | gate (head_dim)]
// side by side (transformers: view(..., heads, 2 head_dim), chunk in two), so the gate is read
// from, and its gradient written to, a strided view of that array: element (t, h, i) at
// t * row_stride + h * head_stride + i. ctx and o are packed (T, heads, head_dim). bf16 in and
// out, fp32 math (sigmoid(g) = 1 / (1 + exp(-g))). Kernels in src/kernels/output_gate.cu; the CPU
// reference, which HostDecoderLayer uses too, is oom/reference/output_gate.hpp. d_ctx may be ctx
// or d_o (in place); d_gate must not overlap ctx or d_o.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

struct OutputGateDims {
  std::int64_t tokens = 0, heads = 0, head_dim = 0;
  std::int64_t row_stride = 0;   ///< elements between tokens of the gate (q_proj's width: 2 heads head_dim)
  std::int64_t head_stride = 0;  ///< elements between heads of the gate (2 head_dim)
};

/// o = ctx * sigmoid(gate).
cudaError_t output_gate_forward(const OutputGateDims& d, const bf16* ctx, const bf16* gate, bf16* o, cudaStream_t stream);

/// d_ctx = d_o * sigmoid(gate) (packed), d_gate = d_o * ctx * s (1 - s) (at the gate's strides);
/// both overwritten.
cudaError_t output_gate_backward(const OutputGateDims& d, const bf16* ctx, const bf16* gate, const bf16* d_o, bf16* d_ctx,
                                 bf16* d_gate, cudaStream_t stream);

}  // namespace oom::kernels
