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
inline HostBudget default_host_budget(const MachineProfile& profile, Bytes held_while_building) {
  const Bytes headroom{std::max<std::uint64_t>(profile.host_memory.count() / 10, std::uint64_t{4} << 30)};
  if (profile.host_memory.count() <= held_while_building.count() + headroom.count())
    OOM_THROW(Errc::out_of_budget, fmt::format("host memory {} (profile {}) holds no more than what building the model holds ({}) and {} of headroom; "
                                               "give --host-mem to plan anyway", profile.host_memory, profile.name, held_while_building, headroom));
  return {Bytes{profile.host_memory.count() - held_while_building.count() - headroom.count()}, held_while_building, headroom};
}

}  // namespace oom::examples
