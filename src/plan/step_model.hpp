// StepModel (internal to the planner): what one layer of a model costs for a request, from the
// ModelSpec and the ProfileCostModel: streamed and resident parameters, saved bytes by activation
// class, chunkable work items, and chunked forward/backward/recompute times.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "oom/concepts/partitioner.hpp"
#include "oom/concepts/retention_policy.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/plan/cost_model.hpp"
#include "oom/plan/machine_profile.hpp"
#include "oom/plan/plan.hpp"

namespace oom::detail {

/// Parameters of one (pseudo-)layer by where they live, in GPU 0's view.
struct LayerState {
  std::uint64_t resident_params = 0;     ///< held and updated on this GPU
  std::uint64_t streamed_params = 0;     ///< streamed to this GPU each pass
  std::uint64_t host_params = 0;         ///< on the host, node-wide (all owners)
  std::uint64_t host_expert_params = 0;  ///< of which experts (expert-parallel: owner-only gradients)
};

class StepModel {
 public:
  StepModel(const ModelSpec& spec, const MachineProfile& profile, const PlanRequest& req, ExecutionPath path);
  /// It keeps a reference to the profile: a temporary would dangle.
  StepModel(const ModelSpec& spec, MachineProfile&& profile, const PlanRequest& req, ExecutionPath path) = delete;

  [[nodiscard]] std::uint64_t tokens() const;
  /// Layer -1 is the embedding, num_layers() the final norm + LM head.
  [[nodiscard]] LayerState layer_state(int layer, const std::vector<bool>& resident) const;
  /// Every (pseudo-)layer's state, embedding first: index layer + 1.
  [[nodiscard]] std::vector<LayerState> layer_states(const std::vector<bool>& resident) const;
  /// Updates `states` (from layer_states) for `segment` turning resident.
  void make_resident(std::vector<LayerState>& states, std::size_t segment) const;
  [[nodiscard]] int segment_layer(std::size_t segment) const { return seg_layer_[segment]; }
  [[nodiscard]] std::uint64_t segment_params(std::size_t segment) const { return seg_params_[segment]; }
  [[nodiscard]] int segment_owner(std::size_t segment) const { return seg_owner_[segment]; }
  [[nodiscard]] int expert_owner(const StateSegment& s) const;
  [[nodiscard]] std::uint64_t state_bytes_per_param(bool on_gpu) const;

  [[nodiscard]] WorkItem attention_item(int layer) const;
  [[nodiscard]] WorkItem mlp_item(int layer) const;
  [[nodiscard]] WorkItem loss_item() const;
  [[nodiscard]] std::array<Bytes, activation_class_count> saved_bytes(int layer) const;

  [[nodiscard]] double attention_time(int layer, const Partition& part, bool backward, bool core_only) const;
  [[nodiscard]] double mlp_time(int layer, std::uint64_t chunk_tokens, bool backward, bool up_only) const;
  [[nodiscard]] double all_to_all_time(int layer) const;
  [[nodiscard]] double loss_time(std::uint64_t rows, bool backward) const;
  /// Weight values of `layer`'s MLP half whose gradients this GPU sums over the MoE chunks (its
  /// experts and the shared expert; or the dense MLP).
  [[nodiscard]] std::uint64_t mlp_weight_values(int layer) const;
  /// Experts one GPU runs: all on the local path, its share on the expert-parallel one.
  [[nodiscard]] std::uint64_t local_experts() const;
  [[nodiscard]] double recompute_time(int layer, const std::array<RetentionDecision, activation_class_count>& row,
                                      const Partition& attn, std::uint64_t mlp_chunk) const;
  [[nodiscard]] double time_of(const Operation& op, Resource r) const;
  [[nodiscard]] const ProfileCostModel& cost() const { return cost_; }
  [[nodiscard]] const PlanRequest& request() const { return req_; }
  [[nodiscard]] ExecutionPath path() const { return path_; }

 private:
  void check_countable() const;
  const ModelSpec& spec_;
  const MachineProfile& profile_;
  PlanRequest req_;
  ExecutionPath path_;
  ProfileCostModel cost_;
  std::vector<int> seg_layer_;
  std::vector<std::uint64_t> seg_params_;
  std::vector<int> seg_owner_;  ///< expert_owner() of each segment
  std::vector<std::vector<std::size_t>> layer_segments_;  ///< by layer + 1 (embedding first, head last)
};

}  // namespace oom::detail
