// ModelSpec from the shipped config.json files: parameter counts against hand-derived exact values
// and published figures, segment names/shapes as transformers checkpoints have them, byte
// accounting, and config errors that name the file and the field.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"

using namespace oom;

namespace {

std::string config_path(const std::string& name) { return std::string(OOM_SOURCE_DIR) + "/examples/configs/" + name; }
ModelSpec load(const std::string& name) { return ModelSpec::from_file(config_path(name)); }

const StateSegment& segment(const ModelSpec& m, const std::string& name) {
  for (const auto& s : m.segments())
    if (s.name == name) return s;
  FAIL("no segment " << name);
  throw;
}

const TensorSpec& tensor(const ModelSpec& m, const std::string& name) {
  for (const auto& s : m.segments())
    for (const auto& t : s.tensors)
      if (t.name == name) return t;
  FAIL("no tensor " << name);
  throw;
}

using Shape = std::vector<std::uint64_t>;

/// Relative distance of `n` from `published`.
double off(std::uint64_t n, double published) { return std::abs(static_cast<double>(n) - published) / published; }

}  // namespace

// Exact counts were derived by hand from each architecture (comments show the arithmetic); where a
// widely quoted exact figure exists (Mixtral 46,702,792,704 / 12,879,925,248; Qwen3-30B-A3B
// 30,532,122,624; OLMoE 6,919,161,856) it agrees. Published totals are checked within 1%.
TEST_CASE("Qwen3-30B-A3B: 30.5B total, 3.3B active") {
  const ModelSpec m = load("qwen3-30b-a3b.json");
  CHECK(m.family() == ModelFamily::qwen3_moe);
  // embed+head 2*151936*2048; per layer: attn 18,874,368 + q/k norm 256 + norms 4096 + router 262,144
  // + 128 experts * 4,718,592; final norm 2048.
  CHECK(m.total_parameters() == 30'532'122'624ULL);
  CHECK(m.active_parameters() == 3'353'032'704ULL);
  CHECK(off(m.total_parameters(), 30.5e9) < 0.01);
  // Published "3.3B" is 3.353B cut to one decimal (1.6% off): it lies in [3.3B, 3.4B).
  CHECK(m.active_parameters() >= 3'300'000'000ULL);
  CHECK(m.active_parameters() < 3'400'000'000ULL);
  CHECK(m.attention() == FullAttentionShape{32, 4, 128, false, true, false, false});
  CHECK(m.moe() == MoeShape{128, 8, 768, 0, true});
  CHECK(m.rope_theta() == 1e6);
  CHECK(m.rms_norm_eps() == 1e-6);
  CHECK_FALSE(m.tied_embeddings());
}

TEST_CASE("OLMoE-1B-7B: 6.9B total, 1.3B active, q/k norm over the full width") {
  const ModelSpec m = load("olmoe-1b-7b-0924.json");
  CHECK(m.family() == ModelFamily::olmoe);
  CHECK(m.total_parameters() == 6'919'161'856ULL);
  CHECK(m.active_parameters() == 1'282'017'280ULL);
  CHECK(off(m.total_parameters(), 6.9e9) < 0.01);
  CHECK(off(m.active_parameters(), 1.3e9) < 0.05 / 1.3);  // published to one decimal
  CHECK(tensor(m, "model.layers.0.self_attn.q_norm.weight").shape == Shape{2048});
  CHECK(tensor(m, "model.layers.0.self_attn.k_norm.weight").shape == Shape{2048});
  CHECK(m.attention().head_dim == 128);
  CHECK_FALSE(m.moe().norm_topk_prob);
  CHECK(m.rms_norm_eps() == 1e-5);
}

TEST_CASE("Mixtral-8x7B: 46.7B total, 12.9B active") {
  const ModelSpec m = load("mixtral-8x7b-v0.1.json");
  CHECK(m.total_parameters() == 46'702'792'704ULL);
  CHECK(m.active_parameters() == 12'879'925'248ULL);
  CHECK(off(m.total_parameters(), 46.7e9) < 0.01);
  CHECK(off(m.active_parameters(), 12.9e9) < 0.01);
  CHECK(tensor(m, "model.layers.31.block_sparse_moe.experts.7.w2.weight").shape == Shape{4096, 14336});
  CHECK(tensor(m, "model.layers.0.block_sparse_moe.gate.weight").shape == Shape{8, 4096});
  CHECK_FALSE(m.attention().qk_norm);
  CHECK(segment(m, "layers.0.attention").tensors.size() == 4);
  // An expert's segment holds w1, w3, w2 (gate, up, down), the other families' layout.
  const auto& ex = segment(m, "layers.0.experts.0").tensors;
  REQUIRE(ex.size() == 3);
  CHECK(ex[0].name == "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  CHECK(ex[1].name == "model.layers.0.block_sparse_moe.experts.0.w3.weight");
  CHECK(ex[2].name == "model.layers.0.block_sparse_moe.experts.0.w2.weight");
  // Fields that change a layer's math, read for the layers to refuse by name (null: none).
  CHECK(m.attention().sliding_window == 0);
  CHECK(m.moe().router_jitter_noise == 0);
  Json j = read_json_file(config_path("mixtral-8x7b-v0.1.json"));
  j.set("sliding_window", 4096);
  j.set("router_jitter_noise", Json::parse("0.01"));
  const ModelSpec windowed = ModelSpec::from_json(j);
  CHECK(windowed.attention().sliding_window == 4096);
  CHECK(windowed.moe().router_jitter_noise == 0.01);
  CHECK(windowed.total_parameters() == m.total_parameters());
  // The load-balancing loss enters the training loss only with output_router_logits: its
  // coefficient then (transformers' default where absent: 0.001 here, 0.01 for OLMoE), else 0.
  CHECK(m.moe().router_aux_loss_coef == 0);
  Json aux = read_json_file(config_path("mixtral-8x7b-v0.1.json"));
  aux.set("output_router_logits", Json(true));
  CHECK(ModelSpec::from_json(aux).moe().router_aux_loss_coef == 0.02);  // the file's
  Json bare = read_json_file(config_path("olmoe-1b-7b-0924.json"));
  Json::Object without;
  for (const auto& [k, v] : bare.as_object())
    if (k != "router_aux_loss_coef") without.emplace_back(k, v);
  Json olmoe(without);
  olmoe.set("output_router_logits", Json(true));
  CHECK(ModelSpec::from_json(olmoe).moe().router_aux_loss_coef == 0.01);
}

TEST_CASE("Qwen1.5-MoE-A2.7B (qwen2_moe): 14.3B total, 2.7B active; q/k/v biases after the weights, a shared expert") {
  const ModelSpec m = load("qwen1.5-moe-a2.7b.json");
  CHECK(m.family() == ModelFamily::qwen2_moe);
  CHECK(m.total_parameters() == 14'315'784'192ULL);
  CHECK(m.active_parameters() == 2'689'173'504ULL);
  CHECK(off(m.total_parameters(), 14.3e9) < 0.01);
  CHECK(off(m.active_parameters(), 2.7e9) < 0.01);
  CHECK_FALSE(m.attention().qk_norm);
  CHECK_FALSE(m.attention().bias);
  CHECK(m.attention().qkv_bias);
  CHECK(m.moe().shared_expert_intermediate == 5632);
  CHECK_FALSE(m.moe().norm_topk_prob);
  const auto& attn = segment(m, "layers.0.attention").tensors;
  REQUIRE(attn.size() == 7);
  CHECK(attn[3].name == "model.layers.0.self_attn.o_proj.weight");
  CHECK(attn[4].name == "model.layers.0.self_attn.q_proj.bias");
  CHECK(attn[6].shape == Shape{2048});
  CHECK(tensor(m, "model.layers.23.mlp.shared_expert_gate.weight").shape == Shape{1, 2048});
  CHECK(tensor(m, "model.layers.0.mlp.experts.59.down_proj.weight").shape == Shape{2048, 1408});
  // qkv_bias false drops the biases; decoder_sparse_step makes dense layers as Qwen3-MoE's does.
  Json j = read_json_file(config_path("qwen1.5-moe-a2.7b.json"));
  j.set("qkv_bias", Json(false));
  j.set("decoder_sparse_step", 2);
  const ModelSpec plain = ModelSpec::from_json(j);
  CHECK(segment(plain, "layers.0.attention").tensors.size() == 4);
  CHECK_FALSE(plain.layer(0).moe);
  CHECK(plain.layer(1).moe);
}

TEST_CASE("Qwen3-Next-80B-A3B: hybrid 3 DeltaNet : 1 gated attention, shared expert") {
  const ModelSpec m = load("qwen3-next-80b-a3b.json");
  CHECK(m.family() == ModelFamily::qwen3_next);
  CHECK(m.total_parameters() == 79'674'391'296ULL);
  CHECK(off(m.total_parameters(), 80e9) < 0.01);
  // "A3B" is a nominal label: under the convention above a token touches 3.87B (3.25B without the
  // embedding table and LM head).
  CHECK(m.active_parameters() == 3'874'929'408ULL);
  int full = 0;
  for (const auto& L : m.layers()) full += L.attention == AttentionKind::full;
  CHECK(full == 12);
  CHECK(m.layer(3).attention == AttentionKind::full);
  CHECK(m.layer(0).attention == AttentionKind::linear);
  CHECK(m.linear_attention() == LinearAttentionShape{16, 32, 128, 128, 4});
  CHECK(m.partial_rotary_factor() == 0.25);
  CHECK(m.rope_theta() == 1e7);
  CHECK(m.attention().output_gate);
  CHECK(tensor(m, "model.layers.3.self_attn.q_proj.weight").shape == Shape{8192, 2048});
  CHECK(tensor(m, "model.layers.3.self_attn.q_norm.weight").shape == Shape{256});
  CHECK(tensor(m, "model.layers.0.linear_attn.in_proj_qkvz.weight").shape == Shape{12288, 2048});
  CHECK(tensor(m, "model.layers.0.linear_attn.in_proj_ba.weight").shape == Shape{64, 2048});
  CHECK(tensor(m, "model.layers.0.linear_attn.conv1d.weight").shape == Shape{8192, 1, 4});
  CHECK(tensor(m, "model.layers.0.linear_attn.A_log").shape == Shape{32});
  CHECK(tensor(m, "model.layers.0.linear_attn.norm.weight").shape == Shape{128});
  CHECK(tensor(m, "model.layers.0.linear_attn.out_proj.weight").shape == Shape{2048, 4096});
  CHECK(tensor(m, "model.layers.5.mlp.shared_expert_gate.weight").shape == Shape{1, 2048});
  CHECK(tensor(m, "model.layers.5.mlp.experts.511.up_proj.weight").shape == Shape{512, 2048});
  CHECK(m.moe() == MoeShape{512, 10, 512, 512, true});
  // Without the field, transformers' Qwen3NextConfig rotates a quarter of each head, not all of it.
  std::string text = read_json_file(config_path("qwen3-next-80b-a3b.json")).dump();
  const std::string field = "\"partial_rotary_factor\":0.25,";
  REQUIRE(text.find(field) != std::string::npos);
  text.erase(text.find(field), field.size());
  CHECK(ModelSpec::from_json(Json::parse(text)).partial_rotary_factor() == 0.25);
}

TEST_CASE("Qwen3.5-MoE reads text_config; experts are slices of packed checkpoint tensors") {
  const ModelSpec m = load("qwen3.5-35b-a3b.json");
  CHECK(m.family() == ModelFamily::qwen3_5_moe);
  CHECK(m.total_parameters() == 34'660'610'688ULL);
  CHECK(off(m.total_parameters(), 35e9) < 0.01);
  CHECK(m.active_parameters() == 3'454'988'928ULL);  // "A3B" nominal; 2.95B without the embedding table
  CHECK(m.num_layers() == 40);
  CHECK(m.rope_theta() == 1e7);
  CHECK(m.partial_rotary_factor() == 0.25);
  CHECK(tensor(m, "model.language_model.embed_tokens.weight").shape == Shape{248320, 2048});
  CHECK(tensor(m, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight").shape == Shape{8192, 2048});
  CHECK(tensor(m, "model.language_model.layers.0.linear_attn.in_proj_z.weight").shape == Shape{4096, 2048});
  CHECK(tensor(m, "model.language_model.layers.0.linear_attn.in_proj_b.weight").shape == Shape{32, 2048});
  const auto& e7 = segment(m, "layers.2.experts.7");
  REQUIRE(e7.tensors.size() == 2);
  CHECK(e7.tensors[0].name == "model.language_model.layers.2.mlp.experts.gate_up_proj");
  CHECK(e7.tensors[0].shape == Shape{1024, 2048});
  CHECK(e7.tensors[0].stacked_index == 7);
  CHECK(e7.tensors[0].stacked_count == 256);
  CHECK(e7.tensors[1].shape == Shape{2048, 512});
  CHECK(e7.expert == 7);

  const ModelSpec big = load("qwen3.5-122b-a10b.json");
  CHECK(big.total_parameters() == 122'111'526'912ULL);
  CHECK(off(big.total_parameters(), 122e9) < 0.01);
  CHECK(big.active_parameters() == 9'771'288'576ULL);
  CHECK(off(big.active_parameters(), 10e9) < 0.05);  // "A10B" nominal, published without decimals
  CHECK(big.linear_attention().value_heads == 64);
}

TEST_CASE("the 5.13B configuration has exactly 5,132,851,200 parameters") {
  const ModelSpec m = load("moe-5b.json");
  CHECK(m.total_parameters() == 5'132'851'200ULL);
  // 301,012,992 non-expert + 16 layers * 8 experts * 4,718,592.
  CHECK(m.active_parameters() == 904'992'768ULL);
  // 16 layers * (1 attention + 1 norms + 1 router + 64 experts) + embedding + final norm + lm_head.
  CHECK(m.segments().size() == 16 * 67 + 3);
  CHECK(m.layer_segments(15).size() == 67);
  CHECK(m.layer_segments(15).front().name == "layers.15.attention");
  CHECK(m.layer_segments(15).back().name == "layers.15.experts.63");
  CHECK(m.segments().front().role == SegmentRole::embedding);
  CHECK(m.segments().back().role == SegmentRole::lm_head);
  CHECK_THROWS_AS((void)m.layer_segments(16), Error);
}

TEST_CASE("tiny-moe: the CPU demo model") {
  const ModelSpec m = load("tiny-moe.json");
  CHECK(m.total_parameters() == 3'942'912ULL);
  CHECK(m.active_parameters() == 1'583'616ULL);
  CHECK(m.embedding_parameters() == 256 * 256);
  CHECK(tensor(m, "model.layers.3.mlp.experts.7.gate_proj.weight").shape == Shape{128, 256});
  CHECK(tensor(m, "model.layers.3.self_attn.k_proj.weight").shape == Shape{64, 256});
}

TEST_CASE("state bytes are parameters times the dtype sizes of each copy") {
  const ModelSpec m = load("moe-5b.json");
  const std::uint64_t n = m.total_parameters();
  const SegmentBytes b = m.state_bytes();  // bf16 weights, fp32 master, fp32 m and v, fp32 grads
  CHECK(b.weights == Bytes{2 * n});
  CHECK(b.master == Bytes{4 * n});
  CHECK(b.moments == Bytes{8 * n});
  CHECK(b.grads == Bytes{4 * n});
  CHECK(b.total() == Bytes{18 * n});
  StatePrecision lean;
  lean.moments = DType::bf16;
  lean.grads = DType::bf16;
  CHECK(m.state_bytes(lean).total() == Bytes{(2 + 4 + 4 + 2) * n});
  const auto& expert = segment(m, "layers.0.experts.0");
  CHECK(expert.parameters() == 3ULL * 2048 * 768);
  CHECK(segment_bytes(expert, {}).weights == Bytes{2ULL * 3 * 2048 * 768});
}

namespace {
Json tiny_json() { return read_json_file(config_path("tiny-moe.json")); }

/// The message of the error reading `config` raises; empty when it reads.
std::string config_error(const Json& config) {
  try {
    (void)ModelSpec::from_json(config, "my/config.json");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::parse);
    return e.message();
  }
  return {};
}

std::string with(const char* key, Json value) {
  Json j = tiny_json();
  j.set(key, std::move(value));
  return config_error(j);
}
}  // namespace

TEST_CASE("tied embeddings drop lm_head; dense layers follow mlp_only_layers and decoder_sparse_step") {
  Json j = tiny_json();
  j.set("tie_word_embeddings", true);
  const ModelSpec tied = ModelSpec::from_json(j);
  CHECK(tied.total_parameters() == 3'942'912ULL - 256 * 256);
  CHECK(tied.segments().back().role == SegmentRole::final_norm);

  j = tiny_json();
  j.set("mlp_only_layers", Json::parse("[1]"));
  const ModelSpec dense1 = ModelSpec::from_json(j);
  CHECK_FALSE(dense1.layer(1).moe);
  CHECK(dense1.layer(0).moe);
  const auto seg1 = dense1.layer_segments(1);
  REQUIRE(seg1.size() == 3);
  CHECK(seg1[2].role == SegmentRole::dense_mlp);
  CHECK(seg1[2].tensors[0].name == "model.layers.1.mlp.gate_proj.weight");
  CHECK(seg1[2].tensors[0].shape == Shape{512, 256});
  // One MoE layer (8 experts * 98,304 + router 2048) became a dense MLP of 3 * 256 * 512.
  CHECK(dense1.total_parameters() == 3'942'912ULL - 8 * 98'304 - 2048 + 3 * 256 * 512);

  j = tiny_json();
  j.set("decoder_sparse_step", 2);
  const ModelSpec step2 = ModelSpec::from_json(j);
  CHECK_FALSE(step2.layer(0).moe);
  CHECK(step2.layer(1).moe);
  CHECK_FALSE(step2.layer(2).moe);
  CHECK(step2.layer(3).moe);
}

TEST_CASE("config errors name the file and the field") {
  CHECK(config_error(tiny_json()).empty());
  CHECK(with("model_type", "llama").find("my/config.json: model_type: unknown model_type \"llama\"") == 0);
  CHECK(with("hidden_size", "256") == "my/config.json: hidden_size: expected non-negative integer, got string");
  CHECK(with("hidden_size", -256) == "my/config.json: hidden_size: expected non-negative integer, got number -256");
  CHECK(with("moe_intermediate_size", 0) == "my/config.json: moe_intermediate_size: must be positive, got 0");
  CHECK(with("num_key_value_heads", 3).find("my/config.json: num_key_value_heads: num_attention_heads 8 is not a "
                                            "multiple of num_key_value_heads 3") == 0);
  CHECK(with("num_experts_per_tok", 9) == "my/config.json: num_experts_per_tok: 9 exceeds the number of experts 8");
  // A segment per expert and layer, bounded before any is built (the fuzzer's 86,666,666 experts).
  CHECK(with("num_experts", 86666666) == "my/config.json: num_experts: 4 layers of 86666666 experts make a state segment per "
                                         "expert and layer, more than the 262144 supported");
  CHECK(with("num_hidden_layers", 20000).find("num_experts: 20000 layers of 8 experts make") != std::string::npos);
  CHECK(with("mlp_only_layers", Json::parse("[0, 4]")).find("my/config.json: mlp_only_layers[1]: layer 4 is out of range") == 0);
  CHECK(with("norm_topk_prob", 1) == "my/config.json: norm_topk_prob: expected bool, got number 1");
  CHECK(with("rms_norm_eps", "1e-6") == "my/config.json: rms_norm_eps: expected number, got string");

  Json j = tiny_json();
  Json::Object without;
  for (const auto& [k, v] : j.as_object())
    if (k != "num_experts") without.emplace_back(k, v);
  CHECK(config_error(Json(without)) == "my/config.json: num_experts: missing required field");

  // Without head_dim the hidden size must split evenly over the heads (OLMoE never has head_dim).
  Json olmoe = read_json_file(config_path("olmoe-1b-7b-0924.json"));
  olmoe.set("num_attention_heads", 15);
  olmoe.set("num_key_value_heads", 15);
  CHECK(config_error(olmoe).find("num_attention_heads: hidden_size 2048 is not divisible by num_attention_heads 15") !=
        std::string::npos);
  olmoe = read_json_file(config_path("olmoe-1b-7b-0924.json"));
  olmoe.set("clip_qkv", -1);
  CHECK(config_error(olmoe).find("clip_qkv: must be positive or null") != std::string::npos);
  olmoe.set("clip_qkv", 0);  // transformers would clamp q, k and v to 0, not leave them
  CHECK(config_error(olmoe).find("clip_qkv: must be positive or null") != std::string::npos);
  Json mixtral = read_json_file(config_path("mixtral-8x7b-v0.1.json"));
  mixtral.set("router_jitter_noise", -1);
  CHECK(config_error(mixtral).find("router_jitter_noise: must not be negative") != std::string::npos);
  mixtral = read_json_file(config_path("mixtral-8x7b-v0.1.json"));
  mixtral.set("output_router_logits", Json(true));
  mixtral.set("router_aux_loss_coef", -1);
  CHECK(config_error(mixtral).find("router_aux_loss_coef: must not be negative") != std::string::npos);
  mixtral = read_json_file(config_path("mixtral-8x7b-v0.1.json"));
  mixtral.set("sliding_window", 0);
  CHECK(config_error(mixtral).find("sliding_window: must be positive") != std::string::npos);

  Json next = read_json_file(config_path("qwen3-next-80b-a3b.json"));
  next.set("linear_num_value_heads", 24);
  CHECK(config_error(next).find("linear_num_value_heads: 24 is not a multiple of linear_num_key_heads 16") !=
        std::string::npos);
  next = read_json_file(config_path("qwen3-next-80b-a3b.json"));
  next.set("layer_types", Json::parse(R"(["linear_attention", "full_attention"])"));
  CHECK(config_error(next).find("layer_types: has 2 entries for 48 layers") != std::string::npos);

  Json q35 = read_json_file(config_path("qwen3.5-35b-a3b.json"));
  Json text = *q35.find("text_config");
  text.set("num_experts", "256");
  q35.set("text_config", text);
  CHECK(config_error(q35) == "my/config.json: text_config.num_experts: expected non-negative integer, got string");
  q35.set("text_config", nullptr);
  CHECK(config_error(q35) == "my/config.json: text_config: expected object, got null");
}

TEST_CASE("sizes too large for exact byte counts are refused, not wrapped") {
  // 2^48 (and 2^50) once read as fewer parameters than 2^45, their byte counts wrapping past 2^64.
  CHECK(with("moe_intermediate_size", std::int64_t{1} << 48) ==
        "my/config.json: moe_intermediate_size: must be at most 2147483647, got 281474976710656");
  // Within each field's bound, each tensor under 2^50, but 3 x 2^47 an expert x 8 experts x 4
  // layers passes 2^50 parameters.
  Json j = tiny_json();
  j.set("hidden_size", std::int64_t{1} << 16);
  j.set("moe_intermediate_size", (std::int64_t{1} << 31) - 1);
  CHECK(config_error(j).find("the config's sizes make more than 2^50 parameters") != std::string::npos);
  j = tiny_json();
  j.set("hidden_size", (std::int64_t{1} << 31) - 1);
  j.set("vocab_size", (std::int64_t{1} << 31) - 1);
  const std::string one = config_error(j);
  CHECK(one.find("more than 2^50 elements") != std::string::npos);
  CHECK(one.find("model.embed_tokens.weight") != std::string::npos);
  // The largest shipped config reads, and its count is exact.
  CHECK(ModelSpec::from_file(config_path("qwen3.5-122b-a10b.json")).total_parameters() > std::uint64_t{100'000'000'000});
}

TEST_CASE("from_file names the file on a syntax error") {
  try {
    (void)ModelSpec::from_file(config_path("README.md"));
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::parse);
    CHECK(e.message().find("examples/configs/README.md:1:1: expected a value") != std::string::npos);
  }
}

namespace {
Json without(const Json& config, std::initializer_list<std::string_view> keys) {
  Json::Object kept;
  for (const auto& [k, v] : config.as_object())
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) kept.emplace_back(k, v);
  return Json(std::move(kept));
}
}  // namespace

TEST_CASE("a config that would train another model than transformers' is refused, and absent fields default as transformers' do") {
  // The session-53 audit: each of these had been accepted and trained as SiLU experts with plain
  // RoPE, no dropout, or (in fp32) a theta of 0 or inf and an eps of 0.
  CHECK(with("hidden_act", "gelu") == "my/config.json: hidden_act: \"gelu\" is not implemented (only \"silu\" is)");
  CHECK(with("hidden_act", "silu").empty());
  CHECK(with("rope_scaling", Json::parse(R"({"rope_type": "yarn", "factor": 4.0})")).find("rope_scaling: RoPE scaling is not implemented") !=
        std::string::npos);
  CHECK(with("rope_scaling", Json::parse(R"({"type": "linear", "factor": 2.0})")).find("rope_scaling: RoPE scaling is not implemented") !=
        std::string::npos);
  CHECK(with("rope_scaling", nullptr).empty());
  CHECK(with("rope_parameters", Json::parse(R"({"rope_type": "linear", "factor": 8.0, "rope_theta": 10000})"))
            .find("rope_parameters.rope_type: \"linear\" is not implemented") != std::string::npos);
  CHECK(with("rope_parameters", Json::parse(R"({"rope_type": "default", "rope_theta": 10000})")).empty());
  CHECK(with("attention_dropout", 0.1).find("attention_dropout: attention dropout is not implemented") != std::string::npos);
  CHECK(with("attention_dropout", 0.0).empty());
  for (const double theta : {1e-300, 1e300})
    CHECK(with("rope_theta", theta).find("rope_theta: must be positive and within fp32's normal range") != std::string::npos);
  CHECK(with("rms_norm_eps", 1e-50).find("rms_norm_eps: must be positive") != std::string::npos);

  // num_key_value_heads (and the hybrids' head_dim) absent: transformers' config classes' defaults,
  // not num_attention_heads (and hidden / heads); an explicit null is num_attention_heads.
  struct Case {
    const char* config;
    std::uint64_t kv_heads;
  };
  for (const Case& c : {Case{"qwen3-30b-a3b.json", 4}, Case{"mixtral-8x7b-v0.1.json", 8}, Case{"qwen1.5-moe-a2.7b.json", 16},
                        Case{"olmoe-1b-7b-0924.json", 16}}) {
    CAPTURE(c.config);
    const Json full = read_json_file(config_path(c.config));
    const ModelSpec spec = ModelSpec::from_json(without(full, {"num_key_value_heads"}), c.config);
    CHECK(spec.attention().kv_heads == c.kv_heads);
    Json null_kv = full;
    null_kv.set("num_key_value_heads", nullptr);
    CHECK(ModelSpec::from_json(null_kv, c.config).attention().kv_heads == ModelSpec::from_json(full, c.config).attention().heads);
  }
  const Json next = read_json_file(config_path("qwen3-next-80b-a3b.json"));
  const ModelSpec bare = ModelSpec::from_json(without(next, {"num_key_value_heads", "head_dim"}), "next");
  CHECK(bare.attention().kv_heads == 2);
  CHECK(bare.attention().head_dim == 256);
}
