// Causal GQA attention forward, FlashAttention-2 (Dao 2023, Algorithm 1): one thread block per
// (query block, query head, batch); each warp owns 16 * M_TILES query rows and keeps its O
// accumulator and running softmax statistics (m, l) in registers while the block streams K/V
// blocks 0 .. diagonal through double-buffered shared memory (cp.async prefetch of block j+1 while
// block j is multiplied). O is normalised once at the end; LSE = m + log(l) is kept for backward.
//
// Tiles (each warp owns 16 query rows; ptxas -v for sm_90 with nvcc 13.0 in brackets):
//   D = 128: 8 warps, BR = 128 query rows, BC = 64 keys; smem Q 32 KiB + 2 x (K, V) 64 KiB =
//            96 KiB; [194 registers, no spills] -> 1 block (8 warps) per SM. (4 warps x 32 rows
//            spilled 272 bytes at the 255-register cap.)
//   D = 256: 4 warps, BR = 64, BC = 32 (the O accumulator alone is 128 registers); smem Q 32 KiB
//            + 2 x (K, V) 64 KiB = 96 KiB; [253 registers, no spills] -> 2 blocks per SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_paths.hpp"
#include "oom/kernels/attention.hpp"
#if OOM_HAS_SM90A_KERNELS
#include "hopper/attention_wgmma.hpp"
#endif

namespace oom::kernels {
namespace attention_detail {
namespace {

template <int D, int M_TILES, int BC, int WARPS>
struct ForwardTiles {
  static constexpr int threads = WARPS * 32;
  static constexpr int rows_per_warp = 16 * M_TILES;
  static constexpr int br = WARPS * rows_per_warp;
  static constexpr int smem_bytes = (br * D + 4 * BC * D) * 2;  // Q + 2 x (K, V)
};

template <int D, int M_TILES, int BC, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, 8 / WARPS) attention_forward_kernel(const ForwardParams p) {
  using Tiles = ForwardTiles<D, M_TILES, BC, WARPS>;
  constexpr int BR = Tiles::br, THREADS = Tiles::threads, N_TILES = BC / 8, D_TILES = D / 8;
  static_assert(BC % 16 == 0 && D % 64 == 0, "tiles must be whole mma k-steps and swizzle groups");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (BR, D)
  __nv_bfloat16* s_k = s_q + BR * D;                        // 2 x (BC, D)
  __nv_bfloat16* s_v = s_k + 2 * BC * D;                    // 2 x (BC, D)

  // Heaviest (last, longest-prefix) query blocks first: better tail balance under the causal mask.
  const int qb = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int hk = h / p.group;
  const int q0 = p.q_begin + qb * BR;
  const int q_last = min(q0 + BR, p.q_end) - 1;  // last valid query row of the block
  const int n_kv = q_last / BC + 1;               // key blocks 0 .. the one holding q_last

  const __nv_bfloat16* q_g = p.q + b * p.q_batch + static_cast<std::int64_t>(h) * D;
  const __nv_bfloat16* k_g = p.k + b * p.k_batch + static_cast<std::int64_t>(hk) * D;
  const __nv_bfloat16* v_g = p.v + b * p.v_batch + static_cast<std::int64_t>(hk) * D;

  load_tile<BR, D, THREADS>(s_q, q_g, p.q_token, q0, p.q_end);
  load_tile<BC, D, THREADS>(s_k, k_g, p.k_token, 0, p.seq);
  load_tile<BC, D, THREADS>(s_v, v_g, p.v_token, 0, p.seq);
  cp_async_commit();

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_w = warp * Tiles::rows_per_warp;  // block-local first row of this warp
  const int warp_q_last = q0 + row_w + Tiles::rows_per_warp - 1;

  float o_acc[M_TILES][D_TILES][4];
  zero(o_acc);
  float m_run[M_TILES][2], l_run[M_TILES][2];  // running max (log2 units) and partial row sum
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      m_run[mt][hf] = -INFINITY;
      l_run[mt][hf] = 0.0f;
    }

