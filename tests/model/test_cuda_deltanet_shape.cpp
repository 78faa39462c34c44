// The Gated DeltaNet block's shape from a model spec and its sizes (no GPU needed): the segment
// it binds is exactly the spec's linear_attention segment, and what it is not given is refused.
// The decoder layer's hybrid, Mixtral and OLMoE shapes and bindings likewise (the layer itself:
// test_cuda_hybrid_layer).
// The planner's worksets for a linear layer's parts and a softmax layer's query chunks against the
// CUDA layer's workspace.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <cstdint>
#include <string>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/kernels/gated_delta.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/model/cuda_deltanet.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/model/router_balance.hpp"
#include "oom/reference/router.hpp"
#include "oom/plan/dependency_partitioner.hpp"
#include "oom/plan/machine_profile.hpp"
#include "plan/step_model.hpp"

using namespace oom;

namespace {

/// The planner's step model of `spec` on one H200 (139 GiB, 125 GiB host) for `workload`, with the
/// profile it keeps a reference to.
struct H200StepModel {
  MachineProfile profile = MachineProfile::h200(1);
  detail::StepModel model;
  H200StepModel(const ModelSpec& spec, Workload workload) : model(spec, profile, request(workload), ExecutionPath::local) {}
  static PlanRequest request(Workload workload) {
    PlanRequest req;
    req.gpu_budget = Bytes{139ull << 30};
    req.host_budget = Bytes{125ull << 30};
    req.workload = workload;
    return req;
  }
};

/// One fake base per segment of a layer, far apart (only offsets are taken from them).
std::vector<const bf16*> fake_bases(const ModelSpec& spec, int layer) {
  std::vector<const bf16*> bases;
  for (std::size_t i = 0; i < spec.layer_segments(layer).size(); ++i) bases.push_back(reinterpret_cast<const bf16*>((i + 1) << 32));
  return bases;
}

}  // namespace

TEST_CASE("DeltaNetShape::from_spec: both families, the spec's segment, refusals named") {
  const std::string dir = std::string(OOM_SOURCE_DIR) + "/examples/configs/";
  const ModelSpec next = ModelSpec::from_file(dir + "qwen3-next-80b-a3b.json");
  const auto s = model::DeltaNetShape::from_spec(next, 0, 4096, 2);
  CHECK(s.fused);
  CHECK(s.hidden == 2048);
  CHECK(s.k_heads == 16);
  CHECK(s.v_heads == 32);
  CHECK(s.k_dim == 128);
  CHECK(s.v_dim == 128);
  CHECK(s.conv_kernel == 4);
  CHECK(s.conv_channels() == 2 * 2048 + 4096);
  CHECK(model::deltanet_parameters(s) == static_cast<std::int64_t>(next.layer_segments(0)[0].parameters()));
  const ModelSpec q35 = ModelSpec::from_file(dir + "qwen3.5-35b-a3b.json");
  const auto s35 = model::DeltaNetShape::from_spec(q35, 0, 1024);
  CHECK_FALSE(s35.fused);
  CHECK(model::deltanet_parameters(s35) == static_cast<std::int64_t>(q35.layer_segments(0)[0].parameters()));
  // The saved state and workspace grow with the tokens.
  const auto longer = model::DeltaNetShape::from_spec(next, 0, 8192, 2);
  CHECK(model::deltanet_saved_bytes(longer) > model::deltanet_saved_bytes(s));
  CHECK(model::deltanet_workspace_bytes(longer) > model::deltanet_workspace_bytes(s));

  CHECK_THROWS_WITH_AS(model::DeltaNetShape::from_spec(next, 3, 4096), doctest::Contains("layer 3 of the qwen3_next model is not a linear-attention layer"),
                       Error);
  CHECK_THROWS_WITH_AS(model::DeltaNetShape::from_spec(next, 0, 4095, 2), doctest::Contains("4095 tokens are not a whole number of sequences = 2"),
                       Error);
  auto wide = s;
  wide.v_dim = 256;
  CHECK_THROWS_WITH_AS((void)model::deltanet_saved_bytes(wide), doctest::Contains("v_dim 256 (at most 128 each)"), Error);
  // In parts: a multiple of the rule's chunk, and a workspace of the part's rows, not the sequence's.
  auto parts = s;
  parts.part_tokens = 100;
  CHECK_THROWS_WITH_AS((void)model::deltanet_workspace_bytes(parts), doctest::Contains("part_tokens = 100 (0: whole sequences, else a multiple of chunk = 64)"),
                       Error);
  parts.part_tokens = 1024;
  CHECK(parts.in_parts());
  {
    auto short_parts = s;
    short_parts.chunk = 1;
    short_parts.part_tokens = 2;  // shorter than the conv's reach into the part after
    CHECK_THROWS_WITH_AS((void)model::deltanet_workspace_bytes(short_parts),
                         doctest::Contains("part_tokens = 2 is shorter than the conv's reach, conv_kernel - 1 = 3"), Error);
  }
  CHECK(model::deltanet_saved_bytes(parts) == model::deltanet_saved_bytes(s));
  CHECK(model::deltanet_workspace_bytes(parts) < model::deltanet_workspace_bytes(s) / 2);  // the rule's per-head scratch is fixed
  auto one_part = s;
  one_part.tokens = 1024;
  one_part.sequences = 1;
  CHECK(model::deltanet_workspace_bytes(parts) >= model::deltanet_workspace_bytes(one_part));
  parts.part_tokens = s.tokens;  // not shorter than a sequence: whole
  CHECK_FALSE(parts.in_parts());
  CHECK(model::deltanet_workspace_bytes(parts) == model::deltanet_workspace_bytes(s));
  // Null weights or gradients are named before any GPU work (no GPU needed to see it).
  model::DeltaNetParams w{};
  CHECK_THROWS_WITH_AS(model::deltanet_forward(nullptr, nullptr, s, w, reinterpret_cast<const bf16*>(&s), reinterpret_cast<bf16*>(&wide),
                                               &wide, &wide),
                       doctest::Contains("forward: weight: in_proj_qkvz is null"), Error);
  // A null gradient is named before anything runs.
  const model::DeltaNetParams bound = model::bind_deltanet_params(s, reinterpret_cast<const bf16*>(&s));
  CHECK_THROWS_WITH_AS(model::deltanet_backward(nullptr, nullptr, s, bound, reinterpret_cast<const bf16*>(&s), reinterpret_cast<const bf16*>(&s),
                                                reinterpret_cast<float*>(&wide), model::DeltaNetGrads{}, &wide, &wide),
                       doctest::Contains("backward: gradient: in_proj_qkvz is null"), Error);
  // Each tensor where ModelSpec's segment puts it (Qwen3.5's separate projections back to back).
  for (const auto& [spec, fused] : {std::pair{&next, true}, std::pair{&q35, false}}) {
    CAPTURE(fused);
    const auto shape = model::DeltaNetShape::from_spec(*spec, 0, 64);
    const bf16* base = reinterpret_cast<const bf16*>(&shape);  // only offsets are taken from it
    const auto p = model::bind_deltanet_params(shape, base);
    std::int64_t at = 0;
    for (const auto& t : spec->layer_segments(0)[0].tensors) {
      CAPTURE(t.name);
      const auto is = [&](const char* suffix) { return t.name.ends_with(suffix); };
      if (is("in_proj_qkvz.weight") || is("in_proj_qkv.weight")) CHECK(p.in_proj_qkvz - base == at);
      if (is("in_proj_ba.weight") || is("in_proj_b.weight")) CHECK(p.in_proj_ba - base == at);
      if (is("conv1d.weight")) CHECK(p.conv - base == at);
      if (is("dt_bias")) CHECK(p.dt_bias - base == at);
      if (is("A_log")) CHECK(p.a_log - base == at);
      if (is("linear_attn.norm.weight")) CHECK(p.norm - base == at);
      if (is("out_proj.weight")) CHECK(p.out_proj - base == at);
      at += static_cast<std::int64_t>(t.elements());
    }
    CHECK(at == model::deltanet_parameters(shape));
  }
  const ModelSpec moe = ModelSpec::from_file(dir + "moe-5b.json");
  CHECK_THROWS_AS(model::DeltaNetShape::from_spec(moe, 0, 4096), Error);
}

