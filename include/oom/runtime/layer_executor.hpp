// LayerExecutor: runs training steps of a stack of the caller's layers on a backend as a Plan says —
// weights streamed through `prefetch_depth` slots or resident, saved activations kept, offloaded
// and prefetched back, or recomputed, layer boundaries regenerated through the layers before them,
// the MLP work in the plan's token chunks, streamed segments updated by the CPU AdamW as soon as
// their gradients land, resident ones by the device AdamW.
// Every plan computes the same step: the tests compare weights bit for bit across plans.
// Backends: HostBackend (runtime/host_executor.hpp: HostExecutor<L>, the reference, layers computed
// on the CPU) and CudaBackend (runtime/cuda_layer_executor.hpp: CudaLayerExecutor<L>, layers that
// enqueue CUDA work on the stream they are handed). docs/runtime.md, "Your own layers".
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <memory>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "oom/concepts/layer.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/optim/cpu_adamw.hpp"
#include "oom/optim/segment_state.hpp"
#include "oom/plan/plan.hpp"
#include "oom/concepts/backend.hpp"
#include "oom/runtime/progress.hpp"
#include "oom/runtime/timeline.hpp"

namespace oom {

/// What the executor hands a layer for one call over tokens [begin, end). Every pointer is in the
/// backend's device memory (host memory on the HostBackend).
struct LayerContext {
  /// Where the layer enqueues its work: the backend's native stream (a cudaStream_t on the
  /// CudaBackend: launch there, never synchronize; null on the HostBackend, whose layers compute
  /// inside the stream's task).
  void* stream = nullptr;
  std::vector<std::span<const bf16>> weights;  ///< per segment of the layer, bound where they live now
  std::vector<std::span<float>> weight_grads;  ///< per segment, fp32, accumulated over tokens in order
  std::uint64_t tokens = 0;
  /// The tokens are this many sequences of tokens / sequences, one after another: attention (and
  /// a position's RoPE angle) is within each.
  std::uint64_t sequences = 1;
  std::uint64_t begin = 0, end = 0;
  const float* input = nullptr;        ///< (T, H) the layer boundary
  float* output = nullptr;             ///< (T, H), or nullptr when recomputing saved activations only
  const float* grad_output = nullptr;  ///< (T, H)
  float* grad_input = nullptr;         ///< (T, H)
  std::array<float*, activation_class_count> saved{};  ///< buffers for the classes the layer saves
  /// For a layer that asks for it (layer_traits<L>::uses_workspace), its temporaries for this
  /// call: its declared LayerCost::workset for the plan's workload, the chunk's share rounded up
  /// (chunk_workset), in device memory counted against the budget (claimant worksets), as the
  /// planner holds it; null otherwise. The chunks of one pass get the same one, in turn.
  void* workspace = nullptr;
  std::uint64_t workspace_bytes = 0;
  /// A forward rerun to regenerate the output (the boundary of the layer above) for the backward:
  /// it must write the same output bits as the step's forward did and count nothing of the step a
  /// second time (a load-balancing loss's statistics, say). `saved` is empty then.
  bool regenerating = false;
};

/// A layer a LayerExecutor runs: describable, forward/backward over a LayerContext, and the
/// number of floats it saves per activation class for `tokens` tokens (0: none of that class).
/// The executor holds what these say (fp32), the plan counted what cost() declares: they must
/// agree, LayerCost::output being hidden() x tokens x 4 bytes and each class's declared
/// activations saved_floats() x 4 bytes; the executor refuses a layer where they do not.
template <class L>
concept executor_layer = layer<L, LayerContext> && requires(const L& l, ActivationClass c, std::uint64_t t) {
  { l.saved_floats(c, t) } -> std::convertible_to<std::uint64_t>;
  { l.hidden() } -> std::convertible_to<std::uint64_t>;
};

struct LayerExecutorOptions {
  optim::AdamWConfig adamw;
  /// A step whose loss is NaN or infinite ends after the forward: no backward, no update, the
  /// optimizer's step count unchanged; step() returns the loss and the caller decides.
  bool skip_nonfinite_loss = true;
  /// Every gradient is checked as it lands; a NaN or infinity throws Errc::invalid_argument naming
  /// the segment. A streamed segment (CPU AdamW) is then not updated; a resident one on the GPU is
  /// (its flag is read at the end of the step). Other segments of that step may have been updated
  /// already, since updates overlap the backward: the run should stop, not continue.
  bool check_gradients = true;
  /// Leave every gradient in place after the backward instead of updating as they land, so the
  /// caller can take the global norm (gradient_sum_of_squares()) and then apply_updates() with a
  /// clipping factor. Costs the overlap of the CPU AdamW with the backward.
  bool defer_updates = false;
  /// Threads of the CPU AdamW of streamed segments (the stream's host thread that runs it
  /// included); 0: one fewer than the hardware threads, so the thread issuing the work is not
  /// queued behind them. Any count gives the same bits.
  unsigned cpu_threads = 0;
  /// Test hook: compute does not wait for its weights' load. Exists so the equivalence tests can
  /// show they catch a broken schedule; never set it otherwise.
  bool drop_weight_wait = false;
  /// Test hook: each weight load is held this many milliseconds first (a host task on the copy
  /// stream), so that a missing wait surely reads a stale slot. 0 otherwise.
  int slow_weight_loads_ms = 0;
};

/// The loss at the top of the stack, computed where the "device" memory is host memory (the
/// HostBackend): from the last layer's output y (T, H) writes dL/dy into grad_y (T, H) and returns
/// L. Runs on the compute stream, after the forward.
using HostLossFn = std::function<double(const float* y, float* grad_y)>;
/// The loss at the top of the stack on any backend: enqueues on `stream` (LayerContext::stream)
/// the work that writes dL/dy into grad_y (T, H, device memory) and L into *loss (host memory the
/// stream may write: a kernel can store to it, the backend maps it; or copy into it). The
/// executor reads *loss once the stream has run.
using DeviceLossFn = std::function<void(const float* y, float* grad_y, double* loss, void* stream)>;

template <executor_layer L, executor_backend B>
class LayerExecutor {
 public:
  /// `initial_master[i]` holds the fp32 master weights of the i-th segment, in layer order. The
  /// plan is copied; `layers` and `backend` are held by reference and must outlive the executor.
  /// Every layer has the same hidden(), not 0 (the boundaries between them are one size); its
  /// cost() for the plan's workload is what the executor holds for it (executor_layer: an output
  /// of hidden() x tokens fp32, each class's activations saved_floats() fp32, no layer_boundary
  /// activation); a layer that runs whole (ChunkDependency::none) gets one chunk.
  /// Errc::invalid_argument otherwise, naming the layer and both sizes, before
  /// anything is taken from the backend, as is an `initial_master` of more or fewer vectors than
  /// the layers have segments, a plan of counts out of range (check_plan_counts), a plan that
  /// clips gradients (Plan::clip_grad_norm) without options.defer_updates, and a LayerStackPlanner's
  /// plan of other layers (Plan::layers_fingerprint: segment names or tensor shapes that differ). (The plan may name resident segments outside the stack:
  /// a causal LM's embedding and head, which its caller holds.)
  LayerExecutor(B& backend, std::vector<L>& layers, const Plan& plan, const std::vector<std::vector<float>>& initial_master,
                LayerExecutorOptions options = {})
      : b_(backend), layers_(layers), plan_(plan), options_(options), pool_(optim::optimizer_threads(options.cpu_threads)), loss_words_(backend.host_words(1)) {
    if (static_cast<int>(plan.retention.size()) != static_cast<int>(layers.size()) || plan.chunks.size() != layers.size())
      OOM_THROW(Errc::invalid_argument, fmt::format("plan covers {} layers, the model has {}", plan.retention.size(), layers.size()));
    if (plan.micro_batches < 1 || plan.gpus != 1)
      OOM_THROW(Errc::unsupported, fmt::format("a layer executor runs on one device, at least one micro-batch (the plan: {} GPUs, {} "
                                               "micro-batches)", plan.gpus, plan.micro_batches));
    if (layers.empty()) OOM_THROW(Errc::invalid_argument, "a layer executor needs at least one layer");
    // A plan priced for clipping by the global norm (PlanRequest::clip_grad_norm) with updates as
    // gradients land: nothing could clip, and the steps would silently run unclipped.
    if (plan.clip_grad_norm && !options.defer_updates)
      OOM_THROW(Errc::invalid_argument, "the plan clips gradients by their global norm (PlanRequest::clip_grad_norm), which needs "
                                        "LayerExecutorOptions::defer_updates (then gradient_sum_of_squares() and apply_updates() "
                                        "with the clipping factor); the executor was built without it");
    // A plan made by hand: a micro-batch of no tokens had run, every step's loss a mean over none
    // (NaN) and skipped.
    refuse_unrunnable_micro_batch(plan.workload);
    // A LayerStackPlanner's plan of another stack: its residency names had matched none of these
    // segments (everything streamed, nothing said) and its bytes had been another stack's.
    if (!plan.layers_fingerprint.empty()) {
      std::vector<std::vector<StateSegment>> segments;
      for (const auto& layer : layers) {
        const auto& segs = layer.segments();  // (segments() may answer by value)
        segments.emplace_back(std::ranges::begin(segs), std::ranges::end(segs));
      }
      if (const std::string mine = layer_stack_fingerprint(segments); mine != plan.layers_fingerprint) {
        std::string stranger;  // a resident segment of the plan that these layers lack, if any
        for (const auto& name : plan.resident_segments)
          if (std::ranges::none_of(segments, [&](const auto& ls) { return std::ranges::any_of(ls, [&](const auto& s) { return s.name == name; }); })) {
            stranger = fmt::format("; its resident segment '{}' is none of theirs", name);
            break;
          }
        OOM_THROW(Errc::invalid_argument, fmt::format("the plan was made for another layer stack (layers fingerprint {}; these layers' "
                                                      "segments, names and tensor shapes, give {}{}): plan these layers "
                                                      "(LayerStackPlanner over describe_layers) and run that plan",
                                                      plan.layers_fingerprint, mine, stranger));
      }
    }
    // ... nor counts out of range: a prefetch_depth of 0 had run with one slot and one of 10^6
    // taken that many, a MoE chunk of 0 tokens had run a token at a time.
    check_plan_counts(plan);
    require_kept_precision(plan.precision, "layer executor");
    // Everything checked before anything is taken from the backend.
    const std::uint64_t tokens = plan.workload.tokens();
    // Each layer's segment names, read once here: take_memory() takes them from this, so a layer
    // whose segments() would answer otherwise later cannot have us read past initial_master.
    std::vector<std::vector<std::string>> names(layers.size());
    // As many weight vectors as segments, checked first: one vector short had been named by the
    // segment after the last, "0 values for N parameters".
    std::size_t segment_total = 0;
    for (const auto& layer : layers) {
      const auto& segs = layer.segments();
      segment_total += static_cast<std::size_t>(std::ranges::distance(segs));
    }
    if (initial_master.size() != segment_total)
      OOM_THROW(Errc::invalid_argument, fmt::format("{} initial weight vectors for the layers' {} segments", initial_master.size(), segment_total));
    std::size_t index = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      // A width of 0 had been taken: boundaries of (T, 0), which the layer wrote its real rows past.
      if (layers[l].hidden() == 0)
        OOM_THROW(Errc::invalid_argument, fmt::format("layer {} ('{}'): hidden() is 0; the executor sizes the (T, H) boundaries the "
                                                      "layer reads and writes from it, which must be > 0", l, label(l)));
      if (layers[l].hidden() != layers.front().hidden())
        OOM_THROW(Errc::invalid_argument, fmt::format("layer {} has hidden size {}, layer 0 {}: the layers of a stack hand one "
                                                      "another (T, H) boundaries of one H", l, layers[l].hidden(), layers.front().hidden()));
      const std::uint64_t chunk = plan.chunks[l].moe_tokens;
      if (layer_traits<L>::chunking(layers[l]) == ChunkDependency::none && chunk < tokens)
        OOM_THROW(Errc::invalid_argument, fmt::format("plan: layer {} runs whole (its chunking() is ChunkDependency::none), the plan "
                                                      "cuts it in chunks of {} of {} tokens", l, chunk, tokens));
      for (const auto& seg : layers[l].segments()) {
        if (index >= initial_master.size() || initial_master[index].size() != seg.parameters())
          OOM_THROW(Errc::invalid_argument, fmt::format("initial weights of segment {} ('{}'): {} values for {} parameters", index,
                                                        seg.name, index < initial_master.size() ? initial_master[index].size() : 0,
                                                        seg.parameters()));
        // A NaN or infinite weight had been taken: every step's loss non-finite and skipped, no
        // segment named.
        if (const auto bad = std::ranges::find_if(initial_master[index], [](float v) { return !std::isfinite(v); });
            bad != initial_master[index].end())
          OOM_THROW(Errc::invalid_argument, fmt::format("initial weights of segment {} ('{}'): value {} of {} is {}", index, seg.name,
                                                        bad - initial_master[index].begin(), seg.parameters(), *bad));
        names[l].push_back(seg.name);
        ++index;
      }
      check_recompute_sources(plan, l);
      const LayerCost cost(layers[l].cost(plan.workload));
      declared_.push_back(check_declared_cost(l, cost));
      workset_.push_back(layer_traits<L>::uses_workspace ? cost.workset : Bytes{});
    }
    hidden_ = layers.front().hidden();
    // (A layer whose segments() answered otherwise the second time.)
    if (index != initial_master.size())
      OOM_THROW(Errc::invalid_argument, fmt::format("{} initial weight vectors for the layers' {} segments", initial_master.size(), index));
    compute_ = make_named_stream("compute");
    h2d_ = make_named_stream("h2d");
    d2h_ = make_named_stream("d2h");
    cpu_ = make_named_stream("cpu-optimizer");
    try {
      take_memory(initial_master, names);
    } catch (...) {  // out of budget, say: give back what was taken, and the streams
      release();
      throw;
    }
  }

