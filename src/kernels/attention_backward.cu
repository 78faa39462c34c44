// Causal GQA attention backward, FlashAttention-2 (Dao 2023, Algorithm 2), made deterministic:
//   1. preprocess: D_i = rowsum(dO_i o O_i) and LSE_i * log2(e) into the workspace;
//   2. dK/dV pass: one thread block per (key block, KV head, batch[, half of D]); each warp owns 16
//      keys and keeps dK, dV in fp32 registers while the block streams (Q_i, dO_i) for every
//      query head of the group and every query block at or after the keys (double-buffered
//      cp.async). Per step (transposed so keys are the M dimension and all operands stay in
//      registers): S^T = K Q^T, P^T = exp(S^T - LSE), dP^T = V dO^T, dS^T = P^T o (dP^T - D),
//      dV += P^T dO, dK += dS^T Q. The GQA sum over the group happens in that loop: no atomics.
//   3. dQ pass: one thread block per (query block, query head, batch), each warp 16 query rows:
//      S = Q K^T, P = exp(S - LSE), dP = dO V^T, dS = P o (dP - D), dQ += dS K over key blocks
//      0 .. diagonal.
// FA2 accumulates dQ with fp32 atomics inside pass 2; recomputing S and dP in pass 3 instead costs
// two more of the seven matrix products but makes every output bit-reproducible and needs no
// fp32 dQ buffer.
//
// Tiles (4 warps = 128 threads, each warp 16 rows; ptxas -v for sm_90 with nvcc 13.0 in brackets):
//   dK/dV, D = 128: BC = 64 keys, BR = 64 queries per step; smem K, V 32 KiB + 2 x (Q, dO) 64 KiB
//                   + stats = 97 KiB [255 registers, 4 bytes spilled] -> 2 blocks per SM.
//   dK/dV, D = 256: the dK + dV accumulators of all 256 columns would need 256 registers, so the
//                   grid splits the output columns in two halves (S^T and dP^T are computed in
//                   both); BR = 32; smem 64 + 2 x 32 KiB + stats = 129 KiB [247, none] -> 1 per SM.
//   dQ, D = 128: BR = 64, BC = 64; smem Q, dO 32 KiB + 2 x (K, V) 64 KiB = 96 KiB [240, none].
//   dQ, D = 256: BR = 64, BC = 32; smem Q, dO 64 KiB + 2 x (K, V) 64 KiB = 128 KiB [254, 8 bytes].
//
// Variant attention_backward_fused_dq (not the default): no pass 3. The dK/dV kernel with
// FUSED_DQ also puts each step's dS (bf16, as dK's product rounds it) transposed into shared memory
// (BR x BC: 8 KiB at D = 128, 4 KiB at D = 256), forms this key block's dS K for the step's query
// tile (K is in shared memory already; the 4 warps split the BR x D_OUT tile, each warp 16 rows in
// 32-column slices) and adds it to an fp32 dQ in the workspace, (B, Hq, q_tiles * BR, D) with the
// scale left out; a last kernel writes dq = bf16(scale * dQ) as pass 3 does.
//   Order. Key block nb visits query tile i iff nb <= last(i) = min(kv_blocks - 1,
//   (q_begin + (i + 1) BR - 1) / BC) (the tile has a row >= nb BC). The blocks of tile i add in the
//   fixed order last(i), last(i) - 1, .., 0, so dQ is bit-reproducible: one counter per (batch,
//   query head, query tile, column half), zeroed by a memset in the launcher; the block of key
//   block nb waits (thread 0: ld.acquire polls with __nanosleep backoff, then __syncthreads) until
//   the counter reads last(i) - nb, adds with L2 loads/stores (.cg; key block last(i) stores, so the
//   accumulator needs no zeroing), then __threadfence, __syncthreads and thread 0 increments
//   (red.release). At D = 256 each column half adds its own columns under its own counter.
//   Deadlock freedom assumes the GPU starts a grid's blocks in increasing linear index (x fastest,
//   then y, z) and that a started block runs to the end. The fused grid puts the LAST key block at
//   blockIdx.x = 0 (x = (kv_blocks - 1 - nb) D_SPLIT + half, y = KV head, z = batch), so a block
//   only waits on blocks of its own (half, KV head, batch) with a larger nb, i.e. a smaller linear
//   index: the lowest unfinished block never waits, and by induction all finish. Last-first also
//   keeps the waits short: key block nb + 1 meets a (head, tile) h + 1 steps earlier in its loop
//   than nb (h = the head's index in the group), so nb rarely waits for it; the first-first order
//   would chain the waits into a wavefront that grows with nb (a unit-cost replay of the grid on
//   264 slots: 0.94 of the busy time at 64K against 0.82; pass 2 alone 0.997).
//   A wait is bounded: past ~17 s (globaltimer) or 2^30 polls, or a counter beyond the expected
//   value, the block prints what it waited for and traps, so a broken assumption fails the launch
//   instead of hanging it; the convert kernel writes NaN for a tile whose counter is short.
//   Verified by construction only: the dispatch-order assumption and the memory ordering (acquire /
//   release, .cg); the index logic (who waits for what, final counts) was replayed on the host for
//   sub-ranges, GQA and both D, and the tests check the results bit for bit.
//   ptxas -v (nvcc 13.0, -O3, sm_90): D = 128: 255 registers, 48 bytes spilled, smem 105 KiB (2
//   blocks per SM); D = 256: 255 registers, no spills (32-byte stack frame: the trap's printf),
//   smem 133 KiB. (The pass-2 kernel reads 255 registers and 80 bytes spilled with these flags.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "attention_backward_common.cuh"
#include "attention_common.cuh"
#include "attention_fused_dq.hpp"
#include "attention_paths.hpp"
#include "oom/kernels/attention.hpp"
#if OOM_HAS_SM90A_KERNELS
#include "hopper/attention_wgmma.hpp"
#endif

