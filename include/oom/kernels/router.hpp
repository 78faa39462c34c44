// MoE router on the GPU (Qwen3-MoE): logits = x Wr^T by cuBLAS (fp32 out), softmax over experts in
// fp32, top-k (k <= 16, lower expert index wins ties, decreasing probability order), optional
// renormalisation; the load-balancing aux loss of transformers' load_balancing_loss_func; backward
// to d logits, dx and dWr. CPU reference: oom/reference/router.hpp.
//
// Launchers return cudaError_t (cuBLAS statuses mapped: invalid value -> cudaErrorInvalidValue,
// not supported -> cudaErrorNotSupported, alloc -> cudaErrorMemoryAllocation, else
// cudaErrorUnknown). Launchers that use cuBLAS set the handle's stream to `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom::kernels {

inline constexpr std::int64_t router_max_top_k = 16;
inline constexpr std::int64_t router_max_experts = 1024;

struct RouterShape {
  std::int64_t tokens = 0;   ///< T (0 is a no-op)
  std::int64_t hidden = 0;   ///< H
  std::int64_t experts = 0;  ///< E <= router_max_experts
  std::int64_t top_k = 0;    ///< k <= min(E, router_max_top_k)
  bool norm_topk_prob = true;
};

/// Forward. `probs` is saved for the backward; `logits` may be dropped after the call.
cudaError_t router_forward(cublasHandle_t blas, cudaStream_t stream, const RouterShape& s,
                           const bf16* x,            // (T, H)
                           const bf16* w_router,     // (E, H)
                           float* logits,            // (T, E) out
                           float* probs,             // (T, E) out: softmax(logits)
                           std::int32_t* expert_ids, // (T, k) out, decreasing probability
                           float* weights);          // (T, k) out

/// Scratch of router_aux_loss: E floats.
std::size_t router_aux_loss_workspace_bytes(const RouterShape& s);

/// aux = E * sum_e (counts[e] / T) * mean_t probs[t, e], deterministic (fixed reduction order).
/// `expert_counts` is what permute_plan produces (slots routed to each expert).
cudaError_t router_aux_loss(cudaStream_t stream, const RouterShape& s,
                            const float* probs,                // (T, E)
                            const std::int32_t* expert_counts, // (E)
                            float* aux_loss,                   // (1) out
                            void* workspace, std::size_t workspace_bytes);

/// Scratch of router_probability_sums: a partial sum per expert for each of up to 256 slabs of
/// rows, in fp64.
std::size_t router_probability_sums_workspace_bytes(const RouterShape& s);

/// sums[e] += sum_t probs[t, e] in fp64, deterministic: at most 256 slabs of rows, a number fixed
/// by T; in a slab 8 lanes each sum every 8th row in order and are added in lane order; the slabs
/// are then added in order. A load-balancing loss over several layers (P_e of
/// model::CudaRouterBalance) adds each layer's router here.
cudaError_t router_probability_sums(cudaStream_t stream, const RouterShape& s,
                                    const float* probs,  // (T, E)
                                    double* sums,        // (E) in and out
                                    void* workspace, std::size_t workspace_bytes);

/// loss = factor * E * sum_e counts[e] * sums[e] / rows^2, in fp64 on one block in expert order:
/// transformers' load-balancing loss over `rows` router rows (all layers' tokens) with C_e =
/// counts[e] slots and P_e = sums[e] probability, times factor (its coefficient and scale).
cudaError_t router_balance_loss(cudaStream_t stream, std::int64_t experts,
                                const std::int32_t* counts,  // (E)
                                const double* sums,          // (E)
                                double rows, double factor,
                                double* loss);               // (1) out

/// Scratch of router_backward: the bf16 copy of d logits that the cuBLAS GEMMs read.
std::size_t router_backward_workspace_bytes(const RouterShape& s);

/// d logits = softmax/renorm backward of d_weights plus aux_loss_grad * d aux / d logits;
/// dx (= or +=, see accumulate_dx) d logits . Wr; dw_router += d logits^T . x (fp32, caller zeroes).
/// The GEMMs read d logits rounded to bf16 (the precision of every other activation gradient).
cudaError_t router_backward(cublasHandle_t blas, cudaStream_t stream, const RouterShape& s,
                            const bf16* x,                      // (T, H)
                            const bf16* w_router,               // (E, H)
                            const float* probs,                 // (T, E) from router_forward
                            const std::int32_t* expert_ids,     // (T, k)
                            const float* d_weights,             // (T, k)
                            const std::int32_t* expert_counts,  // (E)
                            float aux_loss_grad,                // d loss / d aux (the aux coefficient)
                            float* d_logits,                    // (T, E) out fp32
                            bf16* dx,                           // (T, H)
                            bool accumulate_dx,
                            float* dw_router,                   // (E, H) fp32, accumulated
                            void* workspace, std::size_t workspace_bytes);

}  // namespace oom::kernels
