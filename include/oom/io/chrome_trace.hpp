// Chrome trace JSON (chrome://tracing, ui.perfetto.dev) of work on OOM's resources: one track per
// Resource (its thread) in one process, complete events ("ph": "X") in microseconds. The
// executors' measured timelines (runtime/timeline.hpp) and the simulator's predicted ones
// (plan/simulator.hpp) are written with it, so the two open side by side alike.
#pragma once

#include <string>

#include "oom/concepts/cost_model.hpp"
#include "oom/io/json.hpp"

namespace oom {

class ChromeTrace {
 public:
  /// Names the resource tracks of process `pid`.
  explicit ChromeTrace(int pid);
  /// Names the process (shown above its tracks).
  void process_name(const std::string& name);
  /// A complete event on `resource`'s track, from `begin_s` for `duration_s` (seconds); `args`
  /// (an object) is attached unless null.
  void span(const std::string& name, Resource resource, double begin_s, double duration_s, Json args = nullptr);
  /// A complete event on the host track (the thread that issues the work; named on first use).
  void host_span(const std::string& name, double begin_s, double duration_s);
  /// {"traceEvents": [...], "displayTimeUnit": "ms"}, compact.
  [[nodiscard]] std::string dump() const;

 private:
  int pid_;
  bool host_named_ = false;
  Json events_ = Json::array();
};

}  // namespace oom
