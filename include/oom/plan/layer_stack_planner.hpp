// LayerStackPlanner: plans the training step of a stack of the user's own layers — any
// describable_layer — from what each one declares (its state segments and its LayerCost), so a
// framework that plugs its layers in gets a Plan chosen against its GPU and host budgets instead
// of writing one by hand. The plan runs on the HostExecutor (and any executor of the same
// schedule): weights streamed through prefetch_depth slots or resident, each activation class
// kept, offloaded or recomputed, boundaries regenerated in groups through the layers below them,
// chunkable layers run in token chunks. docs/planner.md, "Planning your own layers", says what it
// models and what it does not.
#pragma once

#include <algorithm>
#include <functional>
#include <ranges>
#include <string>
#include <vector>

#include "oom/concepts/layer.hpp"
#include "oom/core/error.hpp"
#include "oom/plan/machine_profile.hpp"
#include "oom/plan/plan.hpp"
#include "oom/plan/planner.hpp"
#include "oom/plan/simulator.hpp"
#include "oom/runtime/timeline.hpp"

namespace oom {

/// A layer's measured compute rates, FLOPs a second of its declared forward_flops and
/// backward_flops (0: priced at the profile's GEMM rate for the chunk's rows).
struct MeasuredRates {
  double forward_flops_per_s = 0;
  double backward_flops_per_s = 0;
};

/// What the planner knows of one layer: its name, its state segments, and its cost for a
/// workload. `cost` is called with each request's workload (one micro-batch on one GPU).
///   - LayerCost::output is the boundary the layer hands on; a layer's input boundary (its
///     ActivationClass::layer_boundary, which the planner keeps, offloads or recomputes from) is
///     the previous layer's output, and the first layer's is taken to be as large as its own.
///     A layer does not declare its boundary among its activations.
///   - LayerCost::workset is live while the layer runs; a layer that is not ChunkDependency::none
///     runs in token chunks, its workset and each chunk's FLOPs shrinking with the chunk.
struct LayerDescription {
  std::string name;
  std::vector<StateSegment> segments;
  std::function<LayerCost(const Workload&)> cost;
  ChunkDependency chunking = ChunkDependency::none;
  /// Whether its forward may run again with the same result: for its own saved activations, and
  /// to regenerate the boundaries of the layers above it.
  bool recomputable = true;
  /// Its passes' rates as a step measured them (with_measured_rates), for a layer the profile's
  /// GEMM rate does not describe: memory-bound work, kernels off the tensor cores, CPU layers.
  /// Recomputes and boundary regenerations are priced at the forward's rate; each chunk still
  /// adds the profile's launch overhead.
  MeasuredRates measured;
};

/// Descriptions of a range of describable layers, in order; each `cost` calls the layer's own
/// cost(), so the layers must outlive the descriptions (and the planner made from them).
///   - A contiguous container of its own layers (std::vector, std::array) is reached through the
///     container and the layer's index, so a vector may grow after this (its reallocation moves
///     the layers: a cost through a pointer to the old one had read freed memory). The container
///     itself must not move. Each cost checks that the layer at its index is still the one
///     described (its segment names): a layer removed, or one inserted before it, is
///     Errc::invalid_argument naming the layer, not another layer's cost.
///   - Any other range (std::deque and std::list, whose elements stay where they are as they grow;
///     std::span and views) is reached through each layer's address: it must stay there.
template <std::ranges::forward_range R>
  requires describable_layer<std::ranges::range_value_t<R>>
std::vector<LayerDescription> describe_layers(const R& layers) {
  using L = std::ranges::range_value_t<R>;
  std::vector<LayerDescription> out;
  for (const L& l : layers) {
    LayerDescription d;
    d.name = std::string(layer_traits<L>::name(l));
    if (d.name == "layer") d.name = "layer " + std::to_string(out.size());
    for (const StateSegment& s : l.segments()) d.segments.push_back(s);
    if constexpr (std::ranges::contiguous_range<R> && std::ranges::sized_range<R> && !std::ranges::borrowed_range<R>) {
      std::vector<std::string> names;
      for (const StateSegment& s : d.segments) names.push_back(s.name);
      d.cost = [c = &layers, i = out.size(), name = d.name, names = std::move(names)](const Workload& w) {
        const auto n = static_cast<std::size_t>(std::ranges::size(*c));
        const auto gone = [&](const std::string& why) {
          OOM_THROW(Errc::invalid_argument, "describe_layers: layer " + std::to_string(i) + " ('" + name + "') " + why +
                                                ": describe the layers again after removing, inserting or moving any");
        };
        if (i >= n) gone("is no longer in its container, which holds " + std::to_string(n) + " layers now");
        const L& layer = std::ranges::data(*c)[i];
        const auto& segments = layer.segments();  // (segments() may answer by value)
        if (!std::ranges::equal(segments, names, {}, &StateSegment::name))
          gone("is not the layer at that index of its container any more (its segments' names differ)");
        return LayerCost(layer.cost(w));
      };
    } else {
      d.cost = [p = &l](const Workload& w) { return LayerCost(p->cost(w)); };
    }
    d.chunking = layer_traits<L>::chunking(l);
    d.recomputable = layer_traits<L>::recomputable;
    out.push_back(std::move(d));
  }
  return out;
}
/// Refused: each description's `cost` points into the layers, which a temporary container takes
/// with it (a planner made from them reads freed memory). Name the container; a borrowed range
/// (std::span, a view of a container that lives on) is taken as an lvalue is.
template <std::ranges::forward_range R>
  requires describable_layer<std::ranges::range_value_t<R>> && (!std::ranges::borrowed_range<R>)
std::vector<LayerDescription> describe_layers(const R&& layers) = delete;

/// The layers' descriptions with `measured` set from a step an executor recorded
/// (LayerExecutor::record_next_step): each layer's declared forward (backward) FLOPs over the
/// workload, times its "fwd NAME" ("bwd NAME") spans, over those spans' summed time. The spans
/// hold the layer's chunks' work on the compute stream and nothing before it (its weights' load,
/// its workspace's allocation); every micro-batch's count. The rate is taken to hold at every
/// chunk size, so measure a step of the chunking you will run (an unchunked one where no layer
/// needs chunks). Throws Errc::invalid_argument naming the layer when a span is missing (the step
/// recorded other layers or was skipped, or the names are not the executor's: LayerExecutor
/// labels a layer as describe_layers names it), when its spans took no time, when two layers
/// share a name, or for an empty workload.
std::vector<LayerDescription> with_measured_rates(std::vector<LayerDescription> layers, const Timeline& step, const Workload& workload);

class LayerStackPlanner {
 public:
  /// Throws Errc::invalid_argument for an empty stack, a layer without a cost function, or two
  /// segments of one name (plans name resident segments). It keeps a pointer to the profile.
  LayerStackPlanner(std::vector<LayerDescription> layers, const MachineProfile& profile, std::string model_name = {});
  LayerStackPlanner(std::vector<LayerDescription> layers, MachineProfile&& profile, std::string model_name = {}) = delete;

