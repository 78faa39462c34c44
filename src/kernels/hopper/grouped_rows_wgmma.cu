// The experts' row GEMMs C = A . B_e in one persistent launch (grouped_rows.hpp says why). The
// structure of grouped_wgrad_wgmma.cu, with the operands of a row GEMM:
//   - 384 threads per block: two consumer warpgroups compute, one thread of the third warpgroup
//     loads (warp_specialized.cuh: setmaxnreg 240 / 24, mbarrier-tracked stages) by TMA from
//     128-byte-swizzled views (tma.cuh, encode_matrix_sw128), one tensor map for A and one per
//     problem for B, in the kernel parameters;
//   - A is K-major (the rows, k contiguous): per K step of 64 a 128-row x 128-byte box; rows past
//     the expert's last are the next expert's (or zeros past the view) and are not stored;
//     warpgroup w reads rows 64w .. 64w+63 (descriptor start + 32 bytes per k16 step, SBO 1024:
//     the attention kernels' Q and K operands);
//   - B_e K-major (stored N x K: the forward's weights) as a 256-row x 128-byte box the same way
//     (with pairs, two 128-row boxes, one from each CTA of the cluster), or N-major (stored K x N:
//     the backward's) as four 64 K x 64 N boxes 8 KiB apart (the grouped weight-gradient kernel's
//     B operand: LBO = 8 KiB, k16 step 2048 bytes);
//   - one m64n256k16 per k16 step and warpgroup: 128 fp32 accumulators per thread.
// Against cp.async by the producer's 128 threads (the first version), TMA ran the 5.13B gate_up
// forward at 704 against 593 TFLOP/s and no case slower (H200, T = 16384, 2026-12-01).
// Shared memory: four stages of A 16 KiB + B 32 KiB, the epilogue's staging (two 2-KiB buffers
// per consumer warp), barriers, 1 KiB to align the tiles to 1024 bytes.
// Schedule: block b takes tiles b, b + grid, ... of the list (problem, M tile, N tile), N tile
// fastest (the blocks working at one time share A's rows and the expert's weights in L2), or,
// given a counter, the next tile an atomicAdd hands out (beside other kernels: blocks that start
// late do not finish late). With pairs (RowsGrid::pairs) the list's entries are pairs of
// M tiles of one (problem, N tile) and cluster c of the grid takes entries c, c + clusters, ...:
// each CTA computes its M tile and loads its own A box and half of B, multicast into both CTAs'
// stage. A problem with an odd count of M tiles ends in entries that pair its last M tile's N
// tiles instead: each CTA computes its N tile, loads half of A multicast into both and its own B
// (where the N tiles are odd too, the last entry is that tile beside one past the problem's rows,
// which computes and stores nothing). A stage is refilled once both CTAs'
// consumer warps released it (each warp arrives on both CTAs' "empty" barrier: count 16), and
// cluster barriers open and close the kernel. The producer streams each tile's K steps through
// the stages without pausing between tiles and publishes (tile, problem) per stage, so the next
// tile's first stages load during the epilogue; the epilogue hands each warp's rows to the TMA unit
// (tensor stores through a view of C) and does not wait for them.
// Determinism: each C element is one thread's wgmma sum over k in order, rounded to bf16 once.
#include "grouped_rows.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <unordered_map>

#include "../attention_common.cuh"
#include "consumer_ring.cuh"
#include "forward_checks.cuh"
#include "tma.cuh"
#include "warp_specialized.cuh"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::smem_addr;

constexpr int kBM = kRowsTileM, kBN = kRowsTileN, kBK = 64;
constexpr int kStages = 4;  // of 48 KiB each, beside the epilogue's 32 KiB
constexpr int kMaxGroups = 128;                                // problems per launch (each a tensor map in the parameters)
constexpr std::uint32_t kATileBytes = kBM * kBK * 2;           // 16 KiB
constexpr std::uint32_t kBTileBytes = kBN * kBK * 2;           // 32 KiB
constexpr std::uint32_t kHalfBytes = kBK * 128;                // N-major B: one 64-wide N half of 64 K rows, 8 KiB
constexpr std::uint32_t kStageBytes = kATileBytes + kBTileBytes;
// The epilogue's staging: per consumer warp two buffers of its 16 rows x 64 columns (one 128-byte-
// swizzled box of the C view, 2 KiB, 1024-byte aligned), written alternately.
constexpr std::uint32_t kEpiBufBytes = 16 * 128;
constexpr std::uint32_t kOffC = kStages * kStageBytes;
constexpr std::uint32_t kOffBar = kOffC + (kWsConsumerThreads / 32) * 2 * kEpiBufBytes;
constexpr std::uint32_t kOffWords = kOffBar + 8 * 2 * kStages;  // per stage: tile, problem
constexpr int kSmemBytes = static_cast<int>(kOffWords) + 4 * 2 * kStages + 1024;
static_assert(kSmemBytes <= kMaxDynamicSmem);

