// What the two causal GQA attention backwards share (attention_backward.cu, the mma.sync product
// kernels, and hopper/attention_backward_wgmma.cu): the kernel parameters, the workspace layout and
// its preprocess pass, and the argument checks. Both backwards run the same preprocess kernel into
// the same workspace (attention_backward_workspace_bytes), so their dK/dV and dQ passes read the
// same D_i and LSE_i * log2(e). Private to the kernels (not installed).
//
// Workspace, (B, Hq, q_end - q_begin) fp32 twice, each half 256-byte aligned:
//   delta = workspace:          D_i = rowsum(dO_i o O_i)
//   lse2  = workspace + half:   LSE_i * log2(e)
// entry (b, h, i) at (b Hq + h)(q_end - q_begin) + (i - q_begin).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::attention_detail {

struct BackwardParams {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const __nv_bfloat16* o;
  const __nv_bfloat16* d_o;
  const float* lse;  // (B, Hq, S)
  __nv_bfloat16* dq;
  __nv_bfloat16* dk;  // null where dK/dV go to the fp32 sums below
  __nv_bfloat16* dv;
  float* dk_sum;      // attention_backward_dkv_sum: dK/dV added here in fp32 (dk_batch ... dv_token
  float* dv_sum;      // then stride these); null otherwise
  float* delta;  // workspace (B, Hq, q_len): D_i = rowsum(dO o O)
  float* lse2;   // workspace (B, Hq, q_len): LSE_i * log2(e)
  std::int64_t q_batch, q_token, k_batch, k_token, v_batch, v_token, o_batch, o_token, do_batch, do_token;
  std::int64_t dq_batch, dq_token, dk_batch, dk_token, dv_batch, dv_token;
  int seq, heads_q, group, q_begin, q_end;
  float scale;       // softmax scale: dQ = scale dS K, dK = scale dS^T Q
  float scale_log2;  // softmax scale * log2(e)
  bool accumulate_dkv;
  // attention_backward_fused_dq only (workspace): dQ / scale in fp32, (B, Hq, q_tiles * BR, D), and
  // its counters, (B, Hq, q_tiles, D_SPLIT): how many key blocks have added to a (query tile, half).
  float* dq_acc;
  unsigned* dq_count;
  [[nodiscard]] __host__ __device__ int q_len() const { return q_end - q_begin; }
};

inline std::size_t round_up_256(std::size_t n) { return (n + 255) / 256 * 256; }

/// The backward's tensors as check_rows (dk, dv: bf16 outputs or fp32 sums), lse not null, and a
/// 256-byte aligned workspace of at least `workspace_needed` bytes (what `workspace_call`
/// returns); else a refusal naming which.
template <class G>
inline cudaError_t check_backward_args(const char* name, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                       TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                       const float* lse, TokenRows<bf16> dq, TokenRows<G> dk, TokenRows<G> dv,
                                       const void* workspace, std::size_t workspace_bytes, std::size_t workspace_needed,
                                       const char* workspace_call) {
  using ::oom::kernels::detail::refuse;
  for (const auto& [tensor, rows] :
       {std::pair{"q", q}, std::pair{"k", k}, std::pair{"v", v}, std::pair{"o", o}, std::pair{"d_o", d_o}})
    if (const cudaError_t e = check_rows(name, tensor, rows); e != cudaSuccess) return e;
  if (const cudaError_t e = check_rows(name, "dq", dq); e != cudaSuccess) return e;
  for (const auto& [tensor, rows] : {std::pair{"dk", dk}, std::pair{"dv", dv}})
    if (const cudaError_t e = check_rows(name, tensor, rows); e != cudaSuccess) return e;
  if (lse == nullptr) return refuse(name, ": lse is null");
  if (workspace == nullptr || workspace_bytes < workspace_needed)
    return ::oom::kernels::detail::refuse_workspace(name, workspace, workspace_bytes, workspace_needed, workspace_call);
  if (reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0) return refuse(name, ": workspace is not 256-byte aligned");
  return cudaSuccess;
}

