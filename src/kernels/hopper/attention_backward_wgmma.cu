// Causal GQA flash-attention backward on Hopper wgmma, head_dim 128 (and 256: the section "head_dim
// 256" below, hopper::attention_backward_wgmma_d256): hopper::attention_backward_wgmma,
// the same arguments, results contract and error returns as oom::kernels::attention_backward
// (attention_backward.cu, whose header comment describes the algorithm). The same three passes:
//   1. preprocess: the very kernel of attention_backward (attention_backward_common.cuh), same
//      workspace: D_i = rowsum(dO_i o O_i), LSE_i log2(e);
//   2. dK/dV, keys as the M dimension (transposed), the GQA sum over the group inside one block;
//   3. dQ per query block over key tiles 0 .. diagonal;
// passes 2 and 3 are independent and run as one grid (dK/dV blocks first, then dQ blocks), so the
// dQ blocks fill the SMs that the causal tail of the dK/dV blocks leaves idle.
// Deterministic (no atomics; every output element is written by one thread, its sums in a fixed
// order): bit-identical run to run. The same roundings as attention_backward: P and dS are rounded
// to bf16 before the products they feed (P^T dO, dS^T Q, dS K), everything else is fp32, outputs
// bf16 (dK = bf16(scale acc [+ old]), dV = bf16(acc [+ old]), dQ = bf16(scale acc)). Only the fp32
// summation order inside the tensor-core products differs, so results agree with the mma.sync
// kernel within the bf16 bounds, not bit for bit.
//
// Shared memory: every Q, K, V, dO tile is d (128 or 256) columns wide, the head-dim-256 blocks'
// exchange tiles 64, all in the forward's 128-byte-swizzled layout (wgmma.cuh, sw128: placement and
// descriptors), one tile serving as either operand form; 1.12-1.28x the no-swizzle band layout it
// replaced on the H200, the same bits.
//
// Warp-specialised as the forward (attention_forward_wgmma.cu; the mbarrier and setmaxnreg
// helpers in warp_specialized.cuh): 384 threads per block. Warpgroups 0 and 1 compute; warpgroup 2,
// the producer, issues every cp.async into mbarrier-tracked stages. setmaxnreg: producer 24
// registers, consumers 240 (launch bound 168 = 65536 / 384). No block-wide barrier after the
// set-up: with S stages (4 at head_dim 128, 2 at 256), tile t lands in stage t % S, whose "full"
// mbarrier (count 128) completes its phase t / S through each producer thread's
// cp.async.mbarrier.arrive.noinc, and whose "empty" mbarrier (count 256) completes once every
// consumer thread has retired the wgmmas that read the stage (wait_group 0) and read its LSE2/D;
// the producer refilling stage t % S with tile t >= S first waits for completion t / S - 1 of
// "empty" (parity (t / S + 1) & 1). A step/tile wholly masked for one
// warpgroup is run (P, dS exact zeros: += 0 products), not skipped: no wgmma in divergent code, and
// both warpgroups arrive on every "empty".
//
// 2. dK/dV block = 128 keys of one (KV head, batch); consumer warpgroup w owns keys 64w .. 64w+63
//    (the M of all its wgmmas) and keeps dK, dV for them in fp32 registers (64 + 64 per thread).
//    K, V are loaded once (barrier "once"); the producer streams (Q, dO, LSE2, D) tiles of BR = 64
//    queries, four stages, for every query head of the group and every query tile with a row >=
//    the block's first key. Per step, per warpgroup:
//      S^T = K_w Q^T       8 x m64n64k16 SS (A = K rows K-major, B = Q rows K-major)   commit
//      dP^T = V_w dO^T     8 x m64n64k16 SS                                            commit
//      wait S^T; P^T = exp2(S^T scale log2e - LSE2_q), 0 where query < key or query >= q_end;
//        P^T to bf16 RS A fragments
//      dV += P^T dO        4 x m64n128k16 RS, B = dO MN-major (k = 16 queries)          commit
//      wait dP^T (dV may still run); dS^T = P^T o (dP^T - D_q) (fp32 P^T), straight into the
//        bf16 fragments
//      dK += dS^T Q        4 x m64n128k16 RS, B = Q MN-major                            commit, wait all
//    so the exponentials overlap the dP^T wgmmas and dS^T the dV wgmmas (and one warpgroup's
//    softmax the other's wgmmas: they meet at no barrier). After the loop dK is scaled by the
//    softmax scale and rows < q_end are stored (or added to, accumulate_dkv).
//    smem: K, V 2 x 32 KiB + 4 x (Q, dO) 2 x 16 KiB + 4 x (LSE2, D) 512 B = 194 KiB + barriers.
//    To fit the consumers in 240 registers: s, dp zeroed at the top of each step (not once before
//    the loop, which kept them live across it), the stage and its phase derived from the step
//    counter, LSE2/D read with ld.shared from 32-bit addresses, and the K/V addresses passed
//    through an opaque mov per step so the compiler rebuilds their 16 descriptors per step instead
//    of holding them (checked with the setmaxnreg removed and __maxnreg__(240): 236 registers, no
//    spills; no spills at 232 either; 4 bytes at 240 without the opaque mov).
//
// 3. dQ block = 128 query rows of one (query head, batch), consumer warpgroup w rows 64w ..
//    64w+63; Q, dO are loaded once (barrier "once"), (K, V) tiles of BC = 64 keys stream through four
//    stages over key tiles 0 .. the one holding the block's last row. Per tile, per warpgroup:
//      S = Q_w K^T, dP = dO_w V^T   8 + 8 x m64n64k16 SS, two commit groups
//      wait S; P = exp2(S scale log2e - LSE2_i), 0 where key > query (rows >= q_end: LSE2 = +inf)
//      wait dP; dS = P o (dP - D_i), to bf16 fragments
//      dQ += dS K                   4 x m64n128k16 RS, B = K MN-major (k = 16 keys), wait
//    dQ (64 fp32 per thread) = scale dQ stored as bf16 for rows < q_end.
//    smem: Q, dO 2 x 32 KiB + 4 x (K, V) 2 x 16 KiB = 192 KiB + barriers.
//
// Rules that keep ptxas from serializing the wgmmas (C7515/C7520) or injecting waits (C7517):
// every wgmma loop is unrolled with compile-time trip counts, no wgmma is issued in divergent
// code, and between a wgmma_fence and the wait of a group nothing touches the group's accumulator
// or A-fragment registers (wgmma_fence_operands pins them at both ends).
//
// History (docs/hopper.md): a serial two-warpgroup version (v1, 256 threads, two launches) and a
// software-pipelined one (v2, 1.01-1.04x v1) came first; this warp-specialised one measured
// 1.32-1.45x v1 on the H200 (seventh session) with the same products in the same order per
// warpgroup, hence the same bits, and replaced both.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../attention_backward_common.cuh"
#include "../attention_common.cuh"
#include "attention_wgmma.hpp"
#include "forward_checks.cuh"
#include "warp_specialized.cuh"
#include "oom/kernels/attention.hpp"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::BackwardParams;
using attention_detail::cp_async_4;
using attention_detail::pack_bf16;
using attention_detail::smem_addr;

constexpr int kD = 128;