TEST_CASE("the decoder layer's hybrid shapes and bindings: kind, gate, rotary, norm offset, shared expert, stacked experts") {
  const std::string data = std::string(OOM_SOURCE_DIR) + "/tests/data/";
  const ModelSpec next = ModelSpec::from_file(data + "gpu-qwen3-next-layers.json");
  const ModelSpec q35 = ModelSpec::from_file(data + "gpu-qwen3.5-moe-layers.json");
  for (const auto* spec : {&next, &q35}) {
    CAPTURE(to_string(spec->family()));
    const auto linear = model::DecoderLayerShape::from_spec(*spec, 0, 122, 2);
    const auto full = model::DecoderLayerShape::from_spec(*spec, 1, 122, 2);
    CHECK(linear.linear);
    CHECK_FALSE(linear.output_gate);
    CHECK(linear.deltanet.fused == (spec == &next));
    CHECK(linear.deltanet.tokens == 122);
    CHECK(linear.deltanet.sequences == 2);
    CHECK_FALSE(full.linear);
    CHECK(full.output_gate);
    CHECK(full.rotary_dim == 32);  // 128 x 0.25
    CHECK(full.norm_offset == 1.0f);
    CHECK(linear.norm_offset == 1.0f);
    CHECK(full.shared_intermediate == 96);
    // A linear layer keeps no attention state; its saved buffer is the block's and the MoE half's.
    CHECK(model::decoder_layer_attention_state(linear, nullptr).output_bytes == 0);
    CHECK(model::decoder_layer_saved_bytes(linear) > model::deltanet_saved_bytes(linear.deltanet));
    // Bindings from fake segment bases (only offsets are taken): every tensor where the spec puts it.
    for (int layer : {0, 1}) {
      CAPTURE(layer);
      const auto segs = spec->layer_segments(layer);
      const auto bases = fake_bases(*spec, layer);
      const auto p = model::bind_decoder_layer_params(*spec, layer, bases);
      const auto H = static_cast<std::int64_t>(spec->hidden_size()), I = static_cast<std::int64_t>(spec->moe().expert_intermediate);
      for (std::size_t e = 0; e < spec->moe().experts; ++e) {
        CHECK(p.expert_up_proj[e] == p.expert_gate_proj[e] + I * H);
        CHECK(p.expert_down_proj[e] == p.expert_gate_proj[e] + 2 * I * H);
      }
      const auto shared = segs.back();
      REQUIRE(shared.role == SegmentRole::shared_expert);
      CHECK(p.shared_gate_proj == bases.back());
      CHECK(p.shared_down_proj == bases.back() + 2 * 96 * H);
      CHECK(p.shared_expert_gate == bases.back() + 3 * 96 * H);
      if (layer == 0) {
        CHECK(p.deltanet.in_proj_qkvz == bases[0]);
        CHECK(p.q_proj == nullptr);
      } else {
        CHECK(p.q_proj == bases[0]);
        CHECK(p.k_proj == bases[0] + 2 * 4 * 128 * H);  // q_proj is [q | gate] per head: 2 Hq D rows
      }
    }
  }
  // A missing shared expert pointer is named before anything runs (no GPU needed).
  const auto full = model::DecoderLayerShape::from_spec(next, 1, 122, 2);
  auto p = model::bind_decoder_layer_params(next, 1, fake_bases(next, 1));
  p.shared_expert_gate = nullptr;
  kernels::ExpertGemmStreams streams;
  const model::DecoderLayerContext ctx{nullptr, reinterpret_cast<cublasHandle_t>(&streams), &streams, nullptr};
  const auto* fake = reinterpret_cast<bf16*>(&streams);
  CHECK_THROWS_WITH_AS(model::decoder_layer_forward(ctx, full, p, reinterpret_cast<const std::int32_t*>(fake), fake,
                                                    const_cast<bf16*>(fake) + 1, &streams, 0, &streams, 0),
                       doctest::Contains("params: shared_expert_gate is null"), Error);
}

