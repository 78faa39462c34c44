// LayerStackPlanner: the step graph of a plan for a stack of described layers, and the search
// over prefetch depth, retention template, chunk size and resident prefix.
#include "oom/plan/layer_stack_planner.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/plan/cost_model.hpp"
#include "fingerprint.hpp"

namespace oom {
namespace {

/// Kept free of every plan, as Planner keeps it: CUDA context, library workspaces, fragmentation.
constexpr double gpu_margin = 0.04;
constexpr std::uint64_t fp32_bytes = 4;
constexpr auto boundary = static_cast<std::size_t>(ActivationClass::layer_boundary);

/// One layer's numbers for one request.
struct Costed {
  LayerCost cost;
  std::array<Bytes, activation_class_count> saved{};  ///< by class; [layer_boundary]: its input
  std::array<double, activation_class_count> recompute_flops{};  ///< by class
};

bool bad_number(double v) { return !std::isfinite(v) || v < 0; }

std::vector<Costed> cost_layers(const std::vector<LayerDescription>& layers, const Workload& w) {
  std::vector<Costed> out;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const auto& d = layers[l];
    Costed c;
    c.cost = d.cost(w);
    const auto where = fmt::format("layer {} ('{}'), cost for {} x {} tokens", l, d.name, w.sequences, w.seq_len);
    if (bad_number(c.cost.forward_flops) || bad_number(c.cost.backward_flops))
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: FLOPs must be finite and >= 0 (forward {}, backward {})", where,
                                                    c.cost.forward_flops, c.cost.backward_flops));
    c.saved = saved_bytes_by_class(c.cost, where);
    for (const auto& a : c.cost.activations) {
      if (bad_number(a.recompute_flops))
        OOM_THROW(Errc::invalid_argument, fmt::format("{}: {} recompute FLOPs must be finite and >= 0, not {}", where,
                                                      to_string(a.cls), a.recompute_flops));
      c.recompute_flops[static_cast<std::size_t>(a.cls)] += a.recompute_flops;
    }
    // The boundary it hands on is what the next layer keeps, offloads or regenerates from (the
    // first layer's input too): a layer has one, and a graph of 0-byte boundaries has no copies.
    if (c.cost.output.count() == 0)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: LayerCost::output is 0 bytes; it is the boundary the layer hands on (e.g. "
                                                    "tokens x hidden x 4 bytes), which must be > 0",
                                                    where));
    c.saved[boundary] = l == 0 ? c.cost.output : out.back().cost.output;
    out.push_back(std::move(c));
  }
  return out;
}


/// Builds one plan's step graph (check_plan'ed). Mirrors the HostExecutor's schedule: one weight
/// slot per load in turn (forward and backward loads alike), two gradient slots by layer parity,
/// offloads after a layer's forward, prefetches and the recompute (of the recomputed classes)
/// before its backward, the CPU AdamW of a layer as soon as its gradients land.
class GraphBuilder {
 public:
  GraphBuilder(const std::vector<LayerDescription>& layers, const std::vector<Costed>& costs, const MachineProfile& profile,
               const Plan& plan)
      : layers_(layers), costs_(costs), profile_(profile), cost_(profile), plan_(plan) {
    std::unordered_set<std::string> resident(plan.resident_segments.begin(), plan.resident_segments.end());
    for (const auto& d : layers) {
      std::uint64_t r = 0, s = 0;
      for (const auto& seg : d.segments) (resident.count(seg.name) > 0 ? r : s) += seg.parameters();
      resident_.push_back(r);
      streamed_.push_back(s);
    }
  }