// The tiles are the forward's 128-byte-swizzled ones (wgmma.cuh, sw128; there verified on the
// H200), filled by the producer's 128 threads through load_rows_sw128_producer
// (warp_specialized.cuh).
/// Where the rows of warpgroup w start in a 128-row tile: 64 rows of 128 bytes per panel.
constexpr std::uint32_t kWgRowsOffset = 64 * 128;

/// acc (64 x 64) = A (64 rows at a_rows of an RA-row tile, K-major) * B^T (64 rows at b_rows of an
/// RB-row tile, K-major), over the COLS (128 or 256) columns: COLS / 16 wgmma m64n64k16 SS, not
/// committed.
template <int RA, int RB, int COLS = kD>
__device__ __forceinline__ void issue_nt_64x64(float (&acc)[32], std::uint32_t a_rows, std::uint32_t b_rows) {
#pragma unroll
  for (int ks = 0; ks < COLS / 16; ++ks)
    wgmma_m64n64k16_f32_bf16_ss(acc, sw128::kmajor_desc<RA>(a_rows, ks), sw128::kmajor_desc<RB>(b_rows, ks),
                                ks > 0 ? 1 : 0);
}

/// acc (64 x 128) += A (64 x 64, bf16 RS fragments) * B (the 64-row tile at b_rows x 128,
/// MN-major): 4 wgmma m64n128k16 RS, not committed. `a` must stay untouched until they complete.
__device__ __forceinline__ void issue_rs_64x128(float (&acc)[64], const std::uint32_t (&a)[4][4],
                                                std::uint32_t b_rows) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    wgmma_m64n128k16_f32_bf16_rs<Major::mn>(acc, a[ks], sw128::mnmajor_desc<64>(b_rows, ks), 1);
}

__device__ __forceinline__ void fence_fragments(std::uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_fence_operands(a[ks]);
}

__device__ __forceinline__ void zero(float (&x)[32]) {
#pragma unroll
  for (int e = 0; e < 32; ++e) x[e] = 0.0f;
}

/// A warpgroup's 64 x 128 fp32 accumulator rows times `scale` into global rows row0 + (fragment
/// row), rows >= row_end skipped. bf16 rows are stored, or with `accumulate` added to
/// (bf16(acc scale + old), as store_rows of the mma.sync kernels); fp32 rows are always added to
/// (attention_backward_dkv_sum's dK/dV sums).
template <class Out>
__device__ __forceinline__ void store_acc_rows(const float (&acc)[64], Out* base, std::int64_t token_stride, int row0,
                                               int row_end, float scale, bool accumulate) {
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = row0 + 16 * warp + (lane >> 2) + 8 * hf;
    if (row >= row_end) continue;
    Out* dst = base + static_cast<std::int64_t>(row) * token_stride + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      float x0 = acc[4 * j + 2 * hf] * scale, x1 = acc[4 * j + 2 * hf + 1] * scale;
      if constexpr (std::is_same_v<Out, float>) {
        auto* d2 = reinterpret_cast<float2*>(dst + 8 * j);
        const float2 old = *d2;
        *d2 = make_float2(old.x + x0, old.y + x1);
      } else {
        auto* d2 = reinterpret_cast<__nv_bfloat162*>(dst + 8 * j);
        if (accumulate) {
          const float2 old = __bfloat1622float2(*d2);
          x0 += old.x;
          x1 += old.y;
        }
        *d2 = __floats2bfloat162_rn(x0, x1);
      }
    }
  }
}

/// A dK/dV block's two accumulators into rows row0.. of column `col` of sequence b's dK and dV
/// (the softmax scale on dK): the bf16 outputs, or attention_backward_dkv_sum's fp32 sums.
__device__ __forceinline__ void store_dkdv(const BackwardParams& p, const float (&dk)[64], const float (&dv)[64], int b,
                                           std::int64_t col, int row0) {
  if (p.dk_sum != nullptr) {
    store_acc_rows(dk, p.dk_sum + b * p.dk_batch + col, p.dk_token, row0, p.q_end, p.scale, true);
    store_acc_rows(dv, p.dv_sum + b * p.dv_batch + col, p.dv_token, row0, p.q_end, 1.0f, true);
  } else {
    store_acc_rows(dk, p.dk + b * p.dk_batch + col, p.dk_token, row0, p.q_end, p.scale, p.accumulate_dkv);
    store_acc_rows(dv, p.dv + b * p.dv_batch + col, p.dv_token, row0, p.q_end, 1.0f, p.accumulate_dkv);
  }
}

// ---- dK/dV and dQ ----

constexpr int kDkdvBr = 64;  // queries per dK/dV step (both head dims)

