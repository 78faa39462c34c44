// Causal GQA flash-attention backward on Hopper wgmma, head_dim 128: hopper::attention_backward_wgmma,
// the same arguments, results contract and error returns as oom::kernels::attention_backward
// (attention_backward.cu, whose header comment describes the algorithm). The same three passes:
//   1. preprocess: the very kernel of attention_backward (attention_backward_common.cuh), same
//      workspace: D_i = rowsum(dO_i o O_i), LSE_i log2(e);
//   2. dK/dV, keys as the M dimension (transposed), the GQA sum over the group inside one block;
//   3. dQ per query block over key tiles 0 .. diagonal.
// Deterministic (no atomics; every output element is written by one thread, its sums in a fixed
// order): bit-identical run to run. The same roundings as attention_backward: P and dS are rounded
// to bf16 before the products they feed (P^T dO, dS^T Q, dS K), everything else is fp32, outputs
// bf16 (dK = bf16(scale acc [+ old]), dV = bf16(acc [+ old]), dQ = bf16(scale acc)). Only the fp32
// summation order inside the tensor-core products differs, so results agree with the mma.sync
// kernel within the bf16 bounds, not bit for bit.
//
// Shared memory: every tile is 128 columns (d) wide, in the no-swizzle core-matrix layout of
// attention_forward_wgmma_2wg.cu: element (row r, column c) at byte
//   (r/8) 2048 + (c/8) 128 + (r%8) 16 + (c%8) 2,
// so a tile of R rows is R x 256 bytes, and one tile serves as either operand form:
//   K-major (rows = M or N, d = the K of the product): LBO 128 (next 8 d), SBO 2048 (next 8 rows),
//       one k-step of 16 d = +256 bytes;
//   MN-major B (rows = the K of the product, d = N):  LBO 2048 (next 8 rows), SBO 128 (next 8 d),
//       one k-step of 16 rows = +4096 bytes.
// (Both placements are the ones test_wgmma checks and attention_forward_wgmma_2wg uses for Q/K
// and for V.)
//
// 2. dK/dV kernel. Block = 2 warpgroups (256 threads) = 128 keys of one (KV head, batch);
//    warpgroup w owns keys 64w .. 64w+63 (the M of all its wgmmas) and keeps dK, dV for them in
//    fp32 registers (64 + 64 per thread). The block streams (Q, dO, LSE2, D) tiles of BR = 64
//    queries for every query head of the group and every query tile with a row >= the block's
//    first key, double-buffered (cp.async of step+1 during step). Per step, per warpgroup, unless
//    all 64 queries precede its keys:
//      S^T = K_w Q^T       8 x m64n64k16 SS (A = K rows K-major, B = Q rows K-major)   commit
//      dP^T = V_w dO^T     8 x m64n64k16 SS                                            commit
//      wait S^T; P^T = exp2(S^T scale log2e - LSE2_q), 0 where query < key or query >= q_end;
//        P^T to bf16 RS A fragments
//      dV += P^T dO        4 x m64n128k16 RS, B = dO MN-major (k = 16 queries)          commit
//      wait dP^T (dV may still run); dS^T = P^T o (dP^T - D_q) (fp32 P^T), to bf16 fragments
//      dK += dS^T Q        4 x m64n128k16 RS, B = Q MN-major                            commit, wait all
//    so the exponentials overlap the dP^T wgmmas and dS^T the dV wgmmas. After the loop dK is
//    scaled by the softmax scale and rows < q_end are stored (or added to, accumulate_dkv).
//    Grid (ceil(q_end / 128), Hkv, B), key block 0 (the most query tiles) first.
//    smem: K, V 2 x 32 KiB + 2 x (Q, dO) 2 x 32 KiB + 2 x (LSE2, D) 1 KiB = 129 KiB: 1 block/SM.
//
// 3. dQ kernel. Block = 2 warpgroups = 128 query rows of one (query head, batch), warpgroup w
//    rows 64w .. 64w+63; Q, dO stay in shared memory, (K, V) tiles of BC = 64 keys are
//    double-buffered over key tiles 0 .. the one holding the block's last row. Per tile, per
//    warpgroup, unless all 64 keys follow its rows:
//      S = Q_w K^T, dP = dO_w V^T   8 + 8 x m64n64k16 SS, two commit groups
//      wait S; P = exp2(S scale log2e - LSE2_i), 0 where key > query (rows >= q_end: LSE2 = +inf)
//      wait dP; dS = P o (dP - D_i), to bf16 fragments
//      dQ += dS K                   4 x m64n128k16 RS, B = K MN-major (k = 16 keys), wait
//    dQ (64 fp32 per thread) = scale dQ stored as bf16 for rows < q_end.
//    Grid (ceil(q_len / 128), Hq, B), the last (longest) query block first.
//    smem: Q, dO 2 x 32 KiB + 2 x (K, V) 2 x 16 KiB = 128 KiB: 1 block/SM.
//
// v2 (attention_backward_wgmma_v2): the same preprocess, grids, tiles and products, software-
// pipelined so that a warpgroup's tensor-core queue never drains inside the loop (in v1 each
// step/tile ends with wgmma_wait_group<0>, and the __syncthreads that follows keeps the two
// warpgroups in lockstep, so both sit in the barrier, the cp.async issue and the softmax with the
// tensor cores idle):
//   2'. dK/dV: three (Q, dO, LSE2, D) buffers (161.5 KiB). Step i: barrier; S^T_i, dP^T_i issued
//      (queued behind dV_{i-1}, dK_{i-1}, still in flight); then the prefetch of step i+1 into
//      buffer (i+1) % 3 = (i-2) % 3 (free: every warpgroup retired dV/dK_{i-2} during step i-1);
//      wait<1> retires dV/dK_{i-1} and S^T_i; P^T, dV_i; wait<1> (dP^T_i); dS^T packed straight
//      into the bf16 fragments; dK_i issued and left in flight.
//   3'. dQ: four (K, V) buffers (Q, dO 64 KiB + 4 x 32 KiB = 192 KiB); S alternates between two
//      register sets (s_a even tiles, s_b odd; the loop is unrolled by two and the last step
//      peeled). Step j (in flight on entry: S_j, dQ_{j-1}): barrier; prefetch tile j+2 into buffer
//      (j+2) % 4 (tiles >= n_kv zero-filled, nothing read); dP_j issued; wait<2> (S_j); S_{j+1}
//      issued; P_j (during dQ_{j-1}, dP_j, S_{j+1}); wait<1> (dQ_{j-1}, dP_j: the dS fragments
//      are free); dS_j; dQ_j issued and left in flight.
//   Rules that keep ptxas from serializing the wgmmas (C7515/C7520) or injecting waits (C7517):
//   inside the loops nothing but a wgmma defines an accumulator that a later wgmma uses while
//   other groups are in flight (no zeroing: the first k-step has scale-d 0; the registers are
//   defined once before the first wgmma; dS^T of 2' is never written back into s/dp), and no
//   wgmma is issued in divergent code: steps whose 64 x 64 tile is wholly masked for one
//   warpgroup (warpgroup 1's first query tile of each head in 2', warpgroup 0's last key tile in
//   3') are run, not skipped (P, dS masked to exact zeros: dK, dV, dQ += 0 products). The same
//   products in the same order on the same values as v1: the same bits (the test checks it).
//
// v3 (attention_backward_wgmma_v3): the same preprocess, grids, tiles and products, warp-
// specialised as the forward's producer_overlap schedule (attention_forward_wgmma_2wg.cu; the
// mbarrier and setmaxnreg helpers in warp_specialized.cuh): 384 threads, warpgroups 0 and 1
// compute exactly as v1 does per step/tile (the same products, the same order, the same waits),
// warpgroup 2, the producer, issues every cp.async; setmaxnreg: producer 24 registers, consumers
// 240 (launch bound 168 = 65536 / 384). No block-wide barrier after the set-up: tile t lands in
// stage t % 4, whose "full" mbarrier (count 128) completes its phase t / 4 through each producer
// thread's cp.async.mbarrier.arrive.noinc, and whose "empty" mbarrier (count 256) completes once
// every consumer thread has retired the wgmmas that read the stage (wait_group 0) and read its
// LSE2/D; the producer refilling stage t % 4 with tile t >= 4 first waits for completion t / 4 - 1
// of "empty" (parity (t / 4 + 1) & 1). As v2, a step/tile wholly masked for one warpgroup is run
// (exact-zero products), not skipped: no wgmma in divergent code, and both warpgroups arrive on
// every "empty". Same bits as v1 (the test checks it).
//   2''. dK/dV: K, V (loaded once, "full_kv"), four (Q, dO, LSE2, D) stages: 194 KiB. To fit the
//      consumers in 240 registers (v1: 246): s, dp zeroed at the top of each step (not once before
//      the loop, which kept them live across it), dS^T packed straight into the bf16 fragments
//      (as v2), the stage and its phase derived from the step counter, LSE2/D read with
//      ld.shared from 32-bit addresses, and the K/V addresses passed through an opaque mov per
//      step so the compiler rebuilds their 16 descriptors per step instead of holding them.
//      Checked by a build with the setmaxnreg removed and __maxnreg__(240) on the kernel: 236
//      registers, no spills (no spills at 232 either; 4 bytes at 240 without the opaque mov).
//   3''. dQ: Q, dO (loaded once, "full_qdo"), four (K, V) stages: 192 KiB. v1's consumer code
//      needs 168 registers here (no spills at any cap >= 168).
//   In the built kernels (nvdisasm): the producer code after setmaxnreg.dec uses R0-R19, the
//   consumers' up to R226 (dK/dV) and R172 (dQ).
//
// ptxas -v (nvcc 13.0, -O3, -gencode=arch=compute_90a,code=sm_90a):
//   dK/dV:     246 registers, no spills, 129 KiB dynamic smem -> 1 block (8 warps) per SM
//   dQ:        196 registers, no spills, 128 KiB dynamic smem -> 1 block (8 warps) per SM
//   dK/dV v2:  255 registers, no spills, 161.5 KiB dynamic smem -> 1 block (8 warps) per SM
//   dQ v2:     243 registers, no spills, 192 KiB dynamic smem -> 1 block (8 warps) per SM
//   dK/dV v3:  168 registers at launch (consumers 240, producer 24), no spills, 194 KiB + 72 bytes
//              dynamic smem -> 1 block (12 warps) per SM
//   dQ v3:     168 registers at launch (consumers 240, producer 24), no spills, 192 KiB + 72 bytes
//              dynamic smem -> 1 block (12 warps) per SM
// No "wgmma.mma_async instructions are serialized" warning (nor any other C75xx note): every
// wgmma loop is unrolled with compile-time trip counts, and between a wgmma_fence and the wait of
// a group nothing touches the group's accumulator or A-fragment registers (wgmma_fence_operands
// pins them at both ends).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
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
using attention_detail::cp_async_16;
using attention_detail::cp_async_4;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;
using attention_detail::pack_bf16;
using attention_detail::smem_addr;

