// HostDecoderLayer: one Qwen3-MoE decoder layer for the HostExecutor, computed on the CPU in fp32
// (fp64 accumulation in every dot product and weight gradient) from bf16 weights, as transformers'
// Qwen3MoeDecoderLayer computes it:
//
//   h = x + o_proj(attention(rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), v_proj(n1))),  n1 = rms1(x)
//   y = h + sum_j w_j down_j(silu(gate_j n2) * up_j n2),                                        n2 = rms2(h)
//
// with causal GQA (scale 1/sqrt(head_dim)), rotate-half RoPE over positions 0..S-1 (the T tokens
// are HostLayerContext::sequences sequences of S, attention within each), a softmax router over the experts with top-k (ties to the lower index) and,
// with norm_topk_prob, the k weights renormalised. No auxiliary loss.
//
// Chunks (ChunkDependency::independent, the executor's run_chunks): forward and backward are
// called for consecutive token ranges from 0 to T. The attention half needs every token, so the
// chunk that begins at 0 runs it for all T; the MoE half runs per chunk. Backward runs the MoE
// half per chunk (writing dh into grad_input), and the chunk that ends at T computes every weight
// gradient over all tokens at once (in token order) and then the attention half's backward,
// overwriting grad_input with dx. Each output element is computed by the same operations whatever
// the chunking, the thread count, or whether an activation was kept, offloaded or recomputed, so
// all of these give bit-identical results.
//
// Saved activations (floats, T tokens; H hidden, q = heads*head_dim, kv = kv_heads*head_dim,
// E experts, k = top_k, I = expert intermediate), each laid out as listed:
//   norm_output        3TH + 2T: rms1(x) (T,H) | rms2(h) (T,H) | h (T,H) | rstd1 (T) | rstd2 (T)
//   attention_output   T(2q + 2kv): q_proj (T,q) | k_proj (T,kv) | v_proj (T,kv) | context (T,q)
//                      (q and k before their norm and RoPE, which backward recomputes)
//   softmax_stats      heads*T: the attention rows' natural-log LSE, (heads, T)
//   router_output      T(E + 2k): probabilities (T,E) | expert ids as floats (T,k) | weights (T,k)
//   expert_intermediate 2TkI: [gate | up] projections per slot t*k+j, (T*k, 2I)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "oom/concepts/layer.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/runtime/host_executor.hpp"

namespace oom {

class HostDecoderLayer {
 public:
  /// Layer `layer` of `spec`. Throws Errc::unsupported, naming the layer and the feature, for
  /// anything but a qwen3_moe layer with full attention, per-head q/k norm, full rotary, no
  /// attention bias or output gate, and an MoE block without shared expert.
  HostDecoderLayer(const ModelSpec& spec, int layer);

  /// Exactly spec.layer_segments(layer): attention, norms, router, experts 0..E-1.
  [[nodiscard]] const std::vector<StateSegment>& segments() const { return segments_; }
  [[nodiscard]] LayerCost cost(const Workload& w) const;
  [[nodiscard]] std::uint64_t hidden() const { return h_; }
  [[nodiscard]] std::uint64_t saved_floats(ActivationClass c, std::uint64_t tokens) const;
  [[nodiscard]] std::string_view name() const { return name_; }
  [[nodiscard]] ChunkDependency chunking() const { return ChunkDependency::independent; }

  /// Writes ctx.output (when set) and every saved class whose pointer is set.
  void forward(HostLayerContext& ctx);
  /// Needs every saved class; writes grad_input and accumulates into weight_grads.
  void backward(HostLayerContext& ctx);

 private:
  // Work that spans the chunks of one pass (calls for one layer never run concurrently).
  struct ForwardState {
    std::uint64_t tokens = 0, sequences = 1, next = 0;
    std::vector<float> xn1, rstd1, q_raw, k_raw, v, context, lse, h;
  };
  struct BackwardState {
    std::uint64_t tokens = 0, sequences = 1, next = 0;
    std::vector<float> dxn2, dlogits, dgate_up, act, dy_weighted;  // per token / per slot, all T
  };

  void check_context(const HostLayerContext& ctx, bool backward) const;
  void begin_pass(const HostLayerContext& ctx, std::uint64_t& tokens, std::uint64_t& sequences, std::uint64_t& next);
  void convert_weights(const HostLayerContext& ctx);
  void attention_forward(const HostLayerContext& ctx);
  void moe_forward(const HostLayerContext& ctx);
  void moe_backward(const HostLayerContext& ctx);
  void moe_weight_grads(const HostLayerContext& ctx);
  void attention_backward(const HostLayerContext& ctx);
  // q and k after their norms and RoPE, from the raw projections (forward and backward alike).
  void normed_rotated(const float* raw, std::uint64_t tokens, std::uint64_t heads, const float* norm_weight,
                      std::vector<float>& normed, std::vector<float>& rstd, std::vector<float>& rotated) const;

  std::vector<StateSegment> segments_;
  std::string name_;
  int layer_ = 0;
  std::uint64_t h_ = 0, heads_ = 0, kv_heads_ = 0, d_ = 0, q_ = 0, kv_ = 0, e_ = 0, k_ = 0, i_ = 0;
  float eps_ = 0, theta_ = 0;
  double scale_ = 0;
  bool norm_topk_ = true;

  std::vector<std::vector<float>> w_;  // fp32 copies of the bound weights, per segment, for one pass
  std::vector<std::int32_t> positions_;  // for positions_.size() tokens in positions_sequences_ sequences
  std::uint64_t positions_sequences_ = 1;
  ForwardState fwd_;
  BackwardState bwd_;
};

static_assert(host_layer<HostDecoderLayer>);

}  // namespace oom
