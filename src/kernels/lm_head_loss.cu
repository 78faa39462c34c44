// Fused LM head + cross-entropy kernels and launcher; see oom/kernels/lm_head_loss.hpp.
#include "oom/kernels/lm_head_loss.hpp"

#include <algorithm>
#include <cfloat>
#include <climits>

#include "moe_blas.cuh"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::align_up;
using detail::block_sum;
using detail::gemm_rm;

constexpr int ce_threads = 1024;

struct Layout {
  std::size_t logits, dlogits, row_loss, row_valid, total;
};
Layout layout(const LmHeadShape& s) {
  const auto cv = static_cast<std::size_t>(s.chunk_rows * s.vocab);
  Layout l{};
  l.logits = 0;
  l.dlogits = align_up(cv * sizeof(float));
  l.row_loss = l.dlogits + align_up(cv * sizeof(__nv_bfloat16));
  l.row_valid = l.row_loss + align_up(s.chunk_rows * sizeof(float));
  const std::size_t acc = l.row_valid + align_up(s.chunk_rows * sizeof(int));
  l.total = acc + align_up(sizeof(double) + sizeof(long long));
  return l;
}

// One block per row: online max/sum over V, then the loss and (optionally) d logits in bf16.
__global__ void cross_entropy_kernel(const float* __restrict__ logits, const std::int32_t* __restrict__ targets,
                                     __nv_bfloat16* __restrict__ dlogits, float* __restrict__ row_loss,
                                     int* __restrict__ row_valid, std::int64_t vocab, float grad_scale) {
  __shared__ float scratch[32];
  __shared__ float smax[32];
  const std::int64_t r = blockIdx.x;
  const float* l = logits + r * vocab;
  const std::int32_t target = targets[r];
  const bool ignored = target == lm_head_ignore_index;
  const bool in_range = target >= 0 && target < vocab;
  // Per-thread running (max, sum of exp(l - max)), merged across the block.
  float m = -FLT_MAX, s = 0.0f;
  for (std::int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float x = l[v];
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  float bm = m;
  for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
  if (threadIdx.x % 32 == 0) smax[threadIdx.x / 32] = bm;
  __syncthreads();
  bm = -FLT_MAX;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) bm = fmaxf(bm, smax[w]);
  const float sum = block_sum(s * expf(m - bm), scratch);
  const float lse = bm + logf(sum);
  if (threadIdx.x == 0) {
    row_valid[r] = ignored ? 0 : 1;
    row_loss[r] = ignored ? 0.0f : (in_range ? lse - l[target] : NAN);
  }
  if (dlogits == nullptr) return;
  __nv_bfloat16* d = dlogits + r * vocab;
  const float scale = ignored ? 0.0f : (in_range ? grad_scale : NAN);
  for (std::int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
    d[v] = __float2bfloat16((expf(l[v] - lse) - (v == target ? 1.0f : 0.0f)) * scale);
}

// Adds the chunk's losses and counts to the running totals (one block, fixed order); on the last
// chunk writes the outputs.
__global__ void accumulate_kernel(const float* __restrict__ row_loss, const int* __restrict__ row_valid, int rows,
                                  double* __restrict__ acc_loss, long long* __restrict__ acc_count, bool first, bool last,
                                  float* __restrict__ loss_sum, std::int32_t* __restrict__ valid_count) {
  __shared__ double scratch[32];
  __shared__ long long scratch_i[32];
  double l = 0.0;
  long long c = 0;
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    l += row_loss[i];
    c += row_valid[i];
  }
  l = block_sum(l, scratch);
  c = block_sum(c, scratch_i);
  if (threadIdx.x == 0) {
    const double total = (first ? 0.0 : *acc_loss) + l;
    const long long count = (first ? 0 : *acc_count) + c;
    *acc_loss = total;
    *acc_count = count;
    if (last) {
      *loss_sum = static_cast<float>(total);
      *valid_count = static_cast<std::int32_t>(count);
    }
  }
}

}  // namespace

std::size_t lm_head_loss_workspace_bytes(const LmHeadShape& s) {
  if (s.chunk_rows < 1 || s.vocab < 1) return 0;
  return layout(s).total;
}

