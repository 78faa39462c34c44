// Token permutation by expert on the GPU, deterministic: slots s = t*k + j are stably sorted by
// expert (CUB radix sort of the ids with the slot as value), so rows are ordered by (expert, slot)
// exactly as the CPU reference (oom/reference/permute.hpp). Per-expert counts (CUB histogram) and
// offsets (CUB scan); experts may receive zero rows. Gather into expert order, combine the k
// expert outputs back per token (fp32 accumulation), and both backwards, all without atomics.
// The four row kernels work a token per block (the gather's blocks stride over the tokens) and
// use 16-byte accesses when H is a multiple of 8 and every row buffer is 16-byte aligned, element
// accesses otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

struct PermuteShape {
  std::int64_t tokens = 0;   ///< T (0 is a no-op)
  std::int64_t top_k = 0;    ///< k
  std::int64_t experts = 0;  ///< E
};

/// Scratch of permute_plan (sorted keys, slot indices, CUB temporary storage); 0 for no tokens,
/// where permute_plan takes a null workspace.
std::size_t permute_plan_workspace_bytes(const PermuteShape& s);

/// Expert ids must lie in [0, E) (router_forward guarantees it). expert_counts is what the expert
/// GEMMs need on the host: copy it down (one small D2H + sync per layer).
cudaError_t permute_plan(cudaStream_t stream, const PermuteShape& s,
                         const std::int32_t* expert_ids,  // (T*k)
                         std::int32_t* row_to_slot,       // (T*k) out: permuted row r holds slot row_to_slot[r]
                         std::int32_t* slot_to_row,       // (T*k) out: inverse
                         std::int32_t* expert_counts,     // (E) out
                         std::int32_t* expert_offsets,    // (E+1) out, [E] = T*k
                         void* workspace, std::size_t workspace_bytes);

/// x_perm[slot_to_row[t*k+j]] = x[t] for every j < k: each x row is read once and written to its k
/// rows. Takes slot_to_row (until 2026-12-01 it took row_to_slot, the same type: a caller written
/// for that gets a wrong permutation, not a compile error).
cudaError_t permute_rows(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                         const std::int32_t* slot_to_row,  // (T*k)
                         const bf16* x,                    // (T, H)
                         bf16* x_perm);                    // (T*k, H) out

/// dx[t] = sum_j dx_perm[slot_to_row[t*k+j]] (fp32 accumulation).
cudaError_t permute_rows_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                  const std::int32_t* slot_to_row,  // (T*k)
                                  const bf16* dx_perm,              // (T*k, H)
                                  bf16* dx);                        // (T, H) out

/// out[t] = sum_j weights[t, j] * y_perm[slot_to_row[t*k+j]] (fp32 accumulation).
cudaError_t unpermute_combine(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                              const std::int32_t* slot_to_row,  // (T*k)
                              const bf16* y_perm,               // (T*k, H)
                              const float* weights,             // (T, k)
                              bf16* out);                       // (T, H) out

/// dy_perm[slot_to_row[t*k+j]] = weights[t, j] * d_out[t]; d_weights[t, j] = <d_out[t], y_perm[row]>.
cudaError_t unpermute_combine_backward(cudaStream_t stream, const PermuteShape& s, std::int64_t hidden,
                                       const std::int32_t* slot_to_row,  // (T*k)
                                       const bf16* d_out,                // (T, H)
                                       const bf16* y_perm,               // (T*k, H)
                                       const float* weights,             // (T, k)
                                       bf16* dy_perm,                    // (T*k, H) out
                                       float* d_weights);                // (T, k) out

}  // namespace oom::kernels
