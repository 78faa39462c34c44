// The elementwise kernels of CublasResidualMlp (residual_mlp_cublas.cu), apart from the layer's
// header so that nvcc compiles them without the executor's headers. Each returns a cudaError_t.
#pragma once

#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::examples::residual_mlp_cublas_kernels {

/// out[i] = bf16(in[i]) (round to nearest even), i < n.
int to_bf16(const float* in, oom::bf16* out, std::uint64_t n, void* stream);
/// a[i] = bf16(silu(pre[i])).
int silu_bf16(const float* pre, oom::bf16* a, std::uint64_t n, void* stream);
/// dpre[i] = bf16(da[i] silu'(pre[i])).
int silu_grad_bf16(const float* da, const float* pre, oom::bf16* dpre, std::uint64_t n, void* stream);

}  // namespace oom::examples::residual_mlp_cublas_kernels