constexpr int kD = 128;
constexpr int kThreads = 256;  // two warpgroups

// Core-matrix tile geometry (see the top of the file).
constexpr std::uint32_t kBandBytes = 2048;  // one 8-row band of a 128-column tile
constexpr std::uint32_t kKmLbo = 128, kKmSbo = kBandBytes, kKmStep = 256;
constexpr std::uint32_t kMnLbo = kBandBytes, kMnSbo = 128, kMnStep = 2 * kBandBytes;
constexpr std::uint32_t kWg64Rows = 64 / 8 * kBandBytes;  // 64 rows of a tile: 16 KiB

template <int ROWS>
constexpr int kTileBytes = ROWS * kD * 2;

/// Rows [row0, row0 + ROWS) of a strided (token_stride elements) global (rows, 128) bf16 matrix
/// into a core-matrix tile by cp.async, all 256 threads; rows >= row_end are zero-filled (nothing
/// read for them). 16-byte chunk n = (r/8) 128 + (c/8) 8 + r%8 holds element (r, c..c+7), so
/// consecutive threads fill consecutive bytes (as load_tile_cores of the 2wg forward).
template <int ROWS>
__device__ __forceinline__ void load_rows(unsigned char* tile, const __nv_bfloat16* base, std::int64_t token_stride,
                                          int row0, int row_end) {
  static_assert(ROWS % 8 == 0 && ROWS * (kD / 8) % kThreads == 0);
#pragma unroll
  for (int i = 0; i < ROWS * (kD / 8) / kThreads; ++i) {
    const int n = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = (n >> 7) * 8 + (n & 7);
    const int c = ((n >> 3) & 15) * 8;
    const bool valid = row0 + r < row_end;
    const __nv_bfloat16* src = valid ? base + static_cast<std::int64_t>(row0 + r) * token_stride + c : base;
    cp_async_16(tile + 16 * n, src, valid);
  }
}

__device__ __forceinline__ std::uint64_t kmajor_desc(std::uint32_t addr) { return encode_smem_desc(addr, kKmLbo, kKmSbo); }
__device__ __forceinline__ std::uint64_t mnmajor_desc(std::uint32_t addr) { return encode_smem_desc(addr, kMnLbo, kMnSbo); }

/// acc (64 x 64) = A (64 rows at a_rows, K-major) * B^T (64 rows at b_rows, K-major), over the
/// 128 columns: 8 wgmma m64n64k16 SS, not committed.
__device__ __forceinline__ void issue_nt_64x64(float (&acc)[32], std::uint32_t a_rows, std::uint32_t b_rows) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
    wgmma_m64n64k16_f32_bf16_ss(acc, kmajor_desc(a_rows + ks * kKmStep), kmajor_desc(b_rows + ks * kKmStep),
                                ks > 0 ? 1 : 0);
}

/// acc (64 x 128) += A (64 x 64, bf16 RS fragments) * B (64 rows at b_rows x 128, MN-major):
/// 4 wgmma m64n128k16 RS, not committed. `a` must stay untouched until they complete.
__device__ __forceinline__ void issue_rs_64x128(float (&acc)[64], const std::uint32_t (&a)[4][4],
                                                std::uint32_t b_rows) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    wgmma_m64n128k16_f32_bf16_rs<Major::mn>(acc, a[ks], mnmajor_desc(b_rows + ks * kMnStep), 1);
}

