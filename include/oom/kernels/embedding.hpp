// Token embedding on the GPU: forward gather of bf16 rows by token id, backward deterministic
// scatter-add of the row gradients into an fp32 table gradient. Launchers only (host-parsable);
// kernels in src/kernels/embedding.cu, CPU reference in oom/reference/embedding.hpp.
//
// Ids are validated on the device: a token whose id is outside [0, V) reads no memory, gets a zero
// row in the forward, contributes nothing in the backward, and adds 1 to the caller's
// `invalid_count` (a device int32 the caller zeroes and reads back), so a bad id is never clamped
// silently into some other token's row.
//
// Backward determinism: (id, token) pairs are stably radix-sorted by id (CUB), then one block per
// distinct id sums that id's gradient rows in token order in fp32 and adds the sum to the table
// gradient. No atomics on the gradient, so the bits never depend on the schedule. One id that
// occurs in very many tokens is summed by a single block (a padding id repeated 100k times is
// slow, still correct).
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

/// Scratch bytes embedding_backward needs for `tokens` tokens and a vocabulary of `vocab` ids.
std::size_t embedding_backward_workspace_bytes(std::int64_t tokens, std::int64_t vocab);

/// grad_table[v, :] += sum over tokens t with ids[t] == v, in increasing t, of grad_out[t, :]
/// (fp32 sum, then one fp32 add into grad_table). Rows of ids that do not occur are untouched.
/// Invalid ids are skipped and counted into *invalid_count. `workspace` holds at least
/// embedding_backward_workspace_bytes(tokens, vocab) bytes (256-byte aligned, as cudaMalloc gives).
cudaError_t embedding_backward(const std::int32_t* ids,  // (T) int32 token ids
                               const bf16* grad_out,      // (T, H) bf16
                               float* grad_table,         // (V, H) fp32, accumulated into
                               std::int32_t* invalid_count,  // (1) int32
                               std::int64_t tokens, std::int64_t vocab, std::int64_t hidden,
                               void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace oom::kernels
