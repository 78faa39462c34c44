// The micro-batch a plan may run (see oom/model/workload.hpp).
#include "oom/model/workload.hpp"

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom {

void refuse_unrunnable_micro_batch(const Workload& w) {
  if (w.sequences < 1 || w.seq_len < 1)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("the plan's micro-batch has {} sequences of {} tokens (needs at least 1 of 1)", w.sequences, w.seq_len));
  if (!w.within_limit())
    OOM_THROW(Errc::invalid_argument, fmt::format("the plan's micro-batch of {} sequences of {} tokens is more than the {} tokens a "
                                                  "micro-batch may hold", w.sequences, w.seq_len, max_workload_tokens));
}

}  // namespace oom
