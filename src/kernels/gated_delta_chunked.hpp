// The gated delta rule in its chunked form (oom::reference::gated_delta_rule_chunked_forward /
// _chunked_backward), the launchers gated_delta.cu routes to (GatedDeltaDims::Form). Internal:
// the dims come with their strides resolved and checked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/kernels/gated_delta.hpp"

namespace oom::kernels::detail {

/// The longest chunk the chunked kernels take (a chunk's tokens are one block's rows).
constexpr std::int64_t chunked_max_chunk = 64;

/// The opt-in for `smem` bytes of dynamic shared memory (over 48 KiB), for both forms' kernels.
template <class Kernel>
cudaError_t reserve_smem(Kernel kernel, std::size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

#ifdef __CUDACC__
/// GatedDeltaDims::chunks(), for device code (the header's is a host function).
__device__ inline std::int64_t chunks_of(const GatedDeltaDims& d) { return (d.seq_len + d.chunk - 1) / d.chunk; }
#endif

/// The most dynamic shared memory one of the chunked kernels takes a block (its per-chunk backward's).
std::size_t gated_delta_chunked_smem_bytes();

/// Floats of the chunked backward's scratch: the gradient of the state leaving every chunk,
/// (B, v_heads, chunks, dk, dv), as the sequential pass hands it to the chunks' pass.
std::size_t gated_delta_chunked_scratch_floats(const GatedDeltaDims& d);

cudaError_t gated_delta_chunked_forward(const GatedDeltaDims& d, const std::uint16_t* q, const std::uint16_t* k,
                                        const std::uint16_t* v, const float* g, const float* beta, std::uint16_t* out,
                                        float* states, cudaStream_t stream);

/// Writes dv, dg, dbeta, d_state (when given) and the per-value-head gradients of the normalised
/// (q scaled) rows, dq_part and dk_part (T, v_heads, dk), for the l2norm's backward.
cudaError_t gated_delta_chunked_backward(const GatedDeltaDims& d, const std::uint16_t* q, const std::uint16_t* k,
                                         const std::uint16_t* v, const float* g, const float* beta, const std::uint16_t* d_out,
                                         const float* states, std::uint16_t* dv, float* dg, float* dbeta, float* d_state,
                                         float* scratch, float* dq_part, float* dk_part, cudaStream_t stream);

}  // namespace oom::kernels::detail
