// CPU reference of the LM head with cross-entropy; see oom/reference/lm_head_loss.hpp.
#include "oom/reference/lm_head_loss.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "oom/core/error.hpp"

namespace oom::reference {

LmHeadLossResult lm_head_loss(std::int64_t tokens, std::int64_t hidden, std::int64_t vocab, std::span<const float> x,
                              std::span<const float> w, std::span<const std::int32_t> targets, bool backward,
                              double grad_scale) {
  if (x.size() != static_cast<std::size_t>(tokens * hidden) || w.size() != static_cast<std::size_t>(vocab * hidden) ||
      targets.size() != static_cast<std::size_t>(tokens))
    OOM_THROW(Errc::invalid_argument, "lm_head_loss reference: x (T, H), w (V, H), targets (T) expected");
  LmHeadLossResult r;
  r.row_loss.assign(static_cast<std::size_t>(tokens), 0.0f);
  if (backward) {
    r.dx.assign(static_cast<std::size_t>(tokens * hidden), 0.0f);
    r.dw.assign(static_cast<std::size_t>(vocab * hidden), 0.0f);
  }
  std::vector<double> logits(static_cast<std::size_t>(vocab)), dlogits(static_cast<std::size_t>(vocab));
  std::vector<double> dw(backward ? static_cast<std::size_t>(vocab * hidden) : 0, 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const auto target = targets[t];
    if (target == ignore_index) continue;
    if (target < 0 || target >= vocab)
      OOM_THROW(Errc::invalid_argument, "lm_head_loss reference: target " + std::to_string(target) + " out of range");
    for (std::int64_t v = 0; v < vocab; ++v) {
      double acc = 0;
      for (std::int64_t h = 0; h < hidden; ++h) acc += static_cast<double>(x[t * hidden + h]) * w[v * hidden + h];
      logits[v] = acc;
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (const double l : logits) sum += std::exp(l - m);
    const double lse = m + std::log(sum);
    r.row_loss[t] = static_cast<float>(lse - logits[target]);
    r.loss_sum += lse - logits[target];
    ++r.valid_count;
    if (!backward) continue;
    for (std::int64_t v = 0; v < vocab; ++v) dlogits[v] = (std::exp(logits[v] - lse) - (v == target ? 1.0 : 0.0)) * grad_scale;
    for (std::int64_t h = 0; h < hidden; ++h) {
      double acc = 0;
      for (std::int64_t v = 0; v < vocab; ++v) acc += dlogits[v] * w[v * hidden + h];
      r.dx[t * hidden + h] = static_cast<float>(acc);
    }
    for (std::int64_t v = 0; v < vocab; ++v)
      for (std::int64_t h = 0; h < hidden; ++h) dw[v * hidden + h] += dlogits[v] * x[t * hidden + h];
  }
  if (backward) std::transform(dw.begin(), dw.end(), r.dw.begin(), [](double d) { return static_cast<float>(d); });
  return r;
}

}  // namespace oom::reference
