// Where a running step is, for progress reports on long steps (a 512K-token step of the 5.13B
// model takes minutes): the executors call a LayerProgressFn before issuing each layer's forward
// and backward, on the thread that runs step().
#pragma once

#include <functional>

namespace oom {

struct LayerProgress {
  bool backward = false;  ///< false: the forward pass
  int layer = 0;          ///< the layer about to be issued
  int layers = 0;         ///< decoder layers in the model
  int micro_batch = 0;    ///< of the step's micro-batches
};

/// Called on the step's thread, so it must be quick (print, store). Work is issued asynchronously:
/// the CUDA executor's thread waits for each layer's expert counts, so it is at most about one
/// layer ahead of the GPU; the host executor's may run further ahead of its streams.
using LayerProgressFn = std::function<void(const LayerProgress&)>;

}  // namespace oom
