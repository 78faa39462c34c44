// Where does the expert down-projection backward lose against one dense GEMM (issue 5: 0.72x)?
// The 5.13B shapes (H = 2048, I = 768, E = 64 experts, T = 16384 tokens x top-8 = N = 131072 rows,
// 2048 rows per expert here: equal counts, so strided batched calls are possible), each part timed
// alone with plain cuBLAS and printed as a ratio to the dense GEMM of the same FLOPs in this run:
//   dh = dy W_d      dense (M = N rows)          vs per-expert loop / strided batched
//   dW_d += dy^T h   dense (K = N, fp32, beta 1)  vs per-expert loop on 1 and 4 streams, beta 1 and
//                                                   0, and strided batched (one launch, 6144 tiles)
// and dh + dW together as the product issues them (dh on the main stream, dW on 4 side streams).
// A what-if for the expert weight gradients' precision (the product writes them in fp32): the
// strided batched dW and dh + dW with dW written in bf16 (as PyTorch's bf16 matmul backward writes a
// bf16 weight's gradient), which halves the C traffic that bounds the dW at 512 rows per expert.
// Operands are N(0, 1) (W N(0, 0.02)) since the sixty-fifth session: products on constant data run
// faster than on real data (the clock drops less), so the ratios before it, on the byte 0x3C,
// measured a faster dense GEMM than training sees. `const` as the second argument fills 0x3C again.
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a scripts/diag/expert_dw_split.cu \
//     -lcublas -o /tmp/dw_split && /tmp/dw_split [rows per expert, default 2048; 512 is T = 4096] [const]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "diag_timing.cuh"  // CK, fill_random_bf16

constexpr long long H = 2048, I = 768, E = 64;

