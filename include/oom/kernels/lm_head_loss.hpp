// Fused LM head + cross-entropy on the GPU over row chunks: for each chunk of rows, logits =
// x W^T (fp32, (chunk, V) in the caller's workspace), loss = logsumexp - logit[target], d logits =
// (softmax - onehot) * grad_scale (bf16), then dx = d logits W and dW += d logits^T x. The full
// (T, V) logits never exist. Targets equal to -100 are ignored (HF); a target outside [0, V)
// otherwise gives a NaN loss (reported, not hidden). CPU reference: oom/reference/lm_head_loss.hpp.
// Rows [r0, r1) of a larger batch: offset x, targets and dx by r0 and pass tokens = r1 - r0.
// Errors: cudaError_t, cuBLAS statuses mapped as in router.hpp; sets the handle's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom::kernels {

inline constexpr std::int32_t lm_head_ignore_index = -100;

struct LmHeadShape {
  std::int64_t tokens = 0;      ///< T rows of x
  std::int64_t hidden = 0;      ///< H
  std::int64_t vocab = 0;       ///< V (151936 for Qwen3)
  std::int64_t chunk_rows = 0;  ///< rows per chunk: workspace ~ chunk_rows * V * 6 bytes
};

std::size_t lm_head_loss_workspace_bytes(const LmHeadShape& s);

/// loss_sum = sum of the valid rows' losses (fp64 accumulation in fixed order, stored fp32);
/// valid_count = rows whose target != -100. With dx == nullptr only the loss is computed (dw is
/// then ignored); otherwise dx is written and dw accumulated (fp32; the caller zeroes it).
/// grad_scale is d loss / d row_loss, e.g. 1 / (valid targets of the whole step).
cudaError_t lm_head_loss(cublasHandle_t blas, cudaStream_t stream, const LmHeadShape& s,
                         const bf16* x,                 // (T, H)
                         const bf16* w,                 // (V, H)
                         const std::int32_t* targets,   // (T)
                         float grad_scale,
                         float* loss_sum,               // (1) out
                         std::int32_t* valid_count,     // (1) out
                         bf16* dx,                      // (T, H) out, or null
                         float* dw,                     // (V, H) fp32 accumulated, or null
                         void* workspace, std::size_t workspace_bytes);

}  // namespace oom::kernels
