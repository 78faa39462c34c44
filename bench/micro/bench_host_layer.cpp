// HostDecoderLayer on the CPU: one layer of examples/configs/tiny-moe.json (H=256, 8 heads, 2 KV
// heads, head_dim 32, 8 experts top-2, I=128) over T tokens, forward alone and forward+backward,
// whole or in MoE chunks. What the demo trainer's step costs per layer.
// Usage: bench_host_layer [google benchmark flags]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "oom/model/host_decoder_layer.hpp"

using namespace oom;

namespace {

struct Fixture {
  ModelSpec spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/tiny-moe.json");
  HostDecoderLayer layer{spec, 0};
  std::uint64_t t;
  std::vector<std::vector<bf16>> w;
  std::vector<std::vector<float>> grads;
  std::vector<float> x, y, dy, dx;
  std::array<std::vector<float>, activation_class_count> saved;
  LayerContext ctx;

  explicit Fixture(std::uint64_t tokens) : t(tokens) {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> n(0.0f, 1.0f);
    const float s = 1.0f / 16;  // ~1/sqrt(H)
    for (const auto& seg : layer.segments()) {
      std::vector<bf16> v(seg.parameters());
      for (auto& e : v) e = to_bf16(seg.role == SegmentRole::norm ? 1.0f : s * n(rng));
      w.push_back(std::move(v));
      grads.emplace_back(seg.parameters(), 0.0f);
    }
    const auto h = layer.hidden();
    for (auto* v : {&x, &y, &dy, &dx}) v->resize(t * h);
    for (auto& e : x) e = n(rng);
    for (auto& e : dy) e = n(rng) / static_cast<float>(t);
    for (const auto& s : w) ctx.weights.emplace_back(s.data(), s.size());
    for (auto& g : grads) ctx.weight_grads.emplace_back(g.data(), g.size());
    ctx.tokens = t;
    ctx.input = x.data();
    ctx.output = y.data();
    ctx.grad_output = dy.data();
    ctx.grad_input = dx.data();
    for (int c = 1; c < activation_class_count; ++c) {
      saved[static_cast<std::size_t>(c)].resize(layer.saved_floats(static_cast<ActivationClass>(c), t));
      if (!saved[static_cast<std::size_t>(c)].empty()) ctx.saved[static_cast<std::size_t>(c)] = saved[static_cast<std::size_t>(c)].data();
    }
  }
  void pass(bool backward, std::uint64_t chunk) {
    for (std::uint64_t b = 0; b < t; b += chunk) {
      LayerContext c = ctx;
      c.begin = b;
      c.end = std::min(t, b + chunk);
      if (backward) layer.backward(c);
      else layer.forward(c);
    }
  }
};

void BM_forward(benchmark::State& state) {
  Fixture f(static_cast<std::uint64_t>(state.range(0)));
  const auto chunk = state.range(1) ? static_cast<std::uint64_t>(state.range(1)) : f.t;
  for (auto _ : state) f.pass(false, chunk);
}
void BM_forward_backward(benchmark::State& state) {
  Fixture f(static_cast<std::uint64_t>(state.range(0)));
  const auto chunk = state.range(1) ? static_cast<std::uint64_t>(state.range(1)) : f.t;
  for (auto _ : state) {
    f.pass(false, chunk);
    for (auto& g : f.grads) std::fill(g.begin(), g.end(), 0.0f);
    f.pass(true, chunk);
  }
}

}  // namespace

BENCHMARK(BM_forward)->Args({256, 0})->Args({256, 64})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_forward_backward)->Args({256, 0})->Args({256, 64})->Args({256, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
