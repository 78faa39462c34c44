// The planner: the step graph of a plan, and the search over candidate plans.
#include "oom/plan/planner.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/plan/dependency_partitioner.hpp"
#include "oom/plan/policies.hpp"
#include "fingerprint.hpp"
#include "step_model.hpp"

namespace oom {

void check_boundary_regeneration(const Plan& plan, std::size_t l) {
  const auto boundary = [&](std::size_t j) { return plan.retention[j][static_cast<std::size_t>(ActivationClass::layer_boundary)]; };
  const int from = boundary(l).recompute_from;
  if (from < 0 || from >= static_cast<int>(l))
    OOM_THROW(Errc::invalid_argument, fmt::format("layer {}: its boundary is regenerated from layer {}, which is not below it", l, from));
  const auto f = static_cast<std::size_t>(from);
  if (boundary(f).action == Retention::recompute)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("layer {}: its boundary is regenerated from layer {}, whose own boundary is regenerated too", l, from));
  for (std::size_t j = f + 1; j < l; ++j)
    if (boundary(j).action != Retention::recompute || boundary(j).recompute_from != from)
      OOM_THROW(Errc::unsupported, fmt::format("layer {}: its boundary is regenerated from layer {} but layer {}'s is not (the "
                                               "executors regenerate a group of consecutive boundaries from the group's first)",
                                               l, from, j));
}

void check_recompute_sources(const Plan& p, std::size_t l) {
  for (int c = 0; c < activation_class_count; ++c) {
    const auto d = p.retention[l][static_cast<std::size_t>(c)];
    if (d.action != Retention::recompute) continue;
    if (c == static_cast<int>(ActivationClass::layer_boundary)) check_boundary_regeneration(p, l);
    else if (d.recompute_from != static_cast<int>(l))
      OOM_THROW(Errc::unsupported, fmt::format("layer {}: {} recomputed from layer {} (a layer's saved activations are recomputed "
                                               "from its own boundary; boundaries are what earlier layers regenerate)",
                                               l, to_string(static_cast<ActivationClass>(c)), d.recompute_from));
  }
}

std::string describe_precision(const StatePrecision& p) {
  if (p == StatePrecision{}) return {};
  return fmt::format("state: {} weights, {} master, {} AdamW moments, {} gradients\n", name(p.weights), name(p.master), name(p.moments),
                     name(p.grads));
}

std::string describe_boundaries(const Plan& p) {
  std::array<std::size_t, 3> n{};  // keep, offload, recompute
  for (const auto& row : p.retention) ++n[static_cast<std::size_t>(row[static_cast<std::size_t>(ActivationClass::layer_boundary)].action)];
  return fmt::format("boundaries: {} kept, {} offloaded, {} regenerated through the layers below them", n[0], n[1], n[2]);
}

void check_plan_request(const PlanRequest& req) {
  if (req.gpus < 1 || req.gpus > max_plan_gpus)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan request: gpus must be 1 to {}, not {}", max_plan_gpus, req.gpus));
  if (req.workload.sequences == 0 || req.workload.seq_len == 0)
    OOM_THROW(Errc::invalid_argument, "plan request: the workload has no tokens (seq and batch must be > 0)");
  if (!req.workload.within_limit())
    OOM_THROW(Errc::invalid_argument, fmt::format("plan request: {} sequences of {} tokens is more than the {} tokens a micro-batch may hold",
                                                  req.workload.sequences, req.workload.seq_len, max_workload_tokens));
  if (req.micro_batches < 1 || req.micro_batches > max_micro_batches)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("plan request: micro_batches must be 1 to {}, not {}", max_micro_batches, req.micro_batches));
  if (req.gpu_budget.count() == 0 || req.host_budget.count() == 0)
    OOM_THROW(Errc::invalid_argument, "plan request: GPU and host budgets must be > 0");
  // 0 or fewer had been taken as 1: an answer other than the one asked for.
  if (req.candidates < 1)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan request: candidates (plans to return) must be at least 1, not {}", req.candidates));
}

void check_plan_counts(const Plan& p) {
  if (p.gpus < 1 || p.gpus > max_plan_gpus)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan: gpus must be 1 to {}, not {}", max_plan_gpus, p.gpus));
  if (p.prefetch_depth < 1 || p.prefetch_depth > max_prefetch_depth)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan: prefetch_depth {} (1 to {}) is out of range: weight slots, layers in flight",
                                                  p.prefetch_depth, max_prefetch_depth));
  if (p.micro_batches < 1 || p.micro_batches > max_micro_batches)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("plan: micro_batches {} (1 to {}) is out of range", p.micro_batches, max_micro_batches));
  if (!p.workload.within_limit() || p.workload.tokens() == 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan: {} sequences of {} tokens (1 to {} tokens a micro-batch)", p.workload.sequences,
                                                  p.workload.seq_len, max_workload_tokens));
  for (std::size_t l = 0; l < p.chunks.size(); ++l)
    if (p.chunks[l].moe_tokens == 0)
      OOM_THROW(Errc::invalid_argument, fmt::format("plan, layer {}: a chunk of 0 tokens (moe_tokens, > 0; the whole micro-batch is {} "
                                                    "tokens)",
                                                    l, p.workload.tokens()));
}

namespace {

using detail::LayerState;

// Recomputed activations of the MLP part are regenerated chunk by chunk inside its backward (experts
// are independent per token chunk), so they live in the chunk workset; the others are regenerated
// for the whole layer and held until its backward ends.
bool held_when_recomputed(ActivationClass c) {
  return c != ActivationClass::layer_boundary && c != ActivationClass::router_output &&
         c != ActivationClass::permuted_tokens && c != ActivationClass::expert_intermediate;
}
using detail::StepModel;

constexpr std::uint64_t fp32_bytes = 4;
/// What the estimate before simulating leaves unclaimed: chunk worksets are sized to the budget
/// less this share, so that what the estimate misses (allocator alignment, the graph's overlap of
/// one layer's work with the next's loads) has room; the simulated peak is then held to the whole
/// budget, which the profile gives as usable after the CUDA context and library workspaces.
constexpr double gpu_margin = 0.04;

PlanRequest request_of(const Plan& p) {
  PlanRequest r;
  r.gpus = p.gpus;
  r.gpu_budget = p.gpu_budget;
  r.host_budget = p.host_budget;
  r.workload = p.workload;
  r.micro_batches = p.micro_batches;
  r.clip_grad_norm = p.clip_grad_norm;
  r.precision = p.precision;
  return r;
}

Partition partition_from_ends(const WorkItem& w, const std::vector<std::uint64_t>& ends) {
  Partition p;
  std::uint64_t b = 0;
  for (auto e : ends) {
    p.chunks.push_back({b, e, live_bytes(w, b, e)});
    p.peak = max(p.peak, p.chunks.back().live);
    b = e;
  }
  return p;
}

std::vector<bool> resident_mask(const ModelSpec& spec, const std::vector<std::string>& names) {
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < spec.segments().size(); ++i) index.emplace(spec.segments()[i].name, i);
  std::vector<bool> mask(spec.segments().size(), false);
  for (const auto& n : names) {
    const auto it = index.find(n);
    if (it == index.end()) OOM_THROW(Errc::invalid_argument, "plan names resident segment '" + n + "', which this model does not have");
    // Named twice, it had been counted once in the graph and twice by describe() ("48 of 47
    // segments resident"), and an edited plan taken for another model's.
    if (mask[it->second]) OOM_THROW(Errc::invalid_argument, "plan names resident segment '" + n + "' twice (resident_segments)");
    mask[it->second] = true;
  }
  return mask;
}

