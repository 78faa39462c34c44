// Conformance of the policy contracts: residency_policy, retention_policy, partitioner and
// cost_model, each with types that satisfy them and near misses that must not; plus the
// run-time halves of the contracts (valid_retention, satisfies_partition_contract).
#include <doctest/doctest.h>

#include <algorithm>
#include <string_view>

#include "oom/concepts/cost_model.hpp"
#include "oom/concepts/partitioner.hpp"
#include "oom/concepts/residency_policy.hpp"
#include "oom/concepts/retention_policy.hpp"
#include "oom/core/error.hpp"

using namespace oom;
using namespace oom::literals;

// ---- residency_policy ----
struct FirstLayersResident {
  int n = 2;
  Placement place(const StateSegment& s) const {
    return s.layer >= 0 && s.layer < n ? Placement::on_device(0) : Placement::host();
  }
  std::string_view name() const { return "first-layers-resident"; }
};
struct ExpertsOnOwner {  // expert-parallel: expert e lives on GPU e % gpus
  int gpus = 2;
  Placement place(const StateSegment& s) const {
    return s.expert >= 0 ? Placement::on_device(s.expert % gpus) : Placement::host();
  }
  const char* name() const { return "experts-on-owner"; }
};
struct PlaceReturnsBool {
  bool place(const StateSegment&) const { return true; }
  std::string_view name() const { return "bool"; }
};
struct UnnamedResidency {
  Placement place(const StateSegment&) const { return Placement::host(); }
};
static_assert(residency_policy<FirstLayersResident>);
static_assert(residency_policy<ExpertsOnOwner>);
static_assert(!residency_policy<PlaceReturnsBool>);
static_assert(!residency_policy<UnnamedResidency>);
static_assert(!residency_policy<int>);

TEST_CASE("residency policies place segments") {
  const StateSegment early{"layers.1.attn", SegmentRole::attention, 1, -1, {}};
  const StateSegment late{"layers.9.attn", SegmentRole::attention, 9, -1, {}};
  const StateSegment expert{"layers.9.experts.5", SegmentRole::expert, 9, 5, {}};
  CHECK(FirstLayersResident{}.place(early) == Placement::on_device(0));
  CHECK(FirstLayersResident{}.place(late) == Placement::host());
  CHECK(ExpertsOnOwner{}.place(expert) == Placement::on_device(1));
  CHECK(ExpertsOnOwner{}.place(expert).resident());
  CHECK_FALSE(ExpertsOnOwner{}.place(late).resident());
}

// ---- retention_policy ----
struct CheckpointEveryLayer {
  RetentionDecision retain(int layer, ActivationClass c) const {
    return c == ActivationClass::layer_boundary ? RetentionDecision::keep() : RetentionDecision::recompute(layer);
  }
  std::string_view name() const { return "checkpoint-every-layer"; }
};
struct RecomputeFromDroppedBoundary {  // satisfies the concept, breaks requirement 2
  RetentionDecision retain(int layer, ActivationClass) const { return RetentionDecision::recompute(layer); }
  std::string_view name() const { return "broken"; }
};
struct RecomputeFromTheFuture {  // recompute from a later layer: breaks requirement 2
  RetentionDecision retain(int layer, ActivationClass c) const {
    return c == ActivationClass::layer_boundary ? RetentionDecision::offload() : RetentionDecision::recompute(layer + 1);
  }
  std::string_view name() const { return "future"; }
};
struct RegenerateInPairs {  // even layers offload their boundary, odd ones regenerate theirs from it
  RetentionDecision retain(int layer, ActivationClass c) const {
    if (c != ActivationClass::layer_boundary) return RetentionDecision::recompute(layer);  // from its own, regenerated or not
    return layer % 2 == 0 ? RetentionDecision::offload() : RetentionDecision::recompute(layer - 1);
  }
  std::string_view name() const { return "regenerate-in-pairs"; }
};
struct RegenerateFromRegenerated {  // layer 2's boundary from layer 1's, itself regenerated: breaks requirement 2
  RetentionDecision retain(int layer, ActivationClass c) const {
    if (c != ActivationClass::layer_boundary || layer == 0) return RetentionDecision::keep();
    return RetentionDecision::recompute(layer - 1);
  }
  std::string_view name() const { return "chain"; }
};
struct RetainTakesString {
  RetentionDecision retain(int, std::string_view) const { return {}; }
  std::string_view name() const { return "s"; }
};
struct RetainReturnsEnum {
  Retention retain(int, ActivationClass) const { return Retention::keep; }
  std::string_view name() const { return "e"; }
};
static_assert(retention_policy<CheckpointEveryLayer>);
static_assert(retention_policy<RecomputeFromDroppedBoundary>);
static_assert(!retention_policy<RetainTakesString>);
static_assert(!retention_policy<RetainReturnsEnum>);

TEST_CASE("valid_retention accepts recompute from a kept boundary, rejects the rest") {
  CHECK(valid_retention(CheckpointEveryLayer{}, 8));
  CHECK_FALSE(valid_retention(RecomputeFromDroppedBoundary{}, 8));
  CHECK_FALSE(valid_retention(RecomputeFromTheFuture{}, 8));
  // Boundaries regenerated from a kept or offloaded one, and a layer's classes from its own
  // regenerated boundary (the planner's hybrid-regenerate); not a boundary from a regenerated one.
  CHECK(valid_retention(RegenerateInPairs{}, 8));
  CHECK_FALSE(valid_retention(RegenerateFromRegenerated{}, 8));
}

