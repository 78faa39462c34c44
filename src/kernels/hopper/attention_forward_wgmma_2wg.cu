// Causal GQA flash-attention forward on Hopper wgmma, head_dim 128, two consumer warpgroups per
// block (hopper::attention_forward_wgmma_2wg): what oom::kernels::attention_forward runs on compute
// capability 9.0 at head_dim 128, same arguments and results as the mma.sync kernel
// (attention_forward.cu). docs/hopper.md says what is verified and what was measured.
//
// What changed against a first wgmma kernel (one warpgroup per 64 rows, 0.8x of mma.sync; removed
// once this one was in the product):
//   - one block = two warpgroups (256 threads) = a 128-row query tile; warpgroup w owns rows
//     64w .. 64w+63 and both share each 128-key K/V tile in shared memory, so K/V traffic per FLOP
//     halves (and each wgmma is m64n128k16 instead of m64n64k16 for S);
//   - P never touches shared memory: the S accumulator fragment, exponentiated and rounded to bf16,
//     is the register A operand of O += P V (wgmma_m64n128k16_f32_bf16_rs; the RS A fragment is the
//     accumulator fragment of two adjacent 8-column blocks, wgmma.cuh);
//   - V is read by the wgmma straight from its cp.async tile as an MN-major B (imm-trans-b = 1):
//     no transpose pass, no staging buffer. K and V tiles have the same layout; only the
//     descriptor's meaning differs.
//
// Shared memory of the first schedules (serial .. producer_3stage; producer_sw128* below differ), in
// the no-swizzle core-matrix layout (core matrix = 8 rows x 16 bytes, 128
// contiguous bytes; the 16 core matrices of one 8-row band side by side, 128 bytes apart, bands
// 2048 bytes apart: element (row r, column c) at byte (r/8) 2048 + (c/8) 128 + (r%8) 16 + (c%8) 2):
//   Q  128 rows x 128 d     A of S = Q K^T, K-major:  LBO 128 (along d), SBO 2048 (along rows)
//   K  128 keys x 128 d     B of S = Q K^T, K-major:  LBO 128 (along d), SBO 2048 (along keys)
//   V  128 keys x 128 d     B of O = P V, MN-major:   LBO 2048 (along keys = K), SBO 128 (along d = N)
// K and V double-buffered: 32 + 2 x 64 = 160 KiB, one block per SM (the registers allow no more).
// The K-major Q/K placement is test_wgmma's "mn_rows" (LBO 128, SBO 16 K) at K = 128; the V
// placement is its "k_slabs" (SBO 128, LBO 16 N) at N = 128 with B MN-major, RS form: both tested
// there with these very shapes.
//
// Per K/V tile j (keys 128j .. 128j+127), every warpgroup on its own 64 rows, in one of two
// schedules (Wgmma2wgSchedule, a template parameter of the kernel):
//   serial:
//   0. all threads: wait for their cp.async, fence the async proxy, barrier; then start the
//      cp.async of K_{j+1}, V_{j+1} into the other buffers (their last readers, the wgmmas of tile
//      j-1 of both warpgroups, completed before that barrier);
//   1. S = Q_w K_j^T: 8 wgmma m64n128k16 SS (k-steps of 16 over d), waited for;
//   2. causal mask only if the tile crosses the diagonal of one of the warpgroup's rows; online
//      softmax on the fragment (a row's 128 values on the 4 lanes of a quad), O rescaled, P packed
//      to bf16 A fragments;
//   3. O += P_j V_j: 8 wgmma m64n128k16 RS, B = V MN-major (k-steps of 16 over the keys), waited for.
//   overlap_softmax (the default; FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024):
//   0. as above, but the loads started are K_{j+1} and V_j: V trails K by one tile;
//   1. S_j = Q_w K_j^T and O += P_{j-1} V_{j-1} issued back to back as two commit groups; wait
//      for the first only (groups complete in order);
//   2. mask and softmax of S_j while the P V wgmmas run (they read P_{j-1} from registers and
//      accumulate into O, neither of which the softmax touches);
//   3. wait for P V, then rescale O and pack P_j;
//   and after the last tile, one more barrier and O += P_{n-1} V_{n-1}. The same operations in
//   the same order on the same values as serial: both give the same bits (the test checks it).
// The two warpgroups share only the barrier of step 0, so one's softmax may also overlap the
// other's wgmmas as the warp schedulers see fit. All wgmma loops have compile-time trip counts.
//
// Warp-specialised schedules (attention_forward_wgmma_ws_kernel, Wgmma2wgSchedule::producer_overlap
// and producer_pingpong; docs/hopper.md): 384 threads, warpgroups 0 and 1 compute as in
// overlap_softmax (the same functions in the same order, so the same bits), warpgroup 2 issues all
// cp.async (Q, K_0, then per tile K_{j+1}, V_j) into 2 K and 2 V stages, each tile completing its
// stage's "full" mbarrier through cp.async.mbarrier.arrive.noinc; consumers release K_j once S_j is
// done and V_j once P_j V_j is ("empty" mbarriers, all 256 consumer threads arrive). No block
// barrier in the loop. setmaxnreg: producer 24, consumers 240 registers (the exact exchange from the
// 168 each thread starts with). producer_pingpong: the consumers take turns issuing their wgmmas
// (named barriers 1, 2), so one's softmax runs under the other's GEMMs.
// producer_tma (H200, seventh session: bit-identical, 0.96-0.98x producer_overlap): producer_overlap
// with K and V loaded by one TMA instruction per tile from one producer thread into a chunk-major
// layout (kKc*, kVc* below; tma.cuh), the consumers unchanged but for those tiles' descriptor
// strides.
// producer_3stage (H200, eighth session: bit-identical, 1.02-1.05x producer_overlap):
// producer_overlap's code with 3 K and 3 V stages instead of 2 (the stage count is the kernel's
// template parameter, WsLayout below: 224 KiB + barriers of the 227 KiB a block may have), so the
// producer may run up to two tiles ahead of the consumers.
// producer_sw128 and producer_sw128_tma (eighth session; the former the default since 2026-12-01): producer_3stage
// with Q, K and V in the 128-byte-swizzled layout (kSw* below), loaded by cp.async or (K, V) by
// TMA. The band layout splits every 32-byte global sector of a cp.async over two shared-memory
// lines (ncu: 2x the ideal L2 sectors, 8x the ideal shared-store wavefronts); this is what held
// the forward at ~2.7x its tensor time. On the H200 both are bit-identical to serial and run at
// 1.41-1.71x producer_overlap across two calls (docs/hopper.md).
// ptxas (nvcc 13.0, -O3, sm_90a): serial 235 registers, overlap_softmax 238; every
// warp-specialised schedule 168 at launch (consumers up to 240); 0 spills, no C7519/C7520 warning.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attention_common.cuh"
#include "attention_forward_steps.cuh"
#include "attention_wgmma.hpp"
#include "forward_checks.cuh"
#include "tma.cuh"
#include "warp_specialized.cuh"
#include "oom/kernels/attention.hpp"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;
using attention_detail::pack_bf16;
using attention_detail::smem_addr;

