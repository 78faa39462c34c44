#include "oom/runtime/timeline.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "oom/core/log.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/io/chrome_trace.hpp"
#include "oom/plan/simulator.hpp"

namespace oom {

void Timeline::add(std::string name, Resource resource, double begin_s, double end_s) {
  std::lock_guard lock(mutex_);
  spans_.push_back({std::move(name), resource, begin_s, std::max(begin_s, end_s)});
}

void Timeline::add_host(std::string name, double begin_s, double end_s) {
  std::lock_guard lock(mutex_);
  host_spans_.push_back({std::move(name), Resource::cpu, begin_s, std::max(begin_s, end_s)});
}

std::vector<TimelineSpan> Timeline::host_spans() const {
  std::lock_guard lock(mutex_);
  return host_spans_;
}

std::vector<TimelineSpan> Timeline::spans() const {
  std::lock_guard lock(mutex_);
  return spans_;
}

void Timeline::clear() {
  std::lock_guard lock(mutex_);
  spans_.clear();
  host_spans_.clear();
}

ResourceTimes Timeline::busy() const {
  auto s = spans();
  std::sort(s.begin(), s.end(), [](const TimelineSpan& a, const TimelineSpan& b) { return a.begin_s < b.begin_s; });
  ResourceTimes out;
  for (int r = 0; r < resource_count; ++r) {
    double covered = 0, open_begin = 0, open_end = -1;
    for (const auto& sp : s) {
      if (static_cast<int>(sp.resource) != r) continue;
      if (sp.begin_s > open_end) {
        if (open_end >= open_begin) covered += open_end - open_begin;
        open_begin = sp.begin_s;
        open_end = sp.end_s;
      } else {
        open_end = std::max(open_end, sp.end_s);
      }
    }
    if (open_end >= open_begin) covered += open_end - open_begin;
    out[static_cast<Resource>(r)] = covered;
  }
  return out;
}

double Timeline::wall_seconds() const {
  const auto s = spans();
  if (s.empty()) return 0;
  double b = s.front().begin_s, e = s.front().end_s;
  for (const auto& sp : s) {
    b = std::min(b, sp.begin_s);
    e = std::max(e, sp.end_s);
  }
  return e - b;
}

std::string Timeline::chrome_trace(const std::string& title) const {
  ChromeTrace trace(0);
  trace.process_name(title);
  for (const auto& sp : spans()) trace.span(sp.name, sp.resource, sp.begin_s, sp.end_s - sp.begin_s);
  for (const auto& sp : host_spans()) trace.host_span(sp.name, sp.begin_s, sp.end_s - sp.begin_s);
  return trace.dump() + "\n";
}

std::filesystem::path predicted_trace_path(std::filesystem::path path) { return path.replace_extension(".predicted.json"); }

std::string write_step_traces(const std::filesystem::path& path, const std::string& label, const std::string& title,
                              const Timeline& measured, double measured_step_s, const StepGraph& graph) {
  const std::size_t spans = measured.spans().size();
  if (spans == 0) {
    log_warn("{} recorded nothing (its timing was lost); no trace written", label);
    return {};
  }
  const std::filesystem::path predicted_path = predicted_trace_path(path);
  const SimResult predicted = simulate(graph);
  write_file_atomically(path, measured.chrome_trace(title));
  write_file_atomically(predicted_path, chrome_trace(graph, predicted));
  const ResourceTimes busy = measured.busy();
  std::string line = fmt::format("{} recorded in {} ({} spans; the prediction's in {}; open in ui.perfetto.dev); busy s measured / predicted",
                                 label, path.string(), spans, predicted_path.string());
  for (int r = 0; r < resource_count; ++r) {
    const auto res = static_cast<Resource>(r);
    if (busy[res] == 0 && predicted.busy[res] == 0) continue;
    line += fmt::format(", {} {:.4g} / {:.4g}", to_string(res), busy[res], predicted.busy[res]);
  }
  return line + fmt::format("; step {:.4g} / {:.4g}", measured_step_s, predicted.step_s);
}

}  // namespace oom

