// GPU test of the CUDA decoder layer on the families beyond Qwen3-MoE (oom/model/cuda_decoder_layer.hpp):
// a Gated DeltaNet layer and a gated full-attention layer of Qwen3-Next and of Qwen3.5-MoE, with
// the shared expert, (1 + w) norms and partial rotary, and a Mixtral layer (no q/k norm, experts
// w1/w3/w2), an OLMoE layer (q/k norm over the whole projection, top-k weights not
// renormalised) and a Qwen2-MoE layer (q/k/v biases, no q/k norm, a shared expert, top-k weights
// not renormalised), against HostDecoderLayer on the same bf16 weights and inputs. The host layer is
// the fp32 oracle: it matches transformers' own layers (tests/data/hybrid_layers_torch.safetensors
// and moe_families_torch.safetensors, test_host_decoder_layer), so this checks the GPU layer
// against transformers' math at widths the GPU kernels take (head_dim 128).
//
// Tolerance: the GPU layer keeps every activation in bf16 (a relative rounding of up to 2^-9 at
// each of some ten steps deep) where the host keeps fp32; issue 5's bar for one layer against an
// fp32 reference is 1e-2 relative L2, and the Qwen3-MoE layer measures <= 8.2e-3 against
// transformers in fp32 (docs/kernels.md). The (gated) attention layers: 1e-2 for y, dx and every
// gradient (measured on the H200, 2026-12-04: y 3.2e-3, dx 4.2e-3, worst gradient 7.5e-3). The
// Gated DeltaNet layers: 3e-2, since the block's bf16 inputs to its recurrence (q, k, v, the
// gates) carry their rounding through every later token: the block alone sits 2-9e-2 from fp64
// in bf16, ours and PyTorch's alike (test_cuda_deltanet: dx 6.1e-2 ours, 6.5e-2 PyTorch's bf16
// Qwen3NextGatedDeltaNet at its shape). Measured here: dx 1.4e-2, worst gradient 2.0e-2
// (in_proj_ba, through the gates' exp and softplus). A dropped piece (the 1 of a norm, the
// partial rotary, OLMoE's full-width norm, Mixtral's RoPE base: PyTorch puts transformers'
// Mixtral layer with theta 1e4 at a worst gradient 0.71 from 1e6's at this shape) moves them by
// O(1): the test also runs the GPU layer with such a field of its shape undone and requires the
// error to exceed the tolerance tenfold, so the comparison can tell.
// The gated attention layers run once more in query chunks (DecoderLayerShape::attention_chunk_tokens).
// Qwen2-MoE's q/k/v bias gradients are sums over the tokens of their projections' output
// gradients, and k's nearly cancels (keys shifted alike leave softmax unchanged; only RoPE keeps
// some of it): each is held to the bar times max(1, kappa), kappa measuring that cancellation
// (bias_kappa). On the H100, 2026-12-05 (before this rule), k's came out 1.19e-2 and 1.09e-2 off
// (layers 0 and 1), y and dx 3.6-3.7e-3 and 4.9e-3; k's kappa on these inputs is 2.52 and 2.20
// (bias_kappa), so 4.7e-3 and 5.0e-3 judged; this rule passed on the H100 on 2026-12-06.
// scripts/diag/qwen2_bias_floor.py measures PyTorch's own bf16 layer the same way: its k bias
// gradient came out 1.34e-2 off its fp32 run's at kappa 2.8 (2026-12-06).

// Routing: a token whose k-th and (k+1)-th router probabilities are within 5% of each other could
// be routed differently by two implementations that round differently; its row of dy is zeroed
// (nothing of its MoE path then reaches any gradient) and its row of y left out, as
// scripts/compare_decoder_layer.py does. Their count is checked to stay small.
//
// Run: build-gpu/tests/test_cuda_hybrid_layer.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/model/host_decoder_layer.hpp"
#include "oom/model/model_spec.hpp"
#include "support/compare.hpp"

using namespace oom;
using oom::test::Blas;
using oom::test::DeviceBuffer;
using oom::test::Stream;
using oom::test::rel_l2;
using oom::test::to_bf16s;
using oom::test::to_floats;

