// What the CUDA layers of src/model share: the bf16 GEMM through cuBLAS (row-major, fp32
// accumulation) with its status turned into an oom::Error naming the layer and the step, and the
// Carver that hands out aligned pieces of one caller-given buffer (or only counts them).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom::detail {

inline void check_cublas(cublasStatus_t status, std::string_view owner, std::string_view step) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(Errc::cublas, fmt::format("{}: {} failed: {}", owner, step, cublasGetStatusString(status)));
}

/// Row-major C (m, n) = op(A) op(B) + beta C with A, B bf16, fp32 accumulation, C bf16 or fp32.
/// A is (m, k) (lda), or stored (k, m) with trans_a; B is (k, n), or stored (n, k) with trans_b.
/// cuBLAS is column-major: it computes C^T = op(B)^T op(A)^T.
inline void gemm_bf16(cublasHandle_t blas, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                      const void* a, std::int64_t lda, const void* b, std::int64_t ldb, void* c, cudaDataType_t c_type,
                      std::int64_t ldc, float beta, std::string_view owner, std::string_view step) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f;
  check_cublas(cublasGemmEx(blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                     static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF,
                     static_cast<int>(lda), &beta, c, c_type, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        owner, step);
}

inline constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

/// Hands out 256-byte aligned sub-buffers of one block; with a null base it only counts (sizing).
/// Two phases of a call that never hold their buffers at once share storage: carve the first,
/// rewind() to the mark() taken before it, carve the second; size() covers the longer.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(std::int64_t count) {
    return static_cast<T*>(take_bytes(static_cast<std::size_t>(count) * sizeof(T)));
  }
  void* take_bytes(std::size_t bytes) {
    offset_ = align_up(offset_);
    void* p = base_ ? base_ + offset_ : nullptr;
    offset_ += bytes;
    end_ = std::max(end_, offset_);
    return p;
  }
  [[nodiscard]] std::size_t mark() const { return align_up(offset_); }
  void rewind(std::size_t at) { offset_ = at; }
  [[nodiscard]] std::size_t size() const { return align_up(end_); }

 private:
  char* base_;
  std::size_t offset_ = 0, end_ = 0;
};

}  // namespace oom::detail