struct Params {
  /// A (rows x k) and every problem's B as 128-byte-swizzled views (tma.cuh, encode_matrix_sw128):
  /// A and a K-major B in boxes of 64 columns x 128 / 256 rows (128 with pairs), an N-major B in
  /// boxes of 64 N x 64 K. Kernel parameters past 4 KiB (up to 32764 bytes: CUDA 12.1 and later,
  /// Volta and later); the maps 64-byte aligned as TMA requires.
  CUtensorMap a_map;
  /// With pairs: A again, in boxes of 64 rows (each CTA's half of an A tile both share).
  CUtensorMap a_half_map;
  /// C (the launch's rows x n) in boxes of 64 columns x 16 rows: one consumer warp's quarter of
  /// its rows, stored by the TMA unit.
  CUtensorMap c_map;
  CUtensorMap b_map[kMaxGroups];
  int groups = 0, n_tiles = 0, k_steps = 0, tiles = 0;
  std::int64_t ldc = 0;
  int* counter = nullptr;  ///< dynamic tiles: the next tile to hand out (0 at launch); nullptr: static
  /// With a counter: block b's first tile is b, and the counter hands out the rest from gridDim.x
  /// on (RowsGrid::first_tiles_fixed).
  int first_tiles_fixed = 0;
  __nv_bfloat16* c = nullptr;
  int first_row[kMaxGroups];
  int rows[kMaxGroups];
  int tile_end[kMaxGroups];  ///< tiles of problems 0..g
};
static_assert(sizeof(Params) <= 32764);

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/// Until all but this thread's newest bulk group have read their shared sources (the buffer the
/// group before the newest read may be rewritten).
__device__ __forceinline__ void bulk_wait_read_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
}
/// Until this thread's bulk groups have completed (their global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/// Where entry t of the tile list (of problem g) puts CTA `rank`: its tile's first row (counted
/// in the problem) and column, and, with pairs, whether the pair shares A (two N tiles of one M
/// tile) rather than B (two M tiles of one N tile). Without pairs, entry = tile, N tile fastest.
/// With pairs, a problem of m M tiles has m / 2 x n_tiles entries sharing B (N tile fastest), then,
/// for an odd m, n_tiles / 2 sharing A on its last M tile and, for odd n_tiles too, that M tile's
/// last N tile beside an M tile past the rows (shares B; the second CTA computes nothing):
/// pair_entries below counts them.
struct TileAt {
  int m0 = 0, n0 = 0;
  bool share_a = false;
};

__host__ __device__ __forceinline__ int pair_entries(int m_tiles, int n_tiles) {
  return m_tiles / 2 * n_tiles + m_tiles % 2 * ((n_tiles + 1) / 2);
}

template <bool kPair>
__device__ __forceinline__ TileAt tile_at(const Params& p, int t, int g, std::uint32_t rank) {
  const int r = t - (g > 0 ? p.tile_end[g - 1] : 0);
  if constexpr (!kPair) return {r / p.n_tiles * kBM, r % p.n_tiles * kBN, false};
  const int m_tiles = (p.rows[g] + kBM - 1) / kBM;
  const int share_b = m_tiles / 2 * p.n_tiles;
  const int me = static_cast<int>(rank);
  if (r < share_b) return {(2 * (r / p.n_tiles) + me) * kBM, r % p.n_tiles * kBN, false};
  const int q = r - share_b, last = (m_tiles - 1) * kBM;
  if (2 * q + 1 < p.n_tiles) return {last, (2 * q + me) * kBN, true};
  return {last + me * kBM, (p.n_tiles - 1) * kBN, false};
}

