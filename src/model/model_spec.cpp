// ModelSpec from a Hugging Face config.json, and the segment list with checkpoint tensor names.
// Defaults for optional fields follow the transformers configuration classes of each family, so a
// config that transformers accepts reads the same here.
#include "oom/model/model_spec.hpp"

#include <algorithm>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"

namespace oom {

const char* to_string(ModelFamily f) noexcept {
  switch (f) {
    case ModelFamily::qwen3_moe: return "qwen3_moe";
    case ModelFamily::qwen3_next: return "qwen3_next";
    case ModelFamily::qwen3_5_moe: return "qwen3_5_moe";
    case ModelFamily::mixtral: return "mixtral";
    case ModelFamily::olmoe: return "olmoe";
    case ModelFamily::qwen2_moe: return "qwen2_moe";
  }
  return "?";
}

const char* to_string(AttentionKind k) noexcept { return k == AttentionKind::full ? "full" : "linear"; }

bool ModelSpec::zero_centred_norms() const { return family_ == ModelFamily::qwen3_next || family_ == ModelFamily::qwen3_5_moe; }

float ModelSpec::norm_weight_offset(std::string_view tensor_name) const {
  const bool norm = tensor_name.ends_with("norm.weight");  // layernorm.weight, q_norm.weight, model.norm.weight, ...
  return zero_centred_norms() && norm && tensor_name.find("linear_attn.norm.weight") == std::string_view::npos ? 1.0f : 0.0f;
}

namespace {

using Shape = std::vector<std::uint64_t>;

/// A config problem: the message is "<field path>: <what is wrong>"; from_json prefixes the file.
[[noreturn]] void bad_field(const JsonCursor& field, const std::string& what) {
  OOM_THROW(Errc::parse, field.path() + ": " + what);
}

/// The most any size or count field may hold: every width product the spec forms from two of
/// them (heads x head_dim, ...) then stays below 2^62, and the shapes are checked as a whole
/// (check_sizes) before any byte count is taken from them.
constexpr std::uint64_t max_field = (std::uint64_t{1} << 31) - 1;

std::uint64_t positive(const JsonCursor& field) {
  const std::uint64_t v = field.as_uint64();
  if (v == 0) bad_field(field, "must be positive, got 0");
  if (v > max_field) bad_field(field, fmt::format("must be at most {}, got {}", max_field, v));
  return v;
}

std::uint64_t positive_or(const JsonCursor& field, std::uint64_t fallback) {
  return field.present_not_null() ? positive(field) : fallback;
}

double number_or(const JsonCursor& field, double fallback) {
  return field.present_not_null() ? field.as_double() : fallback;
}

bool bool_or(const JsonCursor& field, bool fallback) { return field.present_not_null() ? field.as_bool() : fallback; }

}  // namespace

/// Reads one config into a ModelSpec; one instance per read.
class ConfigReader {
 public:
  ConfigReader(const Json& root) : root_(root), text_(root) {}

