// The launchers of CudaResidualMlp's kernels (residual_mlp_cuda.cu), apart from the layer's header
// so that nvcc compiles the kernels without the executor's headers. Each returns a cudaError_t.
#pragma once

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::examples::residual_mlp_kernels {

/// pre[r, j] = (W1 x[b + r])_j for r < rows; then, unless y is null, y[b + r] = x[b + r] + W2 silu(pre[r]).
int forward(const oom::bf16* w, const float* x, float* pre, float* y, std::uint64_t b, std::uint64_t rows, std::uint64_t h,
            std::uint64_t inter, void* stream);
/// dpre (rows, inter), dx[b + r] and g (w1's then w2's gradients) += this chunk's, tokens in order.
int backward(const oom::bf16* w, const float* x, const float* dy, const float* pre, float* dpre, float* dx, float* g, std::uint64_t b,
             std::uint64_t rows, std::uint64_t h, std::uint64_t inter, void* stream);
int mse_loss(const float* y, const float* target, float* grad, std::uint64_t tokens, std::uint64_t hidden, double* loss, void* stream);

}  // namespace oom::examples::residual_mlp_kernels