namespace oom::kernels {
namespace attention_detail {
namespace {

// ---- 2. dK/dV ----

template <int D, int D_SPLIT, int BR, bool FUSED_DQ = false>
struct DkdvTiles {
  static constexpr int threads = 128, bc = 64;
  static constexpr int d_out = D / D_SPLIT;
  // K, V, 2 x (Q, dO), 2 x (LSE, D) [, dS (BR, BC) bf16]
  static constexpr int smem_bytes = (2 * bc * D + 4 * BR * D) * 2 + 4 * BR * 4 + (FUSED_DQ ? BR * bc * 2 : 0);
};

// ---- fused dQ: the ordered hand-over between key-block CTAs ----

/// Key block CTAs of one (batch, KV head, column half) add to a query tile's dQ from the last key
/// block contributing to the tile down to key block 0. Key block `nb` contributes to query tile `i`
/// (tile rows q_begin + i BR ..) iff the tile has a row >= nb BC, i.e. iff nb <= last_key_block(i);
/// that is exactly when the dK/dV loop visits tile i (i >= qb_first).
__host__ __device__ __forceinline__ int last_key_block(int i, int q_begin, int br, int bc, int kv_blocks) {
  const int last = (q_begin + (i + 1) * br - 1) / bc;
  return last < kv_blocks - 1 ? last : kv_blocks - 1;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ std::uint64_t globaltimer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

/// One thread spins until *count == expected. Bounded: a count past `expected` (a protocol bug)
/// traps at once, and a wait longer than ~17 s or 2^30 polls (a CTA waiting on one that was never
/// scheduled: the ordering assumption broken) prints what it waited for and traps, so a bug ends
/// the launch with an error instead of hanging the GPU. A correct wait is one step of the
/// predecessor CTA: microseconds.
__device__ __noinline__ void wait_for_count(const unsigned* count, unsigned expected, int tile, int h) {
  unsigned v = load_acquire(count);
  if (v == expected) return;
  const std::uint64_t t0 = globaltimer_ns();
  unsigned sleep_ns = 32, polls = 0;
  while (v != expected) {
    if (v > expected || ((++polls & 1023u) == 0 && (globaltimer_ns() - t0 > (1ull << 34) || polls >= (1u << 30)))) {
      printf("attention_backward_fused_dq: block (%d, %d, %d) gives up on the dQ counter of query tile %d, head %d: "
             "%u, waiting for %u\n",
             static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z), tile, h, v,
             expected);
      __trap();
    }
    __nanosleep(sleep_ns);
    sleep_ns = min(2 * sleep_ns, 1024u);
    v = load_acquire(count);
  }
}

/// Writes a warp's dS^T fragments (pack_a layout: 16 keys x BR queries) transposed into the
/// (BR, BC) bf16 tile s_ds (swizzled, rows = queries), where the dQ product reads it as its A
/// operand. a[0][ks][r] holds key g + 8 (r & 1), queries 16 ks + 8 (r >> 1) + 2t (low half) and + 1.
template <int K_STEPS, int BC>
__device__ __forceinline__ void store_ds_transposed(__nv_bfloat16* s_ds, const std::uint32_t (&a)[1][K_STEPS][4],
                                                   int key0) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  auto* ds = reinterpret_cast<unsigned short*>(s_ds);
#pragma unroll
  for (int ks = 0; ks < K_STEPS; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = key0 + g + 8 * (r & 1), query = 16 * ks + 8 * (r >> 1) + 2 * t;
      ds[swizzle<BC>(query, key)] = static_cast<unsigned short>(a[0][ks][r] & 0xffffu);
      ds[swizzle<BC>(query + 1, key)] = static_cast<unsigned short>(a[0][ks][r] >> 16);
    }
}

/// The fused variant's share of a step: dQ[q tile] += dS K for this key block, in the fixed order
/// (see last_key_block). s_ds holds dS (BR x BC) of the step, written by all warps. The CTA's
/// BR x D_OUT output (its column half) is split over the 4 warps as BR/16 row groups x the rest
/// column groups, and each warp works in 32-column slices: 16 accumulator registers, 16 for dS.
template <int D, int D_OUT, int BR, int BC>
__device__ __forceinline__ void fused_dq_step(const BackwardParams& p, const __nv_bfloat16* s_ds,
                                              const __nv_bfloat16* s_k, int b, int h, int qb, int nb, int kv_blocks,
                                              int col0, int half, int q_tiles) {
  constexpr int ROW_GROUPS = BR / 16, COL_GROUPS = 4 / ROW_GROUPS, WARP_COLS = D_OUT / COL_GROUPS, SLICE = 32;
  static_assert(4 % ROW_GROUPS == 0 && WARP_COLS % SLICE == 0, "dQ tile must split evenly over the 4 warps");
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_w = (warp % ROW_GROUPS) * 16;
  const int col_w = col0 + (warp / ROW_GROUPS) * WARP_COLS;
  const std::int64_t tile = (static_cast<std::int64_t>(b) * p.heads_q + h) * q_tiles + qb;
  unsigned* count = p.dq_count + tile * (D / D_OUT) + half;
  const int last = last_key_block(qb, p.q_begin, BR, BC, kv_blocks);

  if (threadIdx.x == 0) wait_for_count(count, static_cast<unsigned>(last - nb), qb, h);
  __syncthreads();  // s_ds complete; the predecessors' dQ visible (acquire by thread 0, then the barrier)

  std::uint32_t a[1][BC / 16][4];
  const std::uint32_t ds_tile = smem_addr(s_ds);
#pragma unroll
  for (int ks = 0; ks < BC / 16; ++ks)
    ldmatrix_x4(a[0][ks], ds_tile + 2 * swizzle<BC>(row_w + (lane & 15), ks * 16 + (lane >> 4) * 8));
  float* acc_rows = p.dq_acc + (tile * BR + row_w) * D;
#pragma unroll 1
  for (int c = col_w; c < col_w + WARP_COLS; c += SLICE) {
    float dq[1][SLICE / 8][4];
    zero(dq);
    gemm_regs_nn<1, BC / 16, SLICE / 8, D>(dq, a, smem_addr(s_k), 0, c);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int nt = 0; nt < SLICE / 8; ++nt) {
        // L2-only loads and stores (.cg): the previous value was written on another SM.
        auto* dst = reinterpret_cast<float2*>(acc_rows + static_cast<std::int64_t>(g + 8 * hf) * D + c + nt * 8 + 2 * t);
        float2 v = make_float2(dq[0][nt][2 * hf], dq[0][nt][2 * hf + 1]);
        if (nb != last) {
          const float2 old = __ldcg(dst);
          v.x += old.x;
          v.y += old.y;
        }
        __stcg(dst, v);
      }
  }
  __threadfence();  // this thread's dQ stores before the counter's increment (after the next barrier)
}

template <int D, int D_SPLIT, int BR, bool FUSED_DQ>
__global__ void __launch_bounds__(128, 1) attention_backward_dkdv_kernel(const BackwardParams p) {
  using Tiles = DkdvTiles<D, D_SPLIT, BR, FUSED_DQ>;
  constexpr int BC = Tiles::bc, THREADS = Tiles::threads, D_OUT = Tiles::d_out, Q_TILES = BR / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto* s_k = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (BC, D)
  __nv_bfloat16* s_v = s_k + BC * D;                        // (BC, D)
  __nv_bfloat16* s_q = s_v + BC * D;                        // 2 x (BR, D)
  __nv_bfloat16* s_do = s_q + 2 * BR * D;                   // 2 x (BR, D)
  auto* s_lse2 = reinterpret_cast<float*>(s_do + 2 * BR * D);  // 2 x BR
  float* s_delta = s_lse2 + 2 * BR;                            // 2 x BR
  auto* s_ds = reinterpret_cast<__nv_bfloat16*>(s_delta + 2 * BR);  // FUSED_DQ: (BR, BC)

  // Block 0 of the keys sees the most queries: launch it first. The fused variant launches the
  // last key block first instead: a key block's dQ goes after its successor's (see the header).
  const int kv_blocks = static_cast<int>(gridDim.x) / D_SPLIT;
  const int nb = FUSED_DQ ? kv_blocks - 1 - static_cast<int>(blockIdx.x) / D_SPLIT : static_cast<int>(blockIdx.x) / D_SPLIT;
  const int half = static_cast<int>(blockIdx.x) % D_SPLIT;
  const int col0 = half * D_OUT;
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int n0 = nb * BC;
  const int qb_first = n0 <= p.q_begin ? 0 : (n0 - p.q_begin) / BR;  // first query block with a row >= n0
  const int qb_count = (p.q_len() + BR - 1) / BR;
  const int per_head = qb_count - qb_first;
  const int steps = p.group * per_head;

  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * D;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * D;
  load_tile<BC, D, THREADS>(s_k, k_g, p.k_token, n0, p.seq);
  load_tile<BC, D, THREADS>(s_v, v_g, p.v_token, n0, p.seq);

  // Stage `step` (query head h of the group, query block qb) into buffer `buf`.
  auto prefetch = [&](int step, int buf) {
    const int h = hk * p.group + step / per_head;
    const int q0 = p.q_begin + (qb_first + step % per_head) * BR;
    load_tile<BR, D, THREADS>(s_q + buf * BR * D, p.q + b * p.q_batch + static_cast<std::int64_t>(h) * D, p.q_token, q0,
                              p.q_end);
    load_tile<BR, D, THREADS>(s_do + buf * BR * D, p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * D,
                              p.do_token, q0, p.q_end);
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (q0 - p.q_begin);
    for (int r = static_cast<int>(threadIdx.x); r < 2 * BR; r += THREADS) {
      const int rr = r % BR;
      const bool valid = q0 + rr < p.q_end;
      const float* src = (r < BR ? p.lse2 : p.delta) + (valid ? w + rr : 0);
      cp_async_4((r < BR ? s_lse2 : s_delta) + buf * BR + rr, src, valid);
    }
  };
  if (steps > 0) prefetch(0, 0);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int key_w = n0 + warp * 16;  // this warp's first key

  float dk_acc[1][D_OUT / 8][4], dv_acc[1][D_OUT / 8][4];
  zero(dk_acc);
  zero(dv_acc);

  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) prefetch(step + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const int q0 = p.q_begin + (qb_first + step % per_head) * BR;
    if (q0 + BR - 1 >= key_w) {  // else every query of the block precedes this warp's keys
      const std::uint32_t q_tile = smem_addr(s_q + buf * BR * D), do_tile = smem_addr(s_do + buf * BR * D);
      const float* lse2 = s_lse2 + buf * BR;
      const float* delta = s_delta + buf * BR;

      // S^T = K Q^T, P^T = exp2(scale_log2 S^T - LSE2), zero where the query precedes the key
      // (causal) or lies past q_end (zero-filled rows).
      float st[1][Q_TILES][4];
      zero(st);
      gemm_smem_nt<1, Q_TILES, D>(st, smem_addr(s_k), warp * 16, q_tile, 0);
      const bool edge = q0 < key_w + 15 || q0 + BR > p.q_end;
#pragma unroll
      for (int nt = 0; nt < Q_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * t + (e & 1);  // block-local query
          const int j = key_w + g + 8 * (e >> 1);
          const float pe = exp2f(fmaf(st[0][nt][e], p.scale_log2, -lse2[qi]));
          st[0][nt][e] = (edge && (q0 + qi < j || q0 + qi >= p.q_end)) ? 0.0f : pe;
        }

      // dV += P^T dO (Algorithm 2, line 13)
      std::uint32_t frag[1][BR / 16][4];
      pack_a(frag, st);
      gemm_regs_nn<1, BR / 16, D_OUT / 8, D>(dv_acc, frag, do_tile, 0, col0);

      // dP^T = V dO^T (line 14), dS^T = P^T o (dP^T - D) (line 15)
      float dpt[1][Q_TILES][4];
      zero(dpt);
      gemm_smem_nt<1, Q_TILES, D>(dpt, smem_addr(s_v), warp * 16, do_tile, 0);
#pragma unroll
      for (int nt = 0; nt < Q_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[0][nt][e] *= dpt[0][nt][e] - delta[nt * 8 + 2 * t + (e & 1)];

      // dK += dS^T Q (line 17; the softmax scale is applied once at the end)
      pack_a(frag, st);
      if constexpr (FUSED_DQ) store_ds_transposed<BR / 16, BC>(s_ds, frag, warp * 16);
      gemm_regs_nn<1, BR / 16, D_OUT / 8, D>(dk_acc, frag, q_tile, 0, col0);
    } else if constexpr (FUSED_DQ) {  // dS = 0 for this warp's keys
      for (int e = lane; e < BR * 16 / 2; e += 32) {
        const int query = e / 8, key = warp * 16 + 2 * (e % 8);
        *reinterpret_cast<std::uint32_t*>(s_ds + swizzle<BC>(query, key)) = 0u;
      }
    }
    if constexpr (FUSED_DQ)
      fused_dq_step<D, D_OUT, BR, BC>(p, s_ds, s_k, b, hk * p.group + step / per_head, qb_first + step % per_head, nb,
                                      kv_blocks, col0, half, qb_count);
    __syncthreads();  // buffer `buf` is refilled by the next step's prefetch
    if constexpr (FUSED_DQ) {
      if (threadIdx.x == 0) {
        const int h = hk * p.group + step / per_head, qb = qb_first + step % per_head;
        add_release(p.dq_count + ((static_cast<std::int64_t>(b) * p.heads_q + h) * qb_count + qb) * D_SPLIT + half, 1u);
      }
    }
  }

  const std::int64_t dk_at = b * p.dk_batch + static_cast<std::int64_t>(hk) * D + col0;
  const std::int64_t dv_at = b * p.dv_batch + static_cast<std::int64_t>(hk) * D + col0;
  if (p.dk_sum != nullptr) {  // attention_backward_dkv_sum
    store_rows(dk_acc, p.dk_sum + dk_at, p.dk_token, key_w, p.q_end, p.scale, true);
    store_rows(dv_acc, p.dv_sum + dv_at, p.dv_token, key_w, p.q_end, 1.0f, true);
  } else {
    store_rows(dk_acc, p.dk + dk_at, p.dk_token, key_w, p.q_end, p.scale, p.accumulate_dkv);
    store_rows(dv_acc, p.dv + dv_at, p.dv_token, key_w, p.q_end, 1.0f, p.accumulate_dkv);
  }
}

// ---- 3. dQ ----

template <int D, int BC>
struct DqTiles {
  static constexpr int threads = 128, br = 64;
  static constexpr int smem_bytes = (2 * br * D + 4 * BC * D) * 2;  // Q, dO, 2 x (K, V)
};

template <int D, int BC>
__global__ void __launch_bounds__(128, 1) attention_backward_dq_kernel(const BackwardParams p) {
  using Tiles = DqTiles<D, BC>;
  constexpr int BR = Tiles::br, THREADS = Tiles::threads, N_TILES = BC / 8, D_TILES = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (BR, D)
  __nv_bfloat16* s_do = s_q + BR * D;                       // (BR, D)
  __nv_bfloat16* s_k = s_do + BR * D;                       // 2 x (BC, D)
  __nv_bfloat16* s_v = s_k + 2 * BC * D;                    // 2 x (BC, D)

  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * BR;
  const int q_last = min(q0 + BR, p.q_end) - 1;
  const int n_kv = q_last / BC + 1;

  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * D;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * D;
  load_tile<BR, D, THREADS>(s_q, p.q + b * p.q_batch + static_cast<std::int64_t>(h) * D, p.q_token, q0, p.q_end);
  load_tile<BR, D, THREADS>(s_do, p.d_o + b * p.do_batch + static_cast<std::int64_t>(h) * D, p.do_token, q0, p.q_end);
  load_tile<BC, D, THREADS>(s_k, k_g, p.k_token, 0, p.seq);
  load_tile<BC, D, THREADS>(s_v, v_g, p.v_token, 0, p.seq);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_w = warp * 16;
  const int warp_q_first = q0 + row_w;

  // Row statistics of this lane's two rows (g, g+8); rows past q_end get P = 0 through lse2 = +inf.
  float lse2[2], delta[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = warp_q_first + g + 8 * hf;
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    lse2[hf] = i < p.q_end ? p.lse2[w] : INFINITY;
    delta[hf] = i < p.q_end ? p.delta[w] : 0.0f;
  }

  float dq_acc[1][D_TILES][4];
  zero(dq_acc);

  for (int nb = 0; nb < n_kv; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_kv) {
      load_tile<BC, D, THREADS>(s_k + (buf ^ 1) * BC * D, k_g, p.k_token, (nb + 1) * BC, p.seq);
      load_tile<BC, D, THREADS>(s_v + (buf ^ 1) * BC * D, v_g, p.v_token, (nb + 1) * BC, p.seq);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const int n0 = nb * BC;
    if (n0 <= warp_q_first + 15) {
      const std::uint32_t k_tile = smem_addr(s_k + buf * BC * D), v_tile = smem_addr(s_v + buf * BC * D);
      // S = Q K^T, P = exp2(scale_log2 S - LSE2) with the causal mask (Algorithm 2, lines 9-10)
      float s[1][N_TILES][4];
      zero(s);
      gemm_smem_nt<1, N_TILES, D>(s, smem_addr(s_q), row_w, k_tile, 0);
      const bool edge = n0 + BC - 1 > warp_q_first;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = warp_q_first + g + 8 * (e >> 1);
          const int j = n0 + nt * 8 + 2 * t + (e & 1);
          const float pe = exp2f(fmaf(s[0][nt][e], p.scale_log2, -lse2[e >> 1]));
          s[0][nt][e] = (edge && j > i) ? 0.0f : pe;
        }
      // dP = dO V^T, dS = P o (dP - D) (lines 14-15)
      float dp[1][N_TILES][4];
      zero(dp);
      gemm_smem_nt<1, N_TILES, D>(dp, smem_addr(s_do), row_w, v_tile, 0);
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nt][e] *= dp[0][nt][e] - delta[e >> 1];
      // dQ += dS K (line 16)
      std::uint32_t frag[1][BC / 16][4];
      pack_a(frag, s);
      gemm_regs_nn<1, BC / 16, D_TILES, D>(dq_acc, frag, k_tile, 0, 0);
    }
    __syncthreads();
  }
  store_rows(dq_acc, p.dq + b * p.dq_batch + static_cast<std::int64_t>(h) * D, p.dq_token, warp_q_first, p.q_end,
             p.scale);
}

