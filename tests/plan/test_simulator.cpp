// The step simulator: stream-ordered resources, dependencies across resources, and the memory
// sweep (peaks per claimant, frees before allocations at equal times).
#include <doctest/doctest.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/plan/simulator.hpp"

using namespace oom;
using namespace oom::literals;

TEST_CASE("ops on one resource run in issue order; other resources overlap") {
  StepGraph g;
  const int load0 = g.add({"h2d", Resource::h2d, 1.0, {}, 0});
  const int comp0 = g.add({"compute", Resource::gpu_compute, 2.0, {load0}, 0});
  const int load1 = g.add({"h2d", Resource::h2d, 1.0, {}, 1});  // overlaps comp0
  const int comp1 = g.add({"compute", Resource::gpu_compute, 2.0, {load1}, 1});
  const int upd = g.add({"cpu", Resource::cpu, 5.0, {comp0}, 0});
  const auto r = simulate(g);
  CHECK(r.start_s[static_cast<std::size_t>(comp0)] == 1.0);
  CHECK(r.start_s[static_cast<std::size_t>(load1)] == 1.0);
  CHECK(r.start_s[static_cast<std::size_t>(comp1)] == 3.0);  // waits for comp0 (same stream), not just load1
  CHECK(r.start_s[static_cast<std::size_t>(upd)] == 3.0);
  CHECK(r.step_s == 8.0);
  CHECK(r.busy[Resource::h2d] == 2.0);
  CHECK(r.busy[Resource::gpu_compute] == 4.0);
}

TEST_CASE("an op blocked on a dependency holds up the ops behind it on its stream") {
  StepGraph g;
  const int slow = g.add({"cpu", Resource::cpu, 10.0, {}, 0});
  const int waits = g.add({"h2d", Resource::h2d, 1.0, {slow}, 0});
  const int behind = g.add({"h2d", Resource::h2d, 1.0, {}, 1});
  const auto r = simulate(g);
  CHECK(r.start_s[static_cast<std::size_t>(waits)] == 10.0);
  CHECK(r.start_s[static_cast<std::size_t>(behind)] == 11.0);
}

TEST_CASE("memory holds: peaks per claimant, GPU total at its peak, frees first at equal times") {
  StepGraph g;
  const int a = g.add({"a", Resource::gpu_compute, 1.0, {}, 0});
  const int b = g.add({"b", Resource::gpu_compute, 1.0, {a}, 1});
  const int c = g.add({"c", Resource::gpu_compute, 1.0, {b}, 2});
  g.hold(Claimant::resident_state, 10_GiB);                // whole step
  g.hold(Claimant::worksets, 4_GiB, a, a);                 // [0, 1]
  g.hold(Claimant::worksets, 4_GiB, b, b);                 // [1, 2]: reuses a's bytes
  g.hold(Claimant::retained_activations, 2_GiB, a, c);     // [0, 3]
  g.hold(Claimant::host_offload, 7_GiB, b, c);
  const auto r = simulate(g);
  CHECK(r.peak_of(Claimant::worksets) == 4_GiB);
  CHECK(r.gpu_peak == 16_GiB);
  CHECK(r.at_gpu_peak[static_cast<std::size_t>(Claimant::retained_activations)] == 2_GiB);
  CHECK(r.host_peak == 7_GiB);
}

TEST_CASE("bad graphs are refused, and the trace is JSON with one event per timed op") {
  StepGraph g;
  CHECK_THROWS_AS(g.add({"x", Resource::cpu, 1.0, {3}, 0}), Error);
  CHECK_THROWS_AS(g.add({"x", Resource::cpu, -1.0, {}, 0}), Error);
  const int a = g.add({"fwd", Resource::gpu_compute, 0.5, {}, 2});
  g.add({"d2h", Resource::d2h, 0.25, {a}, 2});
  const auto trace = Json::parse(chrome_trace(g, simulate(g)));
  int timed = 0;
  for (const auto& e : trace.find("traceEvents")->as_array())
    if (e.find("ph")->as_string() == "X") {
      ++timed;
      CHECK(e.find("name")->as_string().find(" L2") != std::string::npos);
    }
  CHECK(timed == 2);
}

TEST_CASE("a memory hold that ends before it starts is refused, or holds nothing: never a wrapped 16 EiB peak") {
  StepGraph g;
  const int a = g.add({"a", Resource::gpu_compute, 1.0, {}, -1});
  const int b = g.add({"b", Resource::gpu_compute, 1.0, {a}, 3});
  try {
    g.hold(Claimant::worksets, 1_MiB, b, a);  // from b's start (t = 1) to a's end (t = 1): reversed
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::invalid_argument);
    CHECK(e.message().find("memory hold of 1.00 MiB (worksets) from op 1 'b L3' to op 0 'a'") != std::string::npos);
  }
  CHECK(g.holds().empty());
  // Issued in order but on another resource, `to` can still end before `from` starts: nothing held.
  const int c = g.add({"c", Resource::h2d, 0.5, {}, -1});  // [0, 0.5] while b runs [1, 2]
  g.hold(Claimant::worksets, 2_MiB, b, c);
  // An op of no duration held for itself: 0 bytes for no time, not 2^64 - 4 MiB.
  const int d = g.add({"d", Resource::cpu, 0.0, {a}, -1});
  g.hold(Claimant::worksets, 4_MiB, d, d);
  g.hold(Claimant::worksets, 1_MiB, a, b);
  const auto r = simulate(g);
  CHECK(r.peak_of(Claimant::worksets) == 1_MiB);
  CHECK(r.gpu_peak == 1_MiB);
}
