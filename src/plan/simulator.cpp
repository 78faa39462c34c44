// Step simulator: list scheduling in issue order per resource, then a sweep over memory holds.
#include "oom/plan/simulator.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/io/chrome_trace.hpp"

namespace oom {

std::string SimOp::name() const { return layer >= 0 ? std::string(what) + " L" + std::to_string(layer) : std::string(what); }

int StepGraph::add(SimOp op) {
  const int id = static_cast<int>(ops_.size());
  for (int d : op.deps)
    if (d < 0 || d >= id) OOM_THROW(Errc::internal, "op '" + op.name() + "' depends on op " + std::to_string(d) + ", which is not issued before it");
  if (!(op.duration_s >= 0)) OOM_THROW(Errc::internal, "op '" + op.name() + "' has a negative or NaN duration");
  ops_.push_back(std::move(op));
  return id;
}

void StepGraph::hold(Claimant c, Bytes bytes, int from, int to) {
  const int n = static_cast<int>(ops_.size());
  if (from < -1 || from >= n || to < -1 || to >= n) OOM_THROW(Errc::internal, "memory hold names an op that does not exist");
  // Ops are issued in order, so a hold from a later op to an earlier one would end no later than
  // it starts: its free would be swept before its take, and the claimant's bytes wrap past 2^64.
  if (from >= 0 && to >= 0 && from > to)
    OOM_THROW(Errc::invalid_argument, fmt::format("memory hold of {} ({}) from op {} '{}' to op {} '{}': it must end at an op "
                                                  "issued no earlier than the one it starts at",
                                                  to_string(bytes), to_string(c), from, ops_[static_cast<std::size_t>(from)].name(), to,
                                                  ops_[static_cast<std::size_t>(to)].name()));
  if (bytes.count() == 0) return;
  holds_.push_back({c, bytes, from, to});
}

SimResult simulate(const StepGraph& graph) {
  const auto& ops = graph.ops();
  SimResult r;
  r.start_s.resize(ops.size());
  r.end_s.resize(ops.size());
  std::array<double, resource_count> free_at{};
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    auto& res_free = free_at[static_cast<std::size_t>(op.resource)];
    double start = res_free;
    for (int d : op.deps) start = std::max(start, r.end_s[static_cast<std::size_t>(d)]);
    r.start_s[i] = start;
    r.end_s[i] = start + op.duration_s;
    res_free = r.end_s[i];
    r.busy[op.resource] += op.duration_s;
    r.step_s = std::max(r.step_s, r.end_s[i]);
  }

  // Memory: +bytes at a hold's start, -bytes at its end; at equal times frees go first (a
  // stream-ordered allocator reuses memory freed by an op that has ended). So a hold that ends no
  // later than it starts (its last op, on another resource, done before its first begins) holds
  // nothing: swept, its free would come before its take and wrap its claimant's bytes past 2^64.
  struct Event {
    double t;
    int sign;
    Claimant c;
    Bytes bytes;
  };
  std::vector<Event> events;
  events.reserve(graph.holds().size() * 2);
  for (const auto& h : graph.holds()) {
    const double from = h.from < 0 ? 0.0 : r.start_s[static_cast<std::size_t>(h.from)];
    const double to = h.to < 0 ? r.step_s : r.end_s[static_cast<std::size_t>(h.to)];
    if (!(to > from)) continue;
    events.push_back({from, +1, h.claimant, h.bytes});
    events.push_back({to, -1, h.claimant, h.bytes});
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.t != b.t ? a.t < b.t : a.sign < b.sign;
  });
  std::array<Bytes, claimant_count> now{};
  Bytes gpu_now, host_now;
  for (const auto& e : events) {
    auto& slot = now[static_cast<std::size_t>(e.c)];
    Bytes& total = on_gpu(e.c) ? gpu_now : host_now;
    if (e.sign > 0) {
      slot += e.bytes;
      total += e.bytes;
    } else {
      slot -= e.bytes;
      total -= e.bytes;
    }
    r.peak[static_cast<std::size_t>(e.c)] = max(r.peak[static_cast<std::size_t>(e.c)], slot);
    if (gpu_now > r.gpu_peak) {
      r.gpu_peak = gpu_now;
      r.at_gpu_peak = now;
    }
    r.host_peak = max(r.host_peak, host_now);
  }
  return r;
}

std::string chrome_trace(const StepGraph& graph, const SimResult& result) {
  ChromeTrace trace(1);
  const auto& ops = graph.ops();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].duration_s <= 0) continue;
    Json args;
    if (ops[i].layer >= 0) {
      args = Json::object();
      args.set("layer", ops[i].layer);
    }
    trace.span(ops[i].name(), ops[i].resource, result.start_s[i], ops[i].duration_s, std::move(args));
  }
  return trace.dump();
}

}  // namespace oom
