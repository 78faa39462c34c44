// residency_policy: decides, for every state segment, whether its state lives (and is updated) on
// a GPU or on the host, from where it is streamed each step.
#pragma once

#include <compare>
#include <concepts>
#include <string_view>

#include "oom/model/segment.hpp"

namespace oom {

/// Where a segment's weights, master copy, moments and gradients live, and so where its optimizer
/// step runs: on the host (CPU AdamW; weights streamed every step) or resident on `device`
/// (GPU AdamW; never streamed).
struct Placement {
  enum class Where : unsigned char { host, device };
  Where where = Where::host;
  int device = -1;

  static constexpr Placement host() { return {Where::host, -1}; }
  static constexpr Placement on_device(int d) { return {Where::device, d}; }
  [[nodiscard]] constexpr bool resident() const { return where == Where::device; }
  constexpr auto operator<=>(const Placement&) const = default;
};

/// Requirements, for `const P& p` and `const StateSegment& s`:
///   1. `p.place(s)` returns a Placement; the same segment always gets the same answer (a plan
///      is computed once and replayed every step);
///   2. `p.name()` converts to std::string_view, for plans, logs and traces;
///   3. for the expert-parallel path, an expert's placement names its owning GPU.
///
/// **Customization**
/// @code
///   struct FirstLayersResident {  // keep layers [0, n) on GPU 0: the next forward waits on them first
///     int n;
///     oom::Placement place(const oom::StateSegment& s) const {
///       return s.layer >= 0 && s.layer < n ? oom::Placement::on_device(0) : oom::Placement::host();
///     }
///     std::string_view name() const { return "first-layers-resident"; }
///   };
/// @endcode
/// @see tests/concepts/test_policies.cpp
template <class P>
concept residency_policy = requires(const P& p, const StateSegment& s) {
  { p.place(s) } -> std::same_as<Placement>;
  { p.name() } -> std::convertible_to<std::string_view>;
};

}  // namespace oom