namespace {

constexpr double attention_tolerance = 1e-2;
constexpr double linear_tolerance = 3e-2;
// Chunked MoE against whole on the GPU: test_cuda_decoder_layer's bound for Qwen3-MoE (1e-3) on
// y and dx, twice that here where the gradients also carry the 0.25 they started from (fp32:
// 2^-24 x 0.25 absolute on each) and the shared expert's chunk-shaped GEMMs.
constexpr double chunk_tolerance = 2e-3;
constexpr std::int64_t sequences = 2, sequence_tokens = 61;  // T = 122: no tile's multiple
constexpr std::int64_t T = sequences * sequence_tokens;

// Widths the GPU kernels take: head_dim 128 (the attention's), linear heads of 64, hidden 256;
// the hybrids' 2 layers, the first Gated DeltaNet, the second gated full attention; a quarter of
// each head rotated; 8 experts top-2 and a shared expert of 96; Mixtral's and OLMoE's 2 layers of
// full attention, 8 experts top-2 (tests/data/gpu-*-layers.json).
ModelSpec layers_spec(const std::string& family) {
  return ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/tests/data/gpu-" + family + "-layers.json");
}

/// Random bf16 weights per segment of `layer`: matrices N(0, 1/16) (about 1/sqrt(fan-in) at
/// hidden 256), norm scales 1 + N(0, 0.1) stored less the norm's offset, the conv's taps N(0, 0.4),
/// dt_bias N(1, 0.2), A_log log U(1, 16) (transformers' initialisation), q/k/v biases N(0, 0.25)
/// (a quarter of the projections' outputs' scale, so they move y and every gradient).
std::vector<std::vector<bf16>> random_weights(const ModelSpec& spec, int layer, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(1.0f, 16.0f);
  std::vector<std::vector<bf16>> w;
  for (const StateSegment& seg : spec.layer_segments(layer)) {
    std::vector<float> v;
    for (const TensorSpec& t : seg.tensors)
      for (std::uint64_t i = 0; i < t.elements(); ++i) {
        if (t.name.ends_with("norm.weight")) v.push_back(1.0f + 0.1f * normal(rng) - spec.norm_weight_offset(t.name));
        else if (t.name.ends_with("conv1d.weight")) v.push_back(0.4f * normal(rng));
        else if (t.name.ends_with("dt_bias")) v.push_back(1.0f + 0.2f * normal(rng));
        else if (t.name.ends_with("A_log")) v.push_back(std::log(uniform(rng)));
        else if (t.name.ends_with("_proj.bias")) v.push_back(0.25f * normal(rng));
        else v.push_back(normal(rng) / 16.0f);
      }
    w.push_back(to_bf16s(v));
  }
  return w;
}

struct Outputs {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;  ///< per segment, fp32, TensorSpec order
};

/// The host layer's forward, and its backward with grad_output `dy` when given; the router's
/// probabilities (T, E) into `probs` when given.
Outputs host_run(const ModelSpec& spec, int layer, const std::vector<std::vector<bf16>>& w, const std::vector<float>& x,
                 const std::vector<float>* dy, std::vector<float>* probs = nullptr) {
  HostDecoderLayer host(spec, layer);
  const auto H = host.hidden();
  Outputs out;
  for (const auto& s : w) out.grads.emplace_back(s.size(), 0.0f);
  std::array<std::vector<float>, activation_class_count> saved;
  LayerContext ctx;
  for (const auto& s : w) ctx.weights.emplace_back(s.data(), s.size());
  for (auto& g : out.grads) ctx.weight_grads.emplace_back(g.data(), g.size());
  ctx.tokens = T;
  ctx.sequences = sequences;
  ctx.begin = 0;
  ctx.end = T;
  out.y.assign(T * H, NAN);
  ctx.input = x.data();
  ctx.output = out.y.data();
  for (int c = 1; c < activation_class_count; ++c) {
    const auto n = host.saved_floats(static_cast<ActivationClass>(c), T);
    if (n == 0) continue;
    saved[static_cast<std::size_t>(c)].assign(n, NAN);
    ctx.saved[static_cast<std::size_t>(c)] = saved[static_cast<std::size_t>(c)].data();
  }
  host.forward(ctx);
  if (probs != nullptr) {  // router_output begins with the probabilities
    const auto& router = saved[static_cast<std::size_t>(ActivationClass::router_output)];
    probs->assign(router.begin(), router.begin() + static_cast<std::ptrdiff_t>(T * spec.moe().experts));
  }
  if (dy == nullptr) return out;
  out.dx.assign(T * H, NAN);
  ctx.output = nullptr;
  ctx.grad_output = dy->data();
  ctx.grad_input = out.dx.data();
  host.backward(ctx);
  return out;
}

/// The GPU layer's forward and backward on the same weights, with `shape` (from_spec's, or one
/// with a field undone), MoE chunks of `chunk` tokens; outputs, saved buffer and workspace
/// poisoned. The gradients start at `grad_start` everywhere and come back less it: what the
/// backward added (an overwrite instead of an accumulation then shows).
Outputs gpu_run(const ModelSpec& spec, int layer, model::DecoderLayerShape shape, const std::vector<std::vector<bf16>>& w,
                const std::vector<float>& x, const std::vector<float>& dy, std::int64_t chunk, float grad_start = 0.0f) {
  shape.moe_chunk_tokens = chunk;
  std::vector<DeviceBuffer<bf16>> weights;
  std::vector<DeviceBuffer<float>> grads;
  std::vector<const bf16*> wb;
  std::vector<float*> gb;
  for (const auto& s : w) {
    weights.emplace_back(s);
    grads.emplace_back(s.size());
    grads.back().upload(std::vector<float>(s.size(), grad_start));
    wb.push_back(weights.back().get());
    gb.push_back(grads.back().get());
  }
  const auto params = model::bind_decoder_layer_params(spec, layer, wb);
  const auto grad_ptrs = model::bind_decoder_layer_grads(spec, layer, gb);
  DeviceBuffer<bf16> x_in(to_bf16s(x)), dy_in(to_bf16s(dy)), y(x.size()), dx(x.size());
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) pos[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t % sequence_tokens);
  DeviceBuffer<std::int32_t> positions(pos);
  Blas blas;
  Stream stream;
  kernels::ExpertGemmStreams expert_streams;
  const std::size_t saved_bytes = model::decoder_layer_saved_bytes(shape);
  const std::size_t ws_bytes = model::decoder_layer_workspace_bytes(shape, expert_streams);
  DeviceBuffer<std::byte> saved(saved_bytes), workspace(ws_bytes);  // poisoned
  const model::DecoderLayerContext ctx{stream.s, blas.get(), &expert_streams, nullptr};
  model::decoder_layer_forward(ctx, shape, params, positions.get(), x_in.get(), y.get(), saved.get(), saved_bytes,
                               workspace.get(), ws_bytes);
  model::decoder_layer_backward(ctx, shape, params, positions.get(), x_in.get(), dy_in.get(), saved.get(), saved_bytes,
                                dx.get(), grad_ptrs, workspace.get(), ws_bytes);
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  Outputs out;
  out.y = to_floats(y.download());
  out.dx = to_floats(dx.download());
  for (const auto& g : grads) {
    out.grads.push_back(g.download());
    for (float& v : out.grads.back()) v -= grad_start;
  }
  return out;
}

