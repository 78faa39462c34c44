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
static_assert(kSmemBytes <= 227 * 1024);
constexpr std::uint32_t kSwAtom = 1024;  // 8 rows of 128 bytes

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

/// An MN-major swizzled operand of 16 K rows starting at `addr` (LBO: the next 64-wide M/N half).
__device__ __forceinline__ std::uint64_t mn_desc(std::uint32_t addr) {
  return encode_smem_desc(addr, kHalfBytes, kSwAtom, Swizzle::b128);
}

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
        wgmma_m64n256k16_f32_bf16_ss<Major::mn, Major::mn>(acc, mn_desc(a_st + kk * 2 * kSwAtom), mn_desc(b_st + kk * 2 * kSwAtom), 1);
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

// ---- The A-stationary schedule (seventeenth session; docs/hopper.md says why) ----
// The unit of work is one (problem, 128-row M tile): the block loads that tile's A_e^T (128 x K,
// the expert's rows) into shared memory once, chunk by chunk as its first N tile's K steps need
// them, and keeps it while it walks the unit's N tiles of 128 columns, streaming only B. Per
// 128 x 128 tile at 512 rows that is B 128 KiB + C 64 KiB + A amortised over the N tiles, ~200
// KiB for half the FLOPs of the streaming kernel's 512 KiB tile. Each consumer warpgroup holds
// two m64n128 accumulators and alternates them: it writes a finished tile's 64 x 128 to C (straight
// from the fragment, 32 columns after each of the next tile's first four K steps is issued) while
// that next tile's wgmmas run, so the tensor cores do not idle through the epilogue.
// Shared memory: A's K chunks (9 x 16 KiB: problems of at most 576 rows; larger ones go to the
// streaming kernel), four B stages of 64 K rows x 128 N (16 KiB), the epilogue's staging (1.25 KiB
// per consumer warp), the stage barriers, one "A empty" barrier per chunk, the stage words, 1 KiB
// to align the tiles.
// MEASURED SLOWER THAN THE STREAMING KERNEL (H200, 2026-12-01, scripts/diag/wgrad_schedules.cu, 64
// experts x 512 rows, C overwritten, ratio to one dense dW): 0.49 / 0.46 (down / gate_up) against
// 0.62 / 0.55; with its global stores predicated off 0.76 / 0.70, with the staging off too
// 1.28 / 1.28; fragment stores straight to C 0.51 / 0.49. The epilogue is not hidden by running
// beside the next tile's wgmmas: see docs/hopper.md.
// A's reuse: the consumers arrive on chunk c's barrier once per unit, when the wgmmas of the unit's
// last N tile that read it have completed (chunks past the unit's K steps when its last tile ends),
// so the producer loads unit i's chunk c (i > 0) after waiting for phase i - 1 of it.
constexpr int kSN = 128, kSChunks = 9, kSStages = 4;
constexpr std::int64_t kStationaryMaxRows = static_cast<std::int64_t>(kSChunks) * kBK;  // 576
static_assert(kStationaryMaxRows == grouped_wgrad_stationary_max_rows);
constexpr std::uint32_t kSBStageBytes = kBK * kSN * 2;                            // 16 KiB
constexpr std::uint32_t kSOffB = kSChunks * kATileBytes;                           // 144 KiB
constexpr std::uint32_t kSOffEpi = kSOffB + kSStages * kSBStageBytes;              // 208 KiB
// The epilogue's staging: per consumer warp, 8 rows x 32 columns of fp32 at a time, rows 40 floats
// apart (as the streaming kernel's: a warp's 8-byte fragment stores take the minimum two passes).
constexpr std::uint32_t kSEpiWarpBytes = 8 * kEpiStride * 4;                      // 1.25 KiB
constexpr std::uint32_t kSOffBar = kSOffEpi + (kWsConsumerThreads / 32) * kSEpiWarpBytes;  // 218 KiB
constexpr std::uint32_t kSOffAEmpty = kSOffBar + 8 * 2 * kSStages;
constexpr std::uint32_t kSOffTiles = kSOffAEmpty + 8 * kSChunks;
constexpr int kSSmemBytes = static_cast<int>(kSOffTiles + 4 * (kSStages + 2)) + 1024;
static_assert(kSSmemBytes <= 227 * 1024);

