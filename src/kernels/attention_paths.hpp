// The attention entry points of include/oom/kernels/attention.hpp pick an implementation by device
// (the wgmma kernels of src/kernels/hopper on compute capability 9.0 at head_dim 128 and 256, when
// the build has them; the mma.sync kernels everywhere else). These private declarations reach the
// mma.sync implementations directly, whatever the device, so tests and benchmarks can set the two
// side by side on one GPU. Same arguments, results and error returns as the public functions.
#pragma once

#include <cuda_runtime_api.h>

#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"

namespace oom::kernels {

/// attention_forward by the mma.sync kernel (src/kernels/attention_forward.cu) on every device.
cudaError_t attention_forward_mma_sync(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                       TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream);

/// attention_backward by the mma.sync kernels (src/kernels/attention_backward.cu) on every device.
cudaError_t attention_backward_mma_sync(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                        const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                        bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream);

/// attention_backward_dkv_sum by the mma.sync kernels on every device.
cudaError_t attention_backward_mma_sync_dkv_sum(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                                TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                                const float* lse, TokenRows<bf16> dq, AttentionDkvSums sums, void* workspace,
                                                std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace oom::kernels
