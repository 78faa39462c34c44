// Per-layer work of a step, costed: FLOPs, saved bytes by class, chunked op times (see step_model.hpp).
#include "step_model.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/plan/cost_model.hpp"
#include "oom/plan/dependency_partitioner.hpp"

namespace oom::detail {

namespace {

constexpr std::uint64_t bf16_bytes = 2;
constexpr std::uint64_t fp32_bytes = 4;

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }  // (a + b - 1) / b wraps for b near 2^64

}  // namespace

StepModel::StepModel(const ModelSpec& spec, const MachineProfile& profile, const PlanRequest& req, ExecutionPath path)
    : spec_(spec), profile_(profile), req_(req), path_(path), cost_(profile, req.gpus) {
  check_countable();
  const auto& segs = spec.segments();
  seg_layer_.resize(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const auto& s = segs[i];
    // Pseudo-layers: -1 embedding, num_layers: final norm + LM head.
    seg_layer_[i] = s.layer >= 0 ? s.layer : (s.role == SegmentRole::embedding ? -1 : spec.num_layers());
  }
  for (const auto& s : segs) {
    seg_params_.push_back(s.parameters());
    seg_owner_.push_back(expert_owner(s));
  }
  layer_segments_.resize(static_cast<std::size_t>(spec.num_layers() + 2));
  for (std::size_t i = 0; i < segs.size(); ++i) layer_segments_[static_cast<std::size_t>(seg_layer_[i] + 1)].push_back(i);
}

// The byte counts below are 64-bit products of the workload's tokens and the model's widths:
// within max_workload_tokens and ModelSpec's size limits they can still pass 2^64 (a layer of
// 1024 experts of 4M intermediate, all routed, over 2^32 tokens: 1.1e20 bytes) and wrap into a
// plan that "fits". Bounded here, in long double, by the sum of every per-token width a step
// saves or holds, over every layer and then some: a workload past 2^62 such bytes is refused.
void StepModel::check_countable() const {
  const auto& a = spec_.attention();
  const auto& m = spec_.moe();
  const auto& la = spec_.linear_attention();
  using F = long double;
  F dense = 0;
  for (int l = 0; l < spec_.num_layers(); ++l) dense = std::max(dense, static_cast<F>(spec_.layer(l).dense_intermediate));
  const F width = F(spec_.hidden_size()) * 4 + F(a.heads) * F(a.head_dim) * 4 + F(a.kv_heads) * F(a.head_dim) * 2 + F(a.heads) +
                  F(m.experts) + F(m.top_k) * (2 + F(spec_.hidden_size()) + 3 * F(m.expert_intermediate)) +
                  3 * F(m.shared_expert_intermediate) + 3 * dense + F(spec_.vocab_size()) +
                  F(la.key_heads) * F(la.key_head_dim) * 2 + F(la.value_heads) * F(la.value_head_dim) * 3 +
                  5 * F(la.value_heads) + F(la.value_heads) * F(la.key_head_dim) * F(la.value_head_dim) / 32;  // a state per 64 tokens
  const F bytes = width * 8 * F(req_.workload.tokens()) * F(spec_.num_layers() + 2);
  if (bytes > F(std::uint64_t{1} << 62))
    OOM_THROW(Errc::invalid_argument,
              fmt::format("plan request: {} tokens of this model ({} layers, {} experts of {} intermediate, top-{}) would save ~{:.3g} "
                          "bytes of activations, past what the planner counts in 64 bits (2^62); fewer tokens per micro-batch or a "
                          "smaller model",
                          req_.workload.tokens(), spec_.num_layers(), m.experts, m.expert_intermediate, m.top_k,
                          static_cast<double>(bytes)));
}

std::uint64_t StepModel::tokens() const { return req_.workload.tokens(); }

int StepModel::expert_owner(const StateSegment& s) const {
  return path_ == ExecutionPath::expert_parallel && s.expert >= 0 ? s.expert % req_.gpus : -1;
}

