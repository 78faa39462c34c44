// Umbrella header: the host-side vocabulary and the plug-in contracts of OOM.
// CUDA-specific headers (oom/core/cuda_check.hpp, oom/cuda/...) are included separately.
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