// ---- 4. fused dQ: the fp32 accumulator to bf16 dQ ----

/// One thread per 8 columns of a dQ row: dq = bf16(scale * acc), as pass 3 stores its registers.
/// A (query tile, half) whose counter is short of its number of key blocks gets NaN: a broken
/// hand-over shows up in the output rather than as silently partial sums.
template <int D, int BR, int D_SPLIT>
__global__ void __launch_bounds__(256) attention_backward_dq_convert_kernel(const BackwardParams p, int q_tiles,
                                                                            int kv_blocks) {
  constexpr int CHUNKS = D / 8;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * 256 + threadIdx.x;  // (row, head, chunk)
  if (idx >= static_cast<std::int64_t>(p.q_len()) * p.heads_q * CHUNKS) return;
  const int b = static_cast<int>(blockIdx.y);
  const int ch = static_cast<int>(idx % CHUNKS);
  const int h = static_cast<int>(idx / CHUNKS % p.heads_q);
  const int r = static_cast<int>(idx / (static_cast<std::int64_t>(CHUNKS) * p.heads_q));  // row - q_begin
  const int qb = r / BR, half = ch * 8 / (D / D_SPLIT);
  const std::int64_t tile = (static_cast<std::int64_t>(b) * p.heads_q + h) * q_tiles + qb;
  const bool complete =
      p.dq_count[tile * D_SPLIT + half] == static_cast<unsigned>(last_key_block(qb, p.q_begin, BR, 64, kv_blocks) + 1);
  const float* src = p.dq_acc + (tile * BR + r % BR) * D + ch * 8;
  const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
  const float s = complete ? p.scale : NAN;
  uint4 out;
  out.x = pack_bf16(lo.x * s, lo.y * s);
  out.y = pack_bf16(lo.z * s, lo.w * s);
  out.z = pack_bf16(hi.x * s, hi.y * s);
  out.w = pack_bf16(hi.z * s, hi.w * s);
  *reinterpret_cast<uint4*>(p.dq + b * p.dq_batch + static_cast<std::int64_t>(p.q_begin + r) * p.dq_token +
                            static_cast<std::int64_t>(h) * D + ch * 8) = out;
}