template <bool BKbyN, bool kPair>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_rows_kernel(const __grid_constant__ Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t pad = pad_to_1024(smem_addr(smem_raw));
  const std::uint32_t base = smem_addr(smem_raw) + pad;
  // Per stage, written by the producer thread before its arrival on the stage's "full" barrier:
  // the tile its K step belongs to (-1: no more tiles) and that tile's problem.
  volatile int* const stage_tile = reinterpret_cast<volatile int*>(smem_raw + pad + kOffWords);
  volatile int* const stage_group = stage_tile + kStages;
  const StageBarriers bar{base + kOffBar, kStages};
  // "full": the producer thread's arrive.expect_tx; the bytes (with a pair, the peer's half of B
  // too) complete it. "empty": every consumer thread, or with a pair both CTAs' consumer warps.
  bar.init(1, kPair ? 2 * kWsConsumerThreads / 32 : kWsConsumerThreads);
  std::uint32_t rank = 0;
  if constexpr (kPair) {
    cluster_sync();  // the peer's barriers exist before anything of this CTA signals them
    rank = cluster_ctarank();
  }

  // K step j of the block (counted over all its tiles) uses stage j % kStages, as in the grouped
  // weight-gradient kernel; every tile has k_steps of them. The two CTAs of a pair walk the same
  // entries, so their stages and phases stay in step.
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == kWsConsumerThreads) {  // one thread issues every copy
      tma_prefetch_map(&p.a_map);
      tma_prefetch_map(&p.c_map);
      const int slot = kPair ? static_cast<int>(blockIdx.x) / 2 : static_cast<int>(blockIdx.x);
      const int slots = kPair ? static_cast<int>(gridDim.x) / 2 : static_cast<int>(gridDim.x);
      int stage = 0, g = 0;
      std::uint32_t phase = 0;
      bool reuse = false;  // a stage is refilled only after the consumers released its previous use
      // (Tiles from a counter ran the 5.13B gate_up forward at 16K 18% slower than fixed ones on
      // the H100, 2026-12-07; asking for the next tile one tile ahead, so that the atomic's round
      // trip overlaps the copies, left it so: 1.154 against 0.973 ms, sixty-fourth session.)
      for (int i = 0;; ++i) {
        const int t = kPair || p.counter == nullptr  ? slot + i * slots
                      : p.first_tiles_fixed == 0     ? atomicAdd(p.counter, 1)
                      : i == 0                       ? slot
                                                     : slots + atomicAdd(p.counter, 1);
        if (reuse) mbar_wait(bar.empty(stage), phase ^ 1u);
        if (t >= p.tiles) {  // no more tiles: the stage says so, and nothing is copied into it
          stage_tile[stage] = -1;
          mbar_arrive(bar.full(stage));
          break;
        }
        while (t >= p.tile_end[g]) ++g;  // a block's tiles only grow (the counter's too)
        const TileAt at = tile_at<kPair>(p, t, g, rank);
        const int n0 = at.n0;
        const int a_row = p.first_row[g] + at.m0;  // (an M tile past the problem: the next one's rows or zeros, never stored)
        const CUtensorMap* b_map = &p.b_map[g];
        for (int ks = 0; ks < p.k_steps; ++ks) {
          if (ks > 0 && reuse) mbar_wait(bar.empty(stage), phase ^ 1u);  // (the first step's wait is above)
          const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kStageBytes;
          stage_tile[stage] = t;
          stage_group[stage] = g;
          mbar_arrive_expect_tx(bar.full(stage), kStageBytes);  // release: the words are seen with the phase
          if (kPair && at.share_a)  // this CTA's half of A, into both CTAs' stage
            tma_load_2d_multicast(st + rank * (kATileBytes / 2), &p.a_half_map, bar.full(stage), ks * kBK,
                                  a_row + static_cast<int>(rank) * (kBM / 2), 0x3);
          else
            tma_load_2d(st, &p.a_map, bar.full(stage), ks * kBK, a_row);  // rows past A's view: zeros
          if (!kPair || at.share_a) {  // all of B, into this CTA's stage
            if constexpr (BKbyN) {
#pragma unroll
              for (int h = 0; h < 4; ++h) tma_load_2d(st + kATileBytes + h * kHalfBytes, b_map, bar.full(stage), n0 + 64 * h, ks * kBK);
            } else if constexpr (kPair) {  // (the map's boxes are 128 of B's 256 rows with pairs)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                tma_load_2d(st + kATileBytes + h * (kBTileBytes / 2), b_map, bar.full(stage), ks * kBK, n0 + h * (kBN / 2));
            } else {
              tma_load_2d(st + kATileBytes, b_map, bar.full(stage), ks * kBK, n0);
            }
          } else if constexpr (kPair) {  // this CTA's half of B, into both CTAs' stage
            if constexpr (BKbyN) {
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int box = 2 * static_cast<int>(rank) + h;
                tma_load_2d_multicast(st + kATileBytes + static_cast<std::uint32_t>(box) * kHalfBytes, b_map, bar.full(stage),
                                      n0 + 64 * box, ks * kBK, 0x3);
              }
            } else {
              tma_load_2d_multicast(st + kATileBytes + rank * (kBTileBytes / 2), b_map, bar.full(stage), ks * kBK,
                                    n0 + static_cast<int>(rank) * (kBN / 2), 0x3);
            }
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
            reuse = true;
          }
        }
      }
    }
    if constexpr (kPair) cluster_sync();  // no multicast or remote arrival reaches a CTA that has left
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int ctid = static_cast<int>(threadIdx.x);  // 0..255
  const int warp = (ctid / 32) % 4, lane = ctid & 31;
  const std::uint32_t c_st = base + kOffC;
  float acc[128];  // C rows 64 wg .. 64 wg + 63 of the tile, columns 0..255: the m64n256 fragment
  ConsumerRing ring{bar};
  if constexpr (kPair) ring.peer = static_cast<int>(rank ^ 1u);
  for (;;) {
    ring.wait_full();
    const int t = stage_tile[ring.stage];
    if (t < 0) break;
    const int g = stage_group[ring.stage];
    const TileAt at = tile_at<kPair>(p, t, g, rank);
    const int m0 = at.m0, n0 = at.n0;
    // A warpgroup whose 64 rows are all past the problem's last (a tail tile of <= 64 rows) issues
    // no products: the other one has the tensor cores to itself, so such a tile costs about half.
    const bool live = m0 + 64 * wg < p.rows[g];
    for (int ks = 0; ks < p.k_steps; ++ks) {
      if (ks > 0) ring.wait_full();  // TMA writes are the async proxy's: no proxy fence
      if (live) {
        const std::uint32_t st = base + static_cast<std::uint32_t>(ring.stage) * kStageBytes;
        const std::uint32_t a_st = st + static_cast<std::uint32_t>(wg) * (64 * 128);
        const std::uint32_t b_st = st + kATileBytes;
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const int scale = ks > 0 || kk > 0 ? 1 : 0;  // the tile's first product overwrites
          if constexpr (BKbyN)
            wgmma_m64n256k16_f32_bf16_ss<Major::mn, Major::k>(acc, sw128::kmajor_desc<kBM>(a_st, kk),
                                                              sw128::mnmajor_desc<kBK>(b_st, kk), scale);
          else
            wgmma_m64n256k16_f32_bf16_ss<Major::k, Major::k>(acc, sw128::kmajor_desc<kBM>(a_st, kk),
                                                             sw128::kmajor_desc<kBN>(b_st, kk), scale);
        }
        wgmma_commit_group();
      }
      ring.step(acc);  // (nothing to wait for where not live)
    }
    ring.drain(acc);

    // Epilogue: each warp writes its 16 rows a quarter (64 columns) at a time into one of its two
    // staging buffers, and its lane 0 hands the quarter to the TMA unit as one tensor store (the C
    // view's 16 x 64 box), which nobody waits for: before a buffer is rewritten, lane 0 waits only
    // until the store that read it two quarters ago has read it. No barrier beyond the warp, so
    // warps go on to the next tile's products as soon as their own stores are issued. (Before: the
    // whole tile staged, 66 KiB that left room for three stages only, two barriers of both
    // warpgroups per tile and one 512-byte bulk copy per row.) Thread (warp, lane) holds rows
    // 16 warp + lane / 4 (+ 8) of the warpgroup's 64, columns 8 j + 2 (lane % 4) (+ 1), j = 0..31
    // (wgmma.cuh's accumulator fragment); in the swizzled buffer row r's 16-byte chunk c sits at
    // c ^ (r % 8), so a warp's 4-byte stores for one j (8 rows x 4 lanes) fall in 32 different
    // banks. Rows past the problem's last belong to the next expert (or to nobody): a warp with
    // some of those (one per tail tile at most) stores its own rows straight from the fragment.
    const int wrow = m0 + 64 * wg + 16 * warp;  // the warp's first row, counted in the problem
    const int valid = p.rows[g] - wrow;         // how many of its 16 rows are the problem's
    const std::int64_t c_row = static_cast<std::int64_t>(p.first_row[g]) + wrow;
    if (valid >= 16) {
      const std::uint32_t bufs = c_st + static_cast<std::uint32_t>(wg * 4 + warp) * 2 * kEpiBufBytes;
#pragma unroll
      for (int q = 0; q < kBN / 64; ++q) {
        const std::uint32_t buf = bufs + static_cast<std::uint32_t>(q & 1) * kEpiBufBytes;
        if (lane == 0) bulk_wait_read_all_but_newest();
        __syncwarp();
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = (lane >> 2) + 8 * hf;
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int j = 8 * q + jj;
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
            const std::uint32_t at = buf + static_cast<std::uint32_t>(row * 128 + ((jj ^ (row & 7)) << 4) + 4 * (lane & 3));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(*reinterpret_cast<const std::uint32_t*>(&v)) : "memory");
          }
        }
        fence_proxy_async_shared();  // the stores, made visible to the tensor store (async proxy)
        __syncwarp();
        if (lane == 0) {
          tma_store_2d(&p.c_map, buf, n0 + 64 * q, static_cast<int>(c_row));
          bulk_commit();
        }
      }
    } else if (valid > 0) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = (lane >> 2) + 8 * hf;
        if (row < valid) {
          __nv_bfloat16* const out = p.c + (c_row + row) * p.ldc + n0 + 2 * (lane & 3);
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
        }
      }
    }
  }
  if (lane == 0) bulk_wait_all();  // the warp's tensor stores done before the block's shared memory goes
  if constexpr (kPair) cluster_sync();