  /// The best few plans within both budgets, fastest first (distinct in residency or retention).
  /// Throws Errc::invalid_argument for a malformed request or a layer cost that is negative, not
  /// finite, has no output (LayerCost::output of 0 bytes) or declares a layer_boundary activation
  /// (naming the layer), Errc::unsupported for
  /// more than one GPU, and Errc::out_of_budget naming the least GPU and host bytes any plan
  /// needs and the GPU claimant that dominates it, when nothing fits.
  [[nodiscard]] PlanSet plan(const PlanRequest& request) const;

  /// The step graph a plan was simulated on (ops named "fwd", "bwd", "recompute", "h2d.weights",
  /// "d2h.activations", "h2d.activations", "d2h.grads", "cpu.adamw", "gpu.adamw", "loss").
  [[nodiscard]] StepGraph step_graph(const Plan& plan) const;
  /// Re-simulates a plan (one of this planner's, or one written by hand or read from JSON).
  /// step_graph and simulate refuse a plan of another layer count, counts out of range
  /// (check_plan_counts) or recomputes the HostExecutor does not run, and layer costs as plan()
  /// does (Errc::invalid_argument naming the field and layer).
  [[nodiscard]] SimResult simulate(const Plan& plan) const;
  /// A readable account of one plan: memory by claimant, residency, retention, chunks, time.
  /// Refuses the plans step_graph does (a plan of another stack, say).
  [[nodiscard]] std::string describe(const Plan& plan) const;

  [[nodiscard]] const std::vector<LayerDescription>& layers() const { return layers_; }
  /// layer_stack_fingerprint() of the layers' segments, as the plans it makes carry it.
  [[nodiscard]] const std::string& layers_fingerprint() const { return layers_fingerprint_; }

 private:
  std::vector<LayerDescription> layers_;
  const MachineProfile* profile_;
  std::string model_name_;
  std::string layers_fingerprint_;
};

}  // namespace oom
