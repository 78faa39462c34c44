// Plan: everything the executor needs to run one training step of a model on a machine, as the
// planner chose it, with the prediction that justified it. Serialisable to JSON.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "oom/concepts/cost_model.hpp"
#include "oom/concepts/retention_policy.hpp"
#include "oom/core/bytes.hpp"
#include "oom/model/segment.hpp"
#include "oom/model/workload.hpp"
#include "oom/plan/simulator.hpp"

namespace oom {

class Json;

enum class ExecutionPath : unsigned char {
  local,            ///< every GPU runs every expert for its own tokens
  expert_parallel,  ///< experts partitioned over GPUs; tokens travel by all-to-all
};
const char* to_string(ExecutionPath p) noexcept;

/// Where a streamed segment's gradient is summed over a step's micro-batches.
enum class GradAccumulation : unsigned char {
  host,    ///< each later micro-batch's lands in pinned memory and is added there (HostExecutor)
  device,  ///< the sum so far goes back up into the layer's GPU gradient slot before its backward,
           ///< which adds to it (CudaCausalLm): PCIe, no CPU pass
};
const char* to_string(GradAccumulation a) noexcept;

/// What the user asks the planner for.
struct PlanRequest {
  int gpus = 1;
  Bytes gpu_budget;       ///< per GPU
  Bytes host_budget;      ///< per node
  Workload workload;      ///< per GPU and micro-batch: `sequences` of `seq_len` tokens
  int micro_batches = 1;  ///< gradient accumulation steps per optimizer step
  /// Gradients clipped by global norm: every update waits for the whole backward (and the norm),
  /// so the CPU AdamW no longer overlaps it, and every streamed gradient is staged until then.
  bool clip_grad_norm = false;
  StatePrecision precision;
  int candidates = 3;     ///< how many of the best plans to return
  /// Only plans of this retention template (its name, as Plan::retention_name begins: the
  /// template alone and its mixes with others nearer the loss); empty: every template. A name the
  /// planner does not search is refused, listing the ones it does.
  std::string retention;
};

/// The predicted cost of a plan, from the simulator.
struct Prediction {
  double step_s = 0;
  ResourceTimes busy;  ///< seconds each resource is busy in one step
  std::array<Bytes, claimant_count> gpu_at_peak{};  ///< GPU bytes by claimant when the GPU total peaks
  std::array<Bytes, claimant_count> peak{};         ///< each claimant's own peak
  Bytes gpu_peak;   ///< per GPU
  Bytes host_peak;  ///< per node

  /// A simulation's figures.
  [[nodiscard]] static Prediction of(const SimResult& r) {
    return {r.step_s, r.busy, r.at_gpu_peak, r.peak, r.gpu_peak, r.host_peak};
  }
};

/// What a plan may hold, for both planners and the plan reader alike: GPUs of one node (as
/// a MachineProfile may describe), weight slots in flight, micro-batches a step.
inline constexpr int max_plan_gpus = 1024;
inline constexpr int max_prefetch_depth = 64;
inline constexpr int max_micro_batches = 1 << 20;
/// Where a layer's streamed weights start on the GPU, in a slot and in a regeneration's workset
/// of several layers' weights alike: a multiple of this many bytes (so a layer's kernels see the
/// same alignment, and compute the same bits, in every pass). A slot is where the backend's
/// device heap puts it, at this alignment too (CudaBackend's and HostBackend's hand out 256-byte
/// blocks; test_runtime checks a layer's weights are aligned in every pass). The
/// LayerStackPlanner counts the padding.
inline constexpr std::uint64_t streamed_weight_alignment = 256;

/// The checks every planner makes of a request before planning (Errc::invalid_argument naming
/// the field): tokens in the workload, within max_workload_tokens, 1 to max_micro_batches
/// micro-batches, 1 to max_plan_gpus GPUs, both budgets set, at least 1 candidate.
void check_plan_request(const PlanRequest& req);

struct LayerChunks {
  /// Query-chunk ends, in execution order (causal), the last seq_len; empty for a layer that has
  /// no attention chunks (a LayerStackPlanner's plans: the layers chunk by moe_tokens alone).
  std::vector<std::uint64_t> attention;
  std::uint64_t moe_tokens = 0;  ///< tokens per MoE chunk
};

struct Plan {
  std::string model;  ///< the config it was made for (path or name)
  /// model_fingerprint() of the model it was made for (empty: a LayerStackPlanner's layers, or a
  /// plan from before the field): what oom-train compares, the name being a path as typed.
  std::string model_fingerprint;
  /// layer_stack_fingerprint() of the layers a LayerStackPlanner made it for (empty: a Planner's
  /// plan, one made by hand, or one from before the field): what a LayerExecutor compares with its
  /// own layers, so that a plan of another stack is refused instead of run with its residency
  /// names matching nothing and its bytes another stack's.
  std::string layers_fingerprint;
  ExecutionPath path = ExecutionPath::local;
  int gpus = 1;
  int prefetch_depth = 2;  ///< weight slots per GPU: layers in flight
  Workload workload;
  int micro_batches = 1;
  /// How the executor sums streamed gradients over micro-batches: the simulation charges the
  /// device's refill (an H2D of the sum so far per streamed layer and later micro-batch); the
  /// host's CPU additions are not modelled. An executor's as_executed sets its own.
  GradAccumulation grad_accumulation = GradAccumulation::host;
  bool clip_grad_norm = false;  ///< PlanRequest::clip_grad_norm
  StatePrecision precision;
  Bytes gpu_budget, host_budget;