  for (int nb = 0; nb < n_kv; ++nb) {
    const int buf = nb & 1;
    if (nb + 1 < n_kv) {  // prefetch block nb+1 into the other buffer (freed by the last barrier)
      load_tile<BC, D, THREADS>(s_k + (buf ^ 1) * BC * D, k_g, p.k_token, (nb + 1) * BC, p.seq);
      load_tile<BC, D, THREADS>(s_v + (buf ^ 1) * BC * D, v_g, p.v_token, (nb + 1) * BC, p.seq);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the prefetch just issued has landed
    __syncthreads();

    const int n0 = nb * BC;
    if (n0 <= warp_q_last) {  // else every key of the block is masked for this warp's rows
      // S = Q K_j^T (Algorithm 1, line 8)
      float s[M_TILES][N_TILES][4];
      zero(s);
      gemm_smem_nt<M_TILES, N_TILES, D>(s, smem_addr(s_q), row_w, smem_addr(s_k + buf * BC * D), 0);

      if (n0 + BC - 1 > q0 + row_w) {  // the block crosses the diagonal of some row: mask j > i
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
          for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = q0 + row_w + mt * 16 + g + 8 * (e >> 1);
              const int j = n0 + nt * 8 + 2 * t + (e & 1);
              if (j > i) s[mt][nt][e] = -INFINITY;
            }
      }

      // Online softmax (lines 9-10): m' = max(m, rowmax S), P = exp(S - m'), l' = e^(m - m') l +
      // rowsum P, O' = e^(m - m') O. Each row lives in a quad of 4 lanes; l stays per-lane partial
      // until the end (the rescale factor is the same on all 4 lanes).
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < N_TILES; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][hf], mx * p.scale_log2);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: avoid inf - inf
          const float alpha = exp2f(m_run[mt][hf] - m_use);
          m_run[mt][hf] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pe = exp2f(fmaf(s[mt][nt][2 * hf + e], p.scale_log2, -m_use));
              s[mt][nt][2 * hf + e] = pe;
              sum += pe;
            }
          l_run[mt][hf] = l_run[mt][hf] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < D_TILES; ++dt) {
            o_acc[mt][dt][2 * hf] *= alpha;
            o_acc[mt][dt][2 * hf + 1] *= alpha;
          }
        }

      // O += P V_j (line 10), P rounded to bf16 as the tensor cores take it.
      std::uint32_t p_frag[M_TILES][BC / 16][4];
      pack_a(p_frag, s);
      gemm_regs_nn<M_TILES, BC / 16, D_TILES, D>(o_acc, p_frag, smem_addr(s_v + buf * BC * D), 0, 0);
    }
    __syncthreads();  // all warps are done with buffer `buf` before it is refilled
  }

  // O = O / l, LSE = m + log l (lines 12-13), converted from log2 to natural units.
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = l_run[mt][hf];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
      for (int dt = 0; dt < D_TILES; ++dt) {
        o_acc[mt][dt][2 * hf] *= inv;
        o_acc[mt][dt][2 * hf + 1] *= inv;
      }
      const int i = q0 + row_w + mt * 16 + g + 8 * hf;
      if (t == 0 && i < p.q_end)
        p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seq + i] =
            l > 0.0f ? (m_run[mt][hf] + log2f(l)) * ln2 : -INFINITY;
    }
  store_rows(o_acc, p.o + b * p.o_batch + static_cast<std::int64_t>(h) * D, p.o_token, q0 + row_w, p.q_end, 1.0f);
}

template <int D, int M_TILES, int BC, int WARPS>
cudaError_t launch_forward(const ForwardParams& params, int batch, cudaStream_t stream) {
  using Tiles = ForwardTiles<D, M_TILES, BC, WARPS>;
  auto* kernel = attention_forward_kernel<D, M_TILES, BC, WARPS>;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tiles::smem_bytes);
      e != cudaSuccess)
    return e;
  const int q_blocks = (params.q_end - params.q_begin + Tiles::br - 1) / Tiles::br;
  const dim3 grid(static_cast<unsigned>(q_blocks), static_cast<unsigned>(params.heads_q), static_cast<unsigned>(batch));
  kernel<<<grid, Tiles::threads, Tiles::smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace
}  // namespace attention_detail

bool attention_can_implement(const AttentionProblem& p) { return attention_detail::problem_issue(p).empty(); }

cudaError_t attention_forward_mma_sync(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                       TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
  using namespace attention_detail;
  if (const cudaError_t e = check_problem("attention_forward", p); e != cudaSuccess) return e;
  if (p.query_end() == p.q_begin) return cudaSuccess;
  if (const cudaError_t e = check_forward_args("attention_forward", q, k, v, o, lse); e != cudaSuccess) return e;
  const ForwardParams params = forward_params(p, q, k, v, o, lse);
  if (p.head_dim == 128) return launch_forward<128, 1, 64, 8>(params, p.batch, stream);
  return launch_forward<256, 1, 32, 4>(params, p.batch, stream);
}

cudaError_t attention_forward(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                              TokenRows<const bf16> v, TokenRows<bf16> o, float* lse, cudaStream_t stream) {
#if OOM_HAS_SM90A_KERNELS
  // The wgmma kernels (one template at head_dim 128 and 256: 2.2-2.9x this file's on an H200;
  // docs/hopper.md) refuse with cudaErrorNotSupported exactly when they have no code for
  // the case (a device other than compute capability 9.0); every other result, an error included,
  // is the answer.
  if (p.head_dim == 128 || p.head_dim == 256) {
    const cudaError_t e = p.head_dim == 128 ? hopper::attention_forward_wgmma(p, q, k, v, o, lse, stream)
                                            : hopper::attention_forward_wgmma_d256(p, q, k, v, o, lse, stream);
    if (e != cudaErrorNotSupported) return e;
  }
#endif
  return attention_forward_mma_sync(p, q, k, v, o, lse, stream);
}

}  // namespace oom::kernels