  ModelSpec read() {
    ModelSpec m;
    const std::string& type = root_["model_type"].as_string();
    if (type == "qwen3_moe") m.family_ = ModelFamily::qwen3_moe;
    else if (type == "qwen3_next") m.family_ = ModelFamily::qwen3_next;
    else if (type == "qwen3_5_moe") m.family_ = ModelFamily::qwen3_5_moe;
    else if (type == "mixtral") m.family_ = ModelFamily::mixtral;
    else if (type == "olmoe") m.family_ = ModelFamily::olmoe;
    else if (type == "qwen2_moe") m.family_ = ModelFamily::qwen2_moe;
    else
      bad_field(root_["model_type"], "unknown model_type \"" + type +
                                         "\" (supported: qwen3_moe, qwen3_next, qwen3_5_moe, mixtral, olmoe, qwen2_moe)");
    const ModelFamily f = m.family_;
    const bool qwen_hybrid = f == ModelFamily::qwen3_next || f == ModelFamily::qwen3_5_moe;

    // Qwen3.5 wraps the language model in a vision-language config; its fields live in text_config.
    if (f == ModelFamily::qwen3_5_moe) {
      text_ = root_["text_config"];
      (void)text_.as_object();
    }
    const JsonCursor& c = text_;

    m.vocab_ = positive(c["vocab_size"]);
    m.hidden_ = positive(c["hidden_size"]);
    const std::uint64_t num_layers = positive(c["num_hidden_layers"]);
    if (num_layers > 100000) bad_field(c["num_hidden_layers"], "implausibly large: " + std::to_string(num_layers));

    // Attention.
    auto& a = m.attention_;
    a.heads = positive(c["num_attention_heads"]);
    // transformers' defaults where the field is absent (an explicit null means num_attention_heads):
    // Qwen3-MoE 4, Qwen3-Next / Qwen3.5 2, Mixtral 8, Qwen2-MoE 16, OLMoE num_attention_heads.
    std::uint64_t default_kv = a.heads;
    switch (f) {
      case ModelFamily::qwen3_moe: default_kv = 4; break;
      case ModelFamily::qwen3_next:
      case ModelFamily::qwen3_5_moe: default_kv = 2; break;
      case ModelFamily::mixtral: default_kv = 8; break;
      case ModelFamily::qwen2_moe: default_kv = 16; break;
      case ModelFamily::olmoe: break;
    }
    a.kv_heads = c["num_key_value_heads"].present() ? positive_or(c["num_key_value_heads"], a.heads) : default_kv;
    if (a.heads % a.kv_heads != 0)
      bad_field(c["num_key_value_heads"], "num_attention_heads " + std::to_string(a.heads) +
                                              " is not a multiple of num_key_value_heads " + std::to_string(a.kv_heads));
    const bool head_dim_given = c["head_dim"].present_not_null() && f != ModelFamily::olmoe;
    if (head_dim_given) {
      a.head_dim = positive(c["head_dim"]);
    } else if (qwen_hybrid) {
      a.head_dim = 256;  // Qwen3NextConfig / Qwen3_5MoeTextConfig: head_dim defaults to 256, not hidden / heads
    } else {
      // No head_dim field: transformers derives it, which requires an exact split of the hidden size.
      if (m.hidden_ % a.heads != 0)
        bad_field(c["num_attention_heads"], "hidden_size " + std::to_string(m.hidden_) +
                                                " is not divisible by num_attention_heads " + std::to_string(a.heads));
      a.head_dim = m.hidden_ / a.heads;
    }
    a.qk_norm = f != ModelFamily::mixtral && f != ModelFamily::qwen2_moe;
    a.qk_norm_full_width = f == ModelFamily::olmoe;
    a.output_gate = f == ModelFamily::qwen3_next || (f == ModelFamily::qwen3_5_moe && bool_or(c["attn_output_gate"], true));
    a.bias = f != ModelFamily::mixtral && f != ModelFamily::qwen2_moe && bool_or(c["attention_bias"], false);
    a.qkv_bias = f == ModelFamily::qwen2_moe && bool_or(c["qkv_bias"], true);
    // Fields that change what a layer computes; read so a layer that does not implement them can
    // refuse the model by name instead of training another one.
    if (f == ModelFamily::mixtral || (f != ModelFamily::olmoe && bool_or(c["use_sliding_window"], false)))
      a.sliding_window = c["sliding_window"].present_not_null() ? positive(c["sliding_window"]) : 0;
    if (f == ModelFamily::olmoe) {
      // transformers clamps whenever the field is not null (0 clamps q, k and v to 0).
      if (c["clip_qkv"].present_not_null()) {
        a.clip_qkv = c["clip_qkv"].as_double();
        if (!(a.clip_qkv > 0)) bad_field(c["clip_qkv"], "must be positive or null");
      }
    }

    // MoE.
    auto& moe = m.moe_;
    const bool expert_count_local = f == ModelFamily::mixtral;
    moe.experts = positive(c[expert_count_local ? "num_local_experts" : "num_experts"]);
    // Each expert of each layer is a state segment of its own: bound their count before building
    // them (a fuzzed config of 86,666,666 experts took gigabytes). The largest public MoE configs
    // hold about 25K (Qwen3-Next-80B: 48 x 513).
    constexpr std::uint64_t max_segments = std::uint64_t{1} << 18;
    if (moe.experts > max_segments || num_layers * (moe.experts + 8) > max_segments)
      bad_field(c[expert_count_local ? "num_local_experts" : "num_experts"],
                std::to_string(num_layers) + " layers of " + std::to_string(moe.experts) +
                    " experts make a state segment per expert and layer, more than the " + std::to_string(max_segments) +
                    " supported");
    moe.top_k = positive(c["num_experts_per_tok"]);
    if (moe.top_k > moe.experts)
      bad_field(c["num_experts_per_tok"], std::to_string(moe.top_k) + " exceeds the number of experts " +
                                              std::to_string(moe.experts));
    if (f == ModelFamily::mixtral) {
      moe.router_jitter_noise = number_or(c["router_jitter_noise"], 0.0);
      if (!(moe.router_jitter_noise >= 0)) bad_field(c["router_jitter_noise"], "must not be negative");
    }
    if (bool_or(c["output_router_logits"], false)) {  // transformers' defaults where the field is absent
      moe.router_aux_loss_coef = number_or(c["router_aux_loss_coef"], f == ModelFamily::olmoe ? 0.01 : 0.001);
      if (!(moe.router_aux_loss_coef >= 0)) bad_field(c["router_aux_loss_coef"], "must not be negative");
    }
    // Mixtral and OLMoE name the expert width intermediate_size; Qwen reserves that for dense layers.
    const bool expert_in_intermediate = f == ModelFamily::mixtral || f == ModelFamily::olmoe;
    moe.expert_intermediate = positive(c[expert_in_intermediate ? "intermediate_size" : "moe_intermediate_size"]);
    if (qwen_hybrid || f == ModelFamily::qwen2_moe) moe.shared_expert_intermediate = positive(c["shared_expert_intermediate_size"]);
    switch (f) {
      case ModelFamily::qwen3_moe:
      case ModelFamily::qwen2_moe:
      case ModelFamily::olmoe: moe.norm_topk_prob = bool_or(c["norm_topk_prob"], false); break;
      case ModelFamily::qwen3_next: moe.norm_topk_prob = bool_or(c["norm_topk_prob"], true); break;
      // These routers always renormalise the top-k weights; the config has no switch.
      case ModelFamily::qwen3_5_moe:
      case ModelFamily::mixtral: moe.norm_topk_prob = true; break;
    }

    // Linear attention (Gated DeltaNet).
    if (qwen_hybrid) {
      auto& l = m.linear_;
      l.key_heads = positive(c["linear_num_key_heads"]);
      l.value_heads = positive(c["linear_num_value_heads"]);
      l.key_head_dim = positive(c["linear_key_head_dim"]);
      l.value_head_dim = positive(c["linear_value_head_dim"]);
      l.conv_kernel = positive(c["linear_conv_kernel_dim"]);
      if (l.value_heads % l.key_heads != 0)
        bad_field(c["linear_num_value_heads"], std::to_string(l.value_heads) +
                                                   " is not a multiple of linear_num_key_heads " +
                                                   std::to_string(l.key_heads));
    }

    // RoPE and norms. Newer configs nest rope settings under rope_parameters.
    const JsonCursor rope = c["rope_parameters"].present_not_null() ? c["rope_parameters"] : JsonCursor(c);
    // Only the default rotary embedding is built: a scaled one (yarn, linear, dynamic, llama3, ...)
    // would train another model than the one the config describes.
    if (c["rope_scaling"].present_not_null()) {
      const JsonCursor rs = c["rope_scaling"];
      const JsonCursor type = rs["rope_type"].present_not_null() ? rs["rope_type"] : rs["type"];
      if (!type.present_not_null() || type.as_string() != "default")
        bad_field(rs, "RoPE scaling is not implemented (only the default rotary embedding is)");
    }
    if (rope["rope_type"].present_not_null() && rope["rope_type"].as_string() != "default")
      bad_field(rope["rope_type"], "\"" + rope["rope_type"].as_string() + "\" is not implemented (only \"default\" is)");
    // Every family's experts (and dense and shared MLPs) are SwiGLU here.
    if (c["hidden_act"].present_not_null() && c["hidden_act"].as_string() != "silu")
      bad_field(c["hidden_act"], "\"" + c["hidden_act"].as_string() + "\" is not implemented (only \"silu\" is)");
    if (number_or(c["attention_dropout"], 0.0) != 0.0)
      bad_field(c["attention_dropout"], "attention dropout is not implemented; it must be 0");
    const double default_theta = f == ModelFamily::mixtral ? 1e6 : 10000.0;
    m.rope_theta_ = number_or(rope["rope_theta"], number_or(c["rope_theta"], default_theta));
    // The layers compute in fp32: a theta that fp32 flushes to 0 or rounds to inf breaks RoPE.
    if (!(m.rope_theta_ >= 1.17549435e-38 && m.rope_theta_ <= 3.40282347e38))
      bad_field(rope["rope_theta"].present() ? rope["rope_theta"] : c["rope_theta"], "must be positive and within fp32's normal range");
    // Qwen3-Next and Qwen3.5 configs default it to 0.25 (transformers' config classes), the others to 1.
    const double default_rotary = qwen_hybrid ? 0.25 : 1.0;
    m.partial_rotary_factor_ = number_or(rope["partial_rotary_factor"], number_or(c["partial_rotary_factor"], default_rotary));
    if (!(m.partial_rotary_factor_ > 0 && m.partial_rotary_factor_ <= 1))
      bad_field(rope["partial_rotary_factor"].present() ? rope["partial_rotary_factor"] : c["partial_rotary_factor"],
                "must be in (0, 1], got " + std::to_string(m.partial_rotary_factor_));
    m.rms_norm_eps_ = number_or(c["rms_norm_eps"], f == ModelFamily::mixtral || f == ModelFamily::olmoe ? 1e-5 : 1e-6);
    if (!(m.rms_norm_eps_ >= 1.17549435e-38)) bad_field(c["rms_norm_eps"], "must be positive (and not below fp32's smallest normal)");

    // Qwen3.5 keeps tie_word_embeddings at the top level, next to text_config.
    const JsonCursor tie = c["tie_word_embeddings"].present_not_null() ? c["tie_word_embeddings"]
                                                                        : root_["tie_word_embeddings"];
    m.tied_ = bool_or(tie, false);

    read_layers(m, num_layers);
    build_segments(m);
    check_sizes(m);
    return m;
  }

