// The experts' weight gradients C_e += A_e^T B_e in one persistent launch (grouped_wgrad.hpp says
// why). Built from the pieces the wgmma attention kernels verified on the H200:
//   - 384 threads per block: two consumer warpgroups compute, a producer warpgroup loads
//     (warp_specialized.cuh: setmaxnreg 240 / 24, mbarrier-tracked stages);
//   - every tile in the 128-byte-swizzled layout, loaded by load_rows_sw128_producer (rows past the
//     expert's last are zero-filled, so a K tail needs no masking: zero rows add zero products);
//   - both operands MN-major: A_e^T is M x K with M contiguous (A_e is rows x M row-major), B_e is
//     K x N with N contiguous. wgmma reads either form from shared memory for bf16 (imm-trans-a,
//     imm-trans-b); the MN-major swizzled descriptor is the one test_wgmma's sw128 placement and the
//     attention kernels' V (forward) and dO/Q/K (backward) operands use: k-step of 16 K rows at
//     2048 bytes, SBO 1024 (next 8 K rows), LBO = the distance between 64-wide M/N halves.
// Tiles: 128 (M) x 256 (N) of C per block tile, K in steps of 64 rows; warpgroup w owns M rows
// 64w .. 64w+63 (one 64-wide half of the A tile: one swizzle atom along M, so A's LBO is unused)
// and all 256 columns as one m64n256k16 accumulator (128 fp32 registers per thread; two m64n128k16
// read the A tile twice from shared memory: 0.77x against 0.76x of dense, H200, 2026-12-01).
// Shared memory per stage: A 64 rows x 128 M (16 KiB: halves at 0 and 8 KiB) and B 64 rows x 256 N
// (32 KiB: four 64-wide N halves 8 KiB apart, loaded as two 128-column tiles), four stages
// (192 KiB) + 8 mbarriers + the epilogue's staging (2.5 KiB per consumer warp) + 1 KiB to align
// the tiles to 1024 bytes.
// Schedule: block b takes block tiles b, b + grid, ... of the list (problem, M tile, N tile), N
// tile fastest, or, given a counter, the next tile an atomicAdd hands out (for a launch beside
// other kernels: blocks that start late do not finish late); the producer picks and publishes
// each tile through a word per stage; the producer streams each tile's K steps through the stages
// without pausing between tiles, so the next tile's first stages load while the consumers write
// the finished one to C (through their staging, 16-byte stores or fire-and-forget L2 reductions,
// st.v4 / red.v4.f32: the consumers never wait for C's old values).
// 32-row K steps in 8 stages measured no better (0.76x / 0.75x against 0.76x / 0.76x); three
// stages run the products as fast as four (H200, 2026-12-01).
// Consumers keep one stage's wgmmas in flight (wait_group 1) and release a stage once the wgmmas
// reading it have completed.
// Determinism: each C element belongs to one thread of one block tile; its value is the wgmma sum
// over the problem's rows in K order, added to the old C once: the same bits every run (the
// reduction flushes subnormals, < 2^-126, to zero).
#include "grouped_wgrad.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../attention_common.cuh"
#include "consumer_ring.cuh"
#include "forward_checks.cuh"
#include "warp_specialized.cuh"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::smem_addr;

constexpr int kBM = kWgradTileM, kBN = kWgradTileN, kBK = 64, kStages = 4;
constexpr int kMaxGroups = 128;  // problems per launch: the parameters stay under 4 KiB
constexpr std::uint32_t kHalfBytes = kBK * 128;             // 64 rows x 64 columns of bf16: 8 KiB
constexpr std::uint32_t kATileBytes = kBK * kBM * 2;        // 16 KiB
constexpr std::uint32_t kBTileBytes = kBK * kBN * 2;        // 32 KiB
constexpr std::uint32_t kStageBytes = kATileBytes + kBTileBytes;
constexpr std::uint32_t kOffBar = kStages * kStageBytes;    // 192 KiB
constexpr std::uint32_t kOffTiles = kOffBar + 8 * 2 * kStages;  // int per stage + 2 broadcast ints
// The epilogue's staging: per consumer warp, 16 rows x 32 columns of fp32 at a time, rows 40
// floats apart, so a warp's 8-byte fragment stores (8 rows x 4 lanes) take the minimum two passes
// (rows 0-3 cover the 32 banks once, rows 4-7 again).
constexpr int kEpiCols = 32, kEpiStride = 40;
constexpr std::uint32_t kEpiWarpBytes = 16 * kEpiStride * 4;  // 2.5 KiB
constexpr std::uint32_t kOffEpi = (kOffTiles + 4 * (kStages + 2) + 15) / 16 * 16;
constexpr int kSmemBytes = static_cast<int>(kOffEpi + (kWsConsumerThreads / 32) * kEpiWarpBytes) + 1024;
static_assert(kSmemBytes <= kMaxDynamicSmem);

