// The host budget oom-train plans with when --host-mem is not given (oom-plan uses it to say what
// oom-train would run).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
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
  // A tenth, at least 4 GiB, but never more than a quarter: a 3 GiB container would otherwise hold
  // nothing for the plan (the quick start's tiny model needs a few MiB).
  const std::uint64_t floor = std::min<std::uint64_t>(std::uint64_t{4} << 30, memory.count() / 4);
  const Bytes headroom{std::max<std::uint64_t>(memory.count() / 10, floor)};
  if (memory.count() <= held_while_building.count() + headroom.count())
    OOM_THROW(Errc::out_of_budget,
              fmt::format("host memory {} ({}) holds no more than what building the model holds ({}) and {} of headroom; "
                          "give --host-mem to plan anyway",
                          memory, host_memory ? std::string("this machine's") : "profile " + profile.name, held_while_building, headroom));
  return {Bytes{memory.count() - held_while_building.count() - headroom.count()}, held_while_building, headroom};
}

/// The least memory limit of the memory cgroups this process is in, read under `root` (the
/// filesystem root; tests pass a directory that mimics /proc and /sys): cgroup v2's memory.max of
/// its cgroup and of every ancestor (a limit is often set on a parent: a batch job's step, a
/// systemd slice), cgroup v1's hierarchical_memory_limit (memory.stat, which counts the ancestors)
/// or memory.limit_in_bytes, at the path /proc/self/cgroup names and at the mount's root, as a
/// container sees its own cgroup. nullopt where none is set or readable ("max"; v1's "no limit"
/// is ~2^63, taken as read, above any machine).
inline std::optional<Bytes> cgroup_memory_limit(const std::filesystem::path& root = "/") {
  std::optional<Bytes> limit;
  const auto lower = [&](const std::string& value) {
    if (value.empty() || value.size() >= 20 || value.find_first_not_of("0123456789") != std::string::npos) return;
    const Bytes b{std::stoull(value)};
    if (b.count() > 0 && (!limit || b < *limit)) limit = b;
  };
  const auto read_value = [&](const std::filesystem::path& file) {
    std::ifstream in(file);
    std::string value;
    if (in >> value) lower(value);
  };
  const auto read_stat = [&](const std::filesystem::path& file) {  // v1 memory.stat's hierarchical limit
    std::ifstream in(file);
    for (std::string key, value; in >> key >> value;)
      if (key == "hierarchical_memory_limit") lower(value);
  };
  const std::filesystem::path sys = root / "sys/fs/cgroup";
  const auto under = [](const std::filesystem::path& base, const std::string& path) {
    return path.empty() || path == "/" ? base : base / std::filesystem::path(path).relative_path();
  };
  std::ifstream cgroups(root / "proc/self/cgroup");  // "0::/path" (v2), "N:memory[,...]:/path" (v1)
  for (std::string line; std::getline(cgroups, line);) {
    const auto first = line.find(':'), second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
    // Outside the cgroup namespace's root ("/../.."): not under this mount; its root is read below.
    if (path.find("..") != std::string::npos) continue;
    if (line.compare(0, first, "0") == 0 && controllers.empty()) {
      // v2: this cgroup and each ancestor up to the mount's root.
      for (std::filesystem::path dir = under(sys, path);; dir = dir.parent_path()) {
        read_value(dir / "memory.max");
        if (dir == sys || dir.parent_path() == dir) break;
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      const std::filesystem::path dir = under(sys / "memory", path);
      read_stat(dir / "memory.stat");
      read_value(dir / "memory.limit_in_bytes");
    }
  }
  read_value(sys / "memory.max");
  read_stat(sys / "memory/memory.stat");
  read_value(sys / "memory/memory.limit_in_bytes");
  return limit;
}

/// The memory this process may use on this machine: its physical memory, or its memory cgroups'
/// least limit where that is lower (cgroup_memory_limit); nullopt where neither can be read.
inline std::optional<Bytes> machine_host_memory() {
  std::optional<Bytes> memory = cgroup_memory_limit();
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    const Bytes physical{static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page)};
    if (!memory || physical < *memory) memory = physical;
  }
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
