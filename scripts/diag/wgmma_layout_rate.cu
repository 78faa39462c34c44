// Did the no-swizzle core-matrix layout of our first wgmma attention kernels cap the tensor cores?
// (Written in the seventh session; the kernels have used the 128-byte swizzle since the eighth.)
// Two warpgroups per block (as the attention consumers), one block per SM, each warpgroup issuing
// m64n128k16 wgmmas back to back on resident shared-memory tiles (no loads, contents irrelevant):
// the rate of the SS form (A and B from shared memory: the attention's S = Q K^T) and of the RS
// form (A from registers: O += P V), with the no-swizzle layout those kernels used and with the
// 128-byte swizzle FlashAttention-3 uses, against one cuBLAS bf16 GEMM (8192^3) in the same run.
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -I include -I src \
//     scripts/diag/wgmma_layout_rate.cu -lcublas -o /tmp/wgmma_rate && /tmp/wgmma_rate
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "kernels/hopper/wgmma.cuh"

using namespace oom::kernels::hopper;

#define CK(x)                                                                       \
  do {                                                                              \
    auto e_ = (x);                                                                  \
    if (e_ != 0) {                                                                  \
      std::printf("error %d at %s:%d\n", static_cast<int>(e_), __FILE__, __LINE__); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

enum Mode : int { ss_none, ss_b128, rs_none, rs_b128 };
constexpr const char* kNames[] = {"SS no-swizzle (old)", "SS 128B swizzle", "RS no-swizzle (old)", "RS 128B swizzle"};
constexpr int kSmem = 64 * 1024 + 1024;

/// Descriptor of k-step ks (16 columns) of rows [row0, row0 + 64) of a 128 x 128 bf16 tile at
/// `tile`: no swizzle = our core-matrix layout ((r/8) 2048 + (c/8) 128 + (r%8) 16 bytes);
/// 128B swizzle = two 64-column halves, each 128 rows x 128 bytes in 1024-byte 8-row atoms.
template <bool SWIZZLE>
__device__ std::uint64_t desc(std::uint32_t tile, int row0, int ks) {
  if constexpr (SWIZZLE)
    return encode_smem_desc(tile + (ks / 4) * 16384 + row0 * 128 + (ks % 4) * 32, 16, 1024, Swizzle::b128);
  else
    return encode_smem_desc(tile + row0 / 8 * 2048 + ks * 256, 128, 2048);
}

template <Mode M>
__global__ void __launch_bounds__(256, 1) rate_kernel(int iters, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const auto raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  const std::uint32_t a_tile = (raw + 1023u) & ~1023u, b_tile = a_tile + 32768;
  constexpr bool kSwz = M == ss_b128 || M == rs_b128;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  float acc[64];
  for (float& x : acc) x = 0.0f;
  std::uint32_t frag[4][4] = {};
  for (int it = 0; it < iters; ++it) {
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      if constexpr (M == ss_none || M == ss_b128)
        wgmma_m64n128k16_f32_bf16_ss(acc, desc<kSwz>(a_tile, 64 * wg, ks), desc<kSwz>(b_tile, 0, ks), 1);
      else
        wgmma_m64n128k16_f32_bf16_rs(acc, frag[ks % 4], desc<kSwz>(b_tile, 0, ks), 1);
    }
    wgmma_commit_group();
    wgmma_wait_group<1>();
  }
  wgmma_wait_group<0>();
  wgmma_fence_operands(acc);
  float s = 0.0f;
  for (float x : acc) s += x;
  if (s == 12345.0f) sink[threadIdx.x] = s;  // keeps the work
}

template <Mode M>
int run(int sms, float* sink, double ref_tflops, double* first) {
  const int iters = 20000;
  CK(cudaFuncSetAttribute(rate_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  rate_kernel<M><<<sms, 256, kSmem>>>(100, sink);
  CK(cudaGetLastError());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  rate_kernel<M><<<sms, 256, kSmem>>>(iters, sink);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  const double tflops = 2.0 * 64 * 128 * 16 * 8 * 2.0 * iters * sms / (ms * 1e-3) / 1e12;
  if (*first == 0) *first = tflops;
  std::printf("%-22s %7.1f TFLOP/s = %.2fx cuBLAS, %.2fx the first row\n", kNames[M], tflops, tflops / ref_tflops,
              tflops / *first);
  return 0;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* sink;
  CK(cudaMalloc(&sink, 256 * sizeof(float)));
  // The physical reference: one cuBLAS bf16 GEMM, fp32 accumulate, 8192^3, zeros (timing only).
  const int n = 8192;
  __nv_bfloat16 *x, *y, *z;
  CK(cudaMalloc(&x, sizeof(__nv_bfloat16) * n * n));
  CK(cudaMalloc(&y, sizeof(__nv_bfloat16) * n * n));
  CK(cudaMalloc(&z, sizeof(__nv_bfloat16) * n * n));
  CK(cudaMemset(x, 0, sizeof(__nv_bfloat16) * n * n));
  CK(cudaMemset(y, 0, sizeof(__nv_bfloat16) * n * n));
  cublasHandle_t h;
  CK(cublasCreate(&h));
  const float one = 1.0f, zero = 0.0f;
  const auto gemm = [&] {
    return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, x, CUDA_R_16BF, n, y, CUDA_R_16BF, n, &zero, z,
                        CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  CK(gemm());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < 10; ++i) CK(gemm());
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  const double ref = 2.0 * n * n * n * 10 / (ms * 1e-3) / 1e12;
  std::printf("cuBLAS bf16 GEMM 8192^3: %.1f TFLOP/s (%d SMs)\n", ref, sms);
  double first = 0;
  if (run<ss_none>(sms, sink, ref, &first) || run<ss_b128>(sms, sink, ref, &first) ||
      run<rs_none>(sms, sink, ref, &first) || run<rs_b128>(sms, sink, ref, &first))
    return 1;
  return 0;
}
