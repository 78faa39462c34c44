// Causal GQA flash-attention forward on Hopper wgmma at head_dim 256
// (hopper::attention_forward_wgmma_d256): what oom::kernels::attention_forward runs on compute
// capability 9.0 at head_dim 256, same arguments and results as the mma.sync kernel
// (attention_forward.cu). The schedule is the head-dim-128 kernel's default, producer_sw128
// (attention_forward_wgmma_2wg.cu, which explains it at length), with the tiles reshaped for 256
// columns (docs/hopper.md, "Head dim 256"):
//   - 384 threads: consumer warpgroups 0 and 1 own query rows 64w .. 64w+63 of a 128-row block;
//     warpgroup 2 issues every cp.async (setmaxnreg 24 / 240, warp_specialized.cuh);
//   - key tiles of 64 (not 128): a consumer thread holds O (64 x 256 fp32: two m64n128
//     accumulators, 128 registers), S (64 x 64: 32) and P as bf16 RS A fragments (16), which is
//     what fits in 240 registers;
//   - per key tile j and warpgroup: S_j = Q_w K_j^T (16 x m64n64k16 SS over d) and O += P_{j-1}
//     V_{j-1} (4 k-steps of 16 keys x two m64n128k16 RS, one per 128-column half of O) issued
//     back to back; the softmax of S_j runs under the P V wgmmas; then O is rescaled and P_j packed;
//   - shared memory: Q (128 x 256 bf16, 64 KiB) and two stages each of K and V (64 x 256, 32 KiB
//     each) in the 128-byte-swizzled layout, four 64-column panels per tile (panel h at h x rows x
//     128 bytes; load_rows_sw128_producer<ROWS, 256>), 192 KiB + barriers + 1 KiB to align;
//   - descriptors: Q, K K-major over d, k-step ks (d = 16 ks ..) at panel ks / 4, byte 32 (ks % 4)
//     of each row, SBO 1024; V MN-major (K = keys, N = d), k-step ks (16 keys) at 2048 ks, SBO 1024
//     (next 8 keys), LBO one panel (next 64 d), half h of O at panel 2h.
// Softmax, masking, the LSE and the rounding (P to bf16 before P V, O to bf16 once) are the
// head-dim-128 kernel's, so results agree with the mma.sync kernel within the bf16 bounds (the fp32
// summation order inside the tensor-core products differs). Deterministic: bit-identical run to run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attention_common.cuh"
#include "attention_forward_steps.cuh"
#include "attention_wgmma.hpp"
#include "forward_checks.cuh"
#include "oom/kernels/attention.hpp"
#include "warp_specialized.cuh"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::smem_addr;

constexpr int kD = 256;
constexpr int kBr = 128;  // query rows per block, 64 per consumer warpgroup
constexpr int kBc = 64;   // keys per K/V tile
constexpr int kStages = 2;
constexpr int kOHalves = kD / 128;  // O as m64n128 accumulators

constexpr std::uint32_t kSwAtom = 1024;             // 8 rows x 128 bytes
constexpr std::uint32_t kQPanel = kBr * 128;         // one 64-column panel of the Q tile: 16 KiB
constexpr std::uint32_t kKvPanel = kBc * 128;        // one 64-column panel of a K or V tile: 8 KiB
constexpr std::uint32_t kQBytes = kBr * kD * 2;      // 64 KiB
constexpr std::uint32_t kKvBytes = kBc * kD * 2;     // 32 KiB
constexpr std::uint32_t kWgQBytes = 64 * 128;        // warpgroup w's Q rows start w x 8 KiB into each panel
constexpr std::uint32_t kOffK = kQBytes;
constexpr std::uint32_t kOffV = kOffK + kStages * kKvBytes;
constexpr std::uint32_t kOffBar = kOffV + kStages * kKvBytes;
constexpr int kBars = 1 + 4 * kStages;  // full_q, full_k[], full_v[], empty_k[], empty_v[]
constexpr int kSmemBytes = static_cast<int>(kOffBar) + 8 * kBars + 1024;  // + room to align to 1 KiB
static_assert(kSmemBytes <= 232448, "over the sm_90 shared memory per block");

using Params = attention_detail::ForwardParams;

/// A consumer warpgroup's running state. Accumulator fragments (wgmma.cuh): warp w of the
/// warpgroup, lane l holds rows r0 = 16w + l/4 (hf = 0) and r0 + 8 (hf = 1) of the warpgroup's 64;
/// of 8-column block j, columns 8j + 2(l%4) + {0, 1} in acc[4j + 2hf], acc[4j + 2hf + 1].
struct State {
  float o[kOHalves][64];          // O columns 128h .. 128h+127
  float s[kBc / 2];               // S, then exp(S - m)
  std::uint32_t pa[kBc / 16][4];  // P as the RS A operand, one k-step of 16 keys
  float m_run[2];                 // running row max, log2 units
  float l_run[2];                 // running row sum, this lane's columns only
};