constexpr int kD = 128;             // head_dim
constexpr int kWarpgroups = 2;      // consumer warpgroups per block
constexpr int kBr = 64 * kWarpgroups;  // query rows per block: 64 (one wgmma M) per warpgroup
constexpr int kBc = 128;            // keys per K/V tile: the N of S = Q K^T, the K of P V
constexpr int kThreads = 128 * kWarpgroups;

constexpr std::uint32_t kCoreBytes = 128;                 // one core matrix, and the column-block stride
constexpr std::uint32_t kBandBytes = (kD / 8) * kCoreBytes;  // one 8-row band of a 128-column tile: 2048

// Descriptor strides (bytes), see the top of the file.
constexpr std::uint32_t kQkLbo = kCoreBytes;  // K-major Q, K: next core matrix along d
constexpr std::uint32_t kQkSbo = kBandBytes;  // K-major Q, K: next 8 rows
constexpr std::uint32_t kVLbo = kBandBytes;   // MN-major V: next 8 keys (the K of P V)
constexpr std::uint32_t kVSbo = kCoreBytes;   // MN-major V: next 8 d (the N of P V)
constexpr std::uint32_t kQkStep = 2 * kQkLbo;  // one k-step of 16 d = 2 core matrices along d
constexpr std::uint32_t kVStep = 2 * kVLbo;    // one k-step of 16 keys = 2 bands

// The chunk-major K and V tiles of Wgmma2wgSchedule::producer_tma (one TMA box {8, 128, 16, 1, 1}
// each, tma.cuh): element (key r, column c) at byte (c/8) kChunkBytes + r 16 + (c%8) 2, with
// kChunkBytes = 128 keys x 16 bytes = 2048 (one 16-byte column chunk of all 128 keys). The 8 keys
// r = 8i .. 8i+7 of chunk c/8 are 128 contiguous bytes, key rows 16 bytes apart: a core matrix at
// (c/8) 2048 + i 128. The same bytes as the band layout's offsets with the roles of the two
// numbers exchanged: along the columns (d) core matrices are now 2048 apart (were 128), along the
// keys 128 apart (were 2048). With the meanings of wgmma.cuh (no swizzle, K-major and MN-major
// alike: LBO = the byte distance between core matrices adjacent along the MMA's K dimension, SBO =
// along its M/N dimension), which give kQkLbo = 128 / kQkSbo = 2048 and kVLbo = 2048 / kVSbo = 128
// for the band layout above:
//   K, B of S = Q K^T, K-major: the MMA's K is d (columns), its N the keys (rows). Core matrix = 8
//     keys (its rows, 16 bytes apart) x 8 consecutive d (one 16-byte row), as K-major requires.
//     LBO = next 8 d = next chunk = 2048; SBO = next 8 keys = 128; one k-step of 16 d = 2 chunks
//     = 2 LBO = 4096 bytes. (test_wgmma's "k_slabs" placement, K-major B at N = 128: LBO 16 N =
//     2048, SBO 128.)
//   V, B of O += P V, MN-major: the MMA's K is the keys (rows), its N is d (columns). Core matrix
//     = 8 keys (its rows, 16 bytes apart) x 8 consecutive d (one row), as MN-major requires (8 K
//     rows of 8 contiguous N values). LBO = next 8 keys = 128; SBO = next 8 d = next chunk = 2048;
//     one k-step of 16 keys = 2 LBO = 256 bytes. (test_wgmma's "mn_rows" placement, MN-major B at
//     K = 128: LBO 128, SBO 16 K = 2048.)
// Both are the band layout's strides swapped, and each k-step is still 2 x LBO.
constexpr std::uint32_t kChunkBytes = kBc * 16;  // 2048
constexpr std::uint32_t kKcLbo = kChunkBytes;    // chunk-major K (K-major): next 8 d
constexpr std::uint32_t kKcSbo = kCoreBytes;     // chunk-major K (K-major): next 8 keys
constexpr std::uint32_t kVcLbo = kCoreBytes;     // chunk-major V (MN-major): next 8 keys (the K of P V)
constexpr std::uint32_t kVcSbo = kChunkBytes;    // chunk-major V (MN-major): next 8 d (the N of P V)
constexpr std::uint32_t kKcStep = 2 * kKcLbo;    // one k-step of 16 d: 4096
constexpr std::uint32_t kVcStep = 2 * kVcLbo;    // one k-step of 16 keys: 256