/// Tokens the two implementations might route apart: the k-th and (k+1)-th probabilities within 5%.
std::vector<bool> near_ties(const std::vector<float>& probs, std::int64_t experts, std::int64_t k) {
  std::vector<bool> tie(static_cast<std::size_t>(T), false);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<float> p(probs.begin() + t * experts, probs.begin() + (t + 1) * experts);
    std::sort(p.begin(), p.end(), std::greater<>());
    tie[static_cast<std::size_t>(t)] = std::log(p[static_cast<std::size_t>(k - 1)] / p[static_cast<std::size_t>(k)]) < 0.05;
  }
  return tie;
}

/// Relative L2 errors. With bias cancellations given to compare(), each such bias's error is
/// judged divided by max(1, kappa) (bias_kappa below): `bias` is the largest such quotient,
/// `bias_text` each bias's error and kappa; worst_grad then covers the other tensors.
struct Errors {
  double y = 0, dx = 0, worst_grad = 0, bias = 0;
  std::string worst_name, bias_text;
  [[nodiscard]] double worst() const { return std::max({y, dx, worst_grad, bias}); }
};

/// Where tensor `name` of layer `layer` lies: its segment, its offset there (elements), its size.
struct Located {
  std::size_t segment = 0, offset = 0, elements = 0;
};
Located locate(const ModelSpec& spec, int layer, const std::string& name) {
  const auto segs = spec.layer_segments(layer);
  for (std::size_t i = 0; i < segs.size(); ++i) {
    std::size_t offset = 0;
    for (const TensorSpec& t : segs[i].tensors) {
      if (t.name == name) return {i, offset, t.elements()};
      offset += t.elements();
    }
  }
  FAIL("layer " << layer << " has no tensor " << name);
  return {};
}