// What the step graph of a plan someone else made needs of it, beyond check_plan_counts: a layer
// count of the model's, each layer's attention chunk ends rising from 0 to seq_len (as the planner
// partitions a sequence), loss rows per chunk. Without them the graph divides by 0 or prices a
// chunk of 2^64 - x tokens.
void check_plan(const Plan& p, const ModelSpec& spec, const MachineProfile& profile) {
  const auto n = static_cast<std::size_t>(spec.num_layers());
  if (p.retention.size() != n || p.chunks.size() != n)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan has retention for {} and chunks for {} layers; the model has {}",
                                                  p.retention.size(), p.chunks.size(), n));
  check_plan_counts(p);
  for (std::size_t l = 0; l < n; ++l) {
    const auto& ends = p.chunks[l].attention;
    for (std::size_t i = 0; i < ends.size(); ++i)
      if (const std::uint64_t before = i == 0 ? 0 : ends[i - 1]; ends[i] <= before)
        OOM_THROW(Errc::invalid_argument, fmt::format("plan, layer {}: attention chunk end {} is {}, not past {} (the ends rise from 0 "
                                                      "to seq_len {})",
                                                      l, i, ends[i], before, p.workload.seq_len));
    if (ends.empty() || ends.back() != p.workload.seq_len)
      OOM_THROW(Errc::invalid_argument, fmt::format("plan, layer {}: the attention chunks end at {}, not at seq_len {}", l,
                                                    ends.empty() ? 0 : ends.back(), p.workload.seq_len));
  }
  if (p.loss_rows == 0) OOM_THROW(Errc::invalid_argument, "plan: loss_rows is 0 (rows per LM-head/cross-entropy chunk, > 0)");
  // Recomputes as the executors run them and the graph prices them (a boundary regenerated from a
  // layer the model lacks had indexed past the plan's rows).
  for (std::size_t l = 0; l < n; ++l) check_recompute_sources(p, l);
  if (p.gpus > profile.gpus)  // its collectives would be priced at the profile's rate of 0: a step of inf
    OOM_THROW(Errc::invalid_argument, fmt::format("plan: for {} GPUs; profile '{}' describes {}", p.gpus, profile.name, profile.gpus));
  if (p.path == ExecutionPath::expert_parallel && spec.moe().experts % static_cast<std::uint64_t>(p.gpus) != 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan: the expert-parallel path over {} GPUs, but {} experts do not divide among them",
                                                  p.gpus, spec.moe().experts));
}

// Builds the step graph of `plan` for `spec` (see docs/planner.md, "Step graph").
class GraphBuilder {
 public:
  /// `mask`, when given, is the plan's resident set by segment index (the search has it at hand;
  /// plans read from JSON name their segments instead).
  /// `states`, when given, are the plan's per-layer parameter placements (the search has them at
  /// hand; plans read from JSON name their resident segments instead).
  GraphBuilder(const StepModel& model, const ModelSpec& spec, const Plan& plan, const std::vector<LayerState>* states = nullptr)
      : spec_(spec), plan_(plan), model_(model),
        states_(states ? *states : model.layer_states(resident_mask(spec, plan.resident_segments))) {
    const int n = spec.num_layers();  // check_plan: the plan's layers
    for (int l = 0; l < n; ++l) {
      attn_.push_back(partition_from_ends(model_.attention_item(l), plan.chunks[static_cast<std::size_t>(l)].attention));
      saved_.push_back(model_.saved_bytes(l));
    }
  }

  StepGraph build() {
    const int n = spec_.num_layers();
    fwd_last_.assign(static_cast<std::size_t>(n + 2), -1);
    bwd_last_.assign(static_cast<std::size_t>(n + 2), -1);
    d2h_act_.assign(static_cast<std::size_t>(n), -1);
    regenerated_.assign(static_cast<std::size_t>(n), false);
    d2h_grads_.assign(static_cast<std::size_t>(n), -1);
    slot_d2h_ = {-1, -1};
    int prev = -1;
    for (int mb = 0; mb < plan_.micro_batches; ++mb) {
      const bool last_mb = mb + 1 == plan_.micro_batches;
      refill_grads_ = mb > 0 && plan_.grad_accumulation == GradAccumulation::device;
      std::fill(regenerated_.begin(), regenerated_.end(), false);
      std::fill(d2h_act_.begin(), d2h_act_.end(), -1);  // this micro-batch's offloads, as they are added
      boundary_back_.assign(static_cast<std::size_t>(n), -1);
      prefetch_op_.clear();
      prefetch_pending_.assign(static_cast<std::size_t>(n), false);
      plan_loads(n);
      prev = embedding_forward(prev);
      for (int l = 0; l < n; ++l) prev = layer_forward(l, prev);
      prev = head(prev, last_mb);
      for (int l = n - 1; l >= 0; --l) prev = layer_backward(l, prev, last_mb);
      prev = embedding_backward(prev, last_mb);
      // What this micro-batch saved for its backward is freed by that backward, not a later
      // micro-batch's (resolved now, while bwd_last_ holds this micro-batch's ops).
      for (const auto& h : deferred_) g_.hold(h.claimant, h.bytes, h.from, resolve(h.to));
      deferred_.clear();
    }
    if (!clipped_updates_.empty()) {
      // Clipping: the gradients' sums of squares (one read of every gradient; the executors take
      // them per layer as the gradients are made, summed here as one pass), then every update.
      std::uint64_t params = 0;
      for (const auto& s : states_) params += s.resident_params + s.streamed_params;
      const int norm = g_.add({"gpu.grad_norm", Resource::gpu_compute,
                               model_.time_of(Operation::moving(OpKind::memory_bound, Bytes{params * fp32_bytes}), Resource::gpu_compute),
                               {prev}, -1});
      for (auto op : clipped_updates_) {
        op.deps.push_back(norm);
        g_.add(std::move(op));
      }
    }
    add_constant_holds();
    return std::move(g_);
  }

 private:
  struct Load {
    int layer;
    bool backward;
  };
  struct Deferred {
    Claimant claimant;
    Bytes bytes;
    int from;
    int to;  // >= 0: op id; < 0: -(layer + 2) for "backward end of layer"
  };

  const LayerState& st(int layer) const { return states_[static_cast<std::size_t>(layer + 1)]; }
  Bytes weight_bytes(int layer) const { return bytes_of(plan_.precision.weights, st(layer).streamed_params); }
  int resolve(int to) const { return to >= 0 ? to : bwd_last_[static_cast<std::size_t>(-to - 2 + 1)]; }
  static int bwd_end_of(int layer) { return -(layer + 2); }

  // The order in which weights enter slots: forward 0..n-1, the head, backward n-1..0.
  void plan_loads(int n) {
    loads_.clear();
    load_op_.clear();
    release_op_.clear();
    for (int l = 0; l < n; ++l) loads_.push_back({l, false});
    loads_.push_back({n, false});
    for (int l = n - 1; l >= 0; --l) loads_.push_back({l, true});
    load_op_.assign(loads_.size(), -1);
    release_op_.assign(loads_.size(), -1);
    issued_ = 0;
    next_compute_ = 0;
  }

  // Issues the H2D of loads up to `upto` (at most depth ahead of the compute that needs them);
  // a load waits for the slot freed by the load `depth` before it.
  void issue_loads_through(std::size_t upto) {
    const auto depth = static_cast<std::size_t>(plan_.prefetch_depth);
    while (issued_ <= upto && issued_ < loads_.size()) {
      const std::size_t j = issued_++;
      const int layer = loads_[j].layer;
      std::vector<int> deps;
      if (j >= depth && release_op_[j - depth] >= 0) deps.push_back(release_op_[j - depth]);
      const Bytes w = weight_bytes(layer);
      if (w.count() > 0)
        load_op_[j] = g_.add({loads_[j].backward ? "h2d.weights.bwd" : "h2d.weights", Resource::h2d,
                              model_.time_of(Operation::moving(OpKind::copy_h2d, w), Resource::h2d), deps, layer});
      if (loads_[j].backward && layer < spec_.num_layers()) prefetch_activations(layer);
    }
  }