__device__ __forceinline__ void start(State& st) {
#pragma unroll
  for (int h = 0; h < kOHalves; ++h)
#pragma unroll
    for (int e = 0; e < 64; ++e) st.o[h][e] = 0.0f;
#pragma unroll
  for (int e = 0; e < kBc / 2; ++e) st.s[e] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks)
#pragma unroll
    for (int x = 0; x < 4; ++x) st.pa[ks][x] = 0u;
  st.m_run[0] = st.m_run[1] = -INFINITY;
  st.l_run[0] = st.l_run[1] = 0.0f;
}

/// Every register a wgmma reads or writes, materialised here (attention_forward_wgmma_2wg.cu's
/// fence_all says why).
__device__ __forceinline__ void fence_all(State& st) {
#pragma unroll
  for (int h = 0; h < kOHalves; ++h) wgmma_fence_operands(st.o[h]);
  wgmma_fence_operands(st.s);
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks) wgmma_fence_operands(st.pa[ks]);
}

/// S = Q_w K^T: 16 wgmma m64n64k16 SS over d, not committed.
__device__ __forceinline__ void issue_s(State& st, std::uint32_t a_q, std::uint32_t a_k) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const std::uint32_t q_at = (ks / 4) * kQPanel + (ks % 4) * 32, k_at = (ks / 4) * kKvPanel + (ks % 4) * 32;
    wgmma_m64n64k16_f32_bf16_ss(st.s, encode_smem_desc(a_q + q_at, 16, kSwAtom, Swizzle::b128),
                                encode_smem_desc(a_k + k_at, 16, kSwAtom, Swizzle::b128), ks > 0 ? 1 : 0);
  }
}

/// O += P V: per k-step of 16 keys, one m64n128k16 RS per half of O, B = V MN-major; not committed.
__device__ __forceinline__ void issue_pv(State& st, std::uint32_t a_v) {
#pragma unroll
  for (int ks = 0; ks < kBc / 16; ++ks)
#pragma unroll
    for (int h = 0; h < kOHalves; ++h)
      wgmma_m64n128k16_f32_bf16_rs<Major::mn>(
          st.o[h], st.pa[ks], encode_smem_desc(a_v + 2 * h * kKvPanel + ks * 2 * kSwAtom, kKvPanel, kSwAtom, Swizzle::b128),
          1);
}

/// Causal mask of the S tile at keys n0.. where it crosses the diagonal of one of the warpgroup's
/// rows, then the online softmax statistics and P = exp(S - m') in place (as the head-dim-128
/// kernel's softmax_tile). O is not touched.
__device__ __forceinline__ void softmax_tile(State& st, float (&alpha)[2], int n0, int wg_row0, int r0, int c0,
                                             float scale_log2) {
  forward_steps::softmax<kBc>(st.s, st.m_run, st.l_run, alpha, n0, wg_row0, r0, c0, scale_log2);
}

/// O *= alpha per row, and P rounded to bf16 into the RS A fragments (k-step ks = column blocks
/// 2ks, 2ks+1; wgmma.cuh). Only once no wgmma reading `pa` or writing `o` is in flight.
__device__ __forceinline__ void rescale_and_pack(State& st, const float (&alpha)[2]) {
  forward_steps::rescale<kD>(&st.o[0][0], alpha);
  forward_steps::pack_p<kBc>(st.pa, st.s);
}

/// O = O / l (bf16) and LSE = (m + log2 l) ln 2 of the thread's rows i0 and i0 + 8 where < q_end.
__device__ __forceinline__ void store_output(const State& st, const Params& p, int b, int h, int i0, int c0, int lane) {
  forward_steps::store<kD>(st.o, st.m_run, st.l_run, p, b, h, i0, c0, lane);
}