/// Two consecutive fp32 of shared memory at a shared-space address (8-byte aligned).
__device__ __forceinline__ float2 ld_shared_f2(std::uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

/// `x`, unknown to the compiler (keeps values derived from it from being hoisted out of a loop).
__device__ __forceinline__ std::uint32_t opaque(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

/// The head-dim-128 blocks' tiles: keys per dK/dV block, query rows per dQ block, keys per dQ
/// tile, and the stages of the streamed pairs.
constexpr int kDkdvKeys = 128, kDqRows = 128, kDqBc = 64, kStages = 4;

/// A tile of R rows x HD columns, bf16.
template <int R, int HD>
constexpr int kTileBytes = R * HD * 2;

/// A block's mbarriers at `base` (8 bytes each): `once` (the tiles loaded once per block: K, V or
/// Q, dO), then the streamed stages' full[S] and empty[S] (warp_specialized.cuh). Step t uses stage
/// t % S, its (t / S)-th use: the stage's full barrier completes phase t / S, and the producer waits
/// for completion t / S - 1 of its empty barrier before refilling it.
struct BwdBarriers {
  std::uint32_t once;
  StageBarriers stage;
  __device__ BwdBarriers(std::uint32_t base, int stages) : once(base), stage{base + 8u, stages} {}
  [[nodiscard]] __device__ std::uint32_t full(int s) const { return stage.full(s); }
  [[nodiscard]] __device__ std::uint32_t empty(int s) const { return stage.empty(s); }
  /// Thread 0 initialises them (the producer's 128 threads arrive on once and full, the consumers'
  /// 256 on empty), then the block's last block-wide barrier.
  __device__ void init() const {
    if (threadIdx.x == 0) mbar_init(once, kWsProducerThreads);
    stage.init(kWsProducerThreads);
  }
};

/// The query tiles a dK/dV block of keys from n0 visits (both head dims): qb_first, the first with
/// a row >= n0, to qb_count - 1, for each of the group's heads: `steps` (>= 1 for a block with
/// n0 < q_end).
struct DkdvWalk {
  int qb_first, qb_count, steps;
  __device__ DkdvWalk(const BackwardParams& p, int n0)
      : qb_first(n0 <= p.q_begin ? 0 : (n0 - p.q_begin) / kDkdvBr),
        qb_count((p.q_len() + kDkdvBr - 1) / kDkdvBr),
        steps(p.group * (qb_count - qb_first)) {}
};

/// The dK/dV blocks' producer (warpgroup 2, which it gives up registers for), layout L (DkdvSmem
/// or DkdvD256Smem): K, V rows [n0, n0 + KEYS) of KV head hk once, then per step t of `w` the Q
/// and dO rows of query tile qb_first + t % (qb_count - qb_first) of query head hk group + t /
/// (that), and the tile's LSE2 and D, into stage t % S. Returns with nothing in flight. `p` by reference
/// here (unlike the blocks' consumers, below): by value ptxas spilled 4 bytes in the head-dim-128
/// producer's 24 registers; by reference the SASS is that of the code it was factored out of.
template <class L, int KEYS, int HD>
__device__ __forceinline__ void dkdv_producer(const BackwardParams& p, unsigned char* smem, BwdBarriers bar,
                                              int n0, int hk, int b, DkdvWalk w) {
  constexpr int S = L::S;
  setmaxnreg_dec<kProducerRegs>();
  const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
  const int qb_first = w.qb_first, qb_count = w.qb_count, steps = w.steps;
  load_rows_sw128_producer<KEYS, HD>(
      smem_addr(smem + L::off_k), p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * HD, p.k_token, n0, p.seq, tid);
  load_rows_sw128_producer<KEYS, HD>(
      smem_addr(smem + L::off_v), p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * HD, p.v_token, n0, p.seq, tid);
  cp_async_mbar_arrive(bar.once);
  int h = hk * p.group, qb = qb_first, st = 0;
  std::uint32_t phase = 0;
  for (int t = 0; t < steps; ++t) {
    if (t >= S) mbar_wait(bar.empty(st), phase ^ 1u);  // completion t / S - 1: stage free
    const int q0 = p.q_begin + qb * kDkdvBr;
    load_rows_sw128_producer<kDkdvBr, HD>(
        smem_addr(smem + L::off_q) + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr, HD>),
        p.q + b * p.q_batch + static_cast<std::int64_t>(h) * HD, p.q_token, q0, p.q_end, tid);
    load_rows_sw128_producer<kDkdvBr, HD>(
        smem_addr(smem + L::off_do) + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr, HD>),
        p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * HD, p.do_token, q0, p.q_end, tid);
    {  // threads 0..63: LSE2, 64..127: D of the tile's rows (zero past q_end; masked anyway)
      const int rr = tid % kDkdvBr;
      const bool valid = q0 + rr < p.q_end;
      const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (q0 - p.q_begin) + rr;
      const float* src = (tid < kDkdvBr ? p.lse2 : p.delta) + (valid ? w : 0);
      const int dst = (tid < kDkdvBr ? L::off_lse2 : L::off_delta) + 4 * (st * kDkdvBr + rr);
      cp_async_4(smem + dst, src, valid);
    }
    cp_async_mbar_arrive(bar.full(st));
    if (++qb == qb_count) {
      qb = qb_first;
      ++h;
    }
    if (++st == S) {
      st = 0;
      phase ^= 1u;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
}

/// The dQ blocks' producer (warpgroup 2, which it gives up registers for), layout L (DqSmem or
/// DqD256Smem): Q, dO rows [q0, q0 + ROWS) of query head h once, then key tile t (BC keys of KV
/// head hk) of K and V into stage t % S for t = 0 .. n_kv - 1. Returns with nothing in flight.
template <class L, int ROWS, int BC, int HD>
__device__ __forceinline__ void dq_producer(const BackwardParams& p, unsigned char* smem, BwdBarriers bar,
                                            int q0, int h, int hk, int b, int n_kv) {
  constexpr int S = L::S;
  setmaxnreg_dec<kProducerRegs>();
  const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
  load_rows_sw128_producer<ROWS, HD>(
      smem_addr(smem + L::off_q), p.q + b * p.q_batch + static_cast<std::int64_t>(h) * HD, p.q_token, q0, p.q_end, tid);
  load_rows_sw128_producer<ROWS, HD>(smem_addr(smem + L::off_do),
                                     p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * HD, p.do_token, q0,
                                     p.q_end, tid);
  cp_async_mbar_arrive(bar.once);
  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * HD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * HD;
  int st = 0;
  std::uint32_t phase = 0;
  for (int t = 0; t < n_kv; ++t) {
    if (t >= S) mbar_wait(bar.empty(st), phase ^ 1u);  // completion t / S - 1: stage free
    load_rows_sw128_producer<BC, HD>(smem_addr(smem + L::off_k) + static_cast<std::uint32_t>(st * kTileBytes<BC, HD>),
                                     k_g, p.k_token, t * BC, p.seq, tid);
    load_rows_sw128_producer<BC, HD>(smem_addr(smem + L::off_v) + static_cast<std::uint32_t>(st * kTileBytes<BC, HD>),
                                     v_g, p.v_token, t * BC, p.seq, tid);
    cp_async_mbar_arrive(bar.full(st));
    if (++st == S) {
      st = 0;
      phase ^= 1u;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
}

struct DkdvSmem {
  static constexpr int S = kStages;  // (Q, dO, LSE2, D) stages
  static constexpr int off_k = 0;
  static constexpr int off_v = off_k + kTileBytes<kDkdvKeys, kD>;
  static constexpr int off_q = off_v + kTileBytes<kDkdvKeys, kD>;        // S tiles
  static constexpr int off_do = off_q + S * kTileBytes<kDkdvBr, kD>;     // S tiles
  static constexpr int off_lse2 = off_do + S * kTileBytes<kDkdvBr, kD>;  // S x 64 fp32
  static constexpr int off_delta = off_lse2 + S * kDkdvBr * 4;            // S x 64 fp32
  static constexpr int off_bar = off_delta + S * kDkdvBr * 4;             // BwdBarriers: once, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * S);
};
static_assert(DkdvSmem::off_bar == 194 * 1024 && DkdvSmem::bytes <= kMaxDynamicSmem);

/// dK, dV of keys [128 nb, 128 nb + 128) of KV head hk, batch b at head_dim 128 (pass 2): one
/// block of the fused kernel below, `smem` its DkdvSmem. `p` by value, as a kernel
/// parameter: taken by reference (its address escapes), the causal/q_end masking of P^T compiled
/// to a branch per element instead of selects, and the kernel ran 0.87-0.92x at S = 16K-64K on
/// the H200.
__device__ __forceinline__ void dkdv_block(const BackwardParams p, unsigned char* smem, int nb, int hk, int b) {
  using L = DkdvSmem;
  constexpr int S = L::S, HD = kD;
  const int n0 = nb * kDkdvKeys;
  const DkdvWalk walk(p, n0);
  const int qb_first = walk.qb_first, qb_count = walk.qb_count, steps = walk.steps;

  const BwdBarriers bar(smem_addr(smem + L::off_bar), S);
  bar.init();  // ends with the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {  // the producer
    dkdv_producer<L, kDkdvKeys, HD>(p, smem, bar, n0, hk, b, walk);
    return;
  }

  // Consumers: warpgroup wg owns keys key_wg .. key_wg + 63 and all 128 output columns.
  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);                          // fragment column offset in an 8-column block
  const int key_wg = n0 + 64 * wg;                        // the warpgroup's first key
  const int key_lane = key_wg + 16 * warp + (lane >> 2);  // this thread's keys: key_lane, key_lane + 8
  // Every shared address as one 32-bit base plus constants (LSE2, D read with ld.shared from it):
  // no 64-bit generic pointers live across the loop.
  const std::uint32_t sbase = smem_addr(smem);
  const std::uint32_t a_k = sbase + L::off_k + wg * kWgRowsOffset;
  const std::uint32_t a_v = a_k + (L::off_v - L::off_k);

  float dk[64], dv[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dk[e] = dv[e] = 0.0f;
  // s, dp are zeroed at the top of each step (nothing is in flight there), so they are dead
  // from the dS^T packing to the next step: 240 registers suffice (defining them once before the
  // loop keeps them live across it, as the wgmmas read their accumulators: 16 bytes of spills).
  float s[32], dp[32];
  std::uint32_t pa[4][4], da[4][4];

  mbar_wait(bar.once, 0);
  // Few registers live across the loop: the stage and phase come from t (S a power of two), the
  // query tile start q0 steps through [q_first, q_stop) once per head.
  static_assert((S & (S - 1)) == 0);
  const int q_first = p.q_begin + qb_first * kDkdvBr, q_stop = p.q_begin + qb_count * kDkdvBr;
  int q0 = q_first;
  for (int t = 0; t < steps; ++t) {
    const int st = t & (S - 1);
    mbar_wait(bar.full(st), static_cast<std::uint32_t>(t / S) & 1u);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_q = sbase + L::off_q + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr, HD>);
    const std::uint32_t a_do = a_q + (L::off_do - L::off_q);
    // LSE2, D of the stage, column c0 of 8-column block 0 (block j: + 32 j bytes)
    const std::uint32_t a_lse2 = sbase + L::off_lse2 + static_cast<std::uint32_t>(4 * (st * kDkdvBr + c0));
    const std::uint32_t a_delta = a_lse2 + (L::off_delta - L::off_lse2);

    zero(s);
    zero(dp);
    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    wgmma_fence();
    // K, V addresses made opaque per step, so the compiler does not hoist their 16 descriptors
    // out of the loop (16 registers held across it: spills at 240).
    const std::uint32_t a_kw = opaque(a_k), a_vw = opaque(a_v);
    issue_nt_64x64<kDkdvKeys, kDkdvBr>(s, a_kw, a_q);  // S^T = K_w Q^T
    wgmma_commit_group();
    issue_nt_64x64<kDkdvKeys, kDkdvBr>(dp, a_vw, a_do);  // dP^T = V_w dO^T
    wgmma_commit_group();
    wgmma_wait_group<1>();  // S^T done
    wgmma_fence_operands(s);
    // P^T = exp2(S^T scale log2e - LSE2_q); 0 where query < key (causal) or query >= q_end (every
    // element of a step wholly before the warpgroup's keys).
    const bool edge = q0 < key_wg + 63 || q0 + kDkdvBr > p.q_end;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 l2 = ld_shared_f2(a_lse2 + 32 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = q0 + 8 * j + c0 + (e & 1);
        const int key = key_lane + 8 * (e >> 1);
        const float pe = exp2f(fmaf(s[4 * j + e], p.scale_log2, -((e & 1) ? l2.y : l2.x)));
        s[4 * j + e] = (edge && (qi < key || qi >= p.q_end)) ? 0.0f : pe;
      }
    }
    attention_detail::pack_rs_fragments<64>(pa, s);
    fence_fragments(pa);
    wgmma_fence_operands(dv);
    wgmma_fence();
    issue_rs_64x128(dv, pa, a_do);  // dV += P^T dO
    wgmma_commit_group();

    wgmma_wait_group<1>();  // dP^T done; dV may still run
    wgmma_fence_operands(dp);
    // dS^T = P^T o (dP^T - D_q), straight into the bf16 fragments (the values an in-place product
    // then pack_rs_fragments would give; fewer live registers).
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int e0 = 8 * ks + 2 * r;  // elements e0, e0 + 1: columns c0, c0 + 1 of 8-column block e0 / 4
        const float2 dl = ld_shared_f2(a_delta + 32 * (e0 / 4));
        da[ks][r] = pack_bf16(s[e0] * (dp[e0] - dl.x), s[e0 + 1] * (dp[e0 + 1] - dl.y));
      }
    fence_fragments(da);
    wgmma_fence_operands(dk);
    wgmma_fence();
    issue_rs_64x128(dk, da, a_q);  // dK += dS^T Q (scaled at the end)
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dk);
    wgmma_fence_operands(dv);
    fence_fragments(pa);
    fence_fragments(da);
    mbar_arrive(bar.empty(st));  // every read of the stage (wgmmas retired, LSE2/D loaded) is done

    q0 += kDkdvBr;
    if (q0 == q_stop) q0 = q_first;
  }

  const std::int64_t col = static_cast<std::int64_t>(hk) * HD;
  store_dkdv(p, dk, dv, b, col, key_wg);
}