  StepGraph build() {
    const int n = static_cast<int>(layers_.size());
    const auto& prec = plan_.precision;
    std::uint64_t resident = 0, streamed = 0, largest = 0;
    for (int l = 0; l < n; ++l) {
      resident += resident_[static_cast<std::size_t>(l)];
      streamed += streamed_[static_cast<std::size_t>(l)];
      largest = std::max(largest, streamed_[static_cast<std::size_t>(l)]);
    }
    const SegmentBytes on_gpu = segment_bytes(resident, prec), on_host = segment_bytes(streamed, prec);
    g_.hold(Claimant::resident_state, on_gpu.total());
    const int depth = plan_.prefetch_depth;  // check_plan: 1 to max_prefetch_depth
    g_.hold(Claimant::worksets, bytes_of(prec.weights, largest) * static_cast<std::uint64_t>(depth));
    g_.hold(Claimant::worksets, Bytes{2 * largest * fp32_bytes});
    g_.hold(Claimant::host_state, on_host.weights + on_host.master + on_host.moments);
    g_.hold(Claimant::host_staging, on_host.grads);
    slot_user_.assign(static_cast<std::size_t>(depth), -1);

    std::vector<int> grads_out;  // every d2h.grads: clipping's norm reads the landed gradients
    int last_bwd = -1;
    std::vector<int> mb_end;  // a micro-batch's last ops: the HostExecutor synchronises after each
    for (int mb = 0; mb < plan_.micro_batches; ++mb) {
      const bool last = mb + 1 == plan_.micro_batches;
      std::vector<int> fwd(static_cast<std::size_t>(n)), offload(static_cast<std::size_t>(n), -1);
      back_.assign(static_cast<std::size_t>(n), -1);
      early_.assign(static_cast<std::size_t>(n), -1);
      int producer = -1;  // the op that made the current boundary (the micro-batch's first load for layer 0)
      for (int l = 0; l < n; ++l) {
        const auto L = static_cast<std::size_t>(l);
        const int h = load(l, l == 0 ? mb_end : std::vector<int>{});
        if (l == 0) producer = h;
        const int f = g_.add({"fwd", Resource::gpu_compute, compute_time(l, costs_[L].cost.forward_flops), {h}, l});
        release(f);
        fwd[L] = f;
        hold_workset(l, f, f);
        if (const Bytes out = offloaded(l); out.count() > 0)
          offload[L] = g_.add({"d2h.activations", Resource::d2h, copy_time(OpKind::copy_d2h, out), {f}, l});
        producers_.push_back(producer);
        producer = f;
      }
      const Bytes y = costs_.back().cost.output;
      const int loss = g_.add({"loss", Resource::gpu_compute, time_of(Operation::moving(OpKind::memory_bound, Bytes{2 * y.count()})),
                               {fwd.back()}, -1});
      g_.hold(Claimant::retained_activations, y, fwd.back(), loss);
      int grad_from = loss;  // dL/d(output of the layer whose backward comes next)
      Bytes grad_bytes = y;
      mb_end.clear();
      for (int l = n; l-- > 0;) {
        const auto L = static_cast<std::size_t>(l);
        // The backward is queued once the loss is known (the executor checks it is finite first).
        const int h = load(l, l == n - 1 ? std::vector<int>{loss} : std::vector<int>{});
        std::vector<int> deps{h};
        if (action(l, 0) == Retention::recompute && back_[L] < 0) deps.push_back(regenerate(l, h, offload));
        int prefetch = -1;
        if (const Bytes up = offloaded(l) - (early_[L] >= 0 ? costs_[L].saved[boundary] : Bytes{}); up.count() > 0) {
          prefetch = g_.add({"h2d.activations", Resource::h2d, copy_time(OpKind::copy_h2d, up), {offload[L]}, l});
          deps.push_back(prefetch);
        }
        bool recomputes = false;
        double rerun = 0;  // the recomputed classes' own FLOPs, at most the forward's
        for (int c = 1; c < activation_class_count; ++c)
          if (costs_[L].saved[static_cast<std::size_t>(c)].count() > 0 && action(l, c) == Retention::recompute) {
            recomputes = true;
            rerun += costs_[L].recompute_flops[static_cast<std::size_t>(c)];
          }
        int rec = -1;
        if (recomputes) {
          // A layer that declares no recompute FLOPs is priced as its whole forward again.
          const double f = rerun > 0 ? std::min(rerun, costs_[L].cost.forward_flops) : costs_[L].cost.forward_flops;
          rec = g_.add({"recompute", Resource::gpu_compute, compute_time(l, f), deps, l});
          hold_workset(l, rec, rec);
          deps.push_back(rec);
        }
        if (streamed_[L] > 0 && grad_slot_user_[L % 2] >= 0) deps.push_back(grad_slot_user_[L % 2]);
        const int b = g_.add({"bwd", Resource::gpu_compute, compute_time(l, costs_[L].cost.backward_flops, Pass::backward), deps, l});
        release(b);
        last_bwd = b;
        hold_workset(l, b, b);
        g_.hold(Claimant::worksets, grad_bytes, grad_from, b);
        grad_from = b;
        grad_bytes = costs_[L].saved[boundary];
        hold_saved(l, fwd[L], offload[L], prefetch, rec, b);
        if (early_[L] >= 0) g_.hold(Claimant::retained_activations, costs_[L].saved[boundary], early_[L], b);
        // Later micro-batches: a resident segment's gradient lands in a scratch, then is added.
        if (mb > 0 && resident_[L] > 0) g_.hold(Claimant::worksets, Bytes{resident_[L] * fp32_bytes}, b, b);
        if (last && resident_[L] > 0) pending_.push_back({"gpu.adamw", Resource::gpu_compute,
                                                          time_of(Operation::over(OpKind::gpu_optimizer, resident_[L], Bytes{}, prec.moments)), {b}, l});
        if (streamed_[L] > 0) {
          const int d = g_.add({"d2h.grads", Resource::d2h, copy_time(OpKind::copy_d2h, Bytes{streamed_[L] * fp32_bytes}), {b}, l});
          grad_slot_user_[L % 2] = d;
          grads_out.push_back(d);
          mb_end.push_back(d);
          // Later micro-batches land in pinned buffers the CPU adds into the staging, then frees.
          if (mb > 0) {
            const int add = g_.add({"cpu.grad_add", Resource::cpu, host_pass_seconds(streamed_[L], 12.0), {d}, l});
            g_.hold(Claimant::host_staging, Bytes{streamed_[L] * fp32_bytes}, d, add);
            mb_end.push_back(add);
          }
          // The update, slowed by the copies streaming meanwhile (a layer's fp32 gradients down
          // and its weights up); the executor's gradient check before it is one more read of the
          // fp32 gradients (LayerExecutorOptions::check_gradients, on by default, priced always),
          // passed as DRAM traffic beside the update as the copies' is.
          if (last)
            pending_.push_back({"cpu.adamw", Resource::cpu,
                                time_of(Operation::over(OpKind::cpu_optimizer, streamed_[L],
                                                        Bytes{streamed_[L] * (2 * fp32_bytes + size_of(prec.weights))}, prec.moments)),
                                {d}, l});
        }
        if (last && !plan_.clip_grad_norm) flush_updates({});
        mb_end.push_back(b);
      }
      mb_end.push_back(loss);
      g_.hold(Claimant::worksets, grad_bytes, grad_from, grad_from);  // dL/d(input), handed to the caller
      producers_.clear();
    }
    if (plan_.clip_grad_norm) {
      // The HostExecutor's defer_updates: once every stream is done, the norm over every gradient
      // (resident and landed), then every update.
      std::vector<int> after = grads_out;
      after.push_back(last_bwd);
      const int norm = g_.add({"cpu.grad_norm", Resource::cpu, host_pass_seconds(resident + streamed, 4.0), after, -1});
      flush_updates({norm});
    }
    return std::move(g_);
  }