std::span<const float> gradient(const Outputs& o, const Located& at) {
  return {o.grads[at.segment].data() + at.offset, at.elements};
}

/// How much a bias gradient cancels over the tokens: kappa = sqrt(sum_t |d_t|^2) / |sum_t d_t|,
/// d_t the projection's output gradient at token t (the bias gradient is sum_t d_t). Errors of
/// relative size eps on each d_t that do not cancel leave the sum about eps * kappa off, so the
/// bias gradient is held to the layer's bar times max(1, kappa): the same bar on each d_t, carried
/// through the sum. Keys cancel by construction (one vector added to every key shifts each query's
/// scores by a constant, which softmax ignores: without RoPE the k bias gradient is exactly zero),
/// so k's kappa is the large one.
/// The host layer keeps no d_t, but its weight gradient G = D^T XN (D: (T, P), XN: the input
/// norm's output, (T, H)) gives them back where T < H: D = (XN XN^T)^-1 XN G^T, solved here in
/// double. That D sums to the host's bias gradient is checked, so a wrong XN cannot pass.
double bias_kappa(const ModelSpec& spec, int layer, const std::vector<std::vector<bf16>>& w, const std::vector<float>& x,
                  const Outputs& host, const std::string& proj) {
  const auto H = static_cast<std::size_t>(spec.hidden_size());
  const auto n = static_cast<std::size_t>(T);
  REQUIRE(n < H);
  const std::string p = fmt::format("model.layers.{}.", layer);
  const std::string norm_name = p + "input_layernorm.weight";
  const Located norm = locate(spec, layer, norm_name);
  std::vector<double> xn(n * H);
  for (std::size_t t = 0; t < n; ++t) {
    double ss = 0;
    for (std::size_t h = 0; h < H; ++h) ss += static_cast<double>(x[t * H + h]) * x[t * H + h];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(H) + spec.rms_norm_eps());
    for (std::size_t h = 0; h < H; ++h)
      xn[t * H + h] = x[t * H + h] * r *
                      (static_cast<double>(to_float(w[norm.segment][norm.offset + h])) + spec.norm_weight_offset(norm_name));
  }
  const auto G = gradient(host, locate(spec, layer, p + "self_attn." + proj + ".weight"));
  const auto g = gradient(host, locate(spec, layer, p + "self_attn." + proj + ".bias"));
  const std::size_t P = g.size();
  REQUIRE(G.size() == P * H);
  // M = XN XN^T (n, n), its Cholesky factor in place; R = XN G^T (n, P) solved into D.
  std::vector<double> M(n * n), R(n * P);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j <= i; ++j) {
      double sum = 0;
      for (std::size_t h = 0; h < H; ++h) sum += xn[i * H + h] * xn[j * H + h];
      M[i * n + j] = M[j * n + i] = sum;
    }
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t j = 0; j < P; ++j) {
      double sum = 0;
      for (std::size_t h = 0; h < H; ++h) sum += xn[t * H + h] * G[j * H + h];
      R[t * P + j] = sum;
    }
  double pivot = INFINITY;  // XN's rows independent: every pivot positive
  for (std::size_t j = 0; j < n; ++j) {
    for (std::size_t k = 0; k < j; ++k) M[j * n + j] -= M[j * n + k] * M[j * n + k];
    pivot = std::min(pivot, M[j * n + j]);
    M[j * n + j] = std::sqrt(std::max(M[j * n + j], 0.0));
    for (std::size_t i = j + 1; i < n; ++i) {
      for (std::size_t k = 0; k < j; ++k) M[i * n + j] -= M[i * n + k] * M[j * n + k];
      M[i * n + j] /= M[j * n + j];
    }
  }
  REQUIRE(pivot > 0);
  for (std::size_t c = 0; c < P; ++c) {  // L L^T d = r, column by column
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t k = 0; k < i; ++k) R[i * P + c] -= M[i * n + k] * R[k * P + c];
      R[i * P + c] /= M[i * n + i];
    }
    for (std::size_t i = n; i-- > 0;) {
      for (std::size_t k = i + 1; k < n; ++k) R[i * P + c] -= M[k * n + i] * R[k * P + c];
      R[i * P + c] /= M[i * n + i];
    }
  }
  std::vector<float> sum(P, 0.0f);
  double rows = 0, total = 0;
  for (std::size_t j = 0; j < P; ++j) {
    double s = 0;
    for (std::size_t t = 0; t < n; ++t) {
      s += R[t * P + j];
      rows += R[t * P + j] * R[t * P + j];
    }
    sum[j] = static_cast<float>(s);
    total += s * s;
  }
  const double recovered = rel_l2(sum, std::vector<float>(g.begin(), g.end()));
  INFO(proj << ": the recovered rows' sum against the host's bias gradient");
  CHECK(recovered <= 1e-3);
  return std::sqrt(rows / total);
}