// Bytes of one parameter's state held where it lives (GPU when resident, host when streamed).
std::uint64_t StepModel::state_bytes_per_param(bool on_gpu) const {
  const auto& p = req_.precision;
  std::uint64_t b = size_of(p.weights) + size_of(p.master) + 2 * size_of(p.moments);
  // A resident segment keeps an fp32 gradient on the GPU; a streamed one keeps an accumulator on
  // the host only when gradients accumulate over micro-batches.
  if (on_gpu || req_.micro_batches > 1) b += size_of(p.grads);
  return b;
}

LayerState StepModel::layer_state(int layer, const std::vector<bool>& resident) const {
  LayerState st;
  for (std::size_t i : layer_segments_.at(static_cast<std::size_t>(layer + 1))) {
    const std::uint64_t n = seg_params_[i];
    const int owner = seg_owner_[i];
    // In the per-GPU view of the expert-parallel path, GPU 0 stands for every GPU: it holds and
    // streams the experts it owns (expert % gpus == 0), which is 1/gpus of them.
    const bool mine = owner < 0 || owner == 0;
    if (resident[i]) {
      if (mine) st.resident_params += n;
    } else {
      if (mine) st.streamed_params += n;
      st.host_params += n;
      if (owner >= 0) st.host_expert_params += n;
    }
  }
  return st;
}

std::vector<LayerState> StepModel::layer_states(const std::vector<bool>& resident) const {
  std::vector<LayerState> states;
  for (int l = -1; l <= spec_.num_layers(); ++l) states.push_back(layer_state(l, resident));
  return states;
}

void StepModel::make_resident(std::vector<LayerState>& states, std::size_t segment) const {
  LayerState& st = states[static_cast<std::size_t>(seg_layer_[segment] + 1)];
  const std::uint64_t n = seg_params_[segment];
  const int owner = seg_owner_[segment];
  const bool mine = owner < 0 || owner == 0;
  if (mine) {
    st.streamed_params -= n;
    st.resident_params += n;
  }
  st.host_params -= n;
  if (owner >= 0) st.host_expert_params -= n;
}

