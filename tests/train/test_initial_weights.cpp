// oom-train's initial weights (examples/train/host_lm.cpp): transformers' init (N(0, 0.02)
// matrices, norms at the identity scale), the same bits for a seed on every machine and in every version (a run's
// resume and a comparison across builds depend on it), whether made whole or segment by segment
// in any order.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/model/model_spec.hpp"
#include "train/host_lm.hpp"

using namespace oom;

namespace {

ModelSpec tiny() { return ModelSpec::from_file(std::filesystem::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json"); }

// FNV-1a over the values' bits, segment after segment.
std::uint64_t fingerprint(const std::vector<std::vector<float>>& w) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& seg : w)
    for (const float f : seg) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof bits);
      for (int b = 0; b < 4; ++b) h = (h ^ ((bits >> (8 * b)) & 0xffu)) * 1099511628211ull;
    }
  return h;
}

}  // namespace

TEST_CASE("the initial weights of a seed are fixed bits; made segment by segment in any order, the same") {
  const auto spec = tiny();
  const auto whole = train::initial_weights(spec, 0);
  // The value every version since the first has made (checked against the code before the
  // weights went segment by segment, 2026-12-03): changing it changes every run's start.
  CHECK(fingerprint(whole) == 0x77b2a076f00fd9e0ull);
  CHECK(fingerprint(train::initial_weights(spec, 1)) != fingerprint(whole));

  const auto source = train::initial_weight_source(spec, 0);
  for (std::size_t k = 0; k < whole.size(); ++k) {
    const std::size_t s = whole.size() - 1 - k;  // the last first
    CAPTURE(spec.segments()[s].name);
    std::vector<float> got(spec.segments()[s].parameters(), -1.0f);
    source(s, got);
    CHECK(std::memcmp(got.data(), whole[s].data(), got.size() * sizeof(float)) == 0);
  }

  // Norm weights 1; every matrix N(0, 0.02) (its sample mean and deviation, over all of them).
  double sum = 0, sq = 0;
  std::uint64_t n = 0;
  for (std::size_t s = 0; s < whole.size(); ++s) {
    std::uint64_t at = 0;
    for (const auto& t : spec.segments()[s].tensors) {
      const bool norm = t.name.ends_with("norm.weight");
      for (std::uint64_t i = 0; i < t.elements(); ++i) {
        const float v = whole[s][at + i];
        if (norm) {
          REQUIRE(v == 1.0f);
        } else {
          sum += v;
          sq += static_cast<double>(v) * v;
          ++n;
        }
      }
      at += t.elements();
    }
  }
  REQUIRE(n > 100000);
  CHECK(std::abs(sum / static_cast<double>(n)) < 2e-4);
  CHECK(std::sqrt(sq / static_cast<double>(n)) == doctest::Approx(0.02).epsilon(0.01));

  // Wrong spans and segments the model does not have are named.
  std::vector<float> small(3);
  CHECK_THROWS_WITH_AS(source(1, small), doctest::Contains(spec.segments()[1].name.c_str()), Error);
  CHECK_THROWS_WITH_AS(source(whole.size(), small), doctest::Contains(fmt::format("segment {} of a model of {}", whole.size(), whole.size()).c_str()), Error);
}

TEST_CASE("norm weights start at the identity scale: 1, or 0 for Qwen3-Next's (1 + w) norms, 1 for its gated norm") {
  const auto next = ModelSpec::from_file(std::filesystem::path(OOM_SOURCE_DIR) / "examples/configs/qwen3-next-80b-a3b.json");
  REQUIRE(next.zero_centred_norms());
  const auto source = train::initial_weight_source(next, 0);
  // Layer 0 (linear attention) and layer 3 (full attention): every norm tensor in their segments.
  int seen_zero = 0, seen_one = 0;
  for (std::size_t s = 0; s < next.segments().size(); ++s) {
    const auto& seg = next.segments()[s];
    if (seg.layer != 0 && seg.layer != 3 && seg.layer != -1) continue;
    bool has_norm = false;
    for (const auto& t : seg.tensors) has_norm = has_norm || t.name.ends_with("norm.weight");
    if (!has_norm) continue;
    std::vector<float> w(seg.parameters());
    source(s, w);
    std::uint64_t off = 0;
    for (const auto& t : seg.tensors) {
      if (t.name.ends_with("norm.weight")) {
        CAPTURE(t.name);
        const float want = t.name.find("linear_attn.norm") != std::string::npos ? 1.0f : 0.0f;
        CHECK(next.norm_weight_offset(t.name) == 1.0f - want);
        std::uint64_t other = 0;
        for (std::uint64_t i = 0; i < t.elements(); ++i) other += w[off + i] != want;
        CHECK(other == 0);
        (want == 0.0f ? seen_zero : seen_one) += 1;
      }
      off += t.elements();
    }
  }
  CHECK(seen_zero >= 6);  // input and post-attention norms of two layers, q and k norms, the final norm
  CHECK(seen_one == 1);   // layer 0's gated norm
  // Another family's norms are plain: no offset, initialised to 1.
  CHECK_FALSE(tiny().zero_centred_norms());
  CHECK(tiny().norm_weight_offset("model.layers.0.input_layernorm.weight") == 0.0f);
}

TEST_CASE("a Gated DeltaNet's decay parameters start as transformers': dt_bias 1, A_log = log U(0.01, 16) per value head") {
  const auto next = ModelSpec::from_file(std::filesystem::path(OOM_SOURCE_DIR) / "examples/configs/qwen3-next-80b-a3b.json");
  const auto source = train::initial_weight_source(next, 7);
  const auto& seg = next.layer_segments(0)[0];  // layer 0's linear attention
  REQUIRE(seg.role == SegmentRole::linear_attention);
  const std::size_t s = static_cast<std::size_t>(&seg - next.segments().data());
  std::vector<float> w(seg.parameters());
  source(s, w);
  std::uint64_t off = 0;
  int seen = 0;
  for (const auto& t : seg.tensors) {
    CAPTURE(t.name);
    const std::span<const float> v(w.data() + off, t.elements());
    if (t.name.ends_with("dt_bias")) {
      CHECK(std::all_of(v.begin(), v.end(), [](float x) { return x == 1.0f; }));
      ++seen;
    } else if (t.name.ends_with("A_log")) {
      // 32 heads: every value in [log 0.01, log 16], their decay rates exp(A_log) spread across
      // orders of magnitude (a matrix's N(0, 0.02) would put them all near 1), no two equal.
      const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
      CHECK(*lo >= std::log(0.01f));
      CHECK(*hi <= std::log(16.0f));
      CHECK(*hi - *lo > 2.0f);
      CHECK(std::set<float>(v.begin(), v.end()).size() == v.size());
      ++seen;
    }
    off += t.elements();
  }
  CHECK(seen == 2);
  // Another seed, other rates.
  std::vector<float> other(seg.parameters());
  train::initial_weight_source(next, 8)(s, other);
  CHECK(other != w);
}
