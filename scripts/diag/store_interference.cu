// How fast can a grouped dW at 512 rows per expert be on this GPU, whatever its schedule?
// (nineteenth session; docs/hopper.md "Nineteenth session".) The best dW kernels tried since the
// twelfth session ran at ~0.62-0.66x of one dense dW of the same FLOPs at T = 4096, and cuBLAS's
// batched GEMM at 0.63-0.68x. This harness takes the kernel logic away and keeps only the work and
// the traffic: blocks walk the real tile list (64 experts, C_e = A_e^T B_e over K rows, N tiles
// fastest), their consumer warpgroups issue the tiles' wgmmas back to back on shared memory
// (contents irrelevant; they wait for data only where loads run), and side warps move the real
// bytes beside them:
//   ld    each tile's operands (A 128 x K, B kN x K bf16, the same bytes as the real column slices,
//         so the same L2 reuse) by cp.async.bulk through a ring of 64-row K stages with full /
//         empty mbarriers: the consumers wait for a stage's bytes and release it, as the kept
//         kernel's do;
//   st    each finished tile's fp32 C by st.global (16 bytes a lane) from one store warp;
//   bulk  the same C by cp.async.bulk (one copy a row of the tile) from a shared-memory buffer: a
//         perfect hand-off;
//   self  the consumers store their own accumulator fragments (8-byte stores) after each tile,
//         as a kernel without a hand-off must.
// "paced": the side traffic follows the consumers tile by tile, and never holds them back (as if
// the hand-off had unlimited room: so "ld + bulk paced" bounds any real hand-off from above);
// "only": without the consumers. Operands are N(0, 1) and shared memory starts uniform in [-1, 1)
// (diag_timing.cuh) since the sixty-sixth session; the figures before it (docs/hopper.md,
// nineteenth and twenty-sixth sessions) ran on the byte 0x3C everywhere, on which products run
// faster than on real data, so their dense GEMM was faster and their ceilings lower.
// Blocks: the kept kernel's (2 consumer warpgroups on 128 x 256 tiles; 4, 3 or 2 stages, the last
// with room for a whole tile's C beside them) and, with a fifth argument "all", one consumer
// warpgroup on 128 x 128 tiles, two blocks an SM or one. Ratios are to one cuBLAS GEMM
// of the same FLOPs with one fp32 C (m x n over K = experts x rows) in the same run; the copy line
// gives HBM's rate. "ld + bulk paced" is what any schedule of these tiles could reach at best.
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src scripts/diag/store_interference.cu -lcublas -o /tmp/si && /tmp/si [experts m n rows [all]]
//   (defaults 64 2048 1536 512: the 5.13B gate_up dW at T = 4096; 64 2048 768 512 is down's)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "diag_timing.cuh"
#include "kernels/hopper/tma.cuh"
#include "kernels/hopper/warp_specialized.cuh"
#include "kernels/hopper/wgmma.cuh"

using namespace oom::kernels::hopper;

enum Mode : int {
  none,
  st_paced,
  bulk_paced,
  ld_paced,
  ld_st_paced,
  ld_bulk_paced,
  self_store,
  ld_self,
  st_only,
  ld_only,
};
constexpr const char* kNames[] = {"none (products only)", "st paced", "bulk paced", "ld", "ld + st paced",
                                  "ld + bulk paced", "self", "ld + self", "st only", "ld only"};
constexpr bool consumers_run(Mode m) { return m != st_only && m != ld_only; }
constexpr bool has_st(Mode m) { return m == st_paced || m == ld_st_paced || m == st_only; }
constexpr bool has_bulk(Mode m) { return m == bulk_paced || m == ld_bulk_paced; }
constexpr bool has_self(Mode m) { return m == self_store || m == ld_self; }
constexpr bool has_ld(Mode m) {
  return m == ld_paced || m == ld_st_paced || m == ld_bulk_paced || m == ld_self || m == ld_only;
}