  // Returns the load op for the next compute and keeps `depth - 1` more in flight.
  int begin_compute() {
    const std::size_t k = next_compute_;
    issue_loads_through(k + static_cast<std::size_t>(plan_.prefetch_depth) - 1);
    return load_op_[k];
  }
  void end_compute(int first_op, int last_op) {
    const std::size_t k = next_compute_++;
    release_op_[k] = last_op;
    const int layer = loads_[k].layer;
    if (load_op_[k] >= 0) g_.hold(Claimant::worksets, weight_bytes(layer), load_op_[k], last_op);
    (void)first_op;
  }

  static std::vector<int> deps_of(std::initializer_list<int> ids) {
    std::vector<int> d;
    for (int i : ids)
      if (i >= 0) d.push_back(i);
    return d;
  }

  int embedding_forward(int prev) {
    const std::uint64_t h = spec_.hidden_size();
    const std::uint64_t t = model_.tokens();
    int rows = -1;
    if (st(-1).streamed_params > 0)  // rows gathered on the host, sent up
      rows = g_.add({"h2d.embedding_rows", Resource::h2d,
                     model_.time_of(Operation::moving(OpKind::copy_h2d, Bytes{t * h * 2}), Resource::h2d), {}, -1});
    const int op = g_.add({"fwd.embedding", Resource::gpu_compute,
                           model_.time_of(Operation::moving(OpKind::memory_bound, Bytes{t * h * 4}), Resource::gpu_compute),
                           deps_of({rows, prev}), -1});
    fwd_last_[0] = op;
    return op;
  }

