// HostDecoderLayer: a Qwen3-MoE decoder layer on the CPU; see oom/model/host_decoder_layer.hpp.
// The norms, RoPE, attention core, router, SwiGLU and the token permutation are the CPU references
// of include/oom/reference; the projections are the two fp64-accumulating GEMM loops below.
#include "oom/model/host_decoder_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"
#include "oom/optim/thread_pool.hpp"
#include "oom/reference/attention.hpp"
#include "oom/reference/output_gate.hpp"
#include "oom/reference/permute.hpp"
#include "oom/reference/rmsnorm.hpp"
#include "oom/reference/rope.hpp"
#include "oom/reference/router.hpp"
#include "oom/reference/swiglu.hpp"

namespace oom {
namespace {

using std::size_t;
using Vec = std::vector<float>;

constexpr auto cls(ActivationClass c) { return static_cast<size_t>(c); }

// ---- GEMM loops ------------------------------------------------------------------------------
// Every output element is computed by one fixed sequence of operations (a dot product in eight
// fp64 lanes, or an fp64 sum over the inner index in order), whichever thread computes it and
// however the work is split, so the results do not depend on the thread count.

optim::ThreadPool& pool() {
  static optim::ThreadPool p(0);
  return p;
}

/// fn(r0, r1, c0, c1) over an (rows, cols) output: split by rows when there are enough of them,
/// else by columns; inline when the work is too small to pay for the hand-off.
void parallel_2d(size_t rows, size_t cols, double work, const std::function<void(size_t, size_t, size_t, size_t)>& fn) {
  auto& p = pool();
  const size_t threads = p.size();
  if (threads == 1 || work < 2e5 || rows * cols < 2) {
    fn(0, rows, 0, cols);
    return;
  }
  if (rows >= 2 * threads) {
    const size_t tasks = std::min(rows, 4 * threads);
    p.run(tasks, [&](size_t t) { fn(rows * t / tasks, rows * (t + 1) / tasks, 0, cols); });
  } else {
    const size_t tasks = std::min(cols, 4 * threads);
    p.run(tasks, [&](size_t t) { fn(0, rows, cols * t / tasks, cols * (t + 1) / tasks); });
  }
}

inline double dot(const float* a, const float* b, size_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (size_t l = 0; l < 8; ++l) s[l] += static_cast<double>(a[i + l]) * static_cast<double>(b[i + l]);
  double r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return r;
}

/// C (M, N) = A (M, K) . B^T with B stored (N, K): the projections with HF-layout weights.
void gemm_nt(const float* a, const float* b, float* c, size_t m, size_t n, size_t k) {
  if (m == 0 || n == 0) return;
  parallel_2d(m, n, static_cast<double>(m) * n * k, [=](size_t r0, size_t r1, size_t c0, size_t c1) {
    constexpr size_t tile = 16;  // rows of B kept in L1 while the rows of A pass
    for (size_t j0 = c0; j0 < c1; j0 += tile)
      for (size_t i = r0; i < r1; ++i)
        for (size_t j = j0; j < std::min(c1, j0 + tile); ++j) c[i * n + j] = static_cast<float>(dot(a + i * k, b + j * k, k));
  });
}

/// C (M, K) = A (M, N) . B (N, K), or C += it (`accumulate`): each C row sums a_ij B_j over j in
/// order in fp64. Serves dX = dY . W and, with A a transposed gradient, dW = dY^T . X.
void gemm_nn(const float* a, const float* b, float* c, size_t m, size_t n, size_t k, bool accumulate) {
  if (m == 0 || k == 0) return;
  parallel_2d(m, k, static_cast<double>(m) * n * k, [=](size_t r0, size_t r1, size_t c0, size_t c1) {
    std::vector<double> acc(c1 - c0);
    for (size_t i = r0; i < r1; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (size_t j = 0; j < n; ++j) {
        const double aij = a[i * n + j];
        const float* bj = b + j * k + c0;
        for (size_t x = 0; x < acc.size(); ++x) acc[x] += aij * static_cast<double>(bj[x]);
      }
      float* ci = c + i * k + c0;
      if (accumulate)
        for (size_t x = 0; x < acc.size(); ++x) ci[x] += static_cast<float>(acc[x]);
      else
        for (size_t x = 0; x < acc.size(); ++x) ci[x] = static_cast<float>(acc[x]);
    }
  });
}

/// dst (C, R) = src (R, C)^T.
void transpose(const float* src, float* dst, size_t rows, size_t cols) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

std::span<const float> cspan(const float* p, size_t n) { return {p, n}; }
std::span<const float> cspan(const Vec& v) { return {v.data(), v.size()}; }

std::string unsupported(int layer, std::string_view feature) {
  return fmt::format("HostDecoderLayer: layer {} has {}, which the host decoder layer does not implement "
                     "(it runs qwen3_moe, qwen3_next, qwen3_5_moe, mixtral, olmoe and qwen2_moe layers: an MoE "
                     "block; full attention with per-head, full-width or no q/k RMSNorm, q/k/v biases or none, "
                     "no sliding window, or Gated DeltaNet linear attention)",
                     layer, feature);
}

}  // namespace

HostDecoderLayer::HostDecoderLayer(const ModelSpec& spec, int layer) : layer_(layer) {
  const LayerSpec& ls = spec.layer(layer);
  const auto& a = spec.attention();
  const auto& m = spec.moe();
  const ModelFamily family = spec.family();
  linear_ = ls.attention == AttentionKind::linear;
  if (!linear_) {
    if (a.bias) OOM_THROW(Errc::unsupported, unsupported(layer, "attention bias on o_proj (attention_bias)"));
    if (a.qkv_bias && a.output_gate) OOM_THROW(Errc::unsupported, unsupported(layer, "q/k/v biases beside an output gate"));
    if (a.qkv_bias) qkv_bias_n_ = (a.heads + 2 * a.kv_heads) * a.head_dim;
    if (a.sliding_window > 0)
      OOM_THROW(Errc::unsupported, unsupported(layer, fmt::format("sliding-window attention (sliding_window {})", a.sliding_window)));
    if (a.clip_qkv > 0) OOM_THROW(Errc::unsupported, unsupported(layer, fmt::format("clip_qkv {}", a.clip_qkv)));
    // transformers gates every Qwen3-Next and Qwen3.5 attention whatever attn_output_gate says;
    // a config without the gate would describe another model than the one it loads.
    if ((family == ModelFamily::qwen3_next || family == ModelFamily::qwen3_5_moe) && !a.output_gate)
      OOM_THROW(Errc::unsupported, unsupported(layer, "attn_output_gate false (transformers always gates this family's attention)"));
  }
  if (m.router_jitter_noise > 0)
    OOM_THROW(Errc::unsupported, unsupported(layer, fmt::format("router_jitter_noise {} (random, so no step could be reproduced)",
                                                                m.router_jitter_noise)));
  if (!ls.moe) OOM_THROW(Errc::unsupported, unsupported(layer, "a dense MLP (mlp_only_layers / decoder_sparse_step)"));

  const auto segs = spec.layer_segments(layer);
  segments_.assign(segs.begin(), segs.end());
  name_ = fmt::format("layers.{}", layer);
  h_ = spec.hidden_size();
  heads_ = a.heads;
  kv_heads_ = a.kv_heads;
  d_ = a.head_dim;
  q_ = heads_ * d_;
  kv_ = kv_heads_ * d_;
  e_ = m.experts;
  k_ = m.top_k;
  i_ = m.expert_intermediate;
  shared_i_ = m.shared_expert_intermediate;
  eps_ = static_cast<float>(spec.rms_norm_eps());
  theta_ = static_cast<float>(spec.rope_theta());
  scale_ = 1.0 / std::sqrt(static_cast<double>(d_));
  norm_topk_ = m.norm_topk_prob;
  if (!linear_ && a.qk_norm) {  // Qwen's per head, OLMoE's over the whole projection; Mixtral's none
    q_norm_n_ = a.qk_norm_full_width ? q_ : d_;
    k_norm_n_ = a.qk_norm_full_width ? kv_ : d_;
  }
  output_gate_ = !linear_ && a.output_gate;
  norm_offset_ = spec.zero_centred_norms() ? 1.0f : 0.0f;
  // transformers: int(head_dim * partial_rotary_factor), rotated as rotate-half pairs.
  rotary_ = static_cast<std::uint64_t>(static_cast<double>(d_) * spec.partial_rotary_factor());
  if (!linear_ && (rotary_ == 0 || rotary_ > d_ || rotary_ % 2 != 0))
    OOM_THROW(Errc::unsupported, unsupported(layer, fmt::format("a rotary dimension of {} (head_dim {} x partial_rotary_factor {}): "
                                                                "it must be even and in (0, head_dim]",
                                                                rotary_, d_, spec.partial_rotary_factor())));
  if (linear_) {
    const auto& l = spec.linear_attention();
    delta_.hidden = static_cast<std::int64_t>(h_);
    delta_.k_heads = static_cast<std::int64_t>(l.key_heads);
    delta_.v_heads = static_cast<std::int64_t>(l.value_heads);
    delta_.k_dim = static_cast<std::int64_t>(l.key_head_dim);
    delta_.v_dim = static_cast<std::int64_t>(l.value_head_dim);
    delta_.conv_kernel = static_cast<std::int64_t>(l.conv_kernel);
    delta_.eps = spec.rms_norm_eps();
    delta_.layout = family == ModelFamily::qwen3_5_moe ? reference::DeltaNetLayout::qwen3_5_stacked
                                                       : reference::DeltaNetLayout::qwen3_next_fused;
  }
  // The layout the weight offsets below assume.
  OOM_ASSERT(segments_.size() == 3 + e_ + (shared_i_ > 0 ? 1 : 0));
  if (linear_) {
    const auto C = static_cast<std::uint64_t>(delta_.conv_channels()), vw = static_cast<std::uint64_t>(delta_.value_width());
    const auto kw = static_cast<std::uint64_t>(delta_.key_width()), vh = static_cast<std::uint64_t>(delta_.v_heads);
    OOM_ASSERT(segments_[0].parameters() == (2 * kw + 2 * vw) * h_ + 2 * vh * h_ + C * static_cast<std::uint64_t>(delta_.conv_kernel) +
                                                2 * vh + static_cast<std::uint64_t>(delta_.v_dim) + h_ * vw);
  } else {
    OOM_ASSERT(segments_[0].parameters() == attention_layout().end);
  }
  OOM_ASSERT(segments_[1].parameters() == 2 * h_ && segments_[2].parameters() == e_ * h_);
  for (std::uint64_t e = 0; e < e_; ++e) OOM_ASSERT(segments_[3 + e].parameters() == 3 * i_ * h_);
  if (shared_i_ > 0) OOM_ASSERT(segments_[3 + e_].parameters() == 3 * shared_i_ * h_ + h_);
}

std::uint64_t HostDecoderLayer::saved_floats(ActivationClass c, std::uint64_t t) const {
  switch (c) {
    case ActivationClass::norm_output: return 3 * t * h_ + 2 * t;
    case ActivationClass::attention_output: return linear_ ? 0 : t * (2 * q_ + 2 * kv_ + (output_gate_ ? q_ : 0));
    case ActivationClass::softmax_stats: return linear_ ? 0 : heads_ * t;
    case ActivationClass::router_output: return t * (e_ + 2 * k_);
    case ActivationClass::expert_intermediate: return t * k_ * 2 * i_ + (shared_i_ > 0 ? t * (2 * shared_i_ + 1) : 0);
    default: return 0;
  }
}

LayerCost HostDecoderLayer::cost(const Workload& w) const {
  const double t = static_cast<double>(w.tokens()), s = static_cast<double>(w.seq_len);
  const double H = static_cast<double>(h_);
  double proj = 0, core = 0, mixer_backward = 0;
  if (linear_) {
    const auto kw = static_cast<double>(delta_.key_width()), vw = static_cast<double>(delta_.value_width());
    const auto vh = static_cast<double>(delta_.v_heads), C = static_cast<double>(delta_.conv_channels());
    proj = 2 * t * H * (2 * kw + 2 * vw + 2 * vh) + 2 * t * vw * H;
    // The conv, and per token and value head the decay, S^T k, the rank-1 update and S^T q.
    core = 2 * t * C * static_cast<double>(delta_.conv_kernel) + 8 * t * vh * static_cast<double>(delta_.k_dim * delta_.v_dim);
    mixer_backward = 3 * (proj + core);  // the block runs again, then twice its work backward
  } else {
    proj = 2 * t * H * static_cast<double>((output_gate_ ? 2 : 1) * q_ + 2 * kv_) + 2 * t * static_cast<double>(q_) * H;
    // QK^T and PV over the causal pairs of each sequence.
    core = static_cast<double>(w.sequences) * 2.0 * static_cast<double>(heads_ * d_) * s * (s + 1);
    mixer_backward = 2 * proj + 2.5 * core;
  }
  const double router = 2 * t * H * static_cast<double>(e_);
  const double experts = 2 * t * static_cast<double>(k_) * 3 * H * static_cast<double>(i_) +
                         (shared_i_ > 0 ? 2 * t * (3 * H * static_cast<double>(shared_i_) + H) : 0.0);
  const double norms = 8 * t * H + (linear_ ? 0.0 : 8 * t * static_cast<double>(q_ + kv_));
  const double attention_half = proj + core + norms / 2;
  LayerCost c;
  c.forward_flops = proj + core + router + experts + norms;
  c.backward_flops = mixer_backward + 2 * (router + experts + norms);
  const std::uint64_t tokens = w.tokens();
  for (auto a : {ActivationClass::norm_output, ActivationClass::attention_output, ActivationClass::softmax_stats,
                 ActivationClass::router_output, ActivationClass::expert_intermediate}) {
    if (saved_floats(a, tokens) == 0) continue;  // a linear-attention layer's attention classes
    const bool attn = is_attention_result(a);
    c.activations.push_back({a, Bytes{saved_floats(a, tokens) * sizeof(float)}, attn ? attention_half : c.forward_flops});
  }
  // Live while the layer runs unchunked: the fp32 weight copies, the mixer's and the MoE half's
  // temporaries and the backward's per-slot gradients.
  std::uint64_t params = 0;
  for (const auto& seg : segments_) params += seg.parameters();
  std::uint64_t per_token = 8 * h_ + 2 * e_ + k_ * (4 * i_ + 3 * i_ + 3 * h_) + (shared_i_ > 0 ? 7 * shared_i_ + h_ + 2 : 0);
  std::uint64_t fixed = 0;
  if (linear_) {
    // The reference block: its projections, conv, gates and core per token (x2 in backward), one
    // head's S x dk x dv fp64 states while its backward runs (sequences run one at a time), and
    // the gradient of every weight of the block it returns for a sequence.
    const auto row = static_cast<std::uint64_t>(2 * delta_.key_width() + 2 * delta_.value_width() + 2 * delta_.v_heads);
    per_token += 6 * row;
    fixed = 2 * (w.seq_len + 1) * static_cast<std::uint64_t>(delta_.k_dim * delta_.v_dim) + segments_[0].parameters();
  } else {
    per_token += 6 * q_ + 6 * kv_ + (output_gate_ ? 4 * q_ : 0);  // the gate, o_proj's input and their gradients
  }
  c.workset = Bytes{(params + tokens * per_token + fixed) * sizeof(float)};
  c.output = Bytes{tokens * h_ * sizeof(float)};
  return c;
}

// ---- pass bookkeeping ------------------------------------------------------------------------

void HostDecoderLayer::check_context(const LayerContext& ctx, bool backward) const {
  if (ctx.weights.size() != segments_.size() || ctx.weight_grads.size() != segments_.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: {} weight bindings for {} segments", name_, ctx.weights.size(), segments_.size()));
  for (size_t s = 0; s < segments_.size(); ++s) {
    if (ctx.weights[s].size() != segments_[s].parameters())
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: segment '{}' bound with {} values for {} parameters", name_,
                                                    segments_[s].name, ctx.weights[s].size(), segments_[s].parameters()));
    if (backward && ctx.weight_grads[s].size() != segments_[s].parameters())
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: gradient of segment '{}' has {} values for {} parameters", name_,
                                                    segments_[s].name, ctx.weight_grads[s].size(), segments_[s].parameters()));
  }
  if (ctx.begin >= ctx.end || ctx.end > ctx.tokens || ctx.input == nullptr)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: bad call over tokens [{}, {}) of {}", name_, ctx.begin, ctx.end, ctx.tokens));
  if (ctx.sequences == 0 || ctx.tokens % ctx.sequences != 0)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{}: {} tokens are not a whole number of sequences = {}", name_, ctx.tokens, ctx.sequences));
  if (backward) {
    if (ctx.grad_output == nullptr || ctx.grad_input == nullptr)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: backward without gradient buffers", name_));
    for (int c = 1; c < activation_class_count; ++c)
      if (saved_floats(static_cast<ActivationClass>(c), ctx.tokens) > 0 && ctx.saved[static_cast<size_t>(c)] == nullptr)
        OOM_THROW(Errc::invalid_argument, fmt::format("{}: backward without the saved {}", name_, to_string(static_cast<ActivationClass>(c))));
  }
}