/// A 64 x 64 accumulator fragment rounded to bf16 as the RS A operand (k-step ks = columns
/// 16ks .. 16ks+15 = 8-column blocks 2ks, 2ks+1; wgmma.cuh): [0] = (row g, block 2ks),
/// [1] = (row g+8, block 2ks), [2] = (row g, block 2ks+1), [3] = (row g+8, block 2ks+1).
__device__ __forceinline__ void pack_fragments(std::uint32_t (&a)[4][4], const float (&x)[32]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    a[ks][0] = pack_bf16(x[8 * ks + 0], x[8 * ks + 1]);
    a[ks][1] = pack_bf16(x[8 * ks + 2], x[8 * ks + 3]);
    a[ks][2] = pack_bf16(x[8 * ks + 4], x[8 * ks + 5]);
    a[ks][3] = pack_bf16(x[8 * ks + 6], x[8 * ks + 7]);
  }
}
__device__ __forceinline__ void fence_fragments(std::uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_fence_operands(a[ks]);
}

__device__ __forceinline__ void zero(float (&x)[32]) {
#pragma unroll
  for (int e = 0; e < 32; ++e) x[e] = 0.0f;
}

/// A warpgroup's 64 x 128 fp32 accumulator rows as bf16 into global rows row0 + (fragment row),
/// times `scale`, rows >= row_end skipped; with `accumulate`, added to the bf16 values there
/// (bf16(acc scale + old), as store_rows of the mma.sync kernels).
__device__ __forceinline__ void store_acc_rows(const float (&acc)[64], __nv_bfloat16* base, std::int64_t token_stride,
                                               int row0, int row_end, float scale, bool accumulate) {
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = row0 + 16 * warp + (lane >> 2) + 8 * hf;
    if (row >= row_end) continue;
    __nv_bfloat16* dst = base + static_cast<std::int64_t>(row) * token_stride + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      float x0 = acc[4 * j + 2 * hf] * scale, x1 = acc[4 * j + 2 * hf + 1] * scale;
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

// ---- 2. dK/dV ----

constexpr int kDkdvKeys = 128;  // keys per block, 64 per warpgroup
constexpr int kDkdvBr = 64;     // queries per step
/// Shared memory of the dK/dV kernel with `bufs` (Q, dO, LSE2, D) buffers: 2 (serial) or 3
/// (pipelined: the dK/dV wgmmas of step i-1 may still read their buffer during step i).
template <int BUFS>
struct DkdvSmem {
  static constexpr int off_k = 0;
  static constexpr int off_v = off_k + kTileBytes<kDkdvKeys>;
  static constexpr int off_q = off_v + kTileBytes<kDkdvKeys>;             // BUFS buffers
  static constexpr int off_do = off_q + BUFS * kTileBytes<kDkdvBr>;       // BUFS buffers
  static constexpr int off_lse2 = off_do + BUFS * kTileBytes<kDkdvBr>;    // BUFS x 64 fp32
  static constexpr int off_delta = off_lse2 + BUFS * kDkdvBr * 4;         // BUFS x 64 fp32
  static constexpr int bytes = off_delta + BUFS * kDkdvBr * 4;
};
static_assert(DkdvSmem<2>::bytes == 129 * 1024);
static_assert(DkdvSmem<3>::bytes == 161 * 1024 + 512);
constexpr int kDkdvSmem = DkdvSmem<2>::bytes;
constexpr int kDkdvSmemPipelined = DkdvSmem<3>::bytes;

template <bool PIPELINED>
__global__ void __launch_bounds__(kThreads, 1) attention_backward_dkdv_wgmma_kernel(const BackwardParams p) {
#if OOM_WGMMA_SM90A
  constexpr int kBufs = PIPELINED ? 3 : 2;
  using L = DkdvSmem<kBufs>;
  constexpr int kDkdvOffK = L::off_k, kDkdvOffV = L::off_v, kDkdvOffQ = L::off_q, kDkdvOffDo = L::off_do,
                kDkdvOffLse2 = L::off_lse2, kDkdvOffDelta = L::off_delta;
  extern __shared__ __align__(128) unsigned char smem[];
  auto* s_lse2 = reinterpret_cast<float*>(smem + kDkdvOffLse2);
  auto* s_delta = reinterpret_cast<float*>(smem + kDkdvOffDelta);

  const int nb = static_cast<int>(blockIdx.x);  // key block 0 sees the most query tiles: first
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int n0 = nb * kDkdvKeys;
  const int qb_first = n0 <= p.q_begin ? 0 : (n0 - p.q_begin) / kDkdvBr;  // first query tile with a row >= n0
  const int qb_count = (p.q_len() + kDkdvBr - 1) / kDkdvBr;
  const int per_head = qb_count - qb_first;  // >= 1: n0 < q_end
  const int steps = p.group * per_head;

  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
  load_rows<kDkdvKeys>(smem + kDkdvOffK, k_g, p.k_token, n0, p.seq);
  load_rows<kDkdvKeys>(smem + kDkdvOffV, v_g, p.v_token, n0, p.seq);

  // Stage `step` (query head h of the group, query tile qb) into buffer `buf`: Q, dO rows
  // (zero past q_end) and the tile's LSE2, D (zero past q_end; those columns are masked anyway).
  const auto q0_of = [&](int step) { return p.q_begin + (qb_first + step % per_head) * kDkdvBr; };
  const auto prefetch = [&](int step, int buf) {
    const int h = hk * p.group + step / per_head;
    const int q0 = q0_of(step);
    load_rows<kDkdvBr>(smem + kDkdvOffQ + buf * kTileBytes<kDkdvBr>,
                       p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD, p.q_token, q0, p.q_end);
    load_rows<kDkdvBr>(smem + kDkdvOffDo + buf * kTileBytes<kDkdvBr>,
                       p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * kD, p.do_token, q0, p.q_end);
    const int r = static_cast<int>(threadIdx.x);  // 0..127: LSE2, 128..255: D
    const int rr = r % kDkdvBr;
    if (r < 2 * kDkdvBr) {
      const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (q0 - p.q_begin);
      const bool valid = q0 + rr < p.q_end;
      const float* src = (r < kDkdvBr ? p.lse2 : p.delta) + (valid ? w + rr : 0);
      cp_async_4((r < kDkdvBr ? s_lse2 : s_delta) + buf * kDkdvBr + rr, src, valid);
    }
  };
  prefetch(0, 0);
  cp_async_commit();

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);                             // fragment column offset in an 8-column block
  const int key_wg = n0 + 64 * wg;                           // the warpgroup's first key
  const int key_lane = key_wg + 16 * warp + (lane >> 2);     // this thread's keys: key_lane, key_lane + 8

  const std::uint32_t a_k = smem_addr(smem + kDkdvOffK) + wg * kWg64Rows;
  const std::uint32_t a_v = smem_addr(smem + kDkdvOffV) + wg * kWg64Rows;
  const std::uint32_t a_q0 = smem_addr(smem + kDkdvOffQ), a_do0 = smem_addr(smem + kDkdvOffDo);

  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dk[e] = dv[e] = 0.0f;

  float s[32], dp[32];
  std::uint32_t pa[4][4], da[4][4];
  if constexpr (PIPELINED) {
    // Every register the loop carries across in-flight wgmmas defined here, once: inside the
    // loop only wgmmas define s, dp (scale-d 0 in the first k-step), or ptxas serializes (C7515).
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[ks][r] = da[ks][r] = 0u;
    zero(s);
    zero(dp);
    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    fence_fragments(pa);
    fence_fragments(da);
  }
  // buf: step % kBufs, tracked incrementally.
  for (int step = 0, buf = 0; step < steps; ++step, buf = buf + 1 == kBufs ? 0 : buf + 1) {
    const int next_buf = buf + 1 == kBufs ? 0 : buf + 1;
    // Serial: tile `step` has landed for everyone, and both warpgroups are done with step - 1
    // (the last readers of buffer buf ^ 1, refilled next). Pipelined: the dV/dK wgmmas of step - 1
    // may still run (they read buffer (step - 1) % 3), but every warpgroup waited for those of
    // step - 2 during step - 1 (below), so buffer (step + 1) % 3 = (step - 2) % 3 is free.
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    if constexpr (!PIPELINED) {
      if (step + 1 < steps) prefetch(step + 1, next_buf);
      cp_async_commit();
    }

    const int q0 = q0_of(step);
    // Otherwise every query precedes the warpgroup's keys: P^T = 0. The serial kernel skips such
    // a step; the pipelined one runs it (P^T, dS^T masked to 0: dK, dV += 0 products, the same
    // values), which keeps its wgmmas out of divergent code (ptxas C7520).
    const bool active = q0 + kDkdvBr - 1 >= key_wg;
    const std::uint32_t a_q = a_q0 + buf * kTileBytes<kDkdvBr>, a_do = a_do0 + buf * kTileBytes<kDkdvBr>;
    const float* lse2 = s_lse2 + buf * kDkdvBr;
    const float* delta = s_delta + buf * kDkdvBr;

    if constexpr (PIPELINED) {
      // The S^T / dP^T wgmmas first (queued behind dV/dK of step - 1), then the prefetch.
      (void)active;
      wgmma_fence_operands(s);
      wgmma_fence_operands(dp);
      wgmma_fence();
      issue_nt_64x64(s, a_k, a_q);  // S^T = K_w Q^T
      wgmma_commit_group();
      issue_nt_64x64(dp, a_v, a_do);  // dP^T = V_w dO^T
      wgmma_commit_group();
      if (step + 1 < steps) prefetch(step + 1, next_buf);
      cp_async_commit();
      // In flight, oldest first: dV, dK of step - 1, S^T, dP^T.
      wgmma_wait_group<1>();  // S^T done, and dV/dK of the previous step: pa, da free again
      wgmma_fence_operands(s);
      fence_fragments(pa);
      fence_fragments(da);
    } else {
      if (!active) continue;
      zero(s);
      zero(dp);
      wgmma_fence_operands(s);
      wgmma_fence_operands(dp);
      wgmma_fence();
      issue_nt_64x64(s, a_k, a_q);  // S^T = K_w Q^T
      wgmma_commit_group();
      issue_nt_64x64(dp, a_v, a_do);  // dP^T = V_w dO^T
      wgmma_commit_group();

      wgmma_wait_group<1>();  // S^T done
      wgmma_fence_operands(s);
    }
    // P^T = exp2(S^T scale log2e - LSE2_q); masked where query < key (causal) or query >= q_end.
    const bool edge = q0 < key_wg + 63 || q0 + kDkdvBr > p.q_end;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + c0);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = q0 + 8 * j + c0 + (e & 1);
        const int key = key_lane + 8 * (e >> 1);
        const float pe = exp2f(fmaf(s[4 * j + e], p.scale_log2, -((e & 1) ? l2.y : l2.x)));
        s[4 * j + e] = (edge && (qi < key || qi >= p.q_end)) ? 0.0f : pe;
      }
    }
    pack_fragments(pa, s);
    fence_fragments(pa);
    wgmma_fence_operands(dv);
    wgmma_fence();
    issue_rs_64x128(dv, pa, a_do);  // dV += P^T dO
    wgmma_commit_group();

    wgmma_wait_group<1>();  // dP^T done; dV may still run
    wgmma_fence_operands(dp);
    // dS^T = P^T o (dP^T - D_q)
    if constexpr (PIPELINED) {
      // Straight into the bf16 fragments (as pack_fragments): s, dp are accumulators of the next
      // step's wgmmas, issued while dV of this step is in flight, so nothing but a wgmma may
      // define them from here on (ptxas C7515).
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e0 = 8 * ks + 2 * r;  // elements e0, e0 + 1: columns c0, c0 + 1 of 8-column block e0 / 4
          const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * (e0 / 4) + c0);
          da[ks][r] = pack_bf16(s[e0] * (dp[e0] - dl.x), s[e0 + 1] * (dp[e0 + 1] - dl.y));
        }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + c0);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * j + e] *= dp[4 * j + e] - ((e & 1) ? dl.y : dl.x);
      }
      pack_fragments(da, s);
    }
    fence_fragments(da);
    wgmma_fence_operands(dk);
    wgmma_fence();
    issue_rs_64x128(dk, da, a_q);  // dK += dS^T Q (scaled at the end)
    wgmma_commit_group();
    if constexpr (!PIPELINED) {  // pipelined: waited for during the next step (or below)
      wgmma_wait_group<0>();
      wgmma_fence_operands(dk);
      wgmma_fence_operands(dv);
      fence_fragments(pa);
      fence_fragments(da);
    }
  }
  if constexpr (PIPELINED) {
    wgmma_wait_group<0>();
    wgmma_fence_operands(dk);
    wgmma_fence_operands(dv);
    fence_fragments(pa);
    fence_fragments(da);
  }

  store_acc_rows(dk, p.dk + b * p.dk_batch + static_cast<std::int64_t>(hk) * kD, p.dk_token, key_wg, p.q_end, p.scale,
                 p.accumulate_dkv);
  store_acc_rows(dv, p.dv + b * p.dv_batch + static_cast<std::int64_t>(hk) * kD, p.dv_token, key_wg, p.q_end, 1.0f,
                 p.accumulate_dkv);
