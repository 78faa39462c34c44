// Expert GEMMs (per-expert loop or cuBLAS grouped batched) and the shared expert gate; see
// oom/kernels/expert_gemm.hpp.
#include "oom/kernels/expert_gemm.hpp"

#include <algorithm>
#include <climits>
#include <vector>

#include "moe_blas.cuh"

namespace oom::kernels {
namespace {

using detail::align_up;
using detail::block_sum;
using detail::to_cuda_error;

/// One row-major GEMM of one expert: C (m, n) = op(A) op(B) (see detail::gemm_rm).
struct Problem {
  bool trans_a, trans_b;
  std::int64_t m, n, k;
  const void* a;
  std::int64_t lda;
  const void* b;
  std::int64_t ldb;
  void* c;
  std::int64_t ldc;
};

std::size_t pointer_array_bytes(std::int64_t experts) { return align_up(3 * static_cast<std::size_t>(experts) * sizeof(void*)); }

/// Runs every problem with the same C type and beta. `slot` picks a separate pointer-array region
/// for the second call of a launcher, so no copy overwrites arrays a queued GEMM still reads.
cudaError_t run(cublasHandle_t blas, cudaStream_t stream, const std::vector<Problem>& ps, cudaDataType_t c_type, float beta,
                ExpertGemmMethod method, void* workspace, std::int64_t experts, int slot) {
  if (ps.empty()) return cudaSuccess;
  OOM_KERNEL_TRY(to_cuda_error(cublasSetStream(blas, stream)));
  if (method == ExpertGemmMethod::per_expert_loop) {
    for (const auto& p : ps)
      OOM_KERNEL_TRY(detail::gemm_rm(blas, p.trans_a, p.trans_b, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.c, c_type, p.ldc, beta));
    return cudaSuccess;
  }
  // Grouped: one group of one problem per expert, in cuBLAS' column-major terms (C^T = op(B)^T op(A)^T).
  const int g = static_cast<int>(ps.size());
  std::vector<cublasOperation_t> ta(g), tb(g);
  std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), size(g, 1);
  std::vector<float> alpha(g, 1.0f), betas(g, beta);
  std::vector<const void*> ptrs(3 * static_cast<std::size_t>(g));
  for (int i = 0; i < g; ++i) {
    const auto& p = ps[i];
    ta[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    tb[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = static_cast<int>(p.n);
    n[i] = static_cast<int>(p.m);
    k[i] = static_cast<int>(p.k);
    lda[i] = static_cast<int>(p.ldb);
    ldb[i] = static_cast<int>(p.lda);
    ldc[i] = static_cast<int>(p.ldc);
    ptrs[i] = p.b;
    ptrs[g + i] = p.a;
    ptrs[2 * g + i] = p.c;
  }
  auto* arrays = reinterpret_cast<const void**>(static_cast<char*>(workspace) + slot * pointer_array_bytes(experts));
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `ptrs` may die after it.
  OOM_KERNEL_TRY(cudaMemcpyAsync(arrays, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
  return to_cuda_error(cublasGemmGroupedBatchedEx(
      blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), arrays, CUDA_R_16BF, lda.data(), arrays + g,
      CUDA_R_16BF, ldb.data(), betas.data(), const_cast<void* const*>(arrays + 2 * g), c_type, ldc.data(), g, size.data(),
      CUBLAS_COMPUTE_32F));
}

bool valid(const ExpertGemmShape& s, const std::int32_t* counts_host, ExpertGemmMethod method, void* workspace,
           std::size_t workspace_bytes) {
  if (s.hidden < 1 || s.intermediate < 1 || s.experts < 1 || counts_host == nullptr) return false;
  if (2 * s.intermediate > INT_MAX || s.hidden > INT_MAX) return false;
  if (method == ExpertGemmMethod::grouped_batched && (workspace == nullptr || workspace_bytes < expert_gemm_workspace_bytes(s)))
    return false;
  std::int64_t rows = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    if (counts_host[e] < 0) return false;
    rows += counts_host[e];
  }
  return rows <= INT_MAX;
}

/// Calls f(e, first_row, rows) for each expert with rows.
template <class F>
void for_each_expert(const ExpertGemmShape& s, const std::int32_t* counts_host, F&& f) {
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    if (counts_host[e] > 0) f(e, r, static_cast<std::int64_t>(counts_host[e]));
    r += counts_host[e];
  }
}

// One block per token: z = x . w_gate (fp32), out = routed + sigmoid(z) y.
__global__ void shared_gate_forward_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate,
                                           const __nv_bfloat16* y, const __nv_bfloat16* routed, float* __restrict__ gate_logit,
                                           __nv_bfloat16* out, std::int64_t hidden) {
  __shared__ float scratch[32];
  const std::int64_t t = blockIdx.x;
  float z = 0.0f;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    z += __bfloat162float(x[t * hidden + i]) * __bfloat162float(w_gate[i]);
  z = block_sum(z, scratch);
  if (threadIdx.x == 0) gate_logit[t] = z;
  const float g = 1.0f / (1.0f + expf(-z));
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float base = routed ? __bfloat162float(routed[t * hidden + i]) : 0.0f;  // read before the in-place write
    out[t * hidden + i] = __float2bfloat16(base + g * __bfloat162float(y[t * hidden + i]));
  }
}