// Chunks come in increasing order from token 0; a pass starts at 0 and must then continue where
// the previous call ended (the state between chunks depends on it).
void HostDecoderLayer::begin_pass(const LayerContext& ctx, std::uint64_t& tokens, std::uint64_t& sequences,
                                  std::uint64_t& next) {
  if (ctx.begin == 0) {
    tokens = ctx.tokens;
    sequences = ctx.sequences;
  } else if (ctx.begin != next || ctx.tokens != tokens || ctx.sequences != sequences) {
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{}: chunk [{}, {}) of {} tokens in {} sequence(s) does not continue the pass (expected begin {} of {} "
                          "tokens in {})",
                          name_, ctx.begin, ctx.end, ctx.tokens, ctx.sequences, next, tokens, sequences));
  }
  next = ctx.end;
  if (positions_.size() != ctx.tokens || positions_sequences_ != ctx.sequences) {
    const std::uint64_t seq = ctx.tokens / ctx.sequences;
    positions_.resize(ctx.tokens);  // each sequence's from 0
    for (size_t t = 0; t < positions_.size(); ++t) positions_[t] = static_cast<std::int32_t>(t % seq);
    positions_sequences_ = ctx.sequences;
  }
}

void HostDecoderLayer::convert_weights(const LayerContext& ctx) {
  w_.resize(segments_.size());
  for (size_t s = 0; s < segments_.size(); ++s) {
    const auto& src = ctx.weights[s];
    w_[s].resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) w_[s][i] = to_float(src[i]);
  }
  if (norm_offset_ != 0) {  // (1 + w), in fp32 as transformers: the layer norms, then q_norm and k_norm
    for (float& v : w_[1]) v += norm_offset_;
    if (!linear_)
      for (size_t i = attention_layout().q_norm; i < w_[0].size(); ++i) w_[0][i] += norm_offset_;
  }
}

