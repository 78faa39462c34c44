// retention_policy: for every activation class of every layer, keep it on the GPU, offload it to
// the host and prefetch it back before backward, or drop it and recompute it from a boundary.
#pragma once

#include <concepts>
#include <string_view>

#include "oom/model/workload.hpp"

namespace oom {

enum class Retention : unsigned char { keep, offload, recompute };

struct RetentionDecision {
  Retention action = Retention::keep;
  /// For Retention::recompute: the layer whose saved input (ActivationClass::layer_boundary) the
  /// recomputation starts from; layers [recompute_from, layer] are rerun forward. Ignored otherwise.
  int recompute_from = -1;

  static constexpr RetentionDecision keep() { return {Retention::keep, -1}; }
  static constexpr RetentionDecision offload() { return {Retention::offload, -1}; }
  static constexpr RetentionDecision recompute(int from_layer) { return {Retention::recompute, from_layer}; }
  friend constexpr bool operator==(const RetentionDecision&, const RetentionDecision&) = default;
};

/// Requirements, for `const P& p`, `int layer` and `ActivationClass c`:
///   1. `p.retain(layer, c)` returns a RetentionDecision, the same every step;
///   2. a recompute decision names a boundary `from <= layer` that exists when the rerun starts:
///      one kept or offloaded; or, for a layer's other classes recomputed from its own boundary
///      (`from == layer`), that boundary regenerated itself (its layer's backward gives it back
///      first). A regenerated boundary (`c == layer_boundary`) starts from a layer below it whose
///      own boundary is kept or offloaded;
///   3. `p.name()` converts to std::string_view.
/// Requirement 2 is a property of a whole plan; `valid_retention(p, layers)` checks it.
///
/// **Customization**
/// @code
///   struct CheckpointEveryLayer {  // keep boundaries, recompute everything else from them
///     oom::RetentionDecision retain(int layer, oom::ActivationClass c) const {
///       return c == oom::ActivationClass::layer_boundary ? oom::RetentionDecision::keep()
///                                                        : oom::RetentionDecision::recompute(layer);
///     }
///     std::string_view name() const { return "checkpoint-every-layer"; }
///   };
/// @endcode
/// @see tests/concepts/test_policies.cpp
template <class P>
concept retention_policy = requires(const P& p, int layer, ActivationClass c) {
  { p.retain(layer, c) } -> std::same_as<RetentionDecision>;
  { p.name() } -> std::convertible_to<std::string_view>;
};

/// Requirement 2 over layers [0, layers): every recompute starts at an existing boundary.
template <retention_policy P>
bool valid_retention(const P& p, int layers) {
  for (int layer = 0; layer < layers; ++layer) {
    for (int c = 0; c < activation_class_count; ++c) {
      const auto d = p.retain(layer, static_cast<ActivationClass>(c));
      if (d.action != Retention::recompute) continue;
      if (d.recompute_from < 0 || d.recompute_from > layer) return false;
      const bool boundary = c == static_cast<int>(ActivationClass::layer_boundary);
      if (boundary && d.recompute_from == layer) return false;  // a boundary cannot start its own rerun
      // Regenerated boundaries start from a kept or offloaded one; a layer's own classes may
      // start from its regenerated boundary, which its backward gives back before them.
      if (p.retain(d.recompute_from, ActivationClass::layer_boundary).action == Retention::recompute &&
          (boundary || d.recompute_from != layer))
        return false;
    }
  }
  return true;
}

}  // namespace oom