// ---- head_dim 256 (attention_backward_wgmma_d256; docs/hopper.md, "Head dim 256" and "The
// head-dim-256 backward without recomputed products") ----
// The same three passes, the same roundings, in the same swizzled layout with 256-column tiles
// (four 64-column panels, load_rows_sw128_producer<ROWS, 256>). A warpgroup cannot hold 64 rows x
// 256 of two fp32 outputs (dK and dV: 256 registers), so both warpgroups of a block take the same
// 64 keys (dK/dV) or 64 query rows (dQ), and warpgroup w keeps only the 128 output columns 128 w ..
// 128 w + 127. The products over d that both would need (S^T and dP^T; S and dP) are split
// between them instead of done twice: warpgroup 0 forms S^T (S), warpgroup 1 dP^T (dP), each over
// all 256 columns (16 k-steps of m64n64k16 SS), and the elementwise results meet in shared memory.
// 7 products of a tile pair's size (the head-dim-128 kernels' count) where forming both in each
// warpgroup took 11; that kernel, run on the H200 in the twenty-second session, gave the same bits
// on every test problem and ran 0.83-0.90x this one as first run (0.79-0.86x once the exchange's
// loads were grouped).
//
// dK/dV block = 64 keys of one (KV head, batch); K, V loaded once; (Q, dO, LSE2, D) tiles of 64
// queries stream through two stages, as in dkdv_block.
// Per step:
//   warpgroup 1: dP^T; x = dP^T - D_q (fp32) into shared memory, in its fragment order (thread t's
//     elements 4g .. 4g + 3 as one float4 at x + 16 (128 g + t): conflict-free); arrive at named
//     barrier 1;
//   warpgroup 0: S^T; P^T = exp2(S^T scale log2e - LSE2_q), masked as dkdv_block's; wait at named
//     barrier 1; dS^T = P^T x (fp32 P^T, so the roundings are dkdv_block's); P^T and dS^T as bf16
//     into two 64 x 64 swizzled tiles (one 128-byte panel each, rows = keys: K-major A operands
//     over the queries); fence.proxy.async;
//   both: named barrier 2; dV_w += P^T dO[:, 128 w ..] and dK_w += dS^T Q[:, 128 w ..] (4 k-steps
//     of m64n128k16 SS each, B MN-major at panel 2w of the stage's tiles); wait; arrive on the
//     stage's empty barrier.
// The exchange buffers are single: warpgroup 0 rewrites the tiles of step t + 1 only after barrier
// 1 of that step, which warpgroup 1 reaches after retiring its step-t products (wait_group 0), and
// warpgroup 1 rewrites x only after barrier 2 of step t, which warpgroup 0 reaches after reading x.
// Shared memory: K, V 2 x 32 KiB, 2 x (Q, dO) 2 x 32 KiB, P^T, dS^T 2 x 8 KiB, x 16 KiB, LSE2/D
// 1 KiB: 225 KiB and the barriers. ptxas: 168 registers at launch, 8 bytes of spills.
struct DkdvD256Smem {
  static constexpr int HD = 256, S = 2, keys = 64;
  static constexpr int off_k = 0;
  static constexpr int off_v = off_k + kTileBytes<keys, HD>;
  static constexpr int off_q = off_v + kTileBytes<keys, HD>;             // S tiles
  static constexpr int off_do = off_q + S * kTileBytes<kDkdvBr, HD>;     // S tiles
  static constexpr int off_pt = off_do + S * kTileBytes<kDkdvBr, HD>;    // P^T, 64 x 64 bf16 swizzled
  static constexpr int off_dst = off_pt + kTileBytes<keys, 64>;          // dS^T, the same
  static constexpr int off_x = off_dst + kTileBytes<keys, 64>;           // dP^T - D: 128 threads x 32 fp32
  static constexpr int off_lse2 = off_x + 128 * 32 * 4;                  // S x 64 fp32
  static constexpr int off_delta = off_lse2 + S * kDkdvBr * 4;           // S x 64 fp32
  static constexpr int off_bar = off_delta + S * kDkdvBr * 4;            // BwdBarriers: once, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * S);
};
static_assert(DkdvD256Smem::off_pt % 1024 == 0 && DkdvD256Smem::off_dst % 1024 == 0, "swizzled tiles: 1 KiB aligned");
static_assert(DkdvD256Smem::off_bar == 225 * 1024 && DkdvD256Smem::bytes + 1024 <= kMaxDynamicSmem);