HostDecoderLayer::AttentionLayout HostDecoderLayer::attention_layout() const {
  AttentionLayout a;
  a.o_proj = ((output_gate_ ? 2 : 1) * q_ + 2 * kv_) * h_;
  a.qkv_bias = a.o_proj + h_ * q_;
  a.q_norm = a.qkv_bias + qkv_bias_n_;
  a.k_norm = a.q_norm + q_norm_n_;
  a.end = a.k_norm + k_norm_n_;
  return a;
}

void HostDecoderLayer::normed_rotated(const float* raw, std::uint64_t tokens, std::uint64_t heads, const float* norm_weight,
                                      std::uint64_t norm_width, Vec& normed, Vec& rstd, Vec& rotated) const {
  const size_t n = tokens * heads * d_;
  normed.resize(n);
  rotated.resize(n);
  if (norm_width == 0) {
    std::copy(raw, raw + n, normed.begin());
    rstd.clear();
  } else {
    rstd.resize(n / norm_width);
    reference::rmsnorm_forward<float>(cspan(raw, n), cspan(norm_weight, norm_width), normed, rstd,
                                      static_cast<std::int64_t>(n / norm_width), static_cast<std::int64_t>(norm_width), eps_);
  }
  reference::rope_forward<float>(cspan(normed), std::span<const std::int32_t>(positions_.data(), tokens), rotated,
                                 static_cast<std::int64_t>(heads), static_cast<std::int64_t>(d_), static_cast<std::int64_t>(rotary_), theta_);
}