struct Params {
  int groups = 0, m_tiles = 0, n_tiles = 0, tiles = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  bool c_vec4 = false;     ///< every C 16-byte aligned and ldc a multiple of 4: 16-byte stores
  int* counter = nullptr;  ///< dynamic tiles: the next tile to hand out (0 at launch); nullptr: static
  const __nv_bfloat16* a[kMaxGroups];
  const __nv_bfloat16* b[kMaxGroups];
  float* c[kMaxGroups];
  int rows[kMaxGroups];
};
static_assert(sizeof(Params) <= 4096);

/// C[0..1] += (x, y) as one fire-and-forget vector reduction performed by L2 (sm_90: red .v2.f32):
/// the thread does not wait for the old value, so the epilogue costs issue slots, not round trips.
/// Round to nearest as an FADD, but subnormal inputs and results flush to zero (f32 reductions have
/// no .noftz; SASS REDG.E.ADD.F32x2.FTZ.RN): below 2^-126 a gradient element may differ from the
/// thread's own load, add and store.
__device__ __forceinline__ void red_add_v2(float* c, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(c), "f"(x), "f"(y) : "memory");
}

/// C[0..1] = (x, y): overwriting, C's old values are never read.
__device__ __forceinline__ void store_v2(float* c, float x, float y) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(c), "f"(x), "f"(y) : "memory");
}

/// C[0..3] (+)= v: one 16-byte reduction or store where C allows (vec4), else two of 8 bytes.
template <bool Accumulate>
__device__ __forceinline__ void put_4(float* c, float4 v, bool vec4) {
  if (vec4) {
    if constexpr (Accumulate)
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(c), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
    else
      asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(c), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
  } else if constexpr (Accumulate) {
    red_add_v2(c, v.x, v.y);
    red_add_v2(c + 2, v.z, v.w);
  } else {
    store_v2(c, v.x, v.y);
    store_v2(c + 2, v.z, v.w);
  }
}

