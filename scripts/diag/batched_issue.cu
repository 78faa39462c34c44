// Host time of cublasGemmBatchedEx by batch count (the row_chunked expert GEMMs' batched calls at
// the 5.13B widths): which counts take milliseconds on the host, and does it repeat once seen?
//   nvcc -O2 -arch=sm_90 -std=c++20 scripts/diag/batched_issue.cu -lcublas -o /tmp/batched_issue && /tmp/batched_issue
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <chrono>
#include <cstdio>
#include <vector>

#define CK(x) do { auto e = (x); if (e != 0) { std::printf("error %d at %s:%d\n", int(e), __FILE__, __LINE__); return 1; } } while (0)

int main() {
  const int H = 2048, I2 = 1536, chunk = 128, maxb = 2100;
  cublasHandle_t h;
  CK(cublasCreate(&h));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  CK(cublasSetStream(h, s));
  __nv_bfloat16 *w, *x, *y;
  CK(cudaMalloc(&w, size_t(64) * H * I2 * 2));
  CK(cudaMalloc(&x, size_t(maxb) * chunk * H * 2));
  CK(cudaMalloc(&y, size_t(maxb) * chunk * I2 * 2));
  std::vector<const void*> hp(3 * maxb);
  for (int i = 0; i < maxb; ++i) {
    hp[i] = w + size_t(i % 12) * H * I2;
    hp[maxb + i] = x + size_t(i) * chunk * H;
    hp[2 * maxb + i] = y + size_t(i) * chunk * I2;
  }
  const void** d;
  CK(cudaMalloc(&d, hp.size() * sizeof(void*)));
  CK(cudaMemcpy(d, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
  const float alpha = 1, beta = 0;
  auto call = [&](int n, int m, int k, int count) {
    const auto t0 = std::chrono::steady_clock::now();
    auto st = cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, d, CUDA_R_16BF, k, d + maxb, CUDA_R_16BF, k,
                                  &beta, (void* const*)(d + 2 * maxb), CUDA_R_16BF, n, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    cudaStreamSynchronize(s);
    return st == CUBLAS_STATUS_SUCCESS ? ms : -1.0;
  };
  for (int rep = 0; rep < 3; ++rep) {
    std::printf("pass %d, gate_up (n %d, k %d) host ms by batch count:\n", rep, I2, H);
    for (int c : {1, 2, 3, 5, 8, 16, 64, 128, 200, 252, 253, 254, 255, 256, 511, 1024, 2032, 2047})
      std::printf("  %3d: %.3f", c, call(I2, chunk, H, c));
    std::printf("\n  down (n %d, k %d):\n", H, I2 / 2);
    for (int c : {1, 2, 3, 5, 8, 16, 64, 128, 200, 252, 253, 254, 255, 256, 511, 1024, 2032, 2047})
      std::printf("  %3d: %.3f", c, call(H, chunk, I2 / 2, c));
    std::printf("\n");
  }
  return 0;
}
