// The host budget oom-train plans with when --host-mem is not given (oom-plan uses it to say what
// oom-train would run).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"  // fmt::formatter<Bytes>
#include "oom/model/model_spec.hpp"
#include "oom/plan/machine_profile.hpp"

namespace oom::examples {

/// The profile's host memory less what the trainer holds beside the plan's memory while the model is
/// built (`held_while_building`: the host model takes the fp32 initial weights whole, 19.1 GiB for the
/// 5.13B model; the CUDA model reads them a segment at a time, CudaCausalLm::build_buffer_bytes) and
/// headroom for the process and the OS (a tenth of it, at least 4 GiB). With the whole profile as its
/// budget, the 5.13B model at 512K on the H200 planned 94 GiB of pinned memory, which did not fit a
/// 125 GiB host beside the whole initial weights.
struct HostBudget {
  Bytes budget, held_while_building, headroom;
};
/// The initial weights whole, as the host model holds them while it is built.
inline Bytes whole_initial_weights(const ModelSpec& spec) { return Bytes{spec.total_parameters() * sizeof(float)}; }
/// Errc::out_of_budget when nothing is left.
/// `host_memory`: what it starts from (the profile's host memory, or host_memory_basis's).
inline HostBudget default_host_budget(const MachineProfile& profile, Bytes held_while_building,
                                      std::optional<Bytes> host_memory = std::nullopt) {
  const Bytes memory = host_memory.value_or(profile.host_memory);
  const Bytes headroom{std::max<std::uint64_t>(memory.count() / 10, std::uint64_t{4} << 30)};
  if (memory.count() <= held_while_building.count() + headroom.count())
    OOM_THROW(Errc::out_of_budget,
              fmt::format("host memory {} ({}) holds no more than what building the model holds ({}) and {} of headroom; "
                          "give --host-mem to plan anyway",
                          memory, host_memory ? std::string("this machine's") : "profile " + profile.name, held_while_building, headroom));
  return {Bytes{memory.count() - held_while_building.count() - headroom.count()}, held_while_building, headroom};
}

/// The memory this process may use on this machine: the physical memory, or its memory cgroup's
/// limit where one is set below it (a container's: cgroup v2 memory.max or v1
/// memory.limit_in_bytes, at the process's cgroup path or at the mount's root as a container sees
/// it); nullopt where none can be read.
inline std::optional<Bytes> machine_host_memory() {
  std::optional<Bytes> memory;
  const auto lower = [&](Bytes b) {
    if (b.count() > 0 && (!memory || b < *memory)) memory = b;
  };
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) lower(Bytes{static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page)});
  const auto read_limit = [&](const std::string& file) {
    std::ifstream in(file);
    std::string value;  // "max" (v2) or a number; v1's "no limit" is ~2^63, above any machine
    if (in >> value && !value.empty() && value.size() < 20 && value.find_first_not_of("0123456789") == std::string::npos)
      lower(Bytes{std::stoull(value)});
  };
  std::ifstream cgroups("/proc/self/cgroup");  // "0::/path" (v2), "N:memory:/path" (v1)
  for (std::string line; std::getline(cgroups, line);) {
    if (line.rfind("0::", 0) == 0) {
      const std::string path = line.substr(3);
      read_limit("/sys/fs/cgroup" + (path == "/" ? std::string() : path) + "/memory.max");
    } else if (const auto at = line.find(":memory:"); at != std::string::npos) {
      const std::string path = line.substr(at + 8);
      read_limit("/sys/fs/cgroup/memory" + (path == "/" ? std::string() : path) + "/memory.limit_in_bytes");
    }
  }
  read_limit("/sys/fs/cgroup/memory.max");
  read_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  return memory;
}

/// The host memory oom-train's default budget starts from: the profile's, or this machine's where it
/// has less (a built-in profile describes the GPU machine it names, 125-250 GiB of host; planned on
/// a 23 GiB workstation, the 5.13B model's 66 GiB host peak passed the plan and failed its
/// allocations). `machine` nullopt: the profile's.
inline Bytes host_memory_basis(const MachineProfile& profile, std::optional<Bytes> machine) {
  return machine && *machine < profile.host_memory ? *machine : profile.host_memory;
}

}  // namespace oom::examples