/// Named barrier `id` of the two consumer warpgroups (256 threads): wait for all, or only arrive.
/// An arrive synchronises with the syncs of the same barrier phase (PTX memory model; the ISA's
/// producer/consumer example is st.shared, bar.arrive / bar.sync, ld.shared with no fence), so the
/// arriving threads' shared-memory writes are visible to the syncing threads after it.
template <int id>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, 256;\n" ::"n"(id) : "memory");
}
template <int id>
__device__ __forceinline__ void consumers_arrive() {
  asm volatile("bar.arrive %0, 256;\n" ::"n"(id) : "memory");
}
__device__ __forceinline__ void st_shared_f4(std::uint32_t addr, float4 v) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ float4 ld_shared_f4(std::uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

/// dK, dV of keys [64 nb, 64 nb + 64) of KV head hk, batch b at head_dim 256, the products split
/// between the warpgroups (above); `smem` the kernel's DkdvD256Smem.
__device__ __forceinline__ void dkdv_block_d256(const BackwardParams p, unsigned char* smem, int nb, int hk, int b) {
  using L = DkdvD256Smem;
  constexpr int S = L::S, HD = L::HD;
  const int n0 = nb * L::keys;
  const DkdvWalk walk(p, n0);
  const int qb_first = walk.qb_first, qb_count = walk.qb_count, steps = walk.steps;

  const BwdBarriers bar(smem_addr(smem + L::off_bar), S);
  bar.init();  // ends with the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {  // the producer
    dkdv_producer<L, L::keys, HD>(p, smem, bar, n0, hk, b, walk);
    return;
  }

  // Consumers: both warpgroups take the block's 64 keys; warpgroup wg keeps dK, dV columns
  // 128 wg .. 128 wg + 127.
  setmaxnreg_inc<kConsumerRegs>();
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid & 31;
  const int c0 = 2 * (lane & 3);               // fragment column offset in an 8-column block
  const int r_lo = 16 * warp + (lane >> 2);    // this thread's fragment rows (keys of the block): r_lo, r_lo + 8
  const int key_lane = n0 + r_lo;
  const std::uint32_t sbase = smem_addr(smem);
  // S^T = K Q^T for warpgroup 0, dP^T = V dO^T for warpgroup 1: the same instructions on other
  // tiles (no wgmma in divergent code).
  const std::uint32_t a_lhs = sbase + (wg == 0 ? L::off_k : L::off_v);
  const std::uint32_t rhs_off = wg == 0 ? 0u : static_cast<std::uint32_t>(L::off_do - L::off_q);
  const std::uint32_t a_pt = sbase + L::off_pt, a_dst = sbase + L::off_dst;
  const std::uint32_t a_x = sbase + L::off_x + 16u * static_cast<std::uint32_t>(tid);  // + 2048 g: float4 g
  // The thread's bf16 pair (row r_lo + 8 hf, columns 8 j + c0, + 1) of a swizzled 64 x 64 tile:
  // row r at r 128, 16-byte chunk j at (j ^ (r % 8)) 16; r_lo + 8 has r_lo's r % 8.
  const std::uint32_t t_row = static_cast<std::uint32_t>(r_lo * 128 + c0 * 2);
  const int r_sw = r_lo & 7;
  const std::uint32_t half = static_cast<std::uint32_t>(wg) * 2 * kTileBytes<kDkdvBr, 64>;  // panels 2wg, 2wg + 1

  float dk[64], dv[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dk[e] = dv[e] = 0.0f;
  float acc[32];  // S^T (warpgroup 0) or dP^T (warpgroup 1)

  mbar_wait(bar.once, 0);
  static_assert((S & (S - 1)) == 0);
  const int q_first = p.q_begin + qb_first * kDkdvBr, q_stop = p.q_begin + qb_count * kDkdvBr;
  int q0 = q_first;
  for (int t = 0; t < steps; ++t) {
    const int st = t & (S - 1);
    mbar_wait(bar.full(st), static_cast<std::uint32_t>(t / S) & 1u);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_q = sbase + L::off_q + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr, HD>);
    const std::uint32_t a_do = a_q + (L::off_do - L::off_q);
    // LSE2 (warpgroup 0) or D (warpgroup 1) of the stage, column c0 of 8-column block 0 (block j:
    // + 32 j bytes)
    const std::uint32_t a_stat =
        sbase + (wg == 0 ? L::off_lse2 : L::off_delta) + static_cast<std::uint32_t>(4 * (st * kDkdvBr + c0));

    zero(acc);
    wgmma_fence_operands(acc);
    wgmma_fence();
    issue_nt_64x64<L::keys, kDkdvBr, HD>(acc, opaque(a_lhs), a_q + rhs_off);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(acc);

    if (wg == 1) {
      // x = dP^T - D_q, for warpgroup 0's dS^T. Every load before the first store (here and in
      // warpgroup 0's exchange below): ptxas keeps shared loads and stores in program order when
      // it cannot tell their addresses apart, so interleaved they wait out one load latency each
      // (1.05-1.06x on the backward with them grouped, H200, twenty-second session).
      float2 dl[8];
#pragma unroll
      for (int g = 0; g < 8; ++g) dl[g] = ld_shared_f2(a_stat + 32 * g);
#pragma unroll
      for (int g = 0; g < 8; ++g)
        st_shared_f4(a_x + 2048u * g, make_float4(acc[4 * g] - dl[g].x, acc[4 * g + 1] - dl[g].y,
                                                  acc[4 * g + 2] - dl[g].x, acc[4 * g + 3] - dl[g].y));
      consumers_arrive<1>();
    } else {
      // P^T = exp2(S^T scale log2e - LSE2_q); 0 where query < key (causal) or query >= q_end.
      const bool edge = q0 < n0 + 63 || q0 + kDkdvBr > p.q_end;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 l2 = ld_shared_f2(a_stat + 32 * j);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = q0 + 8 * j + c0 + (e & 1);
          const int key = key_lane + 8 * (e >> 1);
          const float pe = exp2f(fmaf(acc[4 * j + e], p.scale_log2, -((e & 1) ? l2.y : l2.x)));
          acc[4 * j + e] = (edge && (qi < key || qi >= p.q_end)) ? 0.0f : pe;
        }
      }
      consumers_sync<1>();  // x written
      float4 xs[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) xs[j] = ld_shared_f4(a_x + 2048u * j);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const std::uint32_t at = t_row + static_cast<std::uint32_t>(((j ^ r_sw) * 16));
        const float4 x = xs[j];
        st_shared_u32(a_pt + at, pack_bf16(acc[4 * j], acc[4 * j + 1]));
        st_shared_u32(a_pt + at + 8 * 128, pack_bf16(acc[4 * j + 2], acc[4 * j + 3]));
        st_shared_u32(a_dst + at, pack_bf16(acc[4 * j] * x.x, acc[4 * j + 1] * x.y));
        st_shared_u32(a_dst + at + 8 * 128, pack_bf16(acc[4 * j + 2] * x.z, acc[4 * j + 3] * x.w));
      }
      fence_proxy_async_shared();  // the tiles' generic writes before the wgmmas (async proxy) read them
    }
    consumers_sync<2>();  // P^T, dS^T complete

    wgmma_fence_operands(dv);
    wgmma_fence_operands(dk);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDkdvBr / 16; ++ks)  // dV += P^T dO
      wgmma_m64n128k16_f32_bf16_ss<Major::mn>(dv, sw128::kmajor_desc<L::keys>(a_pt, ks),
                                              sw128::mnmajor_desc<kDkdvBr>(a_do + half, ks), 1);
    wgmma_commit_group();
