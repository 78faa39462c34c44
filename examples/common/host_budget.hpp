// The host budget oom-train plans with when --host-mem is not given (oom-plan uses it to say what
// oom-train would run).
#pragma once

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"  // fmt::formatter<Bytes>
#include "oom/model/model_spec.hpp"
#include "oom/plan/machine_profile.hpp"

namespace oom::examples {

/// The profile's host memory less what the trainer holds beside the plan's memory (the fp32 initial
/// weights while the model is built: 19.1 GiB for the 5.13B model) and headroom for the process and
/// the OS (a tenth of it, at least 4 GiB). With the whole profile as its budget, the 5.13B model at
/// 512K on the H200 planned 94 GiB of pinned memory beside those 19.1 GiB on a 125 GiB host.
struct HostBudget {
  Bytes budget, initial_weights, headroom;
};
/// Errc::out_of_budget when nothing is left.
inline HostBudget default_host_budget(const MachineProfile& profile, const ModelSpec& spec) {
  const Bytes init{spec.total_parameters() * sizeof(float)};
  const Bytes headroom{std::max<std::uint64_t>(profile.host_memory.count() / 10, std::uint64_t{4} << 30)};
  if (profile.host_memory.count() <= init.count() + headroom.count())
    OOM_THROW(Errc::out_of_budget, fmt::format("host memory {} (profile {}) holds no more than the initial weights ({}) and {} of headroom; "
                                               "give --host-mem to plan anyway", profile.host_memory, profile.name, init, headroom));
  return {Bytes{profile.host_memory.count() - init.count() - headroom.count()}, init, headroom};
}

}  // namespace oom::examples
