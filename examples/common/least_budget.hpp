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
/// budget Planner::least_gpu_budget finds a plan at, as a `--gpu-mem` value that plans.
inline PlanSet plan_or_say_least(const Planner& planner, const PlanRequest& req) {
  try {
    return planner.plan(req);
  } catch (const Error& e) {
    if (e.code() != Errc::out_of_budget) throw;
    const auto least = planner.least_gpu_budget(req);
    const std::string found =
        !least ? fmt::format("; no GPU budget up to 1 PiB finds a plan within the host budget of {}", req.host_budget)
               : fmt::format("; a search finds plans from {} per GPU (--gpu-mem {}MiB)", *least, least->count() >> 20);
    throw Error(e.code(), e.message() + found, e.file(), e.line());
  }
}

}  // namespace oom::examples