TEST_CASE("the GPU layer refuses a sliding window by name; a load-balancing loss needs the context's CudaRouterBalance") {
  Json j = read_json_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/tiny-moe-d128.json");
  const auto plain = model::DecoderLayerShape::from_spec(ModelSpec::from_json(j), 0, 128);
  CHECK(plain.router_aux_loss_coef == 0);
  Json windowed = j;
  windowed.set("use_sliding_window", Json(true));
  windowed.set("sliding_window", Json(4096));
  CHECK_THROWS_WITH_AS((void)model::DecoderLayerShape::from_spec(ModelSpec::from_json(windowed), 0, 128),
                       doctest::Contains("sliding-window attention (sliding_window 4096) is not implemented"), Error);
  j.set("output_router_logits", Json(true));
  j.set("router_aux_loss_coef", Json(0.25));
  const ModelSpec spec = ModelSpec::from_json(j);
  const auto s = model::DecoderLayerShape::from_spec(spec, 0, 128);
  CHECK(s.router_aux_loss_coef == 0.25);

  // The layer's entries refuse the loss without its accumulator, or with one of another
  // coefficient or token count, before anything is launched (the pointers here are never read).
  const auto p = model::bind_decoder_layer_params(spec, 0, fake_bases(spec, 0));
  kernels::ExpertGemmStreams streams;
  const auto* fake = reinterpret_cast<bf16*>(&streams);
  const auto* positions = reinterpret_cast<const std::int32_t*>(fake);
  model::DecoderLayerContext ctx{nullptr, reinterpret_cast<cublasHandle_t>(&streams), &streams, nullptr};
  const auto forward = [&] {
    model::decoder_layer_forward(ctx, s, p, positions, fake, const_cast<bf16*>(fake) + 1, &streams, 0, &streams, 0);
  };
  CHECK_THROWS_WITH_AS(forward(), doctest::Contains("router_aux_loss_coef 0.25) and the context no CudaRouterBalance"), Error);
  const std::size_t bytes = model::CudaRouterBalance::device_bytes(s.experts, s.tokens);
  model::CudaRouterBalance other(2, s.experts, s.top_k, s.tokens, 0.5, 1.0, &streams, bytes);
  ctx.balance = &other;
  CHECK_THROWS_WITH_AS(forward(), doctest::Contains("CudaRouterBalance has coefficient 0.5, the shape's router_aux_loss_coef is 0.25"),
                       Error);
  model::CudaRouterBalance shorter(2, s.experts, s.top_k, s.tokens - 1, 0.25, 1.0, &streams, bytes);
  ctx.balance = &shorter;
  CHECK_THROWS_WITH_AS(forward(), doctest::Contains("CudaRouterBalance is for 127 tokens a layer, 8 experts, top 2; the shape has 128, 8, top 2"),
                       Error);
  model::CudaRouterBalance wider(2, s.experts + 1, s.top_k, s.tokens, 0.25, 1.0, &streams, 1 << 20);
  ctx.balance = &wider;  // would read past the layer's (T, E) probabilities
  CHECK_THROWS_WITH_AS(forward(), doctest::Contains("9 experts, top 2; the shape has 128, 8, top 2"), Error);
  model::CudaRouterBalance right(2, s.experts, s.top_k, s.tokens, 0.25, 1.0, &streams, bytes);
  model::DecoderLayerShape without = s;
  without.router_aux_loss_coef = 0;
  ctx.balance = &right;
  CHECK_THROWS_WITH_AS(model::decoder_layer_forward(ctx, without, p, positions, fake, const_cast<bf16*>(fake) + 1, &streams, 0, &streams, 0),
                       doctest::Contains("CudaRouterBalance has coefficient 0.25, the shape's router_aux_loss_coef is 0"), Error);
  model::DecoderLayerShape negative = s;
  negative.router_aux_loss_coef = -1;
  CHECK_THROWS_WITH_AS(negative.validate(), doctest::Contains("router_aux_loss_coef = -1 must be finite and >= 0"), Error);
}