 private:
  Retention action(int l, int c) const {
    return plan_.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)].action;
  }
  // Layer l's saved bytes that go to the host and back (its boundary among them).
  Bytes offloaded(int l) const {
    Bytes b;
    for (int c = 0; c < activation_class_count; ++c)
      if (action(l, c) == Retention::offload) b += costs_[static_cast<std::size_t>(l)].saved[static_cast<std::size_t>(c)];
    return b;
  }
  std::uint64_t chunk_tokens(int l) const {  // check_plan: > 0
    return std::min(plan_.chunks[static_cast<std::size_t>(l)].moe_tokens, plan_.workload.tokens());
  }
  double time_of(const Operation& op) const {
    const auto t = cost_.predict(op);
    return t.longest();
  }
  // A pass over `params` values moving `bytes_per_param` of host memory each, at the bandwidth
  // the CPU AdamW's measured rate implies (it moves 30 bytes a parameter, memory-bound).
  double host_pass_seconds(std::uint64_t params, double bytes_per_param) const {
    return static_cast<double>(params) * bytes_per_param /
           (ProfileCostModel::cpu_adamw_bytes_per_param * profile_.cpu_adamw_params_per_s);
  }
  double copy_time(OpKind kind, Bytes bytes) const { return bytes.count() == 0 ? 0.0 : time_of(Operation::moving(kind, bytes)); }
  // A layer's FLOPs over its tokens in chunks, each chunk a launch at the GEMM rate of its rows, or
  // at the layer's measured rate for the pass (LayerDescription::measured; recomputes and
  // regenerations are forward passes).
  enum class Pass : unsigned char { forward, backward };
  double compute_time(int l, double flops, Pass pass = Pass::forward) const {
    const std::uint64_t T = plan_.workload.tokens(), c = chunk_tokens(l);
    const MeasuredRates& m = layers_[static_cast<std::size_t>(l)].measured;
    const double rate = pass == Pass::forward ? m.forward_flops_per_s : m.backward_flops_per_s;
    auto one = [&](std::uint64_t rows) {
      const double f = flops * static_cast<double>(rows) / static_cast<double>(T);
      if (f <= 0) return profile_.launch_overhead_s;
      return profile_.launch_overhead_s +
             (rate > 0 ? f / rate : ProfileCostModel::compute_seconds(profile_.gemm_flops, static_cast<double>(rows), f / static_cast<double>(rows)));
    };
    return static_cast<double>(T / c) * one(c) + (T % c > 0 ? one(T % c) : 0.0);
  }
  // Layer l's workset over one chunk: a chunk's share, rounded up (never less than its own temporaries).
  Bytes workset_part(int l) const {
    return chunk_workset(costs_[static_cast<std::size_t>(l)].cost.workset, plan_.workload.tokens(), chunk_tokens(l));
  }
  void hold_workset(int l, int from, int to) {
    if (const Bytes part = workset_part(l); part.count() > 0) g_.hold(Claimant::worksets, part, from, to);
  }
  // The weights of layer l into the next slot, once the slot's last user is done with it (and
  // `after`: what the executor waits for on the host before it queues the load).
  int load(int l, std::vector<int> deps) {
    const auto L = static_cast<std::size_t>(l);
    slot_ = next_slot_;
    next_slot_ = (next_slot_ + 1) % slot_user_.size();
    if (slot_user_[slot_] >= 0) deps.push_back(slot_user_[slot_]);
    const Bytes w = bytes_of(plan_.precision.weights, streamed_[L]);
    return g_.add({"h2d.weights", Resource::h2d, copy_time(OpKind::copy_h2d, w), deps, l});
  }
  void release(int op) { slot_user_[slot_] = op; }
  // Layer l's saved activations, its boundary among them: kept from their making to its
  // backward; offloaded ones on the GPU until their copy out and again from their copy back in,
  // on the host in between; recomputed ones during the forward and from the recompute on.
  void hold_saved(int l, int fwd, int offload, int prefetch, int rec, int bwd) {
    const auto L = static_cast<std::size_t>(l);
    for (int c = 0; c < activation_class_count; ++c) {
      const Bytes b = costs_[L].saved[static_cast<std::size_t>(c)];
      if (b.count() == 0) continue;
      const int made = c == 0 ? producers_[L] : fwd;
      switch (action(l, c)) {
        case Retention::keep: g_.hold(Claimant::retained_activations, b, made, bwd); break;
        case Retention::offload:
          g_.hold(Claimant::retained_activations, b, made, offload);
          if (c == 0 && early_[L] >= 0) {  // back early for a regeneration (its GPU hold: build())
            g_.hold(Claimant::host_offload, b, offload, early_[L]);
            break;
          }
          g_.hold(Claimant::host_offload, b, offload, prefetch);
          g_.hold(Claimant::retained_activations, b, prefetch, bwd);
          break;
        case Retention::recompute:
          g_.hold(Claimant::retained_activations, b, made, fwd);
          g_.hold(Claimant::retained_activations, b, c == 0 ? back_[L] : rec, bwd);  // a boundary: from its regeneration
          break;
      }
    }
  }
  // The HostExecutor's regeneration in layer l's backward (the first of its group): layer f's
  // boundary brought back if it was offloaded (and held to f's backward, build()), the streamed
  // weights of layers [f, l) into a workset of their own, then their forwards rerun for their
  // outputs, the boundaries of layers f+1 .. l, each held to its own backward (hold_saved).
  int regenerate(int l, int load_l, const std::vector<int>& offload) {
    const int f = plan_.retention[static_cast<std::size_t>(l)][boundary].recompute_from;  // check_plan: a group
    const auto F = static_cast<std::size_t>(f);
    std::vector<int> deps{load_l};
    if (action(f, 0) == Retention::offload) {
      const Bytes b = costs_[F].saved[boundary];
      early_[F] = g_.add({"h2d.boundary (to regenerate from)", Resource::h2d, copy_time(OpKind::copy_h2d, b), {offload[F]}, l});
      deps.push_back(early_[F]);
    }
    Bytes w, copied;  // held: each layer's weights from a 256-byte boundary, as the executor packs them
    double seconds = 0;
    Bytes temporaries;
    for (int j = f; j < l; ++j) {
      const Bytes layer_weights = bytes_of(plan_.precision.weights, streamed_[static_cast<std::size_t>(j)]);
      copied += layer_weights;
      w += layer_weights.align_up(streamed_weight_alignment);
      seconds += compute_time(j, costs_[static_cast<std::size_t>(j)].cost.forward_flops);
      temporaries = max(temporaries, workset_part(j));
    }
    int weights = -1;
    if (w.count() > 0) {
      weights = g_.add({"h2d.weights.regenerate", Resource::h2d, copy_time(OpKind::copy_h2d, copied), {}, l});
      deps.push_back(weights);
    }
    const int op = g_.add({"regenerate", Resource::gpu_compute, seconds, deps, l});
    if (weights >= 0) g_.hold(Claimant::worksets, w, weights, op);
    if (temporaries.count() > 0) g_.hold(Claimant::worksets, temporaries, op, op);
    for (int j = f + 1; j <= l; ++j) back_[static_cast<std::size_t>(j)] = op;
    return op;
  }
  void flush_updates(const std::vector<int>& extra) {
    for (auto& op : pending_) {
      op.deps.insert(op.deps.end(), extra.begin(), extra.end());
      g_.add(std::move(op));
    }
    pending_.clear();
  }

  const std::vector<LayerDescription>& layers_;
  const std::vector<Costed>& costs_;
  const MachineProfile& profile_;
  ProfileCostModel cost_;
  const Plan& plan_;
  std::vector<std::uint64_t> resident_, streamed_;
  StepGraph g_;
  std::vector<int> slot_user_;
  std::size_t slot_ = 0, next_slot_ = 0;
  std::array<int, 2> grad_slot_user_{-1, -1};
  std::vector<int> producers_;  // by layer: the op that made its boundary, this micro-batch
  std::vector<int> back_;   // by layer: the regeneration that gave its boundary back, this micro-batch (-1: none yet)
  std::vector<int> early_;  // by layer: its offloaded boundary's early copy up for a regeneration (-1: none)
  std::vector<SimOp> pending_;  // updates not yet issued
};

