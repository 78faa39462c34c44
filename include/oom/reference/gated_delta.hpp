// CPU reference of the linear-attention half of the hybrid models (Qwen3-Next, Qwen3.5-MoE): the
// Gated DeltaNet's causal depthwise convolution with SiLU, its gates, the gated delta rule and the
// gated RMSNorm, each forward and backward, and the whole block they make (both families' layouts).
// fp32 values between the pieces, fp64 arithmetic within each. The math is transformers'
// Qwen3NextGatedDeltaNet (torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel, the
// Conv1d with padding kernel - 1 cut to the sequence, Qwen3NextRMSNormGated); GPU kernels are to be
// checked against this, and this against PyTorch's autograd (tests/reference/test_gated_delta_ref.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

struct GatedDeltaShape {
  std::int64_t tokens = 0;   ///< T
  std::int64_t k_heads = 0;  ///< query/key heads
  std::int64_t v_heads = 0;  ///< value heads, a multiple of k_heads: value head h reads key head h / (v_heads / k_heads)
  std::int64_t k_dim = 0;    ///< dk
  std::int64_t v_dim = 0;    ///< dv
};

/// The gated delta rule from a zero state, per value head h (its key head kh):
///   q_t, k_t = l2norm(q[t, kh]), l2norm(k[t, kh])  (x / sqrt(sum x^2 + 1e-6)); q_t /= sqrt(dk)
///   S = exp(g[t, h]) S;  d = beta[t, h] (v[t, h] - S^T k_t);  S += k_t d^T;  out[t, h] = S^T q_t
/// with S a dk x dv state. q, k: (T, k_heads, dk); v: (T, v_heads, dv); g (log decay, <= 0 in the
/// models) and beta: (T, v_heads). Returns out: (T, v_heads, dv).
std::vector<float> gated_delta_rule_forward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                            std::span<const float> v, std::span<const float> g,
                                            std::span<const float> beta);

/// The rule over a token range that continues a sequence (docs/hybrid.md, slice 6: a block run
/// in token chunks): each value head starts from `initial` (v_heads, dk, dv), the state entering
/// the range (empty: zeros, as gated_delta_rule_forward), and the state leaving the range comes
/// back. Running [0, m) and then [m, T) from its final state is the whole rule, up to the fp32
/// rounding of the state handed over.
struct GatedDeltaCarried {
  std::vector<float> out;          ///< (T, v_heads, dv)
  std::vector<float> final_state;  ///< (v_heads, dk, dv)
};
GatedDeltaCarried gated_delta_rule_forward_from(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                std::span<const float> v, std::span<const float> g,
                                                std::span<const float> beta, std::span<const float> initial);

/// The same rule computed a chunk of `chunk` tokens at a time, as chunked GPU kernels do (FLA's
/// form, transformers' torch_chunk_gated_delta_rule): within a chunk, with G_i the decay summed
/// from its start and S the state entering it, the deltas solve the unit lower-triangular system
///   d_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) d_j = beta_i (v_i - exp(G_i) S^T k_i),
/// then out_i = exp(G_i) S^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) d_j, and the state leaving
/// is exp(G_last) S + sum_j exp(G_last - G_j) k_j d_j^T. chunk 1 is the recurrence itself.
struct GatedDeltaChunked {
  std::vector<float> out;     ///< (T, v_heads, dv)
  std::vector<float> states;  ///< (v_heads, chunks + 1, dk, dv): the state entering each chunk, then the final one
};
GatedDeltaChunked gated_delta_rule_chunked_forward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                   std::span<const float> v, std::span<const float> g,
                                                   std::span<const float> beta, std::int64_t chunk);

struct GatedDeltaGrads {
  std::vector<float> dq, dk;  ///< (T, k_heads, dk): summed over the value heads that share a key head
  std::vector<float> dv;      ///< (T, v_heads, dv)
  std::vector<float> dg, dbeta;  ///< (T, v_heads)
};

/// The gradients of gated_delta_rule_forward's inputs from d_out (T, v_heads, dv). Keeps every
/// state of the forward it recomputes (T x dk x dv per head): a reference, for small shapes.
GatedDeltaGrads gated_delta_rule_backward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                          std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                          std::span<const float> d_out);

/// gated_delta_rule_forward_from's backward: with `d_final` (v_heads, dk, dv) the gradient of the
/// state leaving the range (empty: zeros), the inputs' gradients and `d_initial`, the gradient of
/// the state entering it, which the range before takes as its d_final.
struct GatedDeltaCarriedGrads {
  GatedDeltaGrads grads;
  std::vector<float> d_initial;  ///< (v_heads, dk, dv)
};
GatedDeltaCarriedGrads gated_delta_rule_backward_from(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                      std::span<const float> v, std::span<const float> g,
                                                      std::span<const float> beta, std::span<const float> d_out,
                                                      std::span<const float> initial, std::span<const float> d_final);

