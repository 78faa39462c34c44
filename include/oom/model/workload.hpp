// What a layer is asked to do in one step (the workload) and what that costs it (LayerCost): the
// description a layer gives the planner, by activation class, so retention can be chosen per class.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "oom/core/bytes.hpp"

namespace oom {

/// The most tokens a micro-batch may hold: 2^32, some 4,000 times the longest context any model
/// here trains at on one node, and small enough that every byte count the planner forms from it
/// (tokens x hidden x bytes x layers) stays far inside 64 bits.
inline constexpr std::uint64_t max_workload_tokens = std::uint64_t{1} << 32;

/// One micro-batch: `sequences` sequences of `seq_len` tokens each.
struct Workload {
  std::uint64_t sequences = 1;
  std::uint64_t seq_len = 0;

  [[nodiscard]] constexpr std::uint64_t tokens() const { return sequences * seq_len; }
  /// Whether sequences x seq_len is within max_workload_tokens (without overflowing on the way).
  [[nodiscard]] constexpr bool within_limit() const {
    return seq_len <= max_workload_tokens && (seq_len == 0 || sequences <= max_workload_tokens / seq_len);
  }
  friend constexpr bool operator==(const Workload&, const Workload&) = default;
};

/// Errc::invalid_argument, in words an executor's caller sees, for a micro-batch no executor runs:
/// no tokens (0 sequences or a seq_len of 0: every step's loss a mean over none), or more than
/// max_workload_tokens. The planner and Plan::from_json refuse these; a plan made by hand may not.
void refuse_unrunnable_micro_batch(const Workload& w);

/// Kinds of saved activations a retention policy decides about, one decision per class per layer.
enum class ActivationClass : unsigned char {
  layer_boundary,       ///< the layer's input (hidden states): the recompute boundary
  norm_output,          ///< normalised inputs feeding projections
  attention_output,     ///< attention context before the output projection
  softmax_stats,        ///< per-row log-sum-exp of flash attention (small, O(seq))
  linear_attention_state,  ///< chunk states of a linear-attention scan
  router_output,        ///< routing weights and chosen experts per token
  permuted_tokens,      ///< tokens gathered in expert order
  expert_intermediate,  ///< expert MLP activations (gate/up outputs)
  other,
};
inline constexpr int activation_class_count = 9;

/// The classes of the attention's own results, grouped as one by the planner and the executors
/// (linear_attention_state has no tensor in a full-attention layer, but recomputing it means
/// rerunning the attention).
constexpr bool is_attention_result(ActivationClass c) noexcept {
  return c == ActivationClass::attention_output || c == ActivationClass::softmax_stats ||
         c == ActivationClass::linear_attention_state;
}

const char* to_string(ActivationClass c) noexcept;

struct ActivationCost {
  ActivationClass cls = ActivationClass::other;
  Bytes bytes;                  ///< saved for the backward pass by one forward over the workload
  double recompute_flops = 0;   ///< to regenerate it from the layer's boundary
  friend bool operator==(const ActivationCost&, const ActivationCost&) = default;
};

struct LayerCost {
  double forward_flops = 0;
  double backward_flops = 0;
  std::vector<ActivationCost> activations;  ///< what backward needs, by class
  Bytes workset;                            ///< temporaries live while the layer runs unchunked
  Bytes output;                             ///< the boundary it hands to the next layer

  [[nodiscard]] Bytes activation_bytes() const {
    Bytes total;
    for (const auto& a : activations) total += a.bytes;
    return total;
  }
};

/// The bytes `cost` saves for the backward, by class (the entries of one class added): what the
/// planners count and a LayerExecutor holds. Errc::invalid_argument, opened by `where`, for a
/// layer_boundary entry: a layer's boundary is the previous layer's LayerCost::output (the first
/// layer's: its own), not one of its activations.
[[nodiscard]] std::array<Bytes, activation_class_count> saved_bytes_by_class(const LayerCost& cost, std::string_view where);

/// A layer's workset (LayerCost::workset, for `tokens` tokens) over one chunk of `chunk` of them:
/// its share, rounded up (the whole workset unchunked). What the planner holds while a chunked
/// layer runs, and what a LayerExecutor hands the layer (LayerContext::workspace).
[[nodiscard]] inline Bytes chunk_workset(Bytes workset, std::uint64_t tokens, std::uint64_t chunk) {
  if (chunk >= tokens || tokens == 0) return workset;
  // ceil(workset x chunk / tokens) = q x chunk + ceil(r x chunk / tokens), r x chunk < 2^64 x 2^64.
  __extension__ using wide = unsigned __int128;
  const std::uint64_t q = workset.count() / tokens, r = workset.count() % tokens;
  return Bytes{q * chunk + static_cast<std::uint64_t>((static_cast<wide>(r) * chunk + tokens - 1) / tokens)};
}

}  // namespace oom
