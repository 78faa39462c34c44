// Causal GQA flash-attention forwards on Hopper wgmma, head_dim 128 and 256
// (hopper::attention_forward_wgmma, hopper::attention_forward_wgmma_d256): what
// oom::kernels::attention_forward runs on compute capability 9.0, same arguments and results as
// the mma.sync kernel (attention_forward.cu). One kernel template over the head dim (FwdTiles
// below); docs/hopper.md says what is verified and what was measured.
//
// The structure, and why (H200 measurements, docs/hopper.md):
//   - one block = a 128-row query tile for two consumer warpgroups (warpgroup w owns rows
//     64w .. 64w+63) that share each K/V tile in shared memory, so K/V traffic per FLOP halves
//     against one warpgroup per 64 rows (a first such kernel ran at 0.8x of mma.sync);
//   - P never touches shared memory: the S accumulator fragment, exponentiated and rounded to bf16,
//     is the register A operand of O += P V (wgmma_m64n128k16_f32_bf16_rs; the RS A fragment is the
//     accumulator fragment of two adjacent 8-column blocks, wgmma.cuh);
//   - V is read by the wgmma straight from its tile as an MN-major B: no transpose pass, no staging
//     buffer. K and V tiles have the same layout; only the descriptor's meaning differs;
//   - warp-specialised, 384 threads: warpgroup 2 (the producer) issues every cp.async (Q, K_0, then
//     per tile K_{j+1}, V_j), each tile completing its stage's "full" mbarrier through
//     cp.async.mbarrier.arrive.noinc; the consumers free K_j once S_j is done and V_j once
//     P_j V_j is ("empty" mbarriers, all 256 consumer threads arrive). No block barrier in the
//     loop. setmaxnreg: producer 24, consumers 240 registers (the exact exchange from the 168 each
//     thread starts with);
//   - per tile j, a consumer warpgroup issues S_j = Q_w K_j^T and O += P_{j-1} V_{j-1} back to back
//     as two commit groups, waits for the first only, and runs the mask and softmax of S_j while
//     the P V wgmmas run (they read P_{j-1} from registers and accumulate into O, neither of which
//     the softmax touches; FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024); then it
//     waits for P V, rescales O and packs P_j; after the last tile one more O += P V;
//   - Q, K and V in the 128-byte-swizzled layout (below). The no-swizzle core-matrix layout split
//     every 32-byte global sector of a cp.async over two shared-memory lines (ncu: 2x the ideal L2
//     sectors, 8x the ideal shared-store wavefronts, L2 at 90%), which held the forward at ~2.7x
//     its tensor time; swizzled with 3 stages it ran at 1.41-1.71x the two-stage no-swizzle
//     kernel. K/V loaded by TMA into the same layout ran slower than this cp.async loader (369 /
//     531 / 535 against 405 / 605 / 558 TFLOP/s at S = 4K / 16K / 64K).
// What differs with the head dim (FwdTiles): at 128, 128-key tiles and 3 K and 3 V stages (224
// KiB + barriers of the 227 KiB a block may have, so the producer may run two tiles ahead: 1.02-
// 1.05x two stages); at 256, O alone is 128 registers a consumer thread (two m64n128
// accumulators), so the key tiles shrink to 64 (S 32 registers, P 16) and the stages to 2 (Q 64
// KiB + 2 x (K 32 + V 32) = 192 KiB). The other schedules of the same wgmmas (no producer,
// ping-pong, two stages, TMA, the no-swizzle layouts) were measured and removed (docs/hopper.md).
// Deterministic: bit-identical run to run.
// ptxas (nvcc 13.0, -O3, sm_90a): 168 registers at launch (consumers up to 240), 0 spills, no
// C7519/C7520 warning, at both head dims.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attention_common.cuh"
#include "attention_wgmma.hpp"
#include "forward_checks.cuh"
#include "warp_specialized.cuh"
#include "oom/kernels/attention.hpp"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::smem_addr;

constexpr int kWarpgroups = 2;         // consumer warpgroups per block
constexpr int kBr = 64 * kWarpgroups;  // query rows per block: 64 (one wgmma M) per warpgroup
static_assert(kWsConsumerThreads == 128 * kWarpgroups);  // warp_specialized.cuh's split: 2 + 1 warpgroups