 private:
  /// Every tensor's elements and the model's parameters without wrapping past 2^64, and at most
  /// max_parameters: each parameter's state is 16 bytes and more, so byte counts stay exact too.
  static void check_sizes(const ModelSpec& m) {
    constexpr std::uint64_t max_parameters = std::uint64_t{1} << 50;
    std::uint64_t total = 0;
    for (const auto& seg : m.segments_)
      for (const auto& t : seg.tensors) {
        std::uint64_t n = 1;
        for (const auto d : t.shape)
          if (__builtin_mul_overflow(n, d, &n) || n > max_parameters)
            OOM_THROW(Errc::parse, fmt::format("tensor {} (shape {}): more than 2^50 elements; the config's sizes are too large",
                                               t.name, fmt::join(t.shape, " x ")));
        if (__builtin_add_overflow(total, n, &total) || total > max_parameters)
          OOM_THROW(Errc::parse, fmt::format("the config's sizes make more than 2^50 parameters (reached at tensor {})", t.name));
      }
  }

  void read_layers(ModelSpec& m, std::uint64_t num_layers) {
    const ModelFamily f = m.family_;
    const JsonCursor& c = text_;
    const auto n = static_cast<int>(num_layers);
    m.layers_.resize(num_layers);
    for (int i = 0; i < n; ++i) m.layers_[static_cast<std::size_t>(i)].index = i;

    if (f == ModelFamily::qwen3_next || f == ModelFamily::qwen3_5_moe) {
      const JsonCursor types = c["layer_types"];
      if (types.present_not_null()) {
        if (types.size() != num_layers)
          bad_field(types, "has " + std::to_string(types.size()) + " entries for " + std::to_string(num_layers) +
                               " layers");
        for (int i = 0; i < n; ++i) {
          const std::string& t = types[static_cast<std::size_t>(i)].as_string();
          if (t == "full_attention") m.layers_[static_cast<std::size_t>(i)].attention = AttentionKind::full;
          else if (t == "linear_attention") m.layers_[static_cast<std::size_t>(i)].attention = AttentionKind::linear;
          else bad_field(types[static_cast<std::size_t>(i)], "unknown layer type \"" + t + "\"");
        }
      } else {
        // transformers' rule: every interval-th layer (1-based) is full attention.
        const std::uint64_t interval = positive_or(c["full_attention_interval"], 4);
        for (int i = 0; i < n; ++i)
          m.layers_[static_cast<std::size_t>(i)].attention =
              (static_cast<std::uint64_t>(i) + 1) % interval == 0 ? AttentionKind::full : AttentionKind::linear;
      }
    }

    // Dense layers. Qwen3-MoE, Qwen2-MoE and Qwen3-Next build a layer as MoE unless it is listed in
    // mlp_only_layers or falls off decoder_sparse_step; Qwen3.5-MoE, Mixtral and OLMoE always build
    // MoE layers (transformers ignores such fields there, so do we, to match the checkpoints).
    if (f == ModelFamily::qwen3_moe || f == ModelFamily::qwen2_moe || f == ModelFamily::qwen3_next) {
      const std::uint64_t step = positive_or(c["decoder_sparse_step"], 1);
      std::set<std::uint64_t> dense;
      if (const JsonCursor list = c["mlp_only_layers"]; list.present_not_null()) {
        for (std::size_t j = 0; j < list.size(); ++j) {
          const std::uint64_t idx = list[j].as_uint64();
          if (idx >= num_layers)
            bad_field(list[j], "layer " + std::to_string(idx) + " is out of range (num_hidden_layers " +
                                   std::to_string(num_layers) + ")");
          dense.insert(idx);
        }
      }
      for (int i = 0; i < n; ++i) {
        auto& L = m.layers_[static_cast<std::size_t>(i)];
        const auto u = static_cast<std::uint64_t>(i);
        L.moe = dense.count(u) == 0 && (u + 1) % step == 0;
      }
      if (std::any_of(m.layers_.begin(), m.layers_.end(), [](const LayerSpec& L) { return !L.moe; })) {
        const std::uint64_t inter = positive(c["intermediate_size"]);
        for (auto& L : m.layers_)
          if (!L.moe) L.dense_intermediate = inter;
      }
    }
  }

