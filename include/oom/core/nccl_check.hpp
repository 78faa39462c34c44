// Checked NCCL calls: a failure throws oom::Error (Errc::nccl) with the call, NCCL's string and
// its last error message, file and line.
#pragma once

#include <nccl.h>

#include "oom/core/error.hpp"

namespace oom::detail {
[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line);
}  // namespace oom::detail

#define OOM_NCCL_CHECK(expr)                                                                  \
  do {                                                                                        \
    const ncclResult_t oom_status_ = (expr);                                                  \
    if (oom_status_ != ncclSuccess && oom_status_ != ncclInProgress)                          \
      ::oom::detail::throw_nccl_error(oom_status_, #expr, __FILE__, __LINE__);                \
  } while (0)
