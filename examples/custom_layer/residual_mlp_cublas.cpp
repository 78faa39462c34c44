// CublasResidualMlp: the executor's LayerContext bound to cuBLAS GEMMs and the casts of
// residual_mlp_cublas.cu. Matrices are row-major; cuBLAS is column-major, so C = op(A) op(B) is
// asked as C^T = op(B)^T op(A)^T over the same buffers (a row-major buffer read column-major is
// its transpose).
#include "custom_layer/residual_mlp_cublas.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <map>
#include <thread>

#include <fmt/format.h>

#include "custom_layer/residual_mlp_cublas_kernels.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"

namespace oom::examples {
namespace {

namespace k = residual_mlp_cublas_kernels;

void check(int e, const char* what) {
  if (e != cudaSuccess) OOM_THROW(oom::Errc::internal, fmt::format("{}: {}", what, cudaGetErrorString(static_cast<cudaError_t>(e))));
}

/// Row-major C (m x n, fp32, row stride ldc) = beta C + op(A) op(B), A and B bf16 row-major with
/// row strides lda and ldb; op(A) is m x k, op(B) k x n. fp32 accumulation.
void gemm(cublasHandle_t h, bool ta, bool tb, std::uint64_t m, std::uint64_t n, std::uint64_t kk, const oom::bf16* a,
          std::uint64_t lda, const oom::bf16* b, std::uint64_t ldb, float* c, std::uint64_t ldc, float beta) {
  const float alpha = 1.0f;
  OOM_CUBLAS_CHECK(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                          static_cast<int>(kk), &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF, static_cast<int>(lda),
                          &beta, c, CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The operands' bytes for t tokens, rounded up to where cuBLAS's workspace starts.
std::uint64_t operand_bytes(std::uint64_t t, std::uint64_t h, std::uint64_t i) { return (t * (4 * h + 6 * i) + 255) / 256 * 256; }

}  // namespace

/// One call's tokens, cuBLAS handle, weights, input and workspace parts.
struct CublasResidualMlp::Pass {
  std::uint64_t t;
  cublasHandle_t h;
  const oom::bf16 *w1, *w2;
  const float* x;
  oom::bf16* xb;   // (T, H): x
  oom::bf16* dyb;  // (T, H): dy
  oom::bf16* ab;   // (T, I): silu(pre), then d(pre)
  float* f;        // (T, I): d(silu), or a rerun's pre
};

CublasResidualMlp::CublasResidualMlp(int index, std::uint64_t hidden, std::uint64_t inter) : ResidualMlpShape(index, hidden, inter) {
  if (hidden > (1ull << 30) || inter > (1ull << 30))
    OOM_THROW(oom::Errc::invalid_argument, fmt::format("{}: widths {} x {} are past cuBLAS's int sizes", segs_[0].name, hidden, inter));
}

oom::LayerCost CublasResidualMlp::cost(const oom::Workload& w) const {
  oom::LayerCost c = ResidualMlpShape::cost(w);
  c.workset = oom::Bytes{operand_bytes(w.tokens(), h_, i_) + blas_workspace_bytes};
  return c;
}

CublasResidualMlp::Pass CublasResidualMlp::pass(const oom::LayerContext& ctx) const {
  const std::uint64_t t = ctx.end - ctx.begin, operands = operand_bytes(t, h_, i_), need = operands + blas_workspace_bytes;
  if (t > (1ull << 30))
    OOM_THROW(oom::Errc::invalid_argument, fmt::format("{}: {} tokens in one call are past cuBLAS's int sizes", segs_[0].name, t));
  if (ctx.workspace == nullptr || ctx.workspace_bytes < need)
    OOM_THROW(oom::Errc::invalid_argument, fmt::format("{}: {} tokens need a workspace of {} bytes, got {}", segs_[0].name, t, need,
                                                       ctx.workspace_bytes));
  auto* base = static_cast<unsigned char*>(ctx.workspace);
  Pass s{};
  s.t = t;
  s.h = handle(ctx.stream, base + operands);
  s.w1 = ctx.weights[0].data();
  s.w2 = s.w1 + i_ * h_;
  s.x = ctx.input + ctx.begin * h_;
  s.f = reinterpret_cast<float*>(base);  // fp32 first: 4-byte aligned whatever T
  s.xb = reinterpret_cast<oom::bf16*>(base + t * i_ * 4);
  s.dyb = s.xb + t * h_;
  s.ab = s.dyb + t * h_;
  return s;
}

cublasContext* CublasResidualMlp::handle(void* stream, void* workspace) const {
  int device = 0;
  OOM_CUDA_CHECK(cudaGetDevice(&device));
  const auto thread = std::this_thread::get_id();
  if (!blas_ || device != blas_device_ || thread != blas_thread_) {
    // One handle per device and thread (cuBLAS's handles are not for two threads at once), kept
    // alive by the layers that use it.
    thread_local std::map<int, std::weak_ptr<cublasContext>> shared;
    blas_ = shared[device].lock();
    if (!blas_) {
      cublasHandle_t h = nullptr;
      OOM_CUBLAS_CHECK(cublasCreate(&h));
      blas_ = std::shared_ptr<cublasContext>(h, [](cublasHandle_t p) { cublasDestroy(p); });
      shared[device] = blas_;
    }
    blas_device_ = device;
    blas_thread_ = thread;
  }
  // The stream first: setting it puts the handle back on cuBLAS's own workspace.
  OOM_CUBLAS_CHECK(cublasSetStream(blas_.get(), static_cast<cudaStream_t>(stream)));
  OOM_CUBLAS_CHECK(cublasSetWorkspace(blas_.get(), workspace, blas_workspace_bytes));
  return blas_.get();
}

void CublasResidualMlp::forward(oom::LayerContext& ctx) const {
  const Pass s = pass(ctx);
  const std::uint64_t t = s.t;
  float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)];
  float* pre = saved != nullptr ? saved + ctx.begin * i_ : s.f;
  check(k::to_bf16(s.x, s.xb, t * h_, ctx.stream), "CublasResidualMlp cast x");
  gemm(s.h, false, true, t, i_, h_, s.xb, h_, s.w1, h_, pre, i_, 0.0f);  // pre = x W1^T
  if (ctx.output == nullptr) return;                                  // recomputing the saved activation only
  check(k::silu_bf16(pre, s.ab, t * i_, ctx.stream), "CublasResidualMlp silu");
  float* y = ctx.output + ctx.begin * h_;
  OOM_CUDA_CHECK(cudaMemcpyAsync(y, s.x, t * h_ * sizeof(float), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(ctx.stream)));
  gemm(s.h, false, true, t, h_, i_, s.ab, i_, s.w2, i_, y, h_, 1.0f);  // y = x + silu(pre) W2^T
}

void CublasResidualMlp::backward(oom::LayerContext& ctx) const {
  const Pass s = pass(ctx);
  const std::uint64_t t = s.t;
  float* g1 = ctx.weight_grads[0].data();
  float* g2 = g1 + i_ * h_;
  const float* pre = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)] + ctx.begin * i_;
  const float* dy = ctx.grad_output + ctx.begin * h_;
  float* dx = ctx.grad_input + ctx.begin * h_;
  check(k::to_bf16(dy, s.dyb, t * h_, ctx.stream), "CublasResidualMlp cast dy");
  check(k::silu_bf16(pre, s.ab, t * i_, ctx.stream), "CublasResidualMlp silu");
  gemm(s.h, true, false, h_, i_, t, s.dyb, h_, s.ab, i_, g2, i_, 1.0f);  // dW2 += dy^T silu(pre)
  gemm(s.h, false, false, t, i_, h_, s.dyb, h_, s.w2, i_, s.f, i_, 0.0f);  // d(silu) = dy W2
  check(k::silu_grad_bf16(s.f, pre, s.ab, t * i_, ctx.stream), "CublasResidualMlp silu gradient");
  check(k::to_bf16(s.x, s.xb, t * h_, ctx.stream), "CublasResidualMlp cast x");
  gemm(s.h, true, false, i_, h_, t, s.ab, i_, s.xb, h_, g1, h_, 1.0f);  // dW1 += d(pre)^T x
  OOM_CUDA_CHECK(cudaMemcpyAsync(dx, dy, t * h_ * sizeof(float), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(ctx.stream)));
  gemm(s.h, false, false, t, h_, i_, s.ab, i_, s.w1, h_, dx, h_, 1.0f);  // dx = dy + d(pre) W1
}

}  // namespace oom::examples