#else
  (void)p;
  __trap();
#endif
}

/// The kernel's launch: 384 threads, its shared memory, and with pairs 2-CTA clusters (a plain
/// launch without).
struct LaunchConfig {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};
  LaunchConfig(bool pairs, cudaStream_t stream) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    config.blockDim = dim3(kWsThreads);
    config.dynamicSmemBytes = kSmemBytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = pairs ? 1 : 0;
  }
  LaunchConfig(const LaunchConfig&) = delete;  // (config points at cluster)
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

/// encode_matrix_sw128 through a per-thread cache. A tensor map is a function of these arguments
/// alone, so one encoded before is right again for the same ones (an address freed and reused
/// included): the experts' weights, and A where the row count recurs, need no driver call. Why:
/// the 65 encodes of a launch took 10-97 us of host time per launch in the 5.13B trace at 32K
/// (H200, 2026-12-01), time the GPU waits for when the launch follows the counts' download.
cudaError_t cached_matrix_sw128(CUtensorMap* map, const void* base, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                                int box_rows) {
  struct Key {
    const void* base;
    std::int64_t rows, cols, stride;
    int box_rows;
    bool operator==(const Key&) const = default;
  };
  struct Hash {
    std::size_t operator()(const Key& k) const noexcept {
      std::size_t h = std::hash<const void*>{}(k.base);
      for (const std::int64_t v : {k.rows, k.cols, k.stride, static_cast<std::int64_t>(k.box_rows)})
        h = h * 0x9E3779B97F4A7C15ull + std::hash<std::int64_t>{}(v);
      return h;
    }
  };
  constexpr std::size_t kMaxEntries = 4096;  // ~0.5 MiB per thread; cleared when full
  thread_local std::unordered_map<Key, CUtensorMap, Hash> cache;
  const Key key{base, rows, cols, stride, box_rows};
  if (const auto it = cache.find(key); it != cache.end()) {
    *map = it->second;
    return cudaSuccess;
  }
  if (const cudaError_t e = encode_matrix_sw128(map, base, rows, cols, stride, box_rows); e != cudaSuccess) return e;
  if (cache.size() >= kMaxEntries) cache.clear();
  cache.emplace(key, *map);
  return cudaSuccess;
}