// The 128-byte-swizzled tiles of producer_sw128 and producer_sw128_tma (Q, K and V alike; loaded by
// load_rows_sw128_producer or by TMA through swizzle128_view, tma.cuh; every tile 1024-byte
// aligned): a 128-row tile is two 64-column halves of 128 rows x 128 bytes, half h at byte
// h kSwHalf, row r at r 128 within it, its 16-byte chunk c (columns 8c .. 8c+7 of the half) at
// position c ^ (r % 8): element (r, c) at (c/64) kSwHalf + r 128 + (((c%64)/8) ^ (r%8)) 16 + (c%8) 2.
// Why: in the band layout a row's 16-byte chunks are 128 bytes apart, so every 32-byte global
// sector a warp reads lands in two shared-memory lines; ncu on producer_overlap at S = 16K (eighth
// session) counted 2x the ideal L2 sectors and 8x the ideal shared-store wavefronts for every
// cp.async, with L2 throughput at 90%. Here a row's 128 contiguous global bytes fill one 128-byte
// shared line. The descriptors (wgmma.cuh; swizzled layouts: 8-row atoms of 1024 bytes):
//   Q, K (K-major over d): k-step ks (d = 16ks .. 16ks+15) starts at half ks/4, byte 32 (ks%4) of
//     each row: start + (ks/4) kSwHalf + 32 (ks%4); SBO 1024 = next 8 rows; LBO unused (16).
//     Warpgroup w's Q rows start 64 w 128 = 8192 w bytes into each half.
//   V (MN-major: K = keys, N = d): k-step ks (keys 16ks ..) = 2 atoms of 8 keys: start + 2048 ks;
//     SBO 1024 = next 8 keys (along K); LBO kSwHalf = next 64 d (along N): the swizzled MN-major
//     layouts give LBO the MN stride and SBO the K stride, the opposite of no-swizzle.
constexpr std::uint32_t kSwHalf = kBc * 128;  // 16384: one 64-column half of a 128-row tile
static_assert(kBr * 128 == kSwHalf, "Q and K/V tiles have the same swizzled halves");
constexpr std::uint32_t kSwAtom = 1024;       // 8 rows x 128 bytes
constexpr std::uint32_t kSwWgRowBytes = 64 * 128;  // warpgroup w's Q rows start w * 8 KiB into each half

/// Where a kernel's K and V tiles live (Q is in the band layout unless sw128).
enum class KvLayout { band, chunk_major, sw128 };

constexpr int kTileBytes = kBr * kD * 2;  // 128 x 128 bf16 = 32 KiB: Q, one K, one V
static_assert(kBc == kBr, "Q, K and V tiles share one shape and one loader");
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;      // 2 buffers
constexpr int kOffV = kOffK + 2 * kTileBytes;  // 2 buffers
constexpr int kSmemBytes = kOffV + 2 * kTileBytes;
static_assert(kSmemBytes == 160 * 1024);
constexpr int kWgRowBytes = 64 / 8 * static_cast<int>(kBandBytes);  // warpgroup w's Q rows start w * 16 KiB in

using Params = attention_detail::ForwardParams;

/// Rows [row0, row0 + 128) of a strided (token_stride elements) global (rows, 128) bf16 matrix
/// into a core-matrix tile (layout at the top of the file) by cp.async, kN threads (thread `tid` of
/// them); rows >= row_end are zero-filled (nothing read for them). 16-byte chunk n = (r/8) 128 +
/// (c/8) 8 + r%8 of the tile is element (r, c)'s chunk at byte 16 n, so consecutive threads fill
/// consecutive bytes and each warp reads 8 rows x 64 contiguous bytes of global memory.
template <int kN>
__device__ __forceinline__ void load_tile_cores(unsigned char* tile, const __nv_bfloat16* base,
                                                std::int64_t token_stride, int row0, int row_end, int tid) {
  static_assert(kBr * (kD / 8) % kN == 0);
#pragma unroll
  for (int i = 0; i < kBr * (kD / 8) / kN; ++i) {
    const int n = i * kN + tid;
    const int r = (n >> 7) * 8 + (n & 7);
    const int c = ((n >> 3) & 15) * 8;
    const bool valid = row0 + r < row_end;
    const __nv_bfloat16* src = valid ? base + static_cast<std::int64_t>(row0 + r) * token_stride + c : base;
    cp_async_16(tile + 16 * n, src, valid);
  }
}
/// The two-warpgroup kernels' form: all 256 threads.
__device__ __forceinline__ void load_tile_cores(unsigned char* tile, const __nv_bfloat16* base,
                                                std::int64_t token_stride, int row0, int row_end) {
  load_tile_cores<kThreads>(tile, base, token_stride, row0, row_end, static_cast<int>(threadIdx.x));
}

/// One warpgroup's share of a block: its thread's place in the fragments and its running state.
/// Accumulator fragments (wgmma.cuh): warp w of the warpgroup, lane l holds rows r0 = 16w + l/4
/// (hf = 0) and r0 + 8 (hf = 1) of the warpgroup's 64; of 8-column block j, columns
/// 8j + 2(l%4) + {0, 1} in acc[4j + 2hf], acc[4j + 2hf + 1].
struct WarpgroupState {
  float o[kD / 2];                 // O, 64 x 128 per warpgroup
  float s[kBc / 2];                // S, then exp(S - m), 64 x 128 per warpgroup
  std::uint32_t pa[kBc / 16][4];   // P as the RS A operand, one k-step of 16 keys per row
  float m_run[2];                  // running row max, log2 units
  float l_run[2];                  // running row sum, this lane's columns only
};

/// A warpgroup's state before its first K/V tile: O, S and P zero, no row maximum yet (-inf), row
/// sums zero.
__device__ __forceinline__ void start(WarpgroupState& st) {
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) st.o[e] = 0.0f;
#pragma unroll
  for (int e = 0; e < kBc / 2; ++e) st.s[e] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks)
#pragma unroll
    for (int x = 0; x < 4; ++x) st.pa[ks][x] = 0u;
  st.m_run[0] = st.m_run[1] = -INFINITY;
  st.l_run[0] = st.l_run[1] = 0.0f;
}

/// Keeps every register a wgmma reads or writes materialised at this point: before a wgmma_fence
/// (their last writes happen before it) and after a wgmma_wait_group (no use of them, and no reuse
/// of their registers for other values, moves before the wait: the RS form reads `pa` and both
/// forms write their accumulators asynchronously).
__device__ __forceinline__ void fence_all(WarpgroupState& st) {
  wgmma_fence_operands(st.o);
  wgmma_fence_operands(st.s);
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks) wgmma_fence_operands(st.pa[ks]);
}

