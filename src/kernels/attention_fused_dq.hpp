// A private variant of the attention backward (docs/kernels.md): correct and deterministic on the
// H200, slower than attention_backward, kept for the next iteration of its ordered dQ accumulation.
#pragma once

#include <cstddef>

#include "oom/kernels/attention.hpp"

namespace oom::kernels {

/// Scratch attention_backward_fused_dq needs: attention_backward's, then an fp32 dQ accumulator
/// (B, Hq, q_end - q_begin rounded up to the query tile (64 rows at D = 128, 32 at D = 256), D)
/// and one uint32 counter per (batch, query head, query tile, column half at D = 256), 256-aligned.
[[nodiscard]] std::size_t attention_backward_fused_dq_workspace_bytes(const AttentionProblem& p);

/// The mma.sync attention backward (attention_backward_mma_sync, attention_paths.hpp) without its
/// dQ pass (a private variant, not the default; measured on the H200, 2026-11-30: 0.59x / 0.49x /
/// 0.52x the speed of the mma.sync backward at S = 4K / 16K / 64K,
/// B = 1, Hq/Hkv = 16/4, D = 128: the ordered waits cost more than the two products saved): the dK/dV pass also forms
/// dS K for each (key block, query tile) it visits and adds it to an fp32 dQ in the workspace, the
/// key blocks of a query tile in a fixed order (last to first, each thread block waiting on a
/// per-tile counter for the one before it); a small kernel then writes dq = bf16(scale * dQ).
/// Deterministic: bit-identical run to run. dK and dV are bit-identical to the mma.sync backward's
/// (not to the wgmma backward attention_backward runs on compute capability 9.0); dQ equals the
/// mma.sync backward's up to fp32 summation order and the bf16 rounding of dS (formed
/// from S^T rather than S). Same arguments, layout, chunking rules and error returns as
/// attention_backward, with workspace_bytes >= attention_backward_fused_dq_workspace_bytes(p).
/// Relies on the GPU starting a grid's thread blocks in increasing linear index (a block only
/// waits on lower-indexed ones); a wait that exceeds ~17 s traps (the launch fails) instead of
/// hanging.
cudaError_t attention_backward_fused_dq(const AttentionProblem& p,
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

}  // namespace oom::kernels