#else
  (void)p;
  __trap();
#endif
}

// ---- 3. dQ ----

constexpr int kDqRows = 128;  // query rows per block, 64 per warpgroup
constexpr int kDqBc = 64;     // keys per tile
constexpr int kDqOffQ = 0;
constexpr int kDqOffDo = kDqOffQ + kTileBytes<kDqRows>;
constexpr int kDqOffK = kDqOffDo + kTileBytes<kDqRows>;  // 2 buffers
constexpr int kDqOffV = kDqOffK + 2 * kTileBytes<kDqBc>;  // 2 buffers
constexpr int kDqSmem = kDqOffV + 2 * kTileBytes<kDqBc>;
static_assert(kDqSmem == 128 * 1024);

__global__ void __launch_bounds__(kThreads, 1) attention_backward_dq_wgmma_kernel(const BackwardParams p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem[];

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kDqRows;
  const int q_last = min(q0 + kDqRows, p.q_end) - 1;
  const int n_kv = q_last / kDqBc + 1;  // key tiles 0 .. the one holding q_last

  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
  load_rows<kDqRows>(smem + kDqOffQ, p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD, p.q_token, q0, p.q_end);
  load_rows<kDqRows>(smem + kDqOffDo, p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * kD, p.do_token, q0,
                     p.q_end);
  load_rows<kDqBc>(smem + kDqOffK, k_g, p.k_token, 0, p.seq);
  load_rows<kDqBc>(smem + kDqOffV, v_g, p.v_token, 0, p.seq);
  cp_async_commit();

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);
  const int row_wg = q0 + 64 * wg;                          // the warpgroup's first query row
  const int row_lane = row_wg + 16 * warp + (lane >> 2);    // this thread's rows: row_lane, row_lane + 8

  // Row statistics of this thread's two rows; rows past q_end get P = 0 through LSE2 = +inf.
  float lse2[2], delta[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = row_lane + 8 * hf;
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    lse2[hf] = i < p.q_end ? p.lse2[w] : INFINITY;
    delta[hf] = i < p.q_end ? p.delta[w] : 0.0f;
  }

  const std::uint32_t a_q = smem_addr(smem + kDqOffQ) + wg * kWg64Rows;
  const std::uint32_t a_do = smem_addr(smem + kDqOffDo) + wg * kWg64Rows;
  const std::uint32_t a_k0 = smem_addr(smem + kDqOffK), a_v0 = smem_addr(smem + kDqOffV);

  float dq[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dq[e] = 0.0f;

  for (int nb = 0; nb < n_kv; ++nb) {
    const int buf = nb & 1;
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    if (nb + 1 < n_kv) {
      load_rows<kDqBc>(smem + kDqOffK + (buf ^ 1) * kTileBytes<kDqBc>, k_g, p.k_token, (nb + 1) * kDqBc, p.seq);
      load_rows<kDqBc>(smem + kDqOffV + (buf ^ 1) * kTileBytes<kDqBc>, v_g, p.v_token, (nb + 1) * kDqBc, p.seq);
    }
    cp_async_commit();

    const int n0 = nb * kDqBc;
    if (n0 > row_wg + 63) continue;  // every key follows the warpgroup's rows: P = 0

    const std::uint32_t a_k = a_k0 + buf * kTileBytes<kDqBc>, a_v = a_v0 + buf * kTileBytes<kDqBc>;
    float s[32], dp[32];
    std::uint32_t da[4][4];
    zero(s);
    zero(dp);
    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    wgmma_fence();
    issue_nt_64x64(s, a_q, a_k);  // S = Q_w K^T
    wgmma_commit_group();
    issue_nt_64x64(dp, a_do, a_v);  // dP = dO_w V^T
    wgmma_commit_group();

    wgmma_wait_group<1>();  // S done
    wgmma_fence_operands(s);
    const bool edge = n0 + kDqBc - 1 > row_wg;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row_lane + 8 * (e >> 1);
        const int key = n0 + 8 * j + c0 + (e & 1);
        const float pe = exp2f(fmaf(s[4 * j + e], p.scale_log2, -lse2[e >> 1]));
        s[4 * j + e] = (edge && key > i) ? 0.0f : pe;
      }
    wgmma_wait_group<0>();  // dP done
    wgmma_fence_operands(dp);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * j + e] *= dp[4 * j + e] - delta[e >> 1];
    pack_fragments(da, s);
    fence_fragments(da);
    wgmma_fence_operands(dq);
    wgmma_fence();
    issue_rs_64x128(dq, da, a_k);  // dQ += dS K
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dq);
    fence_fragments(da);
  }

  store_acc_rows(dq, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * kD, p.dq_token, row_wg, p.q_end, p.scale,
                 false);