struct Template {
  std::string name;
  Retention boundary, others;  // others fall back to the boundary's action where not recomputable
  /// Boundaries regenerated in groups of this many layers (1: none): a group's first boundary as
  /// `boundary` says, the others regenerated from it by rerunning the layers between, as long as
  /// those are recomputable (a group ends before one that is not).
  std::size_t group = 1;
};

/// The templates for a stack of n layers: every layer alike, then checkpointing (kept or
/// offloaded) in groups of 2, 4 and about sqrt(n) layers, each group's boundaries but its first
/// regenerated: the classic trade of a rerun forward for the boundaries' memory.
std::vector<Template> templates_for(std::size_t n) {
  std::vector<Template> out = {
      {"keep-all", Retention::keep, Retention::keep},
      {"checkpoint", Retention::keep, Retention::recompute},
      {"offload-checkpoint", Retention::offload, Retention::recompute},
      {"offload-all", Retention::offload, Retention::offload},
  };
  std::vector<std::size_t> groups{2, 4, static_cast<std::size_t>(std::lround(std::sqrt(static_cast<double>(n))))};
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  for (std::size_t g : groups) {
    if (g < 2 || g > n) continue;
    out.push_back({fmt::format("checkpoint, boundaries regenerated in groups of {}", g), Retention::keep, Retention::recompute, g});
    out.push_back({fmt::format("offload-checkpoint, boundaries regenerated in groups of {}", g), Retention::offload, Retention::recompute, g});
  }
  return out;
}