#pragma unroll
    for (int ks = 0; ks < kDkdvBr / 16; ++ks)  // dK += dS^T Q (scaled at the end)
      wgmma_m64n128k16_f32_bf16_ss<Major::mn>(dk, sw128::kmajor_desc<L::keys>(a_dst, ks),
                                              sw128::mnmajor_desc<kDkdvBr>(a_q + half, ks), 1);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dk);
    wgmma_fence_operands(dv);
    mbar_arrive(bar.empty(st));  // every read of the stage (wgmmas retired, LSE2/D loaded) is done

    q0 += kDkdvBr;
    if (q0 == q_stop) q0 = q_first;
  }

  const std::int64_t col = static_cast<std::int64_t>(hk) * HD + 128 * wg;
  store_dkdv(p, dk, dv, b, col, n0);
}

struct DqSmem {
  static constexpr int S = kStages;  // (K, V) stages
  static constexpr int off_q = 0;
  static constexpr int off_do = off_q + kTileBytes<kDqRows, kD>;
  static constexpr int off_k = off_do + kTileBytes<kDqRows, kD>;     // S tiles
  static constexpr int off_v = off_k + S * kTileBytes<kDqBc, kD>;    // S tiles
  static constexpr int off_bar = off_v + S * kTileBytes<kDqBc, kD>;  // BwdBarriers: once, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * S);
};
static_assert(DqSmem::off_bar == 192 * 1024 && DqSmem::bytes <= kMaxDynamicSmem);

/// dQ of query rows [q_begin + 128 qb, + 128) of query head h, batch b at head_dim 128 (pass 3):
/// one block of the fused kernel below, `smem` its DqSmem.
__device__ __forceinline__ void dq_block(const BackwardParams p, unsigned char* smem, int qb, int h, int b) {
  using L = DqSmem;
  constexpr int S = L::S, HD = kD;
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kDqRows;
  const int q_last = min(q0 + kDqRows, p.q_end) - 1;
  const int n_kv = q_last / kDqBc + 1;  // key tiles 0 .. the one holding q_last

  const BwdBarriers bar(smem_addr(smem + L::off_bar), S);
  bar.init();  // ends with the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {  // the producer
    dq_producer<L, kDqRows, kDqBc, HD>(p, smem, bar, q0, h, hk, b, n_kv);
    return;
  }

  // Consumers: warpgroup wg owns query rows row_wg .. row_wg + 63 and all 128 dQ columns.
  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);
  const int row_wg = q0 + 64 * wg;                        // the warpgroup's first query row
  const int row_lane = row_wg + 16 * warp + (lane >> 2);  // this thread's rows: row_lane, row_lane + 8

  // Row statistics of this thread's two rows; rows past q_end get P = 0 through LSE2 = +inf.
  float lse2[2], delta[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = row_lane + 8 * hf;
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    lse2[hf] = i < p.q_end ? p.lse2[w] : INFINITY;
    delta[hf] = i < p.q_end ? p.delta[w] : 0.0f;
  }

  const std::uint32_t rows_at = wg * kWgRowsOffset;
  const std::uint32_t a_q = smem_addr(smem + L::off_q) + rows_at;
  const std::uint32_t a_do = smem_addr(smem + L::off_do) + rows_at;
  const std::uint32_t a_k0 = smem_addr(smem + L::off_k), a_v0 = smem_addr(smem + L::off_v);

  float dq[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dq[e] = 0.0f;
  // s, dp defined once; in the loop only wgmmas define them (scale-d 0 first).
  float s[32], dp[32];
  std::uint32_t da[4][4];
  zero(s);
  zero(dp);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) da[ks][0] = da[ks][1] = da[ks][2] = da[ks][3] = 0u;

  mbar_wait(bar.once, 0);
  int st = 0;
  std::uint32_t phase = 0;
  // Every key tile 0 .. n_kv - 1 for both warpgroups, also warpgroup 0's last one when all its keys
  // follow its rows (P, dS masked to exact zeros: dQ += 0 products), so no wgmma is in divergent
  // code and both warpgroups arrive on every empty barrier.
  for (int j = 0; j < n_kv; ++j) {
    mbar_wait(bar.full(st), phase);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_k = a_k0 + static_cast<std::uint32_t>(st * kTileBytes<kDqBc, HD>);
    const std::uint32_t a_v = a_v0 + static_cast<std::uint32_t>(st * kTileBytes<kDqBc, HD>);
    const int n0 = j * kDqBc;

    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    wgmma_fence();
    issue_nt_64x64<kDqRows, kDqBc>(s, a_q, a_k);  // S = Q_w K^T
    wgmma_commit_group();
    issue_nt_64x64<kDqRows, kDqBc>(dp, a_do, a_v);  // dP = dO_w V^T
    wgmma_commit_group();

    wgmma_wait_group<1>();  // S done
    wgmma_fence_operands(s);
    const bool edge = n0 + kDqBc - 1 > row_wg;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row_lane + 8 * (e >> 1);
        const int key = n0 + 8 * jj + c0 + (e & 1);
        const float pe = exp2f(fmaf(s[4 * jj + e], p.scale_log2, -lse2[e >> 1]));
        s[4 * jj + e] = (edge && key > i) ? 0.0f : pe;
      }
    wgmma_wait_group<0>();  // dP done
    wgmma_fence_operands(dp);
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] *= dp[e] - delta[(e >> 1) & 1];  // dS
    attention_detail::pack_rs_fragments<64>(da, s);
    fence_fragments(da);
    wgmma_fence_operands(dq);
    wgmma_fence();
    issue_rs_64x128(dq, da, a_k);  // dQ += dS K
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dq);
    fence_fragments(da);
    mbar_arrive(bar.empty(st));  // K, V of the stage read

    if (++st == S) {
      st = 0;
      phase ^= 1u;
    }
  }

  store_acc_rows(dq, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * HD, p.dq_token, row_wg, p.q_end, p.scale,
                 false);
}

