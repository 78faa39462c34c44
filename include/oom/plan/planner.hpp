// Planner: joint search over execution path, prefetch depth, retention and residency (chunk sizes
// follow from what the budget leaves), each candidate simulated on the calibrated cost model.
// Returns the best few plans within the GPU and host budgets, each explainable, or an error naming
// the least bytes any plan would need.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "oom/model/model_spec.hpp"
#include "oom/plan/machine_profile.hpp"
#include "oom/plan/plan.hpp"
#include "oom/plan/simulator.hpp"

namespace oom {

struct PlanSet {
  std::vector<Plan> plans;  ///< best first
  int evaluated = 0;        ///< candidates simulated
  int feasible = 0;         ///< of which within both budgets
  double search_s = 0;
};

class Planner {
 public:
  /// `model_name` is recorded in plans (e.g. the config's path), with model_fingerprint(spec).
  /// `profile_file` is the file the profile was read from, named beside the profile's own name in
  /// errors about it (empty: a built-in profile).
  Planner(const ModelSpec& spec, const MachineProfile& profile, std::string model_name = {}, std::string profile_file = {});
  /// It keeps pointers to the profile and the spec: a temporary of either would dangle.
  Planner(const ModelSpec& spec, MachineProfile&& profile, std::string model_name = {}, std::string profile_file = {}) = delete;
  Planner(ModelSpec&& spec, const MachineProfile& profile, std::string model_name = {}, std::string profile_file = {}) = delete;
  Planner(ModelSpec&& spec, MachineProfile&& profile, std::string model_name = {}, std::string profile_file = {}) = delete;

  /// Throws Errc::invalid_argument for a malformed request and Errc::out_of_budget, naming the
  /// least GPU and host bytes a plan needs and the claimant that dominates, when nothing fits.
  [[nodiscard]] PlanSet plan(const PlanRequest& request) const;
  /// Where plan(request) finds nothing: the least GPU budget (per GPU, a whole number of MiB) at
  /// which plan() returns a plan for the same request, found by doubling from its gpu_budget and
  /// then bisecting to within `tolerance` of the answer (a fraction; at least 1 MiB). Every figure
  /// returned is one plan() found a plan at, so `--gpu-mem` set to it plans (the out_of_budget
  /// error's figure is an estimate: 18% low for Qwen3-30B-A3B at 4K). Feasibility is not quite
  /// monotonic in the budget (chunks follow it), so a little less may fit too. nullopt where
  /// nothing fits up to `most` (a host budget too small for any plan); the request's own budget
  /// when it fits. Errors other than out_of_budget propagate.
  [[nodiscard]] std::optional<Bytes> least_gpu_budget(PlanRequest request, double tolerance = 0.005,
                                                      Bytes most = Bytes{std::uint64_t{1} << 50}) const;

  /// The step graph of a plan (the one the prediction was simulated on). A plan from elsewhere
  /// (read from JSON, written by hand) is checked against the model first: Errc::invalid_argument
  /// naming the field and layer for another layer count, counts out of range
  /// (check_plan_counts), attention chunk ends that do not rise from 0 to seq_len, 0 loss rows,
  /// or a resident segment the model lacks.
  [[nodiscard]] StepGraph step_graph(const Plan& plan) const;
  /// Re-simulates a plan (e.g. one read from JSON) on this planner's profile; checked as step_graph.
  [[nodiscard]] SimResult simulate(const Plan& plan) const;
  /// Every segment's name, in the order the planner makes segments resident for `plan`'s
  /// workload and path (time saved per GPU byte, earlier layers first among equals): a plan's
  /// resident set is a prefix of it. For an executor that finds GPU memory the plan left unused
  /// (CudaCausalLm::fit). The plan is checked as step_graph checks it.
  [[nodiscard]] std::vector<std::string> residency_order(const Plan& plan) const;

  /// A readable account of one plan: memory per claimant per GPU and on the host, policies,
  /// predicted time per resource.
  [[nodiscard]] std::string describe(const Plan& plan) const;
  /// Why `best` beat `runner_up`, in a few lines.
  [[nodiscard]] static std::string compare(const Plan& best, const Plan& runner_up);

  [[nodiscard]] const ModelSpec& spec() const { return *spec_; }
  [[nodiscard]] const MachineProfile& profile() const { return *profile_; }
  /// The model's fingerprint (oom::model_fingerprint), as the plans it makes carry it.
  [[nodiscard]] const std::string& model_fingerprint() const { return model_fingerprint_; }

 private:
  const ModelSpec* spec_;
  const MachineProfile* profile_;
  std::string model_name_;
  std::string model_fingerprint_;
  std::string profile_file_;
};

/// What a plan depends on in a model, as 16 lowercase hex digits (FNV-1a 64 of its family,
/// widths, each layer's attention and MLP kinds, and every segment's tensors by name and shape):
/// the same for one config whatever its path (oom-plan records the path as typed, oom-train may
/// read the same config from a checkpoint or have it built in), another for a model of other
/// widths. Plans carry it (Plan::model_fingerprint); oom-train refuses a plan of another.
[[nodiscard]] std::string model_fingerprint(const ModelSpec& spec);

}  // namespace oom
