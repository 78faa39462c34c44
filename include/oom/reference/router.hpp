// CPU reference of the MoE router (Qwen3-MoE): logits = x Wr^T, softmax over experts, top-k with
// the lower expert index winning ties, optional renormalisation of the k weights, the
// load-balancing auxiliary loss of transformers' `load_balancing_loss_func` for one layer, and the
// backward of all of it. fp32 values, fp64 accumulation; the GPU kernels are checked against this.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

struct RouterShape {
  std::int64_t tokens = 0;   ///< T
  std::int64_t hidden = 0;   ///< H
  std::int64_t experts = 0;  ///< E
  std::int64_t top_k = 0;    ///< k <= E
  bool norm_topk_prob = true;  ///< Qwen3: the k weights are renormalised to sum to 1
};

struct RouterForward {
  std::vector<float> logits;            // (T, E) fp32
  std::vector<float> probs;             // (T, E) fp32, softmax of logits (saved for backward)
  std::vector<std::int32_t> expert_ids; // (T, k) in order of decreasing probability
  std::vector<float> weights;           // (T, k) fp32
};

/// logits = x Wr^T (fp64 accumulation); then router_select.
RouterForward router_forward(const RouterShape& s, std::span<const float> x,  // (T, H)
                             std::span<const float> w_router);                // (E, H)

/// Softmax, top-k and renormalisation from given logits (T, E) (fills all but `logits`).
RouterForward router_select(const RouterShape& s, std::span<const float> logits);

/// Slots routed to each expert: counts[e] = #{(t, j) : ids[t, j] == e}.
std::vector<std::int32_t> expert_counts(std::int64_t experts, std::span<const std::int32_t> expert_ids);

/// transformers' load_balancing_loss_func for one layer without attention mask:
///   E * sum_e f_e * P_e,  f_e = counts[e] / T (fraction of tokens sending a slot to e, so
///   sum_e f_e = k), P_e = mean_t probs[t, e]. Uniform routing gives k.
double router_aux_loss(const RouterShape& s, std::span<const float> probs,  // (T, E)
                       std::span<const std::int32_t> counts);                 // (E)

/// d logits (T, E) from d weights (T, k) through the renormalisation and softmax, plus
/// aux_loss_grad * d aux / d logits (f_e is piecewise constant: only P_e carries gradient).
std::vector<float> router_logits_backward(const RouterShape& s, std::span<const float> probs,  // (T, E)
                                          std::span<const std::int32_t> expert_ids,             // (T, k)
                                          std::span<const float> d_weights,                     // (T, k)
                                          std::span<const std::int32_t> counts,                 // (E)
                                          float aux_loss_grad);

/// As above with a loss on the probabilities that gives every token the same d loss / d p[t, e] =
/// d_probs[e] (E values; a load-balancing loss over several layers: RouterBalanceLoss).
std::vector<float> router_logits_backward(const RouterShape& s, std::span<const float> probs,  // (T, E)
                                          std::span<const std::int32_t> expert_ids,             // (T, k)
                                          std::span<const float> d_weights,                     // (T, k)
                                          std::span<const double> d_probs);                     // (E)

struct RouterGrads {
  std::vector<float> d_logits;  // (T, E)
  std::vector<float> dx;        // (T, H)
  std::vector<float> dw_router; // (E, H)
};

RouterGrads router_backward(const RouterShape& s, std::span<const float> x, std::span<const float> w_router,
                            const RouterForward& fwd, std::span<const float> d_weights, float aux_loss_grad);

}  // namespace oom::reference