template <bool Accumulate>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_wgrad_kernel(const __grid_constant__ Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: no alignment assumed below
  const std::uint32_t pad = pad_to_1024(smem_addr(smem_raw));  // the swizzled tiles start on 1024-byte boundaries
  const std::uint32_t base = smem_addr(smem_raw) + pad;
  // The tile each stage's K step belongs to (written by producer thread 0 before it arrives on the
  // stage's "full" barrier; -1: no more tiles), and the producers' broadcast of a fetched tile.
  volatile int* const stage_tile = reinterpret_cast<volatile int*>(smem_raw + pad + kOffTiles);
  volatile int* const fetched = stage_tile + kStages;
  const StageBarriers bar{base + kOffBar, kStages};
  bar.init(kWsProducerThreads + 1);  // "full": each producer thread's copies + thread 0's tile word

  // K step j of the block (counted over all its tiles) uses stage j % kStages, its (j / kStages)-th
  // use: "full" completes phase j / kStages when the producer's 128 threads' copies have landed and
  // thread 0 has published the stage's tile, "empty" when the 256 consumer threads have retired the
  // wgmmas that read it. The producer picks the tiles (block b takes b, b + grid, ...; or, with a
  // counter, whatever the next atomicAdd hands out) and the consumers learn each tile from its
  // first stage, so both walk the same K steps.
  const int tiles_per_group = p.m_tiles * p.n_tiles;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    int stage = 0;
    std::uint32_t phase = 0;
    bool reuse = false;  // a stage is refilled only after the consumers released its previous use
    for (int i = 0;; ++i) {
      int t = static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
      if (p.counter != nullptr) {
        // Thread 0 fetches, the producer warpgroup's named barrier publishes; two words
        // alternate, so thread 0 never overwrites one that another thread has yet to read.
        if (tid == 0) fetched[i & 1] = atomicAdd(p.counter, 1);
        asm volatile("bar.sync 1, %0;\n" ::"n"(kWsProducerThreads) : "memory");
        t = fetched[i & 1];
      }
      if (reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
      if (t >= p.tiles) {  // no more tiles: the stage says so, and nothing is copied into it
        if (tid == 0) {
          stage_tile[stage] = -1;
          mbar_arrive(bar.full(stage));
        }
        mbar_arrive(bar.full(stage));
        break;
      }
      const int g = t / tiles_per_group, r = t % tiles_per_group;
      const int rows = p.rows[g];
      const __nv_bfloat16* a = p.a[g] + (r / p.n_tiles) * kBM;
      const __nv_bfloat16* b = p.b[g] + (r % p.n_tiles) * kBN;
      for (int k0 = 0; k0 < rows; k0 += kBK) {
        if (k0 > 0 && reuse) mbar_wait(bar.empty(stage), phase ^ 1u);  // (the first step's wait is above)
        const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kStageBytes;
        load_rows_sw128_producer<kBK>(st, a, p.lda, k0, rows, tid);                    // A^T: 128 M
        load_rows_sw128_producer<kBK>(st + kATileBytes, b, p.ldb, k0, rows, tid);      // B: N 0..127
        load_rows_sw128_producer<kBK>(st + kATileBytes + 2 * kHalfBytes, b + 128, p.ldb, k0, rows, tid);  // 128..255
        if (tid == 0) {
          stage_tile[stage] = t;
          mbar_arrive(bar.full(stage));  // release: the word is seen by whoever waits on the phase
        }
        cp_async_mbar_arrive(bar.full(stage));
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
          reuse = true;
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  float acc[128];  // C columns 0..255 of the block tile, rows 64 wg ..: the m64n256 fragment
  ConsumerRing ring{bar};
  for (;;) {
    ring.wait_full();  // the tile's first K step (or the end)
    const int t = stage_tile[ring.stage];
    if (t < 0) break;
    const int g = t / tiles_per_group, r = t % tiles_per_group;
    const int m0 = (r / p.n_tiles) * kBM, n0 = (r % p.n_tiles) * kBN;
    const int ksteps = (p.rows[g] + kBK - 1) / kBK;
#pragma unroll
    for (int e = 0; e < 128; ++e) acc[e] = 0.0f;
    for (int ks = 0; ks < ksteps; ++ks) {
      if (ks > 0) ring.wait_full();
      fence_proxy_async_shared();  // the producer's cp.async writes, seen through the barrier, before the wgmmas
      const std::uint32_t st = base + static_cast<std::uint32_t>(ring.stage) * kStageBytes;
      const std::uint32_t a_st = st + static_cast<std::uint32_t>(wg) * kHalfBytes;
      const std::uint32_t b_st = st + kATileBytes;
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)  // one m64n256k16 over the four 64-wide N halves
        wgmma_m64n256k16_f32_bf16_ss<Major::mn, Major::mn>(acc, sw128::mnmajor_desc<kBK>(a_st, kk),
                                                           sw128::mnmajor_desc<kBK>(b_st, kk), 1);
      wgmma_commit_group();
      ring.step(acc);  // the previous step's wgmmas are done: its stage is free
    }
    ring.drain(acc);

    // C (+)= the tile. Thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) of the
    // warpgroup's 64, columns 8 j + 2 (lane % 4) (+ 1), j = 0..31 (wgmma.cuh's accumulator
    // fragment). Each warp passes its 16 rows through its staging 32 columns at a time and writes
    // whole 128-byte row pieces (a warp store covers four rows' 128 bytes), 16-byte stores or L2
    // reductions that nothing waits for. Straight from the fragment (eight rows' 32 bytes per warp
    // store, 8-byte stores) the kernel ran at 0.59-0.61x of a dense dW at 512 rows per expert
    // overwriting and 0.72-0.75x at 2048 adding; staged 0.64-0.68x and 0.78-0.83x (H200,
    // 2026-12-01; docs/hopper.md has what else was tried).
    const std::uint32_t epi = base + kOffEpi + static_cast<std::uint32_t>(wg * 4 + warp) * kEpiWarpBytes;
    float* const c_rows = p.c[g] + static_cast<std::int64_t>(m0 + 64 * wg + 16 * warp) * p.ldc + n0;
#pragma unroll
    for (int q = 0; q < kBN / kEpiCols; ++q) {
#pragma unroll
      for (int jj = 0; jj < kEpiCols / 8; ++jj)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int j = q * (kEpiCols / 8) + jj;
          const std::uint32_t at = epi + static_cast<std::uint32_t>(((lane >> 2) + 8 * hf) * kEpiStride + 8 * jj + 2 * (lane & 3)) * 4;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[4 * j + 2 * hf]), "f"(acc[4 * j + 2 * hf + 1]) : "memory");
        }
      __syncwarp();
      float4 v[4];  // rows 4 i + lane / 8, columns 4 (lane % 8) ..: all four loads, then the writes
#pragma unroll
      for (int i = 0; i < 4; ++i)
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v[i].x), "=f"(v[i].y), "=f"(v[i].z), "=f"(v[i].w)
                     : "r"(epi + static_cast<std::uint32_t>((4 * i + (lane >> 3)) * kEpiStride + 4 * (lane & 7)) * 4)
                     : "memory");