  // ---- segments, with the parameter names transformers checkpoints use --------------------------

  static TensorSpec tensor(std::string name, Shape shape) { return TensorSpec{std::move(name), std::move(shape)}; }

  void build_segments(ModelSpec& m) {
    const ModelFamily f = m.family_;
    const std::uint64_t H = m.hidden_;
    const std::string model = f == ModelFamily::qwen3_5_moe ? "model.language_model." : "model.";
    auto& segs = m.segments_;

    segs.push_back({"embedding", SegmentRole::embedding, -1, -1, {tensor(model + "embed_tokens.weight", {m.vocab_, H})}});
    for (const LayerSpec& L : m.layers_) {
      m.layer_first_segment_.push_back(segs.size());
      const std::string p = model + "layers." + std::to_string(L.index) + ".";
      const std::string s = "layers." + std::to_string(L.index) + ".";
      if (L.attention == AttentionKind::full) segs.push_back(full_attention(m, p, s + "attention", L.index));
      else segs.push_back(linear_attention(m, p, s + "linear_attention", L.index));
      segs.push_back({s + "norms", SegmentRole::norm, L.index, -1,
                      {tensor(p + "input_layernorm.weight", {H}), tensor(p + "post_attention_layernorm.weight", {H})}});
      if (L.moe) add_moe(m, p, s, L.index);
      else segs.push_back({s + "mlp", SegmentRole::dense_mlp, L.index, -1, mlp(p + "mlp.", H, L.dense_intermediate)});
    }
    m.layer_first_segment_.push_back(segs.size());
    segs.push_back({"final_norm", SegmentRole::final_norm, -1, -1, {tensor(model + "norm.weight", {H})}});
    if (!m.tied_) segs.push_back({"lm_head", SegmentRole::lm_head, -1, -1, {tensor("lm_head.weight", {m.vocab_, H})}});
  }

