// MoE router kernels and launchers; see oom/kernels/router.hpp.
#include "oom/kernels/router.hpp"

#include <cfloat>
#include <climits>

#include "moe_blas.cuh"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::block_sum;
using detail::gemm_rm;

constexpr int warps_per_block = 4;

__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per token: softmax into shared memory, then k rounds of a warp argmax (ties: lower
// index), each removing its winner. k <= 16 and E <= 1024 keep this a few hundred instructions.
__global__ void router_topk_kernel(const float* __restrict__ logits, float* __restrict__ probs,
                                   std::int32_t* __restrict__ ids, float* __restrict__ weights, std::int64_t tokens,
                                   int experts, int top_k, bool norm) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + warp;
  if (t >= tokens) return;  // no block-wide barrier below
  float* p = smem + warp * experts;
  const float* l = logits + t * experts;
  float m = -FLT_MAX;
  for (int e = lane; e < experts; e += 32) {
    p[e] = l[e];
    m = fmaxf(m, p[e]);
  }
  m = warp_max(m);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    p[e] = expf(p[e] - m);
    sum += p[e];
  }
  sum = warp_sum(sum);
  for (int e = lane; e < experts; e += 32) {
    p[e] = p[e] / sum;
    probs[t * experts + e] = p[e];
  }
  __syncwarp();
  int my_id = 0;
  float my_p = 0.0f, selected = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    float best = -1.0f;  // probabilities are >= 0; taken ones are set to -2
    int best_i = INT_MAX;
    for (int e = lane; e < experts; e += 32)
      if (p[e] > best) best = p[e], best_i = e;  // ascending e: strict > keeps the lower index
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
    }
    if (best_i == INT_MAX) best_i = j;  // NaN logits: keep ids in range, the NaN weight reports it
    if (lane == j) my_id = best_i, my_p = p[best_i];
    selected += p[best_i];
    __syncwarp();
    if (lane == 0) p[best_i] = -2.0f;
    __syncwarp();
  }
  if (lane < top_k) {
    ids[t * top_k + lane] = my_id;
    weights[t * top_k + lane] = norm ? my_p / selected : my_p;
  }
}

// One block per expert: the column sum of probs, times the expert's count (exact in fp32 up to 2^24).
__global__ void aux_partial_kernel(const float* __restrict__ probs, const std::int32_t* __restrict__ counts,
                                   float* __restrict__ partial, std::int64_t tokens, int experts) {
  __shared__ float scratch[32];
  const int e = blockIdx.x;
  float s = 0.0f;
  for (std::int64_t t = threadIdx.x; t < tokens; t += blockDim.x) s += probs[t * experts + e];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partial[e] = s * static_cast<float>(counts[e]);
}

__global__ void aux_final_kernel(const float* __restrict__ partial, float* __restrict__ aux, std::int64_t tokens,
                                 int experts) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) s += partial[e];
  s = block_sum(s, scratch);
  const float T = static_cast<float>(tokens);
  if (threadIdx.x == 0) *aux = static_cast<float>(experts) * (s / T) / T;
}

// The rows of router_probability_sums split into at most this many slabs, each summed by one
// block column; the slabs' count depends on T only, so the sums' order does too.
constexpr std::int64_t prob_sum_slabs = 256;
constexpr int prob_sum_rows_lanes = 8;  // threads a column within a block: rows y, y + 8, ...

std::int64_t prob_sum_slab_count(std::int64_t tokens) { return std::min<std::int64_t>(prob_sum_slabs, (tokens + 255) / 256); }

// Block (32, 8): 32 experts' columns, 8 row lanes over one slab of rows; the lanes' sums are added
// in lane order. Writes partial[slab * E + e].
__global__ void prob_sums_partial_kernel(const float* __restrict__ probs, double* __restrict__ partial, std::int64_t tokens,
                                         int experts, std::int64_t slab_rows) {
  __shared__ double lanes[prob_sum_rows_lanes][32];
  const int e = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * slab_rows;
  const std::int64_t end = min(tokens, begin + slab_rows);
  double s = 0.0;
  if (e < experts)
    for (std::int64_t t = begin + threadIdx.y; t < end; t += prob_sum_rows_lanes) s += static_cast<double>(probs[t * experts + e]);
  lanes[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && e < experts) {
    double total = 0.0;
    for (int y = 0; y < prob_sum_rows_lanes; ++y) total += lanes[y][threadIdx.x];
    partial[blockIdx.y * static_cast<std::int64_t>(experts) + e] = total;
  }
}

