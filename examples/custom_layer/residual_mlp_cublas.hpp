// ResidualMlp on the GPU through cuBLAS, as a real layer would run it: the same function as
// residual_mlp.hpp's CPU layer, its GEMMs bf16 on the tensor cores with fp32 accumulation and fp32
// outputs (x, dy, silu(pre) and d(pre) rounded to bf16 as their operands), the rest in small
// kernels, all enqueued on LayerContext::stream. Its weight gradients add a whole pass's GEMM into
// the fp32 gradient, so the layer is not chunkable: token chunks would change their bits, and the
// plans must all give the same step. Kernels in residual_mlp_cublas.cu.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "custom_layer/residual_mlp.hpp"

struct cublasContext;

namespace oom::examples {

class CublasResidualMlp : public ResidualMlpShape {
 public:
  CublasResidualMlp(int index, std::uint64_t hidden, std::uint64_t inter);

  /// cuBLAS's workspace (its split-K GEMMs' partial sums), the last part of the layer's own:
  /// inside the plan's budget, and the same size in every plan, so cuBLAS picks the same kernels
  /// (and bits) in each. cuBLAS suggests 4 MiB before Hopper, 32 MiB on it.
  static constexpr std::uint64_t blas_workspace_bytes = std::uint64_t{4} << 20;

  /// The shape's cost, its workset what these GEMMs' operands need: bf16 copies of x and dy
  /// (T x H each), of silu(pre) or d(pre) (T x I), and d(silu) in fp32 (T x I), then cuBLAS's
  /// workspace from the next 256-byte boundary.
  oom::LayerCost cost(const oom::Workload& w) const;
  /// One pass over all the tokens (see above).
  oom::ChunkDependency chunking() const { return oom::ChunkDependency::none; }

  void forward(oom::LayerContext& ctx) const;
  void backward(oom::LayerContext& ctx) const;

 private:
  struct Pass;
  Pass pass(const oom::LayerContext& ctx) const;  // one call's operands, the workspace checked to fit
  // The cuBLAS handle of the current device and calling thread, shared by the layers called there
  // (made at the first call, none without a GPU; gone with the last layer that used it), on
  // `stream` with `workspace` (blas_workspace_bytes) as its workspace. Its own device memory (the
  // handle's state) is outside the plan's budget.
  cublasContext* handle(void* stream, void* workspace) const;
  mutable std::shared_ptr<cublasContext> blas_;
  mutable int blas_device_ = -1;
  mutable std::thread::id blas_thread_;
};
static_assert(oom::executor_layer<CublasResidualMlp>);

}  // namespace oom::examples
