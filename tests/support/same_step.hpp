// What the executor tests compare: weights (or any per-segment vectors) bit for bit, the resident
// plan they compare against, whether a plan moves any activation a given way, and the layers'
// forward and backward seconds predicted against measured. Shared by the host, planner and GPU executor tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "oom/plan/plan.hpp"
#include "oom/plan/simulator.hpp"
#include "oom/runtime/timeline.hpp"

namespace oom::test {

/// Same sizes and the same bits, vector by vector.
inline bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  return true;
}

/// The plain plan every other must match: all segments resident, everything kept, unchunked, over
/// one sequence of `tokens` tokens.
template <class L>
Plan resident_plan(const std::vector<L>& layers, std::uint64_t tokens, int micro_batches = 1) {
  Plan p;
  p.workload = {1, tokens};
  p.micro_batches = micro_batches;
  p.gpu_budget = Bytes{std::uint64_t{1} << 30};
  p.host_budget = Bytes{std::uint64_t{1} << 30};
  for (const auto& l : layers)
    for (const auto& s : l.segments()) p.resident_segments.push_back(s.name);
  p.retention.resize(layers.size());
  p.chunks.assign(layers.size(), {{tokens}, tokens});
  p.loss_rows = tokens;
  return p;
}

/// Whether any layer's class is planned `r`.
inline bool any_retention(const Plan& p, Retention r) {
  for (const auto& row : p.retention)
    for (const auto& d : row)
      if (d.action == r) return true;
  return false;
}

/// The layers' forward and backward seconds a step graph predicts, less each op's launch overhead.
inline double pass_seconds(const StepGraph& g, double launch_overhead_s) {
  double sum = 0;
  for (const auto& op : g.ops())
    if (std::string(op.what) == "fwd" || std::string(op.what) == "bwd") sum += op.duration_s - launch_overhead_s;
  return sum;
}

/// The same, as a recorded step measured them (its "fwd ..." and "bwd ..." spans).
inline double pass_seconds(const Timeline& step) {
  double sum = 0;
  for (const auto& span : step.spans())
    if (span.name.starts_with("fwd ") || span.name.starts_with("bwd ")) sum += span.end_s - span.begin_s;
  return sum;
}

}  // namespace oom::test