__global__ void prob_sums_final_kernel(const double* __restrict__ partial, double* __restrict__ sums, int slabs, int experts) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= experts) return;
  double total = 0.0;
  for (int b = 0; b < slabs; ++b) total += partial[static_cast<std::int64_t>(b) * experts + e];
  sums[e] += total;
}

// One thread: E <= 1024 products in expert order (the loss is read once a micro-batch).
__global__ void balance_loss_kernel(const std::int32_t* __restrict__ counts, const double* __restrict__ sums, double rows,
                                    double factor, double* __restrict__ loss, int experts) {
  double s = 0.0;
  for (int e = 0; e < experts; ++e) s += (static_cast<double>(counts[e]) / rows) * (sums[e] / rows);
  *loss = factor * static_cast<double>(experts) * s;
}

// One warp per token: d p from d weights (through renorm) plus the aux term, then softmax backward.
__global__ void router_backward_kernel(const float* __restrict__ probs, const std::int32_t* __restrict__ ids,
                                       const float* __restrict__ d_weights, const std::int32_t* __restrict__ counts,
                                       float aux_grad, float* __restrict__ d_logits, __nv_bfloat16* __restrict__ d_logits_bf16,
                                       std::int64_t tokens, int experts, int top_k, bool norm) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + warp;
  if (t >= tokens) return;
  float* dp = smem + warp * experts;
  const float* p = probs + t * experts;
  // d aux / d p[t, e] = E * counts[e] / T^2.
  const float aux_scale = aux_grad * static_cast<float>(experts) / (static_cast<float>(tokens) * static_cast<float>(tokens));
  for (int e = lane; e < experts; e += 32) dp[e] = aux_scale * static_cast<float>(counts[e]);
  __syncwarp();
  if (lane == 0) {  // k <= 16 slots: serial, and correct even if an id repeats
    const std::int32_t* id = ids + t * top_k;
    const float* dw = d_weights + t * top_k;
    if (norm) {
      float S = 0.0f, dot = 0.0f;
      for (int j = 0; j < top_k; ++j) S += p[id[j]];
      for (int j = 0; j < top_k; ++j) dot += dw[j] * (p[id[j]] / S);
      for (int j = 0; j < top_k; ++j) dp[id[j]] += (dw[j] - dot) / S;
    } else {
      for (int j = 0; j < top_k; ++j) dp[id[j]] += dw[j];
    }
  }
  __syncwarp();
  float pdp = 0.0f;
  for (int e = lane; e < experts; e += 32) pdp += p[e] * dp[e];
  pdp = warp_sum(pdp);
  for (int e = lane; e < experts; e += 32) {
    const float g = p[e] * (dp[e] - pdp);
    d_logits[t * experts + e] = g;
    d_logits_bf16[t * experts + e] = __float2bfloat16(g);
  }
}

/// cudaSuccess for a shape the router kernels take, else a refusal naming the field.
cudaError_t check_shape(const char* name, const RouterShape& s) {
  if (s.tokens < 0 || s.tokens > INT_MAX) return detail::refuse(name, ": tokens = ", s.tokens, " (must be 0 .. 2^31 - 1)");
  if (s.hidden < 1 || s.hidden > INT_MAX) return detail::refuse(name, ": hidden = ", s.hidden, " (must be 1 .. 2^31 - 1)");
  if (s.experts < 1 || s.experts > router_max_experts)
    return detail::refuse(name, ": experts = ", s.experts, " (must be 1 .. ", router_max_experts, ")");
  if (s.top_k < 1 || s.top_k > s.experts || s.top_k > router_max_top_k)
    return detail::refuse(name, ": top_k = ", s.top_k, " (must be 1 .. min(experts = ", s.experts, ", ", router_max_top_k,
                          "))");
  return cudaSuccess;
}