#else
  (void)p;
  __trap();
#endif
}

// ---- 3'. dQ, software-pipelined (attention_backward_wgmma_v2) ----

constexpr int kDq2Bufs = 4;  // K/V tiles j-1 (dQ_{j-1} may still read K), j, j+1, j+2 (landing)
constexpr int kDq2OffK = kDqOffDo + kTileBytes<kDqRows>;     // 4 buffers
constexpr int kDq2OffV = kDq2OffK + kDq2Bufs * kTileBytes<kDqBc>;  // 4 buffers
constexpr int kDq2Smem = kDq2OffV + kDq2Bufs * kTileBytes<kDqBc>;
static_assert(kDq2Smem == 192 * 1024);

/// acc = A * B^T over the 128 columns as issue_nt_64x64, with the fences before it. The first
/// k-step overwrites (scale-d 0), so acc is not zeroed: an instruction defining an accumulator
/// while other wgmmas are in flight would serialize the wgmmas (ptxas C7515).
__device__ __forceinline__ void fence_issue_nt_64x64(float (&acc)[32], std::uint32_t a_rows, std::uint32_t b_rows) {
  wgmma_fence_operands(acc);
  wgmma_fence();
  issue_nt_64x64(acc, a_rows, b_rows);
}

__global__ void __launch_bounds__(kThreads, 1) attention_backward_dq_wgmma_pipelined_kernel(const BackwardParams p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem[];

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kDqRows;
  const int q_last = min(q0 + kDqRows, p.q_end) - 1;
  const int n_kv = q_last / kDqBc + 1;  // key tiles 0 .. the one holding q_last

  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
  // Key tile t into buffer t % 4; a tile t >= n_kv is zero-filled (nothing read): no branch.
  const auto load_kv = [&](int t) {
    const int buf = t & (kDq2Bufs - 1);
    const int row_end = t < n_kv ? p.seq : 0;
    load_rows<kDqBc>(smem + kDq2OffK + buf * kTileBytes<kDqBc>, k_g, p.k_token, t * kDqBc, row_end);
    load_rows<kDqBc>(smem + kDq2OffV + buf * kTileBytes<kDqBc>, v_g, p.v_token, t * kDqBc, row_end);
  };
  load_rows<kDqRows>(smem + kDqOffQ, p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD, p.q_token, q0, p.q_end);
  load_rows<kDqRows>(smem + kDqOffDo, p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * kD, p.do_token, q0,
                     p.q_end);
  load_kv(0);
  cp_async_commit();  // group: Q, dO, tile 0
  load_kv(1);
  cp_async_commit();  // group: tile 1

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);
  const int row_wg = q0 + 64 * wg;                        // the warpgroup's first query row
  const int row_lane = row_wg + 16 * warp + (lane >> 2);  // this thread's rows: row_lane, row_lane + 8
  // Both warpgroups run every key tile 0 .. n_kv-1, also warpgroup 0 its last one when all its keys
  // follow its rows (the causal mask zeroes P and dS there: dQ += 0 products, the same value).
  // Costs at most one tile of 2 n_kv per block, and keeps every wgmma out of divergent code
  // (ptxas C7520 serializes the wgmmas otherwise).

  float lse2[2], delta[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = row_lane + 8 * hf;
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    lse2[hf] = i < p.q_end ? p.lse2[w] : INFINITY;
    delta[hf] = i < p.q_end ? p.delta[w] : 0.0f;
  }

  const std::uint32_t a_q = smem_addr(smem + kDqOffQ) + wg * kWg64Rows;
  const std::uint32_t a_do = smem_addr(smem + kDqOffDo) + wg * kWg64Rows;
  const std::uint32_t a_k0 = smem_addr(smem + kDq2OffK), a_v0 = smem_addr(smem + kDq2OffV);
  const auto a_k = [&](int t) { return a_k0 + (t & (kDq2Bufs - 1)) * kTileBytes<kDqBc>; };
  const auto a_v = [&](int t) { return a_v0 + (t & (kDq2Bufs - 1)) * kTileBytes<kDqBc>; };

  float dq[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dq[e] = 0.0f;
  // Two register sets for S, dP: tile j in one while tile j+1 accumulates in the other.
  // S of tile j alternates between s_a and s_b: S_{j+1} accumulates during the softmax of tile j.
  float s_a[32], s_b[32], dp[32];
  std::uint32_t da[4][4];
  zero(s_a);
  zero(s_b);
  zero(dp);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) da[ks][0] = da[ks][1] = da[ks][2] = da[ks][3] = 0u;

  // Prologue: Q, dO and tile 0 landed; S_0 issued, and an empty group standing for dQ_{-1}.
  cp_async_wait<1>();
  fence_proxy_async_shared();
  __syncthreads();
  wgmma_fence_operands(s_b);  // every register the loop carries defined before S_0 is in flight
  wgmma_fence_operands(dp);
  wgmma_fence_operands(dq);
  fence_fragments(da);
  fence_issue_nt_64x64(s_a, a_q, a_k(0));
  wgmma_commit_group();
  wgmma_commit_group();

  // Step j. wgmma groups in flight on entry, oldest first: S_j (into s), dQ_{j-1}. Three groups
  // are committed per step (dP_j, S_{j+1} (empty in the last step), dQ_j), so the waits count
  // alike in every step. `issue_next` (false only in the last step) is a compile-time constant.
  // No instruction but a wgmma defines an accumulator while another group is in flight that
  // was issued after it was last written (s is written by the softmax before dQ_j is issued,
  // and next accumulates S_{j+2} in step j+1, after the groups in flight then were issued).
  const auto step = [&](int j, float (&s)[32], float (&s_next)[32], auto issue_next) {
    // Tile j+1 has landed (this thread's copies; the barrier publishes everyone's), and both
    // warpgroups are past step j-1's wait for dQ_{j-2}: buffer (j+2) % 4 = (j-2) % 4 is free
    // (dQ_{j-1} may still read K of tile j-1, buffer (j-1) % 4).
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    load_kv(j + 2);  // zero-filled past n_kv
    cp_async_commit();

    fence_issue_nt_64x64(dp, a_do, a_v(j));  // dP_j = dO_w V_j^T
    wgmma_commit_group();
    wgmma_wait_group<2>();  // S_j done; dQ_{j-1}, dP_j may run
    wgmma_fence_operands(s);
    // S_{j+1}: runs on the tensor cores during the softmax of tile j below.
    if constexpr (decltype(issue_next)::value) fence_issue_nt_64x64(s_next, a_q, a_k(j + 1));
    wgmma_commit_group();

    const int n0 = j * kDqBc;
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
    wgmma_wait_group<1>();  // dQ_{j-1} and dP_j done (da free again); S_{j+1} may run
    wgmma_fence_operands(dp);
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] *= dp[e] - delta[(e >> 1) & 1];  // dS
    fence_fragments(da);
    wgmma_fence_operands(dq);
    pack_fragments(da, s);
    fence_fragments(da);
    wgmma_fence();
    issue_rs_64x128(dq, da, a_k(j));  // dQ_j += dS_j K_j
    wgmma_commit_group();
  };
  // Even tiles' S in s_a, odd ones' in s_b; the last step (no S_{j+1}) peeled off, and every
  // wgmma retired before the paths join.
  int j = 0;
  for (; j + 2 < n_kv; j += 2) {
    step(j, s_a, s_b, std::true_type{});
    step(j + 1, s_b, s_a, std::true_type{});
  }
  if (j + 2 == n_kv) {
    step(j, s_a, s_b, std::true_type{});
    step(j + 1, s_b, s_a, std::false_type{});
    wgmma_wait_group<0>();
  } else {
    step(j, s_a, s_b, std::false_type{});
    wgmma_wait_group<0>();
  }
  wgmma_fence_operands(dq);
  fence_fragments(da);

  store_acc_rows(dq, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * kD, p.dq_token, row_wg, p.q_end, p.scale,
                 false);
