// Umbrella header: the host-side vocabulary and the plug-in contracts of OOM, and what a layer
// author plans and trains with on the host: the machine profile, both planners, the layer
// executor on the host backend (HostExecutor). CUDA-specific headers (oom/core/cuda_check.hpp,
// oom/cuda/..., oom/runtime/cuda_layer_executor.hpp, oom/runtime/cuda_causal_lm.hpp) are
// included separately, with oom::cuda linked.
#pragma once

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/core/memory_space.hpp"
#include "oom/core/numeric.hpp"
#include "oom/core/nvtx.hpp"
#include "oom/model/segment.hpp"
#include "oom/model/workload.hpp"
#include "oom/concepts/tensor.hpp"
#include "oom/concepts/layer.hpp"
#include "oom/concepts/residency_policy.hpp"
#include "oom/concepts/retention_policy.hpp"
#include "oom/concepts/partitioner.hpp"
#include "oom/concepts/cost_model.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/plan/dependency_partitioner.hpp"
#include "oom/plan/machine_profile.hpp"
#include "oom/plan/planner.hpp"
#include "oom/plan/layer_stack_planner.hpp"
#include "oom/runtime/host_executor.hpp"
