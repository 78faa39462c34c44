// The Hopper (wgmma) flash-attention kernels: implementations of oom::kernels::attention_forward
// and oom::kernels::attention_backward (include/oom/kernels/attention.hpp) with the same arguments
// and the same results, built on the warpgroup MMA of src/kernels/hopper/wgmma.cuh. Private (not
// installed): compiled only for sm_90a, into the oom_cuda library when the build targets 90
// (src/CMakeLists.txt, object library oom_cuda_sm90a), where the public entry points dispatch to
// them on compute capability 9.0 at head_dim 128 and 256. docs/hopper.md describes their structure and
// what is verified.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::hopper {

/// O = softmax(scale * Q K^T + causal mask) V and LSE (natural log) for query rows
/// [q_begin, q_end), exactly as oom::kernels::attention_forward: same layouts, strides, GQA head
/// mapping, causal prefix of a query chunk, rows outside [q_begin, q_end) untouched. By the kernel
/// of src/kernels/hopper/attention_forward_wgmma.cu at head_dim 128: two consumer warpgroups per
/// block sharing each K/V tile (128 query rows x 128 keys), P kept in registers as the A operand
/// of P V, V read as an MN-major B, the P V of one tile running under the softmax of the next; a
/// producer warpgroup loads Q, K and V by cp.async into 3 mbarrier-tracked K/V stages in the
/// 128-byte-swizzled layout. Within the bf16 bounds of the exact result, deterministic
/// (bit-identical run to run).
/// Returns cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned
/// pointer/stride (as attention_forward does); cudaErrorNotSupported for head_dim != 128 or when
/// the current device is not compute capability 9.0 (the only code compiled is sm_90a); otherwise
/// the launch's status. No allocation, no synchronisation.
cudaError_t attention_forward_wgmma(const AttentionProblem& p,
                                        TokenRows<const bf16> q,  // (B, S, Hq, D) bf16
                                        TokenRows<const bf16> k,  // (B, S, Hkv, D) bf16
                                        TokenRows<const bf16> v,  // (B, S, Hkv, D) bf16
                                        TokenRows<bf16> o,        // (B, S, Hq, D) bf16, rows [q_begin, q_end) written
                                        float* lse,               // (B, Hq, S) fp32, entries [q_begin, q_end) written
                                        cudaStream_t stream);

/// The forward at head_dim 256 (the same kernel template, attention_forward_wgmma.cu, with 64-key
/// tiles, O as two m64n128 accumulators and 2 K/V stages): the same arguments, results and error
/// returns as attention_forward_wgmma (cudaErrorNotSupported for another head_dim or a device
/// other than compute capability 9.0).
cudaError_t attention_forward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                         TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream);

/// dQ, dK, dV exactly as oom::kernels::attention_backward computes them (same layouts, strides,
/// GQA sum, query sub-range and causal prefix, accumulate_dkv, workspace of
/// attention_backward_workspace_bytes(p) and the same preprocess into it), by the wgmma kernels of
/// src/kernels/hopper/attention_backward_wgmma.cu (passes 2 and 3 in one warp-specialised grid: a
/// producer warpgroup loads into mbarrier-tracked stages, two warpgroups compute; tiles in the
/// 128-byte-swizzled layout); within the same bf16 bounds of the exact gradients, deterministic
/// (no atomics: bit-identical run to run).
/// Returns cudaErrorInvalidValue where attention_backward does (problem, pointer, stride, LSE, workspace size or alignment);
/// cudaErrorNotSupported for head_dim != 128 or a current device that is not compute capability
/// 9.0; otherwise the launches' status. No allocation, no synchronisation.
cudaError_t attention_backward_wgmma(const AttentionProblem& p,
                                     TokenRows<const bf16> q,    // (B, S, Hq, D) bf16
                                     TokenRows<const bf16> k,    // (B, S, Hkv, D) bf16
                                     TokenRows<const bf16> v,    // (B, S, Hkv, D) bf16
                                     TokenRows<const bf16> o,    // (B, S, Hq, D) bf16 (the forward's output)
                                     TokenRows<const bf16> d_o,  // (B, S, Hq, D) bf16
                                     const float* lse,           // (B, Hq, S) fp32 (the forward's)
                                     TokenRows<bf16> dq,         // (B, S, Hq, D) bf16, rows [q_begin, q_end)
                                     TokenRows<bf16> dk,         // (B, S, Hkv, D) bf16, rows [0, q_end)
                                     TokenRows<bf16> dv,         // (B, S, Hkv, D) bf16, rows [0, q_end)
                                     bool accumulate_dkv,
                                     void* workspace, std::size_t workspace_bytes,
                                     cudaStream_t stream);

/// The backward at head_dim 256 (attention_backward_wgmma.cu, "head_dim 256": each block's
/// products over d split between its two warpgroups): the same arguments, results, workspace and
/// error returns as attention_backward_wgmma (cudaErrorNotSupported for another head_dim or a
/// device other than compute capability 9.0).
cudaError_t attention_backward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                          TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                          const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                          bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                          cudaStream_t stream);

/// attention_backward_dkv_sum by these kernels, at head_dim 128 or 256 (cudaErrorNotSupported
/// for another head_dim or a device other than compute capability 9.0).
cudaError_t attention_backward_wgmma_dkv_sum(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                             TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                             const float* lse, TokenRows<bf16> dq, AttentionDkvSums sums, void* workspace,
                                             std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace oom::kernels::hopper
