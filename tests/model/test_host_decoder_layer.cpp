// HostDecoderLayer: the forward against a naive fp64 transcription of transformers'
// Qwen3MoeDecoderLayer, the backward against central differences, bit-identical results for any
// chunking and any recompute, bit-identical training through the HostExecutor for random plans,
// and the unsupported features named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/model/host_decoder_layer.hpp"
#include "oom/model/router_balance.hpp"
#include "oom/plan/policies.hpp"
#include "oom/runtime/host_executor.hpp"
#include "support/compare.hpp"

using namespace oom;
using namespace oom::literals;

namespace {

ModelSpec tiny_spec(bool norm_topk = true, int layers = 1, std::uint64_t hidden = 16, std::uint64_t experts = 4) {
  return ModelSpec::from_json(Json::parse(fmt::format(
      R"({{"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": {}, "intermediate_size": 32,
          "moe_intermediate_size": 8, "num_hidden_layers": {}, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 4, "num_experts": {}, "num_experts_per_tok": 2, "norm_topk_prob": {}, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0}})",
      hidden, layers, experts, norm_topk ? "true" : "false")));
}

/// A model config among the tests' data or the examples' (a path from the source tree's root).
ModelSpec data_spec(const std::string& file) { return ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/" + file); }

bool is_norm(const TensorSpec& t) { return t.name.find("norm") != std::string::npos; }

/// Weights on a grid that bf16 holds exactly, with room for the finite-difference step: matrix
/// entries are multiples of 2^-9 with |w| <= 0.48 (at most 8 significant bits below 0.5), norm
/// scales multiples of 2^-8 in [0.55, 0.95] (bf16's spacing in [0.5, 1)), stored less the
/// norm's offset (a (1 + w) norm stores [-0.45, -0.05], as exact). w +- 2^-7 stays on the grid,
/// so the perturbed weights are exactly what the layer reads.
std::vector<std::vector<bf16>> grid_weights(const ModelSpec& spec, const HostDecoderLayer& layer, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.25);
  std::uniform_real_distribution<double> uniform(0.55, 0.95);
  std::vector<std::vector<bf16>> w;
  for (const auto& seg : layer.segments()) {
    std::vector<bf16> v;
    for (const auto& t : seg.tensors)
      for (std::uint64_t i = 0; i < t.elements(); ++i) {
        const double x = is_norm(t) ? std::round(uniform(rng) * 256) / 256 - spec.norm_weight_offset(t.name)
                                    : std::round(std::clamp(normal(rng), -0.48, 0.48) * 512) / 512;
        v.push_back(to_bf16(static_cast<float>(x)));
        REQUIRE(static_cast<double>(to_float(v.back())) == x);
      }
    w.push_back(std::move(v));
  }
  return w;
}

struct Run {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
  std::array<std::vector<float>, activation_class_count> saved;
};

LayerContext bind(const std::vector<std::vector<bf16>>& w, std::vector<std::vector<float>>& grads, std::uint64_t t,
                      std::uint64_t sequences = 1) {
  LayerContext ctx;
  for (const auto& s : w) ctx.weights.emplace_back(s.data(), s.size());
  for (auto& g : grads) ctx.weight_grads.emplace_back(g.data(), g.size());
  ctx.tokens = t;
  ctx.sequences = sequences;
  return ctx;
}

template <class F>
void chunks(std::uint64_t t, std::uint64_t chunk, const LayerContext& ctx, F&& call) {
  for (std::uint64_t b = 0; b < t; b += chunk) {
    LayerContext c = ctx;
    c.begin = b;
    c.end = std::min(t, b + chunk);
    call(c);
  }
}

/// Forward (and backward with grad_output `dy` when given) over chunks of `chunk` tokens, the t
/// tokens being `sequences` sequences.
Run run(HostDecoderLayer& layer, const std::vector<std::vector<bf16>>& w, const std::vector<float>& x,
        const std::vector<float>* dy, std::uint64_t t, std::uint64_t chunk, std::uint64_t backward_chunk = 0,
        std::uint64_t sequences = 1) {
  Run r;
  const auto h = layer.hidden();
  for (const auto& s : w) r.grads.emplace_back(s.size(), 0.0f);
  LayerContext ctx = bind(w, r.grads, t, sequences);
  r.y.assign(t * h, NAN);
  ctx.input = x.data();
  ctx.output = r.y.data();
  for (int c = 1; c < activation_class_count; ++c) {
    const auto n = layer.saved_floats(static_cast<ActivationClass>(c), t);
    if (n == 0) continue;
    r.saved[static_cast<std::size_t>(c)].assign(n, NAN);
    ctx.saved[static_cast<std::size_t>(c)] = r.saved[static_cast<std::size_t>(c)].data();
  }
  chunks(t, chunk, ctx, [&](LayerContext& c) { layer.forward(c); });
  if (dy != nullptr) {
    r.dx.assign(t * h, NAN);
    ctx.output = nullptr;
    ctx.grad_output = dy->data();
    ctx.grad_input = r.dx.data();
    chunks(t, backward_chunk ? backward_chunk : chunk, ctx, [&](LayerContext& c) { layer.backward(c); });
  }
  return r;
}