bool shape_ok(const RowsShape& s, const bf16* a, const bf16* c) {
  const std::int64_t b_width = s.b_k_by_n ? s.n : s.k;
  return s.n > 0 && s.k > 0 && s.n % kBN == 0 && s.k % kBK == 0 && s.lda >= s.k && s.ldc >= s.n && s.ldb >= b_width &&
         s.lda % 8 == 0 && s.ldb % 8 == 0 && s.ldc % 8 == 0 &&
         s.n / kBN <= INT_MAX && s.k / kBK <= INT_MAX && a != nullptr && c != nullptr && aligned16(a) && aligned16(c);
}

bool problem_ok(const RowsShape& s, const RowsProblem& q) {
  if (q.rows < 0 || q.rows > INT_MAX || q.first_row < 0 || q.first_row > INT_MAX - q.rows) return false;
  if ((q.rows + kBM - 1) / kBM > INT_MAX / (s.n / kBN)) return false;  // its tiles indexed by int
  return q.rows == 0 || (q.b != nullptr && aligned16(q.b));
}

}  // namespace

bool grouped_rows_supported(const RowsShape& s, const bf16* a, const bf16* c, std::span<const RowsProblem> problems) {
  if (!shape_ok(s, a, c)) return false;
  for (const RowsProblem& q : problems)
    if (!problem_ok(s, q)) return false;
  return current_device_is_cc90() == cudaSuccess;
}

