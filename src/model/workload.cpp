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

std::array<Bytes, activation_class_count> saved_bytes_by_class(const LayerCost& cost, std::string_view where) {
  std::array<Bytes, activation_class_count> saved{};
  for (const auto& a : cost.activations) {
    if (a.cls == ActivationClass::layer_boundary)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("{}: declares a layer_boundary activation; a layer's boundary is the previous layer's "
                            "LayerCost::output (the first layer's: its own), not one of its activations",
                            where));
    saved[static_cast<std::size_t>(a.cls)] += a.bytes;
  }
  return saved;
}

}  // namespace oom
