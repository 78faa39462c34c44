// layer: what a user layer provides to be planned (describable_layer: LayerStackPlanner, through
// describe_layers) and run (layer, and executor_layer in runtime/layer_executor.hpp: the
// LayerExecutor). It declares its state segments and its cost for a workload (enough for the
// planner), and runs forward/backward over a context the executor hands it (bound parameter views,
// a stream, scratch). Everything else has defaults in layer_traits.
#pragma once

#include <concepts>
#include <ranges>
#include <string>
#include <string_view>
#include <type_traits>

#include "oom/model/segment.hpp"
#include "oom/model/workload.hpp"

namespace oom {

/// How a layer's work may be split into chunks (the partitioner's input; see partitioner.hpp).
enum class ChunkDependency : unsigned char {
  none,            ///< runs whole: not chunkable
  independent,     ///< chunks in any order (MoE experts per token chunk, loss rows)
  causal_prefix,   ///< chunk i needs all earlier chunks' keys (causal attention by query block)
  carried_state,   ///< chunk i needs chunk i-1's state (a linear-attention scan)
};

/// A layer the planner can reason about, without running it.
///
/// Requirements, for `const L& l` and `const Workload& w`:
///   1. `l.segments()` is a range whose elements convert to `const StateSegment&`: every byte of
///      state the layer owns, one segment per placeable unit (each expert separately);
///   2. `l.cost(w)` returns `LayerCost`: FLOPs, saved activations by class, workset and output
///      bytes for one forward over `w`.
///
/// **Customization**
/// @code
///   struct MyNorm {
///     std::vector<oom::StateSegment> segs;
///     const std::vector<oom::StateSegment>& segments() const { return segs; }
///     oom::LayerCost cost(const oom::Workload& w) const;  // 4·tokens·hidden FLOPs, ...
///   };
///   static_assert(oom::describable_layer<MyNorm>);
/// @endcode
/// @see layer, layer_traits, tests/concepts/test_layer.cpp
template <class L>
concept describable_layer = requires(const L& l, const Workload& w) {
  { l.segments() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_reference_t<decltype(l.segments())>, const StateSegment&>;
  { l.cost(w) } -> std::convertible_to<LayerCost>;
};

/// A layer the executor can run with contexts of type `Context` (the executor's per-layer
/// context: bound parameter views, stream, scratch, saved activations).
///
/// Requirements, in addition to describable_layer:
///   3. `l.forward(ctx)` for `Context& ctx`: reads inputs and bound weights from ctx, writes the
///      output and what backward needs (by ActivationClass) back into ctx;
///   4. `l.backward(ctx)`: reads the output gradient and saved activations, writes the input
///      gradient and the parameter gradients into ctx.
/// Both run on ctx's stream; a layer whose layer_traits say `uses_workspace` takes its temporaries
/// from ctx's scratch (counted in the budget where the plan counts them).
template <class L, class Context>
concept layer = describable_layer<L> && requires(L& l, Context& ctx) {
  l.forward(ctx);
  l.backward(ctx);
};

/// Defaults for the optional parts of a layer; a layer overrides one by providing the member.
///   - `name()`: shown in plans and traces, and how a recorded step's spans are told apart
///     (with_measured_rates), so one per layer of a stack, not per type ("blocks.3", not
///     "block"); default "layer" (describe_layers and the executors then say "layer N").
///   - `chunking()`: a ChunkDependency; default ChunkDependency::none (run whole).
///   - `static constexpr bool recomputable`: whether forward may be rerun to regenerate dropped
///     activations (it must be deterministic); default true.
///   - `static constexpr bool uses_workspace`: whether the executor hands it its declared workset
///     as scratch (LayerContext::workspace); default false.
template <describable_layer L>
struct layer_traits {
  /// A copy: a layer's name() may return a temporary std::string, which a view would outlive.
  static std::string name(const L& l) {
    if constexpr (requires { { l.name() } -> std::convertible_to<std::string_view>; })
      return std::string(std::string_view(l.name()));
    else
      return "layer";
  }
  static ChunkDependency chunking(const L& l) {
    if constexpr (requires { { l.chunking() } -> std::same_as<ChunkDependency>; })
      return l.chunking();
    else
      return ChunkDependency::none;
  }
  static constexpr bool recomputable = [] {
    if constexpr (requires { { L::recomputable } -> std::convertible_to<bool>; })
      return static_cast<bool>(L::recomputable);
    else
      return true;
  }();
  /// `static constexpr bool uses_workspace`: whether the executor hands the layer its declared
  /// workset as scratch (LayerContext::workspace), taken from the budget for each pass; default
  /// false (a layer that keeps temporaries of its own, or declares a workset only to be planned).
  static constexpr bool uses_workspace = [] {
    if constexpr (requires { { L::uses_workspace } -> std::convertible_to<bool>; })
      return static_cast<bool>(L::uses_workspace);
    else
      return false;
  }();
};

}  // namespace oom