Errors compare(const ModelSpec& spec, int layer, const Outputs& got, const Outputs& want, const std::vector<bool>& tie,
               const std::map<std::string, double>& kappa = {}) {
  const auto H = static_cast<std::size_t>(spec.hidden_size());
  std::vector<float> gy, wy;  // y without the near-tie rows
  for (std::size_t t = 0; t < static_cast<std::size_t>(T); ++t) {
    if (tie[t]) continue;
    gy.insert(gy.end(), got.y.begin() + static_cast<std::ptrdiff_t>(t * H), got.y.begin() + static_cast<std::ptrdiff_t>((t + 1) * H));
    wy.insert(wy.end(), want.y.begin() + static_cast<std::ptrdiff_t>(t * H), want.y.begin() + static_cast<std::ptrdiff_t>((t + 1) * H));
  }
  Errors e;
  e.y = rel_l2(gy, wy);
  e.dx = rel_l2(got.dx, want.dx);
  const auto segs = spec.layer_segments(layer);
  for (std::size_t i = 0; i < segs.size(); ++i) {
    std::size_t offset = 0;
    for (const TensorSpec& t : segs[i].tensors) {
      const std::span<const float> g(got.grads[i].data() + offset, t.elements()), r(want.grads[i].data() + offset, t.elements());
      offset += t.elements();
      const double err = rel_l2(g, r);
      if (const auto k = kappa.find(t.name); k != kappa.end()) {
        const double judged = err / std::max(1.0, k->second);
        if (!(judged <= e.bias)) e.bias = std::isnan(judged) ? INFINITY : judged;
        e.bias_text += fmt::format("{}{} {:.2e} (kappa {:.2f})", e.bias_text.empty() ? "" : ", ",
                                   t.name.substr(t.name.rfind('.', t.name.size() - 6) + 1), err, k->second);
        continue;
      }
      if (!(err <= e.worst_grad)) {  // NaN counts as worst
        e.worst_grad = std::isnan(err) ? INFINITY : err;
        e.worst_name = t.name;
      }
    }
  }
  return e;
}

