// ResidualMlp on the GPU, for the CudaLayerExecutor: the same function as residual_mlp.hpp's CPU
// layer, its work enqueued on LayerContext::stream over device pointers. Plain fp32 kernels, one
// thread per output: an example of the contract, not a fast MLP (a real layer calls cuBLAS).
// Weight gradients add token by token in token order (one thread per weight), so any token
// chunking of the plan gives the same bits. Kernels in residual_mlp_cuda.cu.
#pragma once

#include <cstdint>
#include <memory>

#include "custom_layer/residual_mlp.hpp"
#include "custom_layer/residual_mlp_kernels.hpp"

namespace oom::examples {

class CudaResidualMlp : public ResidualMlpShape {
 public:
  /// Its temporaries come from the workspace the executor hands each call (the declared workset,
  /// a chunk's T x I floats): the pre-activation of a rerun that saves none (a regenerated
  /// boundary) and the backward's d(pre).
  using ResidualMlpShape::ResidualMlpShape;

  void forward(oom::LayerContext& ctx) const;
  void backward(oom::LayerContext& ctx) const;

 private:
  float* scratch(const oom::LayerContext& ctx) const;  // the workspace, checked to hold the chunk
};
static_assert(oom::executor_layer<CudaResidualMlp>);

/// n floats of device memory (cudaMalloc), freed with the last owner.
std::shared_ptr<float> device_floats(std::uint64_t n);

/// The loss oom-custom-layer trains with, on the GPU: L = 0.5 x mean over tokens of |y - target|^2
/// (fp64 sum in one block, a fixed order) into *loss, and dL/dy = (y - target) / tokens into grad,
/// enqueued on `stream`. `loss` is host memory the device may write (CudaBackend::host_words).
void mse_loss(const float* y, const float* target, float* grad, std::uint64_t tokens, std::uint64_t hidden, double* loss,
              void* stream);

}  // namespace oom::examples
