// The AdamW state of one state segment: owned (what an executor exports and a checkpoint read
// returns) or viewed where it lives (what a checkpoint write reads, without a copy of the model).
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <vector>

namespace oom {

/// fp32 master weights and both AdamW moments of one segment, each `parameters()` long; the
/// segment's tensors lie back to back in its TensorSpec order.
struct SegmentOptimizerState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

/// The same three arrays of one segment, read-only, wherever they live (e.g. an executor's pinned
/// host state).
struct SegmentStateView {
  std::span<const float> master, exp_avg, exp_avg_sq;

  SegmentStateView() = default;
  SegmentStateView(std::span<const float> w, std::span<const float> m, std::span<const float> v)
      : master(w), exp_avg(m), exp_avg_sq(v) {}
  /// Views an owned state (which must outlive the view).
  explicit SegmentStateView(const SegmentOptimizerState& s) : master(s.master), exp_avg(s.exp_avg), exp_avg_sq(s.exp_avg_sq) {}
};

/// Every segment's state as views, in spec.segments() order, plus whatever had to be copied to be
/// viewed (e.g. segments resident on a GPU). The views stay valid while this object lives and the
/// model it came from takes no step and loads nothing.
struct StateSnapshot {
  std::vector<SegmentStateView> views;
  std::vector<SegmentOptimizerState> owned;  ///< reserved up front: views into it never move
};

/// Fills one segment's state (by its index in spec.segments()) into the three spans, each the
/// segment's parameters() long: how a model loads state that is read piece by piece (a checkpoint
/// on disk) without a copy of all of it in memory first.
using SegmentStateSource =
    std::function<void(std::size_t segment, std::span<float> master, std::span<float> exp_avg, std::span<float> exp_avg_sq)>;

/// Fills one segment's fp32 weights (by its index in spec.segments()) into the span, the segment's
/// parameters() long: how a model is built from weights made or read piece by piece (a seeded
/// initialiser, a safetensors file) without all of them in memory beside the model's own state.
using SegmentWeightSource = std::function<void(std::size_t segment, std::span<float> weights)>;

}  // namespace oom
