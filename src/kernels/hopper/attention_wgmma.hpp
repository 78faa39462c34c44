// The Hopper (wgmma) flash-attention kernels: implementations of oom::kernels::attention_forward
// and oom::kernels::attention_backward (include/oom/kernels/attention.hpp) with the same arguments
// and the same results, built on the warpgroup MMA of src/kernels/hopper/wgmma.cuh. Private (not
// installed): compiled only for sm_90a, into the oom_cuda library when the build targets 90
// (src/CMakeLists.txt, object library oom_cuda_sm90a), where the public entry points dispatch to
// them on compute capability 9.0 at head_dim 128. docs/hopper.md describes their structure and
// what is verified.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::hopper {

/// How attention_forward_wgmma_2wg orders a warpgroup's GEMMs (docs/hopper.md):
///   serial: per K/V tile, S = Q K^T, wait, softmax, O += P V, wait;
///   overlap_softmax: the P V of tile j-1 is issued with S of tile j and runs during its softmax;
///   producer_overlap: overlap_softmax's order, but warp-specialised: a third (producer) warpgroup
///     issues all loads into mbarrier-tracked buffers, the consumers get its registers (setmaxnreg)
///     and never meet at a block-wide barrier;
///   producer_pingpong: producer_overlap plus the two consumer warpgroups taking turns issuing
///     their wgmmas (named barriers), so one's softmax overlaps the other's GEMMs;
///   producer_tma: producer_overlap with each K and V tile loaded by one TMA instruction
///     (cp.async.bulk.tensor, one producer thread) into a chunk-major no-swizzle layout instead of
///     128 threads' 16-byte cp.async; the consumers read it through other descriptor strides.
///     Tensors whose strides TMA cannot express (zero, negative, >= 2^40 bytes) run
///     producer_overlap's kernel. On the H200 (seventh session) the same bits, 0.96-0.98x
///     producer_overlap's speed (docs/hopper.md);
///   producer_3stage: producer_overlap's code (cp.async, no ping-pong) with 3 K and 3 V stages
///     instead of 2 (224 KiB of shared memory + barriers instead of 160 KiB), so the producer can
///     load up to two tiles ahead of the consumers: a test of whether the consumers' waits for
///     K/V limit the forward. On the H200 (eighth session) the same bits, 1.02-1.05x
///     producer_overlap;
///   producer_sw128: producer_3stage with Q, K and V in the 128-byte-swizzled layout (a row's 128
///     contiguous global bytes fill one 128-byte shared-memory line; the band layout splits each
///     32-byte sector over two lines: 2x the L2 sectors, 8x the shared-store wavefronts, ncu);
///   producer_sw128_tma: producer_sw128 with K and V loaded by TMA (128-byte swizzle, one
///     instruction per tile); tensors TMA cannot express run producer_sw128's kernel. Both
///     bit-identical to serial on the H200 (eighth session).
/// All eight compute the same operations in the same order per warpgroup: bitwise the same results.
/// The default is producer_sw128: on the H200 (test_attention_wgmma's timing at S = 4K, 16K, 64K)
/// it ran at 405 / 605 / 558 TFLOP/s against producer_sw128_tma's 369 / 531 / 535 (eighth
/// session, last call) and 410 / 611 / 544 against 372 / 493 / 536 (2026-12-01), both after its
/// loader stepped one pointer; before that change TMA led (423 / 577 / 578 against 392 / 580 /
/// 534), docs/hopper.md.
enum class Wgmma2wgSchedule {
  serial,
  overlap_softmax,
  producer_overlap,
  producer_pingpong,
  producer_tma,
  producer_3stage,
  producer_sw128,
  producer_sw128_tma,
};

/// O = softmax(scale * Q K^T + causal mask) V and LSE (natural log) for query rows
/// [q_begin, q_end), exactly as oom::kernels::attention_forward: same layouts, strides, GQA head
/// mapping, causal prefix of a query chunk, rows outside [q_begin, q_end) untouched. By the kernel
/// of src/kernels/hopper/attention_forward_wgmma_2wg.cu: two warpgroups per block sharing each K/V
/// tile (128 query rows x 128 keys), P kept in registers as the A operand of P V, V read as an
/// MN-major B. `schedule` picks one of eight orders/loaders of the same wgmmas (bitwise the same results).
/// Returns cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned
/// pointer/stride (as attention_forward does); cudaErrorNotSupported for head_dim != 128 or when
/// the current device is not compute capability 9.0 (the only code compiled is sm_90a); for
/// producer_tma and producer_sw128_tma also cudaErrorInvalidValue when the driver refuses the tensor maps, or
/// cudaErrorNotSupported when it has no cuTensorMapEncodeTiled; otherwise the launch's status.
/// No allocation, no synchronisation.
cudaError_t attention_forward_wgmma_2wg(const AttentionProblem& p,
                                        TokenRows<const bf16> q,  // (B, S, Hq, D) bf16
                                        TokenRows<const bf16> k,  // (B, S, Hkv, D) bf16
                                        TokenRows<const bf16> v,  // (B, S, Hkv, D) bf16
                                        TokenRows<bf16> o,        // (B, S, Hq, D) bf16, rows [q_begin, q_end) written
                                        float* lse,               // (B, Hq, S) fp32, entries [q_begin, q_end) written
                                        cudaStream_t stream,
                                        Wgmma2wgSchedule schedule = Wgmma2wgSchedule::producer_sw128);

/// The forward at head_dim 256 (attention_forward_wgmma_d256.cu): the same arguments, results and
/// error returns as attention_forward_wgmma_2wg (cudaErrorNotSupported for another head_dim or a
/// device other than compute capability 9.0).
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

/// The backward at head_dim 256 (attention_backward_wgmma.cu, "head_dim 256"): the same arguments,
/// results, workspace and error returns as attention_backward_wgmma (cudaErrorNotSupported for
/// another head_dim or a device other than compute capability 9.0).
cudaError_t attention_backward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                          TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                          const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                          bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                          cudaStream_t stream);

/// attention_backward_wgmma with every shared-memory tile in the no-swizzle band layout (the
/// layout before the eighth session): the same products in the same order, so the same bits.
/// Kept for test_attention_backward_wgmma, which checks that and times the two layouts.
cudaError_t attention_backward_wgmma_band(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                          TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                          const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                          bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                          cudaStream_t stream);

}  // namespace oom::kernels::hopper
