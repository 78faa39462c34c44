// A small but real MoE layer for the host executor's tests: softmax router with top-k and
// renormalisation, SwiGLU experts, residual — y = x + Σ_j w_j · down_e(silu(gate_e x) ⊙ up_e x).
// Weight gradients accumulate token by token in token order, so any chunking gives the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "oom/core/numeric.hpp"
#include "oom/runtime/host_executor.hpp"

namespace oom::test {

class MoeMlpLayer {
 public:
  MoeMlpLayer(int index, std::uint64_t hidden, std::uint64_t experts, std::uint64_t top_k, std::uint64_t inter)
      : h_(hidden), e_(experts), k_(top_k), i_(inter) {
    const std::string p = "layers." + std::to_string(index) + ".mlp.";
    segs_.push_back({p + "gate", SegmentRole::router, index, -1, {{p + "gate.weight", {e_, h_}}}});
    for (std::uint64_t e = 0; e < e_; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      segs_.push_back({p + "experts." + std::to_string(e), SegmentRole::expert, index, static_cast<int>(e),
                       {{q + "gate_proj.weight", {i_, h_}}, {q + "up_proj.weight", {i_, h_}}, {q + "down_proj.weight", {h_, i_}}}});
    }
  }

  const std::vector<StateSegment>& segments() const { return segs_; }
  // What it saves matches saved_floats (fp32, as the HostExecutor holds it); its boundary is
  // (T, H) fp32; a token's temporaries are its probabilities and one expert's gate, up and output.
  LayerCost cost(const Workload& w) const {
    LayerCost c;
    const std::uint64_t t = w.tokens();
    c.forward_flops = 2.0 * static_cast<double>(t) * static_cast<double>(h_ * e_ + k_ * 3 * h_ * i_);
    c.backward_flops = 2 * c.forward_flops;
    for (auto cls : {ActivationClass::router_output, ActivationClass::expert_intermediate})
      c.activations.push_back({cls, Bytes{saved_floats(cls, t) * sizeof(float)}, 2.0 * static_cast<double>(t * h_ * e_)});
    c.workset = Bytes{t * (e_ + 3 * i_ + h_) * sizeof(float)};
    c.output = Bytes{t * h_ * sizeof(float)};
    return c;
  }
  std::uint64_t hidden() const { return h_; }
  ChunkDependency chunking() const { return ChunkDependency::independent; }  // token by token
  std::uint64_t saved_floats(ActivationClass c, std::uint64_t tokens) const {
    if (c == ActivationClass::router_output) return tokens * e_;
    if (c == ActivationClass::expert_intermediate) return tokens * k_ * 2 * i_;
    return 0;
  }

  void forward(LayerContext& ctx) const {
    std::vector<float> probs(e_), g(i_), u(i_), a(i_);
    std::vector<std::uint64_t> idx(k_);
    std::vector<float> w(k_);
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      route(ctx, x, probs.data(), idx.data(), w.data());
      if (float* s = ctx.saved[static_cast<std::size_t>(ActivationClass::router_output)]) std::copy(probs.begin(), probs.end(), s + t * e_);
      std::vector<float> y(x, x + h_);
      for (std::uint64_t j = 0; j < k_; ++j) {
        const auto& ew = ctx.weights[1 + idx[j]];
        for (std::uint64_t i = 0; i < i_; ++i) {
          float gs = 0, us = 0;
          for (std::uint64_t c = 0; c < h_; ++c) {
            gs += to_float(ew[i * h_ + c]) * x[c];
            us += to_float(ew[i_ * h_ + i * h_ + c]) * x[c];
          }
          g[i] = gs;
          u[i] = us;
          a[i] = silu(gs) * us;
        }
        if (float* s = ctx.saved[static_cast<std::size_t>(ActivationClass::expert_intermediate)]) {
          std::copy(g.begin(), g.end(), s + (t * k_ + j) * 2 * i_);
          std::copy(u.begin(), u.end(), s + (t * k_ + j) * 2 * i_ + i_);
        }
        for (std::uint64_t c = 0; c < h_; ++c) {
          float o = 0;
          for (std::uint64_t i = 0; i < i_; ++i) o += to_float(ew[2 * i_ * h_ + c * i_ + i]) * a[i];
          y[c] += w[j] * o;
        }
      }
      if (ctx.output) std::copy(y.begin(), y.end(), ctx.output + t * h_);
    }
  }