std::vector<std::int32_t> expert_ids(const HostDecoderLayer& layer, const Run& r, std::uint64_t t, std::uint64_t experts) {
  const auto& router = r.saved[static_cast<std::size_t>(ActivationClass::router_output)];
  const auto k = (layer.saved_floats(ActivationClass::router_output, 1) - experts) / 2;
  std::vector<std::int32_t> ids;
  for (std::uint64_t i = 0; i < t * k; ++i) ids.push_back(static_cast<std::int32_t>(router[t * experts + i]));
  return ids;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- a naive fp64 transcription of transformers' Qwen3MoeDecoderLayer.forward -----------------

std::vector<double> naive_forward(const ModelSpec& spec, const std::vector<std::vector<bf16>>& wb, const std::vector<float>& xf,
                                  std::uint64_t T) {
  const auto H = spec.hidden_size();
  const auto& a = spec.attention();
  const auto& m = spec.moe();
  const std::uint64_t nh = a.heads, nkv = a.kv_heads, D = a.head_dim, q = nh * D, kv = nkv * D, E = m.experts, I = m.expert_intermediate;
  const double eps = spec.rms_norm_eps();
  auto W = [&](std::size_t s, std::size_t i) { return static_cast<double>(to_float(wb[s][i])); };
  auto rms = [&](const double* x, std::size_t n, std::size_t s, std::size_t off, double* out) {
    double ss = 0;
    for (std::size_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    for (std::size_t i = 0; i < n; ++i) out[i] = W(s, off + i) * (x[i] * r);
  };
  auto linear = [&](const double* x, std::size_t in, std::size_t out_n, std::size_t s, std::size_t off, double* out) {
    for (std::size_t o = 0; o < out_n; ++o) {
      double acc = 0;
      for (std::size_t i = 0; i < in; ++i) acc += W(s, off + o * in + i) * x[i];
      out[o] = acc;
    }
  };
  std::vector<double> x(xf.begin(), xf.end()), xn(T * H), Q(T * q), K(T * kv), V(T * kv);
  for (std::size_t t = 0; t < T; ++t) {
    rms(&x[t * H], H, 1, 0, &xn[t * H]);
    linear(&xn[t * H], H, q, 0, 0, &Q[t * q]);
    linear(&xn[t * H], H, kv, 0, q * H, &K[t * kv]);
    linear(&xn[t * H], H, kv, 0, (q + kv) * H, &V[t * kv]);
  }
  const std::size_t o_off = (q + 2 * kv) * H, qn_off = o_off + H * q, kn_off = qn_off + D;
  auto norm_rope = [&](std::vector<double>& X, std::size_t heads, std::size_t norm_off) {
    std::vector<double> tmp(D);
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t h = 0; h < heads; ++h) {
        double* v = &X[(t * heads + h) * D];
        rms(v, D, 0, norm_off, tmp.data());
        for (std::size_t j = 0; j < D / 2; ++j) {
          // HF: inv_freq = 1 / theta^(arange(0, D, 2) / D) in fp32, freqs = position * inv_freq in fp32.
          const float inv = static_cast<float>(1.0 / std::pow(spec.rope_theta(), static_cast<double>(2 * j) / static_cast<double>(D)));
          const double ang = static_cast<float>(static_cast<float>(t) * inv);
          const double c = std::cos(ang), s = std::sin(ang);
          v[j] = tmp[j] * c - tmp[j + D / 2] * s;
          v[j + D / 2] = tmp[j + D / 2] * c + tmp[j] * s;
        }
      }
  };
  norm_rope(Q, nh, qn_off);
  norm_rope(K, nkv, kn_off);
  std::vector<double> ctx(T * q, 0.0), hres(T * H);
  for (std::size_t h = 0; h < nh; ++h) {
    const std::size_t g = h / (nh / nkv);
    for (std::size_t i = 0; i < T; ++i) {
      std::vector<double> s(i + 1);
      double mx = -INFINITY;
      for (std::size_t j = 0; j <= i; ++j) {
        double d = 0;
        for (std::size_t c = 0; c < D; ++c) d += Q[(i * nh + h) * D + c] * K[(j * nkv + g) * D + c];
        s[j] = d / std::sqrt(static_cast<double>(D));
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (std::size_t j = 0; j <= i; ++j)
        for (std::size_t c = 0; c < D; ++c) ctx[(i * nh + h) * D + c] += s[j] / sum * V[(j * nkv + g) * D + c];
    }
  }
  std::vector<double> y(T * H), xn2(H), logits(E), gate(I), up(I), down(H);
  for (std::size_t t = 0; t < T; ++t) {
    linear(&ctx[t * q], q, H, 0, o_off, &hres[t * H]);
    for (std::size_t c = 0; c < H; ++c) hres[t * H + c] += x[t * H + c];
    rms(&hres[t * H], H, 1, H, xn2.data());
    linear(xn2.data(), H, E, 2, 0, logits.data());
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    std::vector<double> p(E);
    for (std::size_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - mx));
    for (auto& v : p) v /= sum;
    std::vector<std::size_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](auto l, auto r) { return p[l] > p[r]; });
    double sel = 0;
    for (std::size_t j = 0; j < m.top_k; ++j) sel += p[order[j]];
    for (std::size_t c = 0; c < H; ++c) y[t * H + c] = hres[t * H + c];
    for (std::size_t j = 0; j < m.top_k; ++j) {
      const std::size_t e = order[j];
      const double w = m.norm_topk_prob ? p[e] / sel : p[e];
      linear(xn2.data(), H, I, 3 + e, 0, gate.data());
      linear(xn2.data(), H, I, 3 + e, I * H, up.data());
      for (std::size_t i = 0; i < I; ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      linear(gate.data(), I, H, 3 + e, 2 * I * H, down.data());
      for (std::size_t c = 0; c < H; ++c) y[t * H + c] += w * down[c];
    }
  }
  return y;
}

}  // namespace

TEST_CASE("the forward is transformers' Qwen3MoeDecoderLayer") {
  for (const bool norm_topk : {true, false}) {
    const ModelSpec spec = tiny_spec(norm_topk);
    HostDecoderLayer layer(spec, 0);
    CHECK(std::equal(layer.segments().begin(), layer.segments().end(), spec.layer_segments(0).begin(), spec.layer_segments(0).end()));
    const std::uint64_t T = 9;
    const auto w = grid_weights(spec, layer, 11);
    const auto x = test::random_normal(T * layer.hidden(), 12);
    const auto got = run(layer, w, x, nullptr, T, T).y;
    const auto want = naive_forward(spec, w, x, T);
    const auto report = test::compare(got, want, 2e-5, 2e-5, "y");
    CAPTURE(norm_topk);
    INFO(report.first);
    CHECK(report.ok());
  }
}