cudaError_t lm_head_loss(cublasHandle_t blas, cudaStream_t stream, const LmHeadShape& s, const bf16* x, const bf16* w,
                         const std::int32_t* targets, float grad_scale, float* loss_sum, std::int32_t* valid_count, bf16* dx,
                         float* dw, void* workspace, std::size_t workspace_bytes) {
  if (s.tokens < 0) return detail::refuse("lm_head_loss: tokens = ", s.tokens, " (must be >= 0)");
  if (s.hidden < 1 || s.hidden > INT_MAX) return detail::refuse("lm_head_loss: hidden = ", s.hidden, " (must be 1 .. 2^31 - 1)");
  if (s.vocab < 1 || s.vocab > INT_MAX) return detail::refuse("lm_head_loss: vocab = ", s.vocab, " (must be 1 .. 2^31 - 1)");
  if (s.chunk_rows < 1 || s.chunk_rows > INT_MAX)
    return detail::refuse("lm_head_loss: chunk_rows = ", s.chunk_rows, " (must be 1 .. 2^31 - 1)");
  if (const std::size_t need = lm_head_loss_workspace_bytes(s); workspace_bytes < need)
    return detail::refuse_workspace("lm_head_loss", workspace, workspace_bytes, need,
                                    "lm_head_loss_workspace_bytes: chunk_rows = ", s.chunk_rows, ", vocab = ", s.vocab);
  OOM_KERNEL_TRY(detail::refuse_null("lm_head_loss", {{"loss_sum", loss_sum}, {"valid_count", valid_count}}));
  if (s.tokens > 0)  // dx and dw may be null (the loss alone; dx without dw)
    OOM_KERNEL_TRY(detail::refuse_null(
        "lm_head_loss", {{"blas", blas}, {"x", x}, {"w", w}, {"targets", targets}, {"workspace", workspace}}));
  if (s.tokens == 0) {
    OOM_KERNEL_TRY(cudaMemsetAsync(loss_sum, 0, sizeof(float), stream));
    return cudaMemsetAsync(valid_count, 0, sizeof(std::int32_t), stream);
  }
  const Layout L = layout(s);
  auto* base = static_cast<char*>(workspace);
  auto* logits = reinterpret_cast<float*>(base + L.logits);
  auto* dlogits = reinterpret_cast<__nv_bfloat16*>(base + L.dlogits);
  auto* row_loss = reinterpret_cast<float*>(base + L.row_loss);
  auto* row_valid = reinterpret_cast<int*>(base + L.row_valid);
  auto* acc_loss = reinterpret_cast<double*>(base + L.row_valid + align_up(s.chunk_rows * sizeof(int)));
  auto* acc_count = reinterpret_cast<long long*>(acc_loss + 1);
  const bool backward = dx != nullptr;
  const auto H = s.hidden, V = s.vocab;
  OOM_KERNEL_TRY(detail::to_cuda_error(cublasSetStream(blas, stream)));
  for (std::int64_t r0 = 0; r0 < s.tokens; r0 += s.chunk_rows) {
    const std::int64_t m = std::min(s.chunk_rows, s.tokens - r0);
    // logits (m, V) fp32 = x (m, H) . W^T, W stored (V, H)
    OOM_KERNEL_TRY(gemm_rm(blas, false, true, m, V, H, x + r0 * H, H, w, H, logits, CUDA_R_32F, V, 0.0f));
    cross_entropy_kernel<<<static_cast<unsigned>(m), ce_threads, 0, stream>>>(logits, targets + r0,
                                                                               backward ? dlogits : nullptr, row_loss,
                                                                               row_valid, V, grad_scale);
    OOM_KERNEL_TRY(cudaGetLastError());
    if (backward) {
      // dx (m, H) = d logits (m, V) . W (V, H)
      OOM_KERNEL_TRY(gemm_rm(blas, false, false, m, H, V, dlogits, V, w, H, dx + r0 * H, CUDA_R_16BF, H, 0.0f));
      // dW (V, H) += d logits^T (V, m) . x (m, H)
      if (dw != nullptr)
        OOM_KERNEL_TRY(gemm_rm(blas, true, false, V, H, m, dlogits, V, x + r0 * H, H, dw, CUDA_R_32F, H, 1.0f));
    }
    accumulate_kernel<<<1, 256, 0, stream>>>(row_loss, row_valid, static_cast<int>(m), acc_loss, acc_count, r0 == 0,
                                             r0 + m >= s.tokens, loss_sum, valid_count);
    OOM_KERNEL_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace oom::kernels