// One block per token: dy, ds and the dx contribution.
__global__ void shared_gate_backward_kernel(const __nv_bfloat16* __restrict__ w_gate, const __nv_bfloat16* __restrict__ y,
                                            const float* __restrict__ gate_logit, const __nv_bfloat16* __restrict__ d_out,
                                            __nv_bfloat16* __restrict__ dy, __nv_bfloat16* __restrict__ dx,
                                            float* __restrict__ ds_out, std::int64_t hidden) {
  __shared__ float scratch[32];
  const std::int64_t t = blockIdx.x;
  const float g = 1.0f / (1.0f + expf(-gate_logit[t]));
  float dot = 0.0f;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float d = __bfloat162float(d_out[t * hidden + i]);
    dy[t * hidden + i] = __float2bfloat16(g * d);
    dot += d * __bfloat162float(y[t * hidden + i]);
  }
  const float ds = block_sum(dot, scratch) * g * (1.0f - g);
  if (threadIdx.x == 0) ds_out[t] = ds;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    dx[t * hidden + i] = __float2bfloat16(__bfloat162float(dx[t * hidden + i]) + ds * __bfloat162float(w_gate[i]));
}

constexpr int gate_chunks = 64;  // partial sums of dw_gate over token chunks, reduced in fixed order

__global__ void shared_gate_dw_partial_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ ds,
                                              float* __restrict__ partial, std::int64_t tokens, std::int64_t hidden) {
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  const std::int64_t per = (tokens + gate_chunks - 1) / gate_chunks;
  const std::int64_t t0 = blockIdx.y * per, t1 = std::min(tokens, t0 + per);
  float acc = 0.0f;
  for (std::int64_t t = t0; t < t1; ++t) acc += ds[t] * __bfloat162float(x[t * hidden + c]);
  partial[blockIdx.y * hidden + c] = acc;
}

__global__ void shared_gate_dw_final_kernel(const float* __restrict__ partial, float* __restrict__ dw_gate, std::int64_t hidden) {
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  float acc = 0.0f;
  for (int j = 0; j < gate_chunks; ++j) acc += partial[j * hidden + c];
  dw_gate[c] += acc;
}

}  // namespace

std::size_t expert_gemm_workspace_bytes(const ExpertGemmShape& s) { return 2 * pointer_array_bytes(s.experts); }

cudaError_t expert_gate_up_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                   const std::int32_t* counts_host, const bf16* x_perm, const bf16* w_gate_up, bf16* gate_up,
                                   ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes) {
  if (!valid(s, counts_host, method, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const auto H = s.hidden, I2 = 2 * s.intermediate;
  std::vector<Problem> ps;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    ps.push_back({false, true, rows, I2, H, x_perm + r * H, H, w_gate_up + e * I2 * H, H, gate_up + r * I2, I2});
  });
  return run(blas, stream, ps, CUDA_R_16BF, 0.0f, method, workspace, s.experts, 0);
}

cudaError_t expert_down_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                const std::int32_t* counts_host, const bf16* h, const bf16* w_down, bf16* y,
                                ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes) {
  if (!valid(s, counts_host, method, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const auto H = s.hidden, I = s.intermediate;
  std::vector<Problem> ps;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    ps.push_back({false, true, rows, H, I, h + r * I, I, w_down + e * H * I, I, y + r * H, H});
  });
  return run(blas, stream, ps, CUDA_R_16BF, 0.0f, method, workspace, s.experts, 0);
}