namespace {

/// The attention over a pass's tokens: ctx.sequences sequences, each causal on its own.
reference::AttentionDims attention_dims(const LayerContext& ctx, std::uint64_t heads, std::uint64_t kv_heads, std::uint64_t d) {
  return {static_cast<int>(ctx.sequences), static_cast<int>(ctx.tokens / ctx.sequences), static_cast<int>(heads),
          static_cast<int>(kv_heads), static_cast<int>(d)};
}

}  // namespace

// ---- forward ---------------------------------------------------------------------------------

void HostDecoderLayer::forward(LayerContext& ctx) {
  check_context(ctx, false);
  begin_pass(ctx, fwd_.tokens, fwd_.sequences, fwd_.next);
  if (ctx.begin == 0) {
    convert_weights(ctx);
    attention_forward(ctx);
  }
  const auto& sv = ctx.saved;
  if (ctx.output != nullptr || sv[cls(ActivationClass::norm_output)] != nullptr || sv[cls(ActivationClass::router_output)] != nullptr ||
      sv[cls(ActivationClass::expert_intermediate)] != nullptr)
    moe_forward(ctx);
  if (ctx.end == ctx.tokens) {  // the pass is over: give its memory back
    fwd_ = ForwardState{};
    w_.clear();
  }
}

void HostDecoderLayer::attention_forward(const LayerContext& ctx) {
  const size_t T = ctx.tokens, H = h_;
  const float* x = ctx.input;
  auto& f = fwd_;
  f.xn1.resize(T * H);
  f.rstd1.resize(T);
  reference::rmsnorm_forward<float>(cspan(x, T * H), cspan(w_[1].data(), H), f.xn1, f.rstd1, static_cast<std::int64_t>(T),
                                    static_cast<std::int64_t>(H), eps_);
  Vec attn(T * H);
  if (linear_) linear_attention_forward(ctx, attn);
  else full_attention_forward(ctx, attn);
  f.h.resize(T * H);
  for (size_t i = 0; i < T * H; ++i) f.h[i] = x[i] + attn[i];

  if (float* s = ctx.saved[cls(ActivationClass::norm_output)]) {
    std::copy(f.xn1.begin(), f.xn1.end(), s);
    std::copy(f.h.begin(), f.h.end(), s + 2 * T * H);
    std::copy(f.rstd1.begin(), f.rstd1.end(), s + 3 * T * H);
  }
  if (linear_) return;
  if (float* s = ctx.saved[cls(ActivationClass::attention_output)]) {
    s = std::copy(f.q_raw.begin(), f.q_raw.end(), s);
    s = std::copy(f.k_raw.begin(), f.k_raw.end(), s);
    s = std::copy(f.v.begin(), f.v.end(), s);
    s = std::copy(f.context.begin(), f.context.end(), s);
    std::copy(f.gate.begin(), f.gate.end(), s);  // empty without an output gate
  }
  if (float* s = ctx.saved[cls(ActivationClass::softmax_stats)]) std::copy(f.lse.begin(), f.lse.end(), s);
}

namespace {

using reference::output_gate_sigmoid;
float sigmoidf(float x) { return output_gate_sigmoid(x); }

/// The n values of the attention context scaled by sigmoid(gate), as o_proj reads them.
Vec gated_context(const float* context, const float* gate, size_t n) {
  Vec out(n);
  reference::output_gate_forward(cspan(context, n), cspan(gate, n), out);
  return out;
}

}  // namespace

void HostDecoderLayer::full_attention_forward(const LayerContext& ctx, Vec& out) {
  const size_t T = ctx.tokens, H = h_;
  const size_t Pq = (output_gate_ ? 2 : 1) * q_, P = Pq + 2 * kv_;  // q_proj's rows, then k_proj's and v_proj's
  const AttentionLayout at = attention_layout();
  const float* wa = w_[0].data();
  const float* w_o = wa + at.o_proj;
  const float* qkv_bias = wa + at.qkv_bias;
  const float* q_norm = wa + at.q_norm;
  const float* k_norm = wa + at.k_norm;
  auto& f = fwd_;
  Vec qkv(T * P);
  gemm_nt(f.xn1.data(), wa, qkv.data(), T, P, H);
  if (qkv_bias_n_ > 0)
    for (size_t t = 0; t < T; ++t)
      for (size_t j = 0; j < P; ++j) qkv[t * P + j] += qkv_bias[j];
  f.q_raw.resize(T * q_);
  f.gate.resize(output_gate_ ? T * q_ : 0);
  f.k_raw.resize(T * kv_);
  f.v.resize(T * kv_);
  for (size_t t = 0; t < T; ++t) {
    const float* row = qkv.data() + t * P;
    if (output_gate_) {  // per head [q_h | gate_h] (transformers: view(..., heads, 2 head_dim), chunk in two)
      for (size_t hd = 0; hd < heads_; ++hd) {
        std::copy_n(row + hd * 2 * d_, d_, f.q_raw.data() + t * q_ + hd * d_);
        std::copy_n(row + hd * 2 * d_ + d_, d_, f.gate.data() + t * q_ + hd * d_);
      }
    } else {
      std::copy_n(row, q_, f.q_raw.data() + t * q_);
    }
    std::copy_n(row + Pq, kv_, f.k_raw.data() + t * kv_);
    std::copy_n(row + Pq + kv_, kv_, f.v.data() + t * kv_);
  }
  Vec qn, rq, qr, kn, rk, kr;
  normed_rotated(f.q_raw.data(), T, heads_, q_norm, q_norm_n_, qn, rq, qr);
  normed_rotated(f.k_raw.data(), T, kv_heads_, k_norm, k_norm_n_, kn, rk, kr);
  const reference::AttentionDims dims = attention_dims(ctx, heads_, kv_heads_, d_);
  f.context.resize(T * q_);
  f.lse.resize(heads_ * T);
  reference::attention_forward<float>(dims, scale_, cspan(qr), cspan(kr), cspan(f.v), f.context, f.lse);
  if (output_gate_) gemm_nt(gated_context(f.context.data(), f.gate.data(), T * q_).data(), w_o, out.data(), T, H, q_);
  else gemm_nt(f.context.data(), w_o, out.data(), T, H, q_);
}


void HostDecoderLayer::linear_attention_forward(const LayerContext& ctx, Vec& out) {
  const size_t S = ctx.tokens / ctx.sequences, H = h_;
  reference::GatedDeltaNetShape shape = delta_;
  shape.tokens = static_cast<std::int64_t>(S);
  const reference::GatedDeltaNetWeights w = reference::gated_deltanet_weights(shape, w_[0]);
  for (size_t seq = 0; seq < ctx.sequences; ++seq) {  // each from a zero state
    const auto y = reference::gated_deltanet_forward(shape, cspan(fwd_.xn1.data() + seq * S * H, S * H), w);
    std::copy(y.begin(), y.end(), out.begin() + static_cast<std::ptrdiff_t>(seq * S * H));
  }
}