TEST_CASE("CudaRouterBalance refuses sizes, buffers and calls out of order by name, before touching the GPU") {
  int buffer = 0;
  const std::size_t bytes = model::CudaRouterBalance::device_bytes(8, 100);
  CHECK(bytes >= 8 * sizeof(double) + 8 * sizeof(std::int32_t));
  CHECK(model::CudaRouterBalance::device_bytes(64, 100) > bytes);  // grows with the experts
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(2, 8, 2, 100, 0.1, 1.0, nullptr, bytes),
                       doctest::Contains("device buffer null of"), Error);
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(2, 8, 2, 100, 0.1, 1.0, &buffer, bytes - 1),
                       doctest::Contains(("needs " + std::to_string(bytes) + " (CudaRouterBalance::device_bytes)").c_str()), Error);
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(2, 8, 9, 100, 0.1, 1.0, &buffer, bytes), doctest::Contains("1 <= top_k <= min(experts, 16)"),
                       Error);
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(0, 8, 2, 100, 0.1, 1.0, &buffer, bytes), doctest::Contains("at least one layer"), Error);
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(2, 8, 2, 100, 0.1, 0.0, &buffer, bytes), doctest::Contains("a scale > 0"), Error);
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(2, 64, 17, 100, 0.1, 1.0, &buffer, 1 << 20), doctest::Contains("min(experts, 16)"), Error);
  // 48 layers x 2^22 tokens x 16 slots: past int32, which router_backward's counts are.
  CHECK_THROWS_WITH_AS(model::CudaRouterBalance(48, 128, 16, 1 << 22, 0.1, 1.0, &buffer, 1 << 30),
                       doctest::Contains("could pass the int32 counts of router_backward"), Error);

  model::CudaRouterBalance b(2, 8, 2, 100, 0.1, 0.5, &buffer, bytes);
  CHECK(b.aux_loss_grad() == doctest::Approx(0.1 * 0.5 / 4));
  const std::vector<std::int32_t> counts(8, 25);
  CHECK_THROWS_WITH_AS(b.add_counts(counts), doctest::Contains("expert counts added outside a forward (begin() first)"), Error);
  CHECK_THROWS_WITH_AS(b.add_probabilities(nullptr, nullptr, 100), doctest::Contains("outside a forward (begin() first)"), Error);
  CHECK_THROWS_WITH_AS(b.finish(nullptr, nullptr), doctest::Contains("finish() outside a forward"), Error);
  CHECK_THROWS_WITH_AS((void)b.device_counts(), doctest::Contains("the backward's global counts asked before finish()"), Error);
}