/// C[0..3] (+)= v where `on` (one predicated 16-byte store or L2 reduction where C allows, else two
/// of 8 bytes): the registers are read either way, so no branch separates them from the wgmmas.
template <bool Accumulate>
__device__ __forceinline__ void put_4_if(float* c, float4 v, bool vec4, bool on) {
  const int p = on ? 1 : 0;
#define OOM_PUT_IF(op, n)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n@p " op " [%0], {%1, %2" n "};\n}\n" ::"l"(c), \
               "f"(v.x), "f"(v.y), "f"(v.z), "r"(p), "f"(v.w)                                   \
               : "memory")
  if (vec4) {
    if constexpr (Accumulate)
      OOM_PUT_IF("red.global.add.v4.f32", ", %3, %5");
    else
      OOM_PUT_IF("st.global.v4.f32", ", %3, %5");
  } else {
    if constexpr (Accumulate) {
      OOM_PUT_IF("red.global.add.v2.f32", "");
      c += 2;
      v.x = v.z;
      v.y = v.w;
      OOM_PUT_IF("red.global.add.v2.f32", "");
    } else {
      OOM_PUT_IF("st.global.v2.f32", "");
      c += 2;
      v.x = v.z;
      v.y = v.w;
      OOM_PUT_IF("st.global.v2.f32", "");
    }
  }
#undef OOM_PUT_IF
}

/// Columns 32 q .. 32 q + 31 of a warpgroup's finished 64 x 128 accumulator to C (`c_rows`: the
/// warp's first row; nullptr: nothing written), through the warp's staging (`epi`) eight rows at
/// a time: the thread's fragment (rows lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1), j = 4 q ..
/// 4 q + 3; wgmma.cuh) in, then rows 4 i + lane / 8 as 16-byte pieces out, so a warp store covers
/// four rows' 128 bytes. From the fragment directly (8-byte stores, eight rows' 32 bytes per warp
/// store) the epilogue took 60% of the kernel's time (0.51x of a dense dW against 1.28x with the
/// stores switched off, H200, 2026-12-01). `q` is a constant where the callers' loops unroll.
template <bool Accumulate>
__device__ __forceinline__ void put_columns(const float (&acc)[64], float* c_rows, std::int64_t ldc, bool vec4, std::uint32_t epi,
                                            int lane, int q) {
  const bool on = c_rows != nullptr;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * q + jj;
      const std::uint32_t at = epi + static_cast<std::uint32_t>((lane >> 2) * kEpiStride + 8 * jj + 2 * (lane & 3)) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[4 * j + 2 * hf]), "f"(acc[4 * j + 2 * hf + 1]) : "memory");
    }
    __syncwarp();
    float4 v[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(v[i].x), "=f"(v[i].y), "=f"(v[i].z), "=f"(v[i].w)
                   : "r"(epi + static_cast<std::uint32_t>((4 * i + (lane >> 3)) * kEpiStride + 4 * (lane & 7)) * 4)
                   : "memory");
#pragma unroll
    for (int i = 0; i < 2; ++i)
      put_4_if<Accumulate>(c_rows + static_cast<std::int64_t>(8 * hf + 4 * i + (lane >> 3)) * ldc + 32 * q + 4 * (lane & 7), v[i],
                           vec4, on);
    __syncwarp();  // every lane's reads done before the next rows overwrite the staging
  }
}

/// The consumers' walk through the B stages, as ConsumerRing, also releasing A's chunks: a step of
/// a unit's last N tile names its chunk, whose "A empty" barrier is arrived on when the step's
/// wgmmas are known complete.
struct StationaryRing {
  StageBarriers bar;
  std::uint32_t a_empty;  ///< chunk c's barrier at a_empty + 8 c
  int stage = 0;
  std::uint32_t phase = 0;
  int held = -1, held_chunk = -1;

