// CPU reference of the MoE router; see oom/reference/router.hpp.
#include "oom/reference/router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "oom/core/error.hpp"

namespace oom::reference {
namespace {

void check_shape(const RouterShape& s) {
  if (s.tokens < 0 || s.hidden < 1 || s.experts < 1 || s.top_k < 1 || s.top_k > s.experts)
    OOM_THROW(Errc::invalid_argument, "router reference: need T >= 0, H >= 1, 1 <= k <= E");
}

void check_size(std::size_t got, std::int64_t want, const char* what) {
  if (got != static_cast<std::size_t>(want))
    OOM_THROW(Errc::invalid_argument, std::string("router reference: ") + what + " has " + std::to_string(got) +
                                          " elements, expected " + std::to_string(want));
}

}  // namespace

RouterForward router_forward(const RouterShape& s, std::span<const float> x, std::span<const float> w_router) {
  check_shape(s);
  check_size(x.size(), s.tokens * s.hidden, "x");
  check_size(w_router.size(), s.experts * s.hidden, "w_router");
  std::vector<float> logits(static_cast<std::size_t>(s.tokens * s.experts));
  for (std::int64_t t = 0; t < s.tokens; ++t)
    for (std::int64_t e = 0; e < s.experts; ++e) {
      double acc = 0;
      for (std::int64_t h = 0; h < s.hidden; ++h)
        acc += static_cast<double>(x[t * s.hidden + h]) * static_cast<double>(w_router[e * s.hidden + h]);
      logits[t * s.experts + e] = static_cast<float>(acc);
    }
  return router_select(s, logits);
}

RouterForward router_select(const RouterShape& s, std::span<const float> logits) {
  check_shape(s);
  check_size(logits.size(), s.tokens * s.experts, "logits");
  const auto E = s.experts, k = s.top_k;
  RouterForward f;
  f.logits.assign(logits.begin(), logits.end());
  f.probs.resize(logits.size());
  f.expert_ids.resize(static_cast<std::size_t>(s.tokens * k));
  f.weights.resize(static_cast<std::size_t>(s.tokens * k));
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    const float* l = &logits[t * E];
    float* p = &f.probs[t * E];
    const float m = *std::max_element(l, l + E);
    double sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - m));
    for (std::int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(std::exp(static_cast<double>(l[e] - m)) / sum);
    std::iota(order.begin(), order.end(), 0);
    // Decreasing probability, the lower index first among equals (deterministic tie-break).
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return p[a] > p[b]; });
    double selected = 0;
    for (std::int64_t j = 0; j < k; ++j) selected += p[order[j]];
    for (std::int64_t j = 0; j < k; ++j) {
      f.expert_ids[t * k + j] = order[j];
      f.weights[t * k + j] = s.norm_topk_prob ? static_cast<float>(p[order[j]] / selected) : p[order[j]];
    }
  }
  return f;
}

std::vector<std::int32_t> expert_counts(std::int64_t experts, std::span<const std::int32_t> expert_ids) {
  std::vector<std::int32_t> counts(static_cast<std::size_t>(experts), 0);
  for (const auto e : expert_ids) {
    if (e < 0 || e >= experts) OOM_THROW(Errc::invalid_argument, "expert_counts: expert id " + std::to_string(e) + " out of range");
    ++counts[static_cast<std::size_t>(e)];
  }
  return counts;
}

double router_aux_loss(const RouterShape& s, std::span<const float> probs, std::span<const std::int32_t> counts) {
  check_shape(s);
  check_size(probs.size(), s.tokens * s.experts, "probs");
  check_size(counts.size(), s.experts, "counts");
  if (s.tokens == 0) return 0.0;
  const double T = static_cast<double>(s.tokens);
  double loss = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    double p_sum = 0;
    for (std::int64_t t = 0; t < s.tokens; ++t) p_sum += probs[t * s.experts + e];
    loss += (counts[e] / T) * (p_sum / T);
  }
  return static_cast<double>(s.experts) * loss;
}

