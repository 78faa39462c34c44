// layer conformance: a framework-like layer that declares segments and cost and runs over a
// context satisfies describable_layer and layer; layers missing a piece do not; layer_traits
// fills the optional parts.
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "oom/concepts/layer.hpp"

namespace framework {

struct Context {  // stands in for an executor's per-layer context
  std::vector<float> input, output, grad_output, grad_input;
  const float* weight = nullptr;
};

// y = x * w (one scalar weight): the smallest real layer.
struct ScaleLayer {
  std::vector<oom::StateSegment> segs{{"layers.0.scale", oom::SegmentRole::norm, 0, -1, {{"scale.weight", {1}}}}};
  const std::vector<oom::StateSegment>& segments() const { return segs; }
  oom::LayerCost cost(const oom::Workload& w) const {
    oom::LayerCost c;
    c.forward_flops = static_cast<double>(w.tokens());
    c.backward_flops = 2.0 * static_cast<double>(w.tokens());
    c.activations.push_back({oom::ActivationClass::layer_boundary, oom::Bytes{4 * w.tokens()}, 0});
    c.output = oom::Bytes{4 * w.tokens()};
    return c;
  }
  void forward(Context& ctx) {
    ctx.output.resize(ctx.input.size());
    for (std::size_t i = 0; i < ctx.input.size(); ++i) ctx.output[i] = ctx.input[i] * *ctx.weight;
  }
  void backward(Context& ctx) {
    ctx.grad_input.resize(ctx.grad_output.size());
    for (std::size_t i = 0; i < ctx.grad_output.size(); ++i) ctx.grad_input[i] = ctx.grad_output[i] * *ctx.weight;
  }
  // Optional parts, overriding layer_traits' defaults:
  std::string_view name() const { return "scale"; }
  oom::ChunkDependency chunking() const { return oom::ChunkDependency::independent; }
};

struct NoCost {  // cannot be planned
  std::vector<oom::StateSegment> segments() const { return {}; }
  void forward(Context&) {}
  void backward(Context&) {}
};
struct NoBackward {  // can be planned, not trained
  std::vector<oom::StateSegment> segments() const { return {}; }
  oom::LayerCost cost(const oom::Workload&) const { return {}; }
  void forward(Context&) {}
};
struct SegmentsAreStrings {  // segments of the wrong type
  std::vector<std::string> segments() const { return {}; }
  oom::LayerCost cost(const oom::Workload&) const { return {}; }
  void forward(Context&) {}
  void backward(Context&) {}
};
// A name made per layer, returned by value (as most frameworks would write it).
struct NumberedLayer {
  int index = 12;
  std::vector<oom::StateSegment> segments() const { return {}; }
  oom::LayerCost cost(const oom::Workload&) const { return {}; }
  std::string name() const { return "decoder block number " + std::to_string(index) + " of the stack"; }
};
struct NotRecomputable {
  static constexpr bool recomputable = false;  // e.g. uses dropout with an unreplayable RNG
  static constexpr bool uses_workspace = true;  // its temporaries come from the executor's scratch
  std::vector<oom::StateSegment> segments() const { return {}; }
  oom::LayerCost cost(const oom::Workload&) const { return {}; }
};

}  // namespace framework

static_assert(oom::describable_layer<framework::ScaleLayer>);
static_assert(oom::layer<framework::ScaleLayer, framework::Context>);
static_assert(!oom::layer<framework::ScaleLayer, int>, "forward must accept the executor's context");
static_assert(!oom::describable_layer<framework::NoCost>);
static_assert(!oom::layer<framework::NoCost, framework::Context>);
static_assert(oom::describable_layer<framework::NoBackward>);
static_assert(!oom::layer<framework::NoBackward, framework::Context>);
static_assert(!oom::describable_layer<framework::SegmentsAreStrings>);
static_assert(oom::describable_layer<framework::NotRecomputable>);

TEST_CASE("layer_traits takes what a layer provides and defaults the rest") {
  framework::ScaleLayer scale;
  framework::NotRecomputable plain;
  CHECK(oom::layer_traits<framework::ScaleLayer>::name(scale) == "scale");
  CHECK(oom::layer_traits<framework::ScaleLayer>::chunking(scale) == oom::ChunkDependency::independent);
  CHECK(oom::layer_traits<framework::ScaleLayer>::recomputable);
  CHECK(oom::layer_traits<framework::NotRecomputable>::name(plain) == "layer");
  CHECK(oom::layer_traits<framework::NotRecomputable>::chunking(plain) == oom::ChunkDependency::none);
  CHECK_FALSE(oom::layer_traits<framework::NotRecomputable>::recomputable);
  CHECK_FALSE(oom::layer_traits<framework::ScaleLayer>::uses_workspace);
  CHECK(oom::layer_traits<framework::NotRecomputable>::uses_workspace);
}

TEST_CASE("a name() that returns a std::string by value is kept, not viewed after it is gone") {
  // layer_traits::name had returned a std::string_view of the temporary string: the executor's
  // span labels and describe_layers' names read freed memory (AddressSanitizer: heap-use-after-free).
  const framework::NumberedLayer numbered;
  const auto name = oom::layer_traits<framework::NumberedLayer>::name(numbered);
  CHECK(std::string(name) == "decoder block number 12 of the stack");
}

TEST_CASE("a conforming layer runs forward and backward over its context") {
  framework::ScaleLayer layer;
  const float w = 3.0f;
  framework::Context ctx{{1, 2, 3}, {}, {1, 1, 1}, {}, &w};
  layer.forward(ctx);
  layer.backward(ctx);
  CHECK(ctx.output == std::vector<float>{3, 6, 9});
  CHECK(ctx.grad_input == std::vector<float>{3, 3, 3});
  const auto cost = layer.cost(oom::Workload{2, 8});
  CHECK(cost.activation_bytes() == oom::Bytes{64});
  CHECK(layer.segments().front().parameters() == 1);
}
