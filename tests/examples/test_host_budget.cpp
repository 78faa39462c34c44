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

namespace {
/// A directory that mimics /proc/self/cgroup and /sys/fs/cgroup for cgroup_memory_limit.
struct FakeRoot {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("oom-cgroup-" + std::to_string(::getpid()));
  FakeRoot() { std::filesystem::remove_all(dir); }
  ~FakeRoot() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  void write(const std::string& path, const std::string& text) const {
    const auto file = dir / path;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
};
}  // namespace

TEST_CASE("cgroup memory limits: v2 ancestors, v1 hierarchical, the mount's root; 'max' and namespaced paths are no limit") {
  using oom::examples::cgroup_memory_limit;
  {
    const FakeRoot r;  // nothing there: no limit
    CHECK_FALSE(cgroup_memory_limit(r.dir).has_value());
  }
  {
    const FakeRoot r;  // v2, the limit on a parent (a batch job's step), none on the process's own cgroup
    r.write("proc/self/cgroup", "0::/job_7/step_0/task_1\n");
    r.write("sys/fs/cgroup/job_7/step_0/task_1/memory.max", "max\n");
    r.write("sys/fs/cgroup/job_7/step_0/memory.max", "4831838208\n");
    r.write("sys/fs/cgroup/job_7/memory.max", "9663676416\n");
    REQUIRE(cgroup_memory_limit(r.dir).has_value());
    CHECK(*cgroup_memory_limit(r.dir) == Bytes{4831838208});
  }
  {
    const FakeRoot r;  // v2 in a container: its own cgroup is the mount's root
    r.write("proc/self/cgroup", "0::/\n");
    r.write("sys/fs/cgroup/memory.max", "25769803776\n");
    CHECK(cgroup_memory_limit(r.dir) == std::optional<Bytes>(24_GiB));
  }
  {
    const FakeRoot r;  // v2 outside the namespace's root: the mount's root only
    r.write("proc/self/cgroup", "0::/../../elsewhere\n");
    r.write("sys/fs/cgroup/memory.max", "max\n");
    CHECK_FALSE(cgroup_memory_limit(r.dir).has_value());
  }
  {
    const FakeRoot r;  // v1 with a combined controller line; the hierarchical limit counts a parent's
    r.write("proc/self/cgroup", "11:cpu,cpuacct:/x\n4:memory,hugetlb:/slurm/job_3\n");
    r.write("sys/fs/cgroup/memory/slurm/job_3/memory.limit_in_bytes", "9223372036854771712\n");
    r.write("sys/fs/cgroup/memory/slurm/job_3/memory.stat", "cache 0\nhierarchical_memory_limit 2147483648\nrss 0\n");
    CHECK(cgroup_memory_limit(r.dir) == std::optional<Bytes>(2_GiB));
  }
}

TEST_CASE("a small machine's default budget keeps room for the plan: headroom at most a quarter of it") {
  const oom::MachineProfile h200 = oom::MachineProfile::h200(1);
  const auto hb = default_host_budget(h200, 15_MiB, 3_GiB);  // a 3 GiB container, the quick start's tiny model
  CHECK(hb.headroom == Bytes{(3_GiB).count() / 4});
  CHECK(hb.budget == 3_GiB - 15_MiB - hb.headroom);
  CHECK(default_host_budget(h200, 15_MiB, 16_GiB).headroom == 4_GiB);  // from 16 GiB the 4 GiB floor holds
  CHECK(default_host_budget(h200, 15_MiB, 60_GiB).headroom == 6_GiB);
}