/// A block's shape: kWG consumer warpgroups on 128 x kN tiles (kWG = 2: each warpgroup one 64-row
/// half, m64nN wgmmas, as the kept kernel; kWG = 1: one warpgroup both halves, two m64n128 wgmmas
/// a K step), kSt operand stages in a full / empty mbarrier ring when loads run (the consumers wait
/// for a stage's bytes and release it when its wgmmas retire, as in the kept kernel), two side
/// warps: the first loads (its lane 0), the second stores (paced st.global by its 32 lanes, bulk
/// stores by its lane 0), so loads and stores never wait for each other. kFullStaging: room for a
/// whole tile's fp32 C in shared memory beside the stages (only two fit).
template <int kWG, int kN, int kSt, bool kFullStaging = false>
struct Shape {
  static_assert((kWG == 2 && kN == 256) || (kWG == 1 && kN == 128));
  static constexpr std::uint32_t a = 128 * 64 * 2, b = kN * 64 * 2, stage = a + b;
  static constexpr std::uint32_t staging = kFullStaging ? 128 * kN * 4 : 8192;  // full: a whole tile's C
  static constexpr std::uint32_t smem = 1024 + kSt * stage + staging + 16 * kSt + 16;
  static constexpr int threads = kWG * 128 + 64;
  static constexpr int per_sm = smem * 2 + 2048 <= 233472 && 2 * threads * 168 <= 65536 ? 2 : 1;
};

/// The dW problems: E experts, C_e (m x n fp32, row-major) = A_e^T B_e over K = 512 rows; A_e and B_e
/// stored so that the 128 (A) or kN (B) columns one tile reads are one contiguous run (the same bytes
/// as the real operands' column slices, so the same L2 reuse between tiles).
struct Problems {
  int experts, m, n, k;  // m, n multiples of 128 / 256; k (rows per expert) of 64
  const unsigned char* a;  // E x m x K bf16
  const unsigned char* b;  // E x n x K bf16
  float* c;                // E x m x n
  [[nodiscard]] __host__ __device__ double flops() const { return 2.0 * experts * m * double(n) * k; }
  [[nodiscard]] __host__ __device__ double operand_bytes() const { return 2.0 * experts * (m + double(n)) * k; }
  [[nodiscard]] __host__ __device__ double c_bytes() const { return 4.0 * experts * m * double(n); }
};

/// Tile `tile` of the list (N tiles fastest, then M tiles, then experts: the kept kernel's order).
struct TileAt {
  int e, mt, nt;
};
template <int kN>
__device__ __forceinline__ TileAt tile_at(const Problems& p, int tile) {
  const int nt = p.n / kN, per_e = p.m / 128 * nt;
  return {tile / per_e, tile % per_e / nt, tile % nt};
}

struct Shared {
  int progress[2];  // tiles finished, per consumer warpgroup
};

__device__ __forceinline__ int volatile_load(const int* p) { return *static_cast<const volatile int*>(p); }

template <int kWG>
__device__ __forceinline__ void wait_progress(const Shared* sh, int tiles) {
  while (true) {
    int done = volatile_load(&sh->progress[0]);
    if constexpr (kWG == 2) done = min(done, volatile_load(&sh->progress[1]));
    if (done >= tiles) return;
    __nanosleep(64);
  }
}

