// Error construction for the checked CUDA/cuBLAS/NCCL calls (host C++, so fmt is available).
#include <fmt/format.h>

#include <utility>

#include "../kernels/refuse.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/nccl_check.hpp"
#include "oom/kernels/refusal.hpp"

namespace oom::kernels {

const char* last_refusal() noexcept { return detail::refusal_text().c_str(); }
void clear_refusal() noexcept { detail::refusal_text().clear(); }
std::string take_refusal() { return std::exchange(detail::refusal_text(), std::string{}); }

}  // namespace oom::kernels

namespace oom::detail {
namespace {

/// A launcher's refusal reason for `status` (taken), "" when it is no refusal.
std::string refusal_for(cudaError_t status) { return status == cudaErrorInvalidValue ? kernels::take_refusal() : std::string{}; }

}  // namespace

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  // A launcher's refusal is a bad argument, and says which.
  if (std::string why = refusal_for(status); !why.empty())
    throw Error(Errc::invalid_argument, fmt::format("{} returned {}: {}", expr, cudaGetErrorName(status), why), file,
                line);
  throw Error(Errc::cuda,
              fmt::format("{} returned {} ({})", expr, cudaGetErrorName(status), cudaGetErrorString(status)),
              file, line);
}

void throw_launch_error(cudaError_t status, std::string_view what) {
  if (std::string why = refusal_for(status); !why.empty())
    throw Error(Errc::invalid_argument, fmt::format("{} refused: {}", what, why));
  throw Error(Errc::cuda, fmt::format("{} failed: {} ({})", what, cudaGetErrorName(status), cudaGetErrorString(status)));
}

void check_launch(cudaError_t status, std::string_view owner, std::string_view step) {
  if (status == cudaSuccess) {
    kernels::clear_refusal();
    return;
  }
  throw_launch_error(status, fmt::format("{}: {}", owner, step));
}

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  throw Error(Errc::cublas, fmt::format("{} returned {}", expr, cublasGetStatusString(status)), file, line);
}

void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  throw Error(Errc::nccl,
              fmt::format("{} returned {}{}{}", expr, ncclGetErrorString(status), last && *last ? ": " : "",
                          last ? last : ""),
              file, line);
}

}  // namespace oom::detail