/// The same gradients computed a chunk at a time from the last, as a chunked GPU kernel will:
/// per chunk, the forward's quantities (run_chunk: the decays G, the masked k.k and q.k products,
/// the deltas) from the state entering it, then the chunk's equations differentiated in matrix
/// form (the deltas' triangular system by back substitution), the state's gradient handed to the
/// chunk before. Holds one state per chunk, not per token. chunk 1 is the recurrence's backward.
GatedDeltaGrads gated_delta_rule_chunked_backward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                  std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                                  std::span<const float> d_out, std::int64_t chunk);

/// Causal depthwise convolution over time, then SiLU: y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]),
/// x before the first token being 0. x, y: (T, C); w: (C, K) (nn.Conv1d's (C, 1, K) weight).
std::vector<float> causal_conv1d_silu_forward(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                              std::span<const float> x, std::span<const float> w);

struct CausalConvGrads {
  std::vector<float> dx;  ///< (T, C)
  std::vector<float> dw;  ///< (C, K)
};
CausalConvGrads causal_conv1d_silu_backward(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                            std::span<const float> x, std::span<const float> w, std::span<const float> dy);

/// The conv continuing a sequence (docs/hybrid.md, slice 6): `history` (K - 1, C) holds the input
/// rows before x's first, the previous token chunk's last ones (empty: zeros, as above); the
/// backward also returns their gradient, which the chunk before adds to the last K - 1 rows of
/// [its history; its x] (a chunk shorter than K - 1 passes the rest on to its own d_history). The
/// forward is the whole sequence's conv bit for bit; the gradients within fp32 rounding.
std::vector<float> causal_conv1d_silu_forward_from(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                                   std::span<const float> x, std::span<const float> w,
                                                   std::span<const float> history);
struct CausalConvCarriedGrads {
  CausalConvGrads grads;
  std::vector<float> d_history;  ///< (K - 1, C)
};
CausalConvCarriedGrads causal_conv1d_silu_backward_from(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                                        std::span<const float> x, std::span<const float> w,
                                                        std::span<const float> history, std::span<const float> dy);

/// The DeltaNet's gates per (t, h): beta = sigmoid(b), g = -exp(A_log[h]) softplus(a + dt_bias[h])
/// (softplus(x) = x above 20, as torch's). a, b: (T, H); A_log, dt_bias: (H).
struct DeltaGates {
  std::vector<float> beta, g;  ///< (T, H)
};
DeltaGates delta_gates_forward(std::int64_t tokens, std::int64_t heads, std::span<const float> a, std::span<const float> b,
                               std::span<const float> a_log, std::span<const float> dt_bias);

struct DeltaGateGrads {
  std::vector<float> da, db;             ///< (T, H)
  std::vector<float> da_log, ddt_bias;   ///< (H)
};
DeltaGateGrads delta_gates_backward(std::int64_t tokens, std::int64_t heads, std::span<const float> a, std::span<const float> b,
                                    std::span<const float> a_log, std::span<const float> dt_bias,
                                    std::span<const float> dbeta, std::span<const float> dg);

/// Qwen3NextRMSNormGated over rows of `dim`: y = w * x / sqrt(mean(x^2) + eps) * silu(z).
/// x, z, y: (rows, dim); w: (dim).
std::vector<float> gated_rmsnorm_forward(std::int64_t rows, std::int64_t dim, std::span<const float> x,
                                         std::span<const float> z, std::span<const float> w, double eps);

struct GatedRmsNormGrads {
  std::vector<float> dx, dz;  ///< (rows, dim)
  std::vector<float> dw;      ///< (dim)
};
GatedRmsNormGrads gated_rmsnorm_backward(std::int64_t rows, std::int64_t dim, std::span<const float> x,
                                         std::span<const float> z, std::span<const float> w, double eps,
                                         std::span<const float> dy);

/// A whole Gated DeltaNet (linear-attention) block as transformers' Qwen3NextGatedDeltaNet runs
/// it on one sequence without a cache: in_proj_qkvz and in_proj_ba, the per-key-head interleaved
/// split (fix_query_key_value_ordering), the conv + SiLU over [q, k, v] (hidden_act must be silu,
/// as in every Qwen3-Next config), the gates, the gated delta rule, the gated RMSNorm with z,
/// out_proj. Its projections come in one of two layouts (`layout`, below): the weights must be
/// given in the layout named, since both have the same sizes.
enum class DeltaNetLayout : unsigned char {
  /// Qwen3-Next: in_proj_qkvz holds, per key head, [q (dk), k (dk), v (r dv), z (r dv)] of its
  /// r = v_heads / k_heads value heads, and in_proj_ba per key head [b (r), a (r)]
  /// (fix_query_key_value_ordering).
  qwen3_next_fused,
  /// Qwen3.5-MoE: in_proj_qkvz is in_proj_qkv ([q | k | v], the conv's channel order) stacked over
  /// in_proj_z, and in_proj_ba is in_proj_b stacked over in_proj_a (rows).
  qwen3_5_stacked,
};