  __device__ __forceinline__ void wait_full() const { mbar_wait(bar.full(stage), phase); }
  __device__ __forceinline__ void release() {
    if (held >= 0) mbar_arrive(bar.empty(held));
    if (held_chunk >= 0) mbar_arrive(a_empty + 8u * static_cast<std::uint32_t>(held_chunk));
  }
  /// After a K step's wgmmas are committed: retires the previous step's, releases what it read.
  __device__ __forceinline__ void step(float (&acc)[64], int chunk) {
    wgmma_wait_group<1>();
    wgmma_fence_operands(acc);
    release();
    held = stage;
    held_chunk = chunk;
    if (++stage == bar.stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  /// After a unit's last tile's K steps: the chunks from `from` on, which the unit did not load,
  /// released now (its last step's chunk is released with that step's stage, when it retires).
  __device__ __forceinline__ void release_unloaded(int from) const {
    for (int c = from; c < kSChunks; ++c) mbar_arrive(a_empty + 8u * static_cast<std::uint32_t>(c));
  }
  /// At the end: every wgmma complete (the last tile's, into `acc`), the last stage released.
  __device__ __forceinline__ void drain(float (&acc)[64]) {
    wgmma_wait_group<0>();
    wgmma_fence_operands(acc);
    release();
    held = held_chunk = -1;
  }
};

/// A problem's K steps in the stationary kernel: at least four (the zero rows past its end add
/// nothing), so that each of a tile's first four steps carries 32 columns of the previous tile's
/// epilogue without a branch around its wgmmas (ptxas serialises wgmmas issued on divergent paths).
__host__ __device__ constexpr int stationary_k_steps(int rows) {
  const int k = (rows + kBK - 1) / kBK;
  return k > kSN / 32 ? k : kSN / 32;
}

/// Where a tile's 64-row warpgroup half starts in C, for warp `warp` of warpgroup `wg`.
__device__ __forceinline__ float* stationary_c_rows(const Params& p, int t, int wg, int warp) {
  const int u = t / p.n_tiles, nt = t % p.n_tiles;
  const int g = u / p.m_tiles, mt = u % p.m_tiles;
  return p.c[g] + static_cast<std::int64_t>(mt * kBM + 64 * wg + 16 * warp) * p.ldc + nt * kSN;
}

/// One tile into `cur` while `prev` (the warpgroup's previous tile, C rows `prev_rows`; nullptr:
/// none) goes to C. The previous tile's last K step may still be in flight on entry: it retires
/// in this tile's first step (wait_group 1 after this tile's first wgmmas), so the tensor cores
/// never drain between tiles. False at the end of the block's work, with every wgmma complete
/// and `prev` ready to write.
template <bool Accumulate>
__device__ __forceinline__ bool stationary_tile(const Params& p, volatile int* stage_tile, std::uint32_t base,
                                                StationaryRing& ring, float (&cur)[64], float (&prev)[64],
                                                float*& prev_rows, std::uint32_t epi, int wg, int warp, int lane) {
  ring.wait_full();  // the tile's first K step (or the end)
  const int t = stage_tile[ring.stage];
  if (t < 0) {
    ring.drain(prev);
    return false;
  }
  const int u = t / p.n_tiles;
  const bool last_n = t % p.n_tiles == p.n_tiles - 1;
  const int ksteps = stationary_k_steps(p.rows[u / p.m_tiles]);
  const auto issue = [&](int ks) {
    fence_proxy_async_shared();  // the producer's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_st = base + static_cast<std::uint32_t>(ks) * kATileBytes + static_cast<std::uint32_t>(wg) * kHalfBytes;
    const std::uint32_t b_st = base + kSOffB + static_cast<std::uint32_t>(ring.stage) * kSBStageBytes;
    wgmma_fence_operands(cur);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      wgmma_m64n128k16_f32_bf16_ss<Major::mn, Major::mn>(cur, mn_desc(a_st + kk * 2 * kSwAtom), mn_desc(b_st + kk * 2 * kSwAtom), kk > 0 || ks > 0);
    wgmma_commit_group();
  };
  // The first four K steps each followed by 32 of the previous tile's columns, written while that
  // step's products are in flight (the first step's wait retires the previous tile's last).
  // (Read between a wgmma's issue and the next wait_group, the previous accumulator made ptxas
  // inject waits and serialise the wgmmas: C7517 / C7518.)
#pragma unroll
  for (int q = 0; q < kSN / 32; ++q) {
    if (q > 0) ring.wait_full();
    issue(q);
    ring.step(cur, last_n ? q : -1);
    if (q == 0) wgmma_fence_operands(prev);
    put_columns<Accumulate>(prev, prev_rows, p.ldc, p.c_vec4, epi, lane, q);
  }
  for (int ks = kSN / 32; ks < ksteps; ++ks) {
    ring.wait_full();
    issue(ks);
    ring.step(cur, last_n ? ks : -1);
  }
  if (last_n) ring.release_unloaded(ksteps);
  prev_rows = stationary_c_rows(p, t, wg, warp);
  return true;
}

template <bool Accumulate>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_wgrad_stationary_kernel(const __grid_constant__ Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t pad = pad_to_1024(smem_addr(smem_raw));
  const std::uint32_t base = smem_addr(smem_raw) + pad;
  volatile int* const stage_tile = reinterpret_cast<volatile int*>(smem_raw + pad + kSOffTiles);
  volatile int* const fetched = stage_tile + kSStages;
  const StageBarriers bar{base + kSOffBar, kSStages};
  const std::uint32_t a_empty = base + kSOffAEmpty;
  if (threadIdx.x == 0)
    for (int c = 0; c < kSChunks; ++c) mbar_init(a_empty + 8u * static_cast<std::uint32_t>(c), kWsConsumerThreads);
  bar.init(kWsProducerThreads + 1);  // (fences the inits above too, then synchronises the block)

  const int units = p.groups * p.m_tiles;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    int stage = 0;
    std::uint32_t phase = 0;
    bool reuse = false;
    for (int i = 0;; ++i) {
      int u = static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
      if (p.counter != nullptr) {
        if (tid == 0) fetched[i & 1] = atomicAdd(p.counter, 1);
        asm volatile("bar.sync 1, %0;\n" ::"n"(kWsProducerThreads) : "memory");
        u = fetched[i & 1];
      }
      if (u >= units) {
        if (reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
        if (tid == 0) {
          stage_tile[stage] = -1;
          mbar_arrive(bar.full(stage));
        }
        mbar_arrive(bar.full(stage));
        break;
      }
      const int g = u / p.m_tiles;
      const int rows = p.rows[g], ksteps = stationary_k_steps(rows);
      const __nv_bfloat16* const a = p.a[g] + (u % p.m_tiles) * kBM;
      for (int nt = 0; nt < p.n_tiles; ++nt) {
        const __nv_bfloat16* const b = p.b[g] + nt * kSN;
        for (int k0 = 0; k0 < ksteps * kBK; k0 += kBK) {
          if (reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
          if (nt == 0) {  // the unit's A chunk with its first N tile's K step, once the last unit's reads are done
            const int c = k0 / kBK;
            if (i > 0) mbar_wait(a_empty + 8u * static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(i - 1) & 1u);
            load_rows_sw128_producer<kBK>(base + static_cast<std::uint32_t>(c) * kATileBytes, a, p.lda, k0, rows, tid);
          }
          load_rows_sw128_producer<kBK>(base + kSOffB + static_cast<std::uint32_t>(stage) * kSBStageBytes, b, p.ldb, k0, rows, tid);
          if (tid == 0) {
            stage_tile[stage] = u * p.n_tiles + nt;
            mbar_arrive(bar.full(stage));
          }
          cp_async_mbar_arrive(bar.full(stage));
          if (++stage == kSStages) {
            stage = 0;
            phase ^= 1u;
            reuse = true;
          }
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  float acc0[64], acc1[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) acc1[e] = 0.0f;  // (never written to C before a tile fills it)
  StationaryRing ring{bar, a_empty};
  float* prev_rows = nullptr;
  const std::uint32_t epi = base + kSOffEpi + static_cast<std::uint32_t>(wg * 4 + warp) * kSEpiWarpBytes;
  for (;;) {
    if (!stationary_tile<Accumulate>(p, stage_tile, base, ring, acc0, acc1, prev_rows, epi, wg, warp, lane)) {
#pragma unroll
      for (int q = 0; q < kSN / 32; ++q) put_columns<Accumulate>(acc1, prev_rows, p.ldc, p.c_vec4, epi, lane, q);
      break;
    }
    if (!stationary_tile<Accumulate>(p, stage_tile, base, ring, acc1, acc0, prev_rows, epi, wg, warp, lane)) {
#pragma unroll
      for (int q = 0; q < kSN / 32; ++q) put_columns<Accumulate>(acc0, prev_rows, p.ldc, p.c_vec4, epi, lane, q);
      break;
    }
  }
#else
  (void)p;
  __trap();
#endif
}

bool shape_ok(const WgradShape& s) {
  return s.m > 0 && s.n > 0 && s.m % kBM == 0 && s.n % kBN == 0 && s.lda >= s.m && s.ldb >= s.n && s.ldc >= s.n &&
         s.lda % 8 == 0 && s.ldb % 8 == 0 && s.ldc % 2 == 0 && (s.m / kBM) * (s.n / kSN) <= INT_MAX / kMaxGroups;
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
  if (!shape_ok(s)) return cudaErrorInvalidValue;
  for (const WgradProblem& q : problems)
    if (!problem_ok(s, q)) return cudaErrorInvalidValue;
  const auto streaming = s.accumulate ? grouped_wgrad_kernel<true> : grouped_wgrad_kernel<false>;
  const auto stationary = s.accumulate ? grouped_wgrad_stationary_kernel<true> : grouped_wgrad_stationary_kernel<false>;
  int sms = 0;
  if (const cudaError_t e = prepare_persistent_launch(streaming, kSmemBytes, &sms); e != cudaSuccess) return e;
  if (const cudaError_t e = prepare_persistent_launch(stationary, kSSmemBytes, &sms); e != cudaSuccess) return e;
  // Two lists: problems of at most kStationaryMaxRows rows for the A-stationary kernel (unless
  // s.stationary is false), the rest for the streaming one; each launched when full and at the end.
  Params wide, narrow;  // the streaming kernel's (256-column tiles) and the stationary one's (128)
  for (Params* q : {&wide, &narrow}) {
    q->m_tiles = static_cast<int>(s.m / kBM);
    q->lda = s.lda;
    q->ldb = s.ldb;
    q->ldc = s.ldc;
    q->counter = tile_counter;
    q->c_vec4 = s.ldc % 4 == 0;
  }
  wide.n_tiles = static_cast<int>(s.n / kBN);
  narrow.n_tiles = static_cast<int>(s.n / kSN);
  const auto launch = [&](Params& q) -> cudaError_t {
    if (q.groups == 0) return cudaSuccess;
    const bool is_narrow = &q == &narrow;
    q.tiles = q.groups * q.m_tiles * q.n_tiles;
    const int work = is_narrow ? q.groups * q.m_tiles : q.tiles;  // units (M tiles) or tiles
    const int grid = work < sms ? work : sms;
    if (tile_counter != nullptr)
      if (const cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
    if (is_narrow)
      stationary<<<static_cast<unsigned>(grid), kWsThreads, kSSmemBytes, stream>>>(q);
    else
      streaming<<<static_cast<unsigned>(grid), kWsThreads, kSmemBytes, stream>>>(q);
    q.groups = 0;
    return cudaGetLastError();
  };
  for (const WgradProblem& q : problems) {
    if (q.rows == 0) {
      if (!s.accumulate)  // C = the sum of no products
        if (const cudaError_t e = cudaMemset2DAsync(q.c, s.ldc * sizeof(float), 0, s.n * sizeof(float), s.m, stream); e != cudaSuccess)
          return e;
      continue;
    }
    Params& list = s.stationary && q.rows <= kStationaryMaxRows ? narrow : wide;
    const int g = list.groups++;
    list.a[g] = reinterpret_cast<const __nv_bfloat16*>(q.a);
    list.b[g] = reinterpret_cast<const __nv_bfloat16*>(q.b);
    list.c[g] = q.c;
    list.c_vec4 = list.c_vec4 && reinterpret_cast<std::uintptr_t>(q.c) % 16 == 0;
    list.rows[g] = static_cast<int>(q.rows);
    if (list.groups == kMaxGroups)
      if (const cudaError_t e = launch(list); e != cudaSuccess) return e;
  }
  if (const cudaError_t e = launch(narrow); e != cudaSuccess) return e;
  return launch(wide);
}

}  // namespace oom::kernels::hopper
