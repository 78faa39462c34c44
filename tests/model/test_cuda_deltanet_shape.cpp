// The Gated DeltaNet block's shape from a model spec and its sizes (no GPU needed): the segment
// it binds is exactly the spec's linear_attention segment, and what it is not given is refused.
#include <doctest/doctest.h>

#include <string>

#include "oom/core/error.hpp"
#include "oom/model/cuda_deltanet.hpp"
#include "oom/model/model_spec.hpp"

using namespace oom;

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