WorkItem StepModel::attention_item(int layer) const {
  const auto& a = spec_.attention();
  const std::uint64_t b = req_.workload.sequences;
  WorkItem w;
  w.granularity = 128;  // the attention kernel's query tile
  w.extent = req_.workload.seq_len;
  if (spec_.layer(layer).attention == AttentionKind::full) {
    w.dependency = ChunkDependency::causal_prefix;
    // What the CUDA layer's backward holds in query chunks (model/cuda_decoder_layer.cpp, its
    // attention phase; DecoderLayerShape::attention_chunk_tokens); test_cuda_deltanet_shape ties
    // the two. The chunks then come out equal but the last, the length the executor runs.
    const std::uint64_t q = a.heads * a.head_dim, kv = a.kv_heads * a.head_dim;
    // Per query position of the chunk: the attention output's gradient and dq, and gated, o_proj's
    // input again, the gate's gradient and [dq | d gate] (6 q-wide in all, 2 without the gate) in
    // bf16; the kernel's two fp32 a query head. (The layer takes one sequence's chunk at a time;
    // for several sequences this counts b x that: safe, not tight.)
    w.per_unit = Bytes{b * ((a.output_gate ? 6 : 2) * q * bf16_bytes + 2 * a.heads * fp32_bytes)};
    // Whatever the chunk, all T (every sequence's positions): dK and dV in bf16, d xn1 in fp32
    // and bf16, and with q/k/v biases (Qwen2-MoE) the bf16 ones their gradients are summed with;
    // in query chunks also dK's and dV's fp32 sums over the chunks (split_fixed: a whole sequence
    // at once holds none). (Keys up to the chunk's end would do, but the layer holds them for the
    // whole sequence.)
    const std::uint64_t T = tokens();
    w.fixed = Bytes{T * (2 * kv * bf16_bytes + spec_.hidden_size() * (fp32_bytes + bf16_bytes) + (a.qkv_bias ? bf16_bytes : 0))};
    w.split_fixed = Bytes{T * 2 * kv * fp32_bytes};
  } else {
    // The GPU block's workspace (model/cuda_deltanet.cpp, its backward's, the larger), run in
    // parts of the chunk's tokens with the state carried (slice 6); test_cuda_deltanet_shape ties
    // the two. Fixed: the rule kernel's one chunk of states per head (the rows padded to 32, 64 or
    // 128, the columns to 32), the state's gradient carried between parts, the conv's K - 1 rows
    // of d mixed from the part after (twice: carried, and placed), the weight gradients' fp32
    // scratch of conv, A_log, dt_bias and norm.
    const auto& la = spec_.linear_attention();
    const std::uint64_t vh = la.value_heads, dk = la.key_head_dim, dv = la.value_head_dim, K = la.conv_kernel;
    const std::uint64_t kw = la.key_heads * dk, vw = vh * dv, C = 2 * kw + vw, PW = C + vw;
    const std::uint64_t rows = dk <= 32 ? 32 : dk <= 64 ? 64 : 128, cols = ceil_div(dv, 32) * 32;
    const bool fused = spec_.family() == ModelFamily::qwen3_next;  // the projections refused into their fused rows: twice
    w.dependency = ChunkDependency::carried_state;
    // (The rule's state interval, 64, is DeltaNetShape's default. Run in parts the block takes one
    // sequence at a time, so for several sequences this counts b x what a part needs: safe, not
    // tight.) The weight-gradient partials come a block of 256, 128 or 64 tokens at a time: one
    // more block of each covers a part that ends mid-block, so the weights' scratch counts twice.
    w.fixed = Bytes{b * vh * std::min<std::uint64_t>(64, req_.workload.seq_len) * rows * cols * fp32_bytes +
                    vh * dk * dv * fp32_bytes + 2 * (K - 1) * C * bf16_bytes + 2 * (C * K + 2 * vh + dv) * fp32_bytes};
    // Per token: dy, d core, the conv's output again, d [q k v z], d [b a], d mixed (and the fused
    // layout's copies) in bf16; rstd, dg, dbeta in fp32; the rule's dq and dk per value head in fp32;
    // the conv's, the gated norm's and the gates' weight-gradient partials (a block's per 256, 128
    // and 64 tokens).
    // And the chunked rule's gradient of the state leaving every chunk of 64 tokens (a state per
    // head a chunk: as much as the states the forward keeps). The rule's workspace is the larger of
    // the two forms' scratch (either may run: GatedDeltaDims::Form::automatic), counted here as
    // their sum: over by the smaller, the recurrent's fixed one at long parts.
    const std::uint64_t per_token = (2 * vw + 2 * C + PW + 2 * vh + (fused ? PW + 2 * vh : 0)) * bf16_bytes + 3 * vh * fp32_bytes +
                                    2 * vh * dk * fp32_bytes + ceil_div(C * K * fp32_bytes, 256) + ceil_div(vw * fp32_bytes, 128) +
                                    ceil_div(2 * vh * fp32_bytes, 64) + ceil_div(vh * dk * dv * fp32_bytes, 64);
    w.per_unit = Bytes{b * per_token};
  }
  return w;
}

WorkItem StepModel::mlp_item(int layer) const {
  const auto& m = spec_.moe();
  const std::uint64_t h = spec_.hidden_size();
  WorkItem w;
  w.dependency = ChunkDependency::independent;
  w.extent = tokens();
  w.granularity = 64;
  if (spec_.layer(layer).moe) {
    // Per token: router probabilities, k routed copies of the token and their expert
    // intermediates (gate, up, activation), the shared expert's, and the fp32 combine.
    w.per_unit = Bytes{m.experts * fp32_bytes + m.top_k * (h + 3 * m.expert_intermediate) * bf16_bytes * 2 +
                       3 * m.shared_expert_intermediate * bf16_bytes * 2 + h * fp32_bytes};
  } else {
    w.per_unit = Bytes{3 * spec_.layer(layer).dense_intermediate * bf16_bytes * 2 + h * fp32_bytes};
  }
  return w;
}