unsigned token_blocks(std::int64_t tokens) { return static_cast<unsigned>((tokens + warps_per_block - 1) / warps_per_block); }

}  // namespace

cudaError_t router_forward(cublasHandle_t blas, cudaStream_t stream, const RouterShape& s, const bf16* x,
                           const bf16* w_router, float* logits, float* probs, std::int32_t* expert_ids, float* weights) {
  OOM_KERNEL_TRY(check_shape("router_forward", s));
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("router_forward", {{"blas", blas}, {"x", x}, {"w_router", w_router}, {"logits", logits},
                                                        {"probs", probs}, {"expert_ids", expert_ids}, {"weights", weights}}));
  OOM_KERNEL_TRY(detail::to_cuda_error(cublasSetStream(blas, stream)));
  // logits (T, E) = x (T, H) . Wr^T, Wr stored (E, H).
  OOM_KERNEL_TRY(gemm_rm(blas, false, true, s.tokens, s.experts, s.hidden, x, s.hidden, w_router, s.hidden, logits,
                         CUDA_R_32F, s.experts, 0.0f));
  const std::size_t smem = warps_per_block * s.experts * sizeof(float);
  router_topk_kernel<<<token_blocks(s.tokens), warps_per_block * 32, smem, stream>>>(
      logits, probs, expert_ids, weights, s.tokens, static_cast<int>(s.experts), static_cast<int>(s.top_k), s.norm_topk_prob);
  return cudaGetLastError();
}

std::size_t router_aux_loss_workspace_bytes(const RouterShape& s) { return detail::align_up(s.experts * sizeof(float)); }

cudaError_t router_aux_loss(cudaStream_t stream, const RouterShape& s, const float* probs, const std::int32_t* expert_counts,
                            float* aux_loss, void* workspace, std::size_t workspace_bytes) {
  OOM_KERNEL_TRY(check_shape("router_aux_loss", s));
  if (const std::size_t need = router_aux_loss_workspace_bytes(s); workspace_bytes < need)
    return detail::refuse_workspace("router_aux_loss", workspace, workspace_bytes, need,
                                    "router_aux_loss_workspace_bytes");
  if (aux_loss == nullptr) return detail::refuse("router_aux_loss: aux_loss is null");
  if (s.tokens == 0) return cudaMemsetAsync(aux_loss, 0, sizeof(float), stream);
  OOM_KERNEL_TRY(detail::refuse_null("router_aux_loss",
                                     {{"probs", probs}, {"expert_counts", expert_counts}, {"workspace", workspace}}));
  auto* partial = static_cast<float*>(workspace);
  aux_partial_kernel<<<static_cast<unsigned>(s.experts), 256, 0, stream>>>(probs, expert_counts, partial, s.tokens,
                                                                           static_cast<int>(s.experts));
  aux_final_kernel<<<1, 256, 0, stream>>>(partial, aux_loss, s.tokens, static_cast<int>(s.experts));
  return cudaGetLastError();
}

std::size_t router_probability_sums_workspace_bytes(const RouterShape& s) {
  return detail::align_up(static_cast<std::size_t>(prob_sum_slabs * s.experts) * sizeof(double));
}

cudaError_t router_probability_sums(cudaStream_t stream, const RouterShape& s, const float* probs, double* sums, void* workspace,
                                    std::size_t workspace_bytes) {
  OOM_KERNEL_TRY(check_shape("router_probability_sums", s));
  if (const std::size_t need = router_probability_sums_workspace_bytes(s); workspace_bytes < need)
    return detail::refuse_workspace("router_probability_sums", workspace, workspace_bytes, need,
                                    "router_probability_sums_workspace_bytes");
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("router_probability_sums", {{"probs", probs}, {"sums", sums}, {"workspace", workspace}}));
  const std::int64_t slabs = prob_sum_slab_count(s.tokens), slab_rows = (s.tokens + slabs - 1) / slabs;
  auto* partial = static_cast<double*>(workspace);
  const int E = static_cast<int>(s.experts);
  prob_sums_partial_kernel<<<dim3(static_cast<unsigned>((E + 31) / 32), static_cast<unsigned>(slabs)), dim3(32, prob_sum_rows_lanes), 0,
                             stream>>>(probs, partial, s.tokens, E, slab_rows);
  OOM_KERNEL_TRY(cudaGetLastError());
  prob_sums_final_kernel<<<static_cast<unsigned>((E + 127) / 128), 128, 0, stream>>>(partial, sums, static_cast<int>(slabs), E);
  return cudaGetLastError();
}