/// S = Q_wg K^T: A = the warpgroup's 64 Q rows, B = K (128 keys x 128 d), both K-major over d;
/// 8 wgmma m64n128k16 SS, not committed. kLayout: K in the band layout (kQk*), the chunk-major
/// layout of producer_tma (kKc*; Q still band), or Q and K both 128-byte swizzled (kSw*). The same
/// products in the same order in every case.
template <KvLayout kLayout = KvLayout::band>
__device__ __forceinline__ void issue_s(WarpgroupState& st, std::uint32_t a_q, std::uint32_t a_kbuf) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    if constexpr (kLayout == KvLayout::sw128) {
      const std::uint32_t at = (ks / 4) * kSwHalf + (ks % 4) * 32;
      wgmma_m64n128k16_f32_bf16_ss(st.s, encode_smem_desc(a_q + at, 16, kSwAtom, Swizzle::b128),
                                   encode_smem_desc(a_kbuf + at, 16, kSwAtom, Swizzle::b128), ks > 0 ? 1 : 0);
    } else {
      constexpr bool kChunk = kLayout == KvLayout::chunk_major;
      constexpr std::uint32_t kStep = kChunk ? kKcStep : kQkStep;
      constexpr std::uint32_t kLbo = kChunk ? kKcLbo : kQkLbo;
      constexpr std::uint32_t kSbo = kChunk ? kKcSbo : kQkSbo;
      wgmma_m64n128k16_f32_bf16_ss(st.s, encode_smem_desc(a_q + ks * kQkStep, kQkLbo, kQkSbo),
                                   encode_smem_desc(a_kbuf + ks * kStep, kLbo, kSbo), ks > 0 ? 1 : 0);
    }
  }
}

/// O += P V: A = P (registers, 64 x 128 keys), B = V (128 keys x 128 d) MN-major; 8 wgmma
/// m64n128k16 RS, not committed. `pa` must stay untouched until they complete. kLayout: V in the
/// band (kV*), chunk-major (kVc*) or swizzled (kSw*) layout.
template <KvLayout kLayout = KvLayout::band>
__device__ __forceinline__ void issue_pv(WarpgroupState& st, std::uint32_t a_vbuf) {
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks) {
    if constexpr (kLayout == KvLayout::sw128) {
      wgmma_m64n128k16_f32_bf16_rs<Major::mn>(
          st.o, st.pa[ks], encode_smem_desc(a_vbuf + ks * 2 * kSwAtom, kSwHalf, kSwAtom, Swizzle::b128), 1);
    } else {
      constexpr bool kChunk = kLayout == KvLayout::chunk_major;
      constexpr std::uint32_t kStep = kChunk ? kVcStep : kVStep;
      constexpr std::uint32_t kLbo = kChunk ? kVcLbo : kVLbo;
      constexpr std::uint32_t kSbo = kChunk ? kVcSbo : kVSbo;
      wgmma_m64n128k16_f32_bf16_rs<Major::mn>(st.o, st.pa[ks], encode_smem_desc(a_vbuf + ks * kStep, kLbo, kSbo), 1);
    }
  }
}

/// Causal mask of the S tile at keys n0.. (key > query) where it crosses the diagonal of one of the
/// warpgroup's rows, then the online softmax statistics and P = exp(S - m') in place (fp32):
/// m' = max(m, rowmax S), l' = e^(m - m') l + rowsum P, in log2 units (scale * log2 e folded into
/// one FMA). Returns alpha = e^(m - m') per row half in `alpha`; O is not touched (it may still be
/// an in-flight accumulator).
__device__ __forceinline__ void softmax_tile(WarpgroupState& st, float (&alpha)[2], int n0, int wg_row0, int r0,
                                             int c0, float scale_log2) {
  forward_steps::softmax<kBc>(st.s, st.m_run, st.l_run, alpha, n0, wg_row0, r0, c0, scale_log2);
}

/// O *= alpha per row, and P (in s) rounded to bf16 into the RS A fragments: k-step ks covers keys
/// 16ks .. 16ks+15 = column blocks 2ks, 2ks+1 of the fragment; pa[ks][0] = (row r0, block 2ks),
/// [1] = (row r0+8, block 2ks), [2] = (row r0, block 2ks+1), [3] = (row r0+8, block 2ks+1), the
/// lower column in the low half (wgmma.cuh). Only once no wgmma reading `pa` or writing `o` is in
/// flight.
__device__ __forceinline__ void rescale_and_pack(WarpgroupState& st, const float (&alpha)[2]) {
  forward_steps::rescale<kD>(st.o, alpha);
  forward_steps::pack_p<kBc>(st.pa, st.s);
}

/// O = O / l (bf16) and LSE = (m + log2 l) ln 2 of the thread's two rows i0 and i0 + 8 (absolute
/// query rows) where they are valid (< q_end); c0 = 2 (lane % 4), the thread's first column.
__device__ __forceinline__ void store_output(const WarpgroupState& st, const Params& p, int b, int h, int i0, int c0,
                                             int lane) {
  forward_steps::store<kD>(st.o, st.m_run, st.l_run, p, b, h, i0, c0, lane);
}

