#include "host_lm.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/hash.hpp"
#include "oom/reference/lm_head_loss.hpp"
#include "oom/reference/rmsnorm.hpp"

namespace oom::train {
namespace {

// N(0, 1) from two counter-derived uniforms (Box-Muller, in double; the same bits everywhere).
float normal(std::uint64_t key, std::uint64_t i) {
  const double u1 = (static_cast<double>(splitmix64(key ^ (2 * i)) >> 11) + 0.5) * 0x1.0p-53;
  const double u2 = (static_cast<double>(splitmix64(key ^ (2 * i + 1)) >> 11) + 0.5) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

bool is_norm(const std::string& name) { return name.ends_with("norm.weight") || name.ends_with("layernorm.weight"); }

}  // namespace

SegmentWeightSource initial_weight_source(const ModelSpec& spec, std::uint64_t seed, float std) {
  // Every tensor's key first (a chain, in spec order), then the values in parallel: each element is
  // a function of (key, index) alone, so neither the thread count nor the order segments are asked
  // in changes a value.
  const auto& segs = spec.segments();
  auto keys = std::make_shared<std::vector<std::vector<std::uint64_t>>>(segs.size());
  std::uint64_t key = splitmix64(seed);
  for (std::size_t s = 0; s < segs.size(); ++s)
    for (std::size_t t = 0; t < segs[s].tensors.size(); ++t) (*keys)[s].push_back(key = splitmix64(key));
  auto pool = std::make_shared<optim::ThreadPool>(0);
  return [&spec, keys, pool, std](std::size_t s, std::span<float> out) {
    if (s >= spec.segments().size())
      OOM_THROW(Errc::invalid_argument, fmt::format("initial weights: segment {} of a model of {}", s, spec.segments().size()));
    const auto& seg = spec.segments()[s];
    if (out.size() != seg.parameters())
      OOM_THROW(Errc::invalid_argument,
                fmt::format("initial weights: segment '{}' has {} parameters; a span of {}", seg.name, seg.parameters(), out.size()));
    // The segment's tensors cut into pieces, all of them one parallel run: a 5.13B expert segment
    // (three 2048 x 768 matrices) gives 72 tasks for 16 cores.
    constexpr std::uint64_t piece = std::uint64_t{1} << 16;  // elements a task
    struct Piece {
      std::size_t tensor;
      std::uint64_t offset, begin, end;  // offset: the tensor's first element in `out`
    };
    std::vector<Piece> pieces;
    std::uint64_t offset = 0;
    for (std::size_t t = 0; t < seg.tensors.size(); ++t) {
      const std::uint64_t n = seg.tensors[t].elements();
      for (std::uint64_t b = 0; b < n; b += piece) pieces.push_back({t, offset, b, std::min(n, b + piece)});
      offset += n;
    }
    pool->run(pieces.size(), [&](std::size_t p) {
      const Piece& pc = pieces[p];
      float* dst = out.data() + pc.offset;
      const std::string& name = seg.tensors[pc.tensor].name;
      if (is_norm(name)) {
        // The identity scale: 1, or 0 where the norm applies (1 + w) (Qwen3-Next / Qwen3.5).
        std::fill(dst + pc.begin, dst + pc.end, 1.0f - spec.norm_weight_offset(name));
        return;
      }
      const std::uint64_t k = (*keys)[s][pc.tensor];
      if (name.ends_with("_proj.bias")) {  // projection biases (Qwen2-MoE's q/k/v) start at 0, as transformers'
        std::fill(dst + pc.begin, dst + pc.end, 0.0f);
        return;
      }
      // The Gated DeltaNet's decay parameters as transformers' _init_weights sets them: dt_bias 1 and
      // A_log = log U(0.01, 16) per value head, so that the heads decay at rates spread over three
      // orders of magnitude (a matrix's N(0, std) would give every head nearly the same rate).
      if (name.ends_with("linear_attn.dt_bias")) {
        std::fill(dst + pc.begin, dst + pc.end, 1.0f);
        return;
      }
      if (name.ends_with("linear_attn.A_log")) {
        for (std::uint64_t i = pc.begin; i < pc.end; ++i) {
          const double u = (static_cast<double>(splitmix64(k ^ i) >> 11) + 0.5) * 0x1.0p-53;
          dst[i] = static_cast<float>(std::log(0.01 + (16.0 - 0.01) * u));
        }
        return;
      }
      for (std::uint64_t i = pc.begin; i < pc.end; ++i) dst[i] = std * normal(k, i);
    });
  };
}

std::vector<std::vector<float>> weights_in_memory(const ModelSpec& spec, const SegmentWeightSource& source) {
  std::vector<std::vector<float>> out(spec.segments().size());
  for (std::size_t s = 0; s < out.size(); ++s) {
    out[s].resize(spec.segments()[s].parameters());
    source(s, out[s]);
  }
  return out;
}

std::vector<std::vector<float>> initial_weights(const ModelSpec& spec, std::uint64_t seed, float std) {
  return weights_in_memory(spec, initial_weight_source(spec, seed, std));
}

HostCausalLm::HostCausalLm(const ModelSpec& spec, const Plan& plan, const std::vector<std::vector<float>>& weights,
                           const optim::AdamWConfig& adamw, HostBackend::Options backend, double max_grad_norm)
    : spec_(&spec), plan_(plan), adamw_(adamw), backend_(std::make_unique<HostBackend>(backend)), pool_(0),
      max_grad_norm_(max_grad_norm) {
  require_kept_precision(plan.precision, "HostCausalLm");
  const auto& segs = spec.segments();
  if (weights.size() != segs.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("{} weight blocks for a model of {} segments", weights.size(), segs.size()));
  tokens_ = plan.workload.tokens();
  micro_batches_ = static_cast<std::size_t>(std::max(plan.micro_batches, 1));
  tied_ = spec.tied_embeddings();
  auto make_end = [&](std::size_t s) {
    End e;
    e.segment = s;
    e.master = weights[s];
    if (bf16_moments()) {
      e.m16.assign(e.master.size(), to_bf16(0.0f));
      e.v16.assign(e.master.size(), to_bf16(0.0f));
    } else {
      e.m.assign(e.master.size(), 0.0f);
      e.v.assign(e.master.size(), 0.0f);
    }
    e.grad.assign(e.master.size(), 0.0f);
    e.weights.resize(e.master.size());
    std::transform(e.master.begin(), e.master.end(), e.weights.begin(), [](float f) { return to_bf16(f); });
    return e;
  };
  embedding_ = make_end(0);
  std::vector<std::vector<float>> layer_weights;
  std::size_t s = 1;
  for (int l = 0; l < spec.num_layers(); ++l) {
    layers_.emplace_back(spec, l);
    for (std::size_t k = 0; k < spec.layer_segments(l).size(); ++k) layer_weights.push_back(weights[s++]);
  }
  // transformers' load-balancing loss over every layer's router, where the config turns it on
  // (output_router_logits), each micro-batch's carrying 1/k as its cross-entropy does.
  if (const double coef = spec.moe().router_aux_loss_coef; coef > 0) {
    balance_ = std::make_unique<RouterBalanceLoss>(spec.num_layers(), spec.moe().experts, spec.moe().top_k, coef,
                                                   1.0 / static_cast<double>(micro_batches_));
    for (auto& layer : layers_) layer.balance_router(balance_.get());
  }
  final_norm_offset_ = spec.norm_weight_offset(segs[s].tensors.at(0).name);
  final_norm_ = make_end(s++);
  if (!tied_) lm_head_ = make_end(s++);
  LayerExecutorOptions opt;
  opt.adamw = adamw;
  opt.defer_updates = max_grad_norm > 0;
  executor_ = std::make_unique<HostExecutor<HostDecoderLayer>>(*backend_, layers_, plan_, layer_weights, opt);
}

HostCausalLm::~HostCausalLm() = default;

double HostCausalLm::loss_and_grad(const float* y, float* grad_y, std::size_t mb) {
  const auto t = static_cast<std::int64_t>(tokens_);
  const auto h = static_cast<std::int64_t>(spec_->hidden_size());
  const auto v = static_cast<std::int64_t>(spec_->vocab_size());
  const auto eps = static_cast<float>(spec_->rms_norm_eps());
  const auto k = static_cast<double>(micro_batches_);
  std::vector<float> r(static_cast<std::size_t>(t * h)), rstd(static_cast<std::size_t>(t));
  const std::span<const float> ys(y, static_cast<std::size_t>(t * h));
  reference::rmsnorm_forward<float>(ys, norm_w_, r, rstd, t, h, eps);
  const std::span<const std::int32_t> tg(targets_.data() + mb * tokens_, tokens_);
  // The step's loss is the mean over all k·T tokens: each micro-batch carries 1/(k·T).
  const auto res = reference::lm_head_loss(t, h, v, r, head_w_, tg, /*backward=*/true, 1.0 / (static_cast<double>(t) * k));
  // dW of the head (summed over micro-batches in order); the norm's backward gives dL/dy.
  End& head_grad = tied_ ? embedding_ : lm_head_;
  if (mb == 0) {
    std::copy(res.dw.begin(), res.dw.end(), head_grad.grad.begin());
    std::fill(final_norm_.grad.begin(), final_norm_.grad.end(), 0.0f);
  } else {
    for (std::size_t i = 0; i < res.dw.size(); ++i) head_grad.grad[i] += res.dw[i];
  }
  reference::rmsnorm_backward<float>(res.dx, ys, norm_w_, rstd, std::span<float>(grad_y, static_cast<std::size_t>(t * h)),
                                     final_norm_.grad, t, h);
  return res.loss_sum / (static_cast<double>(t) * k) + (balance_ != nullptr ? balance_->loss() : 0.0);
}

HostCausalLm::StepResult HostCausalLm::step(std::span<const std::uint32_t> inputs, std::span<const std::uint32_t> targets) {
  const auto h = spec_->hidden_size();
  const std::size_t all = tokens_ * micro_batches_;
  if (inputs.size() != all || targets.size() != all)
    OOM_THROW(Errc::invalid_argument, fmt::format("a step takes {} x {} tokens (the plan's micro-batches x tokens), got {} inputs and "
                                                  "{} targets", micro_batches_, tokens_, inputs.size(), targets.size()));
  const auto vocab = spec_->vocab_size();
  for (std::size_t i = 0; i < all; ++i)
    if (inputs[i] >= vocab || targets[i] >= vocab)
      OOM_THROW(Errc::invalid_argument, fmt::format("token id {} at position {} is >= the model's vocab {}",
                                                    std::max(inputs[i], targets[i]), i, vocab));
  // Embedding: rows of the bf16 table, read exactly; one (T, H) input per micro-batch.
  std::vector<std::vector<float>> x(micro_batches_, std::vector<float>(tokens_ * h));
  std::vector<HostLossFn> losses;
  for (std::size_t mb = 0; mb < micro_batches_; ++mb) {
    for (std::size_t i = 0; i < tokens_; ++i)
      for (std::uint64_t c = 0; c < h; ++c) x[mb][i * h + c] = to_float(embedding_.weights[inputs[mb * tokens_ + i] * h + c]);
    losses.push_back([this, mb](const float* y, float* g) { return loss_and_grad(y, g, mb); });
  }
  targets_.assign(targets.begin(), targets.end());
  // The final norm's and the head's bf16 weights read as fp32, once per step (every micro-batch's
  // loss uses them; they change only in the update).
  auto widen = [](const std::vector<bf16>& from, std::vector<float>& to) {
    to.resize(from.size());
    std::transform(from.begin(), from.end(), to.begin(), [](bf16 b) { return to_float(b); });
  };
  widen(final_norm_.weights, norm_w_);
  // A (1 + w) final norm (Qwen3-Next / Qwen3.5) applies 1 + w, added in fp32 as transformers does.
  if (final_norm_offset_ != 0)
    for (float& v : norm_w_) v += final_norm_offset_;
  widen((tied_ ? embedding_ : lm_head_).weights, head_w_);
  if (tied_) std::fill(embedding_.grad.begin(), embedding_.grad.end(), 0.0f);  // the head adds into it first
  std::vector<std::vector<float>> grad_x;
  const double loss = executor_->step(x, losses, &grad_x);
  if (executor_->last_step_skipped()) return {loss, true};
  // Embedding backward: scatter-add in micro-batch and token order (deterministic).
  if (!tied_) std::fill(embedding_.grad.begin(), embedding_.grad.end(), 0.0f);
  for (std::size_t mb = 0; mb < micro_batches_; ++mb)
    for (std::size_t i = 0; i < tokens_; ++i)
      for (std::uint64_t c = 0; c < h; ++c) embedding_.grad[inputs[mb * tokens_ + i] * h + c] += grad_x[mb][i * h + c];
  if (max_grad_norm_ <= 0) {
    update_ends(1.0f);
    return {loss, false};
  }
  // Clipping: the global norm over the stack's segments (in order) and then the ends, as
  // torch.nn.utils.clip_grad_norm_ over all parameters; every update scaled by the same factor.
  double ss = executor_->gradient_sum_of_squares();
  for (const End* e : {&embedding_, &final_norm_, &lm_head_})
    if (!e->grad.empty()) ss += optim::grad_sum_of_squares(e->grad, pool_);
  const float scale = optim::clip_grad_scale(ss, max_grad_norm_);
  executor_->apply_updates(scale);
  update_ends(scale);
  return {loss, false, std::sqrt(ss)};
}

void HostCausalLm::update_ends(float grad_scale) {
  const auto step = executor_->optimizer_steps();  // the executor has counted this step already
  const auto sc = optim::adamw_step_scalars(adamw_, step, grad_scale);
  for (End* e : {&embedding_, &final_norm_, &lm_head_}) {
    if (e->master.empty()) continue;
    optim::require_finite_gradients(e->grad, fmt::format("segment '{}' (step {})", spec_->segments()[e->segment].name, step), pool_);
    if (bf16_moments()) optim::adamw_update(optim::AdamWSpan<bf16>{e->master, e->m16, e->v16, e->grad, e->weights}, sc, pool_);
    else optim::adamw_update(optim::AdamWSpan<float>{e->master, e->m, e->v, e->grad, e->weights}, sc, pool_);
  }
}

std::vector<SegmentOptimizerState> HostCausalLm::state() {
  auto layers = executor_->optimizer_state();
  std::vector<SegmentOptimizerState> out;
  out.push_back(end_state(embedding_));
  for (auto& s : layers) out.push_back(std::move(s));
  out.push_back(end_state(final_norm_));
  if (!tied_) out.push_back(end_state(lm_head_));
  return out;
}

SegmentOptimizerState HostCausalLm::end_state(const End& e) const {
  if (!bf16_moments()) return {e.master, e.m, e.v};
  SegmentOptimizerState s{e.master, std::vector<float>(e.master.size()), std::vector<float>(e.master.size())};
  moments_to_fp32(DType::bf16, e.m16.data(), s.exp_avg);
  moments_to_fp32(DType::bf16, e.v16.data(), s.exp_avg_sq);
  return s;
}

StateSnapshot HostCausalLm::state_views() {
  StateSnapshot snap;
  snap.owned = state();
  for (const auto& s : snap.owned) snap.views.emplace_back(s);
  return snap;
}

void HostCausalLm::load(const std::vector<SegmentOptimizerState>& state, std::int64_t optimizer_steps) {
  if (state.size() != spec_->segments().size())
    OOM_THROW(Errc::invalid_argument, fmt::format("state of {} segments for a model of {}", state.size(), spec_->segments().size()));
  for (const End* e : {&embedding_, &final_norm_, &lm_head_}) {  // everything checked before anything changes
    if (e->master.empty()) continue;
    const auto& s = state[e->segment];
    if (s.master.size() != e->master.size() || s.exp_avg.size() != e->master.size() || s.exp_avg_sq.size() != e->master.size())
      OOM_THROW(Errc::invalid_argument, fmt::format("state of segment '{}' has the wrong size", spec_->segments()[e->segment].name));
  }
  std::vector<SegmentOptimizerState> layers(state.begin() + 1, state.end() - (tied_ ? 1 : 2));
  executor_->load_optimizer_state(layers, optimizer_steps);  // checks the layers' sizes first
  auto set = [&](End& e) {
    const auto& s = state[e.segment];
    e.master = s.master;
    if (bf16_moments()) {  // rounded to nearest even: exact for state a bf16-moment run saved
      moments_from_fp32(DType::bf16, s.exp_avg, e.m16.data());
      moments_from_fp32(DType::bf16, s.exp_avg_sq, e.v16.data());
    } else {
      e.m = s.exp_avg;
      e.v = s.exp_avg_sq;
    }
    std::transform(e.master.begin(), e.master.end(), e.weights.begin(), [](float f) { return to_bf16(f); });
  };
  set(embedding_);
  set(final_norm_);
  if (!tied_) set(lm_head_);
}

}  // namespace oom::train