#else
  (void)p;
  __trap();
#endif
}

// ---- v3: warp-specialised dK/dV and dQ (attention_backward_wgmma_v3) ----
// 384 threads: warpgroups 0 and 1 compute exactly as the serial (v1) kernels do, except that a
// step/tile wholly masked for a warpgroup is run rather than skipped (P, dS exact zeros: += 0
// products, the same values, and no wgmma in divergent code); warpgroup 2 (the producer, 24
// registers) issues every cp.async into mbarrier-tracked stages. Stage t % S of tile t is "full"
// once the producer's 128 threads' cp.async have landed (cp.async.mbarrier.arrive.noinc, count
// 128) and "empty" once all 256 consumer threads have retired the wgmmas that read it (count 256).
// No block-wide barrier after the set-up.


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

constexpr int kDkdvStages = 4;  // (Q, dO, LSE2, D) stages
struct DkdvWsSmem {
  static constexpr int off_k = 0;
  static constexpr int off_v = off_k + kTileBytes<kDkdvKeys>;
  static constexpr int off_q = off_v + kTileBytes<kDkdvKeys>;                // kDkdvStages tiles
  static constexpr int off_do = off_q + kDkdvStages * kTileBytes<kDkdvBr>;   // kDkdvStages tiles
  static constexpr int off_lse2 = off_do + kDkdvStages * kTileBytes<kDkdvBr>;  // kDkdvStages x 64 fp32
  static constexpr int off_delta = off_lse2 + kDkdvStages * kDkdvBr * 4;      // kDkdvStages x 64 fp32
  static constexpr int off_bar = off_delta + kDkdvStages * kDkdvBr * 4;       // full_kv, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * kDkdvStages);
};
static_assert(DkdvWsSmem::off_bar == 194 * 1024 && DkdvWsSmem::bytes <= 227 * 1024);
constexpr int kDkdvWsSmem = DkdvWsSmem::bytes;

