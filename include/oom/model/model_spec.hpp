// ModelSpec: the shape of an MoE transformer as read from a Hugging Face config.json, and the full
// list of its state segments with the exact checkpoint tensor names and shapes. This is what the
// planner sizes memory from and what a safetensors loader maps tensors onto.
//
// Families (config.json "model_type"):
//   qwen3_moe    Qwen3-MoE: GQA with per-head q/k RMSNorm; dense layers via mlp_only_layers /
//                decoder_sparse_step.
//   qwen3_next   Qwen3-Next: Gated DeltaNet (linear attention) layers interleaved with gated full
//                attention (full_attention_interval or layer_types); shared expert with sigmoid gate.
//   qwen3_5_moe  Qwen3.5-MoE: as Qwen3-Next, text model nested under "text_config", DeltaNet input
//                projections split, experts packed per layer in the checkpoint ("model.language_model.").
//   mixtral      Mixtral: GQA without q/k norm; experts w1/w2/w3 under block_sparse_moe (held in
//                a segment as w1, w3, w2: gate, up, down, the layout of the other families).
//   olmoe        OLMoE: MHA with q/k RMSNorm over the full projection width.
//   qwen2_moe    Qwen1.5-MoE / Qwen2-MoE: q/k/v biases (qkv_bias), no q/k norm, a shared expert
//                with a sigmoid gate, dense layers as Qwen3-MoE's (held in a segment with the
//                biases after o_proj: the weights' rows stay one block).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "oom/model/segment.hpp"

namespace oom {

class Json;

enum class ModelFamily : unsigned char { qwen3_moe, qwen3_next, qwen3_5_moe, mixtral, olmoe, qwen2_moe };
/// The config.json model_type of a family ("qwen3_moe", ...).
const char* to_string(ModelFamily f) noexcept;

enum class AttentionKind : unsigned char {
  full,    ///< softmax attention (causal, GQA)
  linear,  ///< Gated DeltaNet linear attention
};
const char* to_string(AttentionKind k) noexcept;

/// Softmax attention of the full-attention layers.
struct FullAttentionShape {
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  bool output_gate = false;         ///< q_proj also yields a sigmoid gate on the output (Qwen3-Next/3.5)
  bool qk_norm = false;             ///< RMSNorm on q and k
  bool qk_norm_full_width = false;  ///< the q/k norm spans heads*head_dim (OLMoE), not one head
  bool bias = false;                ///< q/k/v/o projections carry biases (attention_bias)
  bool qkv_bias = false;            ///< q/k/v (not o) carry biases (Qwen2-MoE's qkv_bias)
  /// Attention only over the last this many keys (Mixtral's sliding_window; Qwen's with
  /// use_sliding_window, read for every layer: max_window_layers is not read, so the layers refuse
  /// such a model whole); 0: over every earlier key. The planner sizes it as full attention.
  std::uint64_t sliding_window = 0;
  double clip_qkv = 0;  ///< OLMoE's clamp of the q/k/v projections to [-c, c]; 0: none
  friend bool operator==(const FullAttentionShape&, const FullAttentionShape&) = default;
};

/// Gated DeltaNet of the linear-attention layers; all zero for models without them.
struct LinearAttentionShape {
  std::uint64_t key_heads = 0;
  std::uint64_t value_heads = 0;
  std::uint64_t key_head_dim = 0;
  std::uint64_t value_head_dim = 0;
  std::uint64_t conv_kernel = 0;  ///< causal depthwise conv1d width over q, k and v
  friend bool operator==(const LinearAttentionShape&, const LinearAttentionShape&) = default;
};

struct MoeShape {
  std::uint64_t experts = 0;
  std::uint64_t top_k = 0;
  std::uint64_t expert_intermediate = 0;
  std::uint64_t shared_expert_intermediate = 0;  ///< 0: no shared expert
  bool norm_topk_prob = false;                   ///< top-k routing weights renormalised to sum to 1
  double router_jitter_noise = 0;                ///< Mixtral's multiplicative noise on the router input in training; 0: none
  /// transformers adds router_aux_loss_coef x its load-balancing loss to the training loss only
  /// with output_router_logits: that coefficient then, else 0 (RouterBalanceLoss).
  double router_aux_loss_coef = 0;
  friend bool operator==(const MoeShape&, const MoeShape&) = default;
};

struct LayerSpec {
  int index = 0;
  AttentionKind attention = AttentionKind::full;
  bool moe = true;                          ///< false: a dense MLP of dense_intermediate
  std::uint64_t dense_intermediate = 0;
  friend bool operator==(const LayerSpec&, const LayerSpec&) = default;
};

class ModelSpec {
 public:
  /// Reads a config.json. Errors (unknown model_type, missing/ill-typed/inconsistent fields) are
  /// oom::Error(Errc::parse) whose message names the file and the field path.
  [[nodiscard]] static ModelSpec from_file(const std::filesystem::path& config_json);
  /// As from_file; `source` names the config in error messages.
  [[nodiscard]] static ModelSpec from_json(const Json& config, std::string_view source = "<config>");

