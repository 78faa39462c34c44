// CPU reference of the LM head with cross-entropy: logits = x W^T, loss_t = logsumexp - logit[target],
// targets equal to -100 ignored (as HF), and the backward dx = dlogits W, dW = dlogits^T x with
// dlogits = (softmax - onehot) * grad_scale. The GPU version never holds all (T, V) logits; this
// reference does (it is for small shapes).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

inline constexpr std::int32_t ignore_index = -100;

struct LmHeadLossResult {
  double loss_sum = 0;            ///< sum of the per-token losses over valid targets
  std::int64_t valid_count = 0;   ///< targets != -100
  std::vector<float> row_loss;    // (T) 0 for ignored rows
  std::vector<float> dx;          // (T, H) (empty unless asked for)
  std::vector<float> dw;          // (V, H) (empty unless asked for)
};

LmHeadLossResult lm_head_loss(std::int64_t tokens, std::int64_t hidden, std::int64_t vocab,
                              std::span<const float> x,                // (T, H)
                              std::span<const float> w,                // (V, H)
                              std::span<const std::int32_t> targets,   // (T) in [0, V) or -100
                              bool backward, double grad_scale);

}  // namespace oom::reference