TEST_CASE("Mixtral's and OLMoE's layer shapes and bindings: q/k norm, experts w1/w3/w2, router, refusals named") {
  const std::string data = std::string(OOM_SOURCE_DIR) + "/tests/data/";
  const ModelSpec mixtral = ModelSpec::from_file(data + "gpu-mixtral-layers.json");
  const ModelSpec olmoe = ModelSpec::from_file(data + "gpu-olmoe-layers.json");
  const auto m = model::DecoderLayerShape::from_spec(mixtral, 1, 122, 2);
  const auto o = model::DecoderLayerShape::from_spec(olmoe, 0, 122, 2);
  CHECK(m.qk_norm == model::QkNorm::none);
  CHECK(o.qk_norm == model::QkNorm::full_width);
  for (const auto* s : {&m, &o}) {
    CHECK_FALSE(s->linear);
    CHECK_FALSE(s->output_gate);
    CHECK(s->rotary_dim == 128);
    CHECK(s->norm_offset == 0.0f);
    CHECK(s->shared_intermediate == 0);
  }
  CHECK(m.norm_topk_prob);
  CHECK_FALSE(o.norm_topk_prob);
  CHECK(m.rope_theta == 1e6f);
  // The norms' saved rstd: per head, one per token over the whole projection, none without a norm.
  auto per_head = o;
  per_head.qk_norm = model::QkNorm::per_head;
  auto none = o;
  none.qk_norm = model::QkNorm::none;
  CHECK(model::decoder_layer_saved_bytes(per_head) > model::decoder_layer_saved_bytes(o));
  CHECK(model::decoder_layer_saved_bytes(o) > model::decoder_layer_saved_bytes(none));
  const auto fake_bases = [](const ModelSpec& spec, int layer) {
    std::vector<const bf16*> bases;
    for (std::size_t i = 0; i < spec.layer_segments(layer).size(); ++i) bases.push_back(reinterpret_cast<const bf16*>((i + 1) << 32));
    return bases;
  };
  for (const auto* spec : {&mixtral, &olmoe}) {
    CAPTURE(to_string(spec->family()));
    const auto bases = fake_bases(*spec, 1);
    const auto p = model::bind_decoder_layer_params(*spec, 1, bases);
    const auto H = static_cast<std::int64_t>(spec->hidden_size()), I = static_cast<std::int64_t>(spec->moe().expert_intermediate);
    const auto q = static_cast<std::int64_t>(spec->attention().heads * spec->attention().head_dim);
    const auto kv = static_cast<std::int64_t>(spec->attention().kv_heads * spec->attention().head_dim);
    CHECK(p.router == bases[2]);  // attention, norms, router (block_sparse_moe.gate / mlp.gate), experts
    for (std::size_t e = 0; e < spec->moe().experts; ++e) {
      CHECK(p.expert_gate_proj[e] == bases[3 + e]);  // Mixtral's w1
      CHECK(p.expert_up_proj[e] == bases[3 + e] + I * H);  // w3
      CHECK(p.expert_down_proj[e] == bases[3 + e] + 2 * I * H);  // w2
    }
    CHECK(p.q_proj == bases[0]);
    CHECK(p.o_proj == bases[0] + (q + 2 * kv) * H);
    if (spec == &mixtral) {
      CHECK(p.q_norm == nullptr);
      CHECK(p.k_norm == nullptr);
    } else {
      CHECK(p.q_norm == bases[0] + (q + 2 * kv) * H + H * q);
      CHECK(p.k_norm == p.q_norm + q);  // over the whole projection: q wide, then kv wide
    }
  }
  // What would change their math and is not implemented is refused by name.
  auto refused = [](const std::string& file, const char* field, const Json& value) {
    Json j = read_json_file(file);
    j.set(field, value);
    try {
      (void)model::DecoderLayerShape::from_spec(ModelSpec::from_json(j), 0, 122, 2);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  CHECK(refused(data + "gpu-mixtral-layers.json", "sliding_window", Json(4096)).find("sliding-window attention (sliding_window 4096)") !=
        std::string::npos);
  CHECK(refused(data + "gpu-mixtral-layers.json", "router_jitter_noise", Json::parse("0.01")).find("router_jitter_noise 0.01") !=
        std::string::npos);
  CHECK(refused(data + "gpu-olmoe-layers.json", "clip_qkv", Json::parse("8.0")).find("clip_qkv 8 is not implemented") !=
        std::string::npos);
  CHECK(refused(data + "gpu-olmoe-layers.json", "attention_bias", Json(true))
            .find("attention biases on o_proj (attention_bias) are not implemented") != std::string::npos);
}

TEST_CASE("Qwen2-MoE's layer shape and binding: q/k/v biases after the weights, a shared expert, no q/k norm") {
  const std::string data = std::string(OOM_SOURCE_DIR) + "/tests/data/";
  const ModelSpec spec = ModelSpec::from_file(data + "gpu-qwen2-moe-layers.json");
  const auto s = model::DecoderLayerShape::from_spec(spec, 1, 122, 2);
  CHECK(s.qkv_bias);
  CHECK(s.qk_norm == model::QkNorm::none);
  CHECK_FALSE(s.output_gate);
  CHECK_FALSE(s.norm_topk_prob);
  CHECK(s.shared_intermediate == 96);
  CHECK(s.rotary_dim == 128);
  // The public config too (Qwen1.5-MoE-A2.7B: 60 experts top-4, shared expert 5632).
  const auto big = model::DecoderLayerShape::from_spec(
      ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/qwen1.5-moe-a2.7b.json"), 0, 4096);
  CHECK(big.qkv_bias);
  CHECK(big.experts == 60);
  // Biases take a row of ones in the backward's scratch, T bf16 (to the Carver's alignment).
  kernels::ExpertGemmStreams streams;
  auto plain = s;
  plain.qkv_bias = false;
  const auto ws = static_cast<std::int64_t>(model::decoder_layer_workspace_bytes(s, streams));
  const auto ws_plain = static_cast<std::int64_t>(model::decoder_layer_workspace_bytes(plain, streams));
  CHECK(ws - ws_plain >= 122 * 2);
  CHECK(ws - ws_plain <= 122 * 2 + 256);
  CHECK(model::decoder_layer_saved_bytes(s) == model::decoder_layer_saved_bytes(plain));
  // Bound: q/k/v weights, o_proj, then the biases q, k, v (ModelSpec keeps the weights one block).
  std::vector<const bf16*> bases;
  for (std::size_t i = 0; i < spec.layer_segments(1).size(); ++i) bases.push_back(reinterpret_cast<const bf16*>((i + 1) << 32));
  const auto p = model::bind_decoder_layer_params(spec, 1, bases);
  const std::int64_t H = 256, q = 4 * 128, kv = 2 * 128;
  CHECK(p.q_proj == bases[0]);
  CHECK(p.o_proj == bases[0] + (q + 2 * kv) * H);
  CHECK(p.q_bias == p.o_proj + H * q);
  CHECK(p.k_bias == p.q_bias + q);
  CHECK(p.v_bias == p.k_bias + kv);
  CHECK(p.q_norm == nullptr);
  CHECK(p.k_norm == nullptr);
  CHECK(p.shared_expert_gate != nullptr);
  std::vector<float*> grad_bases;
  for (const bf16* b : bases) grad_bases.push_back(reinterpret_cast<float*>(const_cast<bf16*>(b)));
  const auto g = model::bind_decoder_layer_grads(spec, 1, grad_bases);
  CHECK(g.q_bias == g.o_proj + H * q);
  CHECK(g.v_bias == g.k_bias + kv);
  // A shape with biases and an output gate (no family has both) is refused, as by the host layer.
  auto gated = s;
  gated.output_gate = true;
  CHECK_THROWS_WITH_AS(gated.validate(), doctest::Contains("qkv_bias beside an output gate"), Error);
}

TEST_CASE("the planner's bytes for a linear layer are the GPU block's saved buffer") {
  // The planner (src/plan/step_model.cpp) sizes a linear layer's attention_output and
  // linear_attention_state classes; the CUDA executor keeps deltanet_saved_bytes. They must agree
  // (up to the Carver's 256-byte alignment of each of the block's six pieces), for one sequence
  // and several, at token counts that are no multiple of the state interval.
  const ModelSpec next = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/qwen3-next-80b-a3b.json");
  for (const auto& [sequences, seq_len] : {std::pair<std::uint64_t, std::uint64_t>{1, 4100}, {2, 4100}, {3, 77}}) {
    CAPTURE(sequences);
    CAPTURE(seq_len);
    const H200StepModel planner(next, {sequences, seq_len});
    const auto planned = planner.model.saved_bytes(0);
    const std::uint64_t bytes = planned[static_cast<std::size_t>(ActivationClass::attention_output)].count() +
                                planned[static_cast<std::size_t>(ActivationClass::linear_attention_state)].count();
    const auto shape = model::DeltaNetShape::from_spec(next, 0, static_cast<std::int64_t>(sequences * seq_len),
                                                       static_cast<std::int64_t>(sequences));
    const std::uint64_t gpu = model::deltanet_saved_bytes(shape);
    CHECK(gpu >= bytes);
    CHECK(gpu - bytes < 6 * 256);
  }
}

TEST_CASE("the planner's workset for a linear layer's part is the GPU block's workspace") {
  // The planner partitions a linear layer's tokens (a carried_state work item: fixed + per token)
  // and the CUDA executor runs the block in parts of that many tokens (DeltaNetShape::part_tokens),
  // sizing deltanet_workspace_bytes. They must agree up to the Carver's 256-byte alignment of each
  // of the block's pieces, for both projection layouts.
  for (const char* config : {"/examples/configs/qwen3-next-80b-a3b.json", "/examples/configs/qwen3.5-35b-a3b.json"}) {
    CAPTURE(config);
    const ModelSpec spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + config);
    int linear = 0;
    while (spec.layer(linear).attention != AttentionKind::linear) ++linear;
    const H200StepModel planner(spec, {1, 16384});
    const WorkItem w = planner.model.attention_item(linear);
    CHECK(w.dependency == ChunkDependency::carried_state);
    // The planner keeps one extra block of each weight-gradient partial (conv: C K floats; norm:
    // v_dim; gates: 2 v_heads) for a part that ends mid-block; 1152 tokens end half-way into the
    // conv's 256-token blocks.
    const auto la = spec.linear_attention();
    const std::uint64_t C = 2 * la.key_heads * la.key_head_dim + la.value_heads * la.value_head_dim;
    const std::uint64_t spare = (C * la.conv_kernel + la.value_head_dim + 2 * la.value_heads) * 4;
    for (const std::int64_t part : {1024, 1152, 4096}) {
      CAPTURE(part);
      auto shape = model::DeltaNetShape::from_spec(spec, linear, 16384, 1);
      shape.part_tokens = part;
      const std::uint64_t gpu = model::deltanet_workspace_bytes(shape);
      const std::uint64_t planned = w.fixed.count() + static_cast<std::uint64_t>(part) * w.per_unit.count();
      CHECK(planned + 24 * 256 >= gpu);  // never short by more than the pieces' alignment
      // Nor over by more than the spare blocks and the smaller of the rule's two scratches, which
      // the planner adds where the kernel takes the larger (either form may run).
      auto rule = oom::kernels::GatedDeltaDims{1, part, static_cast<std::int64_t>(la.key_heads), static_cast<std::int64_t>(la.value_heads),
                                               static_cast<std::int64_t>(la.key_head_dim), static_cast<std::int64_t>(la.value_head_dim), 64};
      rule.form = oom::kernels::GatedDeltaDims::Form::chunked;
      const std::uint64_t chunked = oom::kernels::gated_delta_backward_workspace_bytes(rule);
      rule.form = oom::kernels::GatedDeltaDims::Form::recurrent;
      const std::uint64_t per_head_grads = 2 * static_cast<std::uint64_t>(part) * la.value_heads * la.key_head_dim * 4;  // dq, dk: in both
      const std::uint64_t smaller =
          std::min<std::uint64_t>(chunked, oom::kernels::gated_delta_backward_workspace_bytes(rule)) - per_head_grads;
      CHECK(planned <= gpu + spare + smaller);
    }
  }
}

TEST_CASE("the planner prices a linear layer's sequences side by side when whole, one at a time when in parts") {
  // The GPU block runs all sequences of a micro-batch at once when whole (their recurrences side
  // by side, MachineProfile::gated_delta_*_parallel) and one sequence at a time in parts: 4
  // sequences in two parts each cost more than whole in the forward (the recurrent form side by
  // side, 1.6x the chunked one's updates a second) and no less in the backward (the chunked one
  // sequence at a time is as fast per update as the recurrent four side by side: the curve, made
  // non-decreasing, prices both at its rate).
  const ModelSpec next = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/qwen3-next-80b-a3b.json");
  const H200StepModel planner(next, {4, 4096});
  const detail::StepModel& model = planner.model;
  Partition whole, parts;
  whole.chunks = {{0, 4096, Bytes{}}};
  parts.chunks = {{0, 2048, Bytes{}}, {2048, 4096, Bytes{}}};
  for (const bool backward : {false, true}) {
    CAPTURE(backward);
    const double t_whole = model.attention_time(0, whole, backward, true), t_parts = model.attention_time(0, parts, backward, true);
    // The rule at 32 recurrences instead of 128: 1.6x the forward's time per update; with the
    // layer's memory-bound passes beside it, over 1.3x. The backward's the same per update.
    if (backward) CHECK(t_parts >= 0.999 * t_whole);
    else CHECK(t_parts > 1.3 * t_whole);
  }
}

TEST_CASE("the planner's workset for a softmax layer's query chunk is the CUDA layer's backward in chunks") {
  // The planner partitions a full-attention layer's queries (fixed bytes and bytes per query of
  // the chunk) and the CUDA layer runs its backward one query chunk at a time
  // (DecoderLayerShape::attention_chunk_tokens), holding the chunk's rows and, T-wide whatever
  // the chunk, dK/dV with their fp32 sums and d xn1. The chunk's bytes a token must be the
  // planner's per-query bytes (to the Carver's alignment); the T-wide bytes a token at least its
  // fixed bytes a token, the rest being the layer's other T-wide rows (the MoE half's d xn2,
  // routing gradients). Gated (Qwen3-Next, Qwen3.5) and not (the 5.13B configuration). The
  // planner's chunks are then equal but the last: the length the executor runs.
  for (const char* config : {"qwen3-next-80b-a3b.json", "qwen3.5-35b-a3b.json", "moe-5b.json", "qwen1.5-moe-a2.7b.json"}) {
    CAPTURE(config);
    const ModelSpec spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/" + config);
    int full = 0;
    while (spec.layer(full).attention != AttentionKind::full) ++full;
    constexpr std::int64_t T = 65536, C1 = 4096, C2 = 8192;
    const H200StepModel planner(spec, {1, static_cast<std::uint64_t>(T)});
    const WorkItem w = planner.model.attention_item(full);
    CHECK(w.dependency == ChunkDependency::causal_prefix);
    CHECK(w.per_prefix_unit.count() == 0);
    kernels::ExpertGemmStreams streams;  // creates no CUDA objects until used
    const auto workspace = [&](std::int64_t tokens, std::int64_t chunk) {
      auto shape = model::DecoderLayerShape::from_spec(spec, full, tokens);
      shape.moe_chunk_tokens = 4096;  // the MoE half's phase well below the attention's
      shape.attention_chunk_tokens = chunk;
      return static_cast<std::int64_t>(model::decoder_layer_workspace_bytes(shape, streams));
    };
    const std::int64_t per_chunk_token = static_cast<std::int64_t>(w.per_unit.count());
    const std::int64_t chunk_step = workspace(T, C2) - workspace(T, C1);
    CHECK(std::abs(chunk_step - per_chunk_token * (C2 - C1)) <= 8 * 256);
    // T-wide: twice the tokens with the same chunk (in chunks, the fp32 dK/dV sums too: split_fixed).
    REQUIRE(w.fixed.count() % T == 0);
    REQUIRE(w.split_fixed.count() % T == 0);
    const std::int64_t wide = static_cast<std::int64_t>((w.fixed + w.split_fixed).count()) / T;
    const std::int64_t t_step = workspace(2 * T, C1) - workspace(T, C1);
    // The others: d xn2 (bf16), the routing weights' gradient (fp32, k), the router logits'
    // gradient (fp32, E) and the router backward's scratch (2 bytes an expert).
    const std::int64_t others = 2 * spec.hidden_size() + 4 * static_cast<std::int64_t>(spec.moe().top_k) +
                                6 * static_cast<std::int64_t>(spec.moe().experts);
    CHECK(t_step >= wide * T);
    CHECK(t_step <= (wide + others) * T + 16 * 256);
    // Whole, the layer holds the chunk's rows for all T but not the fp32 sums of dK/dV: the
    // difference, to the Carver's alignment. With grouped keys (at least 2 query heads a key head)
    // chunks hold less; with as many key heads as query heads (Qwen1.5-MoE's 16/16) the sums (8
    // head_dim bytes a token a key head) outweigh the rows they spare (4 head_dim + 8 bytes a token
    // a query head): more.
    const std::int64_t kv = static_cast<std::int64_t>(spec.attention().kv_heads * spec.attention().head_dim);
    const std::int64_t saved = workspace(T, 0) - workspace(T, C1);
    CAPTURE(saved);
    if (spec.attention().heads >= 2 * spec.attention().kv_heads) CHECK(saved > 0);
    else CHECK(saved < 0);
    CHECK(std::abs(saved - (per_chunk_token * (T - C1) - 2 * kv * 4 * T)) <= 16 * 256);
    CHECK(static_cast<std::int64_t>(w.split_fixed.count()) == 2 * kv * 4 * T);  // the sums, held only in chunks
    // The planner's live bytes whole (no sums) and in chunks differ as the layer's workspaces do.
    const auto live = [&](std::int64_t end) { return static_cast<std::int64_t>(live_bytes(w, 0, static_cast<std::uint64_t>(end)).count()); };
    CHECK(std::abs((workspace(T, 0) - live(T)) - (workspace(T, C1) - live(C1))) <= 16 * 256);
    // With as many key heads as query heads no split weighs less than the whole sequence: the
    // planner keeps it whole at any budget it fits, as the fit does (test_cuda_footprint).
    if (saved < 0) {
      CHECK(DependencyPartitioner::min_budget(w) == live_bytes(w, 0, static_cast<std::uint64_t>(T)));
      CHECK(DependencyPartitioner{}.partition(w, DependencyPartitioner::min_budget(w)).chunks.size() == 1);
      continue;
    }
    // Partitioned for a budget that takes a few chunks: equal ones, the last shorter, each within it.
    const Bytes budget = w.fixed + w.split_fixed + Bytes{static_cast<std::uint64_t>(per_chunk_token) * 20000};
    const auto part = DependencyPartitioner{}.partition(w, budget);
    REQUIRE(part.chunks.size() > 2);
    for (std::size_t i = 0; i + 1 < part.chunks.size(); ++i) CHECK(part.chunks[i].end - part.chunks[i].begin == part.chunks[0].end);
    CHECK(part.chunks.back().end == static_cast<std::uint64_t>(T));
    CHECK(part.peak <= budget);
  }
}

TEST_CASE("CudaRouterBalance's composition is transformers' loss: global counts and coef x scale / L^2 through the per-layer formula") {
  // What the GPU path computes, in the CPU references its kernels match (test_moe_kernels): each
  // layer's router_backward with the micro-batch's counts over every layer and aux_loss_grad(),
  // and router_aux_loss over the layers' rows stacked with those counts. Against RouterBalanceLoss
  // (the host layer's, checked against transformers): the same loss and the same d logits.
  constexpr int L = 3;
  constexpr std::int64_t T = 37, E = 8, K = 2;
  const double coef = 0.5, scale = 0.5;  // 2 micro-batches
  const reference::RouterShape rs{.tokens = T, .hidden = 4, .experts = E, .top_k = K, .norm_topk_prob = true};
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  RouterBalanceLoss host(L, E, K, coef, scale);
  std::vector<reference::RouterForward> layers;
  std::vector<std::vector<float>> d_weights;
  std::vector<std::int32_t> counts(E, 0);
  std::vector<float> all_probs;
  for (int l = 0; l < L; ++l) {
    std::vector<float> logits(T * E), dw(T * K);
    for (auto& v : logits) v = 2.0f * normal(rng);
    for (auto& v : dw) v = normal(rng);
    layers.push_back(reference::router_select(rs, logits));
    d_weights.push_back(dw);
    host.add(l, 0, layers.back().probs, layers.back().expert_ids);
    for (const auto e : layers.back().expert_ids) ++counts[static_cast<std::size_t>(e)];
    all_probs.insert(all_probs.end(), layers.back().probs.begin(), layers.back().probs.end());
  }
  int buffer = 0;
  const model::CudaRouterBalance balance(L, E, K, T, coef, scale, &buffer, model::CudaRouterBalance::device_bytes(E, T));
  reference::RouterShape stacked = rs;
  stacked.tokens = L * T;
  CHECK(coef * scale * reference::router_aux_loss(stacked, all_probs, counts) == doctest::Approx(host.loss()).epsilon(1e-12));
  for (int l = 0; l < L; ++l) {
    CAPTURE(l);
    const auto& f = layers[static_cast<std::size_t>(l)];
    const auto gpu_way = reference::router_logits_backward(rs, f.probs, f.expert_ids, d_weights[static_cast<std::size_t>(l)], counts,
                                                           balance.aux_loss_grad());
    const auto host_way =
        reference::router_logits_backward(rs, f.probs, f.expert_ids, d_weights[static_cast<std::size_t>(l)], host.probability_gradient());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < gpu_way.size(); ++i) {
      num += (static_cast<double>(gpu_way[i]) - host_way[i]) * (static_cast<double>(gpu_way[i]) - host_way[i]);
      den += static_cast<double>(host_way[i]) * host_way[i];
    }
    CHECK(std::sqrt(num / den) <= 1e-6);  // fp32 arithmetic on both sides
  }
  // The aux term alone (zero d weights), where a wrong scale shows undiluted: aux_loss_grad without
  // its 1 / L^2 would be L^2 times transformers' gradient, the layer's own counts about 1 / L.
  const std::vector<float> zero(T * K, 0.0f);
  const auto& f = layers[0];
  const auto aux_only = reference::router_logits_backward(rs, f.probs, f.expert_ids, zero, counts, balance.aux_loss_grad());
  const auto aux_host = reference::router_logits_backward(rs, f.probs, f.expert_ids, zero, host.probability_gradient());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < aux_only.size(); ++i) {
    num += (static_cast<double>(aux_only[i]) - aux_host[i]) * (static_cast<double>(aux_only[i]) - aux_host[i]);
    den += static_cast<double>(aux_host[i]) * aux_host[i];
  }
  CHECK(den > 0);
  CHECK(std::sqrt(num / den) <= 1e-5);
}
