// Private helper of the expert GEMM launchers: row-major GEMMs (as detail::gemm_rm) through
// cuBLASLt with one algorithm per size bucket, chosen once. The per-expert GEMMs see a new row
// count almost every call (the routing changes every step), and cuBLAS chooses an algorithm for
// every shape it has not seen (its heuristics cache is keyed by the exact sizes), on the host,
// while the GPU may be waiting for the launch. Here the varying sizes (m, and k for the weight
// gradients) are rounded up to a power of two (16 at least) and the algorithm found for the
// rounded problem is reused for every problem in the bucket; a problem the algorithm refuses
// falls back to cublasGemmEx. Results are deterministic (one algorithm per bucket, chosen by
// sizes and alignments only) but not the same bits as cublasGemmEx's choice. Not installed.
#pragma once

#include <cublasLt.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <optional>
#include <tuple>

#include "moe_blas.cuh"

namespace oom::kernels::detail {

class BucketedGemm {
 public:
  BucketedGemm() = default;
  BucketedGemm(const BucketedGemm&) = delete;
  BucketedGemm& operator=(const BucketedGemm&) = delete;
  ~BucketedGemm() {
    if (lt_ != nullptr) cublasLtDestroy(lt_);
  }

  /// Row-major C (m, n) = op(A) op(B) + beta C as gemm_rm, on `stream` with `workspace`
  /// (`workspace_bytes` may be 0: algorithms that need none). `fallback` (a cuBLAS handle already
  /// bound to `stream` and its workspace) runs what no bucket algorithm takes.
  cudaError_t run(cublasHandle_t fallback, cudaStream_t stream, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                  std::int64_t k, const void* a, std::int64_t lda, const void* b, std::int64_t ldb, void* c,
                  cudaDataType_t c_type, std::int64_t ldc, float beta, void* workspace, std::size_t workspace_bytes) {
    if (m == 0 || n == 0) return cudaSuccess;
    if (lt_ == nullptr) OOM_KERNEL_TRY(to_cuda_error(cublasLtCreate(&lt_)));
    // cuBLAS is column-major: C^T (n, m) = op(B)^T (n, k) op(A)^T (k, m), as gemm_rm.
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const std::uint32_t align = std::min({alignment(a, lda, 2), alignment(b, ldb, 2), alignment(c, ldc, c_type == CUDA_R_32F ? 4 : 2)});
    const Key key{trans_a, trans_b, bucket(m), n, bucket(k), lda, ldb, ldc, c_type, beta != 0.0f, align, workspace_bytes};
    auto it = algos_.find(key);
    if (it == algos_.end()) it = algos_.emplace(key, choose(key)).first;
    if (it->second) {
      Problem p(op_b, op_a, n, m, k, ldb, lda, ldc, c_type);
      const float alpha = 1.0f;
      if (p.ok &&
          cublasLtMatmul(lt_, p.desc, &alpha, b, p.a, a, p.b, &beta, c, p.c, c, p.c, &*it->second, workspace, workspace_bytes,
                         stream) == CUBLAS_STATUS_SUCCESS)
        return cudaSuccess;
      ++fallbacks_;
    }
    return gemm_rm(fallback, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, c_type, ldc, beta);
  }

  /// Calls that fell back to cublasGemmEx although their bucket had an algorithm.
  [[nodiscard]] std::uint64_t fallbacks() const { return fallbacks_; }
  /// Buckets seen (each cost one heuristic query).
  [[nodiscard]] std::size_t buckets() const { return algos_.size(); }

  static std::int64_t bucket(std::int64_t x) { return x <= 16 ? 16 : static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(x))); }

 private:
  struct Key {
    bool trans_a, trans_b;
    std::int64_t m, n, k, lda, ldb, ldc;
    cudaDataType_t c_type;
    bool accumulate;
    std::uint32_t align;
    std::size_t workspace_bytes;
    auto tie() const { return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, c_type, accumulate, align, workspace_bytes); }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };

  /// The column-major descriptors of one call: C^T (rows n, cols m) from A' = B stored (n x k or
  /// k x n) and B' = A stored (k x m or m x k).
  struct Problem {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    bool ok = false;
    Problem(cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t rows, std::int64_t cols, std::int64_t k, std::int64_t lda,
            std::int64_t ldb, std::int64_t ldc, cudaDataType_t c_type) {
      const std::uint64_t ar = op_a == CUBLAS_OP_N ? rows : k, ac = op_a == CUBLAS_OP_N ? k : rows;
      const std::uint64_t br = op_b == CUBLAS_OP_N ? k : cols, bc = op_b == CUBLAS_OP_N ? cols : k;
      ok = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, ar, ac, lda) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, br, bc, ldb) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&c, c_type, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ldc) ==
               CUBLAS_STATUS_SUCCESS;
    }
    Problem(const Problem&) = delete;
    Problem& operator=(const Problem&) = delete;
    ~Problem() {
      if (c) cublasLtMatrixLayoutDestroy(c);
      if (b) cublasLtMatrixLayoutDestroy(b);
      if (a) cublasLtMatrixLayoutDestroy(a);
      if (desc) cublasLtMatmulDescDestroy(desc);
    }
  };

  /// The largest power of two (at most 256) dividing the pointer and the row pitch in bytes.
  static std::uint32_t alignment(const void* p, std::int64_t ld, std::size_t element_bytes) {
    const auto bits = reinterpret_cast<std::uintptr_t>(p) | (static_cast<std::uintptr_t>(ld) * element_bytes) | 256u;
    return static_cast<std::uint32_t>(bits & (~bits + 1));
  }

  /// One heuristic query for the bucket's own sizes (leading dimensions widened where the rounded
  /// sizes need it); nullopt when cuBLASLt offers nothing.
  std::optional<cublasLtMatmulAlgo_t> choose(const Key& key) const {
    const cublasOperation_t op_b = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const std::int64_t rows = key.n, cols = key.m, k = key.k;
    const std::int64_t lda = std::max(key.ldb, op_b == CUBLAS_OP_N ? rows : k);
    const std::int64_t ldb = std::max(key.lda, op_a == CUBLAS_OP_N ? k : cols);
    const std::int64_t ldc = std::max(key.ldc, rows);
    Problem p(op_b, op_a, rows, cols, k, lda, ldb, ldc, key.c_type);
    if (!p.ok) return std::nullopt;
    cublasLtMatmulPreference_t pref = nullptr;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return std::nullopt;
    const std::size_t ws = key.workspace_bytes;
    const std::uint32_t align = key.align;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const bool ok =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found) == CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulPreferenceDestroy(pref);
    if (!ok || found < 1 || result.state != CUBLAS_STATUS_SUCCESS) return std::nullopt;
    return result.algo;
  }

  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, std::optional<cublasLtMatmulAlgo_t>> algos_;
  std::uint64_t fallbacks_ = 0;
};

}  // namespace oom::kernels::detail