namespace {

/// Checks HostDecoderLayer against a fixture of PyTorch's autograd through transformers' layers
/// (scripts/make_hybrid_layer_fixture.py, scripts/make_moe_family_fixture.py): per family prefix
/// and config, each of `layers`, on 2 sequences of 9 tokens, weights bf16 values. Tolerance as
/// test_gated_delta_ref's (PyTorch's own fp32 rounding): 1e-4 relative plus 1e-5 of the tensor's
/// largest magnitude.
void check_against_torch(const std::string& fixture, const std::vector<std::pair<std::string, std::string>>& families,
                         const std::vector<int>& layers) {
  const SafetensorsFile file = SafetensorsFile::open(std::string(OOM_SOURCE_DIR) + "/tests/data/" + fixture);
  auto fp32 = [&](const TensorSpec& t) {
    DType dtype{};
    const auto bytes = file.tensor_bytes(t, &dtype);
    REQUIRE(dtype == DType::fp32);
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  };
  auto plain = [&](const std::string& name) {
    const auto& t = file.at(name);
    return fp32(TensorSpec{name, t.shape});
  };
  auto check = [](const std::vector<float>& ours, const std::vector<float>& theirs, const std::string& what) {
    double scale = 0;
    for (float v : theirs) scale = std::max(scale, static_cast<double>(std::abs(v)));
    const auto r = test::compare(ours, theirs, 1e-4, std::max(1e-5, 1e-5 * scale), what.c_str());
    INFO(what << ": max abs err " << r.max_abs_err << " (scale " << scale << ")\n" << r.first);
    CHECK(r.checked == theirs.size());
    CHECK(r.ok());
  };
  const std::uint64_t B = 2, S = 9, T = B * S;
  for (const auto& [family, config] : families)
    for (const int index : layers) {
      CAPTURE(family);
      CAPTURE(index);
      const ModelSpec spec = data_spec(config);
      HostDecoderLayer layer(spec, index);
      const std::string prefix = fmt::format("{}.{}.", family, index), within = fmt::format("layers.{}.", index);
      // Each tensor under the fixture's name: the checkpoint's, from the layer's own prefix on.
      auto fixture_spec = [&](const TensorSpec& t, const char* kind) {
        TensorSpec f = t;
        f.name = prefix + kind + t.name.substr(t.name.find(within) + within.size());
        return f;
      };
      std::vector<std::vector<bf16>> w;
      for (const auto& seg : layer.segments()) {
        std::vector<bf16> v;
        for (const auto& t : seg.tensors) {
          DType dtype{};
          const auto bytes = file.tensor_bytes(fixture_spec(t, "w."), &dtype);
          REQUIRE(dtype == DType::bf16);
          const auto* p = reinterpret_cast<const bf16*>(bytes.data());
          v.insert(v.end(), p, p + bytes.size() / sizeof(bf16));
        }
        REQUIRE(v.size() == seg.parameters());
        w.push_back(std::move(v));
      }
      const auto x = plain(prefix + "x"), dy = plain(prefix + "dy");
      REQUIRE(x.size() == T * layer.hidden());
      // Chunks of 5 forward and 4 backward cross the sequences' boundary.
      const Run r = run(layer, w, x, &dy, T, 5, 4, B);
      check(r.y, plain(prefix + "y"), "y");
      check(r.dx, plain(prefix + "dx"), "dx");
      for (std::size_t s = 0; s < w.size(); ++s) {
        std::uint64_t offset = 0;
        for (const auto& t : layer.segments()[s].tensors) {
          const std::vector<float> ours(r.grads[s].begin() + static_cast<std::ptrdiff_t>(offset),
                                        r.grads[s].begin() + static_cast<std::ptrdiff_t>(offset + t.elements()));
          check(ours, fp32(fixture_spec(t, "g.")), "d " + t.name);
          offset += t.elements();
        }
      }
    }
}

}  // namespace

TEST_CASE("Qwen3-Next's and Qwen3.5's layers are transformers': outputs and every gradient") {
  // tests/data/hybrid_layers_torch.safetensors: Qwen3NextDecoderLayer and Qwen3_5MoeDecoderLayer,
  // a Gated DeltaNet layer (0) and a gated full-attention layer (3) of each.
  check_against_torch("hybrid_layers_torch.safetensors",
                      {{"next", "tests/data/tiny-qwen3-next-layers.json"}, {"q35", "tests/data/tiny-qwen3.5-moe.json"}}, {0, 3});
}

TEST_CASE("Mixtral's, OLMoE's and Qwen2-MoE's layers are transformers': outputs and every gradient") {
  // tests/data/moe_families_torch.safetensors: MixtralDecoderLayer (no q/k norm, experts w1/w3/w2),
  // OlmoeDecoderLayer (q/k RMSNorm over the whole projection, top-k weights not renormalised) and
  // Qwen2MoeDecoderLayer (q/k/v biases, a shared expert with a sigmoid gate).
  check_against_torch("moe_families_torch.safetensors",
                      {{"mixtral", "examples/configs/tiny-mixtral.json"},
                       {"olmoe", "examples/configs/tiny-olmoe.json"},
                       {"qwen2", "examples/configs/tiny-qwen2-moe.json"}},
                      {0, 1});
}

