// ResidualMlp on the GPU through cuBLAS, as a real layer would run it: the same function as
// residual_mlp.hpp's CPU layer, its GEMMs bf16 on the tensor cores with fp32 accumulation and fp32
// outputs (x, dy, silu(pre) and d(pre) rounded to bf16 as their operands), the rest in small
// kernels, all enqueued on LayerContext::stream. Its weight gradients add a whole pass's GEMM into
// the fp32 gradient, so the layer is not chunkable: token chunks would change their bits, and the
// plans must all give the same step. Kernels in residual_mlp_cublas.cu.
#pragma once

#include <cstdint>
#include <memory>

#include "custom_layer/residual_mlp.hpp"

struct cublasContext;

namespace oom::examples {

class CublasResidualMlp : public ResidualMlpShape {
 public:
  CublasResidualMlp(int index, std::uint64_t hidden, std::uint64_t inter);

  /// The shape's cost, its workset what these GEMMs' operands need: bf16 copies of x and dy
  /// (T x H each), of silu(pre) or d(pre) (T x I), and d(silu) in fp32 (T x I).
  oom::LayerCost cost(const oom::Workload& w) const;
  /// One pass over all the tokens (see above).
  oom::ChunkDependency chunking() const { return oom::ChunkDependency::none; }

  void forward(oom::LayerContext& ctx) const;
  void backward(oom::LayerContext& ctx) const;

 private:
  struct Pass;
  Pass pass(const oom::LayerContext& ctx) const;  // one call's operands, the workspace checked to fit
  cublasContext* handle(void* stream) const;            // the stack's cuBLAS handle, on `stream`
  // Each layer makes its own cuBLAS handle at its first call (none without a GPU): its device
  // memory (cuBLAS's default workspace) is outside the plan's budget, and the layer is driven from
  // one thread, as the executor does. A real trainer shares one handle and gives it a workspace
  // from LayerContext::workspace (cublasSetWorkspace), as src/kernels/expert_gemm.cu does.
  mutable std::shared_ptr<cublasContext> blas_;
};
static_assert(oom::executor_layer<CublasResidualMlp>);

}  // namespace oom::examples
