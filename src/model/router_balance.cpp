#include "oom/model/router_balance.hpp"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom {

RouterBalanceLoss::RouterBalanceLoss(int layers, std::uint64_t experts, std::uint64_t top_k, double coefficient, double scale)
    : layers_(layers), experts_(experts), top_k_(top_k), coefficient_(coefficient), scale_(scale),
      layer_rows_(static_cast<std::size_t>(std::max(layers, 0)), 0), counts_(experts, 0), probs_(experts, 0.0),
      gradient_(experts, 0.0) {
  if (layers < 1 || experts < 1 || top_k < 1 || top_k > experts || !(coefficient >= 0) || !(scale > 0))
    OOM_THROW(Errc::invalid_argument, fmt::format("router balance loss over {} layers of {} experts, top {}, coefficient {}, scale {}: "
                                                  "needs at least one layer and expert, 1 <= top_k <= experts, a coefficient >= 0 "
                                                  "and a scale > 0",
                                                  layers, experts, top_k, coefficient, scale));
}

void RouterBalanceLoss::add(int layer, std::uint64_t begin, std::span<const float> probs, std::span<const std::int32_t> expert_ids) {
  if (layer < 0 || layer >= layers_)
    OOM_THROW(Errc::invalid_argument, fmt::format("router balance loss: layer {} of {}", layer, layers_));
  if (probs.size() % experts_ != 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("router balance loss: {} probabilities are no whole rows of {} experts", probs.size(),
                                                  experts_));
  const std::uint64_t n = probs.size() / experts_;
  if (expert_ids.size() != n * top_k_)
    OOM_THROW(Errc::invalid_argument, fmt::format("router balance loss: {} expert ids for {} rows of top {}", expert_ids.size(), n, top_k_));
  for (const std::int32_t e : expert_ids)
    if (e < 0 || static_cast<std::uint64_t>(e) >= experts_)
      OOM_THROW(Errc::invalid_argument, fmt::format("router balance loss: expert id {} of {} experts", e, experts_));
  if (begin == 0 && layer <= last_layer_) {  // the next forward
    std::fill(counts_.begin(), counts_.end(), 0);
    std::fill(probs_.begin(), probs_.end(), 0.0);
    std::fill(layer_rows_.begin(), layer_rows_.end(), 0);
  }
  last_layer_ = layer;
  for (std::uint64_t t = 0; t < n; ++t)
    for (std::uint64_t e = 0; e < experts_; ++e) probs_[e] += probs[t * experts_ + e];
  for (const std::int32_t e : expert_ids) ++counts_[static_cast<std::size_t>(e)];
  layer_rows_[static_cast<std::size_t>(layer)] += n;
  gradient_stale_ = true;
}

std::uint64_t RouterBalanceLoss::rows() const { return std::accumulate(layer_rows_.begin(), layer_rows_.end(), std::uint64_t{0}); }

void RouterBalanceLoss::check_complete(const char* what) const {
  for (int l = 0; l < layers_; ++l)
    if (layer_rows_[static_cast<std::size_t>(l)] == 0 || layer_rows_[static_cast<std::size_t>(l)] != layer_rows_[0])
      OOM_THROW(Errc::invalid_argument,
                fmt::format("router balance loss: {} before every layer's forward added its rows (layer {} holds {} rows, layer 0 {})",
                            what, l, layer_rows_[static_cast<std::size_t>(l)], layer_rows_[0]));
}

double RouterBalanceLoss::loss() const {
  check_complete("the loss asked");
  const double n = static_cast<double>(rows());
  double sum = 0;
  for (std::uint64_t e = 0; e < experts_; ++e) sum += (static_cast<double>(counts_[e]) / n) * (probs_[e] / n);
  return coefficient_ * scale_ * static_cast<double>(experts_) * sum;
}

std::span<const double> RouterBalanceLoss::probability_gradient() const {
  if (gradient_stale_) {
    check_complete("the gradient asked");
    const double n = static_cast<double>(rows());
    for (std::uint64_t e = 0; e < experts_; ++e)
      gradient_[e] = coefficient_ * scale_ * static_cast<double>(experts_) * static_cast<double>(counts_[e]) / (n * n);
    gradient_stale_ = false;
  }
  return gradient_;
}

}  // namespace oom