WorkItem StepModel::loss_item() const {
  WorkItem w;
  w.dependency = ChunkDependency::independent;
  w.extent = tokens();
  w.granularity = 64;
  // Per row: fp32 logits and their gradient; the full [tokens, vocab] matrix never exists.
  w.per_unit = Bytes{spec_.vocab_size() * fp32_bytes * 2 + spec_.hidden_size() * fp32_bytes};
  return w;
}

std::array<Bytes, activation_class_count> StepModel::saved_bytes(int layer) const {
  std::array<Bytes, activation_class_count> s{};
  auto at = [&](ActivationClass c) -> Bytes& { return s[static_cast<std::size_t>(c)]; };
  const std::uint64_t t = tokens();
  const std::uint64_t h = spec_.hidden_size();
  const auto& a = spec_.attention();
  const auto& m = spec_.moe();
  at(ActivationClass::layer_boundary) = Bytes{t * h * bf16_bytes};
  at(ActivationClass::norm_output) = Bytes{2 * t * h * bf16_bytes};
  if (spec_.layer(layer).attention == AttentionKind::full) {
    const std::uint64_t q = a.heads * a.head_dim * (a.output_gate ? 2 : 1);
    at(ActivationClass::attention_output) = Bytes{t * (q + 2 * a.kv_heads * a.head_dim + a.heads * a.head_dim) * bf16_bytes};
    at(ActivationClass::softmax_stats) = Bytes{t * a.heads * fp32_bytes};
  } else {
    // What the GPU block keeps (model::deltanet_saved_bytes): the unfused projections [q k v z]
    // and [b a] and the rule's output (bf16); the gates g and beta and the norm's rstd (fp32); and
    // each sequence's state at every 64th token and its end. (The conv's and the norm's outputs
    // are made again in the backward's workspace.)
    const auto& la = spec_.linear_attention();
    const std::uint64_t kw = la.key_heads * la.key_head_dim, vw = la.value_heads * la.value_head_dim;
    at(ActivationClass::attention_output) =
        Bytes{t * ((2 * kw + 3 * vw + 2 * la.value_heads) * bf16_bytes + 3 * la.value_heads * fp32_bytes)};
    const std::uint64_t b = req_.workload.sequences;
    at(ActivationClass::linear_attention_state) =
        Bytes{b * (ceil_div(t / b, 64) + 1) * la.value_heads * la.key_head_dim * la.value_head_dim * fp32_bytes};
  }
  if (spec_.layer(layer).moe) {
    at(ActivationClass::router_output) = Bytes{t * (m.experts + 2 * m.top_k) * fp32_bytes};
    at(ActivationClass::permuted_tokens) = Bytes{t * m.top_k * h * bf16_bytes};
    at(ActivationClass::expert_intermediate) =
        Bytes{t * (m.top_k * 3 * m.expert_intermediate + 3 * m.shared_expert_intermediate) * bf16_bytes};
  } else {
    at(ActivationClass::expert_intermediate) = Bytes{t * 3 * spec_.layer(layer).dense_intermediate * bf16_bytes};
  }
  return s;
}

double StepModel::time_of(const Operation& op, Resource r) const { return cost_.predict(op)[r]; }