/// Lets `kernel` take `smem_bytes` of dynamic shared memory (a no-op at or below the default 48 KiB).
/// launch_backward asks this for every kernel it will launch before it queues anything, so a
/// failure leaves the stream as it was.
template <class Kernel>
cudaError_t allow_smem(Kernel* kernel, int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

template <class Kernel, class... Args>
cudaError_t launch(Kernel* kernel, dim3 grid, int threads, int smem_bytes, cudaStream_t stream, const Args&... args) {
  kernel<<<grid, threads, smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

/// Tile choice per head dimension (see the header comment).
template <int D>
struct BackwardShape;
template <>
struct BackwardShape<128> {
  static constexpr int d_split = 1, br_dkdv = 64, bc_dq = 64;
};
template <>
struct BackwardShape<256> {
  static constexpr int d_split = 2, br_dkdv = 32, bc_dq = 32;
};

/// The fused variant's workspace after attention_backward's: the fp32 dQ accumulator
/// (B, Hq, q_tiles * BR, D) (the last tile padded to BR rows) and the counters (B, Hq, q_tiles, D_SPLIT).
struct FusedDqLayout {
  int q_tiles = 0, kv_blocks = 0;
  std::size_t acc_offset = 0, count_offset = 0, count_bytes = 0, total_bytes = 0;
};

template <int D>
FusedDqLayout fused_dq_layout(const AttentionProblem& p) {
  using Shape = BackwardShape<D>;
  FusedDqLayout l;
  l.q_tiles = (p.query_end() - p.q_begin + Shape::br_dkdv - 1) / Shape::br_dkdv;
  l.kv_blocks = (p.query_end() + 63) / 64;
  const std::size_t heads = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.heads_q);
  l.acc_offset = attention_backward_workspace_bytes(p);
  l.count_offset =
      l.acc_offset + round_up_256(heads * static_cast<std::size_t>(l.q_tiles) * Shape::br_dkdv * D * sizeof(float));
  l.count_bytes = heads * static_cast<std::size_t>(l.q_tiles) * Shape::d_split * sizeof(unsigned);
  l.total_bytes = l.count_offset + round_up_256(l.count_bytes);
  return l;
}

template <int D, bool FUSED_DQ>
cudaError_t launch_backward(const BackwardParams& params, int batch, int heads_kv, const FusedDqLayout& fused,
                            cudaStream_t stream) {
  constexpr int D_SPLIT = BackwardShape<D>::d_split, BR_DKDV = BackwardShape<D>::br_dkdv;
  constexpr int BC_DQ = BackwardShape<D>::bc_dq;
  using Dkdv = DkdvTiles<D, D_SPLIT, BR_DKDV, FUSED_DQ>;
  using Dq = DqTiles<D, BC_DQ>;
  if (const cudaError_t e = allow_smem(attention_backward_dkdv_kernel<D, D_SPLIT, BR_DKDV, FUSED_DQ>, Dkdv::smem_bytes);
      e != cudaSuccess)
    return e;
  if constexpr (!FUSED_DQ) {
    if (const cudaError_t e = allow_smem(attention_backward_dq_kernel<D, BC_DQ>, Dq::smem_bytes); e != cudaSuccess)
      return e;
  }
  if (const cudaError_t e = launch_backward_preprocess<D>(params, batch, stream); e != cudaSuccess) return e;
  if constexpr (FUSED_DQ) {
    if (const cudaError_t e = cudaMemsetAsync(params.dq_count, 0, fused.count_bytes, stream); e != cudaSuccess) return e;
  }

  const int kv_blocks = (params.q_end + Dkdv::bc - 1) / Dkdv::bc;
  const dim3 dkdv_grid(static_cast<unsigned>(kv_blocks * D_SPLIT), static_cast<unsigned>(heads_kv),
                       static_cast<unsigned>(batch));
  if (const cudaError_t e = launch(attention_backward_dkdv_kernel<D, D_SPLIT, BR_DKDV, FUSED_DQ>, dkdv_grid,
                                   Dkdv::threads, Dkdv::smem_bytes, stream, params);
      e != cudaSuccess)
    return e;

  if constexpr (FUSED_DQ) {
    static_assert(Dkdv::bc == 64, "the convert kernel's counter check assumes 64-key blocks");
    const std::int64_t chunks = static_cast<std::int64_t>(params.heads_q) * params.q_len() * (D / 8);
    const dim3 grid(static_cast<unsigned>((chunks + 255) / 256), static_cast<unsigned>(batch));
    return launch(attention_backward_dq_convert_kernel<D, BR_DKDV, D_SPLIT>, grid, 256, 0, stream, params,
                  fused.q_tiles, fused.kv_blocks);
  } else {
    const int q_blocks = (params.q_len() + Dq::br - 1) / Dq::br;
    const dim3 dq_grid(static_cast<unsigned>(q_blocks), static_cast<unsigned>(params.heads_q),
                       static_cast<unsigned>(batch));
    return launch(attention_backward_dq_kernel<D, BC_DQ>, dq_grid, Dq::threads, Dq::smem_bytes, stream, params);
  }
}


}  // namespace
}  // namespace attention_detail