  static std::vector<TensorSpec> mlp(const std::string& p, std::uint64_t H, std::uint64_t I) {
    return {tensor(p + "gate_proj.weight", {I, H}), tensor(p + "up_proj.weight", {I, H}),
            tensor(p + "down_proj.weight", {H, I})};
  }

  static StateSegment full_attention(const ModelSpec& m, const std::string& p, std::string name, int layer) {
    const auto& a = m.attention_;
    const std::uint64_t H = m.hidden_, q = a.heads * a.head_dim, kv = a.kv_heads * a.head_dim;
    StateSegment seg{std::move(name), SegmentRole::attention, layer, -1, {}};
    auto& t = seg.tensors;
    const std::string sa = p + "self_attn.";
    // With an output gate, q_proj emits the query and the gate side by side (2x its width).
    t.push_back(tensor(sa + "q_proj.weight", {a.output_gate ? 2 * q : q, H}));
    if (a.bias) t.push_back(tensor(sa + "q_proj.bias", {a.output_gate ? 2 * q : q}));
    t.push_back(tensor(sa + "k_proj.weight", {kv, H}));
    if (a.bias) t.push_back(tensor(sa + "k_proj.bias", {kv}));
    t.push_back(tensor(sa + "v_proj.weight", {kv, H}));
    if (a.bias) t.push_back(tensor(sa + "v_proj.bias", {kv}));
    t.push_back(tensor(sa + "o_proj.weight", {H, q}));
    if (a.bias) t.push_back(tensor(sa + "o_proj.bias", {H}));
    if (a.qkv_bias)  // after the weights, which stay one block of rows
      for (const auto& [name, n] : {std::pair{"q_proj.bias", q}, std::pair{"k_proj.bias", kv}, std::pair{"v_proj.bias", kv}})
        t.push_back(tensor(sa + name, {n}));
    if (a.qk_norm) {
      t.push_back(tensor(sa + "q_norm.weight", {a.qk_norm_full_width ? q : a.head_dim}));
      t.push_back(tensor(sa + "k_norm.weight", {a.qk_norm_full_width ? kv : a.head_dim}));
    }
    return seg;
  }

