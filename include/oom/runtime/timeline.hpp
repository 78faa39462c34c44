// Timeline: what an executor measured during one step — spans of work per resource (the compute
// stream, the two copy directions, the CPU optimizer) — exported as Chrome trace JSON (the same
// lanes as the simulator's predicted trace, so the two open side by side in ui.perfetto.dev) and
// summed per resource to set against the plan's prediction.
#pragma once

#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "oom/concepts/cost_model.hpp"

namespace oom {

class StepGraph;  // oom/plan/simulator.hpp

struct TimelineSpan {
  std::string name;  ///< "fwd layers.3", "h2d weights layers.3", ...
  Resource resource = Resource::gpu_compute;
  double begin_s = 0, end_s = 0;  ///< from the step's start
};

class Timeline {
 public:
  /// Thread-safe: executors add spans from their stream workers.
  void add(std::string name, Resource resource, double begin_s, double end_s);
  /// Time the issuing host thread spent on something (enqueueing a layer, waiting for a result):
  /// a track of its own in the trace, not a resource (busy() and wall_seconds() leave it out).
  /// Its `resource` is meaningless.
  void add_host(std::string name, double begin_s, double end_s);
  [[nodiscard]] std::vector<TimelineSpan> spans() const;
  [[nodiscard]] std::vector<TimelineSpan> host_spans() const;
  /// Seconds each resource was busy (the union of its spans).
  [[nodiscard]] ResourceTimes busy() const;
  /// From the first span's begin to the last span's end.
  [[nodiscard]] double wall_seconds() const;
  /// {"traceEvents": [...]}: one complete event ("ph": "X") per span, one thread per resource.
  [[nodiscard]] std::string chrome_trace(const std::string& title = "measured step") const;
  void clear();

 private:
  mutable std::mutex mutex_;
  std::vector<TimelineSpan> spans_, host_spans_;
};

/// One recorded step set beside its plan's prediction, as oom-train --trace-step and
/// oom-custom-layer --trace write it: `measured` as Chrome trace JSON at `path` (titled `title`),
/// the simulator's timeline of `graph` (the plan that ran) at `path` with the extension
/// .predicted.json, both written atomically. Returns one line for the user, beginning with
/// `label`: where the two went, then each resource's busy seconds measured / predicted (those
/// idle in both left out) and the step's seconds, `measured_step_s` against the simulated step.
/// A timeline with no spans (its timing lost) writes nothing, warns (log_warn) and returns "".
[[nodiscard]] std::string write_step_traces(const std::filesystem::path& path, const std::string& label, const std::string& title,
                                            const Timeline& measured, double measured_step_s, const StepGraph& graph);
/// Where write_step_traces(path, ...) puts the prediction: `path` with the extension .predicted.json.
[[nodiscard]] std::filesystem::path predicted_trace_path(std::filesystem::path path);

}  // namespace oom