bool grouped_rows_one_launch(const RowsShape& s, std::span<const RowsProblem> problems) {
  if (s.n < kBN) return false;
  std::int64_t tiles = 0;
  int groups = 0;
  for (const RowsProblem& q : problems) {
    if (q.rows == 0) continue;
    tiles += (q.rows + kBM - 1) / kBM * (s.n / kBN);
    if (++groups > kMaxGroups || tiles > INT_MAX) return false;
  }
  return true;
}

cudaError_t grouped_rows_pairs_fit(int* pairs) {
  *pairs = 0;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  thread_local std::unordered_map<int, int> fit;  // per device: an occupancy query costs host time every launch
  if (const auto it = fit.find(device); it != fit.end()) {
    *pairs = it->second;
    return cudaSuccess;
  }
  const auto kernel = grouped_rows_kernel<false, true>;  // (both layouts' kernels take the same resources)
  int sms = 0;
  if (const cudaError_t e = prepare_persistent_launch(kernel, kSmemBytes, &sms); e != cudaSuccess) return e;
  LaunchConfig launch(true, nullptr);
  launch.config.gridDim = dim3(2);
  if (const cudaError_t e = cudaOccupancyMaxActiveClusters(pairs, kernel, &launch.config); e != cudaSuccess) return e;
  fit.emplace(device, *pairs);
  return cudaSuccess;
}

