// The planner's policies: ResidencySet (a residency_policy: the segments kept on GPU) and
// RetentionTable (a retention_policy: one decision per layer and activation class), with the
// retention templates the planner searches over.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "oom/concepts/residency_policy.hpp"
#include "oom/concepts/retention_policy.hpp"
#include "oom/model/model_spec.hpp"

namespace oom {

/// Segments resident on the GPUs, by index into ModelSpec::segments(). On the local path a
/// resident segment lives on every GPU (each runs every layer); on the expert-parallel path an
/// expert lives on its owner, GPU `expert % gpus`, and other segments on every GPU.
class ResidencySet {
 public:
  ResidencySet() = default;
  ResidencySet(const ModelSpec& spec, std::vector<bool> resident, int gpus, bool expert_parallel);

  [[nodiscard]] Placement place(const StateSegment& s) const;
  [[nodiscard]] std::string_view name() const { return "planned-residency"; }

  [[nodiscard]] bool resident(std::size_t segment) const { return segment < resident_.size() && resident_[segment]; }
  [[nodiscard]] std::size_t resident_count() const;
  [[nodiscard]] const std::vector<bool>& mask() const { return resident_; }

 private:
  std::vector<bool> resident_;
  std::unordered_map<std::string, std::size_t> index_;
  int gpus_ = 1;
  bool expert_parallel_ = false;
};
static_assert(residency_policy<ResidencySet>);

enum class RetentionTemplate : unsigned char {
  keep_all,           ///< everything stays on the GPU
  checkpoint,         ///< keep each layer's boundary, recompute the rest from it
  offload_checkpoint, ///< offload each boundary to host, recompute the rest from it
  keep_attention,     ///< keep boundary and attention results, recompute the MoE part
  offload_attention,  ///< offload boundary and attention results, recompute the MoE part
  hybrid_regenerate,  ///< hybrid models: full-attention results to host, boundaries offloaded at
                      ///< full-attention layers and regenerated through the linear-attention layers
};
inline constexpr int retention_template_count = 6;
const char* to_string(RetentionTemplate t) noexcept;

class RetentionTable {
 public:
  RetentionTable() = default;
  /// The last `layers_near_loss` layers (whose activations backward needs first) follow `near`,
  /// the others `far`.
  RetentionTable(const ModelSpec& spec, RetentionTemplate far, RetentionTemplate near, int layers_near_loss);

  [[nodiscard]] RetentionDecision retain(int layer, ActivationClass c) const {
    return table_.at(static_cast<std::size_t>(layer))[static_cast<std::size_t>(c)];
  }
  [[nodiscard]] std::string_view name() const { return name_; }
  [[nodiscard]] int layers() const { return static_cast<int>(table_.size()); }

 private:
  std::vector<std::array<RetentionDecision, activation_class_count>> table_;
  std::string name_;
};
static_assert(retention_policy<RetentionTable>);

}  // namespace oom