  [[nodiscard]] ModelFamily family() const { return family_; }
  [[nodiscard]] std::uint64_t vocab_size() const { return vocab_; }
  [[nodiscard]] std::uint64_t hidden_size() const { return hidden_; }
  [[nodiscard]] int num_layers() const { return static_cast<int>(layers_.size()); }
  [[nodiscard]] const std::vector<LayerSpec>& layers() const { return layers_; }
  [[nodiscard]] const LayerSpec& layer(int index) const;
  [[nodiscard]] const FullAttentionShape& attention() const { return attention_; }
  [[nodiscard]] const LinearAttentionShape& linear_attention() const { return linear_; }
  [[nodiscard]] const MoeShape& moe() const { return moe_; }
  [[nodiscard]] double rope_theta() const { return rope_theta_; }
  [[nodiscard]] double partial_rotary_factor() const { return partial_rotary_factor_; }
  [[nodiscard]] double rms_norm_eps() const { return rms_norm_eps_; }
  /// Qwen3-Next and Qwen3.5 scale their RMSNorms by (1 + w), w initialised to 0: the input,
  /// post-attention, final and q/k norms ("zero-centred"); not the gated norm inside linear
  /// attention (linear_attn.norm, w initialised to 1), nor any other family's.
  [[nodiscard]] bool zero_centred_norms() const;
  /// What a norm weight `tensor_name` of this model adds to its stored value when applied: 1 for a
  /// zero-centred norm, else 0 (so an initial weight of 1 - offset is the identity scale).
  [[nodiscard]] float norm_weight_offset(std::string_view tensor_name) const;
  [[nodiscard]] bool tied_embeddings() const { return tied_; }

  /// Every segment: embedding, then per layer (attention or linear_attention, norms, then router,
  /// each expert, shared expert — or one dense_mlp), then final_norm and lm_head (absent when tied).
  [[nodiscard]] const std::vector<StateSegment>& segments() const { return segments_; }
  /// The segments of decoder layer `index`, contiguous in segments().
  [[nodiscard]] std::span<const StateSegment> layer_segments(int index) const;

  /// All parameters, each tensor once (a tied embedding counts once).
  [[nodiscard]] std::uint64_t total_parameters() const;
  /// Parameters a token touches, counted as Mixtral/OLMoE/Qwen publish them: every non-expert
  /// parameter (embedding table and LM head included) plus top_k routed experts and the shared
  /// expert in each MoE layer.
  [[nodiscard]] std::uint64_t active_parameters() const;
  /// The input embedding table alone (a lookup, no FLOPs); subtract it from active_parameters()
  /// for the "non-embedding" count used in FLOP estimates.
  [[nodiscard]] std::uint64_t embedding_parameters() const;
  /// Bytes of all state (weights, master, moments, gradients) at the given precisions.
  [[nodiscard]] SegmentBytes state_bytes(const StatePrecision& precision = {}) const;

 private:
  friend class ConfigReader;
  ModelSpec() = default;

  ModelFamily family_ = ModelFamily::qwen3_moe;
  std::uint64_t vocab_ = 0;
  std::uint64_t hidden_ = 0;
  FullAttentionShape attention_;
  LinearAttentionShape linear_;
  MoeShape moe_;
  double rope_theta_ = 0;
  double partial_rotary_factor_ = 1.0;
  double rms_norm_eps_ = 0;
  bool tied_ = false;
  std::vector<LayerSpec> layers_;
  std::vector<StateSegment> segments_;
  std::vector<std::size_t> layer_first_segment_;  ///< num_layers + 1 offsets into segments_
};

}  // namespace oom