cudaError_t grouped_rows_wgmma(const RowsShape& s, const bf16* a, bf16* c, std::span<const RowsProblem> problems,
                               cudaStream_t stream, int* tile_counter, const RowsGrid& grid_opts) {
  using ::oom::kernels::detail::refuse;
  if (!shape_ok(s, a, c))
    return refuse("grouped_rows_wgmma: a shape grouped_rows_supported rejects (n = ", s.n, ", k = ", s.k, ", lda = ", s.lda,
                  ", ldb = ", s.ldb, ", ldc = ", s.ldc, "; a and c 16-byte aligned)");
  for (std::size_t i = 0; i < problems.size(); ++i)
    if (!problem_ok(s, problems[i]))
      return refuse("grouped_rows_wgmma: problem ", i, " (rows = ", problems[i].rows, ", first_row = ", problems[i].first_row,
                    ") is one grouped_rows_supported rejects");
  if (grid_opts.counter_zeroed && (tile_counter == nullptr || !grouped_rows_one_launch(s, problems)))
    return refuse("grouped_rows_wgmma: RowsGrid::counter_zeroed needs a tile counter and problems that fit one launch",
                  " (at most ", kMaxGroups, " with rows)");
  if (grid_opts.pairs && grid_opts.counter_zeroed)
    return refuse("grouped_rows_wgmma: RowsGrid::pairs takes its tiles in a fixed order, not from a counter shared with another launch");
  if (grid_opts.first_tiles_fixed && (grid_opts.counter_zeroed || grid_opts.pairs || tile_counter == nullptr))
    return refuse("grouped_rows_wgmma: RowsGrid::first_tiles_fixed needs a tile counter of its own launch, without pairs");
  if (grid_opts.pairs && grid_opts.max_blocks == 1)
    return refuse("grouped_rows_wgmma: RowsGrid::pairs needs max_blocks of at least 2 (one pair), got 1");
  int pairs_fit = 0;
  if (grid_opts.pairs)
    if (const cudaError_t e = grouped_rows_pairs_fit(&pairs_fit); e != cudaSuccess) return e;
  const bool pairs = pairs_fit > 0;  // (where no 2-CTA cluster of this kernel fits, one block per tile)
  const auto kernel = pairs ? (s.b_k_by_n ? grouped_rows_kernel<true, true> : grouped_rows_kernel<false, true>)
                            : (s.b_k_by_n ? grouped_rows_kernel<true, false> : grouped_rows_kernel<false, false>);
  int sms = 0;
  if (const cudaError_t e = prepare_persistent_launch(kernel, kSmemBytes, &sms); e != cudaSuccess) return e;
  LaunchConfig launch_config(pairs, stream);
  int slots = pairs ? pairs_fit : sms;  // entries of the tile list worked at once: blocks, or pairs
  if (grid_opts.max_blocks > 0) slots = std::min(slots, pairs ? grid_opts.max_blocks / 2 : grid_opts.max_blocks);
  static_assert(alignof(Params) >= 64);  // the tensor maps' alignment, kept by the parameter copy
  Params params;
  params.n_tiles = static_cast<int>(s.n / kBN);
  params.k_steps = static_cast<int>(s.k / kBK);
  params.ldc = s.ldc;
  params.c = reinterpret_cast<__nv_bfloat16*>(c);
  params.counter = pairs ? nullptr : tile_counter;
  params.first_tiles_fixed = grid_opts.first_tiles_fixed ? 1 : 0;
  std::int64_t tiles = 0, row_end = 0;  // row_end: A's rows this launch reads (the A view's extent)
  const auto launch = [&]() -> cudaError_t {
    if (params.groups == 0) return cudaSuccess;
    params.tiles = static_cast<int>(tiles);
    if (const cudaError_t e = cached_matrix_sw128(&params.a_map, a, row_end, s.k, s.lda, kBM); e != cudaSuccess) return e;
    if (pairs)
      if (const cudaError_t e = cached_matrix_sw128(&params.a_half_map, a, row_end, s.k, s.lda, kBM / 2); e != cudaSuccess) return e;
    if (const cudaError_t e = cached_matrix_sw128(&params.c_map, c, row_end, s.n, s.ldc, 16); e != cudaSuccess) return e;
    const int entries = std::min(params.tiles, slots);
    if (params.counter != nullptr && !grid_opts.counter_zeroed)
      if (const cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
    launch_config.config.gridDim = dim3(static_cast<unsigned>(pairs ? 2 * entries : entries));
    if (const cudaError_t e = cudaLaunchKernelEx(&launch_config.config, kernel, params); e != cudaSuccess) return e;
    params.groups = 0;
    tiles = row_end = 0;
    return cudaGetLastError();
  };
  for (const RowsProblem& q : problems) {
    if (q.rows == 0) continue;
    const std::int64_t m_tiles = (q.rows + kBM - 1) / kBM;
    // Entries: tiles, or pairs of them (m_tiles x n_tiles fits an int: problem_ok).
    const std::int64_t q_tiles = pairs ? pair_entries(static_cast<int>(m_tiles), params.n_tiles) : m_tiles * params.n_tiles;
    if (params.groups > 0 && tiles + q_tiles > INT_MAX)  // the tile list is indexed by int
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
    const int g = params.groups++;
    params.first_row[g] = static_cast<int>(q.first_row);
    params.rows[g] = static_cast<int>(q.rows);
    tiles += q_tiles;
    params.tile_end[g] = static_cast<int>(tiles);
    row_end = std::max(row_end, q.first_row + q.rows);
    // B_e: N x K in boxes of 256 rows (N) x 64 (K) (with pairs 128, each CTA's half), or K x N in
    // boxes of 64 x 64.
    const cudaError_t e = s.b_k_by_n ? cached_matrix_sw128(&params.b_map[g], q.b, s.k, s.n, s.ldb, kBK)
                                     : cached_matrix_sw128(&params.b_map[g], q.b, s.n, s.k, s.ldb, pairs ? kBN / 2 : kBN);
    if (e != cudaSuccess) return e;
    if (params.groups == kMaxGroups)
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace oom::kernels::hopper