  ~LayerExecutor() { release(); }
  LayerExecutor(const LayerExecutor&) = delete;
  LayerExecutor& operator=(const LayerExecutor&) = delete;

 private:
  // The state of every segment where the plan puts it, the weight slots and the gradient slots.
  // `names`: each layer's segments, as the constructor checked them against initial_master.
  void take_memory(const std::vector<std::vector<float>>& initial_master, const std::vector<std::vector<std::string>>& names) {
    std::unordered_map<std::string, bool> resident;
    for (const auto& n : plan_.resident_segments) resident[n] = true;
    std::size_t index = 0;
    for (const auto& layer_names : names) {
      auto& ls = layers_state_.emplace_back();
      for (const auto& name : layer_names) {
        auto& s = ls.segments.emplace_back();  // in place first: release() frees what it holds if a later allocation fails
        s.name = name;
        take_segment(s, initial_master[index++], resident.count(name) > 0);
      }
    }
    const auto& layers = layers_;
    const Plan& plan = plan_;
    loaded_ = b_.make_event();
    for (std::size_t l = 0; l < layers.size(); ++l) {
      layers_state_[l].updated = b_.make_event();
      layers_state_[l].forward_done = b_.make_event();
      layers_state_[l].offloaded = b_.make_event();
      layers_state_[l].grads_landed = b_.make_event();
    }
    const int depth = std::max(plan.prefetch_depth, 1);
    std::uint64_t largest_streamed = 0;  // a layer's streamed parameters, at most
    for (const auto& ls : layers_state_) {
      std::uint64_t streamed = 0;
      for (const auto& s : ls.segments)
        if (!s.resident) streamed += s.n;
      largest_streamed = std::max(largest_streamed, streamed);
    }
    const Bytes slot{largest_streamed * sizeof(bf16)};
    for (int i = 0; i < depth; ++i)
      slots_.push_back(Slot{static_cast<bf16*>(b_.allocate(MemorySpace::device(0), slot, Claimant::worksets)), slot, b_.make_event()});
    // Two gradient slots, taken by layer parity, as the CUDA executor's (and the planner's step
    // graph): a streamed layer's backward waits until its slot's last user's gradients went home.
    // (Allocated even where no layer streams: a streamed segment of no parameters still takes one.)
    const Bytes grad_slot{largest_streamed * sizeof(float)};
    for (int i = 0; i < 2; ++i) grad_slots_.push_back(GradSlot{alloc_device(grad_slot, Claimant::worksets), grad_slot, b_.make_event()});
  }
  // Retires the streams (each drained first: no task still uses the memory; a task's error stays
  // for the backend's next synchronize()), then gives back everything take_memory() took (as far
  // as it got).
  void release() noexcept {
    for (auto* s : {&compute_, &h2d_, &d2h_, &cpu_}) b_.retire(*s);
    for (auto& s : slots_) b_.free(s.ptr, MemorySpace::device(0), s.bytes, Claimant::worksets);
    for (auto& s : grad_slots_) b_.free(s.ptr, MemorySpace::device(0), s.bytes, Claimant::worksets);
    slots_.clear();
    grad_slots_.clear();
    for (auto& ls : layers_state_)
      for (auto& s : ls.segments) free_segment(s);
    layers_state_.clear();
  }

