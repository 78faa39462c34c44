// The ends of a causal LM step on the GPU; contract in include/oom/model/cuda_lm_ends.hpp. Host
// code only (OOM's launchers and, inside lm_head_loss, cuBLAS), so it is a .cpp.
#include "oom/model/cuda_lm_ends.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <string_view>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/embedding.hpp"
#include "oom/kernels/lm_head_loss.hpp"
#include "oom/kernels/rmsnorm.hpp"
#include "oom/model/model_spec.hpp"

namespace oom::model {
namespace {

[[noreturn]] void invalid(const std::string& what) { throw Error(Errc::invalid_argument, "lm ends: " + what); }

/// A launcher's status: the step that failed and why (oom::detail::check_launch); each entry point
/// forgets any reason left on this thread too (oom/kernels/refusal.hpp).
void check(cudaError_t status, std::string_view step) { ::oom::detail::check_launch(status, "lm ends", step); }

void require(const void* p, const char* what) {
  if (p == nullptr) invalid(fmt::format("{} is null", what));
}

void require_workspace(const void* workspace, std::size_t bytes, std::size_t needed, const char* call) {
  if (bytes < needed)
    invalid(fmt::format("{}: workspace of {} bytes, needs {} (lm_ends_workspace_bytes)", call, bytes, needed));
  if (needed > 0 && workspace == nullptr) invalid(fmt::format("{}: workspace is null", call));
}

constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

/// Logits budget of one chunk of the fused LM head. Each chunk also reads and writes the whole
/// fp32 head gradient (V x H, added into: 2.5 GB at V = 151936, H = 2048), so short chunks are
/// slow: at 256 rows that traffic took as long as the chunk's three GEMMs (H200, 2026-12-04:
/// the loss of a 151936-vocab model 1.86x its GEMMs' time). 2 GiB gives 2304 rows there (about
/// 11% on top of the GEMMs) and 11,136 at V = 32000. The memory is the executor's shared
/// workspace: from about 24-32K tokens on a layer's backward needs more than this anyway; below
/// that, a model of a large vocabulary holds up to ~1.7 GiB more than with 256 MiB (Qwen3-30B-A3B
/// at 4K: 2,019 MiB against its layers' 453), which CudaCausalLm::fit weighs like any workset. Not
/// tied to the layers' workspace: that depends on the plan, and the rows must not.
constexpr std::size_t lm_head_budget_bytes = std::size_t{2} << 30;

kernels::LmHeadShape head_shape(const LmEndsShape& s) {
  return {.tokens = s.tokens, .hidden = s.hidden, .vocab = s.vocab, .chunk_rows = lm_head_chunk_rows(s)};
}

/// lm_head_forward_backward's workspace, in this order (256-byte aligned each):
///   rstd (T) fp32 | r (T, H) bf16 | scratch: lm_head_loss's, then (after it, on the same stream)
///   rmsnorm_backward's, sharing the same bytes.
struct HeadScratch {
  std::size_t rstd = 0, r = 0, scratch = 0, scratch_bytes = 0, total = 0;
};
HeadScratch head_scratch(const LmEndsShape& s) {
  HeadScratch h;
  h.rstd = 0;
  h.r = h.rstd + align_up(static_cast<std::size_t>(s.tokens) * sizeof(float));
  h.scratch = h.r + align_up(static_cast<std::size_t>(s.tokens * s.hidden) * sizeof(bf16));
  h.scratch_bytes = std::max(kernels::lm_head_loss_workspace_bytes(head_shape(s)),
                             kernels::rmsnorm_backward_workspace_bytes(s.tokens, s.hidden));
  h.total = h.scratch + align_up(h.scratch_bytes);
  return h;
}

}  // namespace

LmEndsShape LmEndsShape::from_spec(const ModelSpec& spec, std::int64_t tokens) {
  LmEndsShape s;
  s.tokens = tokens;
  s.hidden = static_cast<std::int64_t>(spec.hidden_size());
  s.vocab = static_cast<std::int64_t>(spec.vocab_size());
  s.rms_norm_eps = static_cast<float>(spec.rms_norm_eps());
  s.norm_offset = spec.zero_centred_norms() ? 1.0f : 0.0f;
  s.validate();
  return s;
}

void LmEndsShape::validate() const {
  if (tokens < 0 || tokens > INT_MAX) invalid(fmt::format("tokens = {} (needs 0 <= T <= 2^31 - 1)", tokens));
  if (hidden < 1 || hidden > INT_MAX) invalid(fmt::format("hidden = {} (needs 1 <= H <= 2^31 - 1)", hidden));
  // The embedding kernels take V < 2^31 - 1 (ids are int32).
  if (vocab < 1 || vocab >= INT_MAX) invalid(fmt::format("vocab = {} (needs 1 <= V < 2^31 - 1)", vocab));
  if (!(rms_norm_eps >= 0.0f)) invalid(fmt::format("rms_norm_eps = {} (needs >= 0)", rms_norm_eps));
  if (!std::isfinite(norm_offset)) invalid(fmt::format("norm_offset = {} (needs a finite value)", norm_offset));
  if (loss_tokens < 0 || (loss_tokens > 0 && loss_tokens < tokens))
    invalid(fmt::format("loss_tokens = {} (needs 0, or at least this call's tokens {})", loss_tokens, tokens));
}

std::int64_t lm_head_chunk_rows(const LmEndsShape& s) {
  s.validate();
  const auto bytes = [&](std::int64_t rows) {
    return kernels::lm_head_loss_workspace_bytes({.tokens = s.tokens, .hidden = s.hidden, .vocab = s.vocab, .chunk_rows = rows});
  };
  // ~6 bytes per logit (fp32 logits + bf16 d logits); start from that estimate, then step down
  // until the exact size fits (it includes a few small per-row and alignment terms).
  std::int64_t rows = std::max<std::int64_t>(1, static_cast<std::int64_t>(lm_head_budget_bytes / (6 * static_cast<std::size_t>(s.vocab))));
  if (rows >= 64) rows = rows / 64 * 64;  // whole GEMM tiles
  while (rows > 1 && bytes(rows) > lm_head_budget_bytes) rows -= rows > 64 ? 64 : 1;
  return std::max<std::int64_t>(1, std::min(rows, s.tokens));
}

std::size_t lm_ends_workspace_bytes(const LmEndsShape& s) {
  s.validate();
  return std::max(head_scratch(s).total, kernels::embedding_backward_workspace_bytes(s.tokens, s.vocab, s.hidden));
}

void lm_embed_forward(const LmEndsContext& ctx, const LmEndsShape& s, const bf16* embedding, const std::int32_t* ids, bf16* x,
                      std::int32_t* invalid_count) {
  s.validate();
  kernels::clear_refusal();  // see check()
  require(invalid_count, "lm_embed_forward: invalid_count");
  if (s.tokens == 0) return;
  require(embedding, "lm_embed_forward: embedding");
  require(ids, "lm_embed_forward: ids");
  require(x, "lm_embed_forward: x");
  check(kernels::embedding_forward(ids, embedding, x, invalid_count, s.tokens, s.vocab, s.hidden, ctx.stream),
        "embedding_forward");
}

void lm_head_forward_backward(const LmEndsContext& ctx, const LmEndsShape& s, const bf16* y, const bf16* final_norm,
                              const bf16* head, const std::int32_t* targets, float* loss_sum, std::int32_t* valid, bf16* dy,
                              float* grad_final_norm, float* grad_head, void* workspace, std::size_t workspace_bytes) {
  s.validate();
  kernels::clear_refusal();  // see check()
  require(ctx.blas, "lm_head_forward_backward: ctx.blas");
  require(loss_sum, "lm_head_forward_backward: loss_sum");
  require(valid, "lm_head_forward_backward: valid");
  const bool backward = dy != nullptr;
  if (s.tokens > 0) {
    require(y, "lm_head_forward_backward: y");
    require(final_norm, "lm_head_forward_backward: final_norm");
    require(head, "lm_head_forward_backward: head");
    require(targets, "lm_head_forward_backward: targets");
  }
  if (backward) {
    require(grad_final_norm, "lm_head_forward_backward: grad_final_norm (needed with dy)");
    require(grad_head, "lm_head_forward_backward: grad_head (needed with dy)");
    if (dy == y && s.tokens > 0) invalid("lm_head_forward_backward: dy aliases y (the norm's backward reads y)");
  }
  const HeadScratch L = head_scratch(s);
  require_workspace(workspace, workspace_bytes, L.total, "lm_head_forward_backward");

  auto* base = static_cast<char*>(workspace);
  auto* rstd = reinterpret_cast<float*>(base + L.rstd);
  auto* r = reinterpret_cast<bf16*>(base + L.r);
  void* scratch = base + L.scratch;

  // r = rms(y) * (final_norm + norm_offset) (rstd kept for the backward).
  check(kernels::rmsnorm_forward(y, final_norm, r, backward ? rstd : nullptr, s.tokens, s.hidden, s.rms_norm_eps, ctx.stream,
                                 s.norm_offset),
        "final norm rmsnorm_forward");
  // loss_sum, valid; with the backward dr = d(loss_sum / T) / dr written into dy (bf16) and
  // grad_head += dlogits^T r. grad_scale = 1/T, the mean over this call's T tokens (1/(k T) for
  // one of a step's k micro-batches: LmEndsShape::loss_tokens).
  const std::int64_t mean_over = s.loss_tokens > 0 ? s.loss_tokens : s.tokens;
  const float grad_scale = mean_over > 0 ? 1.0f / static_cast<float>(mean_over) : 0.0f;
  check(kernels::lm_head_loss(ctx.blas, ctx.stream, head_shape(s), r, head, targets, grad_scale, loss_sum, valid,
                              backward ? dy : nullptr, backward ? grad_head : nullptr, scratch, L.scratch_bytes),
        "lm_head_loss");
  if (!backward) return;
  // dy = rmsnorm backward of dr, in place (rmsnorm_backward allows grad_x == grad_y: each element
  // of dr is read before the same element of dx is written); grad_final_norm accumulated. The
  // scratch bytes are lm_head_loss's too: it is done with them, earlier on the same stream.
  check(kernels::rmsnorm_backward(dy, y, final_norm, rstd, dy, grad_final_norm, s.tokens, s.hidden, scratch,
                                  L.scratch_bytes, ctx.stream, s.norm_offset),
        "final norm rmsnorm_backward");
}

void lm_embed_backward(const LmEndsContext& ctx, const LmEndsShape& s, const std::int32_t* ids, const bf16* dx,
                       float* grad_embedding, std::int32_t* invalid_count, void* workspace, std::size_t workspace_bytes) {
  s.validate();
  kernels::clear_refusal();  // see check()
  require(invalid_count, "lm_embed_backward: invalid_count");
  if (s.tokens == 0) return;
  require(ids, "lm_embed_backward: ids");
  require(dx, "lm_embed_backward: dx");
  require(grad_embedding, "lm_embed_backward: grad_embedding");
  require_workspace(workspace, workspace_bytes, kernels::embedding_backward_workspace_bytes(s.tokens, s.vocab, s.hidden),
                    "lm_embed_backward");
  check(kernels::embedding_backward(ids, dx, grad_embedding, invalid_count, s.tokens, s.vocab, s.hidden, workspace,
                                    workspace_bytes, ctx.stream),
        "embedding_backward");
}

}  // namespace oom::model
