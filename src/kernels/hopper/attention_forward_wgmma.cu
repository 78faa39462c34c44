// Causal GQA flash-attention forward on Hopper warpgroup MMA (wgmma), head_dim 128: the same
// algorithm and results as src/kernels/attention_forward.cu (FlashAttention-2, Dao 2023,
// Algorithm 1), with both GEMMs of a K/V tile issued as wgmma from shared memory instead of
// mma.sync from registers. A first version, correct by construction and not yet tuned (nor run on
// a GPU): docs/hopper.md says what is verified and what to measure first.
//
// One thread block = one warpgroup (128 threads) per (64-row query tile, query head, batch).
// Every shared-memory operand of a wgmma is in the no-swizzle K-major core-matrix layout of
// wgmma.cuh (core matrix = 8 rows x 16 bytes, its rows contiguous), with the core matrices of one
// 8-row band side by side along K (LBO = 128 bytes) and the bands one after another (SBO = K/8 *
// 128 bytes): exactly the "mn_rows" placement tests/kernels/test_wgmma.cu checks.
//   Q   64 rows  x 128 d    (A of S = Q K^T)   LBO 128, SBO 2048     16 KiB
//   K   64 keys  x 128 d    (B of S = Q K^T)   LBO 128, SBO 2048     2 x 16 KiB (double-buffered)
//   P   64 rows  x 64 keys  (A of O += P V)    LBO 128, SBO 1024     8 KiB
//   V^T 128 d    x 64 keys  (B of O += P V)    LBO 128, SBO 1024     16 KiB
// plus V staged as it arrives, 64 keys x 128 d row-major with the XOR swizzle of
// attention_common.cuh (2 x 16 KiB): 104 KiB in all. V is the B operand of P V with the keys as
// the contracted dimension, so K-major means V^T; rather than the transposed-B mode of wgmma
// (whose MN-major layout rules nothing here has verified) each tile is transposed in shared
// memory, 8x8 blocks at a time by ldmatrix.trans (see transpose_v).
//
// Per K/V tile j (keys 64j .. 64j+63), with tile j+1 loading by cp.async meanwhile:
//   1. S = Q K_j^T: 8 wgmma m64n64k16 (k-steps of 16 over d), committed as one group;
//   2. while they run, V_j is transposed from its staging buffer into V^T;
//   3. wait; causal mask on tiles that cross the diagonal; online softmax on the S fragment in
//      registers (each row's 64 values live on the 4 lanes of a quad: max and sum by two
//      shuffles), O rescaled, P = exp2(S * scale * log2 e - m) rounded to bf16 into shared memory;
//   4. O += P V_j: 4 wgmma m64n128k16 (k-steps of 16 over the keys), waited for at once.
// Ordering: every thread fences the async proxy (fence.proxy.async) after its own generic-proxy
// writes of a wgmma operand (cp.async for Q/K, st.shared for P and V^T) and before the barrier
// that publishes them; the shared memory a wgmma read is reused only after a wgmma.wait_group that
// covers it (its completion includes a generic-async proxy fence, PTX ISA "Async Proxy") and a
// block barrier.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attention_common.cuh"
#include "attention_wgmma.hpp"
#include "forward_checks.cuh"
#include "oom/kernels/attention.hpp"
#include "wgmma.cuh"

