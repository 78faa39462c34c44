// Error construction for the checked CUDA/cuBLAS/NCCL calls (host C++, so fmt is available).
#include <fmt/format.h>

#include "oom/core/cuda_check.hpp"
#include "oom/core/nccl_check.hpp"

namespace oom::detail {

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  throw Error(Errc::cuda,
              fmt::format("{} returned {} ({})", expr, cudaGetErrorName(status), cudaGetErrorString(status)),
              file, line);
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