void HostDecoderLayer::moe_forward(const LayerContext& ctx) {
  const size_t T = ctx.tokens, H = h_, E = e_, K = k_, I = i_;
  const size_t b = ctx.begin, n = ctx.end - ctx.begin, slots = n * K;
  const float* h = fwd_.h.data() + b * H;
  Vec xn2(n * H), rstd2(n);
  reference::rmsnorm_forward<float>(cspan(h, n * H), cspan(w_[1].data() + H, H), xn2, rstd2, static_cast<std::int64_t>(n),
                                    static_cast<std::int64_t>(H), eps_);
  const reference::RouterShape rs{static_cast<std::int64_t>(n), static_cast<std::int64_t>(H), static_cast<std::int64_t>(E),
                                  static_cast<std::int64_t>(K), norm_topk_};
  const auto route = reference::router_forward(rs, xn2, w_[2]);
  // The load-balancing loss counts the forward's rows once (a recompute writes no output; a
  // regeneration of the boundary above reruns the forward for its output alone).
  if (balance_ != nullptr && ctx.output != nullptr && !ctx.regenerating) balance_->add(layer_, b, route.probs, route.expert_ids);
  const auto plan = reference::permute_plan(route.expert_ids, static_cast<std::int64_t>(n), static_cast<std::int64_t>(K),
                                            static_cast<std::int64_t>(E));
  const auto x_perm = reference::permute_rows(plan, xn2, static_cast<std::int64_t>(K), static_cast<std::int64_t>(H));
  Vec gate_up(slots * 2 * I);
  for (size_t e = 0; e < E; ++e) {
    const size_t r0 = static_cast<size_t>(plan.expert_offsets[e]), ne = static_cast<size_t>(plan.expert_counts[e]);
    gemm_nt(x_perm.data() + r0 * H, w_[3 + e].data(), gate_up.data() + r0 * 2 * I, ne, 2 * I, H);
  }
  // The shared expert's [gate | up] projections and its gate's logit, per token.
  const size_t SI = shared_i_;
  Vec shared_gate_up(n * 2 * SI), shared_logit(SI > 0 ? n : 0);
  if (SI > 0) {
    const float* ws = w_[3 + E].data();
    gemm_nt(xn2.data(), ws, shared_gate_up.data(), n, 2 * SI, H);
    gemm_nt(xn2.data(), ws + 3 * SI * H, shared_logit.data(), n, 1, H);
  }
  if (ctx.output != nullptr) {
    Vec act(slots * I), y(slots * H);
    reference::swiglu_forward<float>(cspan(gate_up), act, static_cast<std::int64_t>(slots), static_cast<std::int64_t>(I));
    for (size_t e = 0; e < E; ++e) {
      const size_t r0 = static_cast<size_t>(plan.expert_offsets[e]), ne = static_cast<size_t>(plan.expert_counts[e]);
      gemm_nt(act.data() + r0 * I, w_[3 + e].data() + 2 * I * H, y.data() + r0 * H, ne, H, I);
    }
    auto moe = reference::unpermute_combine(plan, y, route.weights, static_cast<std::int64_t>(K), static_cast<std::int64_t>(H));
    if (shared_i_ > 0) {  // routed + sigmoid(gate) * shared, then the residual (transformers' order)
      Vec act_unused;
      const Vec ys = shared_expert_output(shared_gate_up, n, act_unused);
      for (size_t t = 0; t < n; ++t) {
        const float sg = sigmoidf(shared_logit[t]);
        for (size_t c = 0; c < H; ++c) moe[t * H + c] += sg * ys[t * H + c];
      }
    }
    float* out = ctx.output + b * H;
    for (size_t i = 0; i < n * H; ++i) out[i] = h[i] + moe[i];
  }
  if (float* s = ctx.saved[cls(ActivationClass::norm_output)]) {
    std::copy(xn2.begin(), xn2.end(), s + T * H + b * H);
    std::copy(rstd2.begin(), rstd2.end(), s + 3 * T * H + T + b);
  }
  if (float* s = ctx.saved[cls(ActivationClass::router_output)]) {
    std::copy(route.probs.begin(), route.probs.end(), s + b * E);
    for (size_t j = 0; j < slots; ++j) {
      s[T * E + b * K + j] = static_cast<float>(route.expert_ids[j]);
      s[T * (E + K) + b * K + j] = route.weights[j];
    }
  }
  if (float* s = ctx.saved[cls(ActivationClass::expert_intermediate)]) {
    for (size_t r = 0; r < slots; ++r)
      std::copy_n(gate_up.data() + r * 2 * I, 2 * I, s + (b * K + static_cast<size_t>(plan.row_to_slot[r])) * 2 * I);
    if (SI > 0) {
      std::copy(shared_gate_up.begin(), shared_gate_up.end(), s + T * K * 2 * I + b * 2 * SI);
      std::copy(shared_logit.begin(), shared_logit.end(), s + T * K * 2 * I + T * 2 * SI + b);
    }
  }
}

// down(silu(gate) * up) of the shared expert for `n` tokens' [gate | up] rows; `act` gets silu(gate) * up.
Vec HostDecoderLayer::shared_expert_output(const Vec& gate_up, size_t n, Vec& act) const {
  const size_t SI = shared_i_, H = h_;
  act.resize(n * SI);
  Vec y(n * H);
  reference::swiglu_forward<float>(cspan(gate_up), act, static_cast<std::int64_t>(n), static_cast<std::int64_t>(SI));
  gemm_nt(act.data(), w_[3 + e_].data() + 2 * SI * H, y.data(), n, H, SI);
  return y;
}

// ---- backward --------------------------------------------------------------------------------

void HostDecoderLayer::backward(LayerContext& ctx) {
  check_context(ctx, true);
  begin_pass(ctx, bwd_.tokens, bwd_.sequences, bwd_.next);
  if (ctx.begin == 0) {
    convert_weights(ctx);
    const size_t T = ctx.tokens, slots = T * k_;
    bwd_.dxn2.assign(T * h_, 0.0f);
    bwd_.dlogits.assign(T * e_, 0.0f);
    bwd_.dgate_up.assign(slots * 2 * i_, 0.0f);
    bwd_.act.assign(slots * i_, 0.0f);
    bwd_.dy_weighted.assign(slots * h_, 0.0f);
    if (shared_i_ > 0) {
      bwd_.shared_dgate_up.assign(T * 2 * shared_i_, 0.0f);
      bwd_.shared_act.assign(T * shared_i_, 0.0f);
      bwd_.shared_dy.assign(T * h_, 0.0f);
      bwd_.shared_dlogit.assign(T, 0.0f);
    }
  }
  moe_backward(ctx);
  if (ctx.end == ctx.tokens) {
    moe_weight_grads(ctx);
    attention_backward(ctx);
    bwd_ = BackwardState{};
    w_.clear();
  }
}

