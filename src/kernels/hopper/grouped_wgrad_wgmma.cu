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
// (192 KiB) + 8 mbarriers + 1 KiB to align the tiles to 1024 bytes.
// Schedule: block b takes block tiles b, b + grid, ... of the list (problem, M tile, N tile), N
// tile fastest, or, given a counter, the next tile an atomicAdd hands out (for a launch beside
// other kernels: blocks that start late do not finish late); the producer picks and publishes
// each tile through a word per stage; the producer streams each tile's K steps through the stages without pausing between
// tiles, so the next tile's first stages load while the consumers add the finished one into C
// (fire-and-forget reductions in L2, red.v2.f32: the consumers do not wait for C's old values).
// 32-row K steps in 8 stages measured no better (0.76x / 0.75x against 0.76x / 0.76x).
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
#include "tma.cuh"
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
constexpr int kSmemBytes = static_cast<int>(kOffTiles) + 4 * (kStages + 2) + 1024;
static_assert(kSmemBytes <= 227 * 1024);
constexpr std::uint32_t kSwAtom = 1024;  // 8 rows of 128 bytes

struct Params {
  int groups = 0, m_tiles = 0, n_tiles = 0, tiles = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
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

    // C += the tile: thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) of the warpgroup's 64,
    // columns 8 j + 2 (lane % 4) (+ 1), j = 0..31 (wgmma.cuh's accumulator fragment), added by L2
    // (red_add_v2): nothing waited for. A load, add and store here instead left the tensor cores
    // idle for the round trips: 0.68x dense against 0.76x (H200, 2026-12-01).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float* row = p.c[g] + static_cast<std::int64_t>(m0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * hf) * p.ldc + n0 +
                   2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if constexpr (Accumulate)
          red_add_v2(row + 8 * j, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
        else
          store_v2(row + 8 * j, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
      }
    }
  }
#else
  (void)p;
  __trap();
#endif
}

// ---- WgradKernel::tma_multicast: 2-CTA clusters sharing B ----
// Why: at 512 rows per expert the kernel above is bound by its tile loads through L2 (ncu: L2 68.8%
// busy, tensor pipe 51%; a 128 x 256 tile reads (128 + 256) x K bf16: 1.2 GB for the 5.13B down
// dW at T = 4096, against 0.4 GB written). Here two CTAs of a cluster take the two M tiles
// 2 mp, 2 mp + 1 of one (problem, N tile): each loads its own A tile and half of the B tile by TMA,
// the B half multicast into both CTAs' shared memory (the same offsets, each CTA's "full" barrier
// signalled), so the pair reads B once: a third less L2 traffic per tile.
//   - The views (tma.cuh, encode_matrix_sw128): A_e (rows_e x m) and B_e (rows_e x n) in boxes of
//     64 columns x 64 rows, ending at the expert's last row, so a K tail comes in as zeros; two
//     tensor maps per problem in the parameters (64 problems per launch).
//   - A stage is refilled only once both CTAs' consumers have released it (the peer's multicast
//     writes into this CTA's stage too): each consumer warp arrives on its own CTA's "empty"
//     barrier and on the peer's (mapa + a cluster-scope remote arrive), count 2 x 8 warps.
//   - Both CTAs walk the same pairs (static: cluster c takes pairs c, c + clusters, ...), so they
//     fill and free the stages in step; a peer's bytes may reach this CTA's "full" barrier before
//     its own producer's expect_tx of that phase (the transaction count goes negative meanwhile;
//     the phase cannot complete without that arrival).
//   - A cluster barrier after the barriers' initialisation (no multicast or remote arrival before
//     the peer's barriers exist) and before exit (none after the peer has gone).
// The products, the epilogue and the bits are the kernel above's.
constexpr int kMcGroups = 64;  // problems per launch: two tensor maps each in the parameters
constexpr int kMcStages = 4;
constexpr std::uint32_t kMcHalfBytes = 64 * 128;              // 64 K rows x 64 columns of bf16
constexpr std::uint32_t kMcATileBytes = 2 * kMcHalfBytes;     // 128 M
constexpr std::uint32_t kMcStageBytes = kMcATileBytes + 4 * kMcHalfBytes;  // + 256 N: 48 KiB
constexpr std::uint32_t kMcOffBar = kMcStages * kMcStageBytes;
constexpr std::uint32_t kMcOffWords = kMcOffBar + 16u * kMcStages;
constexpr int kMcSmemBytes = static_cast<int>(kMcOffWords) + 4 * kMcStages + 1024;
static_assert(kMcSmemBytes <= 227 * 1024);

