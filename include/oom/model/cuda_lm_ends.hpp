// The two ends of a Qwen3-MoE causal LM step on the GPU, around the decoder layers
// (oom/model/cuda_decoder_layer.hpp), composed from OOM's kernels:
//
//   x    = embedding[ids]                                  lm_embed_forward      (T, H)
//   ... decoder layers: x -> y ...
//   r    = rms(y) * final_norm                             lm_head_forward_backward
//   loss = sum_t CE(r_t head^T, target_t)   (loss_sum; the step's loss is loss_sum / T)
//   dy   = d(loss_sum / T) / dy,  grad_final_norm += ..., grad_head += ...   (T: loss_tokens if set)
//   ... decoder layers backward: dy -> dx ...
//   grad_embedding += scatter-add of dx by ids             lm_embed_backward
//
// Loss scaling: the gradient is that of loss_sum / T (grad_scale = 1/T, the mean over the T tokens
// of this call; 1/(k T) with LmEndsShape::loss_tokens = k T for one of k micro-batches), known on
// the host, so no host sync is needed to learn the valid-target count.
// With targets of -100 (ignored, as HF) that is not HF's mean over the valid targets: `valid`
// tells the caller how many there were.
//
// Dtypes as the decoder layer: activations and weights bf16, accumulations fp32, parameter
// gradients fp32 and ACCUMULATED (+=) into what the caller passes (zero them once per step). A
// tied lm_head passes the embedding as `head` and the embedding's gradient as `grad_head`; both
// calls accumulate into it.
//
// Calls: everything is issued on ctx.stream (the cuBLAS handle's stream is set to it); no
// allocation and no host synchronisation inside; `workspace` is scratch of one call, at least
// lm_ends_workspace_bytes(shape) bytes (256-byte aligned, as cudaMalloc gives). Device buffers
// 16-byte aligned at least.
//
// Token ids are validated on the device: an id outside [0, V) gives a zero embedding row, is
// skipped in the backward, and adds 1 to *invalid_count (a device int32 the caller zeroes and reads
// back). A target outside [0, V) other than -100 gives a NaN loss (reported, not hidden).
//
// Errors: oom::Error (Errc::invalid_argument for bad shapes, null pointers or a short workspace,
// Errc::cuda naming the kernel call that failed).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom {
class ModelSpec;
}

namespace oom::model {

struct LmEndsShape {
  std::int64_t tokens = 0;  ///< T (rows of this call)
  std::int64_t hidden = 0;  ///< H
  std::int64_t vocab = 0;   ///< V
  float rms_norm_eps = 1e-6f;
  /// Added to the final norm's weight in fp32: 1 where it scales by (1 + w) (Qwen3-Next, Qwen3.5).
  float norm_offset = 0.0f;
  /// Tokens the step's loss is the mean over: 0 means this call's T. A step of k micro-batches of T
  /// tokens each passes k * T, so each call's gradient carries 1 / (k * T) and their sum is the
  /// step's (gradient accumulation).
  std::int64_t loss_tokens = 0;

  /// hidden, vocab, rms_norm_eps and the final norm's offset of `spec`, T = tokens.
  [[nodiscard]] static LmEndsShape from_spec(const ModelSpec& spec, std::int64_t tokens);
  /// Throws Errc::invalid_argument naming the first field out of range.
  void validate() const;
};

struct LmEndsContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;  ///< used by lm_head_forward_backward only
};

/// Rows per chunk of the fused LM head: its fp32 + bf16 logits of one chunk (about 6 * V bytes a
/// row) stay within 2 GiB (11,136 rows at V = 32000, 2304 at V = 151936), a multiple of 64 when
/// that many fit, and never more than T (at least 1). Each chunk reads and writes the fp32 head
/// gradient once (8 * V * H bytes), which is what longer chunks save. A function of the shape
/// alone, so every plan of a model sums the head gradient in the same order.
[[nodiscard]] std::int64_t lm_head_chunk_rows(const LmEndsShape& s);

/// Scratch bytes: the largest of the three calls'.
[[nodiscard]] std::size_t lm_ends_workspace_bytes(const LmEndsShape& s);

/// x[t, :] = embedding[ids[t], :] (zeros and ++*invalid_count for an id outside [0, V)).
void lm_embed_forward(const LmEndsContext& ctx, const LmEndsShape& s,
                      const bf16* embedding,        // (V, H)
                      const std::int32_t* ids,      // (T)
                      bf16* x,                      // (T, H) out
                      std::int32_t* invalid_count); // (1) incremented per invalid id

/// r = rms(y) * final_norm; loss_sum = sum over valid targets of CE(r head^T, target), valid = their
/// count (both written, not accumulated). With dy != nullptr also the backward of loss_sum / T
/// (loss_sum / loss_tokens where set): dy written, grad_final_norm and grad_head accumulated (both
/// required then). With dy == nullptr
/// only the loss (the gradient pointers are ignored). dy must not alias y.
void lm_head_forward_backward(const LmEndsContext& ctx, const LmEndsShape& s,
                              const bf16* y,                 // (T, H) the last layer's output
                              const bf16* final_norm,        // (H)
                              const bf16* head,              // (V, H) lm_head, or the embedding when tied
                              const std::int32_t* targets,   // (T) in [0, V) or -100
                              float* loss_sum,               // (1) out
                              std::int32_t* valid,           // (1) out
                              bf16* dy,                      // (T, H) out, or nullptr for the loss only
                              float* grad_final_norm,        // (H) accumulated
                              float* grad_head,              // (V, H) accumulated
                              void* workspace, std::size_t workspace_bytes);

/// grad_embedding[v, :] += sum over t with ids[t] == v (in token order, fp32) of dx[t, :];
/// deterministic (no atomics on the gradient). Invalid ids are skipped and counted.
void lm_embed_backward(const LmEndsContext& ctx, const LmEndsShape& s,
                       const std::int32_t* ids,      // (T)
                       const bf16* dx,               // (T, H) d loss / d x
                       float* grad_embedding,        // (V, H) accumulated
                       std::int32_t* invalid_count,  // (1) incremented per invalid id
                       void* workspace, std::size_t workspace_bytes);

}  // namespace oom::model