  int layer_forward(int l, int prev) {
    const auto& ch = plan_.chunks[static_cast<std::size_t>(l)];
    const int load = begin_compute();
    const int fa = g_.add({"fwd.attention", Resource::gpu_compute,
                           model_.attention_time(l, attn_[static_cast<std::size_t>(l)], false, false), deps_of({load, prev}), l});
    g_.hold(Claimant::worksets, attn_[static_cast<std::size_t>(l)].peak, fa, fa);
    int before_mlp = fa;
    if (const double a2a = model_.all_to_all_time(l); a2a > 0)
      before_mlp = g_.add({"a2a.fwd", Resource::network, a2a, {fa}, l});
    const int fm = g_.add({"fwd.mlp", Resource::gpu_compute, model_.mlp_time(l, ch.moe_tokens, false, false),
                           deps_of({before_mlp}), l});
    g_.hold(Claimant::worksets, mlp_peak(l), fm, fm);
    end_compute(fa, fm);
    fwd_last_[static_cast<std::size_t>(l + 1)] = fm;

    // Saved activations: keep, or offload now and prefetch before backward; recompute costs nothing here.
    Bytes offload;
    for (int c = 0; c < activation_class_count; ++c) {
      const Bytes b = saved_[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)];
      const auto d = plan_.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)];
      if (d.action == Retention::keep) deferred_.push_back({Claimant::retained_activations, b, fm, bwd_end_of(l)});
      if (d.action == Retention::offload) offload += b;
    }
    if (offload.count() > 0) {
      const int d2h = g_.add({"d2h.activations", Resource::d2h,
                              model_.time_of(Operation::moving(OpKind::copy_d2h, offload), Resource::d2h), {fm}, l});
      d2h_act_[static_cast<std::size_t>(l)] = d2h;
      if (prefetch_pending_[static_cast<std::size_t>(l)]) {
        prefetch_pending_[static_cast<std::size_t>(l)] = false;
        prefetch_activations(l);
      }
      g_.hold(Claimant::retained_activations, offload, fm, d2h);
      deferred_.push_back({Claimant::host_offload, offload * static_cast<std::uint64_t>(plan_.gpus), d2h, bwd_end_of(l)});
    }
    return fm;
  }

  Bytes mlp_peak(int l) const {
    return live_bytes(model_.mlp_item(l), 0, std::min(model_.tokens(), plan_.chunks[static_cast<std::size_t>(l)].moe_tokens));
  }

  void prefetch_activations(int l) {
    Bytes offload;
    for (int c = 0; c < activation_class_count; ++c)
      if (plan_.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)].action == Retention::offload &&
          !(c == 0 && boundary_back_[static_cast<std::size_t>(l)] >= 0))  // the boundary came back for a regeneration
        offload += saved_[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)];
    if (offload.count() == 0) return;
    // The backward's loads run up to prefetch_depth - 1 ahead of the compute, so with depth 3 the
    // last layer's backward load is issued from its own forward, before this micro-batch's offload
    // exists: the prefetch then waits for it and is added after it.
    if (d2h_act_[static_cast<std::size_t>(l)] < 0) {
      prefetch_pending_[static_cast<std::size_t>(l)] = true;
      return;
    }
    const int h2d = g_.add({"h2d.activations", Resource::h2d,
                            model_.time_of(Operation::moving(OpKind::copy_h2d, offload), Resource::h2d),
                            deps_of({d2h_act_[static_cast<std::size_t>(l)]}), l});
    prefetch_op_[l] = h2d;
    deferred_.push_back({Claimant::retained_activations, offload, h2d, bwd_end_of(l)});
  }

  int head(int prev, bool last_mb) {
    const int n = spec_.num_layers();
    const int load = begin_compute();
    const WorkItem item = model_.loss_item();
    const int op = g_.add({"loss (LM head + cross-entropy)", Resource::gpu_compute,
                           model_.loss_time(plan_.loss_rows, false) + model_.loss_time(plan_.loss_rows, true),
                           deps_of({load, prev}), n});
    g_.hold(Claimant::worksets, live_bytes(item, 0, std::min(item.extent, plan_.loss_rows)), op, op);
    end_compute(op, op);
    fwd_last_[static_cast<std::size_t>(n + 1)] = op;
    bwd_last_[static_cast<std::size_t>(n + 1)] = op;
    gradients(n, op, last_mb);
    return op;
  }

  // Regenerates boundaries [from+1, l] by rerunning layers from..l-1 forward (their weights
  // streamed again), once per backward; the boundaries are held until their own backward. An
  // offloaded boundary to regenerate from comes back first (the executors bring it up then) and
  // stays until its own layer's backward, whose prefetch then leaves it out.
  int regenerate(int from, int l, int prev) {
    int back = -1;
    const auto f = static_cast<std::size_t>(from);
    if (plan_.retention[f][static_cast<std::size_t>(ActivationClass::layer_boundary)].action == Retention::offload) {
      if (const auto pf = prefetch_op_.find(from); pf != prefetch_op_.end()) {
        back = pf->second;  // its layer's whole prefetch is in flight already (loads run ahead)
      } else {
        const Bytes b = saved_[f][static_cast<std::size_t>(ActivationClass::layer_boundary)];
        back = g_.add({"h2d.boundary (to regenerate from)", Resource::h2d,
                       model_.time_of(Operation::moving(OpKind::copy_h2d, b), Resource::h2d), deps_of({d2h_act_[f]}), l});
        boundary_back_[f] = back;
        deferred_.push_back({Claimant::retained_activations, b, back, bwd_end_of(from)});
      }
    }
    Bytes weights, temporaries;  // the rerun layers' weights, together; their worksets, one at a time
    double compute = 0, exchange = 0;  // exchange: the rerun's all-to-alls on the expert-parallel path
    for (int j = from; j < l; ++j) {
      exchange += model_.all_to_all_time(j);
      weights += weight_bytes(j);
      temporaries = max(temporaries, max(attn_[static_cast<std::size_t>(j)].peak, mlp_peak(j)));
      compute += model_.attention_time(j, attn_[static_cast<std::size_t>(j)], false, false) +
                 model_.mlp_time(j, plan_.chunks[static_cast<std::size_t>(j)].moe_tokens, false, false);
    }
    int load = -1;
    if (weights.count() > 0)
      load = g_.add({"h2d.weights.regenerate", Resource::h2d,
                     model_.time_of(Operation::moving(OpKind::copy_h2d, weights), Resource::h2d), {}, l});
    // The rerun's token exchanges, taken before its compute (they interleave with it layer by
    // layer: this orders them conservatively).
    const int a2a = exchange > 0 ? g_.add({"a2a.regenerate", Resource::network, exchange, deps_of({load, prev, back}), l}) : -1;
    const int op = g_.add({"regenerate boundaries up to", Resource::gpu_compute, compute,
                           deps_of({load, prev, back, a2a}), l});
    if (load >= 0) g_.hold(Claimant::worksets, weights, load, op);
    g_.hold(Claimant::worksets, temporaries, op, op);
    for (int j = from + 1; j <= l; ++j) {
      regenerated_[static_cast<std::size_t>(j)] = true;
      deferred_.push_back({Claimant::retained_activations,
                           saved_[static_cast<std::size_t>(j)][static_cast<std::size_t>(ActivationClass::layer_boundary)], op,
                           bwd_end_of(j)});
    }
    return op;
  }

  int layer_backward(int l, int prev, bool last_mb) {
    const auto& row = plan_.retention[static_cast<std::size_t>(l)];
    const auto& ch = plan_.chunks[static_cast<std::size_t>(l)];
    const int load = begin_compute();
    const auto boundary = row[static_cast<std::size_t>(ActivationClass::layer_boundary)];
    if (boundary.action == Retention::recompute && !regenerated_[static_cast<std::size_t>(l)])
      prev = regenerate(boundary.recompute_from, l, prev);
    const auto pf = prefetch_op_.find(l);
    const int prefetched = pf == prefetch_op_.end() ? -1 : pf->second;
    // A later micro-batch on the device: the layer's streamed gradients so far go back up into its
    // gradient slot, after the previous micro-batch's went down and the slot's last user (two
    // slots, by layer parity) sent its own home; the backward adds to them.
    int refill = -1;
    if (refill_grads_ && st(l).streamed_params > 0) {
      const Bytes sum{st(l).streamed_params * fp32_bytes};
      refill = g_.add({"h2d.grads (accumulated)", Resource::h2d, model_.time_of(Operation::moving(OpKind::copy_h2d, sum), Resource::h2d),
                       deps_of({d2h_grads_[static_cast<std::size_t>(l)], slot_d2h_[static_cast<std::size_t>(l % 2)]}), l});
    }
    // The recompute starts once what the backward's copies bring up has landed: its boundary (or
    // other offloaded input) and, on a later micro-batch, the refill. Both executors record one
    // event after the layer's copies up, and the compute waits on it before the recompute.
    int rc = -1;
    if (const double t = model_.recompute_time(l, row, attn_[static_cast<std::size_t>(l)], ch.moe_tokens); t > 0) {
      rc = g_.add({"recompute", Resource::gpu_compute, t, deps_of({load, prev, prefetched, refill}), l});
      Bytes dropped;
      for (int c = 0; c < activation_class_count; ++c)
        if (held_when_recomputed(static_cast<ActivationClass>(c)) && row[static_cast<std::size_t>(c)].action == Retention::recompute)
          dropped += saved_[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)];
      deferred_.push_back({Claimant::retained_activations, dropped, rc, bwd_end_of(l)});
    }
    // A streamed layer's gradients take one of two slots (by layer parity), free once the slot's
    // last user's went home: the executors' bound on gradients waiting for the link.
    const int slot_free = st(l).streamed_params > 0 ? slot_d2h_[static_cast<std::size_t>(l % 2)] : -1;
    const int bm = g_.add({"bwd.mlp", Resource::gpu_compute, model_.mlp_time(l, ch.moe_tokens, true, false),
                           deps_of({load, prev, rc, refill, slot_free, prefetched}), l});
    g_.hold(Claimant::worksets, mlp_peak(l), bm, bm);
    int before_attn = bm;
    if (const double a2a = model_.all_to_all_time(l); a2a > 0)
      before_attn = g_.add({"a2a.bwd", Resource::network, a2a, {bm}, l});
    const int ba = g_.add({"bwd.attention", Resource::gpu_compute,
                           model_.attention_time(l, attn_[static_cast<std::size_t>(l)], true, false), {before_attn}, l});
    g_.hold(Claimant::worksets, attn_[static_cast<std::size_t>(l)].peak, ba, ba);
    end_compute(bm, ba);
    bwd_last_[static_cast<std::size_t>(l + 1)] = ba;
    return gradients(l, ba, last_mb);
  }

  // Gradients of (pseudo-)layer l after its backward `done` (which began at `first`): reduced
  // over GPUs when several hold replicas, sent to the host, applied by the CPU optimizer once the
  // last micro-batch's have landed; resident segments updated on the GPU.
  int gradients(int l, int done, bool last_mb) {
    const LayerState& s = st(l);
    const int gpus = plan_.gpus;
    const bool ep = plan_.path == ExecutionPath::expert_parallel;
    int ret = done;
    if (s.streamed_params > 0) {
      const std::uint64_t streamed_grad = s.streamed_params * fp32_bytes;
      // Replicated parameters are reduce-scattered, then each GPU sends its shard; an expert's
      // owner sends its gradients whole.
      const std::uint64_t replicated = ep ? s.host_params - s.host_expert_params : s.host_params;
      const std::uint64_t owned = ep ? s.streamed_params - std::min(s.streamed_params, replicated) : 0;
      int reduced = done;
      if (gpus > 1 && replicated > 0)
        reduced = g_.add({"reduce_scatter.grads", Resource::network,
                          model_.time_of(Operation::moving(OpKind::all_reduce, Bytes{replicated * fp32_bytes / 2}), Resource::network),
                          {done}, l});
      const Bytes sent{(replicated / static_cast<std::uint64_t>(gpus) + owned) * fp32_bytes};
      const int d2h = g_.add({"d2h.grads", Resource::d2h,
                              model_.time_of(Operation::moving(OpKind::copy_d2h, sent), Resource::d2h), {reduced}, l});
      if (l >= 0 && l < spec_.num_layers()) d2h_grads_[static_cast<std::size_t>(l)] = slot_d2h_[static_cast<std::size_t>(l % 2)] = d2h;
      // A decoder layer's go into its gradient slot, held for the whole step (add_constant_holds).
      if (l < 0 || l >= spec_.num_layers()) g_.hold(Claimant::worksets, Bytes{streamed_grad}, done, d2h);
      // While a layer's update runs, the backward streams about one layer's fp32 gradients down
      // and its bf16 weights up through the same host memory (the layers are alike).
      if (last_mb)
        update({"cpu.adamw", Resource::cpu,
                model_.time_of(Operation::over(OpKind::cpu_optimizer, s.host_params, Bytes{sent.count() + s.streamed_params * 2}, plan_.precision.moments),
                               Resource::cpu),
                {d2h}, l});
    }
    if (s.resident_params > 0 && last_mb) {
      int reduced = done;
      if (gpus > 1 && !ep)
        reduced = g_.add({"all_reduce.resident_grads", Resource::network,
                          model_.time_of(Operation::moving(OpKind::all_reduce, Bytes{s.resident_params * fp32_bytes}), Resource::network),
                          {done}, l});
      ret = update({"gpu.adamw", Resource::gpu_compute,
                    model_.time_of(Operation::over(OpKind::gpu_optimizer, s.resident_params, Bytes{}, plan_.precision.moments),
                                   Resource::gpu_compute),
                    {reduced}, l});
      if (ret < 0) ret = reduced;  // deferred: the backward goes on from the gradients
    }
    return ret;
  }

  int embedding_backward(int prev, bool last_mb) {
    const std::uint64_t h = spec_.hidden_size();
    const std::uint64_t t = model_.tokens();
    const LayerState& s = st(-1);
    const int op = g_.add({"bwd.embedding", Resource::gpu_compute,
                           model_.time_of(Operation::moving(OpKind::memory_bound, Bytes{t * h * 8}), Resource::gpu_compute),
                           deps_of({prev}), -1});
    bwd_last_[0] = op;
    if (s.streamed_params > 0) {
      // Row gradients go down; the host scatters them into the table's gradient and updates it.
      const int d2h = g_.add({"d2h.embedding_row_grads", Resource::d2h,
                              model_.time_of(Operation::moving(OpKind::copy_d2h, Bytes{t * h * fp32_bytes}), Resource::d2h), {op}, -1});
      if (last_mb)
        update({"cpu.adamw embedding", Resource::cpu,
                model_.time_of(Operation::over(OpKind::cpu_optimizer, s.host_params, Bytes{}, plan_.precision.moments), Resource::cpu),
                {d2h}, -1});
    }
    if (s.resident_params > 0 && last_mb) {
      const int u = update({"gpu.adamw embedding", Resource::gpu_compute,
                            model_.time_of(Operation::over(OpKind::gpu_optimizer, s.resident_params, Bytes{}, plan_.precision.moments),
                                           Resource::gpu_compute),
                            {op}, -1});
      if (u >= 0) return u;
    }
    return op;
  }

  /// An optimizer update: added now, or with clipping kept for after the norm (returns -1 then).
  int update(SimOp op) {
    if (!plan_.clip_grad_norm) return g_.add(std::move(op));
    clipped_updates_.push_back(std::move(op));
    return -1;
  }

  void add_constant_holds() {
    std::uint64_t resident = 0, host = 0, largest_layer_host = 0;
    for (const auto& s : states_) {
      resident += s.resident_params;
      host += s.host_params;
      largest_layer_host = std::max(largest_layer_host, s.host_params);
    }
    g_.hold(Claimant::resident_state, Bytes{resident * model_.state_bytes_per_param(true)});
    // The two gradient slots (by layer parity) both executors hold through the step, each the
    // largest streamed decoder layer's fp32 gradients.
    std::uint64_t largest_streamed = 0;
    for (int l = 0; l < spec_.num_layers(); ++l) largest_streamed = std::max(largest_streamed, st(l).streamed_params);
    if (largest_streamed > 0) g_.hold(Claimant::worksets, Bytes{2 * largest_streamed * fp32_bytes});
    g_.hold(Claimant::host_state, Bytes{host * model_.state_bytes_per_param(false)});
    // Pinned staging for gradients as they land: two layers' worth, so one is being applied while
    // the next arrives (with accumulation, the accumulators are part of host_state instead); with
    // clipping every streamed gradient waits for the norm.
    g_.hold(Claimant::host_staging, Bytes{(plan_.clip_grad_norm ? host : 2 * largest_layer_host) * fp32_bytes});
  }

  const ModelSpec& spec_;
  const Plan& plan_;
  const StepModel& model_;
  std::vector<LayerState> states_;
  std::vector<Partition> attn_;
  std::vector<std::array<Bytes, activation_class_count>> saved_;
  StepGraph g_;
  std::vector<Load> loads_;
  std::vector<int> load_op_, release_op_;
  std::size_t issued_ = 0, next_compute_ = 0;
  std::vector<int> fwd_last_, bwd_last_, d2h_act_;
  std::vector<int> boundary_back_;  ///< per layer: this micro-batch's early fetch of its offloaded boundary (-1: none)
  std::vector<bool> prefetch_pending_;  ///< per layer: its prefetch was due before its offload was added
  std::map<int, int> prefetch_op_;
  std::vector<bool> regenerated_;
  std::vector<int> d2h_grads_;  ///< per layer: its streamed gradients' last trip down (-1: none yet)
  std::array<int, 2> slot_d2h_{-1, -1};  ///< per gradient slot (layer parity): its last user's trip down
  bool refill_grads_ = false;   ///< this micro-batch refills streamed gradients (GradAccumulation::device)
  std::vector<Deferred> deferred_;
  std::vector<SimOp> clipped_updates_;  ///< with clipping: the updates, added after the norm
};


}  // namespace