int main(int argc, char** argv) {
  const long long R = argc > 1 ? std::atoll(argv[1]) : 2048, N = E * R;
  if (R < 1 || R > 65536) {
    std::printf("rows per expert %lld: expected 1 .. 65536\n", R);
    return 2;
  }
  std::printf("%lld experts x %lld rows (T = %lld tokens at top-8), H = %lld, I = %lld\n", E, R, N / 8, H, I);
  __nv_bfloat16 *dy, *h, *w, *dh;
  float* dw;
  CK(cudaMalloc(&dy, N * H * 2));
  CK(cudaMalloc(&h, N * I * 2));
  CK(cudaMalloc(&w, E * H * I * 2));
  CK(cudaMalloc(&dh, N * I * 2));
  CK(cudaMalloc(&dw, E * H * I * 4));
  if (argc > 2 && std::strcmp(argv[2], "const") == 0) {
    std::printf("operands: the byte 0x3C (bf16 ~0.0115) everywhere\n");
    CK(cudaMemset(dy, 0x3C, N * H * 2));
    CK(cudaMemset(h, 0x3C, N * I * 2));
    CK(cudaMemset(w, 0x3C, E * H * I * 2));
  } else {
    std::printf("operands: N(0, 1), W N(0, 0.02)\n");
    fill_random_bf16(dy, N * H, 1, 1.0f);
    fill_random_bf16(h, N * I, 2, 1.0f);
    fill_random_bf16(w, E * H * I, 3, 0.02f);
  }
  CK(cudaMemset(dw, 0, E * H * I * 4));
  cublasHandle_t blas;
  CK(cublasCreate(&blas));
  void* ws;
  const size_t ws_bytes = 64 << 20;
  CK(cudaMalloc(&ws, ws_bytes));
  CK(cublasSetWorkspace(blas, ws, ws_bytes));
  cudaStream_t main_s, side[4];
  CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
  for (auto& s : side) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t side_blas[4];
  for (int i = 0; i < 4; ++i) {
    CK(cublasCreate(&side_blas[i]));
    CK(cublasSetStream(side_blas[i], side[i]));
  }
  CK(cublasSetStream(blas, main_s));
  const float one = 1.0f, zero = 0.0f;

  // Row-major C (M x N) = A B is column-major C^T = B^T A^T: every call below is written that way.
  // dh_e (rows x I) = dy_e (rows x H) W_e (H x I): col-major dh^T (I x rows) = W^T(I x H) dy^T(H x rows).
  const auto dh_gemm = [&](cublasHandle_t b, long long rows, const __nv_bfloat16* dy_e, const __nv_bfloat16* w_e,
                           __nv_bfloat16* dh_e) {
    CK(cublasGemmEx(b, CUBLAS_OP_N, CUBLAS_OP_N, I, rows, H, &one, w_e, CUDA_R_16BF, I, dy_e, CUDA_R_16BF, H, &zero, dh_e,
                    CUDA_R_16BF, I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  // dW_e (H x I) += dy_e^T h_e: col-major dW^T (I x H) = h^T (I x rows) dy (rows x H).
  const auto dw_gemm = [&](cublasHandle_t b, long long rows, const __nv_bfloat16* dy_e, const __nv_bfloat16* h_e,
                           float* dw_e, const float* beta) {
    CK(cublasGemmEx(b, CUBLAS_OP_N, CUBLAS_OP_T, I, H, rows, &one, h_e, CUDA_R_16BF, I, dy_e, CUDA_R_16BF, H, beta, dw_e,
                    CUDA_R_32F, I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  cudaEvent_t ev_fork, ev_join[4];
  CK(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
  for (auto& e : ev_join) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto per_expert_dw = [&](int streams, const float* beta) {
    CK(cudaEventRecord(ev_fork, main_s));
    for (int i = 0; i < streams; ++i) CK(cudaStreamWaitEvent(side[i], ev_fork));
    for (long long e = 0; e < E; ++e)
      dw_gemm(side_blas[e % streams], R, dy + e * R * H, h + e * R * I, dw + e * H * I, beta);
    for (int i = 0; i < streams; ++i) {
      CK(cudaEventRecord(ev_join[i], side[i]));
      CK(cudaStreamWaitEvent(main_s, ev_join[i]));
    }
  };
  const auto time_ms = [&](const std::function<void()>& f) {
    for (int i = 0; i < 3; ++i) f();
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, main_s));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) f();
    CK(cudaEventRecord(b, main_s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms) / reps;
  };
  const double flops = 2.0 * N * H * I;  // each of dh and dW
  const double dense_dh = time_ms([&] { dh_gemm(blas, N, dy, w, dh); });
  const double dense_dw = time_ms([&] { dw_gemm(blas, N, dy, h, dw, &one); });
  std::printf("dense dh  (M=%lld rows, N=I, K=H)       %.3f ms  %.0f TFLOP/s\n", N, dense_dh, flops / dense_dh / 1e9);
  std::printf("dense dW  (M=H, N=I, K=%lld, fp32 +=)   %.3f ms  %.0f TFLOP/s\n", N, dense_dw, flops / dense_dw / 1e9);
  const auto row = [&](const char* what, double ms, double dense) {
    std::printf("  %-44s %.3f ms  %4.0f TFLOP/s  %.2fx dense\n", what, ms, flops / ms / 1e9, dense / ms);
  };
  row("dh per-expert loop", time_ms([&] {
        for (long long e = 0; e < E; ++e) dh_gemm(blas, R, dy + e * R * H, w + e * H * I, dh + e * R * I);
      }),
      dense_dh);
  row("dh strided batched (64 experts)", time_ms([&] {
        CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, R, H, &one, w, CUDA_R_16BF, I, H * I, dy,
                                      CUDA_R_16BF, H, R * H, &zero, dh, CUDA_R_16BF, I, R * I, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      }),
      dense_dh);
  row("dW per-expert loop, 1 stream, beta 1", time_ms([&] { per_expert_dw(1, &one); }), dense_dw);
  row("dW per-expert loop, 4 streams, beta 1", time_ms([&] { per_expert_dw(4, &one); }), dense_dw);
  row("dW per-expert loop, 4 streams, beta 0", time_ms([&] { per_expert_dw(4, &zero); }), dense_dw);
  row("dW strided batched (64 experts), beta 1", time_ms([&] {
        CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, H, R, &one, h, CUDA_R_16BF, I, R * I, dy,
                                      CUDA_R_16BF, H, R * H, &one, dw, CUDA_R_32F, I, H * I, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      }),
      dense_dw);
  row("dW strided batched, beta 0", time_ms([&] {
        CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, H, R, &one, h, CUDA_R_16BF, I, R * I, dy,
                                      CUDA_R_16BF, H, R * H, &zero, dw, CUDA_R_32F, I, H * I, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      }),
      dense_dw);
  // What-if: dW written in bf16 (beta 0). Its reference is the dense dW with a bf16 C as well.
  __nv_bfloat16* const dw16 = reinterpret_cast<__nv_bfloat16*>(dw);
  const auto batched_dw16 = [&] {
    CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, H, R, &one, h, CUDA_R_16BF, I, R * I, dy,
                                  CUDA_R_16BF, H, R * H, &zero, dw16, CUDA_R_16BF, I, H * I, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
  };
  const auto dense_dw16_call = [&] {
    CK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, H, N, &one, h, CUDA_R_16BF, I, dy, CUDA_R_16BF, H, &zero, dw16,
                    CUDA_R_16BF, I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  const double dense_dw16 = time_ms(dense_dw16_call);
  std::printf("dense dW, bf16 C (what-if)              %.3f ms  %.0f TFLOP/s\n", dense_dw16, flops / dense_dw16 / 1e9);
  row("dW strided batched, beta 0, bf16 C", time_ms(batched_dw16), dense_dw16);
  row("  the same against the dense fp32 += dW", time_ms(batched_dw16), dense_dw);
  // Both together, as the product issues them: dh on the main stream, dW on 4 side streams.
  const double dense_both = time_ms([&] {
    dh_gemm(blas, N, dy, w, dh);
    dw_gemm(blas, N, dy, h, dw, &one);
  });
  const double grouped_both = time_ms([&] {
    per_expert_dw(4, &one);
    CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, R, H, &one, w, CUDA_R_16BF, I, H * I, dy,
                                  CUDA_R_16BF, H, R * H, &zero, dh, CUDA_R_16BF, I, R * I, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
  });
  const double batched_both = time_ms([&] {
    CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, R, H, &one, w, CUDA_R_16BF, I, H * I, dy,
                                  CUDA_R_16BF, H, R * H, &zero, dh, CUDA_R_16BF, I, R * I, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, H, R, &one, h, CUDA_R_16BF, I, R * I, dy,
                                  CUDA_R_16BF, H, R * H, &one, dw, CUDA_R_32F, I, H * I, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
  });
  std::printf("dh + dW: dense %.3f ms; batched dh + dW on 4 side streams %.3f ms = %.2fx; both strided batched %.3f ms = "
              "%.2fx\n",
              dense_both, grouped_both, dense_both / grouped_both, batched_both, dense_both / batched_both);
  const double dense_both16 = time_ms([&] {
    dh_gemm(blas, N, dy, w, dh);
    dense_dw16_call();
  });
  const double batched_both16 = time_ms([&] {
    CK(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, R, H, &one, w, CUDA_R_16BF, I, H * I, dy,
                                  CUDA_R_16BF, H, R * H, &zero, dh, CUDA_R_16BF, I, R * I, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
    batched_dw16();
  });
  std::printf("dh + dW, dW in bf16 (what-if): dense %.3f ms; both strided batched %.3f ms = %.2fx (%.2fx of the fp32 "
              "dense pair)\n",
              dense_both16, batched_both16, dense_both16 / batched_both16, dense_both / batched_both16);
  return 0;
}
