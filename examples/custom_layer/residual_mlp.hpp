// The user's layer of oom-custom-layer: a residual MLP block, y = x + W2 silu(W1 x), in fp32 with
// bf16 weights. ResidualMlpShape is everything the planner reads (state, cost, chunking) and what
// any executor needs to size its buffers; ResidualMlp computes it on the CPU for the HostExecutor
// and CudaResidualMlp (residual_mlp_cuda.hpp) on the GPU for the CudaLayerExecutor.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/runtime/layer_executor.hpp"

namespace oom::examples {

class ResidualMlpShape {
 public:
  ResidualMlpShape(int index, std::uint64_t hidden, std::uint64_t inter) : h_(hidden), i_(inter) {
    const std::string p = "blocks." + std::to_string(index);
    // One segment: the unit OOM keeps resident or streams (one DMA burst), its tensors back to
    // back: w1 (I, H) then w2 (H, I), row-major.
    segs_.push_back({p, oom::SegmentRole::dense_mlp, index, -1, {{p + ".w1", {i_, h_}}, {p + ".w2", {h_, i_}}}});
  }

  // What the planner reads: state, and cost for a workload (FLOPs, what backward needs, temporaries).
  const std::vector<oom::StateSegment>& segments() const { return segs_; }
  oom::LayerCost cost(const oom::Workload& w) const {
    const std::uint64_t t = w.tokens();
    oom::LayerCost c;
    c.forward_flops = 4.0 * static_cast<double>(t * h_ * i_);
    c.backward_flops = 2 * c.forward_flops;
    c.activations.push_back({oom::ActivationClass::other, oom::Bytes{t * i_ * sizeof(float)}, c.forward_flops / 2});
    c.workset = oom::Bytes{t * i_ * sizeof(float)};  // handed to forward/backward: LayerContext::workspace
    c.output = oom::Bytes{t * h_ * sizeof(float)};
    return c;
  }
  // Tokens are independent: the plan may run the layer in token chunks.
  oom::ChunkDependency chunking() const { return oom::ChunkDependency::independent; }
  // Its temporaries are the declared workset, which the executor hands each call from the budget.
  static constexpr bool uses_workspace = true;

  // What the executor reads: the boundary's width and the floats saved per activation class (the
  // pre-activation W1 x).
  std::uint64_t hidden() const { return h_; }
  std::uint64_t inter() const { return i_; }
  std::uint64_t saved_floats(oom::ActivationClass c, std::uint64_t tokens) const {
    return c == oom::ActivationClass::other ? tokens * i_ : 0;
  }

 protected:
  std::uint64_t h_, i_;
  std::vector<oom::StateSegment> segs_;
};

// On the CPU: forward and backward over tokens [begin, end), weights bound where the plan put them.
class ResidualMlp : public ResidualMlpShape {
 public:
  using ResidualMlpShape::ResidualMlpShape;

  void forward(oom::LayerContext& ctx) const {
    const auto& w = ctx.weights[0];
    float* pre = scratch(ctx);  // one token's pre-activation at a time
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      for (std::uint64_t j = 0; j < i_; ++j) {
        float s = 0;
        for (std::uint64_t k = 0; k < h_; ++k) s += oom::to_float(w[j * h_ + k]) * x[k];
        pre[j] = s;
      }
      if (float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)])
        std::copy(pre, pre + i_, saved + t * i_);
      if (ctx.output == nullptr) continue;  // recomputing the saved activation only
      for (std::uint64_t k = 0; k < h_; ++k) {
        float s = x[k];
        for (std::uint64_t j = 0; j < i_; ++j) s += oom::to_float(w[i_ * h_ + k * i_ + j]) * silu(pre[j]);
        ctx.output[t * h_ + k] = s;
      }
    }
  }
  void backward(oom::LayerContext& ctx) const {
    const auto& w = ctx.weights[0];
    auto& g = ctx.weight_grads[0];
    const float* saved = ctx.saved[static_cast<std::size_t>(oom::ActivationClass::other)];
    float* da = scratch(ctx);  // one token's d(silu) at a time
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      const float* dy = ctx.grad_output + t * h_;
      const float* pre = saved + t * i_;
      float* dx = ctx.grad_input + t * h_;
      std::fill(da, da + i_, 0.0f);
      for (std::uint64_t k = 0; k < h_; ++k) {
        dx[k] = dy[k];
        for (std::uint64_t j = 0; j < i_; ++j) {
          g[i_ * h_ + k * i_ + j] += dy[k] * silu(pre[j]);
          da[j] += oom::to_float(w[i_ * h_ + k * i_ + j]) * dy[k];
        }
      }
      for (std::uint64_t j = 0; j < i_; ++j) {
        const float s = 1.0f / (1.0f + std::exp(-pre[j]));
        const float dpre = da[j] * s * (1.0f + pre[j] * (1.0f - s));
        for (std::uint64_t k = 0; k < h_; ++k) {
          g[j * h_ + k] += dpre * x[k];
          dx[k] += oom::to_float(w[j * h_ + k]) * dpre;
        }
      }
    }
  }

 private:
  static float silu(float v) { return v / (1.0f + std::exp(-v)); }
  // The executor hands the declared workset (a chunk's T x I floats) to every call: one token's row.
  float* scratch(const oom::LayerContext& ctx) const {
    if (ctx.workspace_bytes < i_ * sizeof(float))
      OOM_THROW(oom::Errc::invalid_argument, fmt::format("{}: a workspace of {} bytes, {} needed", segs_[0].name, ctx.workspace_bytes,
                                                         i_ * sizeof(float)));
    return static_cast<float*>(ctx.workspace);
  }
};
static_assert(oom::executor_layer<ResidualMlp>);

}  // namespace oom::examples
