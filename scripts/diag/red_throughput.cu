// How fast can fp32 be added into memory on this GPU? (twenty-sixth session; docs/hopper.md
// "Twenty-sixth session".) The grouped dW adds each tile's fp32 sum into C with L2 reductions
// (red.global.add.v4.f32); at 512 rows per expert it runs at 0.33-0.39x of a dense dW when adding
// and 0.59-0.65x when overwriting, and neither an L2 prefetch of C, staggered block starts nor
// adding in the registers closed that. This harness times the C traffic alone, with no GEMM:
// every element of a buffer written or added to once per pass, 16 bytes a lane, grid-stride,
// contiguous (the best case for each instruction), as
//   st          st.global.v4.f32 (what the dW does overwriting)
//   red         red.global.add.v4.f32 (what it does adding)
//   red.v2      red.global.add.v2.f32 (its path where C is only 8-byte aligned)
//   ld+add+st   ld.global.v4, the add in registers, st.global.v4, streamed (several loads in flight)
// over a 1 GiB buffer (C comes from and goes to HBM) and over a 16 MiB one that L2 holds between
// passes (the reduction units alone). Figures: bytes of C changed a second (4 an element), and
// the HBM bytes that implies (reductions and ld+add+st read and write each line) as a fraction of
// a 1 GiB device-to-device copy in the same run.
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a scripts/diag/red_throughput.cu -o /tmp/rt && /tmp/rt
#include <cuda_runtime.h>

#include <cstdio>

#include "diag_timing.cuh"

namespace {

enum class Op { st, red, red_v2, ld_add_st };

template <Op O>
__global__ void __launch_bounds__(256) touch(float4* c, long long n4, float4 v) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (O == Op::ld_add_st) {
    // Four loads in flight a thread, then their adds and stores.
    for (; i + 3 * stride < n4; i += 4 * stride) {
      float4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = __ldcg(c + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        c[i + u * stride] = make_float4(x[u].x + v.x, x[u].y + v.y, x[u].z + v.z, x[u].w + v.w);
    }
    for (; i < n4; i += stride) {
      const float4 x = __ldcg(c + i);
      c[i] = make_float4(x.x + v.x, x.y + v.y, x.z + v.z, x.w + v.w);
    }
  } else {
    for (; i < n4; i += stride) {
      float* p = reinterpret_cast<float*>(c + i);
      if constexpr (O == Op::st)
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
      else if constexpr (O == Op::red)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                     : "memory");
      else {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p + 2), "f"(v.z), "f"(v.w) : "memory");
      }
    }
  }
}

const char* name(Op o) {
  switch (o) {
    case Op::st: return "st.v4";
    case Op::red: return "red.add.v4";
    case Op::red_v2: return "red.add.v2";
    case Op::ld_add_st: return "ld+add+st";
  }
  return "?";
}

template <Op O>
void run(float4* c, long long n4, int grid, double copy_bps, const char* where) {
  const float us = time_us([&] { touch<O><<<grid, 256>>>(c, n4, make_float4(1.f, 1.f, 1.f, 1.f)); }, 5);
  CK(cudaGetLastError());
  const double bytes = 16.0 * static_cast<double>(n4);
  const double hbm = O == Op::st ? bytes : 2.0 * bytes;  // what each line costs when it is not in L2
  std::printf("%-11s %-16s %8.1f us  C changed %6.0f GB/s  (%5.1f%% of the copy's bytes a second as %s)\n", name(O), where, us,
              bytes / (us * 1e-6) / 1e9, 100.0 * hbm / (us * 1e-6) / copy_bps,
              O == Op::st ? "writes" : "reads + writes");
}

}  // namespace

int main() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs, L2 %d MiB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const double copy_bps = copy_bandwidth();
  const long long big4 = (1LL << 30) / 16, small4 = (16LL << 20) / 16;
  float4* c = nullptr;
  CK(cudaMalloc(&c, 16 * big4));
  CK(cudaMemset(c, 0, 16 * big4));
  for (const int per_sm : {4, 8}) {
    const int grid = per_sm * sms;
    std::printf("-- %d blocks of 256 an SM\n", per_sm);
    run<Op::st>(c, big4, grid, copy_bps, "1 GiB (HBM)");
    run<Op::red>(c, big4, grid, copy_bps, "1 GiB (HBM)");
    run<Op::red_v2>(c, big4, grid, copy_bps, "1 GiB (HBM)");
    run<Op::ld_add_st>(c, big4, grid, copy_bps, "1 GiB (HBM)");
    run<Op::st>(c, small4, grid, copy_bps, "16 MiB (L2)");
    run<Op::red>(c, small4, grid, copy_bps, "16 MiB (L2)");
    run<Op::red_v2>(c, small4, grid, copy_bps, "16 MiB (L2)");
    run<Op::ld_add_st>(c, small4, grid, copy_bps, "16 MiB (L2)");
  }
  CK(cudaFree(c));
  return 0;
}