 public:
  /// One training step on `input` (T, H) against `target` (T, H) with loss 0.5·mean‖y − target‖².
  /// Returns the loss; `grad_input`, when given, receives dL/d(input) (T, H). If anything throws (a budget overrun, say), the work already queued is
  /// drained before the exception leaves, so no stream touches the caller's buffers afterwards; a
  /// further task error from that work is thrown by the backend's next synchronize() (the next
  /// step, say), not dropped.
  double step(const std::vector<float>& input, const std::vector<float>& target, std::vector<float>* grad_input = nullptr)
    requires device_memory_is_host<B>
  {
    check_stack();
    const std::uint64_t t = plan_.workload.tokens();
    const std::uint64_t h = layers_.front().hidden();
    if (target.size() != t * h) OOM_THROW(Errc::invalid_argument, fmt::format("step needs (T, H) = ({}, {}) targets, got {} values", t, h, target.size()));
    const float* tgt = target.data();
    return step(input, [tgt, t, h](const float* y, float* grad) {
      double sum = 0;
      for (std::uint64_t i = 0; i < t * h; ++i) {
        const float d = y[i] - tgt[i];
        sum += 0.5 * static_cast<double>(d) * d;
        grad[i] = d / static_cast<float>(t);
      }
      return sum / static_cast<double>(t);
    }, grad_input);
  }

  /// One training step of the stack on `input` (T, H) with the loss `loss` at the top. When
  /// `grad_input` is given it receives dL/d(input) (T, H), for what lies below the stack (an
  /// embedding). Returns the loss; a non-finite one skips the backward and the update when
  /// options.skip_nonfinite_loss (see last_step_skipped()).
  double step(const std::vector<float>& input, const HostLossFn& loss, std::vector<float>* grad_input = nullptr)
    requires device_memory_is_host<B>
  {
    return step(input, on_host(loss), grad_input);
  }
  /// The same with a loss that enqueues its work on the compute stream (any backend).
  double step(const std::vector<float>& input, const DeviceLossFn& loss, std::vector<float>* grad_input = nullptr) {
    const std::vector<float>* in = &input;
    const DeviceLossFn* fn = &loss;
    return run_micro_batches({&in, 1}, {&fn, 1}, grad_input ? std::span<std::vector<float>>(grad_input, 1) : std::span<std::vector<float>>{});
  }

  /// One optimizer step over plan.micro_batches micro-batches (gradient accumulation): micro-batch
  /// i runs forward and backward on inputs[i] with losses[i] (which should carry the 1/k of a mean
  /// over micro-batches); the gradients are summed micro-batch by micro-batch in order (the same
  /// bits under every plan) and the update runs after the last. Returns the sum of the losses; a
  /// non-finite one ends the step without any update.
  double step(const std::vector<std::vector<float>>& inputs, const std::vector<HostLossFn>& losses,
              std::vector<std::vector<float>>* grad_inputs = nullptr)
    requires device_memory_is_host<B>
  {
    std::vector<DeviceLossFn> device;
    for (const auto& f : losses) device.push_back(on_host(f));
    return step(inputs, device, grad_inputs);
  }
  /// The same with losses that enqueue their work on the compute stream (any backend).
  double step(const std::vector<std::vector<float>>& inputs, const std::vector<DeviceLossFn>& losses,
              std::vector<std::vector<float>>* grad_inputs = nullptr) {
    std::vector<const std::vector<float>*> in;
    std::vector<const DeviceLossFn*> fns;
    for (const auto& x : inputs) in.push_back(&x);
    for (const auto& f : losses) fns.push_back(&f);
    if (grad_inputs != nullptr) grad_inputs->assign(inputs.size(), {});
    return run_micro_batches(in, fns, grad_inputs ? std::span<std::vector<float>>(*grad_inputs) : std::span<std::vector<float>>{});
  }

  /// With options.defer_updates, after step(): the sum of squares of every segment's gradient, in
  /// layer and segment order (so the same bits under any plan). Refused as apply_updates() is when
  /// no step's gradients wait (the buffers hold nothing of a step then, or were updated from).
  double gradient_sum_of_squares() {
    require_pending_updates("gradient_sum_of_squares()");
    synchronize_all();
    double sum = 0;
    for (auto& ls : layers_state_)
      for (auto& seg : ls.segments) {
        if (!seg.resident) {
          sum += optim::grad_sum_of_squares({seg.staging, seg.n}, pool_);
          continue;
        }
        const auto g = download(seg.device_grad, seg.n);
        sum += optim::grad_sum_of_squares({g.data(), g.size()}, pool_);
      }
    return sum;
  }

  /// With options.defer_updates, after step(): every segment's AdamW update of that step, each
  /// gradient multiplied by `grad_scale` first (a clipping factor, optim::clip_grad_scale). Once a
  /// step: Errc::invalid_argument before the first step, after a skipped or failed one, or a
  /// second time. The optimizer step is counted here, not by step(); one that throws (a
  /// non-finite gradient) is not counted, as a step that throws is not.
  void apply_updates(float grad_scale) {
    require_pending_updates("apply_updates()");
    updates_pending_ = false;
    synchronize_all();
    const std::int64_t steps_before = step_;
    ++step_;  // before the submissions: a non-finite gradient's error names this step
    try {
      const auto scalars = optim::adamw_step_scalars(options_.adamw, step_, grad_scale);
      for (auto& ls : layers_state_) {
        for (auto& seg : ls.segments) {
          if (seg.resident) submit_device_adamw(seg, scalars);
          else submit_cpu_adamw(seg, scalars);
        }
        b_.record(ls.updated, cpu_);
      }
      synchronize_all();
    } catch (...) {
      step_ = steps_before;
      throw;
    }
  }

  /// Records the next step()'s work per resource into `timeline` (spans of every load, forward,
  /// backward, recompute, offload, gradient copy and update, from the step's start).
  void record_next_step(Timeline* timeline) { timeline_ = timeline; }
  /// Called before each layer's forward and backward is issued (runtime/progress.hpp); empty: none.
  void on_layer(LayerProgressFn fn) { on_layer_ = std::move(fn); }

  /// The learning rate of the steps that follow (a schedule sets it before each step).
  void set_learning_rate(float lr) { options_.adamw.lr = lr; }

  /// Whether the last step() ended after its forward (non-finite loss).
  [[nodiscard]] bool last_step_skipped() const { return skipped_; }
  /// Optimizer steps taken: updates applied (skipped steps do not count; with
  /// options.defer_updates a step counts once apply_updates() has applied its updates).
  [[nodiscard]] std::int64_t optimizer_steps() const { return step_; }