  static StateSegment linear_attention(const ModelSpec& m, const std::string& p, std::string name, int layer) {
    const auto& l = m.linear_;
    const std::uint64_t H = m.hidden_, key = l.key_heads * l.key_head_dim, value = l.value_heads * l.value_head_dim;
    const std::uint64_t conv = 2 * key + value;  // the conv runs over q, k and v
    StateSegment seg{std::move(name), SegmentRole::linear_attention, layer, -1, {}};
    auto& t = seg.tensors;
    const std::string la = p + "linear_attn.";
    if (m.family_ == ModelFamily::qwen3_next) {
      // Qwen3-Next fuses q, k, v and the output gate z into one projection, and b with a.
      t.push_back(tensor(la + "in_proj_qkvz.weight", {2 * key + 2 * value, H}));
      t.push_back(tensor(la + "in_proj_ba.weight", {2 * l.value_heads, H}));
    } else {
      t.push_back(tensor(la + "in_proj_qkv.weight", {conv, H}));
      t.push_back(tensor(la + "in_proj_z.weight", {value, H}));
      t.push_back(tensor(la + "in_proj_b.weight", {l.value_heads, H}));
      t.push_back(tensor(la + "in_proj_a.weight", {l.value_heads, H}));
    }
    t.push_back(tensor(la + "conv1d.weight", {conv, 1, l.conv_kernel}));
    t.push_back(tensor(la + "dt_bias", {l.value_heads}));
    t.push_back(tensor(la + "A_log", {l.value_heads}));
    t.push_back(tensor(la + "norm.weight", {l.value_head_dim}));
    t.push_back(tensor(la + "out_proj.weight", {H, value}));
    return seg;
  }

