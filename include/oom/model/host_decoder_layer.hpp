// HostDecoderLayer: one decoder layer of a Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, OLMoE or
// Qwen2-MoE model for the HostExecutor, computed on the CPU in fp32 (fp64 accumulation in every dot product
// and weight gradient) from bf16 weights, as transformers' Qwen3MoeDecoderLayer /
// Qwen3NextDecoderLayer / Qwen3_5MoeDecoderLayer / MixtralDecoderLayer / OlmoeDecoderLayer /
// Qwen2MoeDecoderLayer compute it:
//
//   h = x + mixer(n1),                                                   n1 = rms1(x)
//   y = h + (sum_j w_j down_j(silu(gate_j n2) * up_j n2) + shared(n2)),   n2 = rms2(h)
//
// where the token mixer is either
//   full attention:   o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v) [* sigmoid(gate)]),
//                     the q/k RMSNorms per head (Qwen3), over the whole projection (OLMoE) or
//                     absent (Mixtral, Qwen2-MoE, whose q, k and v projections add biases);
//                     q (and, with an output gate, the gate: q_proj yields [q_h | gate_h] per
//                     head) = q_proj(n1), k = k_proj(n1), v = v_proj(n1); causal GQA (scale
//                     1/sqrt(head_dim)); rotate-half RoPE over the first rotary_dim =
//                     head_dim * partial_rotary_factor dimensions of each head, positions 0..S-1
//                     (the T tokens are LayerContext::sequences sequences of S, attention
//                     within each);
//   linear attention: the Gated DeltaNet block of oom/reference/gated_delta.hpp (Qwen3-Next's
//                     fused projections or Qwen3.5's separate ones), run on each sequence from a
//                     zero state;
// and the MoE block is a softmax router over the experts with top-k (ties to the lower index)
// and, with norm_topk_prob, the k weights renormalised (the load-balancing loss where the model
// adds it: balance_router), plus, where the model
// has one, a shared expert scaled by sigmoid(shared_expert_gate(n2)). The hybrid families'
// RMSNorms outside the linear block scale by (1 + w) (ModelSpec::zero_centred_norms): the layer
// adds the 1 to its fp32 copy of those weights, as transformers does in fp32.
//
// Chunks (ChunkDependency::independent, the executor's run_chunks): forward and backward are
// called for consecutive token ranges from 0 to T. The token mixer needs every token, so the
// chunk that begins at 0 runs it for all T; the MoE half runs per chunk. Backward runs the MoE
// half per chunk (writing dh into grad_input), and the chunk that ends at T computes every weight
// gradient over all tokens at once (in token order) and then the mixer's backward, overwriting
// grad_input with dx. Each output element is computed by the same operations whatever the
// chunking, the thread count, or whether an activation was kept, offloaded or recomputed, so all
// of these give bit-identical results.
//
// Saved activations (floats, T tokens; H hidden, q = heads*head_dim, kv = kv_heads*head_dim,
// E experts, k = top_k, I = expert intermediate, Is = shared expert intermediate), each laid out
// as listed:
//   norm_output        3TH + 2T: rms1(x) (T,H) | rms2(h) (T,H) | h (T,H) | rstd1 (T) | rstd2 (T)
//   attention_output   full attention only, T(2q + 2kv), + Tq with an output gate: q_proj (T,q) |
//                      k_proj (T,kv) | v_proj (T,kv) | context (T,q) | gate (T,q) (q and k before
//                      their norm and RoPE, which backward recomputes)
//   softmax_stats      full attention only, heads*T: the rows' natural-log LSE, (heads, T)
//   router_output      T(E + 2k): probabilities (T,E) | expert ids as floats (T,k) | weights (T,k)
//   expert_intermediate 2TkI: [gate | up] projections per slot t*k+j, (T*k, 2I); with a shared
//                      expert then T(2Is + 1): its [gate | up] (T, 2Is) | its gate's logit (T)
// A linear-attention layer saves nothing of its own: its backward runs the block again from
// rms1(x) (the reference's backward keeps each head's S x dk x dv states while it runs, which
// cost() counts in the workset; the host backend is an oracle for small shapes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "oom/concepts/layer.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/model/router_balance.hpp"
#include "oom/reference/gated_delta.hpp"
#include "oom/runtime/host_executor.hpp"

namespace oom {

class HostDecoderLayer {
 public:
  /// Layer `layer` of `spec`. Throws Errc::unsupported, naming the layer and the feature, for
  /// anything but a layer with an MoE block (and no router jitter) and, in a full-attention layer,
  /// no attention bias, sliding window or clip_qkv (and, in the hybrid families, the output gate).
  HostDecoderLayer(const ModelSpec& spec, int layer);

  /// Exactly spec.layer_segments(layer): attention or linear attention, norms, router, experts
  /// 0..E-1, then the shared expert where the model has one.
  [[nodiscard]] const std::vector<StateSegment>& segments() const { return segments_; }
  [[nodiscard]] LayerCost cost(const Workload& w) const;
  [[nodiscard]] std::uint64_t hidden() const { return h_; }
  [[nodiscard]] std::uint64_t saved_floats(ActivationClass c, std::uint64_t tokens) const;
  [[nodiscard]] std::string_view name() const { return name_; }
  [[nodiscard]] ChunkDependency chunking() const { return ChunkDependency::independent; }