__device__ __forceinline__ void bulk_load(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(reinterpret_cast<std::uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, std::uint32_t src, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(reinterpret_cast<std::uint64_t>(dst)),
               "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/// The accumulator fragment of an m64nN wgmma (N / 2 floats a thread) to C rows [row0, row0 + 64)
/// in 8-byte stores: thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+ 8), columns
/// 8 j + 2 (t % 4) (+ 1) of block j.
template <int N>
__device__ __forceinline__ void store_fragment(float* c, int ldc, const float (&d)[N], int t) {
  const int row = 16 * (t / 32) + (t % 32) / 4, col = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    *reinterpret_cast<float2*>(c + std::size_t(row) * ldc + 8 * j + col) = make_float2(d[4 * j], d[4 * j + 1]);
    *reinterpret_cast<float2*>(c + std::size_t(row + 8) * ldc + 8 * j + col) = make_float2(d[4 * j + 2], d[4 * j + 3]);
  }
}

template <Mode M, int kWG, int kN, int kSt, bool kFull = false>
__global__ void __launch_bounds__(Shape<kWG, kN, kSt, kFull>::threads, Shape<kWG, kN, kSt, kFull>::per_sm)
    interference_kernel(Problems p, float* sink) {
  using S = Shape<kWG, kN, kSt, kFull>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const auto raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  const std::uint32_t stages = raw + pad_to_1024(raw), staging = stages + kSt * S::stage;
  const std::uint32_t full = staging + S::staging, empty = full + 8 * kSt;  // kSt mbarriers each
  auto* sh = reinterpret_cast<Shared*>(smem_raw + (empty + 8 * kSt - raw));
  const int wg = static_cast<int>(threadIdx.x) / 128, t = static_cast<int>(threadIdx.x) % 128;
  const int first = static_cast<int>(blockIdx.x), step = static_cast<int>(gridDim.x);
  const std::uint32_t steps = static_cast<std::uint32_t>(p.k) / 64;
  const int all = p.experts * (p.m / 128) * (p.n / kN);
  const int tiles = first < all ? (all - first + step - 1) / step : 0;  // this block's
  // Random values in every stage and the C staging (tensor-core power, hence clocks, depends on the
  // data): what the consumers multiply where no loads run.
  for (std::uint32_t i = threadIdx.x; i < (kSt * S::stage + S::staging) / 16; i += blockDim.x)
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(stages + 16 * i), "r"(random_bf16x2(4 * i, blockIdx.x)),
                 "r"(random_bf16x2(4 * i + 1, blockIdx.x)), "r"(random_bf16x2(4 * i + 2, blockIdx.x)),
                 "r"(random_bf16x2(4 * i + 3, blockIdx.x))
                 : "memory");
  fence_proxy_async_shared();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSt; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, kWG);
    }
    mbar_fence_init();
    sh->progress[0] = consumers_run(M) ? 0 : tiles;
    sh->progress[1] = consumers_run(M) && kWG == 2 ? 0 : tiles;
  }
  __syncthreads();

  if (wg < kWG) {  // consumers
    if constexpr (consumers_run(M)) {
      float acc[128];
      for (float& x : acc) x = 0.0f;
      std::uint32_t kstep = 0;
      for (int i = 0; i < tiles; ++i) {
        for (std::uint32_t k = 0; k < steps; ++k, ++kstep) {
          const std::uint32_t s = kstep % kSt, st = stages + s * S::stage;
          if constexpr (has_ld(M)) mbar_wait(full + 8 * s, (kstep / kSt) & 1u);
          wgmma_fence_operands(acc);
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            if constexpr (kWG == 2) {
              wgmma_m64n256k16_f32_bf16_ss(acc, encode_smem_desc(st + wg * 64 * 128 + ks * 32, 16, 1024, Swizzle::b128),
                                           encode_smem_desc(st + S::a + ks * 32, 16, 1024, Swizzle::b128), 1);
            } else {
              auto& lo = *reinterpret_cast<float(*)[64]>(&acc[0]);
              auto& hi = *reinterpret_cast<float(*)[64]>(&acc[64]);
              const std::uint64_t db = encode_smem_desc(st + S::a + ks * 32, 16, 1024, Swizzle::b128);
              wgmma_m64n128k16_f32_bf16_ss(lo, encode_smem_desc(st + ks * 32, 16, 1024, Swizzle::b128), db, 1);
              wgmma_m64n128k16_f32_bf16_ss(hi, encode_smem_desc(st + 64 * 128 + ks * 32, 16, 1024, Swizzle::b128), db, 1);
            }
          }
          wgmma_commit_group();
          wgmma_wait_group<1>();
          // The previous K step's wgmmas have retired: its stage goes back to the loads (the first
          // K step of a tile has none: the previous tile's last was released at its end).
          if constexpr (has_ld(M))
            if (k > 0 && t == 0) mbar_arrive(empty + 8 * ((kstep - 1) % kSt));
        }
        wgmma_wait_group<0>();  // the tile's accumulator complete, as before an epilogue
        wgmma_fence_operands(acc);
        if constexpr (has_ld(M))
          if (t == 0) mbar_arrive(empty + 8 * ((kstep - 1) % kSt));
        if constexpr (has_self(M)) {
          const TileAt at = tile_at<kN>(p, first + i * step);
          float* c = p.c + (std::size_t(at.e) * p.m + at.mt * 128) * p.n + at.nt * kN;
          if constexpr (kWG == 2) {
            store_fragment(c + std::size_t(64 * wg) * p.n, p.n, acc, t);
          } else {
            store_fragment(c, p.n, *reinterpret_cast<float(*)[64]>(&acc[0]), t);
            store_fragment(c + std::size_t(64) * p.n, p.n, *reinterpret_cast<float(*)[64]>(&acc[64]), t);
          }
        }
        if (t == 0) {
          __threadfence_block();
          atomicAdd(&sh->progress[wg], 1);
        }
      }
      float s = 0.0f;
      for (float x : acc) s += x;
      if (s == 12345.0f) sink[threadIdx.x] = s;  // keeps the work
    }
    return;
  }

  // The side warps.
  const int lane = t % 32, side = t / 32;  // 0: loads, 1: stores
  if constexpr (has_ld(M)) {
    if (side == 0 && lane == 0) {
      std::uint32_t issued = 0;
      for (int i = 0; i < tiles; ++i) {
        const TileAt at = tile_at<kN>(p, first + i * step);
        const unsigned char* a = p.a + (std::size_t(at.e) * p.m + at.mt * 128) * p.k * 2;
        const unsigned char* b = p.b + (std::size_t(at.e) * p.n + at.nt * kN) * p.k * 2;
        for (std::uint32_t k = 0; k < steps; ++k, ++issued) {
          const std::uint32_t s = issued % kSt;
          if (issued >= kSt) {  // the stage's previous bytes consumed (alone: landed)
            if constexpr (M == ld_only)
              mbar_wait(full + 8 * s, ((issued / kSt) - 1) & 1u);
            else
              mbar_wait(empty + 8 * s, ((issued / kSt) - 1) & 1u);
          }
          mbar_arrive_expect_tx(full + 8 * s, S::stage);
          bulk_load(stages + s * S::stage, a + k * S::a, S::a, full + 8 * s);
          for (std::uint32_t q = 0; q < S::b; q += 16384)
            bulk_load(stages + s * S::stage + S::a + q, b + k * S::b + q, 16384, full + 8 * s);
        }
      }
      if constexpr (M == ld_only)
        for (std::uint32_t j = issued >= kSt ? issued - kSt : 0; j < issued; ++j)
          mbar_wait(full + 8 * (j % kSt), (j / kSt) & 1u);
    }
    __syncwarp();
  }
  if constexpr (has_st(M)) {
    if (side != 1) return;
    const float4 v = make_float4(1.0f, 2.0f, 3.0f, static_cast<float>(lane));
    for (int i = 0; i < tiles; ++i) {
      if constexpr (M != st_only) {
        if (lane == 0) wait_progress<kWG>(sh, i + 1);
        __syncwarp();
      }
      const TileAt at = tile_at<kN>(p, first + i * step);
      float* c = p.c + (std::size_t(at.e) * p.m + at.mt * 128) * p.n + at.nt * kN;
      constexpr int kRowF4 = kN / 4;
      for (int j = lane; j < 128 * kRowF4; j += 32)
        reinterpret_cast<float4*>(c + std::size_t(j / kRowF4) * p.n)[j % kRowF4] = v;
    }
  }
  if constexpr (has_bulk(M)) {
    if (side == 1 && lane == 0) {
      constexpr std::uint32_t kRows = S::staging / (kN * 4);  // rows the buffer holds
      for (int i = 0; i < tiles; ++i) {
        wait_progress<kWG>(sh, i + 1);
        const TileAt at = tile_at<kN>(p, first + i * step);
        float* c = p.c + (std::size_t(at.e) * p.m + at.mt * 128) * p.n + at.nt * kN;
        for (int r = 0; r < 128; ++r) bulk_store(c + std::size_t(r) * p.n, staging + (r % kRows) * kN * 4, kN * 4);
        bulk_commit();
        bulk_wait_read<1>();
      }
      bulk_wait_all();
    }
  }
}