std::size_t attention_backward_workspace_bytes(const AttentionProblem& p) {
  const std::size_t rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.heads_q) *
                           static_cast<std::size_t>(p.query_end() - p.q_begin);
  return 2 * attention_detail::round_up_256(rows * sizeof(float));
}

cudaError_t attention_backward_mma_sync(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                        const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                        bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream) {
  using namespace attention_detail;
  if (const cudaError_t e = check_problem("attention_backward", p); e != cudaSuccess) return e;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  if (const cudaError_t e = check_backward_args("attention_backward", q, k, v, o, d_o, lse, dq, dk, dv, workspace,
                                                workspace_bytes, attention_backward_workspace_bytes(p),
                                                "attention_backward_workspace_bytes");
      e != cudaSuccess)
    return e;
  const BackwardParams params = backward_params(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace);
  if (p.head_dim == 128) return launch_backward<128, false>(params, p.batch, p.heads_kv, {}, stream);
  return launch_backward<256, false>(params, p.batch, p.heads_kv, {}, stream);
}

cudaError_t attention_backward(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                               TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                               const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                               bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                               cudaStream_t stream) {
#if OOM_HAS_SM90A_KERNELS
  // As attention_forward: the wgmma kernels unless they have no code for the case.
  if (p.head_dim == 128 || p.head_dim == 256) {
    const auto wgmma = p.head_dim == 128 ? hopper::attention_backward_wgmma : hopper::attention_backward_wgmma_d256;
    const cudaError_t e =
        wgmma(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes, stream);
    if (e != cudaErrorNotSupported) return e;
  }
#endif
  return attention_backward_mma_sync(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace, workspace_bytes,
                                     stream);
}