cudaError_t expert_down_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                 const std::int32_t* counts_host, const bf16* dy, const bf16* h, const bf16* w_down, bf16* dh,
                                 float* dw_down, ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes) {
  if (!valid(s, counts_host, method, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const auto H = s.hidden, I = s.intermediate;
  std::vector<Problem> data, weight;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    // dh (rows, I) = dy (rows, H) . w_down[e] (H, I)
    data.push_back({false, false, rows, I, H, dy + r * H, H, w_down + e * H * I, I, dh + r * I, I});
    // dw_down[e] (H, I) += dy^T (H, rows) . h (rows, I)
    weight.push_back({true, false, H, I, rows, dy + r * H, H, h + r * I, I, dw_down + e * H * I, I});
  });
  OOM_KERNEL_TRY(run(blas, stream, data, CUDA_R_16BF, 0.0f, method, workspace, s.experts, 0));
  return run(blas, stream, weight, CUDA_R_32F, 1.0f, method, workspace, s.experts, 1);
}

cudaError_t expert_gate_up_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                    const std::int32_t* counts_host, const bf16* d_gate_up, const bf16* x_perm,
                                    const bf16* w_gate_up, bf16* dx_perm, float* dw_gate_up, ExpertGemmMethod method,
                                    void* workspace, std::size_t workspace_bytes) {
  if (!valid(s, counts_host, method, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const auto H = s.hidden, I2 = 2 * s.intermediate;
  std::vector<Problem> data, weight;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    // dx (rows, H) = d_gate_up (rows, 2I) . w_gate_up[e] (2I, H)
    data.push_back({false, false, rows, H, I2, d_gate_up + r * I2, I2, w_gate_up + e * I2 * H, H, dx_perm + r * H, H});
    // dw_gate_up[e] (2I, H) += d_gate_up^T (2I, rows) . x_perm (rows, H)
    weight.push_back({true, false, I2, H, rows, d_gate_up + r * I2, I2, x_perm + r * H, H, dw_gate_up + e * I2 * H, H});
  });
  OOM_KERNEL_TRY(run(blas, stream, data, CUDA_R_16BF, 0.0f, method, workspace, s.experts, 0));
  return run(blas, stream, weight, CUDA_R_32F, 1.0f, method, workspace, s.experts, 1);
}

cudaError_t shared_expert_gate_forward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden, const bf16* x,
                                       const bf16* w_gate, const bf16* y, const bf16* routed, float* gate_logit, bf16* out) {
  if (tokens < 0 || tokens > INT_MAX || hidden < 1) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  shared_gate_forward_kernel<<<static_cast<unsigned>(tokens), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<const __nv_bfloat16*>(w_gate),
      reinterpret_cast<const __nv_bfloat16*>(y), reinterpret_cast<const __nv_bfloat16*>(routed), gate_logit,
      reinterpret_cast<__nv_bfloat16*>(out), hidden);
  return cudaGetLastError();
}

std::size_t shared_expert_gate_backward_workspace_bytes(std::int64_t tokens, std::int64_t hidden) {
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(tokens, 0)) * sizeof(float)) +
         align_up(static_cast<std::size_t>(gate_chunks * std::max<std::int64_t>(hidden, 0)) * sizeof(float));
}

cudaError_t shared_expert_gate_backward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden, const bf16* x,
                                        const bf16* w_gate, const bf16* y, const float* gate_logit, const bf16* d_out,
                                        bf16* dy, bf16* dx, float* dw_gate, void* workspace, std::size_t workspace_bytes) {
  if (tokens < 0 || tokens > INT_MAX || hidden < 1 || workspace_bytes < shared_expert_gate_backward_workspace_bytes(tokens, hidden))
    return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  auto* ds = static_cast<float*>(workspace);
  auto* partial = reinterpret_cast<float*>(static_cast<char*>(workspace) + align_up(tokens * sizeof(float)));
  shared_gate_backward_kernel<<<static_cast<unsigned>(tokens), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(w_gate), reinterpret_cast<const __nv_bfloat16*>(y), gate_logit,
      reinterpret_cast<const __nv_bfloat16*>(d_out), reinterpret_cast<__nv_bfloat16*>(dy), reinterpret_cast<__nv_bfloat16*>(dx),
      ds, hidden);
  OOM_KERNEL_TRY(cudaGetLastError());
  const unsigned col_blocks = static_cast<unsigned>((hidden + 255) / 256);
  shared_gate_dw_partial_kernel<<<dim3(col_blocks, gate_chunks), 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(x), ds,
                                                                                   partial, tokens, hidden);
  shared_gate_dw_final_kernel<<<col_blocks, 256, 0, stream>>>(partial, dw_gate, hidden);
  return cudaGetLastError();
}

}  // namespace oom::kernels
