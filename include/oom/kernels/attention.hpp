// Causal grouped-query attention on the GPU, flash-style (FlashAttention-2): forward (O and the
// softmax log-sum-exp) and backward (dQ, dK, dV), bf16 in and out, fp32 accumulation, O(S) memory
// (no S x S buffer anywhere). Host-parsable: the kernels live in src/kernels/attention_*.cu.
//
// Layout. Q, O, dO, dQ are (B, S, Hq, D) bf16; K, V, dK, dV are (B, S, Hkv, D) bf16. Within one
// token the heads are contiguous and each head's D values are contiguous (head stride = D,
// element stride = 1); tokens and batches are strided, so Q/K/V (and dQ/dK/dV) may be column views
// into one packed projection output (B*S, (Hq + 2*Hkv)*D):
//   q = {base,              S*row, row},  k = {base + Hq*D, S*row, row},
//   v = {base + (Hq+Hkv)*D, S*row, row}   with row = (Hq + 2*Hkv)*D.
// Every pointer must be 16-byte aligned and every stride a multiple of 8 elements (16 bytes: the
// kernels move 16-byte vectors). LSE is (B, Hq, S) fp32, contiguous, natural log.
//
// Query head h reads K/V head h / (Hq / Hkv). Mask: query i attends keys j <= i.
//
// Chunked execution: with q_begin/q_end, only queries [q_begin, q_end) are processed; they attend
// keys [0, q_end) (causal prefix). The forward writes O and LSE rows [q_begin, q_end) only. The
// backward writes dQ rows [q_begin, q_end) and the chunk's contributions to dK/dV rows
// [0, q_end): stored when accumulate_dkv is false (rows >= q_end untouched), added to the bf16
// values already there when it is true. Run the chunks of a sequence last-to-first, the first
// call (the last chunk, which covers every key) with accumulate_dkv = false. That sums dK/dV in
// bf16, rounding once per chunk; attention_backward_dkv_sum sums them in fp32 instead, for the
// caller to round once after the last chunk (the layer's query chunks, docs/runtime.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

/// A (B, S, H, D) tensor of rows: element (b, s, h, d) is at
/// data[b * batch_stride + s * token_stride + h * D + d] (strides in elements, 64-bit).
template <class T>
struct TokenRows {
  T* data = nullptr;
  std::int64_t batch_stride = 0;
  std::int64_t token_stride = 0;
};

struct AttentionProblem {
  int batch = 1;
  int seq = 0;          ///< S, tokens per sequence
  int heads_q = 0;      ///< Hq, a multiple of heads_kv
  int heads_kv = 0;     ///< Hkv
  int head_dim = 128;   ///< D: 128 or 256
  float softmax_scale = 0;  ///< usually 1/sqrt(D); must be finite and non-zero
  int q_begin = 0;      ///< first query row processed
  int q_end = -1;       ///< one past the last query row; -1 means seq
  [[nodiscard]] int query_end() const { return q_end < 0 ? seq : q_end; }
};

/// True when the kernels accept this problem (head_dim, head grouping, query range, scale).
/// Pointer alignment and strides are checked by the launchers.
[[nodiscard]] bool attention_can_implement(const AttentionProblem& p);

/// O = softmax(scale * Q K^T + causal mask) V for query rows [q_begin, q_end), and
/// LSE[b, h, i] = log(sum_j exp(scale * q_i . k_j)) over j <= i.
/// Returns cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned
/// pointer/stride; otherwise the launch's status. No allocation, no synchronisation.
cudaError_t attention_forward(const AttentionProblem& p,
                              TokenRows<const bf16> q,  // (B, S, Hq, D) bf16
                              TokenRows<const bf16> k,  // (B, S, Hkv, D) bf16
                              TokenRows<const bf16> v,  // (B, S, Hkv, D) bf16
                              TokenRows<bf16> o,        // (B, S, Hq, D) bf16, rows [q_begin, q_end) written
                              float* lse,               // (B, Hq, S) fp32, entries [q_begin, q_end) written
                              cudaStream_t stream);

/// Scratch the backward needs: D_i = rowsum(dO o O), (B, Hq, q_end - q_begin) fp32, 256-aligned.
[[nodiscard]] std::size_t attention_backward_workspace_bytes(const AttentionProblem& p);

/// dQ, dK, dV of a loss L given dO = dL/dO, from Q, K, V, O and LSE of the forward.
/// Deterministic: dK/dV are summed over the query heads of a group inside one thread block, dQ is
/// a separate pass over key blocks per query block; no atomics (bit-identical run to run).
cudaError_t attention_backward(const AttentionProblem& p,
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

/// Where attention_backward_dkv_sum adds dK and dV: (B, S, Hkv, D) fp32 each, strided as
/// TokenRows (16-byte aligned, strides multiples of 8 elements).
struct AttentionDkvSums {
  TokenRows<float> dk;
  TokenRows<float> dv;
};

/// attention_backward for one query chunk [q_begin, q_end) of a sequence whose dK/dV are summed in
/// fp32 over its chunks: dQ rows [q_begin, q_end) as attention_backward writes them (the same
/// bits), and the chunk's contributions to dK/dV rows [0, q_end), the softmax scale applied, ADDED
/// to sums.dk / sums.dv (rows >= q_end untouched). Zero the sums before a sequence's first chunk;
/// chunks in any order; round once after the last (cast_fp32_to_bf16). Over all chunks the sums
/// equal attention_backward's dK/dV before its rounding up to fp32 summation order. Same refusals
/// as attention_backward (for the sums as for dk/dv); workspace of
/// attention_backward_workspace_bytes(p).
cudaError_t attention_backward_dkv_sum(const AttentionProblem& p,
                                       TokenRows<const bf16> q,    // (B, S, Hq, D) bf16
                                       TokenRows<const bf16> k,    // (B, S, Hkv, D) bf16
                                       TokenRows<const bf16> v,    // (B, S, Hkv, D) bf16
                                       TokenRows<const bf16> o,    // (B, S, Hq, D) bf16 (the forward's output)
                                       TokenRows<const bf16> d_o,  // (B, S, Hq, D) bf16
                                       const float* lse,           // (B, Hq, S) fp32 (the forward's)
                                       TokenRows<bf16> dq,         // (B, S, Hq, D) bf16, rows [q_begin, q_end)
                                       AttentionDkvSums sums,      // fp32, rows [0, q_end) added to
                                       void* workspace, std::size_t workspace_bytes,
                                       cudaStream_t stream);

}  // namespace oom::kernels