// dh = dy + rms2'(d n2) for the chunk's tokens, into grad_input; what the weight gradients need
// goes to the pass state, per token and per slot.
void HostDecoderLayer::moe_backward(const LayerContext& ctx) {
  const size_t T = ctx.tokens, H = h_, E = e_, K = k_, I = i_;
  const size_t b = ctx.begin, n = ctx.end - ctx.begin, slots = n * K;
  const float* dy = ctx.grad_output + b * H;
  const float* norm = ctx.saved[cls(ActivationClass::norm_output)];
  const float* h = norm + 2 * T * H + b * H;
  const float* rstd2 = norm + 3 * T * H + T + b;
  const float* router = ctx.saved[cls(ActivationClass::router_output)];
  const float* probs = router + b * E;
  const float* weights = router + T * (E + K) + b * K;
  const float* gate_up_saved = ctx.saved[cls(ActivationClass::expert_intermediate)] + b * K * 2 * I;
  std::vector<std::int32_t> ids(slots);
  for (size_t j = 0; j < slots; ++j) ids[j] = static_cast<std::int32_t>(router[T * E + b * K + j]);
  const auto plan = reference::permute_plan(ids, static_cast<std::int64_t>(n), static_cast<std::int64_t>(K), static_cast<std::int64_t>(E));
  auto slot_of = [&](size_t r) { return static_cast<size_t>(plan.row_to_slot[r]); };

  // Expert rows in expert order: gate_up, the activation and the token's unweighted dy.
  Vec gate_up(slots * 2 * I), act(slots * I), dy_rows(slots * H);
  for (size_t r = 0; r < slots; ++r) {
    std::copy_n(gate_up_saved + slot_of(r) * 2 * I, 2 * I, gate_up.data() + r * 2 * I);
    std::copy_n(dy + slot_of(r) / K * H, H, dy_rows.data() + r * H);
  }
  reference::swiglu_forward<float>(cspan(gate_up), act, static_cast<std::int64_t>(slots), static_cast<std::int64_t>(I));
  // g = down^T dy; the combine weight's gradient is <dy, down act> = <g, act>, and d act = w g.
  Vec g(slots * I);
  for (size_t e = 0; e < E; ++e) {
    const size_t r0 = static_cast<size_t>(plan.expert_offsets[e]), ne = static_cast<size_t>(plan.expert_counts[e]);
    gemm_nn(dy_rows.data() + r0 * H, w_[3 + e].data() + 2 * I * H, g.data() + r0 * I, ne, H, I, false);
  }
  Vec d_weights(slots), d_act(slots * I);
  for (size_t r = 0; r < slots; ++r) {
    const size_t s = slot_of(r);
    d_weights[s] = static_cast<float>(dot(g.data() + r * I, act.data() + r * I, I));
    for (size_t i = 0; i < I; ++i) d_act[r * I + i] = weights[s] * g[r * I + i];
  }
  Vec d_gate_up(slots * 2 * I);
  reference::swiglu_backward<float>(cspan(d_act), cspan(gate_up), d_gate_up, static_cast<std::int64_t>(slots), static_cast<std::int64_t>(I));
  Vec dx_rows(slots * H);
  for (size_t e = 0; e < E; ++e) {
    const size_t r0 = static_cast<size_t>(plan.expert_offsets[e]), ne = static_cast<size_t>(plan.expert_counts[e]);
    gemm_nn(d_gate_up.data() + r0 * 2 * I, w_[3 + e].data(), dx_rows.data() + r0 * H, ne, 2 * I, H, false);
  }
  const auto dx_experts = reference::permute_rows_backward(plan, dx_rows, static_cast<std::int64_t>(K), static_cast<std::int64_t>(H));
  // Router: through the top-k renormalisation and the softmax, plus the load-balancing loss's
  // gradient where the model adds it (the same for every row).
  const reference::RouterShape rs{static_cast<std::int64_t>(n), static_cast<std::int64_t>(H), static_cast<std::int64_t>(E),
                                  static_cast<std::int64_t>(K), norm_topk_};
  const std::vector<double> no_balance(E, 0.0);
  const auto d_logits = reference::router_logits_backward(rs, cspan(probs, n * E), ids, d_weights,
                                                          balance_ != nullptr ? balance_->probability_gradient()
                                                                              : std::span<const double>(no_balance));
  Vec dxn2(n * H);
  gemm_nn(d_logits.data(), w_[2].data(), dxn2.data(), n, E, H, false);
  for (size_t i = 0; i < n * H; ++i) dxn2[i] = dx_experts[i] + dxn2[i];
  if (shared_i_ > 0) shared_expert_backward(ctx, dxn2);
  // rms2: the weight's gradient is taken over all tokens at the end of the pass.
  Vec dh(n * H), unused(H, 0.0f);
  reference::rmsnorm_backward<float>(cspan(dxn2), cspan(h, n * H), cspan(w_[1].data() + H, H), cspan(rstd2, n), dh, unused,
                                     static_cast<std::int64_t>(n), static_cast<std::int64_t>(H));
  float* gi = ctx.grad_input + b * H;
  for (size_t i = 0; i < n * H; ++i) gi[i] = dy[i] + dh[i];

  auto& st = bwd_;
  std::copy(dxn2.begin(), dxn2.end(), st.dxn2.data() + b * H);
  std::copy(d_logits.begin(), d_logits.end(), st.dlogits.data() + b * E);
  for (size_t r = 0; r < slots; ++r) {
    const size_t s = b * K + slot_of(r);
    std::copy_n(d_gate_up.data() + r * 2 * I, 2 * I, st.dgate_up.data() + s * 2 * I);
    std::copy_n(act.data() + r * I, I, st.act.data() + s * I);
    const float w = weights[slot_of(r)];
    for (size_t c = 0; c < H; ++c) st.dy_weighted[s * H + c] = w * dy_rows[r * H + c];
  }
}