/// The two schedules of a warpgroup's GEMMs (docs/hopper.md):
///   serial:          per tile j: S_j, wait, softmax, O += P_j V_j, wait;
///   overlap_softmax: per tile j: S_j and O += P_{j-1} V_{j-1} issued together, wait for S_j only,
///                    softmax of S_j while the P V wgmmas run, then wait for them, rescale O and
///                    pack P_j; the last P V after the loop. V_j then loads one tile after K_j.
template <bool kOverlapSoftmax>
__global__ void __launch_bounds__(kThreads, 1) attention_forward_wgmma_2wg_kernel(const Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* s_q = smem + kOffQ;
  unsigned char* s_k = smem + kOffK;
  unsigned char* s_v = smem + kOffV;

  // Heaviest (last, longest-prefix) query tiles first.
  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kBr;
  const int q_last = min(q0 + kBr, p.q_end) - 1;  // last valid query row of the block
  const int n_kv = q_last / kBc + 1;               // key tiles 0 .. the one holding q_last

  const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD;
  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;

  load_tile_cores(s_q, q_g, p.q_token, q0, p.q_end);
  load_tile_cores(s_k, k_g, p.k_token, 0, p.seq);
  if constexpr (!kOverlapSoftmax) load_tile_cores(s_v, v_g, p.v_token, 0, p.seq);
  cp_async_commit();

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int r0 = 16 * warp + (lane >> 2);
  const int c0 = 2 * (lane & 3);
  const int wg_row0 = q0 + 64 * wg;  // the warpgroup's first query row

  const std::uint32_t a_q = smem_addr(s_q) + static_cast<std::uint32_t>(wg * kWgRowBytes);
  const std::uint32_t a_k = smem_addr(s_k), a_v = smem_addr(s_v);
  const auto k_buf = [&](int j) { return a_k + static_cast<std::uint32_t>((j & 1) * kTileBytes); };
  const auto v_buf = [&](int j) { return a_v + static_cast<std::uint32_t>((j & 1) * kTileBytes); };

  WarpgroupState st;
  start(st);
  float alpha[2];

  for (int nb = 0; nb < n_kv; ++nb) {
    // Every tile loaded so far has landed for everyone, and both warpgroups are done with the
    // wgmmas of the previous iteration (the last readers of the buffers loaded next).
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's cp.async writes before the wgmmas read them
    __syncthreads();
    if constexpr (kOverlapSoftmax) {
      // K_{nb+1} into the buffer S_{nb-1} read, V_nb into the one P_{nb-2} V_{nb-2} read.
      if (nb + 1 < n_kv) load_tile_cores(s_k + ((nb + 1) & 1) * kTileBytes, k_g, p.k_token, (nb + 1) * kBc, p.seq);
      load_tile_cores(s_v + (nb & 1) * kTileBytes, v_g, p.v_token, nb * kBc, p.seq);
    } else if (nb + 1 < n_kv) {
      load_tile_cores(s_k + ((nb + 1) & 1) * kTileBytes, k_g, p.k_token, (nb + 1) * kBc, p.seq);
      load_tile_cores(s_v + ((nb + 1) & 1) * kTileBytes, v_g, p.v_token, (nb + 1) * kBc, p.seq);
    }
    cp_async_commit();

    fence_all(st);
    wgmma_fence();  // s, o and pa were written by the previous iteration
    issue_s(st, a_q, k_buf(nb));
    wgmma_commit_group();
    if constexpr (kOverlapSoftmax) {
      if (nb > 0) {
        // ptxas otherwise injects this arrive itself (C7519): the branch hides that nothing
        // touched o and pa since the fence above. It orders register accesses only; the S
        // wgmmas keep running.
        wgmma_fence();
        issue_pv(st, v_buf(nb - 1));  // O += P_{nb-1} V_{nb-1}, pa and o as left by the previous iteration
        wgmma_commit_group();
        wgmma_wait_group<1>();  // S_nb done (groups complete in order); P V may still run
      } else {
        wgmma_wait_group<0>();
      }
      wgmma_fence_operands(st.s);
      softmax_tile(st, alpha, nb * kBc, wg_row0, r0, c0, p.scale_log2);
      wgmma_wait_group<0>();
      fence_all(st);  // o and pa are free from here on
      rescale_and_pack(st, alpha);
    } else {
      wgmma_wait_group<0>();
      wgmma_fence_operands(st.s);
      softmax_tile(st, alpha, nb * kBc, wg_row0, r0, c0, p.scale_log2);
      rescale_and_pack(st, alpha);
      fence_all(st);
      wgmma_fence();  // o rescaled, pa written
      issue_pv(st, v_buf(nb));
      wgmma_commit_group();
      wgmma_wait_group<0>();
      fence_all(st);
    }
  }
  if constexpr (kOverlapSoftmax) {
    // The last O += P V: V_{n_kv-1} was loaded in the last iteration.
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    fence_all(st);
    wgmma_fence();
    issue_pv(st, v_buf(n_kv - 1));
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_all(st);
  }

  store_output(st, p, b, h, wg_row0 + r0, c0, lane);
#else
  (void)p;
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// The warp-specialised kernel (Wgmma2wgSchedule::producer_overlap, producer_pingpong,
// producer_tma, producer_3stage): a third, producer warpgroup issues every load (cp.async, or
// producer_tma's TMA); the two consumer warpgroups only wait on mbarriers.

constexpr int kConsumerThreads = kWsConsumerThreads;  // warpgroups 0 and 1 (warp_specialized.cuh)
static_assert(kConsumerThreads == kThreads);
constexpr int kProducerThreads = kWsProducerThreads;  // warpgroup 2
constexpr int kMaxSmemPerBlock = 232448;  // sm_90's opt-in dynamic shared memory per block (227 KiB)

/// The warp-specialised kernel's shared memory with kStages K buffers and kStages V buffers (each
/// in flight at once): Q at 0, then the K tiles, then the V tiles, then the mbarriers (8 bytes
/// each: full_q, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages]).
/// 2 stages: 160 KiB + 72 bytes; 3 stages: 224 KiB + 104 bytes (229480 of 232448).
template <int kStages>
struct WsLayout {
  static_assert(kStages >= 2);
  static constexpr int kOffK = kTileBytes;
  static constexpr int kOffV = kOffK + kStages * kTileBytes;
  static constexpr int kOffBar = kOffV + kStages * kTileBytes;
  static constexpr int kBars = 1 + 4 * kStages;
  static constexpr int kSmemBytes = kOffBar + 8 * kBars;
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "over the sm_90 shared memory per block");
};
static_assert(WsLayout<2>::kSmemBytes == 160 * 1024 + 72);
static_assert(WsLayout<3>::kSmemBytes == 224 * 1024 + 104);
// setmaxnreg (producer 24, consumers 240), the mbarrier helpers: warp_specialized.cuh.
// Named barriers (bar.sync / bar.arrive ids; 0 is __syncthreads): "warpgroup w may issue".
constexpr int kBarTurn0 = 1;