// ---- partitioner ----
struct EvenSplit {  // ignores the budget: satisfies the concept, may break requirement 2
  std::uint64_t n = 4;
  Partition partition(const WorkItem& w, Bytes) const {
    Partition p;
    const std::uint64_t step = (w.extent + n - 1) / n;
    for (std::uint64_t b = 0; b < w.extent; b += step) {
      const std::uint64_t e = std::min(w.extent, b + step);
      p.chunks.push_back({b, e, live_bytes(w, b, e)});
      p.peak = max(p.peak, p.chunks.back().live);
    }
    return p;
  }
};
struct ReversedSplit {  // walks the chunks backwards: wrong for causal and scan dependencies
  Partition partition(const WorkItem& w, Bytes budget) const {
    Partition p = EvenSplit{}.partition(w, budget);
    std::reverse(p.chunks.begin(), p.chunks.end());
    return p;
  }
};
struct PartitionReturnsSizes {
  std::vector<std::uint64_t> partition(const WorkItem&, Bytes) const { return {}; }
};
struct PartitionTakesBareBudget {
  Partition partition(const WorkItem&, std::uint64_t) const { return {}; }
};
static_assert(partitioner<EvenSplit>);
static_assert(partitioner<ReversedSplit>);
static_assert(!partitioner<PartitionReturnsSizes>);
static_assert(!partitioner<PartitionTakesBareBudget>, "budgets are Bytes, never bare integers");

TEST_CASE("the partition contract checks coverage, budget and dependency order") {
  WorkItem experts;
  experts.extent = 1000;
  experts.fixed = 1_MiB;
  experts.per_unit = 4_KiB;
  WorkItem causal = experts;
  causal.dependency = ChunkDependency::causal_prefix;
  causal.per_prefix_unit = 1_KiB;
  const Bytes roomy = 64_MiB;
  CHECK(satisfies_partition_contract(experts, EvenSplit{}.partition(experts, roomy), roomy));
  CHECK(satisfies_partition_contract(causal, EvenSplit{}.partition(causal, roomy), roomy));
  // Reversed order is fine for independent chunks, not for causal ones.
  CHECK(satisfies_partition_contract(experts, ReversedSplit{}.partition(experts, roomy), roomy));
  CHECK_FALSE(satisfies_partition_contract(causal, ReversedSplit{}.partition(causal, roomy), roomy));
  // A budget the even split ignores: its chunks overflow it.
  const Bytes tight = 1_MiB + 200_KiB;
  CHECK_FALSE(satisfies_partition_contract(experts, EvenSplit{}.partition(experts, tight), tight));
  // Causal chunks grow with the prefix they read.
  const auto p = EvenSplit{}.partition(causal, roomy);
  CHECK(p.chunks.back().live > p.chunks.front().live);
  // Lost or overlapping coverage is caught.
  auto gap = EvenSplit{}.partition(experts, roomy);
  gap.chunks.erase(gap.chunks.begin() + 1);
  CHECK_FALSE(satisfies_partition_contract(experts, gap, roomy));
}

// ---- cost_model ----
struct Roofline {
  double flops_per_s = 800e12;
  double pcie_bytes_per_s = 55e9;
  ResourceTimes predict(const Operation& op) const {
    ResourceTimes t;
    switch (op.kind) {
      case OpKind::copy_h2d: t[Resource::h2d] = static_cast<double>(op.bytes.count()) / pcie_bytes_per_s; break;
      case OpKind::copy_d2h: t[Resource::d2h] = static_cast<double>(op.bytes.count()) / pcie_bytes_per_s; break;
      default: t[Resource::gpu_compute] = op.flops() / flops_per_s; break;
    }
    return t;
  }
};
struct PredictsSeconds {
  double predict(const Operation&) const { return 0; }
};
struct MutablePredict {  // predict must be callable on a const model
  ResourceTimes predict(const Operation&) { return {}; }
};
static_assert(cost_model<Roofline>);
static_assert(!cost_model<PredictsSeconds>);
static_assert(!cost_model<MutablePredict>);

TEST_CASE("a roofline cost model uses only the resources an op needs, monotonically") {
  const Roofline model;
  Operation copy;
  copy.kind = OpKind::copy_h2d;
  copy.bytes = 1_GiB;
  const auto t = model.predict(copy);
  CHECK(t[Resource::h2d] > 0);
  CHECK(t[Resource::gpu_compute] == 0);
  CHECK(t.longest() == t[Resource::h2d]);
  Operation small = Operation::gemm(1024, 1024, 1024);
  Operation big = Operation::gemm(2048, 1024, 1024);
  CHECK(model.predict(big)[Resource::gpu_compute] > model.predict(small)[Resource::gpu_compute]);
  CHECK(small.flops() == doctest::Approx(2.0 * 1024 * 1024 * 1024));
  Operation attn = Operation::attention(false, 4096, 4096, 128, 16);
  Operation attn_bwd = attn;
  attn_bwd.kind = OpKind::attention_backward;
  CHECK(attn_bwd.flops() == doctest::Approx(2.5 * attn.flops()));
}
