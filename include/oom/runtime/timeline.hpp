// Timeline: what an executor measured during one step — spans of work per resource (the compute
// stream, the two copy directions, the CPU optimizer) — exported as Chrome trace JSON (the same
// lanes as the simulator's predicted trace, so the two open side by side in ui.perfetto.dev) and
// summed per resource to set against the plan's prediction.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "oom/concepts/cost_model.hpp"

namespace oom {

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

}  // namespace oom