  void backward(LayerContext& ctx) const {
    const float* probs_all = ctx.saved[static_cast<std::size_t>(ActivationClass::router_output)];
    const float* gu_all = ctx.saved[static_cast<std::size_t>(ActivationClass::expert_intermediate)];
    std::vector<std::uint64_t> idx(k_);
    std::vector<float> w(k_), dw(k_), a(i_), da(i_), dg(i_), du(i_), dp(e_), dlogit(e_), o(h_), dx(h_);
    for (std::uint64_t t = ctx.begin; t < ctx.end; ++t) {
      const float* x = ctx.input + t * h_;
      const float* dy = ctx.grad_output + t * h_;
      const float* probs = probs_all + t * e_;
      select(probs, idx.data(), w.data());
      std::copy(dy, dy + h_, dx.begin());
      for (std::uint64_t j = 0; j < k_; ++j) {
        const auto& ew = ctx.weights[1 + idx[j]];
        auto& eg = ctx.weight_grads[1 + idx[j]];
        const float* g = gu_all + (t * k_ + j) * 2 * i_;
        const float* u = g + i_;
        for (std::uint64_t i = 0; i < i_; ++i) a[i] = silu(g[i]) * u[i];
        float dwj = 0;
        for (std::uint64_t c = 0; c < h_; ++c) {
          float oc = 0;
          for (std::uint64_t i = 0; i < i_; ++i) oc += to_float(ew[2 * i_ * h_ + c * i_ + i]) * a[i];
          dwj += dy[c] * oc;
        }
        dw[j] = dwj;
        std::fill(da.begin(), da.end(), 0.0f);
        for (std::uint64_t c = 0; c < h_; ++c) {
          const float doc = w[j] * dy[c];
          for (std::uint64_t i = 0; i < i_; ++i) {
            eg[2 * i_ * h_ + c * i_ + i] += doc * a[i];
            da[i] += to_float(ew[2 * i_ * h_ + c * i_ + i]) * doc;
          }
        }
        for (std::uint64_t i = 0; i < i_; ++i) {
          const float s = 1.0f / (1.0f + std::exp(-g[i]));
          dg[i] = da[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
          du[i] = da[i] * (g[i] * s);
          for (std::uint64_t c = 0; c < h_; ++c) {
            eg[i * h_ + c] += dg[i] * x[c];
            eg[i_ * h_ + i * h_ + c] += du[i] * x[c];
            dx[c] += to_float(ew[i * h_ + c]) * dg[i] + to_float(ew[i_ * h_ + i * h_ + c]) * du[i];
          }
        }
      }
      // Router: through the renormalisation of the chosen probabilities, then the softmax.
      float sel = 0, wdw = 0;
      for (std::uint64_t j = 0; j < k_; ++j) {
        sel += probs[idx[j]];
        wdw += w[j] * dw[j];
      }
      std::fill(dp.begin(), dp.end(), 0.0f);
      for (std::uint64_t j = 0; j < k_; ++j) dp[idx[j]] = (dw[j] - wdw) / sel;
      float pdp = 0;
      for (std::uint64_t e = 0; e < e_; ++e) pdp += probs[e] * dp[e];
      auto& rg = ctx.weight_grads[0];
      const auto& rw = ctx.weights[0];
      for (std::uint64_t e = 0; e < e_; ++e) {
        dlogit[e] = probs[e] * (dp[e] - pdp);
        for (std::uint64_t c = 0; c < h_; ++c) {
          rg[e * h_ + c] += dlogit[e] * x[c];
          dx[c] += to_float(rw[e * h_ + c]) * dlogit[e];
        }
      }
      std::copy(dx.begin(), dx.end(), ctx.grad_input + t * h_);
    }
  }

 private:
  static float silu(float v) { return v / (1.0f + std::exp(-v)); }

  void route(const LayerContext& ctx, const float* x, float* probs, std::uint64_t* idx, float* w) const {
    const auto& rw = ctx.weights[0];
    float mx = -INFINITY;
    for (std::uint64_t e = 0; e < e_; ++e) {
      float l = 0;
      for (std::uint64_t c = 0; c < h_; ++c) l += to_float(rw[e * h_ + c]) * x[c];
      probs[e] = l;
      mx = std::max(mx, l);
    }
    float sum = 0;
    for (std::uint64_t e = 0; e < e_; ++e) sum += (probs[e] = std::exp(probs[e] - mx));
    for (std::uint64_t e = 0; e < e_; ++e) probs[e] /= sum;
    select(probs, idx, w);
  }
  // Top-k by probability, ties to the lower index; weights renormalised to sum to one.
  void select(const float* probs, std::uint64_t* idx, float* w) const {
    std::vector<std::uint64_t> order(e_);
    for (std::uint64_t e = 0; e < e_; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return probs[a] > probs[b]; });
    float sel = 0;
    for (std::uint64_t j = 0; j < k_; ++j) sel += probs[idx[j] = order[j]];
    for (std::uint64_t j = 0; j < k_; ++j) w[j] = probs[idx[j]] / sel;
  }

  std::uint64_t h_, e_, k_, i_;
  std::vector<StateSegment> segs_;
};

static_assert(executor_layer<MoeMlpLayer>);

}  // namespace oom::test
