// The per-warpgroup steps of the wgmma flash-attention forwards (attention_forward_wgmma_2wg.cu at
// head_dim 128, attention_forward_wgmma_d256.cu at 256), on their accumulator fragments
// (wgmma.cuh): warp w of the warpgroup, lane l holds rows r0 = 16w + l/4 (hf = 0) and r0 + 8
// (hf = 1) of the warpgroup's 64; of 8-column block j, columns 8j + 2(l%4) + {0, 1} in
// acc[4j + 2hf], acc[4j + 2hf + 1]. rescale takes O as its D / 2 floats in column-block order (a
// 64 x 256 O held as two m64n128 accumulators o[2][64] is o[0] then o[1], so block j of the flat
// array is columns 8j .. 8j + 7 either way); store takes either form (o_at). Private to the kernels.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "../attention_common.cuh"

namespace oom::kernels::hopper::forward_steps {

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

/// O *= alpha per row (D / 2 floats, see the top of the file).
template <int D>
__device__ __forceinline__ void rescale(float* o, const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e >> 1];
}

/// P (in s) rounded to bf16 into the RS A fragments: k-step ks covers keys 16ks .. 16ks+15 =
/// column blocks 2ks, 2ks+1 of the fragment; pa[ks][0] = (row r0, block 2ks), [1] = (row r0+8,
/// block 2ks), [2] = (row r0, block 2ks+1), [3] = (row r0+8, block 2ks+1), the lower column in the
/// low half (wgmma.cuh).
template <int BC>
__device__ __forceinline__ void pack_p(std::uint32_t (&pa)[BC / 16][4], const float (&s)[BC / 2]) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ++ks) {
    pa[ks][0] = attention_detail::pack_bf16(s[8 * ks + 0], s[8 * ks + 1]);
    pa[ks][1] = attention_detail::pack_bf16(s[8 * ks + 2], s[8 * ks + 3]);
    pa[ks][2] = attention_detail::pack_bf16(s[8 * ks + 4], s[8 * ks + 5]);
    pa[ks][3] = attention_detail::pack_bf16(s[8 * ks + 6], s[8 * ks + 7]);
  }
}

/// Column block j (columns 8j .. 8j + 7) of O's fragment, element e: O held as one accumulator
/// (float[64], head_dim 128) or as m64n128 halves (float[H][64], head_dim 128 H).
__device__ __forceinline__ float o_at(const float (&o)[64], int j, int e) { return o[4 * j + e]; }
template <int H>
__device__ __forceinline__ float o_at(const float (&o)[H][64], int j, int e) {
  return o[j / 16][4 * (j % 16) + e];
}

/// O = O / l (bf16) and LSE = (m + log2 l) ln 2 of the thread's two rows i0 and i0 + 8 (absolute
/// query rows) where they are valid (< q_end); c0 = 2 (lane % 4), the thread's first column.
template <int D, class O>
__device__ __forceinline__ void store(const O& o, const float (&m_run)[2], const float (&l_run)[2],
                                      const attention_detail::ForwardParams& p, int b, int h, int i0, int c0, int lane) {
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
            __floats2bfloat162_rn(o_at(o, j, 2 * hf) * inv, o_at(o, j, 2 * hf + 1) * inv);
      if ((lane & 3) == 0)
        p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seq + i] =
            l > 0.0f ? (m_run[hf] + log2f(l)) * attention_detail::ln2 : -INFINITY;
    }
  }
}

}  // namespace oom::kernels::hopper::forward_steps
