// The load-balancing loss on the GPU; contract in include/oom/model/cuda_router_balance.hpp.
#include "oom/model/cuda_router_balance.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <numeric>
#include <string>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/router.hpp"
#include "cuda_layer_util.hpp"

namespace oom::model {
namespace {

kernels::RouterShape shape(std::int64_t experts, std::int64_t top_k, std::int64_t tokens) {
  return {.tokens = tokens, .hidden = 1, .experts = experts, .top_k = top_k};
}

[[noreturn]] void invalid(const std::string& what) { throw Error(Errc::invalid_argument, "router balance loss (GPU): " + what); }

/// The device buffer's parts, carved from `base` (null: only counted, for device_bytes).
struct Parts {
  double* sums;
  std::int32_t* counts;
  void* scratch;
  std::size_t scratch_bytes;
  std::size_t bytes;
};

Parts carve(void* base, std::int64_t experts, std::int64_t tokens) {
  detail::Carver c(base);
  Parts p{};
  p.sums = c.take<double>(experts);
  p.counts = c.take<std::int32_t>(experts);
  p.scratch_bytes = kernels::router_probability_sums_workspace_bytes(shape(experts, 1, tokens));
  p.scratch = c.take_bytes(p.scratch_bytes);
  p.bytes = c.size();
  return p;
}

}  // namespace

std::size_t CudaRouterBalance::device_bytes(std::int64_t experts, std::int64_t tokens) {
  return carve(nullptr, std::max<std::int64_t>(experts, 0), tokens).bytes;
}

CudaRouterBalance::CudaRouterBalance(int layers, std::int64_t experts, std::int64_t top_k, std::int64_t tokens, double coefficient,
                                     double scale, void* device, std::size_t bytes)
    : layers_(layers), experts_(experts), top_k_(top_k), tokens_(tokens), coefficient_(coefficient), scale_(scale) {
  if (layers < 1 || experts < 1 || experts > kernels::router_max_experts || top_k < 1 || top_k > experts ||
      top_k > kernels::router_max_top_k || tokens < 1 || !(coefficient >= 0) || !(scale > 0))
    invalid(fmt::format("{} layers of {} experts, top {}, {} tokens, coefficient {}, scale {}: needs at least one layer and token, "
                        "1 to {} experts, 1 <= top_k <= min(experts, {}), a coefficient >= 0 and a scale > 0",
                        layers, experts, top_k, tokens, coefficient, scale, kernels::router_max_experts, kernels::router_max_top_k));
  if (static_cast<double>(layers) * static_cast<double>(tokens) * static_cast<double>(top_k) > static_cast<double>(INT_MAX))
    invalid(fmt::format("{} layers x {} tokens x top {} slots could pass the int32 counts of router_backward (at most 2^31 - 1)", layers,
                        tokens, top_k));
  const std::size_t need = device_bytes(experts, tokens);
  if (device == nullptr || bytes < need)
    invalid(fmt::format("device buffer {} of {} bytes; needs {} (CudaRouterBalance::device_bytes)", device ? "given" : "null", bytes, need));
  const Parts p = carve(device, experts, tokens);
  sums_ = p.sums;
  device_counts_ = p.counts;
  scratch_ = p.scratch;
  scratch_bytes_ = p.scratch_bytes;
  counts_.assign(static_cast<std::size_t>(experts), 0);
}

void CudaRouterBalance::begin(cudaStream_t stream) {
  OOM_CUDA_CHECK(cudaMemsetAsync(sums_, 0, static_cast<std::size_t>(experts_) * sizeof(double), stream));
  std::fill(counts_.begin(), counts_.end(), 0);
  layers_added_ = 0;
  phase_ = Phase::forward;
}

void CudaRouterBalance::add_probabilities(cudaStream_t stream, const float* probs, std::int64_t tokens) {
  if (phase_ != Phase::forward) invalid("a layer's router added outside a forward (begin() first)");
  if (layers_added_ == layers_) invalid(fmt::format("a router added past the {} layers of the forward", layers_));
  if (tokens != tokens_) invalid(fmt::format("a layer's router over {} tokens; the loss was built for {}", tokens, tokens_));
  OOM_CUDA_CHECK(kernels::router_probability_sums(stream, shape(experts_, top_k_, tokens), probs, sums_, scratch_, scratch_bytes_));
  ++layers_added_;
}

void CudaRouterBalance::add_counts(std::span<const std::int32_t> counts) {
  if (phase_ != Phase::forward) invalid("expert counts added outside a forward (begin() first)");
  if (counts.size() != counts_.size()) invalid(fmt::format("{} expert counts for {} experts", counts.size(), counts_.size()));
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] < 0) invalid(fmt::format("expert {} counted {} slots", e, counts[e]));
    counts_[e] += counts[e];
  }
}

void CudaRouterBalance::finish(cudaStream_t stream, double* loss) {
  if (phase_ != Phase::forward) invalid("finish() outside a forward (begin() first)");
  const std::int64_t slots = std::accumulate(counts_.begin(), counts_.end(), std::int64_t{0});
  if (layers_added_ != layers_ || slots != static_cast<std::int64_t>(layers_) * tokens_ * top_k_)
    invalid(fmt::format("finish() after {} of {} layers' routers and {} of {} slots counted", layers_added_, layers_, slots,
                        static_cast<std::int64_t>(layers_) * tokens_ * top_k_));
  // A pinned source, so that the copy is queued without the host waiting for the stream (from
  // pageable memory it may); refilled only by the next finish(), which comes after the next
  // forward's count read-backs, and those wait for this stream, so for this copy.
  if (!upload_) {
    std::int32_t* p = nullptr;
    OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), static_cast<std::size_t>(experts_) * sizeof(std::int32_t), cudaHostAllocDefault));
    upload_.reset(p);
  }
  std::transform(counts_.begin(), counts_.end(), upload_.get(), [](std::int64_t c) { return static_cast<std::int32_t>(c); });
  OOM_CUDA_CHECK(cudaMemcpyAsync(device_counts_, upload_.get(), static_cast<std::size_t>(experts_) * sizeof(std::int32_t),
                                 cudaMemcpyHostToDevice, stream));
  const double rows = static_cast<double>(layers_) * static_cast<double>(tokens_);
  OOM_CUDA_CHECK(kernels::router_balance_loss(stream, experts_, device_counts_, sums_, rows, coefficient_ * scale_, loss));
  phase_ = Phase::finished;
}

void CudaRouterBalance::FreePinned::operator()(std::int32_t* p) const noexcept { cudaFreeHost(p); }

const std::int32_t* CudaRouterBalance::device_counts() const {
  if (phase_ != Phase::finished) invalid("the backward's global counts asked before finish()");
  return device_counts_;
}

float CudaRouterBalance::aux_loss_grad() const {
  return static_cast<float>(coefficient_ * scale_ / (static_cast<double>(layers_) * static_cast<double>(layers_)));
}

}  // namespace oom::model