void check_request(const PlanRequest& req) {
  check_plan_request(req);
  if (req.gpus != 1)
    OOM_THROW(Errc::unsupported, fmt::format("plan request: the layer-stack planner plans one GPU, not {} (the HostExecutor "
                                             "runs on one)", req.gpus));
  // Planned at other precisions than the executor keeps, a plan would misstate its memory.
  require_kept_precision(req.precision, "plan request for the layer executor");
}

void check_plan(const Plan& p, const std::vector<LayerDescription>& stack) {
  const std::size_t layers = stack.size();
  if (p.retention.size() != layers || p.chunks.size() != layers)
    OOM_THROW(Errc::invalid_argument, fmt::format("plan covers {} layers ({} chunk entries), the stack has {}", p.retention.size(),
                                                  p.chunks.size(), layers));
  if (p.gpus != 1) OOM_THROW(Errc::unsupported, fmt::format("plan for {} GPUs: the layer-stack planner plans one", p.gpus));
  check_plan_counts(p);
  for (std::size_t l = 0; l < layers; ++l) {
    check_recompute_sources(p, l);  // as the HostExecutor runs them
    // ... and only through layers that may run again.
    for (int c = 0; c < activation_class_count; ++c) {
      const auto d = p.retention[l][static_cast<std::size_t>(c)];
      if (d.action != Retention::recompute) continue;
      if (c > 0 && !stack[l].recomputable)
        OOM_THROW(Errc::invalid_argument, fmt::format("plan, layer {} ('{}'): {} recomputed, but the layer is not recomputable", l,
                                                      stack[l].name, to_string(static_cast<ActivationClass>(c))));
      if (c > 0) continue;
      for (std::size_t j = static_cast<std::size_t>(d.recompute_from); j < l; ++j)
        if (!stack[j].recomputable)
          OOM_THROW(Errc::invalid_argument, fmt::format("plan, layer {}: its boundary is regenerated through layer {} ('{}'), which is "
                                                        "not recomputable", l, j, stack[j].name));
    }
  }
}

}  // namespace

std::vector<LayerDescription> with_measured_rates(std::vector<LayerDescription> layers, const Timeline& step, const Workload& workload) {
  if (workload.tokens() == 0) OOM_THROW(Errc::invalid_argument, "with_measured_rates: the workload has no tokens");
  struct Sum {
    double seconds = 0;
    int spans = 0;
  };
  std::unordered_map<std::string, Sum> by_name;
  for (const TimelineSpan& s : step.spans()) {
    if (s.resource != Resource::gpu_compute) continue;
    Sum& sum = by_name[s.name];
    sum.seconds += s.end_s - s.begin_s;
    ++sum.spans;
  }
  std::unordered_map<std::string, std::size_t> named;  // a name's spans are one layer's only if the name is
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (auto [it, fresh] = named.emplace(layers[l].name, l); !fresh)
      OOM_THROW(Errc::invalid_argument, fmt::format("with_measured_rates: layers {} and {} are both named '{}', so their spans cannot be "
                                                    "told apart (give each layer a name of its own)",
                                                    it->second, l, layers[l].name));
  for (std::size_t l = 0; l < layers.size(); ++l) {
    LayerDescription& d = layers[l];
    if (!d.cost) OOM_THROW(Errc::invalid_argument, fmt::format("with_measured_rates: layer {} ('{}') has no cost function", l, d.name));
    const LayerCost c = d.cost(workload);
    auto rate = [&](const char* pass, double flops) {
      const std::string name = fmt::format("{} {}", pass, d.name);
      const auto it = by_name.find(name);
      if (it == by_name.end())
        OOM_THROW(Errc::invalid_argument, fmt::format("with_measured_rates: layer {} ('{}'): the recorded step has no '{}' span on the "
                                                      "compute stream (record a step of an executor running these layers, "
                                                      "record_next_step, that was not skipped for a non-finite loss)",
                                                      l, d.name, name));
      if (!(it->second.seconds > 0))
        OOM_THROW(Errc::invalid_argument, fmt::format("with_measured_rates: layer {} ('{}'): its '{}' spans took {} s", l, d.name, name,
                                                      it->second.seconds));
      return flops * it->second.spans / it->second.seconds;
    };
    d.measured.forward_flops_per_s = rate("fwd", c.forward_flops);
    d.measured.backward_flops_per_s = rate("bwd", c.backward_flops);
  }
  return layers;
}

std::string layer_stack_fingerprint(const std::vector<std::vector<StateSegment>>& segments_per_layer) {
  std::string text = fmt::format("layers {};", segments_per_layer.size());
  for (const auto& segments : segments_per_layer) {
    text += fmt::format("layer {}:", segments.size());
    for (const StateSegment& seg : segments) detail::append_segment(text, seg);
  }
  return detail::fingerprint_of(text);
}

