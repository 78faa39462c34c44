// The Hopper (wgmma) flash-attention kernels: implementations of oom::kernels::attention_forward
// (include/oom/kernels/attention.hpp) with the same arguments and the same results, built on the
// warpgroup MMA of src/kernels/hopper/wgmma.cuh. Private (not installed): compiled only for
// sm_90a, into the oom_cuda library when the build targets 90 (src/CMakeLists.txt, object library
// oom_cuda_sm90a), where oom::kernels::attention_forward dispatches to them on compute capability
// 9.0. docs/hopper.md describes their structure and what is verified.
#pragma once

#include <cuda_runtime_api.h>

#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::hopper {

/// How attention_forward_wgmma_2wg orders a warpgroup's GEMMs (docs/hopper.md):
///   serial: per K/V tile, S = Q K^T, wait, softmax, O += P V, wait;
///   overlap_softmax: the P V of tile j-1 is issued with S of tile j and runs during its softmax.
enum class Wgmma2wgSchedule { serial, overlap_softmax };

/// O = softmax(scale * Q K^T + causal mask) V and LSE (natural log) for query rows
/// [q_begin, q_end), exactly as oom::kernels::attention_forward: same layouts, strides, GQA head
/// mapping, causal prefix of a query chunk, rows outside [q_begin, q_end) untouched. By the kernel
/// of src/kernels/hopper/attention_forward_wgmma_2wg.cu: two warpgroups per block sharing each K/V
/// tile (128 query rows x 128 keys), P kept in registers as the A operand of P V, V read as an
/// MN-major B. `schedule` picks one of two orders of the same wgmmas (bitwise the same results).
/// Returns cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned
/// pointer/stride (as attention_forward does); cudaErrorNotSupported for head_dim != 128 or when
/// the current device is not compute capability 9.0 (the only code compiled is sm_90a); otherwise
/// the launch's status. No allocation, no synchronisation.
cudaError_t attention_forward_wgmma_2wg(const AttentionProblem& p,
                                        TokenRows<const bf16> q,  // (B, S, Hq, D) bf16
                                        TokenRows<const bf16> k,  // (B, S, Hkv, D) bf16
                                        TokenRows<const bf16> v,  // (B, S, Hkv, D) bf16
                                        TokenRows<bf16> o,        // (B, S, Hq, D) bf16, rows [q_begin, q_end) written
                                        float* lse,               // (B, Hq, S) fp32, entries [q_begin, q_end) written
                                        cudaStream_t stream,
                                        Wgmma2wgSchedule schedule = Wgmma2wgSchedule::overlap_softmax);

}  // namespace oom::kernels::hopper