std::vector<float> router_logits_backward(const RouterShape& s, std::span<const float> probs,
                                          std::span<const std::int32_t> expert_ids, std::span<const float> d_weights,
                                          std::span<const std::int32_t> counts, float aux_loss_grad) {
  check_shape(s);
  check_size(counts.size(), s.experts, "counts");
  // d aux / d P_e = E * f_e / T... per token: d aux / d p[t, e] = E * counts[e] / T^2.
  const double T = static_cast<double>(std::max<std::int64_t>(s.tokens, 1));
  std::vector<double> d_probs(static_cast<std::size_t>(s.experts));
  for (std::int64_t e = 0; e < s.experts; ++e) d_probs[e] = aux_loss_grad * static_cast<double>(s.experts) * counts[e] / (T * T);
  return router_logits_backward(s, probs, expert_ids, d_weights, d_probs);
}

std::vector<float> router_logits_backward(const RouterShape& s, std::span<const float> probs,
                                          std::span<const std::int32_t> expert_ids, std::span<const float> d_weights,
                                          std::span<const double> d_probs) {
  check_shape(s);
  const auto E = s.experts, k = s.top_k;
  check_size(probs.size(), s.tokens * E, "probs");
  check_size(expert_ids.size(), s.tokens * k, "expert_ids");
  check_size(d_weights.size(), s.tokens * k, "d_weights");
  check_size(d_probs.size(), E, "d_probs");
  std::vector<float> d_logits(probs.size());
  std::vector<double> dp(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    const float* p = &probs[t * E];
    for (std::int64_t e = 0; e < E; ++e) dp[e] = d_probs[e];
    if (s.norm_topk_prob) {
      // w_i = p_i / S with S = sum of the selected p: dp_i = (dw_i - sum_j dw_j w_j) / S.
      double S = 0;
      for (std::int64_t j = 0; j < k; ++j) S += p[expert_ids[t * k + j]];
      double dot = 0;
      for (std::int64_t j = 0; j < k; ++j) dot += static_cast<double>(d_weights[t * k + j]) * (p[expert_ids[t * k + j]] / S);
      for (std::int64_t j = 0; j < k; ++j) dp[expert_ids[t * k + j]] += (d_weights[t * k + j] - dot) / S;
    } else {
      for (std::int64_t j = 0; j < k; ++j) dp[expert_ids[t * k + j]] += d_weights[t * k + j];
    }
    // Softmax: dl_e = p_e (dp_e - sum_f p_f dp_f).
    double pdp = 0;
    for (std::int64_t e = 0; e < E; ++e) pdp += p[e] * dp[e];
    for (std::int64_t e = 0; e < E; ++e) d_logits[t * E + e] = static_cast<float>(p[e] * (dp[e] - pdp));
  }
  return d_logits;
}

RouterGrads router_backward(const RouterShape& s, std::span<const float> x, std::span<const float> w_router,
                            const RouterForward& fwd, std::span<const float> d_weights, float aux_loss_grad) {
  const auto counts = expert_counts(s.experts, fwd.expert_ids);
  RouterGrads g;
  g.d_logits = router_logits_backward(s, fwd.probs, fwd.expert_ids, d_weights, counts, aux_loss_grad);
  const auto T = s.tokens, H = s.hidden, E = s.experts;
  g.dx.assign(static_cast<std::size_t>(T * H), 0.0f);
  g.dw_router.assign(static_cast<std::size_t>(E * H), 0.0f);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (std::int64_t e = 0; e < E; ++e) acc += static_cast<double>(g.d_logits[t * E + e]) * w_router[e * H + h];
      g.dx[t * H + h] = static_cast<float>(acc);
    }
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (std::int64_t t = 0; t < T; ++t) acc += static_cast<double>(g.d_logits[t * E + e]) * x[t * H + h];
      g.dw_router[e * H + h] = static_cast<float>(acc);
    }
  return g;
}

}  // namespace oom::reference