  std::vector<std::string> resident_segments;  ///< names, in ModelSpec order
  Bytes resident_level;                        ///< the resident-bytes level it was chosen under
  std::string retention_name;
  std::vector<std::array<RetentionDecision, activation_class_count>> retention;  ///< per layer
  std::vector<LayerChunks> chunks;   ///< per decoder layer
  std::uint64_t loss_rows = 0;       ///< rows per LM-head/cross-entropy chunk

  Prediction predicted;

  /// The largest MoE token chunk of its layers (a chunk of 0 or past the micro-batch's tokens
  /// counts as all of them); the micro-batch's tokens when no layer has chunks.
  [[nodiscard]] std::uint64_t largest_moe_chunk() const {
    const std::uint64_t T = workload.tokens();
    std::uint64_t c = 0;
    for (const auto& lc : chunks) c = std::max(c, lc.moe_tokens == 0 ? T : std::min(lc.moe_tokens, T));
    return c == 0 ? T : c;
  }

  /// A plan with what it takes from its request filled in (GPUs, workload, micro-batches,
  /// clipping, precision, budgets) and `model`; the planner fills the rest.
  [[nodiscard]] static Plan for_request(const PlanRequest& r, std::string model) {
    Plan p;
    p.model = std::move(model);
    p.gpus = r.gpus;
    p.workload = r.workload;
    p.micro_batches = r.micro_batches;
    p.clip_grad_norm = r.clip_grad_norm;
    p.precision = r.precision;
    p.gpu_budget = r.gpu_budget;
    p.host_budget = r.host_budget;
    return p;
  }

  [[nodiscard]] Json to_json() const;
  [[nodiscard]] static Plan from_json(const Json& j, std::string_view source = "<plan>");
};

/// The checks every planner makes of a plan it is handed (read from JSON, written by hand) before
/// building its step graph (Errc::invalid_argument naming the field, and the layer): 1 to
/// max_plan_gpus GPUs, 1 to max_prefetch_depth weight slots, 1 to max_micro_batches
/// micro-batches, 1 to max_workload_tokens tokens, a MoE chunk of > 0 tokens in every layer.
/// Each planner adds what its own graph needs (Planner::step_graph: attention chunks, loss rows).
void check_plan_counts(const Plan& p);

/// A regenerated boundary (Retention::recompute of layer `layer`'s layer_boundary) as the
/// executors run one: from a layer f below it whose own boundary is kept or offloaded, every
/// boundary between regenerated from f as well, so that one rerun of layers [f, layer) in the
/// group's first backward gives back all of them. Errc::invalid_argument (f not below, or f's own
/// boundary regenerated) or Errc::unsupported (a boundary between not in the group), naming the
/// layers.
void check_boundary_regeneration(const Plan& p, std::size_t layer);

/// Where layer `layer`'s recomputes start, as the executors run them: its saved activations from
/// its own boundary (Errc::unsupported naming the class otherwise), its boundary as
/// check_boundary_regeneration says.
void check_recompute_sources(const Plan& p, std::size_t layer);

/// "boundaries: K kept, O offloaded, R regenerated through the layers below them": the layer
/// boundaries' decisions counted, for the planners' describe().
std::string describe_boundaries(const Plan& p);
/// "" at the default precisions; else one line naming them (e.g. "state: bf16 weights, fp32
/// master, bf16 AdamW moments, fp32 gradients\n"), for describe().
std::string describe_precision(const StatePrecision& p);

/// A stack of layers as plans see it: each layer's segments in order, their names and tensors'
/// names and shapes (16 lowercase hex digits, FNV-1a). LayerStackPlanner's plans carry it
/// (Plan::layers_fingerprint); LayerExecutor compares it with its layers' segments().
[[nodiscard]] std::string layer_stack_fingerprint(const std::vector<std::vector<StateSegment>>& segments_per_layer);

}  // namespace oom
