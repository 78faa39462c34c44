// CudaResidualMlp: binds the executor's LayerContext to the kernels of residual_mlp_cuda.cu.
#include "custom_layer/residual_mlp_cuda.hpp"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"

namespace oom::examples {

float* CudaResidualMlp::scratch(const oom::LayerContext& ctx) const {
  const std::uint64_t need = (ctx.end - ctx.begin) * i_ * sizeof(float);
  if (ctx.workspace_bytes < need)
    OOM_THROW(oom::Errc::invalid_argument, fmt::format("{}: a chunk of {} tokens needs a workspace of {} bytes, got {}", segs_[0].name,
                                                       ctx.end - ctx.begin, need, ctx.workspace_bytes));
  return static_cast<float*>(ctx.workspace);
}

void CudaResidualMlp::forward(oom::LayerContext& ctx) const {
  float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)];
  float* pre = saved != nullptr ? saved + ctx.begin * i_ : scratch(ctx);
  OOM_CUDA_CHECK(static_cast<cudaError_t>(residual_mlp_kernels::forward(ctx.weights[0].data(), ctx.input, pre, ctx.output, ctx.begin,
                                                                        ctx.end - ctx.begin, h_, i_, ctx.stream)));
}

void CudaResidualMlp::backward(oom::LayerContext& ctx) const {
  const float* pre = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)] + ctx.begin * i_;
  OOM_CUDA_CHECK(static_cast<cudaError_t>(residual_mlp_kernels::backward(ctx.weights[0].data(), ctx.input, ctx.grad_output, pre,
                                                                         scratch(ctx), ctx.grad_input, ctx.weight_grads[0].data(),
                                                                         ctx.begin, ctx.end - ctx.begin, h_, i_, ctx.stream)));
}

std::shared_ptr<float> device_floats(std::uint64_t n) {
  float* p = nullptr;
  OOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)));
  return std::shared_ptr<float>(p, [](float* q) { cudaFree(q); });
}

void mse_loss(const float* y, const float* target, float* grad, std::uint64_t tokens, std::uint64_t hidden, double* loss, void* stream) {
  OOM_CUDA_CHECK(static_cast<cudaError_t>(residual_mlp_kernels::mse_loss(y, target, grad, tokens, hidden, loss, stream)));
}

}  // namespace oom::examples