std::string model_fingerprint(const ModelSpec& spec) {
  // What the planner reads of a model, in a fixed order: numbers that only the layers' arithmetic
  // uses (rope_theta, norm epsilon, router noise) leave a plan as it was.
  std::string text = fmt::format("{} vocab {} hidden {} tied {};", to_string(spec.family()), spec.vocab_size(), spec.hidden_size(),
                                 spec.tied_embeddings());
  const auto& a = spec.attention();
  text += fmt::format("attention {} {} {} {} {} {} {} {};", a.heads, a.kv_heads, a.head_dim, a.output_gate, a.qk_norm, a.qk_norm_full_width,
                      a.bias, a.qkv_bias);
  const auto& la = spec.linear_attention();
  text += fmt::format("linear {} {} {} {} {};", la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel);
  const auto& m = spec.moe();
  text += fmt::format("moe {} {} {} {};", m.experts, m.top_k, m.expert_intermediate, m.shared_expert_intermediate);
  for (const auto& l : spec.layers()) text += fmt::format("layer {} {} {};", to_string(l.attention), l.moe, l.dense_intermediate);
  for (const auto& seg : spec.segments()) detail::append_segment(text, seg);
  return detail::fingerprint_of(text);
}

Planner::Planner(const ModelSpec& spec, const MachineProfile& profile, std::string model_name, std::string profile_file)
    : spec_(&spec), profile_(&profile), model_name_(std::move(model_name)), model_fingerprint_(oom::model_fingerprint(spec)),
      profile_file_(std::move(profile_file)) {
  profile.validate(profile_file_.empty() ? std::string_view(profile.name) : std::string_view(profile_file_));
}

namespace {

// The search's simulation of candidate `p`. A step of more than searched_micro_batches
// micro-batches is priced from steps of 3 and 4 (the first, the middle ones, the last: a middle
// one's graph is the next's): its time and each resource's busy seconds grow by the fourth's
// increment per further micro-batch, and its memory peaks are the 4's (they do not grow with the
// count: test_plan "micro-batches run one after another"). A search over a step of M
// micro-batches had simulated M of them for every candidate: 17 s for the 5.13B model at 64, and
// linear in M up to max_micro_batches. The plans returned are simulated whole (plan(), below).
constexpr int searched_micro_batches = 4;
SimResult search_simulation(const StepModel& model, const ModelSpec& spec, const Plan& p, const std::vector<LayerState>& states) {
  if (p.micro_batches <= searched_micro_batches) return oom::simulate(GraphBuilder(model, spec, p, &states).build());
  Plan q = p;
  q.micro_batches = searched_micro_batches - 1;
  const SimResult before = oom::simulate(GraphBuilder(model, spec, q, &states).build());
  q.micro_batches = searched_micro_batches;
  SimResult r = oom::simulate(GraphBuilder(model, spec, q, &states).build());
  const double more = static_cast<double>(p.micro_batches - searched_micro_batches);
  r.step_s += more * (r.step_s - before.step_s);
  for (std::size_t i = 0; i < r.busy.seconds.size(); ++i) r.busy.seconds[i] += more * (r.busy.seconds[i] - before.busy.seconds[i]);
  r.start_s.clear();  // per op of the 4-micro-batch graph: not this step's
  r.end_s.clear();
  return r;
}

}  // namespace