/// Named barriers with immediate ids (so ptxas knows which ones the kernel uses), 256 threads:
/// warpgroup w's turn is barrier kBarTurn0 + w.
__device__ __forceinline__ void turn_sync(int wg) {
  if (wg == 0)
    asm volatile("bar.sync %0, 256;\n" ::"n"(kBarTurn0) : "memory");
  else
    asm volatile("bar.sync %0, 256;\n" ::"n"(kBarTurn0 + 1) : "memory");
}
__device__ __forceinline__ void turn_arrive(int wg) {
  if (wg == 0)
    asm volatile("bar.arrive %0, 256;\n" ::"n"(kBarTurn0) : "memory");
  else
    asm volatile("bar.arrive %0, 256;\n" ::"n"(kBarTurn0 + 1) : "memory");
}
/// Warp-specialised: warpgroup 2 loads (Q, then K_0, then per tile j: K_{j+1}, V_j, the order the
/// consumers need them in), each tile completing a "full" mbarrier through cp.async's own arrival;
/// warpgroups 0 and 1 compute as overlap_softmax does and free each buffer with an arrival on its
/// "empty" mbarrier (K_j once S_j is done, V_j once P_j V_j is). No block-wide barrier after the
/// set-up. With kPingpong the two consumer warpgroups also take turns issuing their wgmmas (named
/// barriers), so one's softmax runs while the other's GEMMs do (FlashAttention-3's ping-pong).
/// With kTma (Wgmma2wgSchedule::producer_tma) one producer thread loads each K and V tile with one
/// TMA instruction (tma.cuh; tmap_k, tmap_v: the chunk-major views of K and V, boxes of kBc keys)
/// into the chunk-major layout (kKc*, kVc* above), completing the tile's "full" mbarrier by its
/// byte count (init count 1: the thread's arrive.expect_tx); rows >= seq come in as zeros from
/// TMA's out-of-bound fill, as the cp.async path zero-fills them. Q is still loaded by the 128
/// producer threads' cp.async, in the band layout. The consumers issue the same wgmmas on the same
/// values with the other descriptors: the same bits as producer_overlap. Without kTma the two maps
/// are not read.
/// kStages (WsLayout): K tiles, and V tiles, in flight; 2 for producer_overlap, producer_pingpong
/// and producer_tma, 3 for producer_3stage, producer_sw128 and producer_sw128_tma.
/// kSw128 (producer_sw128, and with kTma producer_sw128_tma): Q, K and V in the 128-byte-swizzled
/// layout (kSw* above), loaded by load_rows_sw128_producer or, for K and V with kTma, by TMA through
/// swizzle128_view maps; the shared memory used starts at the first 1024-byte boundary of the
/// dynamic allocation (launch_ws adds the 1 KiB this may take).
template <bool kPingpong, bool kTma, int kStages, bool kSw128 = false>
__global__ void __launch_bounds__(kWsThreads, 1)
    attention_forward_wgmma_ws_kernel(const Params p, const __grid_constant__ CUtensorMap tmap_k,
                                      const __grid_constant__ CUtensorMap tmap_v) {
#if OOM_WGMMA_SM90A
  using Layout = WsLayout<kStages>;
  constexpr KvLayout kLayout = kSw128 ? KvLayout::sw128 : kTma ? KvLayout::chunk_major : KvLayout::band;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: no alignment assumed below
  // The swizzle pattern is taken from address bits 7-9: the tiles must start on 1024-byte boundaries.
  unsigned char* smem = kSw128 ? smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u) : smem_raw;
  unsigned char* s_q = smem;
  unsigned char* s_k = smem + Layout::kOffK;
  unsigned char* s_v = smem + Layout::kOffV;

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // heaviest query tiles first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kBr;
  const int q_last = min(q0 + kBr, p.q_end) - 1;
  const int n_kv = q_last / kBc + 1;

  // Barrier j of each kind for tile j, stage j % kStages, phase j / kStages.
  //
  // The phases, for any kStages >= 2 (power of two or not, e.g. 3): tile t occupies stage
  // t % kStages, whose earlier occupants are the tiles t - kStages, t - 2 kStages, ..., so t is its
  // (t / kStages)-th occupant (counting from 0): its load completes that stage's "full" barrier
  // for the (t / kStages)-th time (phase t / kStages, waited for with parity (t / kStages) & 1),
  // and its release completes the stage's "empty" barrier for the (t / kStages)-th time. Loading
  // t (t >= kStages) waits for the release of occupant t / kStages - 1 of its stage (tile
  // t - kStages), i.e. parity (t / kStages - 1) & 1, written (t / kStages + 1) & 1. Nothing here
  // needs kStages to be a power of two: only the division and remainder, not a mask.
  // A parity wait cannot tell completion c from completion c - 2 or c + 2, so it is right only if,
  // when it starts, the barrier has completed c or c + 1 times (0-based: phases 0 .. c-1 or
  // 0 .. c done). Both bounds hold for every wait here:
  //   - "full" of tile t's stage, awaited by the consumers for completion c = t / kStages: it
  //     cannot complete again (c + 1) before they release t, since the next occupant
  //     t + kStages is loaded only after every consumer thread arrived on "empty" for t; and it
  //     has completed at least c times, as the consumers' previous wait on it (tile t - kStages)
  //     saw completion c - 1 (for t < kStages: c = 0, nothing to have completed);
  //   - "empty" of tile t's stage, awaited by the producer for completion c = t / kStages - 1 (the
  //     release of t - kStages): completion c + 1 is the release of t itself, which needs t loaded,
  //     which the producer does only after this wait; and the producer's previous wait on it
  //     (loading t - kStages) saw completion c - 1 (for t < 2 kStages: c = 0).
  // sv = (nb + kStages - 1) % kStages is (nb - 1) mod kStages without a negative operand (used only
  // for nb >= 1; the V of tile nb - 1, phase (nb - 1) / kStages).
  // Deadlock-free: the producer issues K_0, then per j: K_{j+1}, V_j. Loading K_{j+1} waits for
  // the release of K_{j+1-kStages} (consumer iteration j+1-kStages, which needs only K_{j+1-kStages}
  // and V_{j-kStages}, both issued before); loading V_j waits for the release of V_{j-kStages}
  // (consumer iteration j-kStages+1, which needs K_{j-kStages+1} and V_{j-kStages}, both issued
  // before). So every wait of either side is on something the other side reaches without waiting
  // for it in turn; more stages only loosen these waits (the producer runs further ahead).
  const std::uint32_t bars = smem_addr(smem + Layout::kOffBar);
  const std::uint32_t full_q = bars;
  const auto full_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + s)); };
  const auto full_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + kStages + s)); };
  const auto empty_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 2 * kStages + s)); };
  const auto empty_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 3 * kStages + s)); };
  // A K or V tile's "full" phase: 128 cp.async arrivals, or (kTma) one arrive.expect_tx plus the
  // tile's bytes.
  constexpr std::uint32_t kFullKvCount = kTma ? 1u : static_cast<std::uint32_t>(kProducerThreads);
  if (threadIdx.x == 0) {
    mbar_init(full_q, kProducerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), kFullKvCount);
      mbar_init(full_v(s), kFullKvCount);
      mbar_init(empty_k(s), kConsumerThreads);
      mbar_init(empty_v(s), kConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == kWarpgroups) {
    // Producer. Loading tile t into stage t % kStages first waits until its previous occupant,
    // tile t - kStages, is freed: completion number t / kStages - 1 of the empty barrier, i.e.
    // the phase of parity (t / kStages + 1) & 1.
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kConsumerThreads;
    const std::uint32_t a_q0 = smem_addr(s_q), a_k0 = smem_addr(s_k), a_v0 = smem_addr(s_v);
    const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD;
    const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
    const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
    if constexpr (kSw128)
      load_rows_sw128_producer<kBr>(a_q0, q_g, p.q_token, q0, p.q_end, tid);
    else
      load_rows_producer<kBr>(a_q0, q_g, p.q_token, q0, p.q_end, tid);
    cp_async_mbar_arrive(full_q);
    if constexpr (kTma) {
      // One thread issues every K/V load, in the same order and with the same empty-barrier waits
      // as the cp.async path below; the other 127 are done once their Q cp.async have landed.
      // K and V always end at row seq (the only row_end the K/V loads use), which is the extent
      // of the maps' token dimension: TMA zero-fills the rows past it.
      if (tid == 0) {
        tma_prefetch_map(&tmap_k);
        tma_prefetch_map(&tmap_v);
        tma_load_rows<kBc>(a_k0, &tmap_k, full_k(0), 0, hk, b);
        for (int j = 0; j < n_kv; ++j) {
          if (const int t = j + 1; t < n_kv) {
            const int st = t % kStages;
            if (t >= kStages) mbar_wait(empty_k(st), static_cast<std::uint32_t>((t / kStages + 1) & 1));
            tma_load_rows<kBc>(a_k0 + static_cast<std::uint32_t>(st * kTileBytes), &tmap_k, full_k(st),
                                           t * kBc, hk, b);
          }
          const int st = j % kStages;
          if (j >= kStages) mbar_wait(empty_v(st), static_cast<std::uint32_t>((j / kStages + 1) & 1));
          tma_load_rows<kBc>(a_v0 + static_cast<std::uint32_t>(st * kTileBytes), &tmap_v, full_v(st),
                                         j * kBc, hk, b);
        }
      }
      asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's Q chunks landed
      return;
    }
    const auto load_kv = [&](std::uint32_t tile, const __nv_bfloat16* g, std::int64_t token, int row0) {
      if constexpr (kSw128)
        load_rows_sw128_producer<kBc>(tile, g, token, row0, p.seq, tid);
      else
        load_rows_producer<kBc>(tile, g, token, row0, p.seq, tid);
    };
    load_kv(a_k0, k_g, p.k_token, 0);
    cp_async_mbar_arrive(full_k(0));
    for (int j = 0; j < n_kv; ++j) {
      if (const int t = j + 1; t < n_kv) {
        const int st = t % kStages;
        if (t >= kStages) mbar_wait(empty_k(st), static_cast<std::uint32_t>((t / kStages + 1) & 1));
        load_kv(a_k0 + static_cast<std::uint32_t>(st * kTileBytes), k_g, p.k_token, t * kBc);
        cp_async_mbar_arrive(full_k(st));
      }
      const int st = j % kStages;
      if (j >= kStages) mbar_wait(empty_v(st), static_cast<std::uint32_t>((j / kStages + 1) & 1));
      load_kv(a_v0 + static_cast<std::uint32_t>(st * kTileBytes), v_g, p.v_token, j * kBc);
      cp_async_mbar_arrive(full_v(st));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
    return;
  }

  // Consumers: warpgroup wg owns query rows 64 wg .. 64 wg + 63 of the block.
  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int r0 = 16 * warp + (lane >> 2);
  const int c0 = 2 * (lane & 3);
  const int wg_row0 = q0 + 64 * wg;
  const std::uint32_t a_q = smem_addr(s_q) + static_cast<std::uint32_t>(wg * (kSw128 ? kSwWgRowBytes : kWgRowBytes));
  const std::uint32_t a_k = smem_addr(s_k), a_v = smem_addr(s_v);

  WarpgroupState st;
  start(st);
  float alpha[2];

  mbar_wait(full_q, 0);
  // kTma: Q is the only tile written by cp.async (here as everywhere treated as a generic-proxy
  // write, as the cp.async path's per-tile fence below does); the TMA-written K/V tiles need no
  // proxy fence (async proxy writes, completion observed through the mbarrier, read by the async
  // proxy: the pattern of CUTLASS's TMA pipelines, which fence nothing there).
  if constexpr (kTma) fence_proxy_async_shared();
  // Ping-pong: warpgroup w issues its wgmmas of tile nb after passing barrier kBarTurn0 + w (128
  // of its threads syncing + 128 of the other's arriving) and then lets the other one go. Warpgroup
  // 1 opens warpgroup 0's first turn; every turn after that is opened by the other warpgroup's
  // issue, and warpgroup 1 skips its last arrive, so each barrier sees exactly n_kv syncs and n_kv
  // arrivals and none is left half-complete at exit.
  if (kPingpong && wg == 1) turn_arrive(0);

  for (int nb = 0; nb < n_kv; ++nb) {
    const int sk = nb % kStages, sv = (nb + kStages - 1) % kStages;  // K_nb's stage, V_{nb-1}'s
    mbar_wait(full_k(sk), static_cast<std::uint32_t>((nb / kStages) & 1));
    if (nb > 0) mbar_wait(full_v(sv), static_cast<std::uint32_t>(((nb - 1) / kStages) & 1));
    // The tiles' cp.async writes, observed through the mbarriers, before the wgmmas (async proxy)
    // read them (kTma: nothing to fence, see above).
    if constexpr (!kTma) fence_proxy_async_shared();
    if constexpr (kPingpong) turn_sync(wg);

    fence_all(st);
    wgmma_fence();
    issue_s<kLayout>(st, a_q, a_k + static_cast<std::uint32_t>(sk * kTileBytes));
    wgmma_commit_group();
    if (nb > 0) {
      wgmma_fence();  // as in the overlap_softmax kernel (C7519)
      issue_pv<kLayout>(st, a_v + static_cast<std::uint32_t>(sv * kTileBytes));  // O += P_{nb-1} V_{nb-1}
      wgmma_commit_group();
      if constexpr (kPingpong)
        if (wg == 0 || nb + 1 < n_kv) turn_arrive(wg ^ 1);
      wgmma_wait_group<1>();  // S_nb done
    } else {
      if constexpr (kPingpong)
        if (wg == 0 || nb + 1 < n_kv) turn_arrive(wg ^ 1);
      wgmma_wait_group<0>();
    }
    mbar_arrive(empty_k(sk));  // K_nb read
    wgmma_fence_operands(st.s);
    softmax_tile(st, alpha, nb * kBc, wg_row0, r0, c0, p.scale_log2);
    wgmma_wait_group<0>();
    fence_all(st);  // o and pa are free from here on
    if (nb > 0) mbar_arrive(empty_v(sv));  // V_{nb-1} read
    rescale_and_pack(st, alpha);
  }
  {
    // The last O += P V.
    const int sv = (n_kv - 1) % kStages;
    mbar_wait(full_v(sv), static_cast<std::uint32_t>(((n_kv - 1) / kStages) & 1));
    if constexpr (!kTma) fence_proxy_async_shared();
    fence_all(st);
    wgmma_fence();
    issue_pv<kLayout>(st, a_v + static_cast<std::uint32_t>(sv * kTileBytes));
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_all(st);
  }
  store_output(st, p, b, h, wg_row0 + r0, c0, lane);
#else
  (void)p;
  (void)tmap_k;
  (void)tmap_v;
  __trap();
#endif
}

