// Token embedding on the GPU: forward gather of bf16 rows by token id, backward deterministic
// scatter-add of the row gradients into an fp32 table gradient. Launchers only (host-parsable);
// kernels in src/kernels/embedding.cu, CPU reference in oom/reference/embedding.hpp.
//
// Ids are validated on the device: a token whose id is outside [0, V) reads no memory, gets a zero
// row in the forward, contributes nothing in the backward, and adds 1 to the caller's
// `invalid_count` (a device int32 the caller zeroes and reads back), so a bad id is never clamped
// silently into some other token's row.
//
// Backward determinism: (id, token) pairs are stably radix-sorted by id (CUB); the sorted positions
// are cut into fixed segments of 64, each summed by its own blocks in fp32 in token order. A run of
// one id inside a segment is added to the table gradient there; a run that crosses segments is
// summed segment by segment and the segments' sums added in order by the block of its first
// segment. No atomics on the gradient and a sum order set by the sorted positions alone, so the
// bits never depend on the schedule; an id in very many tokens (a padding id, a frequent word) is
// summed by many blocks, not one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

/// out[t, :] = table[ids[t], :], or zeros (and ++*invalid_count) when ids[t] is outside [0, V).
/// Invalid shapes (negative sizes, V or H < 1, V >= 2^31 - 1) give cudaErrorInvalidValue.
cudaError_t embedding_forward(const std::int32_t* ids,  // (T) int32 token ids
                              const bf16* table,        // (V, H) bf16
                              bf16* out,                // (T, H) bf16
                              std::int32_t* invalid_count,  // (1) int32, incremented per invalid id
                              std::int64_t tokens, std::int64_t vocab, std::int64_t hidden, cudaStream_t stream);

/// Scratch bytes embedding_backward needs for `tokens` tokens, a vocabulary of `vocab` ids and rows
/// of `hidden` (the sort's buffers and two fp32 rows per 64 tokens: about 16 + H / 8 bytes a token).
std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab, std::int64_t hidden);

/// grad_table[v, :] += sum over tokens t with ids[t] == v, in increasing t, of grad_out[t, :]
/// (fp32 sums of each id's tokens in token order, 64 sorted positions at a time, those sums added
/// in order, then one fp32 add into grad_table). Rows of ids that do not occur are untouched.
/// Invalid ids are skipped and counted into *invalid_count. `workspace` holds at least
/// embedding_backward_workspace_bytes(tokens, vocab, hidden) bytes (256-byte aligned, as cudaMalloc
/// gives).
cudaError_t embedding_backward(const std::int32_t* ids,  // (T) int32 token ids
                               const bf16* grad_out,      // (T, H) bf16
                               float* grad_table,         // (V, H) fp32, accumulated into
                               std::int32_t* invalid_count,  // (1) int32
                               std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                               void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace oom::kernels
