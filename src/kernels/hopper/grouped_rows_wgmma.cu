// The experts' row GEMMs C = A . B_e in one persistent launch (grouped_rows.hpp says why). The
// structure of grouped_wgrad_wgmma.cu, with the operands of a row GEMM:
//   - 384 threads per block: two consumer warpgroups compute, a producer warpgroup loads
//     (warp_specialized.cuh: setmaxnreg 240 / 24, mbarrier-tracked stages);
//   - A is K-major (the rows, k contiguous): per K step of 64 a 128-row x 128-byte tile in the
//     128-byte-swizzled layout (load_half_sw128_producer; rows past the expert's last are
//     zero-filled, and not stored); warpgroup w reads rows 64w .. 64w+63 (descriptor start + 32
//     bytes per k16 step, SBO 1024: the attention kernels' Q and K operands);
//   - B_e K-major (stored N x K: the forward's weights) as a 256-row x 128-byte tile the same way,
//     or N-major (stored K x N: the backward's) as 64 K rows x 256 N in four 64-wide halves 8 KiB
//     apart (load_rows_sw128_producer twice; the grouped weight-gradient kernel's B operand: LBO =
//     8 KiB, k16 step 2048 bytes);
//   - one m64n256k16 per k16 step and warpgroup: 128 fp32 accumulators per thread.
// Shared memory per stage: A 16 KiB + B 32 KiB, four stages (192 KiB) + barriers + 1 KiB to align
// the tiles to 1024 bytes.
// Schedule: block b takes tiles b, b + grid, ... of the list (problem, M tile, N tile), N tile
// fastest (the blocks working at one time share A's rows and the expert's weights in L2), or,
// given a counter, the next tile an atomicAdd hands out (beside other kernels: blocks that start
// late do not finish late). The
// producer streams each tile's K steps through the stages without pausing between tiles and
// publishes (tile, problem) per stage; the consumers round and store the finished tile while the
// next one's first stages load.
// Determinism: each C element is one thread's wgmma sum over k in order, rounded to bf16 once.
#include "grouped_rows.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../attention_common.cuh"
#include "forward_checks.cuh"
#include "tma.cuh"
#include "warp_specialized.cuh"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::smem_addr;

constexpr int kBM = kRowsTileM, kBN = kRowsTileN, kBK = 64, kStages = 4;
constexpr int kMaxGroups = 128;                                // problems per launch (each a tensor map in the parameters)
constexpr std::uint32_t kATileBytes = kBM * kBK * 2;           // 16 KiB
constexpr std::uint32_t kBTileBytes = kBN * kBK * 2;           // 32 KiB
constexpr std::uint32_t kHalfBytes = kBK * 128;                // N-major B: one 64-wide N half of 64 K rows, 8 KiB
constexpr std::uint32_t kStageBytes = kATileBytes + kBTileBytes;
constexpr std::uint32_t kOffBar = kStages * kStageBytes;       // 192 KiB
constexpr std::uint32_t kOffWords = kOffBar + 8 * 2 * kStages;  // per stage: tile, problem; 2 broadcast words
constexpr int kSmemBytes = static_cast<int>(kOffWords) + 4 * (2 * kStages + 2) + 1024;
static_assert(kSmemBytes <= 227 * 1024);
constexpr std::uint32_t kSwAtom = 1024;  // 8 rows of 128 bytes

struct Params {
  /// RowsLoad::tma: A (rows x k) and every problem's B as 128-byte-swizzled views (tma.cuh,
  /// encode_matrix_sw128): A and a K-major B in boxes of 64 columns x 128 / 256 rows, an N-major B
  /// in boxes of 64 N x 64 K. Kernel parameters past 4 KiB (up to 32764 bytes: CUDA 12.1 and
  /// later on Volta and later), the maps 64-byte aligned as TMA requires.
  CUtensorMap a_map;
  CUtensorMap b_map[kMaxGroups];
  int groups = 0, n_tiles = 0, k_steps = 0, tiles = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  int* counter = nullptr;  ///< dynamic tiles: the next tile to hand out (0 at launch); nullptr: static
  const __nv_bfloat16* a = nullptr;
  __nv_bfloat16* c = nullptr;
  const __nv_bfloat16* b[kMaxGroups];
  int first_row[kMaxGroups];
  int rows[kMaxGroups];
  int tile_end[kMaxGroups];  ///< tiles of problems 0..g
};
static_assert(sizeof(Params) <= 32764);