struct DqD256Smem {
  static constexpr int HD = 256, S = 2, rows = 64, bc = 64;
  static constexpr int off_q = 0;
  static constexpr int off_do = off_q + kTileBytes<rows, HD>;
  static constexpr int off_k = off_do + kTileBytes<rows, HD>;      // S tiles
  static constexpr int off_v = off_k + S * kTileBytes<bc, HD>;     // S tiles
  static constexpr int off_ds = off_v + S * kTileBytes<bc, HD>;    // dS, 64 x 64 bf16 swizzled
  static constexpr int off_x = off_ds + kTileBytes<rows, 64>;      // dP - D: 128 threads x 32 fp32
  static constexpr int off_bar = off_x + 128 * 32 * 4;             // BwdBarriers: once, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * S);
};
static_assert(DqD256Smem::off_ds % 1024 == 0, "swizzled tile: 1 KiB aligned");
static_assert(DqD256Smem::off_bar == 216 * 1024);

/// dQ of query rows [q_begin + 64 qb, + 64) of query head h, batch b at head_dim 256, the
/// products split between the warpgroups as in dkdv_block_d256: per key tile, warpgroup 0 forms
/// S = Q K^T and warpgroup 1 dP = dO V^T (each once); warpgroup 1 writes x = dP - D_i (fp32, its
/// fragment order) and arrives at named barrier 1; warpgroup 0 forms P (masked as dq_block's) and
/// dS = P x, writes dS as bf16 into a 64 x 64 swizzled tile (rows = queries: a K-major A operand
/// over the keys); after named barrier 2 both run dQ_w += dS K[:, 128 w ..] (4 k-steps of
/// m64n128k16 SS, B = the K stage MN-major at panel 2w). 3 products a tile pair instead of 5.
/// `smem` the kernel's DqD256Smem (Q, dO 2 x 32 KiB, 2 x (K, V) 2 x 32 KiB, dS 8 KiB, x 16 KiB: 216 KiB).
__device__ __forceinline__ void dq_block_d256(const BackwardParams p, unsigned char* smem, int qb, int h, int b) {
  using L = DqD256Smem;
  constexpr int S = L::S, HD = L::HD;
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * L::rows;
  const int q_last = min(q0 + L::rows, p.q_end) - 1;
  const int n_kv = q_last / L::bc + 1;  // key tiles 0 .. the one holding q_last

  const BwdBarriers bar(smem_addr(smem + L::off_bar), S);
  bar.init();  // ends with the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {  // the producer
    dq_producer<L, L::rows, L::bc, HD>(p, smem, bar, q0, h, hk, b, n_kv);
    return;
  }

  // Consumers: both warpgroups take the block's 64 rows; warpgroup wg keeps dQ columns 128 wg ..
  setmaxnreg_inc<kConsumerRegs>();
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid & 31;
  const int c0 = 2 * (lane & 3);
  const int r_lo = 16 * warp + (lane >> 2);  // this thread's fragment rows: r_lo, r_lo + 8
  const int row_lane = q0 + r_lo;

  // This thread's rows' statistic: LSE2 for warpgroup 0 (P), D for warpgroup 1 (dP - D); rows
  // past q_end: LSE2 = +inf (P = 0), D = 0.
  float stat[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = row_lane + 8 * hf;
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    stat[hf] = wg == 0 ? (i < p.q_end ? p.lse2[w] : INFINITY) : (i < p.q_end ? p.delta[w] : 0.0f);
  }

  const std::uint32_t sbase = smem_addr(smem);
  const std::uint32_t a_lhs = sbase + (wg == 0 ? L::off_q : L::off_do);  // S = Q K^T, dP = dO V^T
  const std::uint32_t rhs_off = wg == 0 ? 0u : static_cast<std::uint32_t>(L::off_v - L::off_k);
  const std::uint32_t a_ds = sbase + L::off_ds;
  const std::uint32_t a_x = sbase + L::off_x + 16u * static_cast<std::uint32_t>(tid);  // + 2048 g: float4 g
  const std::uint32_t t_row = static_cast<std::uint32_t>(r_lo * 128 + c0 * 2);
  const int r_sw = r_lo & 7;
  const std::uint32_t half = static_cast<std::uint32_t>(wg) * 2 * kTileBytes<L::bc, 64>;  // panels 2wg, 2wg + 1

  float dq[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dq[e] = 0.0f;
  float acc[32];  // S (warpgroup 0) or dP (warpgroup 1)

  mbar_wait(bar.once, 0);
  int st = 0;
  std::uint32_t phase = 0;
  for (int j = 0; j < n_kv; ++j) {
    mbar_wait(bar.full(st), phase);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_k = sbase + L::off_k + static_cast<std::uint32_t>(st * kTileBytes<L::bc, HD>);
    const int n0 = j * L::bc;

    zero(acc);
    wgmma_fence_operands(acc);
    wgmma_fence();
    issue_nt_64x64<L::rows, L::bc, HD>(acc, opaque(a_lhs), a_k + rhs_off);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(acc);

    if (wg == 1) {
#pragma unroll
      for (int g = 0; g < 8; ++g)
        st_shared_f4(a_x + 2048u * g, make_float4(acc[4 * g] - stat[0], acc[4 * g + 1] - stat[0],
                                                  acc[4 * g + 2] - stat[1], acc[4 * g + 3] - stat[1]));
      consumers_arrive<1>();
    } else {
      const bool edge = n0 + L::bc - 1 > q0;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_lane + 8 * (e >> 1);
          const int key = n0 + 8 * jj + c0 + (e & 1);
          const float pe = exp2f(fmaf(acc[4 * jj + e], p.scale_log2, -stat[e >> 1]));
          acc[4 * jj + e] = (edge && key > i) ? 0.0f : pe;
        }
      consumers_sync<1>();  // x written
      float4 xs[8];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) xs[jj] = ld_shared_f4(a_x + 2048u * jj);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const std::uint32_t at = t_row + static_cast<std::uint32_t>(((jj ^ r_sw) * 16));
        const float4 x = xs[jj];
        st_shared_u32(a_ds + at, pack_bf16(acc[4 * jj] * x.x, acc[4 * jj + 1] * x.y));
        st_shared_u32(a_ds + at + 8 * 128, pack_bf16(acc[4 * jj + 2] * x.z, acc[4 * jj + 3] * x.w));
      }
      fence_proxy_async_shared();  // the tile's generic writes before the wgmmas (async proxy) read it
    }
    consumers_sync<2>();  // dS complete

    wgmma_fence_operands(dq);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < L::bc / 16; ++ks)  // dQ += dS K
      wgmma_m64n128k16_f32_bf16_ss<Major::mn>(dq, sw128::kmajor_desc<L::rows>(a_ds, ks),
                                              sw128::mnmajor_desc<L::bc>(a_k + half, ks), 1);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dq);
    mbar_arrive(bar.empty(st));  // K, V of the stage read

    if (++st == S) {
      st = 0;
      phase ^= 1u;
    }
  }

  store_acc_rows(dq, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * HD + 128 * wg, p.dq_token, q0, p.q_end,
                 p.scale, false);
}