void check_layer(const std::string& family, int layer) {
  const ModelSpec spec = layers_spec(family);
  const auto w = random_weights(spec, layer, 100 + static_cast<std::uint64_t>(layer));
  const auto H = static_cast<std::size_t>(spec.hidden_size());
  // Inputs as bf16 holds them, so both layers read the same numbers.
  std::vector<float> x = to_floats(to_bf16s(test::random_normal(static_cast<std::size_t>(T) * H, 7)));
  std::vector<float> dy = to_floats(to_bf16s(test::random_normal(static_cast<std::size_t>(T) * H, 8)));
  std::vector<float> probs;
  (void)host_run(spec, layer, w, x, nullptr, &probs);
  const auto tie = near_ties(probs, static_cast<std::int64_t>(spec.moe().experts), static_cast<std::int64_t>(spec.moe().top_k));
  const auto ties = std::count(tie.begin(), tie.end(), true);
  CHECK(ties <= T / 4);
  for (std::size_t t = 0; t < tie.size(); ++t)
    if (tie[t]) std::fill(dy.begin() + static_cast<std::ptrdiff_t>(t * H), dy.begin() + static_cast<std::ptrdiff_t>((t + 1) * H), 0.0f);
  const Outputs want = host_run(spec, layer, w, x, &dy);

  const auto shape = model::DecoderLayerShape::from_spec(spec, layer, T, sequences);
  CHECK(shape.linear == (spec.layer(layer).attention == AttentionKind::linear));
  const double tolerance = shape.linear ? linear_tolerance : attention_tolerance;
  // The MoE half whole, then in chunks of 37 tokens onto gradients that start at 0.25 (they add).
  const Outputs whole = gpu_run(spec, layer, shape, w, x, dy, 0);
  const Outputs chunked = gpu_run(spec, layer, shape, w, x, dy, 37, 0.25f);
  std::map<std::string, double> kappa;  // Qwen2-MoE's q/k/v biases
  if (shape.qkv_bias)
    for (const char* proj : {"q_proj", "k_proj", "v_proj"})
      kappa[fmt::format("model.layers.{}.self_attn.{}.bias", layer, proj)] = bias_kappa(spec, layer, w, x, want, proj);
  for (const auto& [name, k] : kappa) {
    // The bar max(1, kappa) x tolerance stays far below 1, so a bias gradient left unwritten, or
    // 10% off (below), still fails.
    INFO(name << ": kappa " << k);
    CHECK(k * tolerance <= 0.05);
  }
  if (!kappa.empty()) {
    Outputs off = whole;
    const Located kb = locate(spec, layer, fmt::format("model.layers.{}.self_attn.k_proj.bias", layer));
    for (std::size_t i = 0; i < kb.elements; ++i) off.grads[kb.segment][kb.offset + i] *= 0.9f;
    CHECK(compare(spec, layer, off, want, tie, kappa).bias > tolerance);
  }
  for (const auto& [chunk, got] : {std::pair{0, &whole}, std::pair{37, &chunked}}) {
    const Errors e = compare(spec, layer, *got, want, tie, kappa);
    MESSAGE(fmt::format("{} layer {} ({}), MoE chunk {}: rel L2 y {:.2e}, dx {:.2e}, worst gradient {:.2e} ({}); {} near-tie tokens",
                        family, layer, shape.linear ? "Gated DeltaNet" : shape.output_gate ? "gated attention" : "attention",
                        chunk, e.y, e.dx, e.worst_grad, e.worst_name, ties));
    if (!e.bias_text.empty()) MESSAGE("  bias gradients: " << e.bias_text);
    CHECK(e.y <= tolerance);
    CHECK(e.dx <= tolerance);
    CHECK(e.worst_grad <= tolerance);
    CHECK(e.bias <= tolerance);
  }
  // Chunked against whole, as test_cuda_decoder_layer checks Qwen3-MoE's: only the expert and
  // shared-expert GEMMs' shapes (so cuBLAS's summation orders) and the chunks' partial sums
  // differ, so far closer than to the host (and every row, the near ties included: the routing
  // is the same launches over all T).
  const Errors apart = compare(spec, layer, chunked, whole, std::vector<bool>(static_cast<std::size_t>(T), false));
  MESSAGE(fmt::format("  chunked vs whole: y {:.2e}, dx {:.2e}, worst gradient {:.2e} ({})", apart.y, apart.dx, apart.worst_grad,
                      apart.worst_name));
  CHECK(apart.worst() <= chunk_tolerance);

  if (!shape.linear) {
    // The gated attention in query chunks of 16 (16, 16, 16, 13 of each 61-token sequence) beside
    // the MoE chunks of 37: against the host as above, and against the MoE-chunked run, from
    // which only its summation orders differ (dK/dV summed in fp32 over the chunks, o_proj's and
    // q_proj's weight gradients chunk by chunk, chunk-shaped GEMMs).
    auto in_chunks = shape;
    in_chunks.attention_chunk_tokens = 16;
    const Outputs q_chunked = gpu_run(spec, layer, in_chunks, w, x, dy, 37, 0.25f);
    const Errors e = compare(spec, layer, q_chunked, want, tie, kappa);
    const Errors off = compare(spec, layer, q_chunked, chunked, std::vector<bool>(static_cast<std::size_t>(T), false));
    MESSAGE(fmt::format("  query chunks of 16: rel L2 y {:.2e}, dx {:.2e}, worst gradient {:.2e} ({}); vs MoE-chunked alone: "
                        "y {:.2e}, dx {:.2e}, worst gradient {:.2e} ({})",
                        e.y, e.dx, e.worst_grad, e.worst_name, off.y, off.dx, off.worst_grad, off.worst_name));
    if (!e.bias_text.empty()) MESSAGE("  bias gradients: " << e.bias_text);
    CHECK(e.worst() <= tolerance);
    CHECK(off.worst() <= chunk_tolerance);
  }

  // Each family's piece undone in the GPU layer's shape is caught by the comparison.
  std::vector<std::pair<std::string, model::DecoderLayerShape>> undone;
  if (shape.norm_offset != 0.0f) {
    auto plain_norms = shape;
    plain_norms.norm_offset = 0.0f;
    undone.emplace_back("norm_offset 0", plain_norms);
  }
  if (shape.qk_norm == model::QkNorm::full_width) {  // OLMoE: the q/k norms per head instead (their weights' first head_dim)
    auto per_head = shape;
    per_head.qk_norm = model::QkNorm::per_head;
    undone.emplace_back("q/k norms per head", per_head);
  }
  // Qwen2-MoE: the biases left out. Their gradients are then unwritten (1.0 apart whatever the
  // forward did), so this one is judged on y and dx alone: the host layer without its biases moves
  // them by 0.32-0.35 and 0.19-0.21 on these weights (measured on the CPU, 2026-12-05).
  std::optional<model::DecoderLayerShape> no_bias;
  if (shape.qkv_bias) {
    no_bias = shape;
    no_bias->qkv_bias = false;
  }
  if (spec.family() == ModelFamily::mixtral) {  // no q/k norm to undo: Mixtral's RoPE base instead of Qwen3's
    auto base = shape;
    base.rope_theta = 10000.0f;
    undone.emplace_back("rope_theta 10000", base);
  }
  if (!shape.linear && shape.rotary_dim > 0 && shape.rotary_dim < shape.head_dim) {
    auto full_rotary = shape;
    full_rotary.rotary_dim = shape.head_dim;
    undone.emplace_back("rotary over all of head_dim", full_rotary);
  }
  for (const auto& [what, wrong] : undone) {
    const Errors e = compare(spec, layer, gpu_run(spec, layer, wrong, w, x, dy, 0), want, tie);
    MESSAGE(fmt::format("  with {}: worst rel L2 {:.2e}", what, e.worst()));
    CHECK(e.worst() > 10 * tolerance);
  }
  if (no_bias) {
    const Errors e = compare(spec, layer, gpu_run(spec, layer, *no_bias, w, x, dy, 0), want, tie);
    MESSAGE(fmt::format("  with no q/k/v biases: rel L2 y {:.2e}, dx {:.2e}", e.y, e.dx));
    CHECK(e.y > 10 * tolerance);
    CHECK(e.dx > 10 * tolerance);
  }
}

}  // namespace

TEST_CASE("Qwen3-Next's Gated DeltaNet and gated attention layers on the GPU: the host layer's output and every gradient") {
  check_layer("qwen3-next", 0);
  check_layer("qwen3-next", 1);
}

TEST_CASE("Qwen3.5-MoE's layers (separate DeltaNet projections, stacked experts) on the GPU: the host layer's results") {
  check_layer("qwen3.5-moe", 0);
  check_layer("qwen3.5-moe", 1);
}

TEST_CASE("Mixtral's layer (no q/k norm, experts w1/w3/w2) and OLMoE's (q/k norm over the whole projection, top-k not "
          "renormalised) on the GPU: the host layer's results") {
  check_layer("mixtral", 1);
  check_layer("olmoe", 0);
}

TEST_CASE("Qwen2-MoE's layer (q/k/v biases, no q/k norm, a shared expert, top-k not renormalised) on the GPU: the host "
          "layer's results, in MoE and query chunks too") {
  check_layer("qwen2-moe", 0);
  check_layer("qwen2-moe", 1);
}