// Q, K and V tiles are 128-byte swizzled (wgmma.cuh, sw128; loaded by load_rows_sw128_producer,
// warp_specialized.cuh): a tile of R rows is HD / 64 panels of R rows x 128 bytes, so a row's 128
// contiguous global bytes of a panel fill one 128-byte shared line. Q and K are K-major over d; V
// is the MN-major B of P V (K = keys, N = d), O's m64n128 half h reading panels 2h and 2h + 1.
constexpr std::uint32_t kSwWgRowBytes = 64 * 128;  // warpgroup w's Q rows start w * 8 KiB into each panel

/// What the head dim fixes: keys per K/V tile (the N of S = Q K^T, the K of P V), K/V stages, and
/// the shared memory: Q at 0, then kStages K tiles, then kStages V tiles, then the mbarriers (8
/// bytes each: full_q, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages]), all
/// from the first 1024-byte boundary of the dynamic allocation (the swizzle pattern is taken from
/// address bits 7-9), for which the launch adds 1 KiB.
template <int HD>
struct FwdTiles {
  static_assert(HD == 128 || HD == 256);
  static constexpr int kBc = HD == 128 ? 128 : 64;
  static constexpr int kStages = HD == 128 ? 3 : 2;
  static constexpr int kOHalves = HD / 128;                      // O as m64n128 accumulators
  static constexpr std::uint32_t kKvPanel = kBc * 128;           // one 64-column panel of a K or V tile
  static constexpr std::uint32_t kQBytes = kBr * HD * 2;
  static constexpr std::uint32_t kKvBytes = kBc * HD * 2;
  static constexpr std::uint32_t kOffK = kQBytes;
  static constexpr std::uint32_t kOffV = kOffK + kStages * kKvBytes;
  static constexpr std::uint32_t kOffBar = kOffV + kStages * kKvBytes;
  static constexpr int kBars = 1 + 4 * kStages;
  static constexpr int kSmemBytes = static_cast<int>(kOffBar) + 8 * kBars + 1024;  // + room to align to 1 KiB
  static_assert(kSmemBytes <= kMaxDynamicSmem, "over the sm_90 shared memory per block");
};
static_assert(FwdTiles<128>::kOffBar + 8 * FwdTiles<128>::kBars == 224 * 1024 + 104);
static_assert(FwdTiles<256>::kOffBar + 8 * FwdTiles<256>::kBars == 192 * 1024 + 72);

using Params = attention_detail::ForwardParams;

// The per-warpgroup steps, on the accumulator fragments (wgmma.cuh): warp w of the warpgroup,
// lane l holds rows r0 = 16w + l/4 (hf = 0) and r0 + 8 (hf = 1) of the warpgroup's 64; of 8-column
// block j, columns 8j + 2(l%4) + {0, 1} in acc[4j + 2hf], acc[4j + 2hf + 1]. O is held as HD / 128
// m64n128 accumulators o[h][64] (columns 128h ..): block j of O is o[j / 16], blocks j % 16.

/// Causal mask of an S tile of BC keys at n0.. (key > query) where it crosses the diagonal of one
/// of the warpgroup's rows, then the online softmax statistics and P = exp(S - m') in place (fp32):
/// m' = max(m, rowmax S), l' = e^(m - m') l + rowsum P, in log2 units (scale * log2 e folded into
/// one FMA). Returns alpha = e^(m - m') per row half in `alpha`; O is not touched (it may still be
/// an in-flight accumulator).
template <int BC>
__device__ __forceinline__ void softmax(float (&s)[BC / 2], float (&m_run)[2], float (&l_run)[2], float (&alpha)[2],
                                        int n0, int wg_row0, int r0, int c0, float scale_log2) {
  if (n0 + BC - 1 > wg_row0) {
#pragma unroll
    for (int j = 0; j < BC / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = wg_row0 + r0 + 8 * (e >> 1);
        const int key = n0 + 8 * j + c0 + (e & 1);
        if (key > i) s[4 * j + e] = -INFINITY;
      }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < BC / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[hf], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: avoid inf - inf
    alpha[hf] = exp2f(m_run[hf] - m_use);
    m_run[hf] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < BC / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(fmaf(s[4 * j + 2 * hf + e], scale_log2, -m_use));
        s[4 * j + 2 * hf + e] = pe;
        sum += pe;
      }
    l_run[hf] = l_run[hf] * alpha[hf] + sum;
  }
}