StepGraph Planner::step_graph(const Plan& plan) const {
  check_plan(plan, *spec_, *profile_);
  const StepModel model(*spec_, *profile_, request_of(plan), plan.path);
  return GraphBuilder(model, *spec_, plan).build();
}

SimResult Planner::simulate(const Plan& plan) const { return oom::simulate(step_graph(plan)); }

namespace {

struct RetentionChoice {
  RetentionTemplate far, near;
  int near_layers;
};

std::vector<RetentionChoice> retention_candidates(const ModelSpec& spec) {
  const int n = spec.num_layers();
  bool hybrid = false;
  for (const auto& l : spec.layers()) hybrid |= l.attention == AttentionKind::linear;
  std::vector<RetentionChoice> out;
  std::vector<RetentionTemplate> pure = {RetentionTemplate::keep_all, RetentionTemplate::checkpoint,
                                         RetentionTemplate::offload_checkpoint, RetentionTemplate::keep_attention,
                                         RetentionTemplate::offload_attention};
  if (hybrid) pure.push_back(RetentionTemplate::hybrid_regenerate);
  for (auto t : pure) out.push_back({t, t, 0});
  // The layers nearest the loss are needed first by backward: keep more of theirs on the GPU.
  const RetentionTemplate nears[] = {RetentionTemplate::keep_all, RetentionTemplate::keep_attention, RetentionTemplate::checkpoint};
  std::vector<RetentionTemplate> fars = {RetentionTemplate::checkpoint, RetentionTemplate::offload_checkpoint,
                                         RetentionTemplate::offload_attention};
  if (hybrid) fars.push_back(RetentionTemplate::hybrid_regenerate);
  for (auto near : nears)
    for (auto far : fars) {
      if (near == far) continue;
      for (int q = 1; q <= 3; ++q) out.push_back({far, near, n * q / 4});
    }
  return out;
}

// Resident-bytes levels: 0, then 4 KiB growing by 2^(1/4): fixed whatever the budget, so a
// candidate at one budget is also a candidate at any larger one. From 4 KiB so that a small model
// (the tiny configs' whole state is 1-100 MiB) is weighed resident at the budgets it fits; levels
// that add no segment to the one below are skipped before any work (a 5.13B expert's state is
// 72 MiB, so its first 90 levels cost nothing). (From 256 MiB, until the sixty-first session, any
// budget under ~267 MiB planned nothing resident and reported a host need it did not have.)
std::vector<Bytes> residency_ladder(Bytes up_to) {
  std::vector<Bytes> levels{Bytes{}};
  for (double b = 4096.0; b <= static_cast<double>(up_to.count()); b *= 1.189207115002721)
    levels.push_back(Bytes{static_cast<std::uint64_t>(b)});
  return levels;
}

// Segments by time saved per GPU byte if made resident (streaming in for forward and backward,
// gradients out, CPU update, minus the GPU update), earlier layers first among equals: their CPU
// updates end the step, which the next forward waits on.
std::vector<std::size_t> residency_order(const ModelSpec& spec, const StepModel& model) {
  const auto& segs = spec.segments();
  const auto& cost = model.cost();
  const int n = spec.num_layers();
  std::vector<std::pair<double, std::size_t>> scored;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const auto p = static_cast<double>(segs[i].parameters());
    const double saved = p * 2 * 2 / cost.h2d_rate() + p * 4 / cost.d2h_rate() + p / cost.profile().cpu_adamw_params_per_s -
                         p * ProfileCostModel::gpu_adamw_bytes_per_param / cost.profile().hbm_bytes_per_s;
    const int layer = model.segment_layer(i);
    const double position = 1.0 + static_cast<double>(n - std::clamp(layer, 0, n)) / std::max(n, 1);
    scored.emplace_back(saved * position / std::max(p * static_cast<double>(model.state_bytes_per_param(true)), 1.0), i);
  }
  std::stable_sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::size_t> order;
  for (const auto& s : scored) order.push_back(s.second);
  return order;
}

// GPU bytes of retained activations at the forward/backward turn, and in flight while offloading.
Bytes retained_estimate(const StepModel& model, const RetentionTable& table, int layers) {
  Bytes kept, largest_offload, largest_layer;
  for (int l = 0; l < layers; ++l) {
    const auto saved = model.saved_bytes(l);
    Bytes off, dropped;
    for (int c = 0; c < activation_class_count; ++c) {
      const auto cls = static_cast<ActivationClass>(c);
      const auto d = table.retain(l, cls);
      if (d.action == Retention::keep) kept += saved[static_cast<std::size_t>(c)];
      if (d.action == Retention::offload) off += saved[static_cast<std::size_t>(c)];
      if (d.action == Retention::recompute && held_when_recomputed(cls)) dropped += saved[static_cast<std::size_t>(c)];
    }
    largest_offload = max(largest_offload, off);
    largest_layer = max(largest_layer, off + dropped);
  }
  // The layer being differentiated (prefetched and recomputed), the next one's prefetch, and an
  // offload still draining.
  return kept + largest_layer + 2 * largest_offload;
}

}  // namespace

std::optional<Bytes> Planner::least_gpu_budget(PlanRequest req, double tolerance, Bytes most) const {
  if (!(tolerance > 0.0 && tolerance < 1.0))
    OOM_THROW(Errc::invalid_argument, fmt::format("least_gpu_budget: tolerance {} is not a fraction in (0, 1)", tolerance));
  constexpr std::uint64_t mib = std::uint64_t{1} << 20;
  req.candidates = 1;  // feasibility alone
  const auto fits = [&](std::uint64_t mibs) {
    req.gpu_budget = Bytes{mibs * mib};
    try {
      (void)plan(req);
      return true;
    } catch (const Error& e) {
      if (e.code() != Errc::out_of_budget) throw;
      return false;
    }
  };
  // In MiB: lo the most found not to fit, hi the least found to fit.
  std::uint64_t lo = req.gpu_budget.count() / mib, hi = 0;
  if (lo > 0 && req.gpu_budget.count() % mib == 0 && fits(lo)) return Bytes{lo * mib};
  for (std::uint64_t b = std::max<std::uint64_t>(lo, 1); b <= most.count() / mib / 2;) {
    b *= 2;
    if (fits(b)) {
      hi = b;
      break;
    }
    lo = b;
  }
  if (hi == 0) return std::nullopt;
  while (hi - lo > 1 && static_cast<double>(hi - lo) > tolerance * static_cast<double>(hi)) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return Bytes{hi * mib};
}