  static void add_moe(ModelSpec& m, const std::string& p, const std::string& s, int layer) {
    const auto& moe = m.moe_;
    const std::uint64_t H = m.hidden_, I = moe.expert_intermediate, E = moe.experts;
    auto& segs = m.segments_;
    const bool mixtral = m.family_ == ModelFamily::mixtral;
    const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
    segs.push_back({s + "router", SegmentRole::router, layer, -1, {tensor(block + "gate.weight", {E, H})}});
    for (std::uint64_t e = 0; e < E; ++e) {
      const std::string ex = block + "experts." + std::to_string(e) + ".";
      std::vector<TensorSpec> t;
      if (mixtral) {
        // w1 gate, w3 up, w2 down: held in the order the other families' experts are.
        t = {tensor(ex + "w1.weight", {I, H}), tensor(ex + "w3.weight", {I, H}), tensor(ex + "w2.weight", {H, I})};
      } else if (m.family_ == ModelFamily::qwen3_5_moe) {
        TensorSpec gate_up = tensor(block + "experts.gate_up_proj", {2 * I, H});
        TensorSpec down = tensor(block + "experts.down_proj", {H, I});
        gate_up.stacked_index = down.stacked_index = static_cast<std::int64_t>(e);
        gate_up.stacked_count = down.stacked_count = E;
        t = {std::move(gate_up), std::move(down)};
      } else {
        t = mlp(ex, H, I);
      }
      segs.push_back({s + "experts." + std::to_string(e), SegmentRole::expert, layer, static_cast<int>(e), std::move(t)});
    }
    if (moe.shared_expert_intermediate > 0) {
      auto t = mlp(block + "shared_expert.", H, moe.shared_expert_intermediate);
      t.push_back(tensor(block + "shared_expert_gate.weight", {1, H}));  // sigmoid gate, one scalar per token
      segs.push_back({s + "shared_expert", SegmentRole::shared_expert, layer, -1, std::move(t)});
    }
  }

  JsonCursor root_;
  JsonCursor text_;
};

ModelSpec ModelSpec::from_json(const Json& config, std::string_view source) {
  try {
    return ConfigReader(config).read();
  } catch (const Error& e) {
    // Name the file in the message itself: it is the first thing a user needs to fix the field.
    throw Error(Errc::parse, std::string(source) + ": " + e.message(), e.file(), e.line());
  }
}

ModelSpec ModelSpec::from_file(const std::filesystem::path& config_json) {
  return from_json(read_json_file(config_json), config_json.string());
}

const LayerSpec& ModelSpec::layer(int index) const {
  if (index < 0 || index >= num_layers())
    OOM_THROW(Errc::invalid_argument,
              "layer " + std::to_string(index) + " out of range (model has " + std::to_string(num_layers()) + ")");
  return layers_[static_cast<std::size_t>(index)];
}

std::span<const StateSegment> ModelSpec::layer_segments(int index) const {
  (void)layer(index);
  const auto i = static_cast<std::size_t>(index);
  return std::span<const StateSegment>(segments_).subspan(layer_first_segment_[i],
                                                          layer_first_segment_[i + 1] - layer_first_segment_[i]);
}

std::uint64_t ModelSpec::total_parameters() const {
  std::uint64_t n = 0;
  for (const auto& s : segments_) n += s.parameters();
  return n;
}

std::uint64_t ModelSpec::active_parameters() const {
  // Each MoE layer's routed experts are all the same size; a token uses top_k of them.
  std::uint64_t n = 0;
  for (const auto& s : segments_) {
    if (s.role != SegmentRole::expert) n += s.parameters();
    else if (static_cast<std::uint64_t>(s.expert) < moe_.top_k) n += s.parameters();
  }
  return n;
}

std::uint64_t ModelSpec::embedding_parameters() const { return segments_.front().parameters(); }

SegmentBytes ModelSpec::state_bytes(const StatePrecision& precision) const {
  SegmentBytes sum{};
  for (const auto& s : segments_) {
    const SegmentBytes b = segment_bytes(s, precision);
    sum.weights += b.weights;
    sum.master += b.master;
    sum.moments += b.moments;
    sum.grads += b.grads;
  }
  return sum;
}

void require_kept_precision(const StatePrecision& p, std::string_view who) {
  struct Field {
    const char* name;
    DType is;
    bool kept;
    const char* keeps;
  };
  for (const Field& f : {Field{"weights", p.weights, p.weights == DType::bf16, "bf16"}, Field{"master", p.master, p.master == DType::fp32, "fp32"},
                         Field{"moments", p.moments, p.moments == DType::fp32 || p.moments == DType::bf16, "fp32 or bf16"},
                         Field{"grads", p.grads, p.grads == DType::fp32, "fp32"}})
    if (!f.kept)
      OOM_THROW(Errc::unsupported, fmt::format("{}: precision.{} is {}; it keeps {} {}", who, f.name, name(f.is), f.keeps, f.name));
}

}  // namespace oom