TEST_CASE("several sequences in one pass: each sequence's outputs as if it ran alone, the weight gradients their sum") {
  const ModelSpec spec = tiny_spec();
  HostDecoderLayer layer(spec, 0);
  const auto h = layer.hidden();
  constexpr std::uint64_t S = 7, B = 3, T = S * B;
  const auto w = grid_weights(spec, layer, 31);
  const auto x = test::random_normal(T * h, 32);
  const auto dy = test::random_normal(T * h, 33);
  // Chunks of 5 tokens cross the sequences' boundaries; so does the backward's 4.
  const Run all = run(layer, w, x, &dy, T, 5, 4, B);
  std::vector<std::vector<double>> sum;
  for (const auto& g : all.grads) sum.emplace_back(g.size(), 0.0);
  for (std::uint64_t b = 0; b < B; ++b) {
    CAPTURE(b);
    const auto rows = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(b * S * h), v.begin() + static_cast<std::ptrdiff_t>((b + 1) * S * h));
    };
    const auto xb = rows(x), dyb = rows(dy);
    const Run alone = run(layer, w, xb, &dyb, S, S);
    // Every row is its own fixed sequence of operations: the same bits.
    CHECK(same_bits(rows(all.y), alone.y));
    CHECK(same_bits(rows(all.dx), alone.dx));
    for (std::size_t s = 0; s < sum.size(); ++s)
      for (std::size_t i = 0; i < sum[s].size(); ++i) sum[s][i] += alone.grads[s][i];
  }
  // A weight gradient adds over all T tokens in order; the separate runs' sum rounds elsewhere.
  for (std::size_t s = 0; s < sum.size(); ++s) {
    const auto report = test::compare(all.grads[s], sum[s], 1e-5, 1e-5, "weight gradient");
    INFO(report.first);
    CHECK(report.ok());
  }
  // The same tokens as one sequence: later rows attend across, at other positions.
  HostDecoderLayer fresh(spec, 0);
  const Run joined = run(fresh, w, x, &dy, T, T);
  CHECK(std::equal(joined.y.begin(), joined.y.begin() + static_cast<std::ptrdiff_t>(S * h), all.y.begin()));
  CHECK_FALSE(std::equal(joined.y.begin() + static_cast<std::ptrdiff_t>(S * h), joined.y.end(), all.y.begin() + static_cast<std::ptrdiff_t>(S * h)));
  // One layer object, the same T split one way and then the other: its positions follow.
  CHECK(same_bits(run(layer, w, x, &dy, T, T).y, joined.y));
  CHECK(same_bits(run(layer, w, x, &dy, T, 5, 4, B).y, all.y));
  // A pass whose chunks disagree on the split is refused, naming both.
  {
    std::vector<std::vector<float>> grads;
    for (const auto& s : w) grads.emplace_back(s.size(), 0.0f);
    std::vector<float> y(T * h);
    LayerContext ctx = bind(w, grads, T, B);
    ctx.input = x.data();
    ctx.output = y.data();
    Run dummy;
    for (int c = 1; c < activation_class_count; ++c) {
      const auto n = layer.saved_floats(static_cast<ActivationClass>(c), T);
      dummy.saved[static_cast<std::size_t>(c)].assign(n, 0.0f);
      if (n > 0) ctx.saved[static_cast<std::size_t>(c)] = dummy.saved[static_cast<std::size_t>(c)].data();
    }
    ctx.begin = 0;
    ctx.end = 5;
    layer.forward(ctx);
    ctx.begin = 5;
    ctx.end = T;
    ctx.sequences = 1;
    CHECK_THROWS_WITH_AS(layer.forward(ctx), doctest::Contains("of 21 tokens in 1 sequence(s) does not continue the pass (expected begin 5 of 21 tokens in 3)"), Error);
  }
  // Tokens that do not split into the sequences are refused, naming both.
  HostDecoderLayer other(spec, 0);
  CHECK_THROWS_WITH_AS(run(other, w, x, nullptr, T, T, 0, 4), doctest::Contains("21 tokens are not a whole number of sequences = 4"), Error);
}

TEST_CASE("backward against central differences of L = sum(y * g) (+ the load-balancing loss)") {
  // Finite differences in the weights need perturbed weights that bf16 holds exactly: the weights
  // are drawn on a grid (see grid_weights) on which w +- 2^-7 is representable, so L(w +- eps) is
  // the layer's exact fp32 function of the perturbed weight, not of a rounded one. L is summed in
  // fp64 from the fp32 outputs; its rounding (~1e-6) over 2 eps bounds the difference quotient's
  // noise near 1e-4, the truncation error is ~eps^2/6 |L'''|. A perturbation that flips a top-k
  // choice makes L jump; those samples are detected (the chosen experts differ) and skipped.
  // With the load-balancing loss (RouterBalanceLoss, coefficient 0.5) L adds its value: its
  // gradient reaches the router's weights, the norms and x through the probabilities.
  for (const auto& [norm_topk, balanced] : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}}) {
    CAPTURE(norm_topk);
    CAPTURE(balanced);
    const ModelSpec spec = tiny_spec(norm_topk);
    HostDecoderLayer layer(spec, 0);
    RouterBalanceLoss balance(1, spec.moe().experts, spec.moe().top_k, 0.5);
    if (balanced) layer.balance_router(&balance);
    const std::uint64_t T = 7, H = layer.hidden(), E = spec.moe().experts;
    auto w = grid_weights(spec, layer, 21);
    auto x = test::random_normal(T * H, 22);
    const auto g = test::random_normal(T * H, 23);
    const Run base = run(layer, w, x, &g, T, T);
    const auto base_ids = expert_ids(layer, base, T, E);
    auto loss = [&](bool& flipped) {
      const Run r = run(layer, w, x, nullptr, T, T);
      flipped = flipped || expert_ids(layer, r, T, E) != base_ids;
      double l = balanced ? balance.loss() : 0.0;
      for (std::size_t i = 0; i < r.y.size(); ++i) l += static_cast<double>(r.y[i]) * g[i];
      return l;
    };
    int checked = 0, skipped = 0;
    double max_err = 0;
    auto check = [&](float& value, double analytic, auto perturb, const std::string& what) {
      const float saved = value;
      bool flipped = false;
      const float up = perturb(saved, +1), down = perturb(saved, -1);
      value = up;
      const double lp = loss(flipped);
      value = down;
      const double lm = loss(flipped);
      value = saved;
      if (flipped) {
        ++skipped;
        return;
      }
      const double fd = (lp - lm) / (static_cast<double>(up) - static_cast<double>(down));
      ++checked;
      max_err = std::max(max_err, std::abs(fd - analytic));
      INFO(what << ": analytic " << analytic << " vs finite difference " << fd);
      CHECK(std::abs(fd - analytic) <= 1e-3 + 1e-2 * std::abs(analytic));
    };
    // The input.
    for (std::size_t i = 0; i < x.size(); i += 3)
      check(x[i], base.dx[i], [](float v, int s) { return v + static_cast<float>(s) * 0.01f; }, fmt::format("dx[{}]", i));
    // Every parameter tensor: all of a small one, a sample of a large one.
    std::mt19937_64 rng(24);
    for (std::size_t s = 0; s < w.size(); ++s) {
      std::uint64_t offset = 0;
      for (const auto& t : layer.segments()[s].tensors) {
        const std::uint64_t n = t.elements();
        std::vector<std::uint64_t> idx;
        if (n <= 16) {
          idx.resize(n);
          std::iota(idx.begin(), idx.end(), 0);
        } else {
          for (int i = 0; i < 12; ++i) idx.push_back(rng() % n);
        }
        for (auto i : idx) {
          // The layer reads bf16: write the perturbed value, exact on the grid, into the element.
          auto& slot = w[s][offset + i];
          const double analytic = base.grads[s][offset + i];
          const float eps = 1.0f / 128;
          auto perturb = [&](float val, int sign) {
            const float p = val + static_cast<float>(sign) * eps;
            REQUIRE(to_float(to_bf16(p)) == p);
            return p;
          };
          const float saved = to_float(slot);
          bool flipped = false;
          slot = to_bf16(perturb(saved, +1));
          const double lp = loss(flipped);
          slot = to_bf16(perturb(saved, -1));
          const double lm = loss(flipped);
          slot = to_bf16(saved);
          if (flipped) {
            ++skipped;
            continue;
          }
          const double fd = (lp - lm) / (2.0 * eps);
          ++checked;
          max_err = std::max(max_err, std::abs(fd - analytic));
          INFO(t.name << "[" << i << "]: analytic " << analytic << " vs finite difference " << fd);
          CHECK(std::abs(fd - analytic) <= 1e-3 + 1e-2 * std::abs(analytic));
        }
        offset += n;
      }
    }
    MESSAGE("norm_topk_prob " << norm_topk << std::string(balanced ? ", load-balancing loss" : "") << ": " << checked << " derivatives checked, " << skipped
                              << " skipped (top-k flipped), max |error| " << max_err);
    CHECK(skipped * 10 < checked);
  }
}