namespace oom::kernels::hopper {
namespace {

using attention_detail::cp_async_16;
using attention_detail::cp_async_commit;
using attention_detail::cp_async_wait;
using attention_detail::ldmatrix_x4_trans;
using attention_detail::pack_bf16;
using attention_detail::smem_addr;

constexpr int kD = 128;        // head_dim
constexpr int kBr = 64;        // query rows per block: the M of one wgmma
constexpr int kBc = 64;        // keys per K/V tile
constexpr int kThreads = 128;  // one warpgroup

// Core-matrix strides (bytes) of the operand tiles, see the top of the file.
constexpr std::uint32_t kLbo = 128;                     // next core matrix along K: always adjacent
constexpr std::uint32_t kSboQk = (kD / 8) * 128;        // Q, K: K = d, 16 core matrices per band
constexpr std::uint32_t kSboPv = (kBc / 8) * 128;       // P, V^T: K = keys, 8 core matrices per band
constexpr std::uint32_t kStepBytes = 2 * kLbo;          // one k-step of 16 = 2 core matrices along K

constexpr int kTileBytes = kBr * kD * 2;  // a 64 x 128 bf16 tile: Q, one K, one V stage, V^T
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;       // 2 buffers
constexpr int kOffV = kOffK + 2 * kTileBytes;   // 2 buffers, swizzled row-major (staging)
constexpr int kOffVt = kOffV + 2 * kTileBytes;
constexpr int kOffP = kOffVt + kTileBytes;
constexpr int kSmemBytes = kOffP + kBr * kBc * 2;  // 104 KiB
static_assert(kSmemBytes == 104 * 1024);
static_assert(kBr == 64 && kThreads == 128, "one warpgroup computes the 64 rows of one wgmma");

using Params = attention_detail::ForwardParams;

/// Rows [row0, row0 + 64) of a strided (token_stride elements) global (rows, 128) bf16 matrix into
/// a core-matrix tile with LBO 128, SBO 2048, by cp.async; rows >= row_end are zero-filled (and
/// nothing is read for them). Element (r, c) belongs at byte (r/8) * 2048 + (c/8) * 128 +
/// (r%8) * 16 + (c%8) * 2, so 16-byte chunk number n = (r/8) * 128 + (c/8) * 8 + r%8 of the tile
/// goes to byte 16 n: consecutive threads fill consecutive bytes, and each warp reads 8 rows x 64
/// contiguous bytes of global memory.
__device__ __forceinline__ void load_rows_kmajor(unsigned char* tile, const __nv_bfloat16* base,
                                                 std::int64_t token_stride, int row0, int row_end) {
#pragma unroll
  for (int i = 0; i < kBr * (kD / 8) / kThreads; ++i) {
    const int n = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = (n >> 7) * 8 + (n & 7);
    const int c = ((n >> 3) & 15) * 8;
    const bool valid = row0 + r < row_end;
    const __nv_bfloat16* src = valid ? base + static_cast<std::int64_t>(row0 + r) * token_stride + c : base;
    cp_async_16(tile + 16 * n, src, valid);
  }
}

/// V^T (128 d x 64 keys, core matrices with LBO 128, SBO 1024) from a staged V tile (64 keys x 128
/// d, row-major, XOR-swizzled as attention_detail::load_tile writes it). Core matrix (d-block db,
/// key-block kb) of V^T is the transpose of the 8x8 block (keys 8kb.., d 8db..) of V. ldmatrix
/// .trans hands lane l of the warp the elements (row 2(l%4) + {0, 1}, column l/4) of each 8x8
/// matrix it loads (PTX ISA, ldmatrix: with .trans the matrix is read column-major; the same fact
/// gemm_regs_nn in attention_common.cuh relies on), i.e. V[8kb + 2(l%4) + {0,1}][8db + l/4]: row
/// l/4, columns 2(l%4) + {0,1} of the transposed block, which in a core matrix (row = 16 bytes) is
/// byte 16 (l/4) + 4 (l%4) = 4 l. So each register goes to its core matrix at byte 4 l: 32 lanes
/// store 128 contiguous bytes. Warp w transposes d-blocks 4w..4w+3 of all 8 key blocks; the 8 row
/// addresses of one ldmatrix matrix fall in 8 different 16-byte bank groups (the swizzle).
__device__ __forceinline__ void transpose_v(unsigned char* vt, const __nv_bfloat16* vs) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int my_db = warp * 4 + (lane >> 3);  // lanes 8m..8m+7 address the rows of matrix m
#pragma unroll
  for (int kb = 0; kb < kBc / 8; ++kb) {
    std::uint32_t r[4];
    ldmatrix_x4_trans(r, smem_addr(vs + attention_detail::swizzle<kD>(kb * 8 + (lane & 7), my_db * 8)));
#pragma unroll
    for (int m = 0; m < 4; ++m)
      *reinterpret_cast<std::uint32_t*>(vt + (warp * 4 + m) * kSboPv + kb * kLbo + 4 * lane) = r[m];
  }
}

__global__ void __launch_bounds__(kThreads) attention_forward_wgmma_kernel(const Params p) {
#if OOM_WGMMA_SM90A
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* s_q = smem + kOffQ;
  unsigned char* s_k = smem + kOffK;
  auto* s_v = reinterpret_cast<__nv_bfloat16*>(smem + kOffV);
  unsigned char* s_vt = smem + kOffVt;
  unsigned char* s_p = smem + kOffP;
  const std::uint32_t a_q = smem_addr(s_q), a_k = smem_addr(s_k), a_vt = smem_addr(s_vt), a_p = smem_addr(s_p);

  // Heaviest (last, longest-prefix) query tiles first, as the mma.sync kernel does.
  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * kBr;
  const int q_last = min(q0 + kBr, p.q_end) - 1;  // last valid query row of the tile
  const int n_kv = q_last / kBc + 1;               // key tiles 0 .. the one holding q_last

  const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * kD;
  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * kD;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * kD;

  load_rows_kmajor(s_q, q_g, p.q_token, q0, p.q_end);
  load_rows_kmajor(s_k, k_g, p.k_token, 0, p.seq);
  attention_detail::load_tile<kBc, kD, kThreads>(s_v, v_g, p.v_token, 0, p.seq);
  cp_async_commit();

  // Accumulator fragments (wgmma.cuh): warp w, lane l holds rows r0 = 16w + l/4 (h = 0) and
  // r0 + 8 (h = 1) of the tile; of 8-column block j, columns 8j + 2(l%4) + {0, 1} in
  // acc[4j + 2h], acc[4j + 2h + 1].
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int r0 = 16 * warp + (lane >> 2);
  const int c0 = 2 * (lane & 3);

  float o[kD / 2];   // O, 64 x 128
  float s[kBc / 2];  // S, then P, 64 x 64
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) o[e] = 0.0f;
#pragma unroll
  for (int e = 0; e < kBc / 2; ++e) s[e] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max, log2 units
  float l_run[2] = {0.0f, 0.0f};            // running row sum, this lane's columns only