/// Launches attention_forward_wgmma_ws_kernel<kPingpong, kTma, kStages> with its own shared
/// memory size (WsLayout<kStages>), raising the function's dynamic shared memory limit to it first.
template <bool kPingpong, bool kTma, int kStages, bool kSw128 = false>
cudaError_t launch_ws(dim3 grid, const Params& params, const CUtensorMap& tmap_k, const CUtensorMap& tmap_v,
                      cudaStream_t stream) {
  constexpr int kBytes = WsLayout<kStages>::kSmemBytes + (kSw128 ? 1024 : 0);  // room to align to 1 KiB
  static_assert(kBytes <= kMaxSmemPerBlock, "over the sm_90 shared memory per block");
  auto* kernel = attention_forward_wgmma_ws_kernel<kPingpong, kTma, kStages, kSw128>;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
      e != cudaSuccess)
    return e;
  kernel<<<grid, kWsThreads, kBytes, stream>>>(params, tmap_k, tmap_v);
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_forward_wgmma_2wg(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream,
                                        Wgmma2wgSchedule schedule) {
  bool empty = false;
  if (const cudaError_t e = forward_checks(p, kD, q, k, v, o, lse, &empty); e != cudaSuccess || empty) return e;

  const Params params = attention_detail::forward_params(p, q, k, v, o, lse);

  const int q_tiles = (params.q_end - params.q_begin + kBr - 1) / kBr;
  const dim3 grid(static_cast<unsigned>(q_tiles), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  if (schedule == Wgmma2wgSchedule::producer_tma || schedule == Wgmma2wgSchedule::producer_sw128_tma) {
    // The TMA views of K and V (tma.cuh): chunk-major for producer_tma, 128-byte swizzled for
    // producer_sw128_tma. forward_checks has established what TMA needs of them in every case
    // that matters: aligned_rows = data 16-byte aligned and both strides multiples of 8 elements
    // (16 bytes); head offsets (256 bytes) and the 16-byte chunks are multiples of 16 by
    // construction. What it does not exclude is a stride TMA cannot express: zero or negative
    // (where its dimension has more than one entry) or 2^40 bytes and over. Such tensors run the
    // same schedule's cp.async kernel instead (producer_overlap, producer_sw128): the same bits by
    // construction, so the TMA schedules accept exactly what the cp.async ones accept.
    const bool sw = schedule == Wgmma2wgSchedule::producer_sw128_tma;
    const auto view = sw ? swizzle128_view : chunk_major_view;
    ChunkMajorView kview{}, vview{};
    if (view(&kview, k.data, p.batch, p.seq, p.heads_kv, k.batch_stride, k.token_stride, kBc) &&
        view(&vview, v.data, p.batch, p.seq, p.heads_kv, v.batch_stride, v.token_stride, kBc)) {
      CUtensorMap tmap_k{}, tmap_v{};
      if (const cudaError_t e = encode_view(&tmap_k, kview, k.data); e != cudaSuccess) return e;
      if (const cudaError_t e = encode_view(&tmap_v, vview, v.data); e != cudaSuccess) return e;
      return sw ? launch_ws<false, true, 3, true>(grid, params, tmap_k, tmap_v, stream)
                : launch_ws<false, true, 2>(grid, params, tmap_k, tmap_v, stream);
    }
    schedule = sw ? Wgmma2wgSchedule::producer_sw128 : Wgmma2wgSchedule::producer_overlap;
  }
  const CUtensorMap unused{};  // the cp.async kernels read no tensor map
  if (schedule == Wgmma2wgSchedule::producer_overlap) return launch_ws<false, false, 2>(grid, params, unused, unused, stream);
  if (schedule == Wgmma2wgSchedule::producer_pingpong) return launch_ws<true, false, 2>(grid, params, unused, unused, stream);
  if (schedule == Wgmma2wgSchedule::producer_3stage) return launch_ws<false, false, 3>(grid, params, unused, unused, stream);
  if (schedule == Wgmma2wgSchedule::producer_sw128)
    return launch_ws<false, false, 3, true>(grid, params, unused, unused, stream);
  auto* kernel = schedule == Wgmma2wgSchedule::overlap_softmax ? attention_forward_wgmma_2wg_kernel<true>
                                                                : attention_forward_wgmma_2wg_kernel<false>;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess)
    return e;
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace oom::kernels::hopper