struct GatedDeltaNetShape {
  std::int64_t tokens = 0, hidden = 0;
  std::int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;  ///< linear_num_key_heads, ..., linear_value_head_dim
  std::int64_t conv_kernel = 4;                                  ///< linear_conv_kernel_dim
  double eps = 1e-6;                                             ///< rms_norm_eps
  DeltaNetLayout layout = DeltaNetLayout::qwen3_next_fused;
  [[nodiscard]] std::int64_t key_width() const { return k_heads * k_dim; }
  [[nodiscard]] std::int64_t value_width() const { return v_heads * v_dim; }
  [[nodiscard]] std::int64_t conv_channels() const { return 2 * key_width() + value_width(); }
};

/// The block's parameters under their transformers layouts (nn.Linear: (out, in)).
struct GatedDeltaNetWeights {
  std::span<const float> in_proj_qkvz;  ///< (2 key_width + 2 value_width, hidden)
  std::span<const float> in_proj_ba;    ///< (2 v_heads, hidden)
  std::span<const float> conv;          ///< (conv_channels, conv_kernel)
  std::span<const float> a_log, dt_bias;  ///< (v_heads)
  std::span<const float> norm;          ///< (v_dim)
  std::span<const float> out_proj;      ///< (hidden, value_width)
};

/// Where each of the block's tensors starts in its linear_attention segment, in elements: ModelSpec's
/// order, in_proj_qkvz (Qwen3.5: in_proj_qkv then in_proj_z), in_proj_ba (in_proj_b then
/// in_proj_a), conv1d, dt_bias, A_log, norm, out_proj; `end` is the segment's size. The one
/// statement of that layout for the host layer, the GPU block and their tests.
struct GatedDeltaNetOffsets {
  std::int64_t in_proj_qkvz = 0, in_proj_ba = 0, conv = 0, dt_bias = 0, a_log = 0, norm = 0, out_proj = 0, end = 0;
};
GatedDeltaNetOffsets gated_deltanet_offsets(const GatedDeltaNetShape& s);

/// The weights of a segment laid out as gated_deltanet_offsets says.
GatedDeltaNetWeights gated_deltanet_weights(const GatedDeltaNetShape& s, std::span<const float> segment);

/// out (T, hidden) from x (T, hidden).
std::vector<float> gated_deltanet_forward(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w);

struct GatedDeltaNetGrads {
  std::vector<float> dx;  ///< (T, hidden)
  std::vector<float> in_proj_qkvz, in_proj_ba, conv, a_log, dt_bias, norm, out_proj;  ///< as the weights
};

/// Every gradient from d_out (T, hidden); the forward is run again inside.
GatedDeltaNetGrads gated_deltanet_backward(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                           std::span<const float> d_out);

/// What a token chunk of one sequence hands the next (docs/hybrid.md, slice 6): the rule's state
/// per value head (v_heads, dk, dv) and the conv's last K - 1 input rows (K - 1, C). Empty
/// vectors: zeros (a sequence's first chunk). The gradients of the same, handed back.
struct GatedDeltaNetCarry {
  std::vector<float> state;         ///< (v_heads, dk, dv)
  std::vector<float> conv_history;  ///< (K - 1, conv channels): [q k v] before the conv
};
/// The block over a token chunk continuing a sequence from `in`; returns its output and the
/// carry for the chunk after. Chunks run in order are the whole block (the rule within its fp32
/// handover of the state; everything else per token or bit for bit).
struct GatedDeltaNetChunk {
  std::vector<float> out;  ///< (T, hidden)
  GatedDeltaNetCarry carry;
};
GatedDeltaNetChunk gated_deltanet_forward_from(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                               const GatedDeltaNetCarry& in);
/// Its backward from d_out and `d_carry_out`, the next chunk's d_carry_in (empty: zeros): the
/// chunk's gradients (weights' to be summed over the chunks) and the gradient of `in`.
struct GatedDeltaNetChunkGrads {
  GatedDeltaNetGrads grads;
  GatedDeltaNetCarry d_carry_in;
};
GatedDeltaNetChunkGrads gated_deltanet_backward_from(const GatedDeltaNetShape& s, std::span<const float> x,
                                                     const GatedDeltaNetWeights& w, std::span<const float> d_out,
                                                     const GatedDeltaNetCarry& in, const GatedDeltaNetCarry& d_carry_out);

/// Adds g's weight gradients into a segment's gradient (float or double), laid out as
/// gated_deltanet_offsets says.
template <class T>
void add_gated_deltanet_grads(const GatedDeltaNetShape& s, const GatedDeltaNetGrads& g, std::span<T> segment) {
  const GatedDeltaNetOffsets o = gated_deltanet_offsets(s);
  auto add = [&](std::int64_t at, const std::vector<float>& v) {
    for (std::size_t i = 0; i < v.size(); ++i) segment[static_cast<std::size_t>(at) + i] += v[i];
  };
  add(o.in_proj_qkvz, g.in_proj_qkvz);
  add(o.in_proj_ba, g.in_proj_ba);
  add(o.conv, g.conv);
  add(o.dt_bias, g.dt_bias);
  add(o.a_log, g.a_log);
  add(o.norm, g.norm);
  add(o.out_proj, g.out_proj);
}

}  // namespace oom::reference