  for (int nb = 0; nb < n_kv; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_kv) {  // prefetch tile nb+1 into the other buffer (its readers all passed a barrier)
      load_rows_kmajor(s_k + (buf ^ 1) * kTileBytes, k_g, p.k_token, (nb + 1) * kBc, p.seq);
      attention_detail::load_tile<kBc, kD, kThreads>(s_v + (buf ^ 1) * kBc * kD, v_g, p.v_token, (nb + 1) * kBc,
                                                     p.seq);
    }
    cp_async_commit();
    cp_async_wait<1>();          // everything but the prefetch just issued has landed
    fence_proxy_async_shared();  // this thread's cp.async writes (Q, K) before the wgmma reads them
    __syncthreads();

    // 1. S = Q K^T: A = Q (64 x 128), B = K (64 keys x 128), both K-major over d.
    const std::uint32_t a_kbuf = a_k + static_cast<std::uint32_t>(buf) * kTileBytes;
    wgmma_fence_operands(s);
    wgmma_fence();  // the softmax of the previous tile accessed s
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      wgmma_m64n64k16_f32_bf16_ss(s, encode_smem_desc(a_q + ks * kStepBytes, kLbo, kSboQk),
                                  encode_smem_desc(a_kbuf + ks * kStepBytes, kLbo, kSboQk), ks > 0 ? 1 : 0);
    wgmma_commit_group();