TEST_CASE("any chunking and any recompute give the same bits (Qwen3-MoE, both hybrid families' linear and gated full attention, "
          "Mixtral, OLMoE; with the load-balancing loss)") {
  struct Case {
    std::string name;
    ModelSpec spec;
    int layer;
    bool balanced = false;
  };
  const std::vector<Case> cases = {{"qwen3_moe", tiny_spec(true, 1, 16, 8), 0},
                                   {"qwen3_next linear", data_spec("tests/data/tiny-qwen3-next-layers.json"), 0},
                                   {"qwen3_next full", data_spec("tests/data/tiny-qwen3-next-layers.json"), 3},
                                   {"qwen3_5_moe linear", data_spec("tests/data/tiny-qwen3.5-moe.json"), 0},
                                   {"qwen3_5_moe full", data_spec("tests/data/tiny-qwen3.5-moe.json"), 3},
                                   {"mixtral", data_spec("examples/configs/tiny-mixtral.json"), 1},
                                   {"olmoe", data_spec("examples/configs/tiny-olmoe.json"), 0},
                                   {"qwen2_moe", data_spec("examples/configs/tiny-qwen2-moe.json"), 1},
                                   {"mixtral, load-balancing loss", data_spec("examples/configs/tiny-mixtral.json"), 0, true}};
  for (const auto& [name, spec, index, balanced] : cases)
  for (const std::uint64_t T : {7u, 23u}) {
    CAPTURE(name);
    CAPTURE(T);
    HostDecoderLayer layer(spec, index);
    RouterBalanceLoss balance(1, spec.moe().experts, spec.moe().top_k, 0.5);  // over this layer alone
    if (balanced) layer.balance_router(&balance);
    const auto balance_loss = [&] { return balanced ? balance.loss() : 0.0; };
    const std::uint64_t H = layer.hidden();
    const auto w = grid_weights(spec, layer, 31 + T);
    const auto x = test::random_normal(T * H, 32 + T);
    const auto g = test::random_normal(T * H, 33 + T);
    const Run whole = run(layer, w, x, &g, T, T);
    const double whole_loss = balance_loss();
    CHECK(balance.rows() == (balanced ? T : 0));
    for (const std::uint64_t fc : {T, std::uint64_t{1}, std::uint64_t{3}, std::uint64_t{5}})
      for (const std::uint64_t bc : {T, std::uint64_t{1}, std::uint64_t{3}, std::uint64_t{5}}) {
        CAPTURE(fc);
        CAPTURE(bc);
        const Run r = run(layer, w, x, &g, T, fc, bc);
        CHECK(balance_loss() == whole_loss);  // each forward's rows once, summed in token order
        CHECK(same_bits(r.y, whole.y));
        CHECK(same_bits(r.dx, whole.dx));
        for (std::size_t s = 0; s < r.grads.size(); ++s) CHECK(same_bits(r.grads[s], whole.grads[s]));
        for (int c = 0; c < activation_class_count; ++c) CHECK(same_bits(r.saved[static_cast<std::size_t>(c)], whole.saved[static_cast<std::size_t>(c)]));
      }
    // Recompute each class alone (output == nullptr, only that class bound), in other chunks.
    for (int c = 1; c < activation_class_count; ++c) {
      const auto n = layer.saved_floats(static_cast<ActivationClass>(c), T);
      if (n == 0) continue;
      CAPTURE(c);
      std::vector<std::vector<float>> grads;
      for (const auto& s : w) grads.emplace_back(s.size(), 0.0f);
      LayerContext ctx = bind(w, grads, T);
      ctx.input = x.data();
      std::vector<float> again(n, NAN);
      ctx.saved[static_cast<std::size_t>(c)] = again.data();
      chunks(T, 2, ctx, [&](LayerContext& cc) { layer.forward(cc); });
      CHECK(same_bits(again, whole.saved[static_cast<std::size_t>(c)]));
      CHECK(balance.rows() == (balanced ? T : 0));  // a recompute adds no rows
      CHECK(balance_loss() == whole_loss);
    }
  }
}

namespace {

Plan resident_plan(const std::vector<HostDecoderLayer>& layers, std::uint64_t tokens) {
  Plan p;
  p.workload = {1, tokens};
  p.prefetch_depth = 2;
  p.gpu_budget = 1_GiB;
  p.host_budget = 1_GiB;
  for (const auto& l : layers)
    for (const auto& s : l.segments()) p.resident_segments.push_back(s.name);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    p.retention.push_back({});
    p.chunks.push_back({{tokens}, tokens});
  }
  p.loss_rows = tokens;
  return p;
}

Plan random_plan(const std::vector<HostDecoderLayer>& layers, std::uint64_t tokens, std::mt19937_64& rng) {
  Plan p = resident_plan(layers, tokens);
  p.prefetch_depth = 1 + static_cast<int>(rng() % 3);
  p.resident_segments.clear();
  for (const auto& l : layers)
    for (const auto& s : l.segments())
      if (rng() % 2) p.resident_segments.push_back(s.name);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    auto& row = p.retention[l];
    row[static_cast<std::size_t>(ActivationClass::layer_boundary)] = rng() % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
    for (auto c : {ActivationClass::norm_output, ActivationClass::attention_output, ActivationClass::softmax_stats,
                   ActivationClass::router_output, ActivationClass::expert_intermediate}) {
      const auto pick = rng() % 3;
      row[static_cast<std::size_t>(c)] = pick == 0   ? RetentionDecision::keep()
                                         : pick == 1 ? RetentionDecision::offload()
                                                     : RetentionDecision::recompute(static_cast<int>(l));
    }
    p.chunks[l].moe_tokens = 1 + rng() % tokens;
  }
  return p;
}