LayerStackPlanner::LayerStackPlanner(std::vector<LayerDescription> layers, const MachineProfile& profile, std::string model_name)
    : layers_(std::move(layers)), profile_(&profile), model_name_(std::move(model_name)) {
  profile.validate(profile.name);
  if (layers_.empty()) OOM_THROW(Errc::invalid_argument, "layer-stack planner: the stack has no layers");
  std::unordered_map<std::string, std::size_t> seen;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (!layers_[l].cost) OOM_THROW(Errc::invalid_argument, fmt::format("layer {} ('{}') has no cost function", l, layers_[l].name));
    if (const MeasuredRates& m = layers_[l].measured; bad_number(m.forward_flops_per_s) || bad_number(m.backward_flops_per_s))
      OOM_THROW(Errc::invalid_argument, fmt::format("layer {} ('{}'): measured FLOP rates must be finite and >= 0 (forward {}, "
                                                    "backward {}; 0: the profile's GEMM rate)",
                                                    l, layers_[l].name, m.forward_flops_per_s, m.backward_flops_per_s));
    for (const auto& s : layers_[l].segments)
      if (auto [it, fresh] = seen.emplace(s.name, l); !fresh)
        OOM_THROW(Errc::invalid_argument, fmt::format("segment name '{}' is used by layer {} and layer {} ('{}'): plans name "
                                                      "resident segments, so names must be unique",
                                                      s.name, it->second, l, layers_[l].name));
  }
  std::vector<std::vector<StateSegment>> segments;
  segments.reserve(layers_.size());
  for (const auto& l : layers_) segments.push_back(l.segments);
  layers_fingerprint_ = layer_stack_fingerprint(segments);
}

StepGraph LayerStackPlanner::step_graph(const Plan& plan) const {
  check_plan(plan, layers_);
  const auto costs = cost_layers(layers_, plan.workload);
  return GraphBuilder(layers_, costs, *profile_, plan).build();
}

SimResult LayerStackPlanner::simulate(const Plan& plan) const { return oom::simulate(step_graph(plan)); }