    // 2. V^T of this tile while the tensor cores work (the previous P V, its last reader, was
    // waited for before the barrier above).
    transpose_v(s_vt, s_v + buf * kBc * kD);

    wgmma_wait_group<0>();
    wgmma_fence_operands(s);

    // 3. Causal mask (key j > query i) where the tile crosses the diagonal of some row.
    const int n0 = nb * kBc;
    if (n0 + kBc - 1 > q0) {
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = q0 + r0 + 8 * (e >> 1);
          const int key = n0 + 8 * j + c0 + (e & 1);
          if (key > i) s[4 * j + e] = -INFINITY;
        }
    }
    // Online softmax: m' = max(m, rowmax S), P = exp(S - m'), l' = e^(m - m') l + rowsum P,
    // O' = e^(m - m') O, in log2 units (scale * log2 e folded into one FMA).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hf], mx * p.scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: avoid inf - inf
      const float alpha = exp2f(m_run[hf] - m_use);
      m_run[hf] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(fmaf(s[4 * j + 2 * hf + e], p.scale_log2, -m_use));
          s[4 * j + 2 * hf + e] = pe;
          sum += pe;
        }
      l_run[hf] = l_run[hf] * alpha + sum;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        o[4 * j + 2 * hf] *= alpha;
        o[4 * j + 2 * hf + 1] *= alpha;
      }
      // P row r0 + 8 hf, columns 8j + c0 + {0, 1} (bf16, as the tensor cores take it): core matrix
      // (row band 2 warp + hf, key block j), row lane/4, byte 4 (lane%4): byte 4 lane of it.
      unsigned char* p_row = s_p + (2 * warp + hf) * kSboPv + 4 * lane;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
        *reinterpret_cast<std::uint32_t*>(p_row + j * kLbo) = pack_bf16(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]);
    }
    fence_proxy_async_shared();  // this thread's P and V^T stores before the wgmma reads them
    __syncthreads();

    // 4. O += P V: A = P (64 x 64 keys), B = V^T (128 d x 64 keys), both K-major over the keys.
    wgmma_fence_operands(o);
    wgmma_fence();  // o was rescaled above
#pragma unroll
    for (int ks = 0; ks < kBc / 16; ++ks)
      wgmma_m64n128k16_f32_bf16_ss(o, encode_smem_desc(a_p + ks * kStepBytes, kLbo, kSboPv),
                                   encode_smem_desc(a_vt + ks * kStepBytes, kLbo, kSboPv), 1);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(o);
    // No barrier here: P and V^T are next written after the barrier at the top of the next
    // iteration, which every warp reaches only after its own wait above.
  }

  // O = O / l, LSE = (m + log2 l) ln 2 for the valid rows.
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = l_run[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int i = q0 + r0 + 8 * hf;
    if (i < p.q_end) {
      __nv_bfloat16* dst = p.o + b * p.o_batch + static_cast<std::int64_t>(i) * p.o_token +
                           static_cast<std::int64_t>(h) * kD + c0;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
            __floats2bfloat162_rn(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
      if ((lane & 3) == 0)
        p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seq + i] =
            l > 0.0f ? (m_run[hf] + log2f(l)) * attention_detail::ln2 : -INFINITY;
    }
  }
#else
  (void)p;
  __trap();
#endif
}

}  // namespace

cudaError_t attention_forward_wgmma(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                    TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  bool empty = false;
  if (const cudaError_t e = forward_checks(p, kD, q, k, v, o, lse, &empty); e != cudaSuccess || empty) return e;

  const Params params = attention_detail::forward_params(p, q, k, v, o, lse);

  auto* kernel = attention_forward_wgmma_kernel;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess)
    return e;
  const int q_tiles = (params.q_end - params.q_begin + kBr - 1) / kBr;
  const dim3 grid(static_cast<unsigned>(q_tiles), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace oom::kernels::hopper