template <Mode M, int kWG, int kN, int kSt, bool kFull = false>
float run(const Problems& p, int blocks, bool one_per_sm, float* sink) {
  using S = Shape<kWG, kN, kSt, kFull>;
  // One block an SM where the shape would fit two: ask for more shared memory than half an SM's.
  const std::uint32_t smem = one_per_sm && S::per_sm == 2 ? 120 * 1024 : S::smem;
  CK(cudaFuncSetAttribute(interference_kernel<M, kWG, kN, kSt, kFull>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem));
  return time_us(
      [&] {
        interference_kernel<M, kWG, kN, kSt, kFull><<<blocks, S::threads, smem>>>(p, sink);
        CK(cudaGetLastError());
      },
      3);
}

/// One report row a mode, the block shape and launch fixed.
template <int kWG, int kN, int kSt, bool kFull, Mode... Ms, class Report>
void rows(const char* name, const Problems& p, int blocks, bool one_per_sm, float* sink, const Report& report) {
  (report(name, Ms, run<Ms, kWG, kN, kSt, kFull>(p, blocks, one_per_sm, sink)), ...);
}

int main(int argc, char** argv) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Problems p{};
  p.experts = argc > 1 ? std::atoi(argv[1]) : 64;
  p.m = argc > 2 ? std::atoi(argv[2]) : 2048;
  p.n = argc > 3 ? std::atoi(argv[3]) : 1536;
  p.k = argc > 4 ? std::atoi(argv[4]) : 512;
  if (p.m % 128 != 0 || p.n % 256 != 0 || p.experts < 1 || p.k % 64 != 0 || p.k < 64) {
    std::printf("usage: si [experts] [m, a multiple of 128] [n, a multiple of 256] [rows per expert, of 64]\n");
    return 2;
  }
  float* sink;
  CK(cudaMalloc(&sink, 384 * sizeof(float)));
  unsigned char *a, *b;
  float* c;
  const std::size_t a_bytes = std::size_t(2) * p.experts * p.m * p.k, b_bytes = std::size_t(2) * p.experts * p.n * p.k;
  CK(cudaMalloc(&a, a_bytes));
  CK(cudaMalloc(&b, b_bytes));
  CK(cudaMalloc(&c, static_cast<std::size_t>(p.c_bytes())));
  fill_random_bf16(reinterpret_cast<__nv_bfloat16*>(a), static_cast<long long>(a_bytes / 2), 1);
  fill_random_bf16(reinterpret_cast<__nv_bfloat16*>(b), static_cast<long long>(b_bytes / 2), 2);
  p.a = a;
  p.b = b;
  p.c = c;

  // Physical references in the same run: one dense cuBLAS bf16 GEMM with the problems' FLOPs
  // (m x n over K = experts x 512 rows, fp32 C, as the bench's dense dW) and a 1 GiB copy.
  const int dk = p.experts * p.k;
  __nv_bfloat16 *x, *y;
  float* z;
  CK(cudaMalloc(&x, sizeof(__nv_bfloat16) * p.m * dk));
  CK(cudaMalloc(&y, sizeof(__nv_bfloat16) * p.n * dk));
  CK(cudaMalloc(&z, sizeof(float) * p.m * p.n));
  fill_random_bf16(x, static_cast<long long>(p.m) * dk, 3);
  fill_random_bf16(y, static_cast<long long>(p.n) * dk, 4);
  cublasHandle_t h;
  CK(cublasCreate(&h));
  const float one = 1.0f, zero = 0.0f;
  const float gemm_us = time_us(
      [&] {
        CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, dk, &one, y, CUDA_R_16BF, dk, x, CUDA_R_16BF, dk, &zero,
                        z, CUDA_R_32F, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      5);
  const double copy = copy_bandwidth();
  const double dense = p.flops() / (gemm_us * 1e-6);
  const double floor_us = (p.c_bytes() + p.operand_bytes()) / copy * 1e6;
  std::printf("%d experts, C %d x %d fp32 each over K = %d: %.1f GFLOP, C %.0f MB, operands %.0f MB (%d SMs)\n",
              p.experts, p.m, p.n, p.k, p.flops() / 1e9, p.c_bytes() / 1e6, p.operand_bytes() / 1e6, sms);
  std::printf("dense dW of the same FLOPs (cuBLAS): %.1f us, %.0f TFLOP/s; C + operands once through HBM at the copy's"
              " rate: %.1f us = %.2fx of it\n",
              gemm_us, dense / 1e12, floor_us, gemm_us / floor_us);
  std::printf("%-36s %-22s %8s %8s %8s %8s %10s\n", "block", "mode", "us", "x dense", "x none", "C TB/s", "oper TB/s");
  double none_us = 0;
  const auto report = [&](const char* block, Mode m, float us) {
    const double s = us * 1e-6;
    if (m == none) none_us = us;
    const double cb = (has_st(m) || has_bulk(m) || has_self(m)) ? p.c_bytes() / s / 1e12 : 0.0;
    const double lb = has_ld(m) ? p.operand_bytes() / s / 1e12 : 0.0;
    std::printf("%-36s %-22s %8.1f %8.2f %8.2f %8.2f %10.2f\n", block, kNames[m], us, gemm_us / us, none_us / us, cb, lb);
  };
  // The kept kernel's block: two consumer warpgroups on 128 x 256 tiles, one an SM.
  rows<2, 256, 4, false, none, bulk_paced, st_paced, self_store, ld_paced, ld_bulk_paced, ld_st_paced, ld_self, st_only,
       ld_only>("2 WG x 64x256, 4 stages", p, sms, true, sink, report);
  rows<2, 256, 3, false, ld_paced, ld_bulk_paced, ld_self>("2 WG x 64x256, 3 stages", p, sms, true, sink, report);
  // Two stages leave room for a whole tile's C in shared memory.
  rows<2, 256, 2, true, ld_paced, ld_bulk_paced, ld_self>("2 WG x 64x256, 2 stages + C buffer", p, sms, true, sink, report);
  // One consumer warpgroup on 128 x 128 tiles, 3 stages: two blocks an SM (one's epilogue under the
  // other's products), then one (nineteenth session: both slower; run with a fifth argument "all").
  if (argc > 5 && std::string(argv[5]) == "all") {
    rows<1, 128, 3, false, none, ld_paced, ld_st_paced, ld_bulk_paced, self_store, ld_self>(
        "1 WG x 128x128, 3 stages, 2 an SM", p, 2 * sms, false, sink, report);
    rows<1, 128, 3, false, none, ld_paced, ld_st_paced, ld_bulk_paced, self_store, ld_self>(
        "1 WG x 128x128, 3 stages, 1 an SM", p, sms, true, sink, report);
  }
  return 0;
}