/// The warp-specialised kernel. Tile t of K (and of V) lives in stage t % kStages; its "full"
/// mbarrier completes (128 cp.async arrivals) for the (t / kStages)-th time when it lands and its
/// "empty" one (256 consumer arrivals) when both warpgroups are done reading it. The producer
/// issues Q, K_0, then per j: K_{j+1}, V_j (the head-dim-128 kernel's order and phase argument,
/// which holds for any kStages >= 2).
__global__ void __launch_bounds__(kWsThreads, 1) attention_forward_wgmma_d256_kernel(const Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t base = smem_addr(smem_raw) + pad_to_1024(smem_addr(smem_raw));  // swizzle: 1 KiB aligned
  const std::uint32_t a_q0 = base, a_k0 = base + kOffK, a_v0 = base + kOffV;

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // heaviest query tiles first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kBr;
  const int q_last = min(q0 + kBr, p.q_end) - 1;
  const int n_kv = q_last / kBc + 1;  // key tiles 0 .. the one holding q_last

  const std::uint32_t bars = base + kOffBar;
  const std::uint32_t full_q = bars;
  const auto full_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + s)); };
  const auto full_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + kStages + s)); };
  const auto empty_k = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 2 * kStages + s)); };
  const auto empty_v = [&](int s) { return bars + static_cast<std::uint32_t>(8 * (1 + 3 * kStages + s)); };
  if (threadIdx.x == 0) {
    mbar_init(full_q, kWsProducerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), kWsProducerThreads);
      mbar_init(full_v(s), kWsProducerThreads);
      mbar_init(empty_k(s), kWsConsumerThreads);
      mbar_init(empty_v(s), kWsConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last block-wide barrier

  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    const int tid = static_cast<int>(threadIdx.x) - kWsConsumerThreads;
    const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD;
    const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
    const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;
    load_rows_sw128_producer<kBr, kD>(a_q0, q_g, p.q_token, q0, p.q_end, tid);
    cp_async_mbar_arrive(full_q);
    load_rows_sw128_producer<kBc, kD>(a_k0, k_g, p.k_token, 0, p.seq, tid);
    cp_async_mbar_arrive(full_k(0));
    for (int j = 0; j < n_kv; ++j) {
      if (const int t = j + 1; t < n_kv) {
        const int st = t % kStages;
        if (t >= kStages) mbar_wait(empty_k(st), static_cast<std::uint32_t>((t / kStages + 1) & 1));
        load_rows_sw128_producer<kBc, kD>(a_k0 + static_cast<std::uint32_t>(st) * kKvBytes, k_g, p.k_token, t * kBc, p.seq,
                                          tid);
        cp_async_mbar_arrive(full_k(st));
      }
      const int st = j % kStages;
      if (j >= kStages) mbar_wait(empty_v(st), static_cast<std::uint32_t>((j / kStages + 1) & 1));
      load_rows_sw128_producer<kBc, kD>(a_v0 + static_cast<std::uint32_t>(st) * kKvBytes, v_g, p.v_token, j * kBc, p.seq,
                                        tid);
      cp_async_mbar_arrive(full_v(st));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave nothing in flight behind
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) & 31;
  const int r0 = 16 * warp + (lane >> 2);
  const int c0 = 2 * (lane & 3);
  const int wg_row0 = q0 + 64 * wg;
  const std::uint32_t a_q = a_q0 + static_cast<std::uint32_t>(wg) * kWgQBytes;

  State st;
  start(st);
  float alpha[2];
  mbar_wait(full_q, 0);
  for (int nb = 0; nb < n_kv; ++nb) {
    const int sk = nb % kStages, sv = (nb + kStages - 1) % kStages;  // K_nb's stage, V_{nb-1}'s
    mbar_wait(full_k(sk), static_cast<std::uint32_t>((nb / kStages) & 1));
    if (nb > 0) mbar_wait(full_v(sv), static_cast<std::uint32_t>(((nb - 1) / kStages) & 1));
    fence_proxy_async_shared();  // the tiles' cp.async writes before the wgmmas (async proxy) read them

    fence_all(st);
    wgmma_fence();
    issue_s(st, a_q, a_k0 + static_cast<std::uint32_t>(sk) * kKvBytes);
    wgmma_commit_group();
    if (nb > 0) {
      wgmma_fence();
      issue_pv(st, a_v0 + static_cast<std::uint32_t>(sv) * kKvBytes);  // O += P_{nb-1} V_{nb-1}
      wgmma_commit_group();
      wgmma_wait_group<1>();  // S_nb done
    } else {
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
    const int sv = (n_kv - 1) % kStages;  // the last O += P V
    mbar_wait(full_v(sv), static_cast<std::uint32_t>(((n_kv - 1) / kStages) & 1));
    fence_proxy_async_shared();
    fence_all(st);
    wgmma_fence();
    issue_pv(st, a_v0 + static_cast<std::uint32_t>(sv) * kKvBytes);
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

}  // namespace

cudaError_t attention_forward_wgmma_d256(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                         TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  bool empty = false;
  if (const cudaError_t e = forward_checks(p, kD, q, k, v, o, lse, &empty); e != cudaSuccess || empty) return e;
  const Params params = attention_detail::forward_params(p, q, k, v, o, lse);
  const int q_tiles = (params.q_end - params.q_begin + kBr - 1) / kBr;
  const dim3 grid(static_cast<unsigned>(q_tiles), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  if (const cudaError_t e =
          cudaFuncSetAttribute(attention_forward_wgmma_d256_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess)
    return e;
  attention_forward_wgmma_d256_kernel<<<grid, kWsThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace oom::kernels::hopper
