// CudaLayerExecutor: the LayerExecutor on the CudaBackend: a stack of the caller's own layers
// trained on one GPU as a Plan says (runtime/layer_executor.hpp), the same schedule as the
// HostExecutor's, so every plan computes the resident plan's step. A layer's forward and backward
// enqueue CUDA work on LayerContext::stream (a cudaStream_t) over device pointers and never
// synchronize; the loss is a DeviceLossFn. Link oom::cuda. docs/runtime.md, "Your own layers".
#pragma once

#include "oom/runtime/cuda_backend.hpp"
#include "oom/runtime/layer_executor.hpp"

namespace oom {

template <executor_layer L>
using CudaLayerExecutor = LayerExecutor<L, CudaBackend>;

}  // namespace oom