PlanSet Planner::plan(const PlanRequest& req) const {
  const auto t0 = std::chrono::steady_clock::now();
  check_plan_request(req);
  if (req.gpus > profile_->gpus)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan request: {} GPUs asked for, profile '{}' describes {}", req.gpus,
                                                  profile_->name, profile_->gpus));

  const int n = spec_->num_layers();
  std::vector<ExecutionPath> paths{ExecutionPath::local};
  if (req.gpus > 1 && spec_->moe().experts % static_cast<std::uint64_t>(req.gpus) == 0)
    paths.push_back(ExecutionPath::expert_parallel);
  auto retentions = retention_candidates(*spec_);
  if (!req.retention.empty()) {
    std::string names;
    for (const auto& r : retentions)
      if (r.near_layers == 0) names += fmt::format("{}'{}'", names.empty() ? "" : ", ", to_string(r.far));
    std::erase_if(retentions, [&](const RetentionChoice& r) { return req.retention != to_string(r.far); });
    if (retentions.empty())
      OOM_THROW(Errc::invalid_argument, fmt::format("plan request: retention '{}' is not one the planner searches for this model ({})",
                                                    req.retention, names));
  }
  const Bytes usable{static_cast<std::uint64_t>(static_cast<double>(req.gpu_budget.count()) * (1.0 - gpu_margin))};
  const auto ladder = residency_ladder(usable);

  PlanSet out;
  struct Found {
    Plan plan;
    std::vector<bool> mask;  // resident segments, named only for the plans returned
  };
  std::vector<Found> feasible;
  // The least any candidate needs, for the error when nothing fits.
  Bytes least_gpu{~0ull}, least_host{~0ull};
  std::string least_gpu_claimant;

  for (auto path : paths) {
    const StepModel model(*spec_, *profile_, req, path);
    const auto order = oom::residency_order(*spec_, model);
    const WorkItem loss = model.loss_item();
    for (int depth : {2, 3}) {
      for (const auto& r : retentions) {
        const RetentionTable table(*spec_, r.far, r.near, r.near_layers);
        if (!valid_retention(table, n)) continue;
        const Bytes retained = retained_estimate(model, table, n);
        std::vector<bool> mask(spec_->segments().size(), false);
        std::vector<LayerState> states = model.layer_states(mask);
        std::size_t taken = 0;
        Bytes resident_bytes;
        std::size_t last_taken = ~std::size_t{0};
        for (Bytes level : ladder) {
          while (taken < order.size()) {
            const std::size_t seg = order[taken];
            // Per-GPU bytes: an expert owned elsewhere costs this GPU nothing (its owner pays as much).
            const Bytes b{model.segment_owner(seg) > 0 ? 0 : model.segment_params(seg) * model.state_bytes_per_param(true)};
            if (resident_bytes + b > level) break;
            resident_bytes += b;
            mask[seg] = true;
            model.make_resident(states, seg);
            ++taken;
          }
          if (taken == last_taken) continue;  // the same resident set as the level below
          last_taken = taken;
          // What the budget leaves for chunk worksets, after resident state, retained activations,
          // weight slots and gradient buffers.
          Bytes slots, grads;
          for (const auto& s : states) {
            slots = max(slots, bytes_of(req.precision.weights, s.streamed_params));
            grads = max(grads, Bytes{s.streamed_params * fp32_bytes});
          }
          const Bytes fixed = resident_bytes + retained + slots * static_cast<std::uint64_t>(depth) + 2 * grads;
          Bytes need_chunks = DependencyPartitioner::min_budget(loss);
          for (int l = 0; l < n; ++l)
            need_chunks = max(need_chunks, max(DependencyPartitioner::min_budget(model.attention_item(l)),
                                               DependencyPartitioner::min_budget(model.mlp_item(l))));
          if (fixed + need_chunks > usable) {
            const Bytes need{static_cast<std::uint64_t>(static_cast<double>((fixed + need_chunks).count()) / (1.0 - gpu_margin))};
            if (need < least_gpu) {
              least_gpu = need;
              const Bytes parts[] = {resident_bytes, retained, slots * static_cast<std::uint64_t>(depth) + 2 * grads, need_chunks};
              const char* names[] = {"resident state", "retained activations", "weight slots and gradient buffers",
                                     "chunk worksets"};
              least_gpu_claimant = names[std::max_element(std::begin(parts), std::end(parts)) - std::begin(parts)];
            }
            break;  // higher levels only need more
          }
          // Chunks sized to what the budget leaves; where the simulated peak still passes the
          // budget (the estimate misses what the graph overlaps), again with smaller worksets: a
          // candidate that fits a smaller budget with its smaller chunks is not lost to a larger
          // one (5400 MiB had found no plan for OLMoE-1B-7B at 4K where 5390 MiB had, 2026-12-06).
          Plan p = Plan::for_request(req, model_name_);
          p.model_fingerprint = model_fingerprint_;
          p.path = path;
          p.prefetch_depth = depth;
          p.resident_level = level;
          p.retention_name = std::string(table.name());
          for (int l = 0; l < n; ++l) {
            std::array<RetentionDecision, activation_class_count> row{};
            for (int c = 0; c < activation_class_count; ++c) row[static_cast<std::size_t>(c)] = table.retain(l, static_cast<ActivationClass>(c));
            p.retention.push_back(row);
          }
          const DependencyPartitioner part;
          Bytes workset = usable - fixed;
          SimResult sim;
          for (int attempt = 0;; ++attempt) {  // only the chunks follow the workset
            p.chunks.clear();
            for (int l = 0; l < n; ++l) {
              LayerChunks lc;
              for (const auto& c : part.partition(model.attention_item(l), workset).chunks) lc.attention.push_back(c.end);
              const auto mlp = part.partition(model.mlp_item(l), workset);
              lc.moe_tokens = mlp.chunks.empty() ? model.tokens() : mlp.chunks.front().end - mlp.chunks.front().begin;
              p.chunks.push_back(std::move(lc));
            }
            const auto lossp = part.partition(loss, workset);
            p.loss_rows = lossp.chunks.empty() ? model.tokens() : lossp.chunks.front().end - lossp.chunks.front().begin;

            sim = search_simulation(model, *spec_, p, states);
            ++out.evaluated;
            if (!std::isfinite(sim.step_s))
              OOM_THROW(Errc::invalid_argument, fmt::format("profile '{}'{}: its rates predict a step of {} s (a rate too small to price "
                                                            "with: check the profile's rates)",
                                                            profile_->name, profile_file_.empty() ? "" : fmt::format(" ({})", profile_file_),
                                                            sim.step_s));
            if (sim.gpu_peak <= req.gpu_budget || workset == need_chunks || attempt == 6) break;
            // The peak is not monotonic in the workset (a split adds to every chunk): smaller
            // worksets by 3% a try, down to 0.83x (not to the least: chunks of a granule each
            // make graphs of thousands of ops, 10x the search's time at 256K).
            workset = max(need_chunks, Bytes{workset.count() / 100 * 97});
          }
          p.predicted = Prediction::of(sim);
          least_host = min(least_host, sim.host_peak);
          if (sim.gpu_peak > req.gpu_budget) {
            if (sim.gpu_peak < least_gpu) {
              least_gpu = sim.gpu_peak;
              least_gpu_claimant = "the simulated peak";
            }
            continue;
          }
          if (sim.host_peak > req.host_budget) continue;
          ++out.feasible;
          feasible.push_back({std::move(p), mask});
        }
      }
    }
  }
  out.search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (feasible.empty()) {
    std::string msg = fmt::format("no plan for {} fits: ", model_name_.empty() ? "this model" : model_name_);
    if (least_gpu.count() != ~0ull && least_gpu > req.gpu_budget)
      msg += fmt::format("the least GPU memory any plan needs is about {} per GPU (an estimate before the chunks are sized and "
                         "the step simulated, often low: Planner::least_gpu_budget searches for the figure; largest claimant: "
                         "{}), the budget is {}",
                         least_gpu, least_gpu_claimant, req.gpu_budget);
    if (least_host.count() != ~0ull && least_host > req.host_budget)
      msg += fmt::format("{}the least host memory any plan needs is {}, the budget is {}",
                         msg.back() == ' ' ? "" : "; ", least_host, req.host_budget);
    if (least_host.count() == ~0ull) {
      const Bytes host_state{spec_->total_parameters() * detail::StepModel(*spec_, *profile_, req, ExecutionPath::local).state_bytes_per_param(false)};
      if (host_state > req.host_budget)
        msg += fmt::format("; streamed state alone needs {} of host memory, the budget is {}", host_state, req.host_budget);
    }
    OOM_THROW(Errc::out_of_budget, msg);
  }
  std::stable_sort(feasible.begin(), feasible.end(),
                   [](const Found& a, const Found& b) { return a.plan.predicted.step_s < b.plan.predicted.step_s; });
  // Return distinct alternatives: a candidate that differs from a better one only in prefetch
  // depth or chunk sizes says nothing new. A step of more micro-batches than the search simulated
  // is simulated whole for each one returned, its prediction then exact (and its budgets checked
  // again, though its peaks are the search's).
  const auto wanted = static_cast<std::size_t>(req.candidates);
  std::vector<std::size_t> chosen;
  for (std::size_t k = 0; k < feasible.size() && chosen.size() < wanted; ++k) {
    auto& c = feasible[k];
    const bool repeat = std::any_of(chosen.begin(), chosen.end(), [&](std::size_t j) {
      const auto& b = feasible[j];
      return b.plan.path == c.plan.path && b.plan.retention_name == c.plan.retention_name && b.mask == c.mask;
    });
    if (repeat) continue;
    if (c.plan.micro_batches > searched_micro_batches) {
      const StepModel model(*spec_, *profile_, req, c.plan.path);
      std::vector<LayerState> states = model.layer_states(c.mask);
      const SimResult whole = oom::simulate(GraphBuilder(model, *spec_, c.plan, &states).build());
      if (whole.gpu_peak > req.gpu_budget || whole.host_peak > req.host_budget) continue;
      c.plan.predicted = Prediction::of(whole);
    }
    chosen.push_back(k);
  }
  if (chosen.empty())  // the whole step's peaks are the search's (micro-batches do not add to them)
    OOM_THROW(Errc::internal, fmt::format("no plan of {} micro-batches fits once simulated whole, though {} did in the search",
                                          req.micro_batches, feasible.size()));
  std::stable_sort(chosen.begin(), chosen.end(),
                   [&](std::size_t a, std::size_t b) { return feasible[a].plan.predicted.step_s < feasible[b].plan.predicted.step_s; });
  for (std::size_t k : chosen) {
    Plan& p = feasible[k].plan;
    for (std::size_t i = 0; i < feasible[k].mask.size(); ++i)
      if (feasible[k].mask[i]) p.resident_segments.push_back(spec_->segments()[i].name);
    out.plans.push_back(std::move(p));
  }
  return out;
}