  /// The model's load-balancing loss (output_router_logits): the forward adds its router's rows to
  /// `loss` (shared by every layer of the model; it must outlive the layer's calls) and the
  /// backward adds its gradient. nullptr (the default): none.
  void balance_router(RouterBalanceLoss* loss) { balance_ = loss; }

  /// Writes ctx.output (when set) and every saved class whose pointer is set.
  void forward(LayerContext& ctx);
  /// Needs every saved class; writes grad_input and accumulates into weight_grads.
  void backward(LayerContext& ctx);

 private:
  // Work that spans the chunks of one pass (calls for one layer never run concurrently).
  struct ForwardState {
    std::uint64_t tokens = 0, sequences = 1, next = 0;
    std::vector<float> xn1, rstd1, q_raw, k_raw, v, context, gate, lse, h;
  };
  struct BackwardState {
    std::uint64_t tokens = 0, sequences = 1, next = 0;
    std::vector<float> dxn2, dlogits, dgate_up, act, dy_weighted;  // per token / per slot, all T
    std::vector<float> shared_dgate_up, shared_act, shared_dy, shared_dlogit;  // the shared expert's, per token
  };

  void check_context(const LayerContext& ctx, bool backward) const;
  void begin_pass(const LayerContext& ctx, std::uint64_t& tokens, std::uint64_t& sequences, std::uint64_t& next);
  void convert_weights(const LayerContext& ctx);
  void attention_forward(const LayerContext& ctx);
  // The full-attention or Gated DeltaNet mixer of n1 over all tokens into `out` (T, H).
  void full_attention_forward(const LayerContext& ctx, std::vector<float>& out);
  void linear_attention_forward(const LayerContext& ctx, std::vector<float>& out);
  void moe_forward(const LayerContext& ctx);
  // down(silu(gate) * up) of the shared expert from n tokens' [gate | up] projections (n, 2 Is);
  // `act` gets silu(gate) * up (n, Is).
  [[nodiscard]] std::vector<float> shared_expert_output(const std::vector<float>& gate_up, std::size_t n,
                                                        std::vector<float>& act) const;
  void moe_backward(const LayerContext& ctx);
  void shared_expert_backward(const LayerContext& ctx, std::vector<float>& dxn2);
  void moe_weight_grads(const LayerContext& ctx);
  void attention_backward(const LayerContext& ctx);
  // d n1 (T, H) from dh = grad_input, accumulating the mixer's weight gradients.
  void full_attention_backward(const LayerContext& ctx, std::vector<float>& dxn1);
  void linear_attention_backward(const LayerContext& ctx, std::vector<float>& dxn1);
  // Where a full-attention segment's pieces begin, in floats: q_proj's rows (with the gate's), then
  // k_proj's and v_proj's as one (P, H) block, o_proj, the q/k/v biases (Qwen2-MoE), the q norm,
  // the k norm; `end` is the segment's size. The forward, the backward and the weights' (1 + w)
  // all read it from here.
  struct AttentionLayout {
    std::size_t o_proj = 0, qkv_bias = 0, q_norm = 0, k_norm = 0, end = 0;
  };
  [[nodiscard]] AttentionLayout attention_layout() const;
  // q and k after their norms and RoPE, from the raw projections (forward and backward alike).
  // norm_width: the RMSNorm's row (head_dim, the projection's width, or 0 for none).
  void normed_rotated(const float* raw, std::uint64_t tokens, std::uint64_t heads, const float* norm_weight,
                      std::uint64_t norm_width, std::vector<float>& normed, std::vector<float>& rstd, std::vector<float>& rotated) const;

  std::vector<StateSegment> segments_;
  std::string name_;
  int layer_ = 0;
  std::uint64_t h_ = 0, heads_ = 0, kv_heads_ = 0, d_ = 0, q_ = 0, kv_ = 0, e_ = 0, k_ = 0, i_ = 0;
  std::uint64_t rotary_ = 0;  // dimensions of a head RoPE rotates
  std::uint64_t shared_i_ = 0;  // the shared expert's intermediate; 0: none
  std::uint64_t qkv_bias_n_ = 0;  // Qwen2-MoE's q, k and v biases (heads + 2 kv_heads) * head_dim; 0: none
  std::uint64_t q_norm_n_ = 0, k_norm_n_ = 0;  // the q and k norms' weights (and rows): head_dim, full width, or 0: none
  float eps_ = 0, theta_ = 0;
  float norm_offset_ = 0;  // added to the input, post-attention and q/k norm weights: 1 where they scale by (1 + w)
  double scale_ = 0;
  bool norm_topk_ = true;
  RouterBalanceLoss* balance_ = nullptr;
  bool linear_ = false;       // a Gated DeltaNet layer
  bool output_gate_ = false;  // full attention's output scaled by sigmoid(gate)
  reference::GatedDeltaNetShape delta_;  // the linear block's shape, for one sequence

  std::vector<std::vector<float>> w_;  // fp32 copies of the bound weights, per segment, for one pass
  std::vector<std::int32_t> positions_;  // for positions_.size() tokens in positions_sequences_ sequences
  std::uint64_t positions_sequences_ = 1;
  ForwardState fwd_;
  BackwardState bwd_;
};

static_assert(executor_layer<HostDecoderLayer>);

}  // namespace oom