PlanSet LayerStackPlanner::plan(const PlanRequest& req) const {
  const auto t0 = std::chrono::steady_clock::now();
  check_request(req);
  const auto costs = cost_layers(layers_, req.workload);
  const std::size_t n = layers_.size();
  const std::uint64_t T = req.workload.tokens();
  const Bytes usable{static_cast<std::uint64_t>(static_cast<double>(req.gpu_budget.count()) * (1.0 - gpu_margin))};

  // Residency order: layer by layer from the first, whose weights open the step's forward and
  // whose updates close it (the next step's first load waits on them); a plan's resident set is a
  // prefix of this order.
  std::vector<std::string> order;
  for (const auto& d : layers_)
    for (const auto& s : d.segments) order.push_back(s.name);

  // Chunk sizes: the whole micro-batch, then halves, while any chunkable layer has a workset.
  std::vector<std::uint64_t> chunk_levels{T};
  bool chunkable = false;
  for (std::size_t l = 0; l < n; ++l)
    chunkable |= layers_[l].chunking != ChunkDependency::none && costs[l].cost.workset.count() > 0;
  if (chunkable)
    for (std::uint64_t c = T; c > 1;) chunk_levels.push_back(c = (c + 1) / 2);

  PlanSet out;
  struct Found {
    Plan plan;
    std::size_t resident = 0;
  };
  std::vector<Found> feasible;
  // For the refusal: the least GPU memory of a plan within the host budget; the least host memory
  // of a plan within the GPU budget; failing that, the least host memory of any plan.
  Bytes least_gpu{~0ull}, least_host{~0ull}, least_host_any{~0ull};
  std::string least_claimant;
  // Each template's table. A class a layer does not save is set as the template says; the
  // tables are compared over the classes saved, so no two candidates differ only there.
  const std::vector<Template> templates = templates_for(n);
  struct Candidate {
    std::string name;
    std::vector<std::array<RetentionDecision, activation_class_count>> table;
    std::size_t far;  // its template (the far part, where it is a mix)
  };
  std::vector<Candidate> candidates;  // the templates, then their mixes
  for (const Template& tpl : templates) {
    auto& table = candidates.emplace_back(Candidate{tpl.name, {}, candidates.size()}).table;
    std::size_t first = 0;  // the current group's first layer
    for (std::size_t l = 0; l < n; ++l) {
      std::array<RetentionDecision, activation_class_count> row{};
      const bool rec = layers_[l].recomputable;
      // A boundary regenerated from the group's first: the group is not full and every layer to
      // rerun (first .. l-1) is recomputable; otherwise l starts the next group.
      const bool regenerated = l > first && l - first < tpl.group && layers_[l - 1].recomputable;
      if (!regenerated) first = l;
      for (int c = 0; c < activation_class_count; ++c) {
        if (c > 0 && costs[l].saved[static_cast<std::size_t>(c)].count() == 0) continue;  // keep: nothing to move
        if (c == 0) {
          row[0] = regenerated ? RetentionDecision::recompute(static_cast<int>(first)) : RetentionDecision{tpl.boundary, -1};
          continue;
        }
        const Retention a = tpl.others == Retention::recompute && !rec ? tpl.boundary : tpl.others;
        row[static_cast<std::size_t>(c)] =
            a == Retention::recompute ? RetentionDecision::recompute(static_cast<int>(l)) : RetentionDecision{a, -1};
      }
      table.push_back(row);
    }
  }
  // Mixes: the layers nearest the loss, whose backward comes first (an offload or a recompute of
  // theirs is waited for at once), under keep-all or checkpoint, the others under any other
  // template, for the last quarter, half and three quarters of the stack. A group of regenerated
  // boundaries cut by the mix stays valid: its layers below the cut keep regenerating from the
  // group's first, those above keep their boundaries.
  const std::size_t pure = templates.size();
  for (std::size_t far = 1; far < pure; ++far)
    for (std::size_t near : {std::size_t{0}, std::size_t{1}}) {  // keep-all, checkpoint
      if (near == far) continue;
      for (std::size_t q : {n / 4, n / 2, 3 * n / 4}) {
        if (q == 0 || q >= n) continue;
        auto mixed = candidates[far].table;
        std::copy(candidates[near].table.begin() + static_cast<std::ptrdiff_t>(n - q), candidates[near].table.end(),
                  mixed.begin() + static_cast<std::ptrdiff_t>(n - q));
        candidates.push_back({fmt::format("{} + last {} layers {}", templates[far].name, q, templates[near].name), std::move(mixed), far});
      }
    }
  if (!req.retention.empty() &&
      std::none_of(templates.begin(), templates.end(), [&](const Template& t) { return t.name == req.retention; })) {
    std::string known;
    for (const Template& t : templates) known += fmt::format("{}'{}'", known.empty() ? "" : ", ", t.name);
    OOM_THROW(Errc::invalid_argument, fmt::format("plan request: retention '{}' is not one the layer-stack planner searches for {} "
                                                  "layers ({})", req.retention, n, known));
  }
  // Those the request asks for, each table once: a template that gives an earlier one's table (no
  // layer recomputable, say) adds nothing.
  std::vector<const Candidate*> searched;
  for (const Candidate& c : candidates)
    if ((req.retention.empty() || templates[c.far].name == req.retention) &&
        std::none_of(searched.begin(), searched.end(), [&](const Candidate* s) { return s->table == c.table; }))
      searched.push_back(&c);
  const int depths = static_cast<int>(std::min<std::size_t>(3, 2 * n));  // loads per micro-batch: 2n

  for (int depth = 1; depth <= depths; ++depth) {
    for (const Candidate* cand : searched) {
      for (std::uint64_t chunk : chunk_levels) {
        Plan p = Plan::for_request(req, model_name_);  // check_request: one GPU
        p.layers_fingerprint = layers_fingerprint_;
        p.prefetch_depth = depth;
        p.retention_name = cand->name;
        p.retention = cand->table;
        for (std::size_t l = 0; l < n; ++l) {
          LayerChunks lc;
          lc.moe_tokens = layers_[l].chunking != ChunkDependency::none ? chunk : T;
          p.chunks.push_back(lc);
        }
        p.loss_rows = T;
        // The first `k` segments of the order resident.
        auto with = [&](std::size_t k) {
          Plan q = p;
          q.resident_segments.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
          const SimResult sim = oom::simulate(GraphBuilder(layers_, costs, *profile_, q).build());
          ++out.evaluated;
          q.predicted = Prediction::of(sim);
          return q;
        };
        auto gpu_fits = [&](const Plan& q) { return q.predicted.gpu_peak <= usable; };
        auto host_fits = [&](const Plan& q) { return q.predicted.host_peak <= req.host_budget; };
        // The most resident prefix in [lo, hi] within the GPU budget, given `at_lo`'s plan within
        // it (bisection; more resident segments, more GPU memory).
        auto most_within_gpu = [&](std::size_t lo, std::size_t hi, Plan at_lo) {
          while (lo < hi) {
            const std::size_t mid = lo + (hi - lo + 1) / 2;
            Plan q = with(mid);
            if (gpu_fits(q)) {
              lo = mid;
              at_lo = std::move(q);
            } else {
              hi = mid - 1;
            }
          }
          return std::pair{lo, std::move(at_lo)};
        };
        // More resident segments: more GPU memory, less host memory. The smallest resident prefix
        // within the host budget (bisection) ...
        const std::size_t S = order.size();
        Plan none = with(0);
        std::size_t k_lo = 0;
        Plan low = none;
        if (!host_fits(none)) {
          Plan all = with(S);
          if (!host_fits(all)) {  // no prefix fits the host (offloaded activations, say)
            least_host_any = min(least_host_any, all.predicted.host_peak);
            continue;
          }
          std::size_t a = 0, b = S;  // host_fits(b), !host_fits(a)
          low = std::move(all);
          while (b - a > 1) {
            const std::size_t mid = a + (b - a) / 2;
            Plan q = with(mid);
            if (host_fits(q)) {
              b = mid;
              low = std::move(q);
            } else {
              a = mid;
            }
          }
          k_lo = b;
        }
        if (!gpu_fits(low)) {  // the least GPU memory a plan within the host budget needs, here
          const Bytes need{static_cast<std::uint64_t>(std::ceil(static_cast<double>(low.predicted.gpu_peak.count()) / (1.0 - gpu_margin)))};
          if (need < least_gpu) {
            least_gpu = need;
            const auto& at = low.predicted.gpu_at_peak;
            least_claimant = to_string(static_cast<Claimant>(std::max_element(at.begin(), at.begin() + 3) - at.begin()));
          }
          // The host memory of the most resident prefix within the GPU budget, where one is.
          if (k_lo > 0 && gpu_fits(none)) least_host = min(least_host, most_within_gpu(0, k_lo - 1, none).second.predicted.host_peak);
          continue;  // smaller chunks may fit
        }
        // ... and the largest within the GPU budget (bisection; each plan kept was simulated), with
        // a few levels between: more residency is not always faster.
        auto [lo, best] = most_within_gpu(k_lo, S, low);
        std::vector<std::size_t> levels{lo, k_lo + (lo - k_lo) / 2, k_lo + (lo - k_lo) / 4, k_lo};
        levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
        for (std::size_t k : levels) {
          Plan q = k == lo ? best : k == k_lo ? low : with(k);
          if (!gpu_fits(q) || !host_fits(q)) continue;
          ++out.feasible;
          feasible.push_back({std::move(q), k});
        }
      }
    }
  }
  out.search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (feasible.empty()) {
    std::string msg = fmt::format("no plan for {} fits: ", model_name_.empty() ? "this layer stack" : model_name_);
    if (least_gpu.count() != ~0ull)
      msg += fmt::format("within the host budget, the least GPU memory a plan needs is {} (largest claimant: {}), the budget is {}",
                         least_gpu, least_claimant, req.gpu_budget);
    if (least_host.count() != ~0ull)
      msg += fmt::format("{}within the GPU budget, the least host memory a plan needs is {}, the budget is {}",
                         msg.back() == ' ' ? "" : "; ", least_host, req.host_budget);
    else if (least_host_any.count() != ~0ull && least_gpu.count() == ~0ull)  // (else a plan meets the host budget: not the bound)
      msg += fmt::format("{}the least host memory any plan needs is {}, the budget is {}", msg.back() == ' ' ? "" : "; ",
                         least_host_any, req.host_budget);
    OOM_THROW(Errc::out_of_budget, msg);
  }
  std::stable_sort(feasible.begin(), feasible.end(), [](const Found& a, const Found& b) {
    if (a.plan.predicted.step_s != b.plan.predicted.step_s) return a.plan.predicted.step_s < b.plan.predicted.step_s;
    return a.plan.predicted.gpu_peak < b.plan.predicted.gpu_peak;
  });
  // Distinct alternatives: one that differs from a better one only in depth or chunks says nothing new.
  const auto wanted = static_cast<std::size_t>(req.candidates);
  std::vector<const Found*> chosen;
  for (const auto& f : feasible) {
    if (chosen.size() == wanted) break;
    if (std::none_of(chosen.begin(), chosen.end(), [&](const Found* b) {
          return b->plan.retention == f.plan.retention && b->resident == f.resident;
        }))
      chosen.push_back(&f);
  }
  for (const Found* f : chosen) out.plans.push_back(f->plan);
  return out;
}

