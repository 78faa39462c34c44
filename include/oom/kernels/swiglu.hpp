// SwiGLU on the GPU: out = silu(gate) * up, the MLP/expert activation of Qwen3. The input is one
// (T, 2I) tensor whose rows are [gate | up] halves (gate = row[0:I], up = row[I:2I]): the fused
// gate_up projection writes it with one GEMM, and the backward writes its gradient in the same
// layout for the one backward GEMM. Kernels in src/kernels/swiglu.cu, reference in
// oom/reference/swiglu.hpp. silu(g) = g * sigmoid(g), sigmoid(g) = 1 / (1 + exp(-g)) in fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

cudaError_t swiglu_forward(const bf16* gate_up,  // (T, 2I) bf16, rows [gate | up]
                           bf16* out,            // (T, I) bf16
                           std::int64_t tokens, std::int64_t intermediate, cudaStream_t stream);

/// grad_gate = grad_out * up * s * (1 + g * (1 - s)), grad_up = grad_out * silu(g), s = sigmoid(g).
cudaError_t swiglu_backward(const bf16* grad_out,  // (T, I) bf16
                            const bf16* gate_up,   // (T, 2I) bf16, the forward's input
                            bf16* grad_gate_up,    // (T, 2I) bf16, rows [grad_gate | grad_up]
                            std::int64_t tokens, std::int64_t intermediate, cudaStream_t stream);

}  // namespace oom::kernels
