// The AdamW state of one state segment, owned: what an executor exports and a checkpoint holds.
#pragma once

#include <vector>

namespace oom {

/// fp32 master weights and both AdamW moments of one segment, each `parameters()` long; the
/// segment's tensors lie back to back in its TensorSpec order.
struct SegmentOptimizerState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

}  // namespace oom
