// RouterBalanceLoss: transformers' load-balancing loss (load_balancing_loss_func, added to the loss
// as router_aux_loss_coef x it when a config sets output_router_logits) over every MoE layer of one
// forward, for HostDecoderLayer. Over the N = L x T rows of L layers' T tokens,
//
//   aux = E * sum_e (C_e / N) (P_e / N),  C_e: the top-k slots routed to expert e,
//                                         P_e: the router probabilities of e summed,
//
// so d aux / d p[l, t, e] = E C_e / N^2 for every layer and token (C is piecewise constant: no
// gradient flows through the choice). The layers add their rows as their forwards run (in layer,
// then token order: the same sums whatever the chunking), and their backwards read that gradient
// once every forward of the micro-batch has added (loss() and probability_gradient() refuse sums
// in which the layers hold different row counts); a layer's first rows of a new forward (a layer
// no later than the last to add, from token 0) begin the next micro-batch's sums. Not thread-safe:
// the HostExecutor calls every layer, and the loss, from its one compute stream.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom {

class RouterBalanceLoss {
 public:
  /// `layers` MoE layers of `experts` experts, `top_k` a token; the loss enters the step as
  /// coefficient x scale x aux (scale: the micro-batch's share of the step's mean, 1/K).
  RouterBalanceLoss(int layers, std::uint64_t experts, std::uint64_t top_k, double coefficient, double scale = 1.0);

  /// Layer `layer`'s router over tokens [begin, begin + n): probabilities (n, E), expert ids (n, k).
  /// Checked whole before anything is added.
  void add(int layer, std::uint64_t begin, std::span<const float> probs, std::span<const std::int32_t> expert_ids);
  /// coefficient x scale x aux of the forward so far (every layer's rows once they have all added).
  [[nodiscard]] double loss() const;
  /// d (coefficient x scale x aux) / d p[l, t, e], per expert e (the same for every row).
  [[nodiscard]] std::span<const double> probability_gradient() const;
  /// Rows added in this forward, over every layer.
  [[nodiscard]] std::uint64_t rows() const;

 private:
  void check_complete(const char* what) const;

  int layers_;
  std::uint64_t experts_, top_k_;
  double coefficient_, scale_;
  int last_layer_ = -1;
  std::vector<std::uint64_t> layer_rows_;  // rows each layer added in this forward
  std::vector<std::uint64_t> counts_;  // C_e
  std::vector<double> probs_;          // P_e, summed row by row in order
  mutable std::vector<double> gradient_;
  mutable bool gradient_stale_ = true;
};

}  // namespace oom