cudaError_t router_balance_loss(cudaStream_t stream, std::int64_t experts, const std::int32_t* counts, const double* sums, double rows,
                                double factor, double* loss) {
  if (experts < 1 || experts > router_max_experts)
    return detail::refuse("router_balance_loss: ", experts, " experts (1 to ", router_max_experts, ")");
  if (!(rows > 0)) return detail::refuse("router_balance_loss: ", rows, " rows (must be positive)");
  OOM_KERNEL_TRY(detail::refuse_null("router_balance_loss", {{"counts", counts}, {"sums", sums}, {"loss", loss}}));
  balance_loss_kernel<<<1, 1, 0, stream>>>(counts, sums, rows, factor, loss, static_cast<int>(experts));
  return cudaGetLastError();
}

std::size_t router_backward_workspace_bytes(const RouterShape& s) {
  return detail::align_up(static_cast<std::size_t>(s.tokens * s.experts) * sizeof(__nv_bfloat16));
}

cudaError_t router_backward(cublasHandle_t blas, cudaStream_t stream, const RouterShape& s, const bf16* x,
                            const bf16* w_router, const float* probs, const std::int32_t* expert_ids,
                            const float* d_weights, const std::int32_t* expert_counts, float aux_loss_grad,
                            float* d_logits, bf16* dx, bool accumulate_dx, float* dw_router, void* workspace,
                            std::size_t workspace_bytes) {
  OOM_KERNEL_TRY(check_shape("router_backward", s));
  if (const std::size_t need = router_backward_workspace_bytes(s); workspace_bytes < need)
    return detail::refuse_workspace("router_backward", workspace, workspace_bytes, need,
                                    "router_backward_workspace_bytes");
  if (s.tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("router_backward", {{"blas", blas}, {"x", x}, {"w_router", w_router}, {"probs", probs},
                                                         {"expert_ids", expert_ids}, {"d_weights", d_weights},
                                                         {"expert_counts", expert_counts}, {"d_logits", d_logits},
                                                         {"dx", dx}, {"dw_router", dw_router}, {"workspace", workspace}}));
  auto* dl16 = static_cast<__nv_bfloat16*>(workspace);
  const std::size_t smem = warps_per_block * s.experts * sizeof(float);
  router_backward_kernel<<<token_blocks(s.tokens), warps_per_block * 32, smem, stream>>>(
      probs, expert_ids, d_weights, expert_counts, aux_loss_grad, d_logits, dl16, s.tokens, static_cast<int>(s.experts),
      static_cast<int>(s.top_k), s.norm_topk_prob);
  OOM_KERNEL_TRY(cudaGetLastError());
  OOM_KERNEL_TRY(detail::to_cuda_error(cublasSetStream(blas, stream)));
  // dx (T, H) = d logits (T, E) . Wr (E, H)
  OOM_KERNEL_TRY(gemm_rm(blas, false, false, s.tokens, s.hidden, s.experts, dl16, s.experts, w_router, s.hidden, dx,
                         CUDA_R_16BF, s.hidden, accumulate_dx ? 1.0f : 0.0f));
  // dWr (E, H) += d logits^T (E, T) . x (T, H)
  return gemm_rm(blas, true, false, s.experts, s.hidden, s.tokens, dl16, s.experts, x, s.hidden, dw_router, CUDA_R_32F,
                 s.hidden, 1.0f);
}

}  // namespace oom::kernels
