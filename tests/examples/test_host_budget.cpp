// oom-train's default host budget (examples/common/host_budget.hpp): from the profile's host
// memory, or this machine's where it has less.
#include <doctest/doctest.h>

#include <unistd.h>

#include <fstream>
#include <optional>
#include <string>

#include "common/host_budget.hpp"
#include "oom/core/bytes.hpp"
#include "oom/plan/machine_profile.hpp"

using namespace oom::literals;
using oom::Bytes;
using oom::examples::default_host_budget;
using oom::examples::host_memory_basis;
using oom::examples::machine_host_memory;

TEST_CASE("the default host budget starts from the profile's memory, or this machine's where it has less") {
  const oom::MachineProfile h200 = oom::MachineProfile::h200(1);  // 125 GiB of host
  CHECK(host_memory_basis(h200, std::nullopt) == h200.host_memory);
  CHECK(host_memory_basis(h200, 24_GiB) == 24_GiB);
  CHECK(host_memory_basis(h200, 2_TiB) == h200.host_memory);
  // The budget: the basis less what building holds and a tenth of it, at least 4 GiB.
  CHECK(default_host_budget(h200, 1_GiB).budget == h200.host_memory - 1_GiB - Bytes{h200.host_memory.count() / 10});
  CHECK(default_host_budget(h200, 1_GiB, 24_GiB).budget == 24_GiB - 1_GiB - 4_GiB);
  CHECK(default_host_budget(h200, 1_GiB, 100_GiB).budget == 100_GiB - 1_GiB - 10_GiB);
  // Nothing left: refused, naming whose memory it was.
  try {
    (void)default_host_budget(h200, 20_GiB, 24_GiB);
    FAIL("no error");
  } catch (const oom::Error& e) {
    CHECK(e.code() == oom::Errc::out_of_budget);
    CHECK(std::string(e.what()).find("this machine's") != std::string::npos);
  }
  try {
    (void)default_host_budget(h200, 120_GiB);
    FAIL("no error");
  } catch (const oom::Error& e) {
    CHECK(std::string(e.what()).find("profile " + h200.name) != std::string::npos);
  }
}

TEST_CASE("this machine's host memory: at most its physical memory, and at least what the process holds") {
  const std::optional<Bytes> memory = machine_host_memory();
  REQUIRE(memory.has_value());
  const Bytes physical{static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE))};
  CHECK(*memory <= physical);
  std::ifstream status("/proc/self/status");
  std::uint64_t rss_kib = 0;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) rss_kib = std::stoull(line.substr(6));
  CHECK(*memory > Bytes{rss_kib * 1024});
}
