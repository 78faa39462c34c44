#include "oom/runtime/timeline.hpp"

#include <algorithm>

#include "oom/io/json.hpp"

namespace oom {

void Timeline::add(std::string name, Resource resource, double begin_s, double end_s) {
  std::lock_guard lock(mutex_);
  spans_.push_back({std::move(name), resource, begin_s, std::max(begin_s, end_s)});
}

std::vector<TimelineSpan> Timeline::spans() const {
  std::lock_guard lock(mutex_);
  return spans_;
}

void Timeline::clear() {
  std::lock_guard lock(mutex_);
  spans_.clear();
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
  Json events = Json::array();
  for (int r = 0; r < resource_count; ++r) {
    Json meta = Json::object();
    meta.set("name", "thread_name");
    meta.set("ph", "M");
    meta.set("pid", 0);
    meta.set("tid", r);
    Json args = Json::object();
    args.set("name", to_string(static_cast<Resource>(r)));
    meta.set("args", args);
    events.push_back(meta);
  }
  Json process = Json::object();
  process.set("name", "process_name");
  process.set("ph", "M");
  process.set("pid", 0);
  Json pargs = Json::object();
  pargs.set("name", title);
  process.set("args", pargs);
  events.push_back(process);
  for (const auto& sp : spans()) {
    Json e = Json::object();
    e.set("name", sp.name);
    e.set("ph", "X");
    e.set("pid", 0);
    e.set("tid", static_cast<int>(sp.resource));
    e.set("ts", sp.begin_s * 1e6);
    e.set("dur", (sp.end_s - sp.begin_s) * 1e6);
    events.push_back(e);
  }
  Json root = Json::object();
  root.set("traceEvents", events);
  root.set("displayTimeUnit", "ms");
  return root.dump() + "\n";
}

}  // namespace oom