/// O *= alpha per row.
template <int H>
__device__ __forceinline__ void rescale(float (&o)[H][64], const float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int e = 0; e < 64; ++e) o[h][e] *= alpha[(e >> 1) & 1];
}

/// O = O / l (bf16) and LSE = (m + log2 l) ln 2 of the thread's two rows i0 and i0 + 8 (absolute
/// query rows) where they are valid (< q_end); c0 = 2 (lane % 4), the thread's first column.
template <int D>
__device__ __forceinline__ void store(const float (&o)[D / 128][64], const float (&m_run)[2], const float (&l_run)[2],
                                      const Params& p, int b, int h, int i0, int c0, int lane) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = l_run[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int i = i0 + 8 * hf;
    if (i < p.q_end) {
      __nv_bfloat16* dst =
          p.o + b * p.o_batch + static_cast<std::int64_t>(i) * p.o_token + static_cast<std::int64_t>(h) * D + c0;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
            __floats2bfloat162_rn(o[j / 16][4 * (j % 16) + 2 * hf] * inv, o[j / 16][4 * (j % 16) + 2 * hf + 1] * inv);
      if ((lane & 3) == 0)
        p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seq + i] =
            l > 0.0f ? (m_run[hf] + log2f(l)) * attention_detail::ln2 : -INFINITY;
    }
  }
}

/// One warpgroup's running state, in the fragments described above.
template <int HD>
struct WarpgroupState {
  using T = FwdTiles<HD>;
  float o[T::kOHalves][64];          // O columns 128h .. 128h+127
  float s[T::kBc / 2];               // S, then exp(S - m)
  std::uint32_t pa[T::kBc / 16][4];  // P as the RS A operand, one k-step of 16 keys per row
  float m_run[2];                    // running row max, log2 units
  float l_run[2];                    // running row sum, this lane's columns only
};

/// A warpgroup's state before its first K/V tile: O, S and P zero, no row maximum yet (-inf), row
/// sums zero.
template <int HD>
__device__ __forceinline__ void start(WarpgroupState<HD>& st) {
  using T = FwdTiles<HD>;
#pragma unroll
  for (int h = 0; h < T::kOHalves; ++h)
#pragma unroll
    for (int e = 0; e < 64; ++e) st.o[h][e] = 0.0f;
#pragma unroll
  for (int e = 0; e < T::kBc / 2; ++e) st.s[e] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < T::kBc / 16; ++ks)
#pragma unroll
    for (int x = 0; x < 4; ++x) st.pa[ks][x] = 0u;
  st.m_run[0] = st.m_run[1] = -INFINITY;
  st.l_run[0] = st.l_run[1] = 0.0f;
}

/// Keeps every register a wgmma reads or writes materialised at this point: before a wgmma_fence
/// (their last writes happen before it) and after a wgmma_wait_group (no use of them, and no reuse
/// of their registers for other values, moves before the wait: the RS form reads `pa` and both
/// forms write their accumulators asynchronously).
template <int HD>
__device__ __forceinline__ void fence_all(WarpgroupState<HD>& st) {
#pragma unroll
  for (int h = 0; h < FwdTiles<HD>::kOHalves; ++h) wgmma_fence_operands(st.o[h]);
  wgmma_fence_operands(st.s);
#pragma unroll
  for (int ks = 0; ks < FwdTiles<HD>::kBc / 16; ++ks) wgmma_fence_operands(st.pa[ks]);
}

/// S = Q_w K^T: A = the warpgroup's 64 Q rows, B = K (kBc keys x HD), both K-major over d; HD / 16
/// wgmma m64nBCk16 SS, not committed.
template <int HD>
__device__ __forceinline__ void issue_s(WarpgroupState<HD>& st, std::uint32_t a_q, std::uint32_t a_k) {
  using T = FwdTiles<HD>;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const std::uint64_t a = sw128::kmajor_desc<kBr>(a_q, ks), b = sw128::kmajor_desc<T::kBc>(a_k, ks);
    if constexpr (T::kBc == 128)
      wgmma_m64n128k16_f32_bf16_ss(st.s, a, b, ks > 0 ? 1 : 0);
    else
      wgmma_m64n64k16_f32_bf16_ss(st.s, a, b, ks > 0 ? 1 : 0);
  }
}