struct Trained {
  std::vector<std::vector<float>> master;
  std::vector<double> losses;
};

/// Two steps of `plan`; with `balance_coef` > 0 the loss adds the load-balancing loss over every
/// layer (RouterBalanceLoss) at that coefficient.
Trained train(const ModelSpec& spec, const Plan& plan, std::uint64_t tokens, std::uint64_t seed, double balance_coef = 0) {
  std::vector<HostDecoderLayer> layers;
  for (int l = 0; l < spec.num_layers(); ++l) layers.emplace_back(spec, l);
  std::unique_ptr<RouterBalanceLoss> balance;
  if (balance_coef > 0) {
    balance = std::make_unique<RouterBalanceLoss>(spec.num_layers(), spec.moe().experts, spec.moe().top_k, balance_coef);
    for (auto& l : layers) l.balance_router(balance.get());
  }
  std::vector<std::vector<float>> init;
  std::uint64_t s = seed;
  for (const auto& l : layers)
    for (const auto& seg : l.segments()) {
      auto v = test::random_normal(seg.parameters(), ++s, 0.3f);
      std::size_t at = 0;
      for (const auto& t : seg.tensors) {  // norms near their identity scale
        if (is_norm(t))
          for (std::size_t i = at; i < at + t.elements(); ++i) v[i] += 1.0f - spec.norm_weight_offset(t.name);
        at += t.elements();
      }
      init.push_back(std::move(v));
    }
  HostBackend backend({plan.gpu_budget, 1_GiB, true});
  Trained r;
  LayerExecutorOptions options;
  options.adamw.lr = 1e-2f;
  HostExecutor<HostDecoderLayer> exec(backend, layers, plan, init, options);
  const auto h = spec.hidden_size();
  for (int step = 0; step < 2; ++step) {
    const auto x = test::random_normal(tokens * h, seed * 100 + static_cast<std::uint64_t>(step));
    const auto y = test::random_normal(tokens * h, seed * 100 + 50 + static_cast<std::uint64_t>(step));
    if (!balance) {
      r.losses.push_back(exec.step(x, y));
      continue;
    }
    const float* tgt = y.data();
    auto* bal = balance.get();
    r.losses.push_back(exec.step(x, [tgt, bal, n = tokens * h, tokens](const float* out, float* grad) {
      double sum = 0;
      for (std::uint64_t i = 0; i < n; ++i) {
        const float d = out[i] - tgt[i];
        sum += 0.5 * static_cast<double>(d) * d;
        grad[i] = d / static_cast<float>(tokens);
      }
      return sum / static_cast<double>(tokens) + bal->loss();
    }));
  }
  r.master = exec.master();
  return r;
}

}  // namespace

TEST_CASE("a 2-layer stack through the HostExecutor: random plans train the resident plan's weights bit for bit") {
  const ModelSpec spec = tiny_spec(true, 2);
  std::vector<HostDecoderLayer> shape;
  for (int l = 0; l < spec.num_layers(); ++l) shape.emplace_back(spec, l);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 12; ++i) {
    const std::uint64_t tokens = 3 + rng() % 18;
    const Plan reference = resident_plan(shape, tokens);
    const Plan plan = random_plan(shape, tokens, rng);
    const auto seed = rng();
    const Trained expect = train(spec, reference, tokens, seed);
    const Trained got = train(spec, plan, tokens, seed);
    CAPTURE(i);
    CAPTURE(tokens);
    REQUIRE(got.losses == expect.losses);
    REQUIRE(got.master.size() == expect.master.size());
    for (std::size_t s = 0; s < got.master.size(); ++s) REQUIRE(same_bits(got.master[s], expect.master[s]));
    CHECK(expect.losses.back() != expect.losses.front());
  }
}

TEST_CASE("several sequences through the HostExecutor: every plan the resident plan's step bit for bit, not one long sequence's") {
  const ModelSpec spec = tiny_spec(true, 2);
  std::vector<HostDecoderLayer> shape;
  for (int l = 0; l < spec.num_layers(); ++l) shape.emplace_back(spec, l);
  constexpr std::uint64_t S = 6, B = 3, T = S * B;
  auto batched = [&](Plan p) {  // the plan for B sequences of S: attention chunks per sequence
    p.workload = {B, S};
    for (auto& c : p.chunks) c.attention = {S};
    return p;
  };
  const Plan reference = batched(resident_plan(shape, T));
  const Trained expect = train(spec, reference, T, 9);
  // The executor hands the split to every pass (forward, backward, recompute): without it the
  // step would be one sequence of T tokens'.
  const Trained joined = train(spec, resident_plan(shape, T), T, 9);
  CHECK(joined.losses != expect.losses);
  std::mt19937_64 rng(17);
  for (int i = 0; i < 6; ++i) {
    Plan p = batched(random_plan(shape, T, rng));
    // Every class recomputed in one of them (the recompute pass regenerates saved state by forward).
    if (i == 0)
      for (std::size_t l = 0; l < p.retention.size(); ++l)
        for (int c = 1; c < activation_class_count; ++c)
          p.retention[l][static_cast<std::size_t>(c)] = RetentionDecision::recompute(static_cast<int>(l));
    CAPTURE(i);
    const Trained got = train(spec, p, T, 9);
    CHECK(got.losses == expect.losses);
    for (std::size_t s = 0; s < got.master.size(); ++s) CHECK(same_bits(got.master[s], expect.master[s]));
  }
}

namespace {

/// The tiny Qwen3-Next stack (3 Gated DeltaNet layers, 1 gated full attention) over B = 2
/// sequences of S = 5 tokens.
struct HybridStack {
  static constexpr std::uint64_t S = 5, B = 2, T = S * B;
  ModelSpec spec = data_spec("tests/data/tiny-qwen3-next-layers.json");
  std::vector<HostDecoderLayer> shape = layers_of(spec);