// The shared expert of the chunk's tokens: adds its d n2 into dxn2 (n, H) and keeps what its
// weight gradients need. y = sigmoid(l) down(a), a = silu(gate) * up, l = <w_gate, n2>.
void HostDecoderLayer::shared_expert_backward(const LayerContext& ctx, Vec& dxn2) {
  const size_t T = ctx.tokens, H = h_, K = k_, I = i_, SI = shared_i_;
  const size_t b = ctx.begin, n = ctx.end - ctx.begin;
  const float* dy = ctx.grad_output + b * H;
  const float* saved = ctx.saved[cls(ActivationClass::expert_intermediate)] + T * K * 2 * I;
  const Vec gate_up(saved + b * 2 * SI, saved + (b + n) * 2 * SI);
  const float* logit = saved + T * 2 * SI + b;
  const float* ws = w_[3 + e_].data();
  Vec act;
  const Vec y = shared_expert_output(gate_up, n, act);
  auto& st = bwd_;
  Vec dy_scaled(n * H), dlogit(n);
  for (size_t t = 0; t < n; ++t) {
    const float sg = sigmoidf(logit[t]);
    // dL/dl = <dy, y> sigmoid'(l); the MLP's output gradient is sigmoid(l) dy.
    dlogit[t] = static_cast<float>(dot(dy + t * H, y.data() + t * H, H) * sg * (1.0 - static_cast<double>(sg)));
    for (size_t c = 0; c < H; ++c) dy_scaled[t * H + c] = sg * dy[t * H + c];
  }
  Vec d_act(n * SI), d_gate_up(n * 2 * SI), dx(n * H);
  gemm_nn(dy_scaled.data(), ws + 2 * SI * H, d_act.data(), n, H, SI, false);
  reference::swiglu_backward<float>(cspan(d_act), cspan(gate_up), d_gate_up, static_cast<std::int64_t>(n), static_cast<std::int64_t>(SI));
  gemm_nn(d_gate_up.data(), ws, dx.data(), n, 2 * SI, H, false);
  const float* w_gate = ws + 3 * SI * H;
  for (size_t t = 0; t < n; ++t)
    for (size_t c = 0; c < H; ++c) dxn2[t * H + c] += dx[t * H + c] + dlogit[t] * w_gate[c];
  std::copy(d_gate_up.begin(), d_gate_up.end(), st.shared_dgate_up.begin() + static_cast<std::ptrdiff_t>(b * 2 * SI));
  std::copy(act.begin(), act.end(), st.shared_act.begin() + static_cast<std::ptrdiff_t>(b * SI));
  std::copy(dy_scaled.begin(), dy_scaled.end(), st.shared_dy.begin() + static_cast<std::ptrdiff_t>(b * H));
  std::copy(dlogit.begin(), dlogit.end(), st.shared_dlogit.begin() + static_cast<std::ptrdiff_t>(b));
}

// The MoE half's weight gradients over all T tokens, each summed in token order.
void HostDecoderLayer::moe_weight_grads(const LayerContext& ctx) {
  const size_t T = ctx.tokens, H = h_, E = e_, K = k_, I = i_;
  const float* norm = ctx.saved[cls(ActivationClass::norm_output)];
  const float* xn2 = norm + T * H;
  const float* h = norm + 2 * T * H;
  const float* rstd2 = norm + 3 * T * H + T;
  const float* router = ctx.saved[cls(ActivationClass::router_output)];
  std::vector<std::int32_t> ids(T * K);
  for (size_t j = 0; j < T * K; ++j) ids[j] = static_cast<std::int32_t>(router[T * E + j]);
  const auto plan = reference::permute_plan(ids, static_cast<std::int64_t>(T), static_cast<std::int64_t>(K), static_cast<std::int64_t>(E));
  const auto& st = bwd_;
  Vec a, bm;
  for (size_t e = 0; e < E; ++e) {
    const size_t r0 = static_cast<size_t>(plan.expert_offsets[e]), ne = static_cast<size_t>(plan.expert_counts[e]);
    if (ne == 0) continue;
    float* grad = ctx.weight_grads[3 + e].data();
    // [gate; up] (2I, H) += d_gate_up^T . n2, over the expert's slots in token order.
    a.resize(2 * I * ne);
    bm.resize(ne * H);
    for (size_t r = 0; r < ne; ++r) {
      const size_t s = static_cast<size_t>(plan.row_to_slot[r0 + r]);
      for (size_t i = 0; i < 2 * I; ++i) a[i * ne + r] = st.dgate_up[s * 2 * I + i];
      std::copy_n(xn2 + s / K * H, H, bm.data() + r * H);
    }
    gemm_nn(a.data(), bm.data(), grad, 2 * I, ne, H, true);
    // down (H, I) += (w dy)^T . act.
    a.resize(H * ne);
    bm.resize(ne * I);
    for (size_t r = 0; r < ne; ++r) {
      const size_t s = static_cast<size_t>(plan.row_to_slot[r0 + r]);
      for (size_t c = 0; c < H; ++c) a[c * ne + r] = st.dy_weighted[s * H + c];
      std::copy_n(st.act.data() + s * I, I, bm.data() + r * I);
    }
    gemm_nn(a.data(), bm.data(), grad + 2 * I * H, H, ne, I, true);
  }
  if (shared_i_ > 0) {  // [gate; up] (2Is, H) += d_gate_up^T . n2; down (H, Is) += (s dy)^T . act; gate (1, H) += dl^T . n2
    const size_t SI = shared_i_;
    float* grad = ctx.weight_grads[3 + E].data();
    a.resize(2 * SI * T);
    transpose(st.shared_dgate_up.data(), a.data(), T, 2 * SI);
    gemm_nn(a.data(), xn2, grad, 2 * SI, T, H, true);
    a.resize(H * T);
    transpose(st.shared_dy.data(), a.data(), T, H);
    gemm_nn(a.data(), st.shared_act.data(), grad + 2 * SI * H, H, T, SI, true);
    gemm_nn(st.shared_dlogit.data(), xn2, grad + 3 * SI * H, 1, T, H, true);
  }
  // Router (E, H) += d_logits^T . n2.
  a.resize(E * T);
  transpose(st.dlogits.data(), a.data(), T, E);
  gemm_nn(a.data(), xn2, ctx.weight_grads[2].data(), E, T, H, true);
  // post_attention_layernorm.
  Vec unused(T * H);
  reference::rmsnorm_backward<float>(cspan(st.dxn2), cspan(h, T * H), cspan(w_[1].data() + H, H), cspan(rstd2, T), unused,
                                     ctx.weight_grads[1].subspan(H, H), static_cast<std::int64_t>(T), static_cast<std::int64_t>(H));
}

// The mixer's half over all tokens: reads dh from grad_input, overwrites it with dx.
void HostDecoderLayer::attention_backward(const LayerContext& ctx) {
  const size_t T = ctx.tokens, H = h_;
  const float* x = ctx.input;
  float* dh = ctx.grad_input;
  const float* rstd1 = ctx.saved[cls(ActivationClass::norm_output)] + 3 * T * H;
  Vec dxn1(T * H);
  if (linear_) linear_attention_backward(ctx, dxn1);
  else full_attention_backward(ctx, dxn1);
  // input_layernorm, and the residual.
  Vec dx(T * H);
  reference::rmsnorm_backward<float>(cspan(dxn1), cspan(x, T * H), cspan(w_[1].data(), H), cspan(rstd1, T), dx,
                                     ctx.weight_grads[1].subspan(0, H), static_cast<std::int64_t>(T), static_cast<std::int64_t>(H));
  for (size_t i = 0; i < T * H; ++i) dh[i] += dx[i];
}