// Forward (backward = false) or backward time of the attention part of `layer`, chunked.
double StepModel::attention_time(int layer, const Partition& part, bool backward, bool core_only) const {
  const auto& a = spec_.attention();
  const std::uint64_t h = spec_.hidden_size();
  const std::uint64_t b = req_.workload.sequences;
  const double gemm_factor = backward ? 2.0 : 1.0;  // dX and dW for each forward product
  double t = 0;
  std::uint64_t begin = 0;
  for (const auto& c : part.chunks) {
    const std::uint64_t len = c.end - c.begin;
    begin = c.begin;
    if (spec_.layer(layer).attention == AttentionKind::full) {
      const std::uint64_t q = a.heads * a.head_dim * (a.output_gate ? 2 : 1);
      if (!core_only) {
        t += gemm_factor * time_of(Operation::gemm(b * len, q + 2 * a.kv_heads * a.head_dim, h), Resource::gpu_compute);
        t += gemm_factor * time_of(Operation::gemm(b * len, h, a.heads * a.head_dim), Resource::gpu_compute);
      }
      // Queries [begin, end) over keys [0, end): 2·len·(begin+end)·hd FLOPs per head is exactly
      // Operation's causal count with m = len, n = begin + end.
      t += time_of(Operation::attention(backward, len, begin + c.end, a.head_dim, a.heads * b), Resource::gpu_compute);
    } else {
      const auto& la = spec_.linear_attention();
      const std::uint64_t in = 2 * la.key_heads * la.key_head_dim + 2 * la.value_heads * la.value_head_dim + 2 * la.value_heads;
      if (!core_only) {
        t += gemm_factor * time_of(Operation::gemm(b * len, in, h), Resource::gpu_compute);
        t += gemm_factor * time_of(Operation::gemm(b * len, h, la.value_heads * la.value_head_dim), Resource::gpu_compute);
      }
      // The gated delta rule's recurrence: every value head's key x value state updated per token.
      // Whole sequences run side by side; in parts (several chunks) the GPU block takes one
      // sequence at a time, so its recurrences are one sequence's heads.
      t += time_of(Operation::delta_rule(backward, b * len, la.key_head_dim, la.value_head_dim, la.value_heads,
                                         part.chunks.size() > 1 ? 1 : b),
                   Resource::gpu_compute);
    }
  }
  (void)begin;
  // Norms, rotary, residual: a dozen passes over the hidden states.
  t += (backward ? 2.0 : 1.0) *
       time_of(Operation::moving(OpKind::memory_bound, Bytes{tokens() * h * bf16_bytes * 12}), Resource::gpu_compute);
  return t;
}

double StepModel::mlp_time(int layer, std::uint64_t chunk_tokens, bool backward, bool up_only) const {
  const auto& m = spec_.moe();
  const std::uint64_t h = spec_.hidden_size();
  const std::uint64_t t_all = tokens();
  const std::uint64_t chunks = ceil_div(t_all, chunk_tokens);
  const double f = backward ? 2.0 : 1.0;
  double t = 0;
  for (std::uint64_t i = 0; i < chunks; ++i) {
    const std::uint64_t c = std::min(chunk_tokens, t_all - i * chunk_tokens);
    if (spec_.layer(layer).moe) {
      const bool ep = path_ == ExecutionPath::expert_parallel;
      const std::uint64_t gpus = ep ? static_cast<std::uint64_t>(req_.gpus) : 1;
      const std::uint64_t per_expert = std::max<std::uint64_t>(1, ceil_div(gpus * c * m.top_k, m.experts));
      const std::uint64_t width = (up_only ? 2 : 3) * m.expert_intermediate;
      t += f * time_of(Operation::gemm(c, m.experts, h), Resource::gpu_compute);
      t += f * time_of(Operation::gemm(per_expert, width, h, local_experts()), Resource::gpu_compute);
      if (m.shared_expert_intermediate > 0)
        t += f * time_of(Operation::gemm(c, (up_only ? 2 : 3) * m.shared_expert_intermediate + 1, h), Resource::gpu_compute);
      // Permute / unpermute: the routed copies through HBM twice.
      t += f * time_of(Operation::moving(OpKind::memory_bound, Bytes{c * m.top_k * h * bf16_bytes * 4}), Resource::gpu_compute);
    } else {
      t += f * time_of(Operation::gemm(c, (up_only ? 2 : 3) * spec_.layer(layer).dense_intermediate, h), Resource::gpu_compute);
    }
    // The weight gradients are fp32 sums over the chunks: the first chunk writes them, every later
    // one reads and writes them again. (A later micro-batch's first chunk adds too, one pass this
    // counts short: ~3 ms a Qwen3-Next layer. Dense layers are priced alike, unmeasured: the CUDA
    // executor takes MoE layers only.) (The 512-expert Qwen3-Next layer's 1.6 G values, 12.9 GB a
    // chunk; the 2-layer slice at 424,960 tokens in 32 chunks of 13,280 ran its MoE backward about
    // 0.3 s over a prediction without this pass, which accounts for 0.19 s of it; H200 2026-12-04).
    if (backward && !up_only) {
      const std::uint64_t passes = i == 0 ? 1 : 2;
      t += time_of(Operation::moving(OpKind::memory_bound, Bytes{passes * mlp_weight_values(layer) * fp32_bytes}), Resource::gpu_compute);
    }
  }
  return t;
}

