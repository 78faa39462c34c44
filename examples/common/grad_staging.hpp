// The --grad-staging pairs oom-train refuses on the CUDA backend, in one place: oom-plan refuses
// them too, so that none of its lines says oom-train would run them.
#pragma once

#include <cstdint>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom::examples {

/// A pinned gradient staging ring (`grad_staging` > 0 layers; 0: one buffer per parameter) where
/// every streamed gradient must be staged whole: with clipping (`max_grad_norm` > 0) or several
/// micro-batches. Throws invalid_argument naming both flags.
inline void refuse_grad_staging_pairs(std::uint64_t grad_staging, double max_grad_norm, std::uint64_t micro_batches) {
  if (grad_staging == 0) return;
  if (max_grad_norm > 0)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("--grad-staging {} with --max-grad-norm: clipping defers every update to the end of the backward, so the "
                          "gradients are staged one pinned buffer per parameter; oom-train refuses the pair (leave --grad-staging "
                          "out, or pass 0)",
                          grad_staging));
  if (micro_batches > 1)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("--grad-staging {} with --micro-batches {}: each layer's gradients accumulate in their staging until the last "
                          "micro-batch, so they are staged one pinned buffer per parameter; oom-train refuses the pair (leave "
                          "--grad-staging out, or pass 0)",
                          grad_staging, micro_batches));
}

}  // namespace oom::examples
