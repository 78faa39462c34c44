// Checked CUDA runtime and cuBLAS calls: a failure throws oom::Error with the call's text, the
// library's error string, file and line; a kernel launcher's refusal (cudaErrorInvalidValue with a
// reason, oom/kernels/refusal.hpp) throws Errc::invalid_argument with the reason instead. Needs the
// CUDA toolkit's headers (link oom::cuda).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "oom/core/error.hpp"
#include "oom/kernels/refusal.hpp"

#include <string_view>

namespace oom::detail {
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line);
/// A launcher's failed status as oom::Error: Errc::cuda "<what> failed: <name> (<text>)", or for
/// a launcher's refusal Errc::invalid_argument "<what> refused: <reason>".
[[noreturn]] void throw_launch_error(cudaError_t status, std::string_view what);
/// A layer's check of one launcher's status: a success forgets any refusal reason left on this
/// thread (so none is blamed on a later step's unrelated error); a failure throws as
/// throw_launch_error, naming "<owner>: <step>".
void check_launch(cudaError_t status, std::string_view owner, std::string_view step);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line);
}  // namespace oom::detail

#define OOM_CUDA_CHECK(expr)                                                                 \
  do {                                                                                       \
    ::oom::kernels::clear_refusal();                                                         \
    const cudaError_t oom_status_ = (expr);                                                  \
    if (oom_status_ != cudaSuccess) ::oom::detail::throw_cuda_error(oom_status_, #expr, __FILE__, __LINE__); \
  } while (0)

#define OOM_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                       \
    const cublasStatus_t oom_status_ = (expr);                                               \
    if (oom_status_ != CUBLAS_STATUS_SUCCESS)                                                \
      ::oom::detail::throw_cublas_error(oom_status_, #expr, __FILE__, __LINE__);             \
  } while (0)

/// After a kernel launch: reports a bad launch configuration at the launch site.
#define OOM_CUDA_CHECK_LAUNCH() OOM_CUDA_CHECK(cudaGetLastError())
