// HostCausalLm: a Qwen3-MoE causal language model on the host backend — the token embedding, the
// decoder layers run by the HostExecutor as the Plan says, the final RMSNorm and the LM head with
// cross-entropy. The decoder layers' state lives in the executor (streamed or resident per the
// plan); the embedding, final norm and LM head ("the ends") are updated here by the CPU AdamW, at
// the same step count.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "oom/model/host_decoder_layer.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/optim/segment_state.hpp"
#include "oom/optim/thread_pool.hpp"
#include "oom/plan/plan.hpp"
#include "oom/runtime/host_backend.hpp"
#include "oom/runtime/host_executor.hpp"

namespace oom::train {

/// Initial weights as transformers initialises Qwen3-MoE: every matrix N(0, std), every norm
/// at its identity scale (1, or 0 for a (1 + w) norm); a Gated DeltaNet's dt_bias 1 and A_log
/// log U(0.01, 16), as transformers' Qwen3-Next. A counter-based generator, so the same seed gives the same weights everywhere.
std::vector<std::vector<float>> initial_weights(const ModelSpec& spec, std::uint64_t seed, float std = 0.02f);
/// The same weights segment by segment, on every core: what a model built from a source takes
/// (CudaCausalLm), with no copy of the whole model in memory. Valid while `spec` lives.
SegmentWeightSource initial_weight_source(const ModelSpec& spec, std::uint64_t seed, float std = 0.02f);
/// Every segment of `source`, in memory (what HostCausalLm takes).
std::vector<std::vector<float>> weights_in_memory(const ModelSpec& spec, const SegmentWeightSource& source);

class HostCausalLm {
 public:
  /// `weights[s]` holds the fp32 values of spec.segments()[s] (see initial_weights).
  /// `max_grad_norm` > 0 clips the global gradient norm as torch.nn.utils.clip_grad_norm_ (the
  /// updates then wait for the whole backward).
  HostCausalLm(const ModelSpec& spec, const Plan& plan, const std::vector<std::vector<float>>& weights,
               const optim::AdamWConfig& adamw, HostBackend::Options backend, double max_grad_norm = 0);
  ~HostCausalLm();

  struct StepResult {
    double loss = 0;       ///< mean cross-entropy over the step's tokens (nats)
    bool skipped = false;  ///< the loss was not finite: no backward, no update
    double grad_norm = -1; ///< global gradient norm before clipping (-1: not computed, no clipping)
  };
  /// One optimizer step on `inputs` -> `targets`: plan.micro_batches windows of T tokens back to
  /// back (each plan.workload.sequences sequences of seq_len), their gradients accumulated (the
  /// loss is the mean over all of their tokens).
  StepResult step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets);

  /// Every segment's AdamW state, in spec.segments() order (what a checkpoint holds).
  [[nodiscard]] std::vector<SegmentOptimizerState> state();
  /// The same as a snapshot of views (the host executor's state is copied out: it is small).
  [[nodiscard]] StateSnapshot state_views();
  /// Continues from a checkpoint's state after `optimizer_steps` updates.
  void load(const std::vector<SegmentOptimizerState>& state, std::int64_t optimizer_steps);
  [[nodiscard]] std::int64_t optimizer_steps() const { return executor_->optimizer_steps(); }
  /// The learning rate of the steps that follow (the stack's and the ends').
  void set_learning_rate(float lr) {
    adamw_.lr = lr;
    executor_->set_learning_rate(lr);
  }

  [[nodiscard]] HostBackend& backend() { return *backend_; }
  /// Records the next step's work per resource (the decoder stack's; see HostExecutor).
  void record_next_step(Timeline* timeline) { executor_->record_next_step(timeline); }
  /// Progress of the decoder stack's passes (see HostExecutor::on_layer).
  void on_layer(LayerProgressFn fn) { executor_->on_layer(std::move(fn)); }

 private:
  struct End {  // one segment outside the decoder stack
    std::size_t segment = 0;  // index in spec.segments()
    std::vector<float> master, grad;
    std::vector<float> m, v;        // AdamW moments in fp32, or
    std::vector<bf16> m16, v16;     // in bf16, where the plan keeps bf16 moments (the other pair empty)
    std::vector<bf16> weights;
  };
  bool bf16_moments() const { return plan_.precision.moments == DType::bf16; }
  SegmentOptimizerState end_state(const End& e) const;
  double loss_and_grad(const float* y, float* grad_y, std::size_t micro_batch);
  void update_ends(float grad_scale);

  const ModelSpec* spec_;
  Plan plan_;
  optim::AdamWConfig adamw_;
  std::unique_ptr<HostBackend> backend_;
  std::vector<HostDecoderLayer> layers_;
  std::unique_ptr<RouterBalanceLoss> balance_;  ///< the load-balancing loss, where the config adds it
  std::unique_ptr<HostExecutor<HostDecoderLayer>> executor_;
  optim::ThreadPool pool_;
  End embedding_, final_norm_, lm_head_;
  bool tied_ = false;
  float final_norm_offset_ = 0;  // 1 where the final norm applies (1 + w)
  double max_grad_norm_ = 0;
  std::uint64_t tokens_ = 0;         // per micro-batch
  std::size_t micro_batches_ = 1;
  std::vector<std::int32_t> targets_;
  std::vector<float> head_w_, norm_w_;  // this step's bf16 weights of the head and the final norm, as fp32
};

}  // namespace oom::train