std::string Planner::describe(const Plan& p) const {
  std::string s;
  const auto& pr = p.predicted;
  auto claim = [&](Claimant c) { return pr.gpu_at_peak[static_cast<std::size_t>(c)]; };
  s += fmt::format("path {} on {} GPU(s), prefetch depth {}, {} micro-batch(es) of {} x {} tokens per GPU\n",
                   to_string(p.path), p.gpus, p.prefetch_depth, p.micro_batches, p.workload.sequences, p.workload.seq_len);
  s += fmt::format("GPU memory per GPU at its peak: {} of {} budget\n", pr.gpu_peak, p.gpu_budget);
  for (auto c : {Claimant::resident_state, Claimant::retained_activations, Claimant::worksets})
    s += fmt::format("  {:<22} {:>12}  (own peak {})\n", to_string(c), claim(c), pr.peak[static_cast<std::size_t>(c)]);
  s += fmt::format("host memory at its peak: {} of {} budget\n", pr.host_peak, p.host_budget);
  for (auto c : {Claimant::host_state, Claimant::host_staging, Claimant::host_offload})
    s += fmt::format("  {:<22} {:>12}\n", to_string(c), pr.peak[static_cast<std::size_t>(c)]);
  s += describe_precision(p.precision);
  std::uint64_t resident_params = 0;
  std::map<std::string, int> by_role;
  for (const auto& name : p.resident_segments) {
    for (const auto& seg : spec_->segments())
      if (seg.name == name) {
        resident_params += seg.parameters();
        by_role[to_string(seg.role)]++;
        break;
      }
  }
  s += fmt::format("residency: {} of {} segments resident ({} parameters)", p.resident_segments.size(),
                   spec_->segments().size(), count_label(resident_params));
  for (const auto& [role, count] : by_role) s += fmt::format(", {} {}", count, role);
  s += "\n";
  s += fmt::format("retention: {}\n{}\n", p.retention_name, describe_boundaries(p));
  // Full-attention layers' query chunks; linear-attention layers' token parts (the longest first part).
  std::size_t max_attn = 0;
  std::uint64_t linear_part = 0;
  for (std::size_t l = 0; l < p.chunks.size(); ++l) {
    const auto& c = p.chunks[l];
    if (spec_->layer(static_cast<int>(l)).attention == AttentionKind::linear) {
      if (c.attention.size() > 1) linear_part = std::max(linear_part, c.attention.front());
    } else {
      max_attn = std::max(max_attn, c.attention.size());
    }
  }
  s += fmt::format("chunking: attention up to {} query chunk(s),{} MoE {} tokens per chunk, loss {} rows per chunk\n", max_attn,
                   linear_part > 0 ? fmt::format(" linear attention in parts of {} tokens,", linear_part) : std::string(),
                   p.chunks.empty() ? 0 : p.chunks.front().moe_tokens, p.loss_rows);
  s += fmt::format("predicted step {} s ({:.0f} tokens/s over {} GPU(s)); busy:", seconds_label(pr.step_s),
                   static_cast<double>(p.workload.tokens() * static_cast<std::uint64_t>(p.micro_batches * p.gpus)) / pr.step_s, p.gpus);
  for (int r = 0; r < resource_count; ++r)
    if (pr.busy.seconds[static_cast<std::size_t>(r)] > 0)
      s += fmt::format(" {} {} s", to_string(static_cast<Resource>(r)), seconds_label(pr.busy.seconds[static_cast<std::size_t>(r)]));
  s += "\n";
  return s;
}

std::string Planner::compare(const Plan& best, const Plan& other) {
  std::string s = fmt::format("chosen plan {} s vs runner-up {} s ({:+.1f}%)\n", seconds_label(best.predicted.step_s),
                              seconds_label(other.predicted.step_s), 100.0 * (other.predicted.step_s / best.predicted.step_s - 1.0));
  if (best.path != other.path) s += fmt::format("  path: {} vs {}\n", to_string(best.path), to_string(other.path));
  if (best.prefetch_depth != other.prefetch_depth)
    s += fmt::format("  prefetch depth: {} vs {}\n", best.prefetch_depth, other.prefetch_depth);
  if (best.retention_name != other.retention_name)
    s += fmt::format("  retention: {} vs {}\n", best.retention_name, other.retention_name);
  if (best.resident_segments.size() != other.resident_segments.size())
    s += fmt::format("  resident segments: {} vs {}\n", best.resident_segments.size(), other.resident_segments.size());
  for (int r = 0; r < resource_count; ++r) {
    const double a = best.predicted.busy.seconds[static_cast<std::size_t>(r)];
    const double b = other.predicted.busy.seconds[static_cast<std::size_t>(r)];
    if (std::abs(a - b) > 1e-3 * std::max(a, b))
      s += fmt::format("  {} busy {} s vs {} s\n", to_string(static_cast<Resource>(r)), seconds_label(a), seconds_label(b));
  }
  s += fmt::format("  GPU peak {} vs {}\n", best.predicted.gpu_peak, other.predicted.gpu_peak);
  return s;
}

std::vector<std::string> Planner::residency_order(const Plan& plan) const {
  check_plan(plan, *spec_, *profile_);
  const StepModel model(*spec_, *profile_, request_of(plan), plan.path);
  std::vector<std::string> names;
  for (const std::size_t i : oom::residency_order(*spec_, model)) names.push_back(spec_->segments()[i].name);
  return names;
}

}  // namespace oom
