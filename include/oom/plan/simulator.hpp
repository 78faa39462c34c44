// The step simulator: operations on resources with dependencies, and memory holds between them.
// Each resource runs its operations in issue order (CUDA stream semantics: an op waiting on a
// dependency holds up the ops behind it); an op starts when its resource is free and all its
// dependencies have ended. Peak memory per claimant and in total is swept over the timeline.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "oom/concepts/cost_model.hpp"
#include "oom/core/bytes.hpp"

namespace oom {

/// Who holds memory. GPU claimants are per GPU; host claimants per node.
enum class Claimant : unsigned char {
  resident_state,        ///< GPU: resident segments' weights, master, moments, gradients
  retained_activations,  ///< GPU: saved activations kept (or prefetched back) for backward
  worksets,              ///< GPU: weight slots, gradient buffers, per-chunk temporaries
  host_state,            ///< host: streamed segments' state (pinned weights, master, moments)
  host_staging,          ///< host: pinned gradient staging / accumulators
  host_offload,          ///< host: offloaded activations
};
inline constexpr int claimant_count = 6;
const char* to_string(Claimant c) noexcept;
constexpr bool on_gpu(Claimant c) { return c <= Claimant::worksets; }
/// Bytes by claimant summed on the GPU and on the host.
struct GpuHostBytes {
  Bytes gpu, host;
};
inline GpuHostBytes gpu_and_host(const std::array<Bytes, claimant_count>& by_claimant) {
  GpuHostBytes sum;
  for (int c = 0; c < claimant_count; ++c) (on_gpu(static_cast<Claimant>(c)) ? sum.gpu : sum.host) += by_claimant[static_cast<std::size_t>(c)];
  return sum;
}

struct SimOp {
  const char* what = "";  ///< a static string: "fwd.attention", "h2d.weights", ... (with `layer`, its name)
  Resource resource = Resource::gpu_compute;
  double duration_s = 0;
  std::vector<int> deps;  ///< ids of earlier ops that must end first
  int layer = -1;

  /// "fwd.attention L3"; "loss" for ops of no decoder layer.
  [[nodiscard]] std::string name() const;
};

/// `bytes` of `claimant` held from the start of op `from` to the end of op `to`;
/// from = -1: from the step's start; to = -1: to its end.
struct MemoryHold {
  Claimant claimant = Claimant::worksets;
  Bytes bytes;
  int from = -1;
  int to = -1;
};

class StepGraph {
 public:
  /// Appends an op; its deps must already exist (ops are issued in order).
  int add(SimOp op);
  /// Holds `bytes` of `c` as MemoryHold says; Errc::invalid_argument, naming both ops, when `to`
  /// is issued before `from`. (One that still ends no later than it starts, on another resource,
  /// holds nothing.)
  void hold(Claimant c, Bytes bytes, int from = -1, int to = -1);
  [[nodiscard]] const std::vector<SimOp>& ops() const { return ops_; }
  [[nodiscard]] const std::vector<MemoryHold>& holds() const { return holds_; }

 private:
  std::vector<SimOp> ops_;
  std::vector<MemoryHold> holds_;
};

struct SimResult {
  double step_s = 0;                      ///< the last op's end
  ResourceTimes busy;                     ///< seconds each resource is busy
  std::vector<double> start_s, end_s;     ///< per op
  std::array<Bytes, claimant_count> peak{};       ///< each claimant's own peak
  std::array<Bytes, claimant_count> at_gpu_peak{};  ///< each claimant's bytes when the GPU total peaks
  Bytes gpu_peak;   ///< total of GPU claimants, at its highest
  Bytes host_peak;  ///< total of host claimants, at its highest

  [[nodiscard]] Bytes peak_of(Claimant c) const { return peak[static_cast<std::size_t>(c)]; }
};

[[nodiscard]] SimResult simulate(const StepGraph& graph);

/// The simulated timeline as Chrome trace JSON (chrome://tracing, Perfetto): one track per resource.
[[nodiscard]] std::string chrome_trace(const StepGraph& graph, const SimResult& result);

}  // namespace oom
