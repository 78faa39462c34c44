// HostExecutor: the LayerExecutor on the HostBackend, the reference: a stack of layers computed on
// the CPU in "device" memory that is a budgeted host arena, streamed, offloaded, recomputed and
// updated as the Plan says (runtime/layer_executor.hpp). Its losses may be CPU code (HostLossFn),
// and step(input, target) trains towards targets with 0.5 x mean squared error.
#pragma once

#include "oom/runtime/host_backend.hpp"
#include "oom/runtime/layer_executor.hpp"

namespace oom {

template <executor_layer L>
using HostExecutor = LayerExecutor<L, HostBackend>;

// The names from before the executor was generic (2026-12-05), for code written against them.
using HostLayerContext [[deprecated("renamed oom::LayerContext")]] = LayerContext;
using HostExecutorOptions [[deprecated("renamed oom::LayerExecutorOptions")]] = LayerExecutorOptions;
template <class L>
concept host_layer = executor_layer<L>;

}  // namespace oom