  static std::vector<HostDecoderLayer> layers_of(const ModelSpec& m) {
    std::vector<HostDecoderLayer> out;
    for (int l = 0; l < m.num_layers(); ++l) out.emplace_back(m, l);
    return out;
  }
  /// `p` for the B sequences: attention chunks per sequence.
  Plan batched(Plan p) const {
    p.workload = {B, S};
    for (auto& c : p.chunks) c.attention = {S};
    return p;
  }
};

}  // namespace

TEST_CASE("a hybrid stack (3 Gated DeltaNet layers, 1 gated full attention) through the HostExecutor: random plans, "
          "several sequences, the resident plan's step bit for bit") {
  const HybridStack hs;
  const auto& [spec, shape] = hs;
  constexpr std::uint64_t T = HybridStack::T;
  const auto batched = [&](const Plan& p) { return hs.batched(p); };
  const Trained expect = train(spec, batched(resident_plan(shape, T)), T, 3);
  CHECK(expect.losses.back() != expect.losses.front());
  // One sequence of T is another step: the linear layers' state and the attention run across.
  CHECK(train(spec, resident_plan(shape, T), T, 3).losses != expect.losses);
  std::mt19937_64 rng(29);
  for (int i = 0; i < 5; ++i) {
    Plan p = batched(random_plan(shape, T, rng));
    if (i == 0)  // everything recomputed
      for (std::size_t l = 0; l < p.retention.size(); ++l)
        for (int c = 1; c < activation_class_count; ++c)
          p.retention[l][static_cast<std::size_t>(c)] = RetentionDecision::recompute(static_cast<int>(l));
    CAPTURE(i);
    const Trained got = train(spec, p, T, 3);
    CHECK(got.losses == expect.losses);
    for (std::size_t s = 0; s < got.master.size(); ++s) CHECK(same_bits(got.master[s], expect.master[s]));
  }
}

TEST_CASE("boundaries regenerated through the layers before them (hybrid-regenerate): the resident plan's step bit for bit, "
          "the load-balancing loss counted once") {
  // Qwen3-Next's 3 Gated DeltaNet layers and 1 gated full attention, 4 layers over 2 sequences:
  // the retention MISSION.md names for hybrid models. Layer 0's boundary goes to the host; layers
  // 1-3 regenerate theirs through the linear layers below them in layer 3's backward.
  const HybridStack hs;
  const auto& [spec, shape] = hs;
  constexpr std::uint64_t T = HybridStack::T;
  const auto batched = [&](const Plan& p) { return hs.batched(p); };
  const RetentionTable table(spec, RetentionTemplate::hybrid_regenerate, RetentionTemplate::hybrid_regenerate, 0);
  int regenerated = 0;
  Plan regen = batched(resident_plan(shape, T));
  for (int l = 0; l < spec.num_layers(); ++l)
    for (int c = 0; c < activation_class_count; ++c) {
      const auto d = table.retain(l, static_cast<ActivationClass>(c));
      regen.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)] = d;
      regenerated += c == 0 && d.action == Retention::recompute && d.recompute_from < l;
    }
  REQUIRE(regenerated == 3);
  for (const double coef : {0.0, 0.5}) {
    CAPTURE(coef);
    const Trained expect = train(spec, batched(resident_plan(shape, T)), T, 3, coef);
    CHECK(expect.losses.back() != expect.losses.front());
    Plan streamed = regen;  // and every segment streamed through one slot, the MoE in chunks of 3
    streamed.resident_segments.clear();
    streamed.prefetch_depth = 1;
    for (auto& c : streamed.chunks) c.moe_tokens = 3;
    for (const Plan& p : {regen, streamed}) {
      const Trained got = train(spec, p, T, 3, coef);
      CHECK(got.losses == expect.losses);
      for (std::size_t s = 0; s < got.master.size(); ++s) CHECK(same_bits(got.master[s], expect.master[s]));
    }
  }
  // A boundary regenerated from a layer whose own is regenerated, or past a layer that keeps its
  // own, is refused by name before anything runs.
  Plan bad = regen;
  bad.retention[3][0] = RetentionDecision::recompute(2);
  CHECK_THROWS_WITH_AS((void)train(spec, bad, T, 3), doctest::Contains("layer 3: its boundary is regenerated from layer 2, whose own"), Error);
  bad = regen;
  bad.retention[2][0] = RetentionDecision::keep();
  CHECK_THROWS_WITH_AS((void)train(spec, bad, T, 3), doctest::Contains("layer 3: its boundary is regenerated from layer 0 but layer 2's is not"),
                       Error);
}