cudaError_t attention_backward_mma_sync_dkv_sum(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                                TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                                const float* lse, TokenRows<bf16> dq, AttentionDkvSums sums, void* workspace,
                                                std::size_t workspace_bytes, cudaStream_t stream) {
  using namespace attention_detail;
  if (const cudaError_t e = check_problem("attention_backward_dkv_sum", p); e != cudaSuccess) return e;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  if (const cudaError_t e = check_backward_args("attention_backward_dkv_sum", q, k, v, o, d_o, lse, dq, sums.dk, sums.dv,
                                                workspace, workspace_bytes, attention_backward_workspace_bytes(p),
                                                "attention_backward_workspace_bytes");
      e != cudaSuccess)
    return e;
  const BackwardParams params = with_sums(backward_params(p, q, k, v, o, d_o, lse, dq, {}, {}, true, workspace), sums);
  if (p.head_dim == 128) return launch_backward<128, false>(params, p.batch, p.heads_kv, {}, stream);
  return launch_backward<256, false>(params, p.batch, p.heads_kv, {}, stream);
}

cudaError_t attention_backward_dkv_sum(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                       TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                       const float* lse, TokenRows<bf16> dq, AttentionDkvSums sums, void* workspace,
                                       std::size_t workspace_bytes, cudaStream_t stream) {
#if OOM_HAS_SM90A_KERNELS
  if (p.head_dim == 128 || p.head_dim == 256) {
    const cudaError_t e = hopper::attention_backward_wgmma_dkv_sum(p, q, k, v, o, d_o, lse, dq, sums, workspace, workspace_bytes, stream);
    if (e != cudaErrorNotSupported) return e;
  }
#endif
  return attention_backward_mma_sync_dkv_sum(p, q, k, v, o, d_o, lse, dq, sums, workspace, workspace_bytes, stream);
}