void HostDecoderLayer::full_attention_backward(const LayerContext& ctx, Vec& dxn1) {
  const size_t T = ctx.tokens, H = h_, Pq = (output_gate_ ? 2 : 1) * q_, P = Pq + 2 * kv_;
  const float* dh = ctx.grad_input;
  const float* xn1 = ctx.saved[cls(ActivationClass::norm_output)];
  const float* attn = ctx.saved[cls(ActivationClass::attention_output)];
  const float* q_raw = attn;
  const float* k_raw = q_raw + T * q_;
  const float* v = k_raw + T * kv_;
  const float* context = v + T * kv_;
  const float* gate = output_gate_ ? context + T * q_ : nullptr;
  const float* lse = ctx.saved[cls(ActivationClass::softmax_stats)];
  const AttentionLayout at = attention_layout();
  const float* wa = w_[0].data();
  const float* w_o = wa + at.o_proj;
  const float* q_norm = wa + at.q_norm;
  const float* k_norm = wa + at.k_norm;
  float* ga = ctx.weight_grads[0].data();
  float* g_o = ga + at.o_proj;

  // o_proj reads the context, scaled by sigmoid(gate) where there is a gate.
  Vec dh_t(H * T);
  transpose(dh, dh_t.data(), T, H);
  if (gate != nullptr) gemm_nn(dh_t.data(), gated_context(context, gate, T * q_).data(), g_o, H, T, q_, true);
  else gemm_nn(dh_t.data(), context, g_o, H, T, q_, true);
  Vec d_context(T * q_), d_gate(gate != nullptr ? T * q_ : 0);
  gemm_nn(dh, w_o, d_context.data(), T, H, q_, false);
  if (gate != nullptr) {  // d o_in = d_context so far; o_in = c s(g)
    const Vec d_o = d_context;
    reference::output_gate_backward(cspan(context, T * q_), cspan(gate, T * q_), cspan(d_o), d_context, d_gate);
  }
  // Attention core, on q and k normed and rotated again exactly as in forward.
  Vec qn, rq, qr, kn, rk, kr;
  normed_rotated(q_raw, T, heads_, q_norm, q_norm_n_, qn, rq, qr);
  normed_rotated(k_raw, T, kv_heads_, k_norm, k_norm_n_, kn, rk, kr);
  const reference::AttentionDims dims = attention_dims(ctx, heads_, kv_heads_, d_);
  Vec dqr(T * q_), dkr(T * kv_), dv(T * kv_);
  reference::attention_backward<float>(dims, scale_, cspan(qr), cspan(kr), cspan(v, T * kv_), cspan(context, T * q_),
                                       cspan(lse, heads_ * T), cspan(d_context), dqr, dkr, dv);
  // RoPE and the q/k norms.
  Vec dqn(T * q_), dkn(T * kv_);
  const std::span<const std::int32_t> pos(positions_.data(), T);
  const auto D = static_cast<std::int64_t>(d_), R = static_cast<std::int64_t>(rotary_);
  reference::rope_backward<float>(cspan(dqr), pos, dqn, static_cast<std::int64_t>(heads_), D, R, theta_);
  reference::rope_backward<float>(cspan(dkr), pos, dkn, static_cast<std::int64_t>(kv_heads_), D, R, theta_);
  Vec dq_raw(T * q_), dk_raw(T * kv_);
  auto norm_backward = [&](const Vec& dn, const float* raw, size_t n, const float* w, std::uint64_t width, const Vec& rstd,
                           size_t at, Vec& draw) {
    if (width == 0) {
      draw = dn;
      return;
    }
    reference::rmsnorm_backward<float>(cspan(dn), cspan(raw, n), cspan(w, width), cspan(rstd), draw,
                                       ctx.weight_grads[0].subspan(at, width), static_cast<std::int64_t>(n / width),
                                       static_cast<std::int64_t>(width));
  };
  norm_backward(dqn, q_raw, T * q_, q_norm, q_norm_n_, rq, at.q_norm, dq_raw);
  norm_backward(dkn, k_raw, T * kv_, k_norm, k_norm_n_, rk, at.k_norm, dk_raw);
  // q(+gate)/k/v projections as one (P, H) matrix, rows as the forward split them.
  Vec dqkv(T * P);
  for (size_t t = 0; t < T; ++t) {
    float* row = dqkv.data() + t * P;
    if (gate != nullptr) {
      for (size_t hd = 0; hd < heads_; ++hd) {
        std::copy_n(dq_raw.data() + t * q_ + hd * d_, d_, row + hd * 2 * d_);
        std::copy_n(d_gate.data() + t * q_ + hd * d_, d_, row + hd * 2 * d_ + d_);
      }
    } else {
      std::copy_n(dq_raw.data() + t * q_, q_, row);
    }
    std::copy_n(dk_raw.data() + t * kv_, kv_, row + Pq);
    std::copy_n(dv.data() + t * kv_, kv_, row + Pq + kv_);
  }
  Vec dqkv_t(P * T);
  transpose(dqkv.data(), dqkv_t.data(), T, P);
  gemm_nn(dqkv_t.data(), xn1, ga, P, T, H, true);
  if (qkv_bias_n_ > 0)  // each bias's gradient: its rows' gradients summed over the tokens, in order
    for (size_t j = 0; j < P; ++j) {
      double sum = 0;
      for (size_t t = 0; t < T; ++t) sum += dqkv_t[j * T + t];
      ga[at.qkv_bias + j] += static_cast<float>(sum);
    }
  gemm_nn(dqkv.data(), wa, dxn1.data(), T, P, H, false);
}

// Each sequence's block run again from n1 and differentiated (the reference's backward), its
// weight gradients added in sequence order.
void HostDecoderLayer::linear_attention_backward(const LayerContext& ctx, Vec& dxn1) {
  const size_t S = ctx.tokens / ctx.sequences, H = h_;
  const float* xn1 = ctx.saved[cls(ActivationClass::norm_output)];
  reference::GatedDeltaNetShape shape = delta_;
  shape.tokens = static_cast<std::int64_t>(S);
  const reference::GatedDeltaNetWeights w = reference::gated_deltanet_weights(shape, w_[0]);
  for (size_t seq = 0; seq < ctx.sequences; ++seq) {
    const auto g = reference::gated_deltanet_backward(shape, cspan(xn1 + seq * S * H, S * H), w,
                                                      cspan(ctx.grad_input + seq * S * H, S * H));
    std::copy(g.dx.begin(), g.dx.end(), dxn1.begin() + static_cast<std::ptrdiff_t>(seq * S * H));
    reference::add_gated_deltanet_grads(shape, g, ctx.weight_grads[0]);
  }
}

}  // namespace oom