__global__ void __launch_bounds__(kWsThreads, 1) attention_backward_dkdv_wgmma_ws_kernel(const BackwardParams p) {
#if OOM_WGMMA_SM90A
  using L = DkdvWsSmem;
  constexpr int S = kDkdvStages;
  extern __shared__ __align__(128) unsigned char smem[];

  const int nb = static_cast<int>(blockIdx.x);  // key block 0 sees the most query tiles: first
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int n0 = nb * kDkdvKeys;
  const int qb_first = n0 <= p.q_begin ? 0 : (n0 - p.q_begin) / kDkdvBr;  // first query tile with a row >= n0
  const int qb_count = (p.q_len() + kDkdvBr - 1) / kDkdvBr;
  const int steps = p.group * (qb_count - qb_first);  // >= 1: n0 < q_end

  // Step t (query head hk group + t / per_head, query tile qb_first + t % per_head) in stage t % S,
  // the (t / S)-th use of that stage: its full barrier completes phase t / S, and the producer
  // waits for completion t / S - 1 of its empty barrier before refilling it.
  const std::uint32_t bars = smem_addr(smem + L::off_bar);
  const std::uint32_t full_kv = bars;
  const auto full = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + s)); };
  const auto empty = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + S + s)); };
  if (threadIdx.x == 0) {
    mbar_init(full_kv, kWsProducerThreads);
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), kWsProducerThreads);
      mbar_init(empty(s), kWsConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    load_rows_producer<kDkdvKeys>(smem_addr(smem + L::off_k), p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD,
                                  p.k_token, n0, p.seq, tid);
    load_rows_producer<kDkdvKeys>(smem_addr(smem + L::off_v), p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD,
                                  p.v_token, n0, p.seq, tid);
    cp_async_mbar_arrive(full_kv);
    int h = hk * p.group, qb = qb_first, st = 0;
    std::uint32_t phase = 0;
    for (int t = 0; t < steps; ++t) {
      if (t >= S) mbar_wait(empty(st), phase ^ 1u);  // completion t / S - 1: stage free
      const int q0 = p.q_begin + qb * kDkdvBr;
      load_rows_producer<kDkdvBr>(smem_addr(smem + L::off_q) + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr>),
                                  p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD, p.q_token, q0, p.q_end, tid);
      load_rows_producer<kDkdvBr>(smem_addr(smem + L::off_do) + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr>),
                                  p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * kD, p.do_token, q0, p.q_end,
                                  tid);
      {  // threads 0..63: LSE2, 64..127: D of the tile's rows (zero past q_end; masked anyway)
        const int rr = tid % kDkdvBr;
        const bool valid = q0 + rr < p.q_end;
        const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (q0 - p.q_begin) + rr;
        const float* src = (tid < kDkdvBr ? p.lse2 : p.delta) + (valid ? w : 0);
        const int dst = (tid < kDkdvBr ? L::off_lse2 : L::off_delta) + 4 * (st * kDkdvBr + rr);
        cp_async_4(smem + dst, src, valid);
      }
      cp_async_mbar_arrive(full(st));
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
    return;
  }

  // Consumers: warpgroup wg owns keys n0 + 64 wg .. n0 + 64 wg + 63.
  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int c0 = 2 * (lane & 3);                          // fragment column offset in an 8-column block
  const int key_wg = n0 + 64 * wg;                        // the warpgroup's first key
  const int key_lane = key_wg + 16 * warp + (lane >> 2);  // this thread's keys: key_lane, key_lane + 8
  // Every shared address as one 32-bit base plus constants (LSE2, D read with ld.shared from it):
  // no 64-bit generic pointers live across the loop.
  const std::uint32_t sbase = smem_addr(smem);
  const std::uint32_t a_k = sbase + L::off_k + wg * kWg64Rows;
  const std::uint32_t a_v = a_k + (L::off_v - L::off_k);

  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dk[e] = dv[e] = 0.0f;
  // s, dp are zeroed at the top of each step (as v1; nothing is in flight there), so they are dead
  // from the dS^T packing to the next step: 240 registers suffice (defining them once before the
  // loop keeps them live across it, as the wgmmas read their accumulators: 16 bytes of spills).
  float s[32], dp[32];
  std::uint32_t pa[4][4], da[4][4];

  mbar_wait(full_kv, 0);
  // Few registers live across the loop: the stage and phase come from t (S a power of two), the
  // query tile start q0 steps through [q_first, q_stop) once per head.
  static_assert((S & (S - 1)) == 0);
  const int q_first = p.q_begin + qb_first * kDkdvBr, q_stop = p.q_begin + qb_count * kDkdvBr;
  int q0 = q_first;
  for (int t = 0; t < steps; ++t) {
    const int st = t & (S - 1);
    mbar_wait(full(st), static_cast<std::uint32_t>(t / S) & 1u);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_q = sbase + L::off_q + static_cast<std::uint32_t>(st * kTileBytes<kDkdvBr>);
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
    issue_nt_64x64(s, a_kw, a_q);  // S^T = K_w Q^T
    wgmma_commit_group();
    issue_nt_64x64(dp, a_vw, a_do);  // dP^T = V_w dO^T
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
    pack_fragments(pa, s);
    fence_fragments(pa);
    wgmma_fence_operands(dv);
    wgmma_fence();
    issue_rs_64x128(dv, pa, a_do);  // dV += P^T dO
    wgmma_commit_group();

    wgmma_wait_group<1>();  // dP^T done; dV may still run
    wgmma_fence_operands(dp);
    // dS^T = P^T o (dP^T - D_q), straight into the bf16 fragments (the values of v1's in-place
    // product, then pack_fragments; fewer live registers).
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
    mbar_arrive(empty(st));  // every read of the stage (wgmmas retired, LSE2/D loaded) is done

    q0 += kDkdvBr;
    if (q0 == q_stop) q0 = q_first;
  }

  store_acc_rows(dk, p.dk + b * p.dk_batch + static_cast<std::int64_t>(hk) * kD, p.dk_token, key_wg, p.q_end, p.scale,
                 p.accumulate_dkv);
  store_acc_rows(dv, p.dv + b * p.dv_batch + static_cast<std::int64_t>(hk) * kD, p.dv_token, key_wg, p.q_end, 1.0f,
                 p.accumulate_dkv);
#else
  (void)p;
  __trap();
#endif
}

constexpr int kDqStages = 4;  // (K, V) stages
struct DqWsSmem {
  static constexpr int off_q = 0;
  static constexpr int off_do = off_q + kTileBytes<kDqRows>;
  static constexpr int off_k = off_do + kTileBytes<kDqRows>;              // kDqStages tiles
  static constexpr int off_v = off_k + kDqStages * kTileBytes<kDqBc>;     // kDqStages tiles
  static constexpr int off_bar = off_v + kDqStages * kTileBytes<kDqBc>;   // full_qdo, full[], empty[]
  static constexpr int bytes = off_bar + 8 * (1 + 2 * kDqStages);
};
static_assert(DqWsSmem::off_bar == 192 * 1024 && DqWsSmem::bytes <= 227 * 1024);
constexpr int kDqWsSmem = DqWsSmem::bytes;