std::size_t attention_backward_fused_dq_workspace_bytes(const AttentionProblem& p) {
  using namespace attention_detail;
  return p.head_dim == 256 ? fused_dq_layout<256>(p).total_bytes : fused_dq_layout<128>(p).total_bytes;
}

cudaError_t attention_backward_fused_dq(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                        TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                        const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                        bool accumulate_dkv, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream) {
  using namespace attention_detail;
  if (const cudaError_t e = check_problem("attention_backward_fused_dq", p); e != cudaSuccess) return e;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  if (const cudaError_t e = check_backward_args("attention_backward_fused_dq", q, k, v, o, d_o, lse, dq, dk, dv, workspace,
                                                workspace_bytes, attention_backward_fused_dq_workspace_bytes(p),
                                                "attention_backward_fused_dq_workspace_bytes");
      e != cudaSuccess)
    return e;
  BackwardParams params = backward_params(p, q, k, v, o, d_o, lse, dq, dk, dv, accumulate_dkv, workspace);
  const FusedDqLayout layout = p.head_dim == 128 ? fused_dq_layout<128>(p) : fused_dq_layout<256>(p);
  params.dq_acc = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + layout.acc_offset);
  params.dq_count = reinterpret_cast<unsigned*>(static_cast<unsigned char*>(workspace) + layout.count_offset);
  if (p.head_dim == 128) return launch_backward<128, true>(params, p.batch, p.heads_kv, layout, stream);
  return launch_backward<256, true>(params, p.batch, p.heads_kv, layout, stream);
}

}  // namespace oom::kernels