#pragma unroll
      for (int i = 0; i < 4; ++i)
        put_4<Accumulate>(c_rows + static_cast<std::int64_t>(4 * i + (lane >> 3)) * p.ldc + q * kEpiCols + 4 * (lane & 7), v[i],
                          p.c_vec4);
      __syncwarp();  // every lane's reads done before the next columns overwrite the staging
    }
  }
#else
  (void)p;
  __trap();
#endif
}

bool shape_ok(const WgradShape& s) {
  return s.m > 0 && s.n > 0 && s.m % kBM == 0 && s.n % kBN == 0 && s.lda >= s.m && s.ldb >= s.n && s.ldc >= s.n &&
         s.lda % 8 == 0 && s.ldb % 8 == 0 && s.ldc % 2 == 0 && (s.m / kBM) * (s.n / kBN) <= INT_MAX / kMaxGroups;
}

bool problem_ok(const WgradShape& s, const WgradProblem& q) {
  if (q.rows < 0 || q.rows > INT_MAX) return false;
  if (q.rows == 0) return s.accumulate || q.c != nullptr;  // overwriting, an empty problem's C is zeroed
  return q.a != nullptr && q.b != nullptr && q.c != nullptr && reinterpret_cast<std::uintptr_t>(q.a) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(q.b) % 16 == 0 && reinterpret_cast<std::uintptr_t>(q.c) % 8 == 0;
}

}  // namespace

bool grouped_wgrad_supported(const WgradShape& s, std::span<const WgradProblem> problems) {
  if (!shape_ok(s)) return false;
  for (const WgradProblem& q : problems)
    if (!problem_ok(s, q)) return false;
  return current_device_is_cc90() == cudaSuccess;
}

cudaError_t grouped_wgrad_wgmma(const WgradShape& s, std::span<const WgradProblem> problems, cudaStream_t stream,
                                int* tile_counter) {
  using ::oom::kernels::detail::refuse;
  if (!shape_ok(s))
    return refuse("grouped_wgrad_wgmma: a shape grouped_wgrad_supported rejects (m = ", s.m, ", n = ", s.n, ", lda = ", s.lda,
                  ", ldb = ", s.ldb, ", ldc = ", s.ldc, ")");
  for (std::size_t i = 0; i < problems.size(); ++i)
    if (!problem_ok(s, problems[i]))
      return refuse("grouped_wgrad_wgmma: problem ", i, " (rows = ", problems[i].rows,
                    ") is one grouped_wgrad_supported rejects (rows outside 0 .. 2^31 - 1; a, b or c null or misaligned;",
                    " or, overwriting, no c)");
  const auto kernel = s.accumulate ? grouped_wgrad_kernel<true> : grouped_wgrad_kernel<false>;
  int sms = 0;
  if (const cudaError_t e = prepare_persistent_launch(kernel, kSmemBytes, &sms); e != cudaSuccess) return e;
  Params params;
  params.m_tiles = static_cast<int>(s.m / kBM);
  params.n_tiles = static_cast<int>(s.n / kBN);
  params.lda = s.lda;
  params.ldb = s.ldb;
  params.ldc = s.ldc;
  params.counter = tile_counter;
  params.c_vec4 = s.ldc % 4 == 0;
  const auto launch = [&]() -> cudaError_t {
    if (params.groups == 0) return cudaSuccess;
    params.tiles = params.groups * params.m_tiles * params.n_tiles;
    const int grid = params.tiles < sms ? params.tiles : sms;
    if (tile_counter != nullptr)
      if (const cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(grid), kWsThreads, kSmemBytes, stream>>>(params);
    params.groups = 0;
    return cudaGetLastError();
  };
  for (const WgradProblem& q : problems) {
    if (q.rows == 0) {
      if (!s.accumulate)  // C = the sum of no products
        if (const cudaError_t e = cudaMemset2DAsync(q.c, s.ldc * sizeof(float), 0, s.n * sizeof(float), s.m, stream); e != cudaSuccess)
          return e;
      continue;
    }
    const int g = params.groups++;
    params.a[g] = reinterpret_cast<const __nv_bfloat16*>(q.a);
    params.b[g] = reinterpret_cast<const __nv_bfloat16*>(q.b);
    params.c[g] = q.c;
    params.c_vec4 = params.c_vec4 && reinterpret_cast<std::uintptr_t>(q.c) % 16 == 0;
    params.rows[g] = static_cast<int>(q.rows);
    if (params.groups == kMaxGroups)
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace oom::kernels::hopper