std::string LayerStackPlanner::describe(const Plan& p) const {
  check_plan(p, layers_);  // a plan of another stack had been described as if it were this one's
  const auto& pr = p.predicted;
  std::string s = fmt::format("{} layers, prefetch depth {}, {} micro-batch(es) of {} x {} tokens\n", layers_.size(), p.prefetch_depth,
                              p.micro_batches, p.workload.sequences, p.workload.seq_len);
  s += fmt::format("GPU memory at its peak: {} of {} budget\n", pr.gpu_peak, p.gpu_budget);
  for (auto c : {Claimant::resident_state, Claimant::retained_activations, Claimant::worksets})
    s += fmt::format("  {:<22} {:>12}  (own peak {})\n", to_string(c), pr.gpu_at_peak[static_cast<std::size_t>(c)],
                     pr.peak[static_cast<std::size_t>(c)]);
  s += fmt::format("host memory at its peak: {} of {} budget\n", pr.host_peak, p.host_budget);
  for (auto c : {Claimant::host_state, Claimant::host_staging, Claimant::host_offload})
    s += fmt::format("  {:<22} {:>12}\n", to_string(c), pr.peak[static_cast<std::size_t>(c)]);
  s += describe_precision(p.precision);
  std::size_t segments = 0;
  std::uint64_t params = 0, resident_params = 0;
  const std::unordered_set<std::string> resident(p.resident_segments.begin(), p.resident_segments.end());
  for (const auto& d : layers_)
    for (const auto& seg : d.segments) {
      ++segments;
      params += seg.parameters();
      if (resident.count(seg.name) > 0) resident_params += seg.parameters();
    }
  s += fmt::format("residency: {} of {} segments resident ({} of {} parameters)\n", p.resident_segments.size(), segments,
                   resident_params, params);
  s += fmt::format("retention: {}\n{}\n", p.retention_name, describe_boundaries(p));
  std::uint64_t smallest = p.workload.tokens();
  for (const auto& c : p.chunks) smallest = std::min(smallest, c.moe_tokens == 0 ? p.workload.tokens() : c.moe_tokens);
  s += fmt::format("chunking: {} tokens per chunk at the smallest\n", smallest);
  const auto measured = std::count_if(layers_.begin(), layers_.end(), [](const LayerDescription& d) {
    return d.measured.forward_flops_per_s > 0 || d.measured.backward_flops_per_s > 0;
  });
  s += measured == 0 ? std::string("compute: declared FLOPs at the profile's GEMM rate\n")
                     : fmt::format("compute: {} of {} layers at their measured rates\n", measured, layers_.size());
  s += fmt::format("predicted step {} s; busy:", seconds_label(pr.step_s));
  for (int r = 0; r < resource_count; ++r)
    if (pr.busy.seconds[static_cast<std::size_t>(r)] > 0)
      s += fmt::format(" {} {} s", to_string(static_cast<Resource>(r)), seconds_label(pr.busy.seconds[static_cast<std::size_t>(r)]));
  s += "\n";
  return s;
}

}  // namespace oom