/// The shared memory of the head dim's blocks (the larger of the dK/dV and dQ layouts), plus the
/// 1 KiB that aligning it may take.
template <int HD>
constexpr int kBackwardSmem =
    HD == 256 ? (DkdvD256Smem::bytes > DqD256Smem::bytes ? DkdvD256Smem::bytes : DqD256Smem::bytes) + 1024
              : (DkdvSmem::bytes > DqSmem::bytes ? DkdvSmem::bytes : DqSmem::bytes) + 1024;
static_assert(kBackwardSmem<128> <= kMaxDynamicSmem && kBackwardSmem<256> <= kMaxDynamicSmem);

/// Passes 2 and 3 in one grid: blocks [0, dkdv_blocks) are dK/dV blocks, then dQ blocks. The two
/// passes are independent (both read only the inputs and the preprocess's LSE2/D), so the dQ blocks
/// fill the SMs that the causal tail of the dK/dV blocks leaves idle instead of waiting for a
/// second launch (at S = 4K, Hkv = 4 the dK/dV pass alone is 128 blocks for 132 SMs, key block 0
/// doing twice the mean work). Within each pass the blocks of one head come together (the key /
/// query block index varies fastest, key block 0 and the last query block, the longest, first):
/// the blocks running at one time share the head's Q/dO (dK/dV) or K/V (dQ) tiles in L2.
/// HD: the head dim, 128 (dkdv_block, dq_block) or 256 (dkdv_block_d256, dq_block_d256).
template <int HD>
__global__ void __launch_bounds__(kWsThreads, 1) attention_backward_wgmma_kernel(const BackwardParams p, int kv_blocks,
                                                                                int dkdv_blocks, int q_blocks) {
  static_assert(HD == 128 || HD == 256);
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: no alignment assumed below
  // The swizzle pattern is taken from address bits 7-9: tiles start on 1024-byte boundaries.
  unsigned char* smem = smem_raw + pad_to_1024(smem_addr(smem_raw));
  const int i = static_cast<int>(blockIdx.x);
  if (i < dkdv_blocks) {
    const int heads_kv = p.heads_q / p.group, rest = i / kv_blocks;
    if constexpr (HD == 256)
      dkdv_block_d256(p, smem, i % kv_blocks, rest % heads_kv, rest / heads_kv);
    else
      dkdv_block(p, smem, i % kv_blocks, rest % heads_kv, rest / heads_kv);
  } else {
    const int j = i - dkdv_blocks, rest = j / q_blocks;
    if constexpr (HD == 256)
      dq_block_d256(p, smem, q_blocks - 1 - j % q_blocks, rest % p.heads_q, rest / p.heads_q);
    else
      dq_block(p, smem, q_blocks - 1 - j % q_blocks, rest % p.heads_q, rest / p.heads_q);
  }
#else
  (void)p;
  (void)kv_blocks;
  (void)dkdv_blocks;
  (void)q_blocks;
  __trap();
#endif
}

/// attention_backward_wgmma; with kHeadDim 256, attention_backward_wgmma_d256.
template <int kHeadDim>
cudaError_t backward(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                     TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o, const float* lse,
                     TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv, bool accumulate_dkv, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream, const AttentionDkvSums* sums = nullptr) {
  using namespace attention_detail;
  const char* const name = sums != nullptr ? "attention_backward_dkv_sum" : "attention_backward";
  if (const cudaError_t e = check_problem(name, p); e != cudaSuccess) return e;
  static_assert(kHeadDim == kD || kHeadDim == 256);
  if (p.head_dim != kHeadDim) return cudaErrorNotSupported;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  const cudaError_t checked =
      sums != nullptr ? check_backward_args(name, q, k, v, o, d_o, lse, dq, sums->dk, sums->dv, workspace, workspace_bytes,
                                            attention_backward_workspace_bytes(p), "attention_backward_workspace_bytes")
                      : check_backward_args(name, q, k, v, o, d_o, lse, dq, dk, dv, workspace, workspace_bytes,
                                            attention_backward_workspace_bytes(p), "attention_backward_workspace_bytes");
  if (checked != cudaSuccess) return checked;
  if (const cudaError_t e = current_device_is_cc90(); e != cudaSuccess) return e;

  const BackwardParams plain = backward_params(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace);
  const BackwardParams params = sums != nullptr ? with_sums(plain, *sums) : plain;
  // Every refusal before the first launch, so a refused call leaves nothing queued.
  constexpr int kKeys = kHeadDim == 256 ? DkdvD256Smem::keys : kDkdvKeys;
  constexpr int kQRows = kHeadDim == 256 ? DqD256Smem::rows : kDqRows;
  const std::int64_t kv_blocks = (params.q_end + kKeys - 1) / kKeys;
  const std::int64_t q_blocks = (params.q_len() + kQRows - 1) / kQRows;
  const std::int64_t dkdv_blocks = kv_blocks * p.heads_kv * p.batch, dq_blocks = q_blocks * p.heads_q * p.batch;
  if (dkdv_blocks + dq_blocks > std::numeric_limits<int>::max())  // beyond any that fits
    return ::oom::kernels::detail::refuse("attention_backward: ", dkdv_blocks + dq_blocks, " blocks exceed 2^31 - 1");
  auto* kernel = attention_backward_wgmma_kernel<kHeadDim>;
  constexpr int kSmem = kBackwardSmem<kHeadDim>;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      e != cudaSuccess)
    return e;

  if (const cudaError_t e = launch_backward_preprocess<kHeadDim>(params, p.batch, stream); e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(dkdv_blocks + dq_blocks), kWsThreads, kSmem, stream>>>(
      params, static_cast<int>(kv_blocks), static_cast<int>(dkdv_blocks), static_cast<int>(q_blocks));
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_backward_wgmma(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                     TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                     const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                     bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                     cudaStream_t stream) {
  return backward<kD>(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes, stream);
}

cudaError_t attention_backward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                          TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                          const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                          bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                          cudaStream_t stream) {
  return backward<256>(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes, stream);
}

cudaError_t attention_backward_wgmma_dkv_sum(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                             TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                             const float* lse, TokenRows<bf16> dq, AttentionDkvSums sums, void* workspace,
                                             std::size_t workspace_bytes, cudaStream_t stream) {
  if (p.head_dim == 256) return backward<256>(p, q, k, v, o, d_o, lse, dq, {}, {}, true, workspace, workspace_bytes, stream, &sums);
  return backward<kD>(p, q, k, v, o, d_o, lse, dq, {}, {}, true, workspace, workspace_bytes, stream, &sums);
}

}  // namespace oom::kernels::hopper
