#include "oom/io/chrome_trace.hpp"

#include <utility>

namespace oom {

namespace {

constexpr int host_tid = resource_count;  // the host track, after the resources' tracks

Json thread_name(int pid, int tid, const std::string& name) {
  Json meta = Json::object();
  meta.set("name", "thread_name");
  meta.set("ph", "M");
  meta.set("pid", pid);
  meta.set("tid", tid);
  Json args = Json::object();
  args.set("name", name);
  meta.set("args", std::move(args));
  return meta;
}

Json complete(const std::string& name, int pid, int tid, double begin_s, double duration_s) {
  Json e = Json::object();
  e.set("name", name);
  e.set("ph", "X");
  e.set("pid", pid);
  e.set("tid", tid);
  e.set("ts", begin_s * 1e6);
  e.set("dur", duration_s * 1e6);
  return e;
}

}  // namespace

ChromeTrace::ChromeTrace(int pid) : pid_(pid) {
  for (int r = 0; r < resource_count; ++r) events_.push_back(thread_name(pid_, r, to_string(static_cast<Resource>(r))));
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
  Json e = complete(name, pid_, static_cast<int>(resource), begin_s, duration_s);
  if (!args.is_null()) e.set("args", std::move(args));
  events_.push_back(std::move(e));
}

void ChromeTrace::host_span(const std::string& name, double begin_s, double duration_s) {
  if (!host_named_) {
    events_.push_back(thread_name(pid_, host_tid, "host (issuing thread)"));
    host_named_ = true;
  }
  events_.push_back(complete(name, pid_, host_tid, begin_s, duration_s));
}

std::string ChromeTrace::dump() const {
  Json root = Json::object();
  root.set("traceEvents", events_);
  root.set("displayTimeUnit", "ms");
  return root.dump();
}

}  // namespace oom
