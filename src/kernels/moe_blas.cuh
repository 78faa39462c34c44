// Private helpers of the MoE kernels' .cu files: row-major cuBLAS GEMMs with bf16 inputs and fp32
// accumulation, cuBLAS statuses mapped onto cudaError_t (the launchers' one error type), and
// small block reductions. Not installed; no fmt (nvcc TUs).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace oom::kernels::detail {

/// cuBLAS status -> cudaError_t, so every launcher reports one error type. The mapping keeps the
/// distinctions a caller acts on: bad arguments, out of memory, unsupported, failed execution. (No
/// refusal reason for INVALID_VALUE: the launchers check their arguments first, so cuBLAS refusing
/// one is an internal failure, reported as a CUDA error, not as the caller's bad argument.)
inline cudaError_t to_cuda_error(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return cudaSuccess;
    case CUBLAS_STATUS_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUBLAS_STATUS_ALLOC_FAILED: return cudaErrorMemoryAllocation;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: return cudaErrorNotSupported;
    case CUBLAS_STATUS_NOT_INITIALIZED: return cudaErrorInitializationError;
    case CUBLAS_STATUS_EXECUTION_FAILED: return cudaErrorLaunchFailure;
    default: return cudaErrorUnknown;
  }
}

#define OOM_KERNEL_TRY(expr)                       \
  do {                                             \
    const cudaError_t oom_kernel_status_ = (expr); \
    if (oom_kernel_status_ != cudaSuccess) return oom_kernel_status_; \
  } while (0)

/// Row-major C (M, N) = alpha op(A) op(B) + beta C, A/B bf16, fp32 accumulation; C bf16 or fp32.
/// A is (M, K) with leading dimension lda, or stored (K, M) with trans_a; B is (K, N) or stored
/// (N, K) with trans_b. cuBLAS is column-major, so this computes C^T = op(B)^T op(A)^T.
inline cudaError_t gemm_rm(cublasHandle_t h, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                           const void* a, std::int64_t lda, const void* b, std::int64_t ldb, void* c, cudaDataType_t c_type,
                           std::int64_t ldc, float beta, float alpha = 1.0f) {
  if (m == 0 || n == 0) return cudaSuccess;
  return to_cuda_error(cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF,
                                    static_cast<int>(ldb), a, CUDA_R_16BF, static_cast<int>(lda), &beta, c, c_type,
                                    static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// Sum over a block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
/// Fixed reduction order: deterministic run to run.
template <class T>
__device__ T block_sum(T v, T* scratch /* >= 32 */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may be in use by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

inline std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace oom::kernels::detail