__global__ void __launch_bounds__(kWsThreads, 1) attention_backward_dq_wgmma_ws_kernel(const BackwardParams p) {
#if OOM_WGMMA_SM90A
  using L = DqWsSmem;
  constexpr int S = kDqStages;
  extern __shared__ __align__(128) unsigned char smem[];

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kDqRows;
  const int q_last = min(q0 + kDqRows, p.q_end) - 1;
  const int n_kv = q_last / kDqBc + 1;  // key tiles 0 .. the one holding q_last

  // Key tile t in stage t % S, its (t / S)-th use (as in the dK/dV kernel).
  const std::uint32_t bars = smem_addr(smem + L::off_bar);
  const std::uint32_t full_qdo = bars;
  const auto full = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + s)); };
  const auto empty = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + S + s)); };
  if (threadIdx.x == 0) {
    mbar_init(full_qdo, kWsProducerThreads);
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), kWsProducerThreads);
      mbar_init(empty(s), kWsConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    load_rows_producer<kDqRows>(smem_addr(smem + L::off_q), p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD,
                                p.q_token, q0, p.q_end, tid);
    load_rows_producer<kDqRows>(smem_addr(smem + L::off_do),
                                p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * kD, p.do_token, q0, p.q_end,
                                tid);
    cp_async_mbar_arrive(full_qdo);
    const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
    const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
    int st = 0;
    std::uint32_t phase = 0;
    for (int t = 0; t < n_kv; ++t) {
      if (t >= S) mbar_wait(empty(st), phase ^ 1u);  // completion t / S - 1: stage free
      load_rows_producer<kDqBc>(smem_addr(smem + L::off_k) + static_cast<std::uint32_t>(st * kTileBytes<kDqBc>), k_g,
                                p.k_token, t * kDqBc, p.seq, tid);
      load_rows_producer<kDqBc>(smem_addr(smem + L::off_v) + static_cast<std::uint32_t>(st * kTileBytes<kDqBc>), v_g,
                                p.v_token, t * kDqBc, p.seq, tid);
      cp_async_mbar_arrive(full(st));
      if (++st == S) {
        st = 0;
        phase ^= 1u;
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
    return;
  }

  // Consumers: warpgroup wg owns query rows q0 + 64 wg .. q0 + 64 wg + 63.
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

  const std::uint32_t a_q = smem_addr(smem + L::off_q) + wg * kWg64Rows;
  const std::uint32_t a_do = smem_addr(smem + L::off_do) + wg * kWg64Rows;
  const std::uint32_t a_k0 = smem_addr(smem + L::off_k), a_v0 = smem_addr(smem + L::off_v);

  float dq[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dq[e] = 0.0f;
  float s[32], dp[32];  // defined once; in the loop only wgmmas define them (scale-d 0 first)
  std::uint32_t da[4][4];
  zero(s);
  zero(dp);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) da[ks][0] = da[ks][1] = da[ks][2] = da[ks][3] = 0u;

  mbar_wait(full_qdo, 0);
  int st = 0;
  std::uint32_t phase = 0;
  // Every key tile 0 .. n_kv - 1 for both warpgroups, also warpgroup 0's last one when all its keys
  // follow its rows (P, dS masked to exact zeros: dQ += 0 products), so no wgmma is in divergent
  // code and both warpgroups arrive on every empty barrier.
  for (int j = 0; j < n_kv; ++j) {
    mbar_wait(full(st), phase);
    fence_proxy_async_shared();  // the stage's cp.async writes, seen through the barrier, before the wgmmas
    const std::uint32_t a_k = a_k0 + static_cast<std::uint32_t>(st * kTileBytes<kDqBc>);
    const std::uint32_t a_v = a_v0 + static_cast<std::uint32_t>(st * kTileBytes<kDqBc>);
    const int n0 = j * kDqBc;

    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    wgmma_fence();
    issue_nt_64x64(s, a_q, a_k);  // S = Q_w K^T
    wgmma_commit_group();
    issue_nt_64x64(dp, a_do, a_v);  // dP = dO_w V^T
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
    pack_fragments(da, s);
    fence_fragments(da);
    wgmma_fence_operands(dq);
    wgmma_fence();
    issue_rs_64x128(dq, da, a_k);  // dQ += dS K
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(dq);
    fence_fragments(da);
    mbar_arrive(empty(st));  // K, V of the stage read

    if (++st == S) {
      st = 0;
      phase ^= 1u;
    }
  }

  store_acc_rows(dq, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * kD, p.dq_token, row_wg, p.q_end, p.scale,
                 false);
#else
  (void)p;
  __trap();
#endif
}

/// The three entry points: the same preprocess; dK/dV and dQ by the serial (v1), pipelined (v2)
/// or warp-specialised (v3) kernels.
enum class Variant { serial, pipelined, warp_specialized };

cudaError_t run_backward(Variant variant, const AttentionProblem& p, TokenRows<const bf16> q,
                         TokenRows<const bf16> k, TokenRows<const bf16> v, TokenRows<const bf16> o,
                         TokenRows<const bf16> d_o, const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk,
                         TokenRows<bf16> dv, bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                         cudaStream_t stream) {
  using namespace attention_detail;
  if (!attention_can_implement(p)) return cudaErrorInvalidValue;
  if (p.head_dim != kD) return cudaErrorNotSupported;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  if (!backward_args_ok(p, q, k, v, o, d_o, lse, dq, dk, dv, workspace, workspace_bytes,
                        attention_backward_workspace_bytes(p)))
    return cudaErrorInvalidValue;
  if (const cudaError_t e = current_device_is_cc90(); e != cudaSuccess) return e;

  const BackwardParams params = backward_params(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace);
  if (const cudaError_t e = launch_backward_preprocess<kD>(params, p.batch, stream); e != cudaSuccess) return e;

  const bool ws = variant == Variant::warp_specialized;
  const int threads = ws ? kWsThreads : kThreads;
  const auto dkdv_kernel = ws ? attention_backward_dkdv_wgmma_ws_kernel
                           : variant == Variant::pipelined ? attention_backward_dkdv_wgmma_kernel<true>
                                                           : attention_backward_dkdv_wgmma_kernel<false>;
  const int dkdv_smem = ws ? kDkdvWsSmem : variant == Variant::pipelined ? kDkdvSmemPipelined : kDkdvSmem;
  if (const cudaError_t e =
          cudaFuncSetAttribute(dkdv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem);
      e != cudaSuccess)
    return e;
  const int kv_blocks = (params.q_end + kDkdvKeys - 1) / kDkdvKeys;
  const dim3 dkdv_grid(static_cast<unsigned>(kv_blocks), static_cast<unsigned>(p.heads_kv),
                       static_cast<unsigned>(p.batch));
  dkdv_kernel<<<dkdv_grid, threads, static_cast<std::size_t>(dkdv_smem), stream>>>(params);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

  const auto dq_kernel = ws ? attention_backward_dq_wgmma_ws_kernel
                         : variant == Variant::pipelined ? attention_backward_dq_wgmma_pipelined_kernel
                                                         : attention_backward_dq_wgmma_kernel;
  const int dq_smem = ws ? kDqWsSmem : variant == Variant::pipelined ? kDq2Smem : kDqSmem;
  if (const cudaError_t e = cudaFuncSetAttribute(dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dq_smem);
      e != cudaSuccess)
    return e;
  const int q_blocks = (params.q_len() + kDqRows - 1) / kDqRows;
  const dim3 dq_grid(static_cast<unsigned>(q_blocks), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  dq_kernel<<<dq_grid, threads, static_cast<std::size_t>(dq_smem), stream>>>(params);
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_backward_wgmma(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                     TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                     const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                     bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                     cudaStream_t stream) {
  return run_backward(Variant::serial, p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes, stream);
}

cudaError_t attention_backward_wgmma_v2(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                        const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                        bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream) {
  return run_backward(Variant::pipelined, p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes, stream);
}

cudaError_t attention_backward_wgmma_v3(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                        const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                        bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream) {
  return run_backward(Variant::warp_specialized, p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace,
                      workspace_bytes, stream);
}

}  // namespace oom::kernels::hopper