/// A K-major swizzled operand (rows of 128 bytes, 8-row atoms 1024 bytes apart); LBO unused.
__device__ __forceinline__ std::uint64_t k_desc(std::uint32_t addr) { return encode_smem_desc(addr, 16, kSwAtom, Swizzle::b128); }
/// An N-major swizzled operand of 16 K rows (LBO: the next 64-wide N half).
__device__ __forceinline__ std::uint64_t n_desc(std::uint32_t addr) {
  return encode_smem_desc(addr, kHalfBytes, kSwAtom, Swizzle::b128);
}

template <bool BKbyN, bool Tma>
__global__ void __launch_bounds__(kWsThreads, 1) grouped_rows_kernel(const __grid_constant__ Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_addr(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  const std::uint32_t base = raw + pad;
  const std::uint32_t bars = base + kOffBar;
  // Per stage, written by producer thread 0 before its arrival on the stage's "full" barrier: the
  // tile its K step belongs to (-1: no more tiles) and that tile's problem.
  volatile int* const stage_tile = reinterpret_cast<volatile int*>(smem_raw + pad + kOffWords);
  volatile int* const stage_group = stage_tile + kStages;
  volatile int* const fetched = stage_group + kStages;  // the producers' broadcast of a fetched tile
  const auto full = [&](int s) { return bars + static_cast<std::uint32_t>(8 * s); };
  const auto empty = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (kStages + s)); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      // cp.async: each producer thread's copies + thread 0's words; TMA: thread 0's arrive.expect_tx
      mbar_init(full(s), Tma ? 1 : kWsProducerThreads + 1);
      mbar_init(empty(s), kWsConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();

  // K step j of the block (counted over all its tiles) uses stage j % kStages, as in the grouped
  // weight-gradient kernel; every tile has k_steps of them.
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    if constexpr (Tma) {
      if (tid != 0) return;  // one thread issues every copy
      tma_prefetch_map(&p.a_map);
      int stage = 0, g = 0;
      std::uint32_t phase = 0;
      bool reuse = false;
      for (int i = 0;; ++i) {
        const int t = p.counter != nullptr ? atomicAdd(p.counter, 1) : static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
        if (reuse) mbar_wait(empty(stage), phase ^ 1u);
        if (t >= p.tiles) {
          stage_tile[stage] = -1;
          mbar_arrive(full(stage));
          break;
        }
        while (t >= p.tile_end[g]) ++g;
        const int r = t - (g > 0 ? p.tile_end[g - 1] : 0);
        const int m0 = (r / p.n_tiles) * kBM, n0 = (r % p.n_tiles) * kBN;
        const int a_row = p.first_row[g] + m0;
        const CUtensorMap* b_map = &p.b_map[g];
        for (int ks = 0; ks < p.k_steps; ++ks) {
          if (ks > 0 && reuse) mbar_wait(empty(stage), phase ^ 1u);  // (the first step's wait is above)
          const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kStageBytes;
          stage_tile[stage] = t;
          stage_group[stage] = g;
          mbar_arrive_expect_tx(full(stage), kStageBytes);  // release: the words are seen with the phase
          tma_load_2d(st, &p.a_map, full(stage), ks * kBK, a_row);  // rows past A's end: zeros
          if constexpr (BKbyN) {
#pragma unroll
            for (int h = 0; h < 4; ++h) tma_load_2d(st + kATileBytes + h * kHalfBytes, b_map, full(stage), n0 + 64 * h, ks * kBK);
          } else {
            tma_load_2d(st + kATileBytes, b_map, full(stage), ks * kBK, n0);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
            reuse = true;
          }
        }
      }
      return;
    }
    int stage = 0, g = 0;
    std::uint32_t phase = 0;
    bool reuse = false;
    for (int i = 0;; ++i) {
      int t = static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
      if (p.counter != nullptr) {
        // As in the grouped weight-gradient kernel: thread 0 fetches, the producer warpgroup's
        // named barrier publishes, two words alternate.
        if (tid == 0) fetched[i & 1] = atomicAdd(p.counter, 1);
        asm volatile("bar.sync 1, %0;\n" ::"n"(kWsProducerThreads) : "memory");
        t = fetched[i & 1];
      }
      if (t >= p.tiles) {
        if (reuse) mbar_wait(empty(stage), phase ^ 1u);
        if (tid == 0) {
          stage_tile[stage] = -1;
          mbar_arrive(full(stage));
        }
        mbar_arrive(full(stage));
        break;
      }
      while (t >= p.tile_end[g]) ++g;  // a block's tiles only grow (the counter's too)
      const int r = t - (g > 0 ? p.tile_end[g - 1] : 0);
      const int m0 = (r / p.n_tiles) * kBM, n0 = (r % p.n_tiles) * kBN;
      const __nv_bfloat16* a = p.a + static_cast<std::int64_t>(p.first_row[g] + m0) * p.lda;
      const int row_end = p.rows[g] - m0;
      const __nv_bfloat16* b = BKbyN ? p.b[g] + n0 : p.b[g] + static_cast<std::int64_t>(n0) * p.ldb;
      for (int ks = 0; ks < p.k_steps; ++ks) {
        if (reuse) mbar_wait(empty(stage), phase ^ 1u);
        const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kStageBytes;
        load_half_sw128_producer<kBM>(st, a + ks * kBK, p.lda, row_end, tid);
        if constexpr (BKbyN) {
          const __nv_bfloat16* bk = b + static_cast<std::int64_t>(ks) * kBK * p.ldb;
          load_rows_sw128_producer<kBK>(st + kATileBytes, bk, p.ldb, 0, kBK, tid);                          // N 0..127
          load_rows_sw128_producer<kBK>(st + kATileBytes + 2 * kHalfBytes, bk + 128, p.ldb, 0, kBK, tid);  // 128..255
        } else {
          load_half_sw128_producer<kBN>(st + kATileBytes, b + ks * kBK, p.ldb, kBN, tid);
        }
        if (tid == 0) {
          stage_tile[stage] = t;
          stage_group[stage] = g;
          mbar_arrive(full(stage));
        }
        cp_async_mbar_arrive(full(stage));
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
          reuse = true;
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  float acc[128];  // C rows 64 wg .. 64 wg + 63 of the tile, columns 0..255: the m64n256 fragment
  int stage = 0;
  std::uint32_t phase = 0;
  for (;;) {
    mbar_wait(full(stage), phase);
    const int t = stage_tile[stage];
    if (t < 0) break;
    const int g = stage_group[stage];
    const int r = t - (g > 0 ? p.tile_end[g - 1] : 0);
    const int m0 = (r / p.n_tiles) * kBM, n0 = (r % p.n_tiles) * kBN;
    int held = -1;
    for (int ks = 0; ks < p.k_steps; ++ks) {
      if (ks > 0) mbar_wait(full(stage), phase);
      if constexpr (!Tma) fence_proxy_async_shared();  // cp.async writes are the generic proxy's; TMA's are async
      const std::uint32_t st = base + static_cast<std::uint32_t>(stage) * kStageBytes;
      const std::uint32_t a_st = st + static_cast<std::uint32_t>(wg) * (64 * 128);
      const std::uint32_t b_st = st + kATileBytes;
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const int scale = ks > 0 || kk > 0 ? 1 : 0;  // the tile's first product overwrites
        if constexpr (BKbyN)
          wgmma_m64n256k16_f32_bf16_ss<Major::mn, Major::k>(acc, k_desc(a_st + kk * 32), n_desc(b_st + kk * 2 * kSwAtom), scale);
        else
          wgmma_m64n256k16_f32_bf16_ss<Major::k, Major::k>(acc, k_desc(a_st + kk * 32), k_desc(b_st + kk * 32), scale);
      }
      wgmma_commit_group();
      wgmma_wait_group<1>();
      wgmma_fence_operands(acc);
      if (held >= 0) mbar_arrive(empty(held));
      held = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
    wgmma_wait_group<0>();
    wgmma_fence_operands(acc);
    if (held >= 0) mbar_arrive(empty(held));

    // Thread (warp, lane) holds rows 16 warp + lane / 4 (+ 8) of the warpgroup's 64, columns
    // 8 j + 2 (lane % 4) (+ 1), j = 0..31 (wgmma.cuh's accumulator fragment); rows past the
    // problem's last belong to the next expert (or to nobody) and are not stored.
    const int rows = p.rows[g];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = m0 + 64 * wg + 16 * warp + (lane >> 2) + 8 * hf;
      if (row >= rows) continue;
      __nv_bfloat16* out = p.c + static_cast<std::int64_t>(p.first_row[g] + row) * p.ldc + n0 + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
    }
  }
#else
  (void)p;
  __trap();
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

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

cudaError_t grouped_rows_wgmma(const RowsShape& s, const bf16* a, bf16* c, std::span<const RowsProblem> problems,
                               cudaStream_t stream, int* tile_counter, RowsLoad load) {
  if (!shape_ok(s, a, c)) return cudaErrorInvalidValue;
  for (const RowsProblem& q : problems)
    if (!problem_ok(s, q)) return cudaErrorInvalidValue;
  if (const cudaError_t e = current_device_is_cc90(); e != cudaSuccess) return e;
  int device = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  const bool tma = load == RowsLoad::tma;
  const auto kernel = s.b_k_by_n ? (tma ? grouped_rows_kernel<true, true> : grouped_rows_kernel<true, false>)
                                 : (tma ? grouped_rows_kernel<false, true> : grouped_rows_kernel<false, false>);
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes); e != cudaSuccess)
    return e;
  static_assert(alignof(Params) >= 64);  // the tensor maps' alignment, kept by the parameter copy
  Params params;
  params.n_tiles = static_cast<int>(s.n / kBN);
  params.k_steps = static_cast<int>(s.k / kBK);
  params.lda = s.lda;
  params.ldb = s.ldb;
  params.ldc = s.ldc;
  params.a = reinterpret_cast<const __nv_bfloat16*>(a);
  params.c = reinterpret_cast<__nv_bfloat16*>(c);
  params.counter = tile_counter;
  std::int64_t tiles = 0, row_end = 0;  // row_end: A's rows this launch reads (the A view's extent)
  const auto launch = [&]() -> cudaError_t {
    if (params.groups == 0) return cudaSuccess;
    params.tiles = static_cast<int>(tiles);
    if (tma)
      if (const cudaError_t e = encode_matrix_sw128(&params.a_map, a, row_end, s.k, s.lda, kBM); e != cudaSuccess) return e;
    const int grid = params.tiles < sms ? params.tiles : sms;
    if (tile_counter != nullptr)
      if (const cudaError_t e = cudaMemsetAsync(tile_counter, 0, sizeof(int), stream); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(grid), kWsThreads, kSmemBytes, stream>>>(params);
    params.groups = 0;
    tiles = row_end = 0;
    return cudaGetLastError();
  };
  for (const RowsProblem& q : problems) {
    if (q.rows == 0) continue;
    const std::int64_t q_tiles = (q.rows + kBM - 1) / kBM * params.n_tiles;
    if (params.groups > 0 && tiles + q_tiles > INT_MAX)  // the tile list is indexed by int
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
    const int g = params.groups++;
    params.b[g] = reinterpret_cast<const __nv_bfloat16*>(q.b);
    params.first_row[g] = static_cast<int>(q.first_row);
    params.rows[g] = static_cast<int>(q.rows);
    tiles += q_tiles;
    params.tile_end[g] = static_cast<int>(tiles);
    row_end = std::max(row_end, q.first_row + q.rows);
    if (tma) {  // B_e: N x K in boxes of 256 rows (N) x 64 (K), or K x N in boxes of 64 x 64
      const cudaError_t e = s.b_k_by_n ? encode_matrix_sw128(&params.b_map[g], q.b, s.k, s.n, s.ldb, kBK)
                                       : encode_matrix_sw128(&params.b_map[g], q.b, s.n, s.k, s.ldb, kBN);
      if (e != cudaSuccess) return e;
    }
    if (params.groups == kMaxGroups)
      if (const cudaError_t e = launch(); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace oom::kernels::hopper
