// A layer with a segment of no parameters before its own (a zero-size tensor, as a layer that
// declares an optional bias of width 0 has): the executors must bind it an empty view and give it
// no gradient, and train the rest as the layer without it (test_host_executor,
// test_cuda_layer_executor).
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

#include "oom/runtime/layer_executor.hpp"

namespace oom::test {

/// `Base` (constructed from (layer index, hidden, inter), one segment of its own) with the segment
/// "blocks.<index>.empty" of one tensor of shape {0} first; its views are dropped before `Base` runs.
template <class Base>
struct WithEmptySegment : Base {
  std::vector<StateSegment> all;
  WithEmptySegment(int index, std::uint64_t hidden, std::uint64_t inter) : Base(index, hidden, inter) {
    const std::string p = fmt::format("blocks.{}.empty", index);
    all.push_back({p, SegmentRole::norm, index, -1, {{p + ".bias", {0}}}});
    for (const auto& s : Base::segments()) all.push_back(s);
  }
  const std::vector<StateSegment>& segments() const { return all; }
  void forward(LayerContext& ctx) const {
    LayerContext c = own(ctx);
    Base::forward(c);
  }
  void backward(LayerContext& ctx) const {
    LayerContext c = own(ctx);
    Base::backward(c);
  }

 private:
  static LayerContext own(const LayerContext& ctx) {
    REQUIRE(ctx.weights.size() == 2);
    REQUIRE(ctx.weight_grads.size() == 2);
    CHECK(ctx.weights[0].empty());
    CHECK(ctx.weight_grads[0].empty());
    LayerContext c = ctx;
    c.weights.erase(c.weights.begin());
    c.weight_grads.erase(c.weight_grads.begin());
    return c;
  }
};

}  // namespace oom::test
