// The grouped dW kernels (src/kernels/hopper/grouped_wgrad_wgmma.cu) alone at the 5.13B widths and
// T = 4096 (64 experts of R rows, C overwritten), both schedules, as ratios to one dense cuBLAS
// GEMM of the same FLOPs in the same run. Built from the product's file or a variant of it, to
// measure a change to one schedule without rebuilding the library:
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src -I src/kernels [-DWGRAD_SOURCE='"/tmp/variant.cu"'] scripts/diag/wgrad_schedules.cu -lcublas -o /tmp/ws
//   /tmp/ws [rows per expert, default 512]
#ifdef WGRAD_SOURCE
#include WGRAD_SOURCE
#else
#include "../../src/kernels/hopper/grouped_wgrad_wgmma.cu"
#endif

#include <cublas_v2.h>

#include <cstdlib>
#include <vector>

#include "diag_timing.cuh"

namespace hw = oom::kernels::hopper;

int main(int argc, char** argv) {
  const long long R = argc > 1 ? std::atoll(argv[1]) : 512, E = 64;
  cublasHandle_t blas;
  CK(cublasCreate(&blas));
  struct Op {
    const char* name;
    long long m, n;
  };
  for (const Op op : {Op{"down dW 2048 x 768", 2048, 768}, Op{"gate_up dW 1536 x 2048", 1536, 2048}}) {
    const long long N = E * R;
    __nv_bfloat16 *a, *b;
    float* c;
    CK(cudaMalloc(&a, N * op.m * 2));
    CK(cudaMalloc(&b, N * op.n * 2));
    CK(cudaMalloc(&c, E * op.m * op.n * 4));
    CK(cudaMemset(a, 0x3C, N * op.m * 2));
    CK(cudaMemset(b, 0x3C, N * op.n * 2));
    std::vector<hw::WgradProblem> problems;
    for (long long e = 0; e < E; ++e)
      problems.push_back({.a = reinterpret_cast<const oom::bf16*>(a + e * R * op.m), .b = reinterpret_cast<const oom::bf16*>(b + e * R * op.n),
                          .c = c + e * op.m * op.n, .rows = R});
    const float alpha = 1.0f, beta = 0.0f;
    const float dense = time_us([&] {
      CK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(op.n), static_cast<int>(op.m), static_cast<int>(N), &alpha, b,
                      CUDA_R_16BF, static_cast<int>(op.n), a, CUDA_R_16BF, static_cast<int>(op.m), &beta, c, CUDA_R_32F,
                      static_cast<int>(op.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    float t[2];
    for (int st = 0; st < 2; ++st) {
      const hw::WgradShape shape{.m = op.m, .n = op.n, .lda = op.m, .ldb = op.n, .ldc = op.n, .accumulate = false, .stationary = st == 1};
      t[st] = time_us([&] { CK(hw::grouped_wgrad_wgmma(shape, problems, nullptr)); });
    }
    std::printf("%lld rows/expert %-24s streaming %.2f  stationary %.2f  (of one dense GEMM of the same FLOPs)\n", R, op.name,
                dense / t[0], dense / t[1]);
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(c));
  }
  return 0;
}