/// O += P V: A = P (registers, 64 x kBc keys), B = V (kBc keys x HD) MN-major; per k-step of 16
/// keys one wgmma m64n128k16 RS per half of O, not committed. `pa` must stay untouched until they
/// complete.
template <int HD>
__device__ __forceinline__ void issue_pv(WarpgroupState<HD>& st, std::uint32_t a_v) {
  using T = FwdTiles<HD>;
#pragma unroll
  for (int ks = 0; ks < T::kBc / 16; ++ks)
#pragma unroll
    for (int h = 0; h < T::kOHalves; ++h)
      wgmma_m64n128k16_f32_bf16_rs<Major::mn>(st.o[h], st.pa[ks],
                                              sw128::mnmajor_desc<T::kBc>(a_v + 2 * h * T::kKvPanel, ks), 1);
}

/// The kernel (structure at the top of the file): warpgroup 2 loads (Q, then K_0, then per tile j:
/// K_{j+1}, V_j, the order the consumers need them in), each tile completing a "full" mbarrier
/// through cp.async's own arrival; warpgroups 0 and 1 compute and free each buffer with an arrival
/// on its "empty" mbarrier (K_j once S_j is done, V_j once P_j V_j is). No block-wide barrier after
/// the set-up.
template <int HD>
__global__ void __launch_bounds__(kWsThreads, 1) attention_forward_wgmma_kernel(const Params p) {
#if OOM_WGMMA_SM90A
  using T = FwdTiles<HD>;
  constexpr int kBc = T::kBc, kStages = T::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: no alignment assumed below
  // The swizzle pattern is taken from address bits 7-9: the tiles must start on 1024-byte boundaries.
  const std::uint32_t base = smem_addr(smem_raw) + pad_to_1024(smem_addr(smem_raw));
  const std::uint32_t a_q0 = base, a_k0 = base + T::kOffK, a_v0 = base + T::kOffV;

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // heaviest query tiles first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kBr;
  const int q_last = min(q0 + kBr, p.q_end) - 1;  // last valid query row of the block
  const int n_kv = q_last / kBc + 1;               // key tiles 0 .. the one holding q_last

  // Barrier j of each kind for tile j, stage j % kStages, phase j / kStages.
  //
  // The phases (any kStages >= 2): tile t occupies stage t % kStages, whose earlier occupants are
  // the tiles t - kStages, t - 2 kStages, ..., so t is its (t / kStages)-th occupant (counting from
  // 0): its load completes that stage's "full" barrier for the (t / kStages)-th time (phase
  // t / kStages, waited for with parity (t / kStages) & 1), and its release completes the stage's
  // "empty" barrier for the (t / kStages)-th time. Loading t (t >= kStages) waits for the release
  // of occupant t / kStages - 1 of its stage (tile t - kStages), i.e. parity (t / kStages - 1) & 1,
  // written (t / kStages + 1) & 1. Nothing here needs kStages to be a power of two: only the
  // division and remainder, not a mask.
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
  const std::uint32_t bars = base + T::kOffBar;
  const std::uint32_t full_q = bars;
  const auto full_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + s)); };
  const auto full_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + kStages + s)); };
  const auto empty_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 2 * kStages + s)); };
  const auto empty_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 3 * kStages + s)); };
  if (threadIdx.x == 0) {
    mbar_init(full_q, kWsProducerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), kWsProducerThreads);  // 128 cp.async arrivals per K or V tile
      mbar_init(full_v(s), kWsProducerThreads);
      mbar_init(empty_k(s), kWsConsumerThreads);
      mbar_init(empty_v(s), kWsConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == kWarpgroups) {
    // Producer: each tile's load waits for its stage's previous occupant to be freed (above).
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * HD;
    const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * HD;
    const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * HD;
    load_rows_sw128_producer<kBr, HD>(a_q0, q_g, p.q_token, q0, p.q_end, tid);
    cp_async_mbar_arrive(full_q);
    const auto load_kv = [&](std::uint32_t tile, const __nv_bfloat16* g, std::int64_t token, int row0) {
      load_rows_sw128_producer<kBc, HD>(tile, g, token, row0, p.seq, tid);
    };
    load_kv(a_k0, k_g, p.k_token, 0);
    cp_async_mbar_arrive(full_k(0));
    for (int j = 0; j < n_kv; ++j) {
      if (const int t = j + 1; t < n_kv) {
        const int st = t % kStages;
        if (t >= kStages) mbar_wait(empty_k(st), static_cast<std::uint32_t>((t / kStages + 1) & 1));
        load_kv(a_k0 + static_cast<std::uint32_t>(st) * T::kKvBytes, k_g, p.k_token, t * kBc);
        cp_async_mbar_arrive(full_k(st));
      }
      const int st = j % kStages;
      if (j >= kStages) mbar_wait(empty_v(st), static_cast<std::uint32_t>((j / kStages + 1) & 1));
      load_kv(a_v0 + static_cast<std::uint32_t>(st) * T::kKvBytes, v_g, p.v_token, j * kBc);
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
  const int wg_row0 = q0 + 64 * wg;  // the warpgroup's first query row
  const std::uint32_t a_q = a_q0 + static_cast<std::uint32_t>(wg) * kSwWgRowBytes;

  WarpgroupState<HD> st;
  start(st);
  float alpha[2];

  mbar_wait(full_q, 0);
  for (int nb = 0; nb < n_kv; ++nb) {
    const int sk = nb % kStages, sv = (nb + kStages - 1) % kStages;  // K_nb's stage, V_{nb-1}'s
    mbar_wait(full_k(sk), static_cast<std::uint32_t>((nb / kStages) & 1));
    if (nb > 0) mbar_wait(full_v(sv), static_cast<std::uint32_t>(((nb - 1) / kStages) & 1));
    // The tiles' cp.async writes, observed through the mbarriers, before the wgmmas (async proxy)
    // read them.
    fence_proxy_async_shared();

    fence_all(st);
    wgmma_fence();  // s, o and pa were written by the previous iteration
    issue_s(st, a_q, a_k0 + static_cast<std::uint32_t>(sk) * T::kKvBytes);
    wgmma_commit_group();
    if (nb > 0) {
      // ptxas otherwise injects this arrive itself (C7519): the branch hides that nothing touched o
      // and pa since the fence above. It orders register accesses only; the S wgmmas keep running.
      wgmma_fence();
      issue_pv(st, a_v0 + static_cast<std::uint32_t>(sv) * T::kKvBytes);  // O += P_{nb-1} V_{nb-1}
      wgmma_commit_group();
      wgmma_wait_group<1>();  // S_nb done (groups complete in order); P V may still run
    } else {
      wgmma_wait_group<0>();
    }
    mbar_arrive(empty_k(sk));  // K_nb read
    wgmma_fence_operands(st.s);
    // Mask and online softmax of S_nb (O untouched: it may still be an in-flight accumulator).
    softmax<kBc>(st.s, st.m_run, st.l_run, alpha, nb * kBc, wg_row0, r0, c0, p.scale_log2);
    wgmma_wait_group<0>();
    fence_all(st);  // o and pa are free from here on
    if (nb > 0) mbar_arrive(empty_v(sv));  // V_{nb-1} read
    rescale(st.o, alpha);
    attention_detail::pack_rs_fragments<kBc>(st.pa, st.s);  // P
  }
  {
    // The last O += P V.
    const int sv = (n_kv - 1) % kStages;
    mbar_wait(full_v(sv), static_cast<std::uint32_t>(((n_kv - 1) / kStages) & 1));
    fence_proxy_async_shared();
    fence_all(st);
    wgmma_fence();
    issue_pv(st, a_v0 + static_cast<std::uint32_t>(sv) * T::kKvBytes);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_all(st);
  }
  store<HD>(st.o, st.m_run, st.l_run, p, b, h, wg_row0 + r0, c0, lane);
#else
  (void)p;
  __trap();
#endif
}

/// The checks, grid and launch of either head dim.
template <int HD>
cudaError_t launch(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k, TokenRows<const bf16> v,
                   TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  bool empty = false;
  if (const cudaError_t e = forward_checks(p, HD, q, k, v, o, lse, &empty); e != cudaSuccess || empty) return e;
  const Params params = attention_detail::forward_params(p, q, k, v, o, lse);
  const int q_tiles = (params.q_end - params.q_begin + kBr - 1) / kBr;
  const dim3 grid(static_cast<unsigned>(q_tiles), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  auto* kernel = attention_forward_wgmma_kernel<HD>;
  constexpr int kBytes = FwdTiles<HD>::kSmemBytes;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
      e != cudaSuccess)
    return e;
  kernel<<<grid, kWsThreads, kBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_forward_wgmma(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  return launch<128>(p, q, k, v, o, lse, stream);
}

cudaError_t attention_forward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                         TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  return launch<256>(p, q, k, v, o, lse, stream);
}

}  // namespace oom::kernels::hopper
