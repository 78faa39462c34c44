#include "oom/io/chrome_trace.hpp"

#include <utility>

namespace oom {

ChromeTrace::ChromeTrace(int pid) : pid_(pid) {
  for (int r = 0; r < resource_count; ++r) {
    Json meta = Json::object();
    meta.set("name", "thread_name");
    meta.set("ph", "M");
    meta.set("pid", pid_);
    meta.set("tid", r);
    Json args = Json::object();
    args.set("name", to_string(static_cast<Resource>(r)));
    meta.set("args", std::move(args));
    events_.push_back(std::move(meta));
  }
}

void ChromeTrace::process_name(const std::string& name) {
  Json process = Json::object();
  process.set("name", "process_name");
  process.set("ph", "M");
  process.set("pid", pid_);
  Json args = Json::object();
  args.set("name", name);
  process.set("args", std::move(args));
  events_.push_back(std::move(process));
}

void ChromeTrace::span(const std::string& name, Resource resource, double begin_s, double duration_s, Json args) {
  Json e = Json::object();
  e.set("name", name);
  e.set("ph", "X");
  e.set("pid", pid_);
  e.set("tid", static_cast<int>(resource));
  e.set("ts", begin_s * 1e6);
  e.set("dur", duration_s * 1e6);
  if (!args.is_null()) e.set("args", std::move(args));
  events_.push_back(std::move(e));
}

void ChromeTrace::host_span(const std::string& name, double begin_s, double duration_s) {
  constexpr int host_tid = resource_count;  // after the resources' tracks
  if (!host_named_) {
    Json meta = Json::object();
    meta.set("name", "thread_name");
    meta.set("ph", "M");
    meta.set("pid", pid_);
    meta.set("tid", host_tid);
    Json args = Json::object();
    args.set("name", "host (issuing thread)");
    meta.set("args", std::move(args));
    events_.push_back(std::move(meta));
    host_named_ = true;
  }
  Json e = Json::object();
  e.set("name", name);
  e.set("ph", "X");
  e.set("pid", pid_);
  e.set("tid", host_tid);
  e.set("ts", begin_s * 1e6);
  e.set("dur", duration_s * 1e6);
  events_.push_back(std::move(e));
}

std::string ChromeTrace::dump() const {
  Json root = Json::object();
  root.set("traceEvents", events_);
  root.set("displayTimeUnit", "ms");
  return root.dump();
}

}  // namespace oom