inline BackwardParams backward_params(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                      TokenRows<const bf16> v, TokenRows<const bf16> o, TokenRows<const bf16> d_o,
                                      const float* lse, TokenRows<bf16> dq, TokenRows<bf16> dk, TokenRows<bf16> dv,
                                      bool accumulate_dkv, void* workspace) {
  BackwardParams params{};
  params.q = reinterpret_cast<const __nv_bfloat16*>(q.data);
  params.k = reinterpret_cast<const __nv_bfloat16*>(k.data);
  params.v = reinterpret_cast<const __nv_bfloat16*>(v.data);
  params.o = reinterpret_cast<const __nv_bfloat16*>(o.data);
  params.d_o = reinterpret_cast<const __nv_bfloat16*>(d_o.data);
  params.lse = lse;
  params.dq = reinterpret_cast<__nv_bfloat16*>(dq.data);
  params.dk = reinterpret_cast<__nv_bfloat16*>(dk.data);
  params.dv = reinterpret_cast<__nv_bfloat16*>(dv.data);
  const std::size_t half = attention_backward_workspace_bytes(p) / 2;
  params.delta = static_cast<float*>(workspace);
  params.lse2 = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + half);
  params.q_batch = q.batch_stride;
  params.q_token = q.token_stride;
  params.k_batch = k.batch_stride;
  params.k_token = k.token_stride;
  params.v_batch = v.batch_stride;
  params.v_token = v.token_stride;
  params.o_batch = o.batch_stride;
  params.o_token = o.token_stride;
  params.do_batch = d_o.batch_stride;
  params.do_token = d_o.token_stride;
  params.dq_batch = dq.batch_stride;
  params.dq_token = dq.token_stride;
  params.dk_batch = dk.batch_stride;
  params.dk_token = dk.token_stride;
  params.dv_batch = dv.batch_stride;
  params.dv_token = dv.token_stride;
  params.seq = p.seq;
  params.heads_q = p.heads_q;
  params.group = p.heads_q / p.heads_kv;
  params.q_begin = p.q_begin;
  params.q_end = p.query_end();
  params.scale = p.softmax_scale;
  params.scale_log2 = p.softmax_scale * log2e;
  params.accumulate_dkv = accumulate_dkv;
  return params;
}

/// `params` (of backward_params, any dk/dv) made to add dK/dV into `sums` in fp32.
inline BackwardParams with_sums(BackwardParams params, const AttentionDkvSums& sums) {
  params.dk = nullptr;
  params.dv = nullptr;
  params.dk_sum = sums.dk.data;
  params.dv_sum = sums.dv.data;
  params.dk_batch = sums.dk.batch_stride;
  params.dk_token = sums.dk.token_stride;
  params.dv_batch = sums.dv.batch_stride;
  params.dv_token = sums.dv.token_stride;
  params.accumulate_dkv = true;
  return params;
}

namespace {  // kernels: internal linkage, one copy per translation unit that launches them

// ---- 1. preprocess: one warp per (b, h, i), each lane D/32 elements ----

template <int D>
__global__ void __launch_bounds__(256) attention_backward_preprocess_kernel(const BackwardParams p) {
  constexpr int per_lane = D / 32;  // 4 or 8 bf16: one 8- or 16-byte load
  using Vec = std::conditional_t<per_lane == 8, uint4, uint2>;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= static_cast<std::int64_t>(p.heads_q) * p.q_len()) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int b = static_cast<int>(blockIdx.y);
  const int h = static_cast<int>(row % p.heads_q);
  const int i = p.q_begin + static_cast<int>(row / p.heads_q);  // heads of a token are adjacent in memory
  const std::int64_t col = static_cast<std::int64_t>(h) * D + lane * per_lane;
  const Vec o_vec = *reinterpret_cast<const Vec*>(p.o + b * p.o_batch + i * p.o_token + col);
  const Vec do_vec = *reinterpret_cast<const Vec*>(p.d_o + b * p.do_batch + i * p.do_token + col);
  const auto* o2 = reinterpret_cast<const __nv_bfloat162*>(&o_vec);
  const auto* do2 = reinterpret_cast<const __nv_bfloat162*>(&do_vec);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < per_lane / 2; ++e) {
    const float2 a = __bfloat1622float2(o2[e]), c = __bfloat1622float2(do2[e]);
    sum = fmaf(a.x, c.x, fmaf(a.y, c.y, sum));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const std::int64_t w = (static_cast<std::int64_t>(b) * p.heads_q + h) * p.q_len() + (i - p.q_begin);
    p.delta[w] = sum;
    p.lse2[w] = p.lse[(static_cast<std::int64_t>(b) * p.heads_q + h) * p.seq + i] * log2e;
  }
}

/// Pass 1 of either backward: D and LSE2 for rows [q_begin, q_end) of every (batch, query head)
/// into the workspace `params` points at.
template <int D>
cudaError_t launch_backward_preprocess(const BackwardParams& params, int batch, cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(params.heads_q) * params.q_len();
  const dim3 grid(static_cast<unsigned>((rows + 7) / 8), static_cast<unsigned>(batch));
  attention_backward_preprocess_kernel<D><<<grid, 256, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace
}  // namespace oom::kernels::attention_detail
