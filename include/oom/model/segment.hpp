// State segments: the unit of model state OOM places, streams and updates. A segment is one
// contiguous host block (one DMA burst): a layer's attention weights, one expert's three matrices,
// a router, the embedding... Each expert is its own segment so residency can be chosen per expert.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"

namespace oom {

enum class SegmentRole : unsigned char {
  embedding,           ///< token embedding table
  attention,           ///< full (softmax) attention projections, incl. q/k norms
  linear_attention,    ///< linear-attention (e.g. Gated DeltaNet) projections and parameters
  norm,                ///< layer norms outside attention (input / post-attention RMSNorm)
  router,              ///< MoE gate (hidden -> experts)
  expert,              ///< one routed expert's MLP
  shared_expert,       ///< an always-active expert (with its sigmoid gate)
  dense_mlp,           ///< a dense MLP in a non-MoE layer
  final_norm,          ///< the norm before the LM head
  lm_head,             ///< output projection (absent when tied to the embedding)
};

const char* to_string(SegmentRole r) noexcept;

/// One named tensor inside a segment, laid out back to back in declaration order.
struct TensorSpec {
  std::string name;                  ///< Hugging Face parameter name, e.g. "model.layers.0.mlp.gate.weight"
  std::vector<std::uint64_t> shape;  ///< row-major, as in the checkpoint
  /// Some checkpoints pack all experts of a layer into one tensor (Qwen3.5-MoE:
  /// `mlp.experts.gate_up_proj` of shape [experts, 2*inter, hidden]). Each expert is still its own
  /// segment, so its tensor is then slice `stacked_index` (along dim 0) of the checkpoint tensor
  /// `name`, whose full shape is [stacked_count, shape...]. -1 when the tensor is stored on its own.
  std::int64_t stacked_index = -1;
  std::uint64_t stacked_count = 0;

  [[nodiscard]] std::uint64_t elements() const {
    std::uint64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

struct StateSegment {
  std::string name;  ///< "layers.3.experts.17", "embedding", ...
  SegmentRole role = SegmentRole::attention;
  int layer = -1;    ///< decoder layer index; -1 for embedding, final norm and LM head
  int expert = -1;   ///< expert index for SegmentRole::expert; -1 otherwise
  std::vector<TensorSpec> tensors;

  [[nodiscard]] std::uint64_t parameters() const {
    std::uint64_t n = 0;
    for (const auto& t : tensors) n += t.elements();
    return n;
  }
  friend bool operator==(const StateSegment&, const StateSegment&) = default;
};

/// Precision of each copy of the state. The defaults are mixed-precision AdamW as PyTorch AMP
/// trains: bf16 working weights, fp32 master, fp32 moments, fp32 gradient accumulator.
struct StatePrecision {
  DType weights = DType::bf16;  ///< what the forward/backward reads (streamed to the GPU)
  DType master = DType::fp32;   ///< what the optimizer updates
  DType moments = DType::fp32;  ///< AdamW m and v (each)
  DType grads = DType::fp32;    ///< gradient accumulator across micro-batches

  friend bool operator==(const StatePrecision&, const StatePrecision&) = default;
};

/// The precisions this library's executors (LayerExecutor, CudaCausalLm and the example trainer's
/// HostCausalLm) keep: bf16 working weights, fp32 master and gradients, and AdamW moments in fp32
/// or bf16 (halving their bytes: 18 -> 14 bytes a parameter with the gradient). Errc::unsupported
/// naming `who` and the first field that differs; a plan counted at other precisions would run
/// with other bytes than it counted.
void require_kept_precision(const StatePrecision& p, std::string_view who);

/// Bytes of each copy of one segment's state.
struct SegmentBytes {
  Bytes weights;
  Bytes master;
  Bytes moments;  ///< m and v together
  Bytes grads;

  [[nodiscard]] constexpr Bytes total() const { return weights + master + moments + grads; }
};

inline SegmentBytes segment_bytes(std::uint64_t parameters, const StatePrecision& p) {
  return {bytes_of(p.weights, parameters), bytes_of(p.master, parameters), 2 * bytes_of(p.moments, parameters),
          bytes_of(p.grads, parameters)};
}
inline SegmentBytes segment_bytes(const StateSegment& s, const StatePrecision& p) {
  return segment_bytes(s.parameters(), p);
}

}  // namespace oom