TEST_CASE("what the host decoder layer does not implement is named") {
  const std::string dir = std::string(OOM_SOURCE_DIR) + "/examples/configs/";
  auto error_of = [](const ModelSpec& spec, int layer) -> std::string {
    try {
      HostDecoderLayer l(spec, layer);
    } catch (const Error& e) {
      CHECK(e.code() == Errc::unsupported);
      return e.message();
    }
    return "no error";
  };
  // Mixtral and OLMoE are built, at the full models' shapes too; what changes their math and the
  // layer does not implement is refused: a sliding window, OLMoE's clip_qkv, Mixtral's router jitter.
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_file(dir + "mixtral-8x7b-v0.1.json"), 1));
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_file(dir + "olmoe-1b-7b-0924.json"), 0));
  Json windowed = read_json_file(dir + "mixtral-8x7b-v0.1.json");
  windowed.set("sliding_window", 4096);
  CHECK(error_of(ModelSpec::from_json(windowed), 1).find("layer 1 has sliding-window attention (sliding_window 4096)") != std::string::npos);
  Json jittered = read_json_file(dir + "mixtral-8x7b-v0.1.json");
  jittered.set("router_jitter_noise", Json::parse("0.01"));
  CHECK(error_of(ModelSpec::from_json(jittered), 0).find("layer 0 has router_jitter_noise 0.01") != std::string::npos);
  Json clipped = read_json_file(dir + "olmoe-1b-7b-0924.json");
  clipped.set("clip_qkv", Json::parse("8.0"));
  CHECK(error_of(ModelSpec::from_json(clipped), 0).find("layer 0 has clip_qkv 8") != std::string::npos);
  // The hybrids' layers of both kinds are built (at the full models' shapes too).
  const ModelSpec next = ModelSpec::from_file(dir + "qwen3-next-80b-a3b.json");
  CHECK_NOTHROW(HostDecoderLayer(next, 0));
  CHECK_NOTHROW(HostDecoderLayer(next, 3));
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_file(dir + "qwen3.5-35b-a3b.json"), 3));
  // A rotary width that rotate-half cannot pair (head_dim 8 x 0.1 = 0 dimensions).
  Json narrow = read_json_file(std::string(OOM_SOURCE_DIR) + "/tests/data/tiny-qwen3-next-layers.json");
  narrow.set("partial_rotary_factor", Json::parse("0.1"));
  CHECK(error_of(ModelSpec::from_json(narrow), 3).find("layer 3 has a rotary dimension of 0 (head_dim 8 x partial_rotary_factor 0.1)") !=
        std::string::npos);
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_json(narrow), 0));  // linear attention has no RoPE
  // Attention biases; a hybrid config that turns the output gate off (transformers gates anyway).
  Json biased = read_json_file(dir + "tiny-moe.json");
  biased.set("attention_bias", Json::parse("true"));
  CHECK(error_of(ModelSpec::from_json(biased), 0).find("layer 0 has attention bias") != std::string::npos);
  Json ungated = read_json_file(std::string(OOM_SOURCE_DIR) + "/tests/data/tiny-qwen3.5-moe.json");
  Json text = *ungated.find("text_config");
  text.set("attn_output_gate", Json::parse("false"));
  ungated.set("text_config", std::move(text));
  CHECK(error_of(ModelSpec::from_json(ungated), 3).find("layer 3 has attn_output_gate false") != std::string::npos);
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_json(ungated), 0));
  Json dense = read_json_file(dir + "tiny-moe.json");
  dense.set("mlp_only_layers", Json::parse("[2]"));
  CHECK(error_of(ModelSpec::from_json(dense), 2).find("layer 2 has a dense MLP") != std::string::npos);
  CHECK_NOTHROW(HostDecoderLayer(ModelSpec::from_json(dense), 1));
}

TEST_CASE("the load-balancing loss is transformers' load_balancing_loss_func over every layer; each forward begins anew") {
  // Two layers of 3 tokens over 4 experts, top-2: the formula written out.
  RouterBalanceLoss loss(2, 4, 2, 0.25, 0.5);
  const std::vector<float> p0 = {0.4f, 0.3f, 0.2f, 0.1f, 0.1f, 0.2f, 0.3f, 0.4f, 0.25f, 0.25f, 0.25f, 0.25f};
  const std::vector<std::int32_t> ids0 = {0, 1, 3, 2, 0, 1};
  const std::vector<float> p1 = {0.7f, 0.1f, 0.1f, 0.1f, 0.1f, 0.7f, 0.1f, 0.1f, 0.1f, 0.1f, 0.7f, 0.1f};
  const std::vector<std::int32_t> ids1 = {0, 1, 1, 0, 2, 0};
  // Layer 0 in two chunks (tokens 0-1, then 2), layer 1 whole; nothing is read before both added.
  loss.add(0, 0, std::span(p0).first(8), std::span(ids0).first(4));
  loss.add(0, 2, std::span(p0).subspan(8), std::span(ids0).subspan(4));
  CHECK_THROWS_WITH_AS((void)loss.loss(), doctest::Contains("before every layer's forward added its rows (layer 1 holds 0 rows"), Error);
  loss.add(1, 0, p1, ids1);
  CHECK(loss.rows() == 6);
  std::vector<double> C(4, 0), P(4, 0);
  for (const auto* ids : {&ids0, &ids1})
    for (const auto e : *ids) C[static_cast<std::size_t>(e)] += 1;
  for (const auto* p : {&p0, &p1})
    for (std::size_t i = 0; i < p->size(); ++i) P[i % 4] += (*p)[i];
  double aux = 0;
  for (std::size_t e = 0; e < 4; ++e) aux += (C[e] / 6) * (P[e] / 6);
  aux *= 4;
  CHECK(loss.loss() == doctest::Approx(0.25 * 0.5 * aux).epsilon(1e-12));
  const auto grad = loss.probability_gradient();
  for (std::size_t e = 0; e < 4; ++e) CHECK(grad[e] == doctest::Approx(0.25 * 0.5 * 4 * C[e] / 36).epsilon(1e-12));
  // The next forward (layer 0 from token 0 again) starts from nothing.
  loss.add(0, 0, p1, ids1);
  CHECK(loss.rows() == 3);
  loss.add(1, 0, p1, ids1);
  CHECK(loss.rows() == 6);
  double again = 0;
  std::vector<double> c1(4, 0), q1(4, 0);
  for (const auto e : ids1) c1[static_cast<std::size_t>(e)] += 1;
  for (std::size_t i = 0; i < p1.size(); ++i) q1[i % 4] += p1[i];
  for (std::size_t e = 0; e < 4; ++e) again += (c1[e] / 3) * (q1[e] / 3);
  CHECK(loss.loss() == doctest::Approx(0.25 * 0.5 * 4 * again).epsilon(1e-12));  // both layers the same rows: the same ratios
  // Bad rows are named, and leave the sums as they were.
  CHECK_THROWS_WITH_AS(loss.add(2, 0, p1, ids1), doctest::Contains("layer 2 of 2"), Error);
  CHECK_THROWS_WITH_AS(loss.add(0, 0, std::span(p1).first(5), ids1), doctest::Contains("no whole rows of 4 experts"), Error);
  const std::vector<std::int32_t> bad = {0, 4, 1, 1, 2, 3};
  CHECK_THROWS_WITH_AS(loss.add(0, 0, p1, bad), doctest::Contains("expert id 4 of 4 experts"), Error);
  CHECK_THROWS_WITH_AS(loss.add(0, 0, p1, std::span(ids1).first(5)), doctest::Contains("5 expert ids for 3 rows of top 2"), Error);
  CHECK(loss.rows() == 6);
  CHECK(loss.loss() == doctest::Approx(0.25 * 0.5 * 4 * again).epsilon(1e-12));
  CHECK_THROWS_AS(RouterBalanceLoss(0, 4, 2, 0.1), Error);
  CHECK_THROWS_AS(RouterBalanceLoss(2, 4, 5, 0.1), Error);
}
