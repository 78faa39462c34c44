// The planner's out_of_budget error with the least GPU budget a search finds a plan at: the error's
// own figure is an estimate (18% low for Qwen3-30B-A3B at 4K), and followed as written it found no
// plan. oom-plan and oom-train both say it.
#pragma once

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"  // fmt::formatter<Bytes>
#include "oom/plan/planner.hpp"

namespace oom::examples {

/// `planner.plan(req)`; where nothing fits, the out_of_budget error again with the least GPU
/// budget Planner::least_gpu_budget finds a plan at, as a `--gpu-mem` value that plans, searched
/// up to the profile's GPU memory: past it, the host budget is what to raise (a search without
/// that bound had told a 16 GiB host to take 2.09 TiB of GPU memory).
inline PlanSet plan_or_say_least(const Planner& planner, const PlanRequest& req) {
  try {
    return planner.plan(req);
  } catch (const Error& e) {
    if (e.code() != Errc::out_of_budget) throw;
    const Bytes most = planner.profile().gpu_memory;
    const auto least = req.gpu_budget < most ? planner.least_gpu_budget(req, 0.005, most) : std::nullopt;
    const std::string found =
        least ? fmt::format("; a search finds plans from {} per GPU (--gpu-mem {}MiB)", *least, least->count() >> 20)
              : fmt::format("; no GPU budget up to the {} profile's {} finds a plan within the host budget of {} (--host-mem)",
                            planner.profile().name, most, req.host_budget);
    throw Error(e.code(), e.message() + found, e.file(), e.line());
  }
}

}  // namespace oom::examples