struct McParams {
  CUtensorMap a_map[kMcGroups];
  CUtensorMap b_map[kMcGroups];
  int groups = 0, pair_tiles = 0, n_tiles = 0, pairs = 0;  ///< pair_tiles: M tile pairs per problem
  std::int64_t ldc = 0;
  float* c[kMcGroups];
  int rows[kMcGroups];
};
static_assert(sizeof(McParams) <= 32764);

__device__ __forceinline__ std::uint32_t cluster_ctarank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// All threads of both CTAs: release this CTA's writes, acquire the peer's. (Not .aligned: the
/// producer warp arrives from diverged threads.)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
/// One arrival on the mbarrier at this CTA's shared address `bar` as mapped into CTA `rank`.
__device__ __forceinline__ void mbar_arrive_cluster(std::uint32_t bar, std::uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}
/// A 2-D box into shared address `dst` of every CTA in `mask` (the same offset in each), each
/// signalling its own mbarrier at offset `bar` (complete_tx).
__device__ __forceinline__ void tma_load_2d_multicast(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c0, int c1,
                                                      std::uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}

template <bool Accumulate>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kWsThreads, 1) grouped_wgrad_mc_kernel(const __grid_constant__ McParams p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t pad = pad_to_1024(smem_addr(smem_raw));
  const std::uint32_t base = smem_addr(smem_raw) + pad;
  volatile int* const stage_pair = reinterpret_cast<volatile int*>(smem_raw + pad + kMcOffWords);
  const StageBarriers bar{base + kMcOffBar, kMcStages};
  bar.init(1, 2 * kWsConsumerThreads / 32);  // "full": the producer's expect_tx; "empty": both CTAs' consumer warps
  cluster_sync();                            // the peer's barriers exist before anything signals them
  const std::uint32_t rank = cluster_ctarank(), peer = rank ^ 1u;
  const int cluster = static_cast<int>(blockIdx.x) / 2, clusters = static_cast<int>(gridDim.x) / 2;
  const int tiles_per_group = p.pair_tiles * p.n_tiles;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == kWsConsumerThreads) {  // one thread issues every copy
      int stage = 0;
      std::uint32_t phase = 0;
      bool reuse = false;
      for (int t = cluster;; t += clusters) {
        if (reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
        if (t >= p.pairs) {  // no more pairs: the stage says so, nothing is copied into it
          stage_pair[stage] = -1;
          mbar_arrive(bar.full(stage));
          break;
        }
        const int g = t / tiles_per_group, r = t % tiles_per_group;
        const int m0 = (2 * (r / p.n_tiles) + static_cast<int>(rank)) * kBM, n0 = (r % p.n_tiles) * kBN;
        for (int k0 = 0; k0 < p.rows[g]; k0 += 64) {
          if (k0 > 0 && reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
          const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kMcStageBytes;
          stage_pair[stage] = t;
          mbar_arrive_expect_tx(bar.full(stage), kMcStageBytes);  // A 16 KiB + both B halves 32 KiB
#pragma unroll
          for (int h = 0; h < 2; ++h) tma_load_2d(st + h * kMcHalfBytes, &p.a_map[g], bar.full(stage), m0 + 64 * h, k0);
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // this CTA's half of B (64-column boxes 2 rank, 2 rank + 1), to both
            const int box = 2 * static_cast<int>(rank) + h;
            tma_load_2d_multicast(st + kMcATileBytes + static_cast<std::uint32_t>(box) * kMcHalfBytes, &p.b_map[g], bar.full(stage),
                                  n0 + 64 * box, k0, 0x3);
          }
          if (++stage == kMcStages) {
            stage = 0;
            phase ^= 1u;
            reuse = true;
          }
        }
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int ctid = static_cast<int>(threadIdx.x);
    const int warp = (ctid / 32) % 4, lane = ctid & 31;
    float acc[128];
    int stage = 0;
    std::uint32_t phase = 0;
    // A stage's release: this warp's wgmmas that read it are done; one arrival here, one at the peer.
    const auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(bar.empty(s));
        mbar_arrive_cluster(bar.empty(s), peer);
      }
    };
    for (;;) {
      mbar_wait(bar.full(stage), phase);
      const int t = stage_pair[stage];
      if (t < 0) break;
      const int g = t / tiles_per_group, r = t % tiles_per_group;
      const int m0 = (2 * (r / p.n_tiles) + static_cast<int>(rank)) * kBM, n0 = (r % p.n_tiles) * kBN;
      const int ksteps = (p.rows[g] + 63) / 64;
      int held = -1;
#pragma unroll
      for (int e = 0; e < 128; ++e) acc[e] = 0.0f;  // (added to as the kernel above does: the same bits)
      for (int ks = 0; ks < ksteps; ++ks) {
        if (ks > 0) mbar_wait(bar.full(stage), phase);  // TMA writes are the async proxy's: no proxy fence
        const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kMcStageBytes;
        const std::uint32_t a_st = st + static_cast<std::uint32_t>(wg) * kMcHalfBytes, b_st = st + kMcATileBytes;
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n256k16_f32_bf16_ss<Major::mn, Major::mn>(acc, mn_desc(a_st + kk * 2 * kSwAtom), mn_desc(b_st + kk * 2 * kSwAtom), 1);
        wgmma_commit_group();
        wgmma_wait_group<1>();
        wgmma_fence_operands(acc);
        if (held >= 0) release(held);
        held = stage;
        if (++stage == kMcStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      wgmma_wait_group<0>();
      wgmma_fence_operands(acc);
      if (held >= 0) release(held);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float* row = p.c[g] + static_cast<std::int64_t>(m0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * hf) * p.ldc + n0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          if constexpr (Accumulate)
            red_add_v2(row + 8 * j, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
          else
            store_v2(row + 8 * j, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
        }
      }
    }
  }
  cluster_sync();  // no remote arrival or multicast reaches a CTA that has exited
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

bool valid(const WgradShape& s, std::span<const WgradProblem> problems, WgradKernel kernel) {
  if (!shape_ok(s)) return false;
  if (kernel == WgradKernel::tma_multicast && (s.m / kBM) % 2 != 0) return false;  // M tiles in pairs
  if (kernel != WgradKernel::cp_async && kernel != WgradKernel::tma_multicast) return false;
  for (const WgradProblem& q : problems)
    if (!problem_ok(s, q)) return false;
  return true;
}

/// Overwriting, the empty problems' C = 0 on `stream`.
cudaError_t zero_empty(const WgradShape& s, std::span<const WgradProblem> problems, cudaStream_t stream) {
  if (s.accumulate) return cudaSuccess;
  for (const WgradProblem& q : problems)
    if (q.rows == 0)
      if (const cudaError_t e = cudaMemset2DAsync(q.c, s.ldc * sizeof(float), 0, s.n * sizeof(float), s.m, stream); e != cudaSuccess)
        return e;
  return cudaSuccess;
}

/// The multicast kernel's variant, its shared memory set; how many of its clusters fit at once.
cudaError_t multicast_kernel(bool accumulate, cudaStream_t stream, void (**kernel)(McParams), int* clusters) {
  *kernel = accumulate ? grouped_wgrad_mc_kernel<true> : grouped_wgrad_mc_kernel<false>;
  if (const cudaError_t e = cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMcSmemBytes); e != cudaSuccess)
    return e;
  cudaLaunchConfig_t config{};  // (the cluster shape is the kernel's own, __cluster_dims__)
  config.gridDim = dim3(2, 1, 1);
  config.blockDim = dim3(kWsThreads, 1, 1);
  config.dynamicSmemBytes = kMcSmemBytes;
  config.stream = stream;
  return cudaOccupancyMaxActiveClusters(clusters, *kernel, &config);
}

/// WgradKernel::tma_multicast: one launch of 2-CTA clusters per kMcGroups non-empty problems.
cudaError_t launch_multicast(const WgradShape& s, std::span<const WgradProblem> problems, cudaStream_t stream) {
  void (*kernel)(McParams) = nullptr;
  int clusters = 0;  // resident at once
  if (const cudaError_t e = multicast_kernel(s.accumulate, stream, &kernel, &clusters); e != cudaSuccess) return e;
  if (clusters < 1) return cudaErrorNotSupported;
  McParams params;
  params.pair_tiles = static_cast<int>(s.m / kBM / 2);
  params.n_tiles = static_cast<int>(s.n / kBN);
  params.ldc = s.ldc;
  const auto launch = [&]() -> cudaError_t {
    if (params.groups == 0) return cudaSuccess;
    params.pairs = params.groups * params.pair_tiles * params.n_tiles;
    const int grid = 2 * (params.pairs < clusters ? params.pairs : clusters);
    kernel<<<static_cast<unsigned>(grid), kWsThreads, kMcSmemBytes, stream>>>(params);
    params.groups = 0;
    return cudaGetLastError();
  };
  for (const WgradProblem& q : problems) {
    if (q.rows == 0) continue;
    const int g = params.groups++;
    // Views that end at the expert's last row: the K tail's rows come in as zeros.
    if (const cudaError_t e = encode_matrix_sw128(&params.a_map[g], q.a, q.rows, s.m, s.lda, 64); e != cudaSuccess) return e;
    if (const cudaError_t e = encode_matrix_sw128(&params.b_map[g], q.b, q.rows, s.n, s.ldb, 64); e != cudaSuccess) return e;
    params.c[g] = q.c;
    params.rows[g] = static_cast<int>(q.rows);
    if (params.groups == kMcGroups)
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace

cudaError_t grouped_wgrad_multicast_clusters(bool accumulate, int* clusters) {
  void (*kernel)(McParams) = nullptr;
  return multicast_kernel(accumulate, nullptr, &kernel, clusters);
}

bool grouped_wgrad_supported(const WgradShape& s, std::span<const WgradProblem> problems, WgradKernel kernel) {
  return valid(s, problems, kernel) && current_device_is_cc90() == cudaSuccess;
}

cudaError_t grouped_wgrad_wgmma(const WgradShape& s, std::span<const WgradProblem> problems, cudaStream_t stream,
                                int* tile_counter, WgradKernel kernel) {
  if (!valid(s, problems, kernel)) return cudaErrorInvalidValue;
  if (kernel == WgradKernel::tma_multicast && tile_counter != nullptr) return cudaErrorInvalidValue;  // static tiles only
  if (const cudaError_t e = current_device_is_cc90(); e != cudaSuccess) return e;
  if (kernel == WgradKernel::tma_multicast) {
    if (const cudaError_t e = zero_empty(s, problems, stream); e != cudaSuccess) return e;
    return launch_multicast(s, problems, stream);
  }
  int device = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  const auto fn = s.accumulate ? grouped_wgrad_kernel<true> : grouped_wgrad_kernel<false>;
  if (const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes); e != cudaSuccess)
    return e;
  Params params;
  params.m_tiles = static_cast<int>(s.m / kBM);
  params.n_tiles = static_cast<int>(s.n / kBN);
  params.lda = s.lda;
  params.ldb = s.ldb;
  params.ldc = s.ldc;
  params.counter = tile_counter;
  const auto launch = [&]() -> cudaError_t {
    if (params.groups == 0) return cudaSuccess;
    params.tiles = params.groups * params.m_tiles * params.n_tiles;
    const int grid = params.tiles < sms ? params.tiles : sms;
    if (tile_counter != nullptr)
      if (const cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
    fn<<<static_cast<unsigned>(grid), kWsThreads, kSmemBytes, stream>>>(params);
    params.groups = 0;
    return cudaGetLastError();
  };
  if (const cudaError_t e = zero_empty(s, problems, stream); e != cudaSuccess) return e;
  for (const WgradProblem& q : problems) {
    if (q.rows == 0) continue;
    const int g = params.groups++;
    params.a[g] = reinterpret_cast<const __nv_bfloat16*>(q.a);
    params.b[g] = reinterpret_cast<const __nv_bfloat16*>(q.b);
    params.c[g] = q.c;
    params.rows[g] = static_cast<int>(q.rows);
    if (params.groups == kMaxGroups)
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace oom::kernels::hopper