std::uint64_t StepModel::local_experts() const {
  const auto& m = spec_.moe();
  return path_ == ExecutionPath::expert_parallel ? m.experts / static_cast<std::uint64_t>(req_.gpus) : m.experts;
}

std::uint64_t StepModel::mlp_weight_values(int layer) const {
  const auto& m = spec_.moe();
  const std::uint64_t h = spec_.hidden_size();
  if (!spec_.layer(layer).moe) return 3 * spec_.layer(layer).dense_intermediate * h;
  std::uint64_t v = local_experts() * 3 * m.expert_intermediate * h;  // (the router's runs once over all tokens)
  if (m.shared_expert_intermediate > 0) v += (3 * m.shared_expert_intermediate + 1) * h;  // shared expert and its gate
  return v;
}

double StepModel::all_to_all_time(int layer) const {
  if (path_ != ExecutionPath::expert_parallel || !spec_.layer(layer).moe || req_.gpus < 2) return 0;
  const auto& m = spec_.moe();
  const double g = req_.gpus;
  // Dispatch and combine: each GPU sends (g-1)/g of its routed copies.
  const auto bytes = static_cast<std::uint64_t>(static_cast<double>(tokens() * m.top_k * spec_.hidden_size() * bf16_bytes) * (g - 1) / g);
  return 2 * time_of(Operation::moving(OpKind::all_to_all, Bytes{bytes}), Resource::network);
}

double StepModel::loss_time(std::uint64_t rows, bool backward) const {
  const std::uint64_t t_all = tokens();
  const std::uint64_t chunks = ceil_div(t_all, rows);
  double t = 0;
  for (std::uint64_t i = 0; i < chunks; ++i) {
    const std::uint64_t r = std::min(rows, t_all - i * rows);
    t += (backward ? 2.0 : 1.0) * time_of(Operation::gemm(r, spec_.vocab_size(), spec_.hidden_size()), Resource::gpu_compute);
    t += time_of(Operation::moving(OpKind::memory_bound, Bytes{r * spec_.vocab_size() * fp32_bytes * 3}), Resource::gpu_compute);
    // Each chunk's head gradient is added into the fp32 (V, H) sum: read and written once a chunk.
    if (backward)
      t += time_of(Operation::moving(OpKind::memory_bound, Bytes{spec_.vocab_size() * spec_.hidden_size() * fp32_bytes * 2}),
                   Resource::gpu_compute);
  }
  return t;
}

// Recompute time for the classes `layer`'s retention drops, from its own boundary.
double StepModel::recompute_time(int layer, const std::array<RetentionDecision, activation_class_count>& row,
                                 const Partition& attn, std::uint64_t mlp_chunk) const {
  auto dropped = [&](ActivationClass c) {
    return row[static_cast<std::size_t>(c)].action == Retention::recompute;
  };
  double t = 0;
  const bool attn_dropped = dropped(ActivationClass::attention_output) || dropped(ActivationClass::softmax_stats) ||
                            dropped(ActivationClass::linear_attention_state);
  const bool mlp_dropped = dropped(ActivationClass::router_output) || dropped(ActivationClass::permuted_tokens) ||
                           dropped(ActivationClass::expert_intermediate) || dropped(ActivationClass::norm_output);
  if (attn_dropped) t += attention_time(layer, attn, false, false);
  if (mlp_dropped) {
    if (!attn_dropped) {
      // The MLP's input needs the attention output projection again.
      const auto& a = spec_.attention();
      t += time_of(Operation::gemm(tokens(), spec_.hidden_size(), a.heads * a.head_dim), Resource::gpu_compute);
    }
    t += mlp_time(layer, mlp_chunk, false, true);
  }
  return t;
}

}  // namespace oom::detail