 private:
  // apply_updates() and gradient_sum_of_squares() read the gradients a deferred step left; `what`
  // names the caller in the error.
  void require_pending_updates(const char* what) const {
    if (!options_.defer_updates)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: the executor updates as gradients land (LayerExecutorOptions::defer_updates "
                                                    "is off), so no step's gradients wait for their update", what));
    if (!updates_pending_)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: no step's gradients wait for their update (no step yet, the last one was "
                                                    "skipped or failed, or its updates were applied already)", what));
  }
  // The caller's layers are held by reference: a vector that has gained or lost layers since the
  // executor was made would be indexed past the executor's per-layer state; a layer whose
  // hidden() or saved_floats() answers otherwise than it did would be handed buffers of other
  // sizes than the plan counted (or than it writes). O(layers) calls a step.
  void check_stack() const {
    if (layers_.size() != layers_state_.size())
      OOM_THROW(Errc::invalid_argument, fmt::format("step(): the stack has {} layers, the executor was made for {}", layers_.size(),
                                                    layers_state_.size()));
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      if (layers_[l].hidden() != hidden_)
        OOM_THROW(Errc::invalid_argument, fmt::format("step(): layer {} ('{}') has hidden size {}, {} when the executor was made: the "
                                                      "step's (T, H) boundaries are of one H", l, label(l), layers_[l].hidden(), hidden_));
      check_saved_floats(l, declared_[l], "step(): ");
    }
  }
  // Layer l's cost() for the plan's workload against what the executor holds for it: its output
  // boundary (T, hidden()) fp32, each class saved_floats() fp32 (class_bytes). The plan counted
  // the cost: a class saved but not declared had run out of a budget of the plan's prediction,
  // naming no layer ("retained_activations asks for ..."); an output declared for another width
  // sized the plan's boundaries wrong. Returns the declared bytes by class.
  std::array<Bytes, activation_class_count> check_declared_cost(std::size_t l, const LayerCost& cost) const {
    const Workload& w = plan_.workload;
    const std::uint64_t t = w.tokens(), h = layers_[l].hidden();
    const auto where = fmt::format("layer {} ('{}'), cost for {} x {} tokens", l, label(l), w.sequences, w.seq_len);
    const std::uint64_t row_bytes = t * sizeof(float);  // t <= max_workload_tokens: refuse_unrunnable_micro_batch
    if (h > std::numeric_limits<std::uint64_t>::max() / row_bytes)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: hidden() {} x {} tokens x 4 bytes (fp32) is more than 2^64 bytes", where, h, t));
    if (cost.output.count() != h * row_bytes)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: LayerCost::output is {} bytes where hidden() {} x {} tokens x 4 bytes (fp32) = {} "
                                                    "were expected; the executor holds the boundary a layer hands on as (T, hidden()) "
                                                    "fp32, the plan counted LayerCost::output", where, cost.output.count(), h, t, h * row_bytes));
    const auto declared = saved_bytes_by_class(cost, where);
    check_saved_floats(l, declared, "");
    return declared;
  }
  // Layer l's saved_floats() for the plan's tokens against `declared`, its cost()'s bytes by
  // class; `when` opens the error ("step(): " at a step).
  void check_saved_floats(std::size_t l, const std::array<Bytes, activation_class_count>& declared, std::string_view when) const {
    const std::uint64_t t = plan_.workload.tokens();
    for (int c = 1; c < activation_class_count; ++c) {  // class 0, the boundary, is hidden()'s
      const auto cls = static_cast<ActivationClass>(c);
      const std::uint64_t floats = layers_[l].saved_floats(cls, t);
      const Bytes want = declared[static_cast<std::size_t>(c)];
      if (want.count() % sizeof(float) == 0 && floats == want.count() / sizeof(float)) continue;
      OOM_THROW(Errc::invalid_argument, fmt::format("{}layer {} ('{}'): saved_floats({}, {} tokens) is {} floats, its cost() declares {} "
                                                    "bytes of {} activations; the executor holds saved_floats() x 4 bytes (fp32) of a "
                                                    "class, the plan counted what cost() declares", when, l, label(l), to_string(cls), t,
                                                    floats, want.count(), to_string(cls)));
    }
  }
  // A host loss as a device one: it runs in the compute stream's task, where it may read the memory.
  static DeviceLossFn on_host(const HostLossFn& fn) {
    if (!fn) return {};  // refused by name in run_micro_batches, not a bad_function_call in a task
    return [fn](const float* y, float* grad, double* loss, void* /*stream*/) { *loss = fn(y, grad); };
  }

  // The micro-batches of one step (inputs and losses by pointer: the callers' buffers, not copies).
  double run_micro_batches(std::span<const std::vector<float>* const> inputs, std::span<const DeviceLossFn* const> losses,
                           std::span<std::vector<float>> grad_inputs) {
    check_stack();
    const auto k = static_cast<std::size_t>(plan_.micro_batches);
    if (inputs.size() != k || losses.size() != k)
      OOM_THROW(Errc::invalid_argument, fmt::format("the plan has {} micro-batches per step; step() got {} inputs and {} losses", k,
                                                    inputs.size(), losses.size()));
    for (std::size_t mb = 0; mb < k; ++mb)
      if (!*losses[mb]) OOM_THROW(Errc::invalid_argument, fmt::format("step(): the loss of micro-batch {} is an empty function", mb));
    // A second step would overwrite the gradients that wait: refused, or they were lost unapplied.
    if (updates_pending_)
      OOM_THROW(Errc::invalid_argument, "step(): the previous step's updates were never applied: call apply_updates() (after "
                                        "gradient_sum_of_squares(), for clipping) before the next step (LayerExecutorOptions::"
                                        "defer_updates is on)");
    const std::int64_t steps_before = step_;
    try {
      skipped_ = false;
      t0_ = std::chrono::steady_clock::now();
      // Recorded if record_next_step() came before the step: one asked for during it (from an
      // on_layer callback) is for the next.
      recording_ = timeline_ != nullptr;
      struct StopRecording {
        LayerExecutor& e;
        ~StopRecording() {
          if (!e.recording_) return;
          e.recording_ = false;
          e.timeline_ = nullptr;
          if constexpr (timed_marks<B>) e.marks_.clear();
        }
      } stop_recording{*this};
      if constexpr (timed_marks<B>)
        if (recording_) step_mark_ = b_.time_mark(compute_);
      const auto scalars = optim::adamw_step_scalars(options_.adamw, step_ + 1);
      double total = 0;
      for (std::size_t mb = 0; mb < k; ++mb) {
        total += run_step(*inputs[mb], *losses[mb], grad_inputs.empty() ? nullptr : &grad_inputs[mb], mb, mb + 1 == k, scalars);
        if (skipped_) break;
      }
      updates_pending_ = options_.defer_updates && !skipped_;
      flush_marks();
      return total;
    } catch (...) {
      drain();
      give_back_step();
      step_ = steps_before;  // a step that threw is not counted (updates it made before the error stay: stop the run)
      throw;
    }
  }

  // One micro-batch's forward, loss and backward. Its weight gradients go into the accumulators
  // (micro-batch 0 writes them, later ones add theirs); the last one also submits the updates.
  double run_step(const std::vector<float>& input, const DeviceLossFn& loss_fn, std::vector<float>* grad_input, std::size_t mb,
                  bool last, const optim::AdamWStepScalars& scalars) {
    const std::uint64_t t = plan_.workload.tokens();
    const std::uint64_t h = layers_.front().hidden();
    if (input.size() != t * h)
      OOM_THROW(Errc::invalid_argument, fmt::format("step needs (T, H) = ({}, {}) inputs, got {} values", t, h, input.size()));
    const bool update = last && !options_.defer_updates;
    const std::size_t n = layers_.size();
    const Bytes act_bytes{t * h * sizeof(float)};
    std::vector<float*> act(n + 1, nullptr);  // act[l]: input of layer l (device)
    act[0] = take_step(act_bytes, Claimant::retained_activations);
    b_.copy(act[0], input.data(), act_bytes, compute_);
    std::vector<std::array<float*, activation_class_count>> saved(n);
    std::vector<std::array<float*, activation_class_count>> host_copy(n);

    // ---- forward ----
    for (std::size_t l = 0; l < n; ++l) {
      if (on_layer_) on_layer_({false, static_cast<int>(l), static_cast<int>(n), static_cast<int>(mb)});
      auto& ls = layers_state_[l];
      Slot* slot = load_weights(l);
      act[l + 1] = take_step(act_bytes, Claimant::retained_activations);
      saved[l] = {};
      for (int c = 1; c < activation_class_count; ++c) {  // class 0, the boundary, is act[l]
        const auto elems = layers_[l].saved_floats(static_cast<ActivationClass>(c), t);
        if (elems > 0) saved[l][static_cast<std::size_t>(c)] = take_step(Bytes{elems * sizeof(float)}, Claimant::retained_activations);
      }
      LayerContext ctx = bind(l, slot);
      ctx.input = act[l];
      ctx.output = act[l + 1];
      ctx.saved = saved[l];
      run_chunks(l, ctx, /*backward=*/false, "fwd " + label(l));
      b_.record(ls.forward_done, compute_);
      release(slot);
      // Retention: offload now (and free on the device once copied), drop what is recomputed.
      host_copy[l] = {};
      for (int c = 0; c < activation_class_count; ++c) {
        float* buf = c == 0 ? act[l] : saved[l][static_cast<std::size_t>(c)];
        if (buf == nullptr) continue;
        const auto action = plan_.retention[l][static_cast<std::size_t>(c)].action;
        const Bytes bytes = class_bytes(l, c, t);
        if (action == Retention::offload) {
          auto* host = take_step(bytes, Claimant::host_offload, MemorySpace::pinned_host());
          host_copy[l][static_cast<std::size_t>(c)] = host;
          b_.wait(d2h_, ls.forward_done);
          auto out = span_begin(d2h_);
          b_.copy(host, buf, bytes, d2h_);
          span_end(d2h_, Resource::d2h, fmt::format("d2h {} {}", to_string(static_cast<ActivationClass>(c)), label(l)), out);
          free_device_on(d2h_, buf, bytes, Claimant::retained_activations);
        } else if (action == Retention::recompute) {
          free_device_on(compute_, buf, bytes, Claimant::retained_activations);
        }
        if (action != Retention::keep) {
          if (c == 0) act[l] = nullptr;
          else saved[l][static_cast<std::size_t>(c)] = nullptr;
        }
      }
      b_.record(ls.offloaded, d2h_);
    }

    // ---- loss ----
    float* grad = take_step(act_bytes, Claimant::worksets);
    double* loss = &loss_words_[0];
    {
      float* y = act[n];
      const DeviceLossFn* fn = &loss_fn;
      void* native = b_.native(compute_);
      auto lb = span_begin(compute_);
      b_.submit(compute_, [y, grad, fn, loss, native] { (*fn)(y, grad, loss, native); });
      span_end(compute_, Resource::gpu_compute, "loss", lb);
      free_device_on(compute_, act[n], act_bytes, Claimant::retained_activations);
    }
    if (options_.skip_nonfinite_loss) {
      b_.synchronize(compute_);
      if (!std::isfinite(*loss)) {
        b_.synchronize(d2h_);  // offloads in flight land before their buffers go
        for (std::size_t l = 0; l < n; ++l) {
          for (int c = 0; c < activation_class_count; ++c) {
            const auto i = static_cast<std::size_t>(c);
            float* dev = c == 0 ? act[l] : saved[l][i];
            give_now(dev, MemorySpace::device(0), class_bytes(l, c, t), Claimant::retained_activations);
            give_now(host_copy[l][i], MemorySpace::pinned_host(), class_bytes(l, c, t), Claimant::host_offload);
          }
        }
        give_now(grad, MemorySpace::device(0), act_bytes, Claimant::worksets);
        skipped_ = true;
        return *loss;
      }
    }
    if (update) ++step_;  // a deferred step is counted by apply_updates()

    // ---- backward ----
    for (std::size_t li = n; li-- > 0;) {
      if (on_layer_) on_layer_({true, static_cast<int>(li), static_cast<int>(n), static_cast<int>(mb)});
      auto& ls = layers_state_[li];
      Slot* slot = load_weights(li);
      // A regenerated boundary: rerun the layers from the group's first boundary up to this one,
      // which gives every boundary of the group back at once (their backwards come next).
      if (act[li] == nullptr && plan_.retention[li][0].action == Retention::recompute)
        regenerate(static_cast<std::size_t>(plan_.retention[li][0].recompute_from), li, act, host_copy, t);
      // Bring back what was offloaded.
      for (int c = 0; c < activation_class_count; ++c) {
        float*& host = host_copy[li][static_cast<std::size_t>(c)];
        if (host == nullptr) continue;
        (c == 0 ? act[li] : saved[li][static_cast<std::size_t>(c)]) = bring_back(li, c, host, t);
      }
      auto restored = b_.make_event();
      b_.record(restored, h2d_);
      b_.wait(compute_, restored);
      // Recompute what was dropped, from the boundary.
      LayerContext re = bind(li, slot);
      re.input = act[li];
      bool any = false;
      for (int c = 1; c < activation_class_count; ++c) {
        if (plan_.retention[li][static_cast<std::size_t>(c)].action != Retention::recompute) continue;
        const auto elems = layers_[li].saved_floats(static_cast<ActivationClass>(c), t);
        if (elems == 0) continue;
        saved[li][static_cast<std::size_t>(c)] = take_step(Bytes{elems * sizeof(float)}, Claimant::retained_activations);
        re.saved[static_cast<std::size_t>(c)] = saved[li][static_cast<std::size_t>(c)];
        any = true;
      }
      if (any) {
        run_chunks(li, re, false, "recompute " + label(li));
      }
      // Backward, chunk by chunk; weight gradients accumulate in token order.
      float* grad_in = take_step(act_bytes, Claimant::worksets);
      LayerContext ctx = bind(li, slot);
      ctx.input = act[li];
      ctx.grad_output = grad;
      ctx.grad_input = grad_in;
      ctx.saved = saved[li];
      // Micro-batch 0 accumulates a resident segment's gradient in place; later ones into a
      // scratch that is then added, exactly as a streamed segment's lands in staging and is added.
      // Streamed segments' gradients go into the layer's gradient slot, once its last user's left.
      std::vector<float*> streamed_grads, resident_scratch(ls.segments.size(), nullptr);
      GradSlot* gslot = nullptr;
      std::uint64_t gslot_at = 0;
      for (std::size_t s = 0; s < ls.segments.size(); ++s) {
        auto& seg = ls.segments[s];
        float* g = nullptr;
        if (seg.resident && mb == 0) {
          g = seg.device_grad;
        } else if (seg.resident) {
          g = resident_scratch[s] = take_step(Bytes{seg.n * sizeof(float)}, Claimant::worksets);
        } else {
          if (gslot == nullptr) {
            gslot = &grad_slots_[li % 2];
            b_.wait(compute_, gslot->free);
          }
          g = gslot->ptr + gslot_at;
          gslot_at += seg.n;
          streamed_grads.push_back(g);
        }
        ctx.weight_grads[s] = {g, seg.n};
        b_.zero(g, seg.n, compute_);
      }
      run_chunks(li, ctx, true, "bwd " + label(li));
      auto done = b_.make_event();
      b_.record(done, compute_);
      release(slot);
      // Free this layer's activations and the incoming gradient.
      free_device_on(compute_, act[li], act_bytes, Claimant::retained_activations);
      for (int c = 1; c < activation_class_count; ++c)
        if (float* buf = saved[li][static_cast<std::size_t>(c)]) free_device_on(compute_, buf, class_bytes(li, c, t), Claimant::retained_activations);
      free_device_on(compute_, grad, act_bytes, Claimant::worksets);
      grad = grad_in;
      for (std::size_t s = 0; s < ls.segments.size(); ++s) {
        float* scratch = resident_scratch[s];
        if (scratch == nullptr) continue;
        b_.add(ls.segments[s].device_grad, scratch, ls.segments[s].n, compute_);
        free_device_on(compute_, scratch, Bytes{ls.segments[s].n * sizeof(float)}, Claimant::worksets);
      }
      // Gradients: resident segments update on the device; streamed ones go to the host and the
      // CPU AdamW applies them as soon as they land.
      if (update) {
        auto ab = span_begin(compute_);
        for (auto& seg : ls.segments)
          if (seg.resident) submit_device_adamw(seg, scalars);
        span_end(compute_, Resource::gpu_compute, "adamw resident " + label(li), ab);
      }
      std::size_t k = 0;
      b_.wait(d2h_, done);
      auto gb = span_begin(d2h_);
      std::vector<std::pair<Segment*, float*>> landed;  // micro-batches after the first: added on the CPU
      for (auto& seg : ls.segments) {
        if (seg.resident) continue;
        float* into = seg.staging;
        if (mb > 0) {
          into = take_step(Bytes{seg.n * sizeof(float)}, Claimant::host_staging, MemorySpace::pinned_host());
          landed.emplace_back(&seg, into);
        }
        b_.copy(into, streamed_grads[k], Bytes{seg.n * sizeof(float)}, d2h_);
        ++k;
      }
      if (gslot != nullptr) b_.record(gslot->free, d2h_);
      span_end(d2h_, Resource::d2h, "d2h grads " + label(li), gb);
      b_.record(ls.grads_landed, d2h_);
      if (!landed.empty()) {
        b_.wait(cpu_, ls.grads_landed);
        for (const auto& [landed_seg, landed_buf] : landed) {
          Segment* seg = landed_seg;  // a structured binding in a capture is C++20 that clang < 16 refuses
          float* buf = landed_buf;
          b_.host_task(cpu_, [seg, buf, pool = &pool_] { optim::add_gradients({seg->staging, seg->n}, {buf, seg->n}, *pool); });
          give_after(cpu_, buf, MemorySpace::pinned_host(), Bytes{seg->n * sizeof(float)}, Claimant::host_staging);
        }
      }
      if (update) {
        b_.wait(cpu_, ls.grads_landed);
        auto cb = span_begin(cpu_);
        for (auto& seg : ls.segments)
          if (!seg.resident) submit_cpu_adamw(seg, scalars);
        span_end(cpu_, Resource::cpu, "adamw " + label(li), cb);
        b_.record(ls.updated, cpu_);
      }
    }
    if (grad_input != nullptr) {
      grad_input->resize(t * h);
      b_.copy(grad_input->data(), grad, act_bytes, compute_);
    }
    free_device_on(compute_, grad, act_bytes, Claimant::worksets);
    synchronize_all();
    return *loss;
  }

 public:
  /// AdamW state of every segment, in layer order (device copies for resident ones).
  std::vector<SegmentOptimizerState> optimizer_state() {
    synchronize_all();
    std::vector<SegmentOptimizerState> out;
    for (auto& ls : layers_state_)
      for (auto& s : ls.segments) {
        if (s.resident) out.push_back({download(s.device_master, s.n), download_moments(s.device_m, s.n), download_moments(s.device_v, s.n)});
        else out.push_back({{s.master, s.master + s.n}, host_moments(s.exp_avg, s.n), host_moments(s.exp_avg_sq, s.n)});
      }
    return out;
  }

  /// Continues from saved state (a checkpoint): every segment's master, moments and bf16 working
  /// copy, and the optimizer's step count (>= 0). Sizes must match the layers' segments.
  void load_optimizer_state(const std::vector<SegmentOptimizerState>& state, std::int64_t optimizer_steps) {
    // A negative count had been taken, and every later step refused by AdamW's bias correction.
    if (optimizer_steps < 0)
      OOM_THROW(Errc::invalid_argument, fmt::format("load_optimizer_state(): optimizer_steps is {}; a step count is at least 0",
                                                    optimizer_steps));
    synchronize_all();
    std::size_t i = 0, segments = 0;
    for (const auto& ls : layers_state_) segments += ls.segments.size();
    if (state.size() != segments)
      OOM_THROW(Errc::invalid_argument, fmt::format("optimizer state holds {} segments, the layers {}", state.size(), segments));
    for (auto& ls : layers_state_)  // all checked before anything is overwritten
      for (auto& s : ls.segments) {
        if (state[i].master.size() != s.n || state[i].exp_avg.size() != s.n || state[i].exp_avg_sq.size() != s.n)
          OOM_THROW(Errc::invalid_argument, fmt::format("optimizer state of segment '{}': sizes do not match its {} parameters", s.name, s.n));
        ++i;
      }
    i = 0;
    for (auto& ls : layers_state_)
      for (auto& s : ls.segments) {
        const auto& st = state[i++];
        if (s.resident) {
          upload(s, st.master, st.exp_avg, st.exp_avg_sq);
          continue;
        }
        std::copy(st.master.begin(), st.master.end(), s.master);
        moments_from_fp32(moments(), st.exp_avg, s.exp_avg);
        moments_from_fp32(moments(), st.exp_avg_sq, s.exp_avg_sq);
        for (std::uint64_t e = 0; e < s.n; ++e) s.weights[e] = to_bf16(s.master[e]);
      }
    step_ = optimizer_steps;
  }

  /// fp32 master weights of every segment, in layer order (device copies for resident ones).
  std::vector<std::vector<float>> master() {
    synchronize_all();
    std::vector<std::vector<float>> out;
    for (auto& ls : layers_state_)
      for (auto& s : ls.segments) out.push_back(s.resident ? download(s.device_master, s.n) : std::vector<float>(s.master, s.master + s.n));
    return out;
  }

 private:
  struct Segment {
    std::string name;
    std::uint64_t n = 0;
    bool resident = false;
    // Host (pinned) state of a streamed segment: one block, bf16 working copy first.
    bf16* weights = nullptr;
    float* master = nullptr;
    void* exp_avg = nullptr;     // AdamW moments as the plan keeps them (moments(): fp32 or bf16)
    void* exp_avg_sq = nullptr;
    float* staging = nullptr;  // gradients land here
    // Device state of a resident segment.
    bf16* device_weights = nullptr;
    float* device_master = nullptr;
    void* device_m = nullptr;  // as exp_avg
    void* device_v = nullptr;
    float* device_grad = nullptr;
  };
  struct LayerState {
    std::vector<Segment> segments;
    typename B::Event updated, forward_done, offloaded, grads_landed;
  };
  struct Slot {
    bf16* ptr;
    Bytes bytes;
    typename B::Event free;
  };
  struct GradSlot {
    float* ptr;
    Bytes bytes;
    typename B::Event free;  ///< recorded on d2h_ once its layer's gradients are copied out
  };

  // A stream, named where the backend takes names (the host backend's threads, for diagnostics).
  typename B::Stream make_named_stream(const char* name) {
    if constexpr (requires { b_.make_stream(std::string(name)); }) return b_.make_stream(std::string(name));
    else return b_.make_stream();
  }
  float* alloc_device(Bytes bytes, Claimant c) { return static_cast<float*>(b_.allocate(MemorySpace::device(0), bytes, c)); }
  // Memory one step holds (activations, gradients, staging, worksets): each buffer is taken and
  // given back through these, so that a step that throws gives back what it still held (on the
  // GPU a layer or loss that throws does so before the frees after it are queued).
  float* take_step(Bytes bytes, Claimant c, MemorySpace where = MemorySpace::device(0)) {
    auto* p = static_cast<float*>(b_.allocate(where, bytes, c));
    try {
      step_held_.emplace(p, Held{where, bytes, c});
    } catch (...) {
      b_.free(p, where, bytes, c);
      throw;
    }
    return p;
  }
  void give_after(typename B::Stream& s, void* p, MemorySpace where, Bytes bytes, Claimant c) {
    if (p == nullptr) return;
    b_.free_after(s, p, where, bytes, c);  // if this throws, the step still holds p and gives it back
    step_held_.erase(p);
  }
  void give_now(void* p, MemorySpace where, Bytes bytes, Claimant c) {
    if (p == nullptr) return;
    step_held_.erase(p);
    b_.free(p, where, bytes, c);
  }
  void free_device_on(typename B::Stream& s, void* p, Bytes bytes, Claimant c) { give_after(s, p, MemorySpace::device(0), bytes, c); }
  // After a step threw and the streams drained: what it still held goes back.
  void give_back_step() noexcept {
    for (auto& [p, h] : step_held_) b_.free(p, h.where, h.bytes, h.claimant);
    step_held_.clear();
  }

  // n floats of device memory, copied home (the compute stream's work before it done first).
  std::vector<float> download(const float* device, std::uint64_t n) {
    std::vector<float> out(n);
    b_.copy(out.data(), device, Bytes{n * sizeof(float)}, compute_);
    b_.synchronize(compute_);
    return out;
  }
  // The precision the plan keeps AdamW moments at (fp32 or bf16: require_kept_precision).
  DType moments() const { return plan_.precision.moments; }
  Bytes moment_bytes(std::uint64_t n) const { return bytes_of(moments(), n); }
  // n host moments as fp32.
  std::vector<float> host_moments(const void* kept, std::uint64_t n) const {
    std::vector<float> out(n);
    moments_to_fp32(moments(), kept, out);
    return out;
  }
  // n device moments, copied home as fp32.
  std::vector<float> download_moments(const void* device, std::uint64_t n) {
    std::vector<std::byte> kept(moment_bytes(n).count());
    b_.copy(kept.data(), device, moment_bytes(n), compute_);
    b_.synchronize(compute_);
    return host_moments(kept.data(), n);
  }
  // A resident segment's master and moments from the host, its bf16 copy from the master.
  void upload(Segment& s, const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
    std::vector<bf16> w(s.n);
    for (std::uint64_t e = 0; e < s.n; ++e) w[e] = to_bf16(master[e]);
    const Bytes f{s.n * sizeof(float)};
    std::vector<std::byte> m_kept(moment_bytes(s.n).count()), v_kept(moment_bytes(s.n).count());
    moments_from_fp32(moments(), m, m_kept.data());
    moments_from_fp32(moments(), v, v_kept.data());
    b_.copy(s.device_master, master.data(), f, compute_);
    b_.copy(s.device_m, m_kept.data(), moment_bytes(s.n), compute_);
    b_.copy(s.device_v, v_kept.data(), moment_bytes(s.n), compute_);
    b_.copy(s.device_weights, w.data(), Bytes{s.n * sizeof(bf16)}, compute_);
    b_.synchronize(compute_);  // before the host vectors go
  }

  Bytes class_bytes(std::size_t l, int c, std::uint64_t t) const {
    if (c == 0) return Bytes{t * layers_[l].hidden() * sizeof(float)};
    return Bytes{layers_[l].saved_floats(static_cast<ActivationClass>(c), t) * sizeof(float)};
  }

  // Takes segment s's memory where the plan puts it (each pointer set as it is taken) and fills it.
  void take_segment(Segment& s, const std::vector<float>& init, bool resident) {
    s.n = init.size();
    s.resident = resident;
    if (resident) {
      const Bytes f{s.n * sizeof(float)};
      s.device_master = alloc_device(f, Claimant::resident_state);
      s.device_m = b_.allocate(MemorySpace::device(0), moment_bytes(s.n), Claimant::resident_state);
      s.device_v = b_.allocate(MemorySpace::device(0), moment_bytes(s.n), Claimant::resident_state);
      s.device_grad = alloc_device(f, Claimant::resident_state);
      s.device_weights = static_cast<bf16*>(b_.allocate(MemorySpace::device(0), Bytes{s.n * sizeof(bf16)}, Claimant::resident_state));
      const std::vector<float> zeros(s.n, 0.0f);
      upload(s, init, zeros, zeros);
    } else {
      const Bytes f{s.n * sizeof(float)};
      auto pinned = [&](Bytes b, Claimant c) { return b_.allocate(MemorySpace::pinned_host(), b, c); };
      s.weights = static_cast<bf16*>(pinned(Bytes{s.n * sizeof(bf16)}, Claimant::host_state));
      s.master = static_cast<float*>(pinned(f, Claimant::host_state));
      s.exp_avg = pinned(moment_bytes(s.n), Claimant::host_state);
      s.exp_avg_sq = pinned(moment_bytes(s.n), Claimant::host_state);
      s.staging = static_cast<float*>(pinned(f, Claimant::host_staging));
      std::copy(init.begin(), init.end(), s.master);
      std::transform(init.begin(), init.end(), s.weights, [](float x) { return to_bf16(x); });
      std::memset(s.exp_avg, 0, moment_bytes(s.n).count());  // +0.0 in fp32 and bf16 alike
      std::memset(s.exp_avg_sq, 0, moment_bytes(s.n).count());
    }
  }
  // Gives back what segment s holds (a segment whose taking failed part-way holds some of it).
  void free_segment(Segment& s) noexcept {
    const Bytes f{s.n * sizeof(float)};
    const auto give = [&](void* p, MemorySpace where, Bytes b, Claimant c) {
      if (p != nullptr) b_.free(p, where, b, c);
    };
    if (s.resident) {
      for (float* p : {s.device_master, s.device_grad}) give(p, MemorySpace::device(0), f, Claimant::resident_state);
      for (void* p : {s.device_m, s.device_v}) give(p, MemorySpace::device(0), moment_bytes(s.n), Claimant::resident_state);
      give(s.device_weights, MemorySpace::device(0), Bytes{s.n * sizeof(bf16)}, Claimant::resident_state);
    } else {
      give(s.weights, MemorySpace::pinned_host(), Bytes{s.n * sizeof(bf16)}, Claimant::host_state);
      give(s.master, MemorySpace::pinned_host(), f, Claimant::host_state);
      for (void* p : {s.exp_avg, s.exp_avg_sq}) give(p, MemorySpace::pinned_host(), moment_bytes(s.n), Claimant::host_state);
      give(s.staging, MemorySpace::pinned_host(), f, Claimant::host_staging);
    }
  }

  // Loads layer l's streamed segments into the next slot (after the slot's last user and the
  // layer's last update); compute waits for the load. Every layer takes a slot, so slots rotate
  // in the same order whatever is resident.
  Slot* load_weights(std::size_t l) {
    auto& ls = layers_state_[l];
    std::uint64_t offset = 0;
    Slot* slot = &slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % slots_.size();
    b_.wait(h2d_, slot->free);
    b_.wait(h2d_, ls.updated);
    if (options_.slow_weight_loads_ms > 0)
      b_.host_task(h2d_, [ms = options_.slow_weight_loads_ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
    auto wb = span_begin(h2d_);
    for (auto& seg : ls.segments) {
      if (seg.resident) continue;
      b_.copy(slot->ptr + offset, seg.weights, Bytes{seg.n * sizeof(bf16)}, h2d_);
      offset += seg.n;
    }
    span_end(h2d_, Resource::h2d, "h2d weights " + label(l), wb);
    b_.record(loaded_, h2d_);
    if (!options_.drop_weight_wait) b_.wait(compute_, loaded_);
    return slot;
  }
  void release(Slot* slot) { b_.record(slot->free, compute_); }

  /// Layer l's weights where they live now (its streamed ones in `slot`), over the micro-batch's
  /// tokens and sequences.
  LayerContext bind(std::size_t l, Slot* slot) { return bind(l, slot->ptr); }
  /// The same with layer l's streamed segments at `streamed`, one after another.
  LayerContext bind(std::size_t l, bf16* streamed) {
    LayerContext ctx;
    ctx.tokens = plan_.workload.tokens();
    ctx.sequences = plan_.workload.sequences;
    std::uint64_t offset = 0;
    for (auto& seg : layers_state_[l].segments) {
      if (seg.resident) {
        ctx.weights.emplace_back(seg.device_weights, seg.n);
      } else {
        ctx.weights.emplace_back(streamed + offset, seg.n);
        offset += seg.n;
      }
      ctx.weight_grads.emplace_back();
    }
    return ctx;
  }

  // Timing marks, no-ops unless a step is recorded: on a backend with timed_marks, marks the
  // device times, read when the step has run (flush_marks); elsewhere host tasks in stream order.
  struct SpanStart {
    std::shared_ptr<double> at;  // host tasks' begin
    TimeMarkOf<B> mark{};        // a timed backend's begin
    bool on = false;
  };
  SpanStart span_begin(typename B::Stream& s) {
    if (!recording_) return {};
    if constexpr (timed_marks<B>) {
      return {nullptr, b_.time_mark(s), true};
    } else {
      auto at = std::make_shared<double>(0.0);
      const auto t0 = t0_;
      b_.host_task(s, [at, t0] { *at = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); });
      return {std::move(at), {}, true};
    }
  }
  void span_end(typename B::Stream& s, Resource r, std::string name, const SpanStart& begin) {
    if (!recording_ || !begin.on) return;
    if constexpr (timed_marks<B>) {
      marks_.push_back({std::move(name), r, begin.mark, b_.time_mark(s)});
    } else {
      auto* tl = timeline_;
      const auto t0 = t0_;
      b_.host_task(s, [tl, t0, r, name = std::move(name), at = begin.at] {
        tl->add(name, r, *at, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      });
    }
  }
  // A timed backend's spans into the timeline, from the step's first mark, once they have run.
  // The step's work is done by now: a mark that cannot be read loses the timing, not the step.
  void flush_marks() {
    if constexpr (timed_marks<B>) {
      if (!recording_ || marks_.empty()) return;
      synchronize_all();
      std::vector<TimelineSpan> spans;
      try {
        for (const auto& m : marks_)
          spans.push_back({m.name, m.resource, b_.seconds_between(step_mark_, m.begin), b_.seconds_between(step_mark_, m.end)});
      } catch (const Error& e) {
        log_warn("the recorded step's timing is lost: {}", e.what());
        spans.clear();
      }
      for (auto& sp : spans) timeline_->add(std::move(sp.name), sp.resource, sp.begin_s, sp.end_s);
      marks_.clear();
    }
  }
  std::string label(std::size_t l) const {
    const auto n = layer_traits<L>::name(layers_[l]);
    return n == "layer" ? fmt::format("layer {}", l) : std::string(n);
  }

  // Copies layer l's offloaded class c up from `host` into a new device buffer (after the offload
  // landed), frees the pinned copy once it has, and empties `host`; returns the device buffer.
  float* bring_back(std::size_t l, int c, float*& host, std::uint64_t t) {
    const Bytes bytes = class_bytes(l, c, t);
    float* dev = take_step(bytes, Claimant::retained_activations);
    b_.wait(h2d_, layers_state_[l].offloaded);
    auto in = span_begin(h2d_);
    b_.copy(dev, host, bytes, h2d_);
    span_end(h2d_, Resource::h2d, fmt::format("h2d {} {}", to_string(static_cast<ActivationClass>(c)), label(l)), in);
    give_after(h2d_, host, MemorySpace::pinned_host(), bytes, Claimant::host_offload);
    host = nullptr;
    return dev;
  }

  // Gives back the boundaries act[from + 1 .. l] by rerunning layers [from, l) forward over
  // act[from] (brought back first if it was offloaded), with their streamed weights in a workset
  // of their own; the layers' outputs only, in the plan's chunks, so the same bits as the forward.
  void regenerate(std::size_t from, std::size_t l, std::vector<float*>& act,
                  std::vector<std::array<float*, activation_class_count>>& host_copy, std::uint64_t t) {
    if (act[from] == nullptr) {  // offloaded: it comes back now and stays until its own backward
      if (host_copy[from][0] == nullptr)
        OOM_THROW(Errc::internal, fmt::format("layer {}: the boundary of layer {} to regenerate from is gone", l, from));
      act[from] = bring_back(from, 0, host_copy[from][0], t);
    }
    // Each layer's streamed segments start at a 256-byte boundary, as in a slot, so a layer's
    // kernels see its weights aligned as in the step's forward (vector loads, cuBLAS's choice of
    // kernel, and so the bits, depend on it).
    constexpr std::uint64_t layer_align = streamed_weight_alignment / sizeof(bf16);
    std::vector<std::uint64_t> at_offset(l - from, 0);
    std::uint64_t streamed = 0;
    for (std::size_t j = from; j < l; ++j) {
      at_offset[j - from] = streamed;
      std::uint64_t n = 0;
      for (const auto& seg : layers_state_[j].segments)
        if (!seg.resident) n += seg.n;
      streamed += (n + layer_align - 1) / layer_align * layer_align;
    }
    const Bytes weight_bytes{streamed * sizeof(bf16)};
    auto* weights = streamed > 0 ? reinterpret_cast<bf16*>(take_step(weight_bytes, Claimant::worksets)) : nullptr;
    auto wb = span_begin(h2d_);
    std::vector<bf16*> at(l - from, nullptr);
    for (std::size_t j = from; j < l; ++j) {
      at[j - from] = weights + at_offset[j - from];
      b_.wait(h2d_, layers_state_[j].updated);
      std::uint64_t offset = at_offset[j - from];
      for (auto& seg : layers_state_[j].segments) {
        if (seg.resident) continue;
        b_.copy(weights + offset, seg.weights, Bytes{seg.n * sizeof(bf16)}, h2d_);
        offset += seg.n;
      }
    }
    span_end(h2d_, Resource::h2d, fmt::format("h2d weights regenerate {}-{}", from, l - 1), wb);
    auto ready = b_.make_event();
    b_.record(ready, h2d_);
    b_.wait(compute_, ready);
    // The outputs first, so that the span holds the reruns and no allocation's wait; the planner
    // holds them all from the regeneration's start too (beside its largest workspace).
    for (std::size_t j = from; j < l; ++j) act[j + 1] = take_step(class_bytes(j + 1, 0, t), Claimant::retained_activations);
    auto rb = span_begin(compute_);
    for (std::size_t j = from; j < l; ++j) {
      LayerContext ctx = bind(j, at[j - from]);
      ctx.input = act[j];
      ctx.output = act[j + 1];
      ctx.regenerating = true;
      run_chunks(j, ctx, /*backward=*/false, {});
    }
    span_end(compute_, Resource::gpu_compute, fmt::format("regenerate boundaries {}-{}", from + 1, l), rb);
    if (weights != nullptr) free_device_on(compute_, weights, weight_bytes, Claimant::worksets);
  }

  // Runs layer l over the plan's token chunks, in increasing token order, on the compute stream,
  // with its workset for a chunk taken for the pass and given back after it. A recorded step's
  // span `span` (none: empty) holds the chunks' work and nothing before it (the workspace's
  // allocation may wait on the host for a free).
  void run_chunks(std::size_t l, const LayerContext& ctx, bool backward, std::string span) {
    const std::uint64_t t = ctx.tokens;
    const std::uint64_t chunk = std::max<std::uint64_t>(plan_.chunks[l].moe_tokens, 1);
    L* layer = &layers_[l];
    const Bytes ws = chunk_workset(workset_[l], t, chunk);
    void* workspace = ws.count() > 0 ? take_step(ws, Claimant::worksets) : nullptr;
    const SpanStart begin = span.empty() ? SpanStart{} : span_begin(compute_);
    for (std::uint64_t b = 0; b < t; b += chunk) {
      LayerContext c = ctx;
      c.stream = b_.native(compute_);
      c.workspace = workspace;
      c.workspace_bytes = ws.count();
      c.begin = b;
      c.end = std::min(t, b + chunk);
      b_.submit(compute_, [layer, c, backward]() mutable {
        if (backward) layer->backward(c);
        else layer->forward(c);
      });
    }
    span_end(compute_, Resource::gpu_compute, std::move(span), begin);
    free_device_on(compute_, workspace, ws, Claimant::worksets);
  }

  // What a non-finite gradient's error names: the segment and the step (empty: no check).
  std::string gradient_check(const Segment& seg) const {
    return options_.check_gradients ? fmt::format("segment '{}' (step {})", seg.name, step_) : std::string();
  }
  void submit_device_adamw(Segment& seg, const optim::AdamWStepScalars& sc) {
    if (moments() == DType::bf16)
      b_.device_adamw(sc, seg.device_master, static_cast<bf16*>(seg.device_m), static_cast<bf16*>(seg.device_v), seg.device_grad,
                      seg.device_weights, seg.n, compute_, gradient_check(seg));
    else
      b_.device_adamw(sc, seg.device_master, static_cast<float*>(seg.device_m), static_cast<float*>(seg.device_v), seg.device_grad,
                      seg.device_weights, seg.n, compute_, gradient_check(seg));
  }
  void submit_cpu_adamw(Segment& seg, const optim::AdamWStepScalars& sc) {
    auto* pool = &pool_;
    b_.host_task(cpu_, [&seg, sc, pool, bf16_moments = moments() == DType::bf16, what = gradient_check(seg)] {
      if (!what.empty()) optim::require_finite_gradients({seg.staging, seg.n}, what, *pool);
      const auto update = [&]<class M>(M* m, M* v) {
        optim::adamw_update(optim::AdamWSpan<M>{{seg.master, seg.n}, {m, seg.n}, {v, seg.n}, {seg.staging, seg.n}, {seg.weights, seg.n}},
                            sc, *pool);
      };
      if (bf16_moments) update(static_cast<bf16*>(seg.exp_avg), static_cast<bf16*>(seg.exp_avg_sq));
      else update(static_cast<float*>(seg.exp_avg), static_cast<float*>(seg.exp_avg_sq));
    });
  }

  void synchronize_all() {
    for (auto* s : {&compute_, &h2d_, &d2h_, &cpu_})
      if (*s) b_.synchronize(*s);
  }
  // Waits for every stream; a task error is left on the backend for its next synchronize().
  void drain() noexcept {
    for (auto* s : {&compute_, &h2d_, &d2h_, &cpu_}) b_.drain(*s);
  }

  B& b_;
  std::vector<L>& layers_;
  const Plan plan_;  // a copy: a caller's temporary plan (planner.plan(req).plans.front()) may go
  LayerExecutorOptions options_;
  optim::ThreadPool pool_;
  std::shared_ptr<double[]> loss_words_;  // the loss of the micro-batch running, where the device may write it
  typename B::Stream compute_, h2d_, d2h_, cpu_;
  typename B::Event loaded_;
  std::vector<LayerState> layers_state_;
  std::vector<Bytes> workset_;  ///< each layer's declared workset for the plan's workload, unchunked
  /// Each layer's declared activation bytes by class for the plan's workload (check_declared_cost).
  std::vector<std::array<Bytes, activation_class_count>> declared_;
  std::uint64_t hidden_ = 0;  ///< every layer's hidden() when the executor was made
  struct Held {
    MemorySpace where;
    Bytes bytes;
    Claimant claimant;
  };
  std::unordered_map<void*, Held> step_held_;  ///< what the step running holds and has not queued back
  std::vector<Slot> slots_;
  std::vector<GradSlot> grad_slots_;  ///< two, by layer parity
  std::size_t next_slot_ = 0;
  std::int64_t step_ = 0;
  bool skipped_ = false;
  bool updates_pending_ = false;  ///< a deferred step's gradients wait for apply_updates()
  Timeline* timeline_ = nullptr;
  bool recording_ = false;  ///< the step running is recorded (into timeline_)
  LayerProgressFn on_layer_;
  std::chrono::steady_clock::time_point t0_;
  // A timed backend's recorded step: its first mark (on the compute stream) and the spans' marks.
  struct MarkedSpan {
    std::string name;
    Resource resource;
    TimeMarkOf<B> begin, end;
  };
  TimeMarkOf<B> step_mark_{};
  std::vector<MarkedSpan> marks_;
};

}  // namespace oom
