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
