// The AdamW state of one state segment: owned (what an executor exports and a checkpoint read
// returns) or viewed where it lives (what a checkpoint write reads, without a copy of the model).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"

namespace oom {

/// fp32 master weights and both AdamW moments of one segment, each `parameters()` long; the
/// segment's tensors lie back to back in its TensorSpec order.
struct SegmentOptimizerState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

/// AdamW moments as an executor keeps them (StatePrecision::moments: fp32, or bf16 to halve their
/// bytes) and as the state above speaks them (fp32). Widening is exact; narrowing to bf16 rounds
/// to nearest even, so state that came from bf16 moments goes back bit for bit.
inline void moments_to_fp32(DType kept, const void* from, std::span<float> out) {
  OOM_ASSERT(kept == DType::fp32 || kept == DType::bf16);
  if (kept == DType::bf16) {
    const auto* m = static_cast<const bf16*>(from);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(m[i]);
  } else {
    const auto* m = static_cast<const float*>(from);
    std::copy(m, m + out.size(), out.begin());
  }
}
inline void moments_from_fp32(DType kept, std::span<const float> in, void* to) {
  OOM_ASSERT(kept == DType::fp32 || kept == DType::bf16);
  if (kept == DType::bf16) {
    auto* m = static_cast<bf16*>(to);
    for (std::size_t i = 0; i < in.size(); ++i) m[i] = to_bf16(in[i]);
  } else {
    std::copy(in.begin(), in.end(), static_cast<float*>(to));
  }
}

/// One of the three arrays of a segment's state.
enum class StateArray : unsigned char { master, exp_avg, exp_avg_sq };

/// The same three arrays of one segment, read-only, wherever they live: in host memory (the spans,
/// e.g. an executor's pinned host state), or elsewhere (e.g. resident on a GPU), read a range at a
/// time by `read`, so that whoever reads all of a model's state (a checkpoint write) never holds a
/// copy of all of it.
struct SegmentStateView {
  /// Copies out.size() values of one array, from `offset` on, into `out`.
  using RangeReader = std::function<void(StateArray array, std::size_t offset, std::span<float> out)>;

  std::span<const float> master, exp_avg, exp_avg_sq;  ///< empty where `read` is set
  RangeReader read;                                     ///< set for state not in host memory
  std::size_t read_parameters = 0;                      ///< each array's length where `read` is set

  SegmentStateView() = default;
  SegmentStateView(std::span<const float> w, std::span<const float> m, std::span<const float> v)
      : master(w), exp_avg(m), exp_avg_sq(v) {}
  /// Views an owned state (which must outlive the view).
  explicit SegmentStateView(const SegmentOptimizerState& s) : master(s.master), exp_avg(s.exp_avg), exp_avg_sq(s.exp_avg_sq) {}
  /// State of `parameters` values per array that `reader` copies out a range at a time.
  SegmentStateView(std::size_t parameters, RangeReader reader) : read(std::move(reader)), read_parameters(parameters) {}

  [[nodiscard]] std::span<const float> host(StateArray a) const {
    return a == StateArray::master ? master : a == StateArray::exp_avg ? exp_avg : exp_avg_sq;
  }
  [[nodiscard]] std::size_t size(StateArray a) const { return read ? read_parameters : host(a).size(); }
  /// out.size() values of `a` from `offset` on, from wherever they live; a range past the end is
  /// Errc::invalid_argument, before any reader is asked.
  void copy(StateArray a, std::size_t offset, std::span<float> out) const {
    const std::size_t n = size(a);
    if (offset > n || out.size() > n - offset)
      OOM_THROW(Errc::invalid_argument, "state read: values " + std::to_string(offset) + ".." + std::to_string(offset + out.size()) +
                                            " of a segment of " + std::to_string(n));
    if (read) {
      read(a, offset, out);
    } else {
      const auto from = host(a).subspan(offset, out.size());
      std::copy(from.begin(), from.end(), out.begin());
    }
  }
};

/// Every segment's state as views, in spec.segments() order, plus whatever had to be copied to be
/// viewed. The views stay valid while this object lives and the model it came from takes no step
/// and loads nothing.
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
