// CudaRouterBalance: transformers' load-balancing loss (router_aux_loss_coef x
// load_balancing_loss_func, in the training loss when a config sets output_router_logits) over
// the MoE layers of one micro-batch's forward, on the GPU; the same loss as RouterBalanceLoss
// (oom/model/router_balance.hpp, the host layer's). Over the N = L x T rows of L layers' T tokens,
//
//   aux = E * sum_e (C_e / N) (P_e / N),   d aux / d p[l, t, e] = E C_e / N^2 for every row,
//
// C_e the top-k slots routed to expert e, P_e its router probabilities summed. One micro-batch:
//   begin(stream)              before its first layer's forward: C and P zeroed;
//   each layer's forward       (decoder_layer_forward with DecoderLayerContext::balance, not a
//                              recompute) adds its T rows: P on the device
//                              (kernels::router_probability_sums, fp64, a fixed order), C on the
//                              host from the counts the layer reads back for its expert GEMMs
//                              (integers: exact in any order);
//   finish(stream, loss)       after the last layer's forward: C goes up to the device (int32)
//                              and coefficient x scale x aux is written to `loss` (a device
//                              double, kernels::router_balance_loss);
//   each layer's backward      kernels::router_backward as it is, with the global C for the
//                              layer's counts and aux_loss_grad() = coefficient x scale / L^2: its
//                              E counts[e] / T^2 becomes E C_e / N^2.
// The device buffer is the caller's (device_bytes); every launch goes on the stream given. The
// next micro-batch's forward must come after this one's backward on the same stream: its
// finish() overwrites the device C that the backward reads. Not thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace oom::model {

class CudaRouterBalance {
 public:
  /// Bytes of the device buffer for E experts and T tokens a layer: P (E fp64), C (E int32) and
  /// the probability sums' scratch.
  [[nodiscard]] static std::size_t device_bytes(std::int64_t experts, std::int64_t tokens);

  /// `layers` MoE layers of `experts` experts, `top_k` a token, `tokens` a layer's forward; the
  /// loss enters the step as coefficient x scale x aux (scale: the micro-batch's share of the
  /// step's mean, 1/K). Errc::invalid_argument for sizes out of range, counts that could pass
  /// int32 (L x T x k > 2^31 - 1), or a device buffer smaller than device_bytes.
  CudaRouterBalance(int layers, std::int64_t experts, std::int64_t top_k, std::int64_t tokens, double coefficient, double scale,
                    void* device, std::size_t device_bytes);

  /// A micro-batch's forward begins: C and P zeroed (P on `stream`).
  void begin(cudaStream_t stream);
  /// One layer's router over its T tokens (probs (T, E) fp32 on the device), added to P on `stream`.
  void add_probabilities(cudaStream_t stream, const float* probs, std::int64_t tokens);
  /// One MoE chunk's E per-expert slot counts (host), added to C.
  void add_counts(std::span<const std::int32_t> counts);
  /// After the last layer's forward: checks every layer added its T rows and T x k slots, puts C
  /// on the device and writes coefficient x scale x aux to `loss` (device), both on `stream`.
  void finish(cudaStream_t stream, double* loss);

  /// C on the device (int32, E), for the backward's router_backward; valid after finish().
  [[nodiscard]] const std::int32_t* device_counts() const;
  /// d (coefficient x scale x aux) / d aux, divided by L^2 (router_backward's aux_loss_grad).
  [[nodiscard]] float aux_loss_grad() const;
  [[nodiscard]] double coefficient() const { return coefficient_; }
  [[nodiscard]] std::int64_t tokens() const { return tokens_; }
  [[nodiscard]] std::int64_t experts() const { return experts_; }
  [[nodiscard]] std::int64_t top_k() const { return top_k_; }

 private:
  enum class Phase : unsigned char { idle, forward, finished };
  int layers_;
  std::int64_t experts_, top_k_, tokens_;
  double coefficient_, scale_;
  double* sums_ = nullptr;            // P (device)
  std::int32_t* device_counts_ = nullptr;  // C (device)
  void* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  Phase phase_ = Phase::idle;
  int layers_added_ = 0;
  std::vector<std::int64_t> counts_;       // C (host)
  struct FreePinned {
    void operator()(std::int32_t* p) const noexcept;
  };
  std::unique_ptr<std::int32_t[], FreePinned> upload_;  // C as int32, the H2D copy's pinned source (first finish())
};

}  // namespace oom::model
