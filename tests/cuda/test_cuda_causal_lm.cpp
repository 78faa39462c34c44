// The CUDA executor computes the same step under every plan: residency (GPU AdamW vs CPU AdamW),
// prefetch depth, and keep/offload/recompute of boundaries and saved buffers give the resident
// plan's weights, moments and losses bit for bit after 3 steps (the kernels are deterministic and
// the two AdamWs round identically); a schedule that drops the wait for a layer's weights is
// caught; a streamed plan needs less device memory than the resident one; state export/load
// resumes bit for bit. The plans above run each layer's MoE half whole (chunks of T): token
// chunks change the expert GEMMs' summation order, so a chunked plan is checked on its own: the
// same under every retention, deterministic, and within a tolerance of the whole one.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/runtime/cuda_causal_lm.hpp"
#include "support/executor_options.hpp"
#include "support/small_moe.hpp"
#include "train/host_lm.hpp"

using namespace oom;
using namespace oom::literals;

namespace {

using test::attention_state;
using test::staging_ring;

ModelSpec small_spec() { return test::small_qwen3_moe(3); }

constexpr std::uint64_t T = 157;  // not a multiple of any tile

std::vector<std::vector<float>> init(const ModelSpec& spec) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<std::vector<float>> w;
  for (const auto& s : spec.segments()) {
    std::vector<float> v;
    for (const auto& t : s.tensors)
      for (std::uint64_t i = 0; i < t.elements(); ++i) v.push_back(t.name.ends_with("norm.weight") ? 1.0f + d(rng) : d(rng));
    w.push_back(std::move(v));
  }
  return w;
}

/// The recorded span `whole` and its two halves (DecoderLayerContext::halves): the first starts
/// with it, the second ends with it, they meet, and neither is empty.
void check_halves(const std::vector<TimelineSpan>& spans, const std::string& whole_name, const std::string& first_name,
                  const std::string& second_name) {
  CAPTURE(whole_name);
  auto find = [&](const std::string& name) {
    const auto it = std::find_if(spans.begin(), spans.end(), [&](const TimelineSpan& s) { return s.name == name; });
    REQUIRE_MESSAGE(it != spans.end(), name);
    return *it;
  };
  const auto whole = find(whole_name), first = find(first_name), second = find(second_name);
  CHECK(first.begin_s == whole.begin_s);
  CHECK(first.end_s == second.begin_s);
  CHECK(second.end_s == whole.end_s);
  CHECK(first.end_s > first.begin_s);
  CHECK(second.end_s > second.begin_s);
}

/// A warm-up step of `lm` (inputs of 5s, targets of 7s), then one recorded into `tl`.
void record_second_step(CudaCausalLm& lm, Timeline& tl) {
  const std::vector<std::uint32_t> in(T, 5), tgt(T, 7);
  (void)lm.step(in, tgt);
  lm.record_next_step(&tl);
  (void)lm.step(in, tgt);
}

Plan resident_plan(const ModelSpec& spec, std::uint64_t tokens = T) {
  Plan p;
  p.workload = {1, tokens};
  p.prefetch_depth = 2;
  p.gpu_budget = 2_GiB;
  p.host_budget = 4_GiB;
  for (const auto& s : spec.segments()) p.resident_segments.push_back(s.name);
  for (int l = 0; l < spec.num_layers(); ++l) {
    p.retention.push_back({});
    p.chunks.push_back({{tokens}, tokens});
  }
  p.loss_rows = tokens;
  return p;
}

struct Run {
  std::vector<double> losses;
  std::vector<double> grad_norms;  ///< StepResult::grad_norm (-1 without clipping)
  std::vector<SegmentOptimizerState> state;
  Bytes device_peak;
  Bytes staging;  ///< pinned gradient staging (and the token buffer)
};

// The executor's defaults unless a test says otherwise (a gradient staging ring, recompute around
// kept attention state), so the equivalence tests below run the path oom-train takes.
Run run_steps(const ModelSpec& spec, const Plan& plan, int steps = 3, bool drop_wait = false,
          unsigned grad_staging_layers = CudaCausalLmOptions{}.grad_staging_layers,
          bool keep_attention_state = CudaCausalLmOptions{}.keep_attention_state, double max_grad_norm = 0,
          bool leave_unrouted = CudaCausalLmOptions{}.leave_unrouted_expert_grads, std::uint64_t tokens = T,
          bool overlap_updates = CudaCausalLmOptions{}.overlap_updates, bool repeat_window = false,
          bool skip_nonfinite_loss = CudaCausalLmOptions{}.skip_nonfinite_loss) {
  CudaCausalLmOptions opt;
  opt.skip_nonfinite_loss = skip_nonfinite_loss;
  opt.overlap_updates = overlap_updates;
  opt.max_grad_norm = max_grad_norm;
  opt.leave_unrouted_expert_grads = leave_unrouted;
  opt.keep_attention_state = keep_attention_state;
  opt.adamw.lr = 3e-3f;
  opt.drop_weight_wait = drop_wait;
  opt.grad_staging_layers = grad_staging_layers;
  CudaCausalLm lm(spec, plan, init(spec), opt);
  Run r;
  std::mt19937_64 rng(7);
  // A step takes plan.micro_batches windows of `tokens` (with repeat_window, copies of its first).
  const auto k = static_cast<std::uint64_t>(plan.micro_batches);
  for (int s = 0; s < steps; ++s) {
    std::vector<std::uint32_t> in(tokens * k), tgt(tokens * k);
    // (drawn window by window: a run repeating its first window draws what a one-window run does)
    for (std::uint64_t i = 0; i < tokens * k; ++i)
      in[i] = repeat_window && i >= tokens ? in[i % tokens] : static_cast<std::uint32_t>(rng() % 300);
    for (std::uint64_t i = 0; i < tokens * k; ++i) tgt[i] = (in[i] * 7 + 3) % 300;  // learnable: a function of the current token
    const auto result = lm.step(in, tgt);
    r.losses.push_back(result.loss);
    r.grad_norms.push_back(result.grad_norm);
  }
  r.state = lm.state();
  r.device_peak = lm.backend().device_arena().peak();
  r.staging = lm.backend().pinned_arena().peak(Claimant::host_staging);
  return r;
}

/// `reference` with a random prefetch depth, residency (every segment streamed with
/// all_streamed) and keep / offload / recompute of each layer's boundary and expert activations.
Plan random_variant(const ModelSpec& spec, Plan p, std::mt19937_64& rng, bool all_streamed) {
  p.prefetch_depth = 1 + static_cast<int>(rng() % 3);
  p.resident_segments.clear();
  for (const auto& s : spec.segments())
    if (!all_streamed && rng() % 2) p.resident_segments.push_back(s.name);
  for (int l = 0; l < spec.num_layers(); ++l) {
    auto& row = p.retention[static_cast<std::size_t>(l)];
    row[0] = rng() % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
    const auto pick = rng() % 3;
    const auto d = pick == 0 ? RetentionDecision::keep() : pick == 1 ? RetentionDecision::offload() : RetentionDecision::recompute(l);
    row[static_cast<std::size_t>(ActivationClass::expert_intermediate)] = d;
  }
  return p;
}

/// `p` with one micro-batch.
Plan single(Plan p) {
  p.micro_batches = 1;
  return p;
}

/// ||got - want|| / ||want|| over every segment's master weights.
double master_rel_l2(const std::vector<SegmentOptimizerState>& got, const std::vector<SegmentOptimizerState>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    for (std::size_t j = 0; j < want[i].master.size(); ++j) {
      const double d = static_cast<double>(got[i].master[j]) - want[i].master[j];
      num += d * d;
      den += static_cast<double>(want[i].master[j]) * want[i].master[j];
    }
  return std::sqrt(num / den);
}

/// The `n` segments whose master weights are furthest apart (relative L2 each), for a message.
std::string furthest_segments(const ModelSpec& spec, const std::vector<SegmentOptimizerState>& got,
                              const std::vector<SegmentOptimizerState>& want, std::size_t n = 4) {
  std::vector<std::pair<double, std::string>> apart;
  for (std::size_t i = 0; i < want.size() && i < spec.segments().size(); ++i)
    apart.emplace_back(master_rel_l2({got[i]}, {want[i]}), spec.segments()[i].name);
  std::sort(apart.begin(), apart.end(), std::greater<>());
  std::string out;
  for (std::size_t i = 0; i < std::min(n, apart.size()); ++i) out += (i ? ", " : "") + apart[i].second + " " + std::to_string(apart[i].first);
  return out;
}

bool same(const std::vector<SegmentOptimizerState>& a, const std::vector<SegmentOptimizerState>& b) {
  if (a.size() != b.size()) return false;
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!eq(a[i].master, b[i].master) || !eq(a[i].exp_avg, b[i].exp_avg) || !eq(a[i].exp_avg_sq, b[i].exp_avg_sq)) return false;
  return true;
}

/// A middle range of each of the view's arrays (from a third in to a fifth short of the end), read
/// through the view, holds the owned state's bits there.
void check_view_range(const SegmentStateView& view, const SegmentOptimizerState& whole) {
  const std::size_t n = whole.master.size(), off = n / 3, len = n - off - n / 5;
  for (auto [a, all] : {std::pair{StateArray::master, &whole.master}, {StateArray::exp_avg, &whole.exp_avg},
                        {StateArray::exp_avg_sq, &whole.exp_avg_sq}}) {
    std::vector<float> part(len, -1.0f);
    view.copy(a, off, part);
    CHECK(std::memcmp(part.data(), all->data() + off, len * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("every plan gives the resident plan's step, bit for bit, on the GPU") {
  const auto spec = small_spec();
  const Plan reference = resident_plan(spec);
  const Run expect = run_steps(spec, reference);
  MESSAGE("resident plan: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]
                                   << ", device peak " << expect.device_peak.count());
  // The optimizer moved every segment (the comparisons below are not between untouched copies).
  const auto start = init(spec);
  for (std::size_t i = 0; i < start.size(); ++i) CHECK(expect.state[i].master != start[i]);
  CHECK(same(run_steps(spec, reference).state, expect.state));  // deterministic run to run

  std::mt19937_64 rng(42);
  for (int i = 0; i < 8; ++i) {
    const Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
    CAPTURE(i);
    CAPTURE(p.prefetch_depth);
    const Run got = run_steps(spec, p);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
    if (i == 0) CHECK(got.device_peak < expect.device_peak);
  }
}

namespace {
/// `p` keeping its AdamW moments as `moments` (Plan::precision.moments).
Plan with_moments(Plan p, DType moments) {
  p.precision.moments = moments;
  return p;
}
}  // namespace

TEST_CASE("bf16 moments: every plan the resident plan's step, bit for bit; moments exported exactly; state loads back") {
  const auto spec = small_spec();
  const Plan reference = with_moments(resident_plan(spec), DType::bf16);
  const Run expect = run_steps(spec, reference);
  MESSAGE("resident plan, bf16 moments: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
  CHECK(same(run_steps(spec, reference).state, expect.state));  // deterministic run to run

  // The exported moments are bf16 values widened (to_bf16 gives them back), and not the fp32
  // moments' run: from the second step on the update reads moments rounded to bf16.
  // (Moments of parameters no gradient reached, e.g. embedding rows of tokens not drawn, are 0 in
  // both runs: only the others count.)
  const Run fp32 = run_steps(spec, resident_plan(spec));
  std::size_t not_bf16 = 0, moved = 0, differ = 0;
  for (std::size_t s = 0; s < expect.state.size(); ++s)
    for (auto [got, other] : {std::pair{&expect.state[s].exp_avg, &fp32.state[s].exp_avg},
                              {&expect.state[s].exp_avg_sq, &fp32.state[s].exp_avg_sq}})
      for (std::size_t i = 0; i < got->size(); ++i) {
        const float x = (*got)[i], rounded = to_float(to_bf16(x));
        not_bf16 += std::memcmp(&x, &rounded, sizeof(float)) != 0 ? 1 : 0;
        if ((*other)[i] == 0.0f) continue;
        ++moved;
        differ += std::memcmp(&x, &(*other)[i], sizeof(float)) != 0 ? 1 : 0;
      }
  CHECK(not_bf16 == 0);
  MESSAGE(differ << " of " << moved << " nonzero moments differ from the fp32 moments' run");
  CHECK(moved > 0);
  CHECK(differ > moved / 2);
  CHECK(!same(expect.state, fp32.state));

  // Every plan: the GPU AdamW (bf16 moments on the GPU) and the CPU AdamW (bf16 moments in pinned
  // memory) round alike, so residency, prefetch and retention change nothing.
  std::mt19937_64 rng(43);
  for (int i = 0; i < 5; ++i) {
    const Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
    REQUIRE(p.precision.moments == DType::bf16);
    CAPTURE(i);
    CAPTURE(p.prefetch_depth);
    CAPTURE(p.resident_segments.size());
    const Run got = run_steps(spec, p);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
    if (i == 0) CHECK(got.device_peak < expect.device_peak);
  }

  // state() -> load() into a fresh model, half the segments streamed: the same state back, bit for
  // bit (the exported moments round to themselves), and the next step the one the first model takes.
  Plan mixed = reference;
  mixed.resident_segments.resize(mixed.resident_segments.size() / 2);
  CudaCausalLmOptions opt;
  opt.adamw.lr = 3e-3f;
  std::vector<std::uint32_t> in(T), tgt(T);
  for (std::uint64_t i = 0; i < T; ++i) in[i] = static_cast<std::uint32_t>((i * 31 + 5) % 300), tgt[i] = (in[i] * 7 + 3) % 300;
  CudaCausalLm first(spec, mixed, init(spec), opt);
  for (int s = 0; s < 2; ++s) (void)first.step(in, tgt);
  const auto saved = first.state();
  // The views a checkpoint writes from: every segment read (bf16 moments are widened on the way),
  // the same bits as state() at any range.
  const StateSnapshot snap = first.state_views();
  REQUIRE(snap.views.size() == saved.size());
  for (std::size_t s = 0; s < saved.size(); ++s) {
    CAPTURE(s);
    CHECK(snap.views[s].read);
    check_view_range(snap.views[s], saved[s]);
  }
  CudaCausalLm second(spec, mixed, init(spec), opt);
  second.load(saved, first.optimizer_steps());
  CHECK(same(second.state(), saved));
  CHECK(second.step(in, tgt).loss == first.step(in, tgt).loss);
  CHECK(same(second.state(), first.state()));

  // Moments the executor does not keep: refused before anything is allocated, naming the field.
  CHECK_THROWS_WITH_AS(CudaCausalLm(spec, with_moments(reference, DType::fp16), init(spec), opt),
                       doctest::Contains("CudaCausalLm: precision.moments is fp16; it keeps fp32 or bf16 moments"),
                       Error);
}

TEST_CASE("a hybrid model (Gated DeltaNet and gated attention layers, shared experts): every plan the resident plan's step") {
  // tests/data/gpu-qwen3-next-layers.json: layers 0 and 2 Gated DeltaNet, 1 gated full attention
  // with a quarter of each head rotated, (1 + w) norms (the final one too), a shared expert.
  const auto spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/tests/data/gpu-qwen3-next-layers.json");
  REQUIRE(spec.layer(0).attention == AttentionKind::linear);
  REQUIRE(spec.layer(1).attention == AttentionKind::full);
  const Plan reference = resident_plan(spec);
  const Run expect = run_steps(spec, reference);
  MESSAGE("hybrid resident plan: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
  for (const double loss : expect.losses) CHECK(std::isfinite(loss));
  const auto start = init(spec);
  for (std::size_t i = 0; i < start.size(); ++i) CHECK(expect.state[i].master != start[i]);
  // Streamed, offloaded and recomputed (a linear layer's recompute runs its whole block: it keeps
  // no attention state) plans, with and without kept attention state: the same bits.
  std::mt19937_64 rng(43);
  for (int i = 0; i < 6; ++i) {
    Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
    if (i % 2 == 1)  // every saved buffer recomputed
      for (int l = 0; l < spec.num_layers(); ++l)
        for (int c = 1; c < activation_class_count; ++c) p.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)] = RetentionDecision::recompute(l);
    CAPTURE(i);
    const Run got = run_steps(spec, p, 3, false, CudaCausalLmOptions{}.grad_staging_layers, /*keep_attention_state=*/i % 3 != 2);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
  }
  // MoE token chunks (the shared expert recomputed chunk by chunk in the backward) and 2
  // micro-batches a step: each plan its own resident step under streaming and recompute.
  for (const bool micro : {false, true}) {
    CAPTURE(micro);
    Plan chunked = reference;
    for (auto& c : chunked.chunks) c.moe_tokens = 50;  // 157 tokens: 50, 50, 50 and 7
    if (micro) chunked.micro_batches = 2;
    const Run want = run_steps(spec, chunked);
    for (const double loss : want.losses) CHECK(std::isfinite(loss));
    Plan streamed = chunked;
    streamed.resident_segments.clear();
    streamed.prefetch_depth = 1;
    streamed.retention[0][0] = RetentionDecision::offload();
    for (int l = 0; l < spec.num_layers(); ++l)
      streamed.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(ActivationClass::expert_intermediate)] =
          l == 1 ? RetentionDecision::offload() : RetentionDecision::recompute(l);
    const Run got = run_steps(spec, streamed);
    CHECK(got.losses == want.losses);
    CHECK(same(got.state, want.state));
  }
  // The linear layers in the plan's token chunks (parts of 64, 64 and 29 tokens, the rule's state,
  // its gradient and the conv's edge rows carried between them), and the gated attention layer in
  // query chunks (the same ends: chunks of 128 and 29, on the executor's 128-token granularity; its
  // dK/dV summed in fp32 over them): its own step under streaming, offload and recompute, bit for
  // bit. Against the whole plan: the first step's loss the same bits (the forward in parts is the
  // whole's, test_cuda_deltanet; the gated q_proj and o_proj rows a chunk at a time, the same
  // sums), the gradients the same up to the weight gradients summed a part at a time and dK/dV
  // summed over chunks (1e-7 relative there, test_cuda_hybrid_layer: 7.8e-6 at the worst), which AdamW's
  // first steps amplify where a gradient is near 0 (the MoE-chunk case below explains the bounds):
  // later losses within 5e-3 relative (measured 3.7e-5 and 1.4e-3 at steps 2 and 3, H200,
  // thirty-seventh session), the master weights within 1e-2 relative L2. With the query chunks the
  // gradients differ by more than a summation order: dK/dV are rounded to bf16 once from fp32 sums
  // whose order changed, so a small fraction of their elements move by one bf16 step (2^-8), and
  // that reaches the layer's k and v weight gradients (7.8e-6 relative, test_cuda_hybrid_layer;
  // and its dx in general: 1e-4 in test_cuda_decoder_layer, against 1e-7 for the parts' weight
  // gradients): more near-zero gradients change sign under AdamW's first, sign-like steps, every
  // later step's gradients then differ, and the models drift further apart over the 3 steps (measured on the H200,
  // thirty-eighth session: losses 1.5e-3 and 7.5e-4 relative at steps 2 and 3, master weights
  // 2.2e-2, spread over every layer's router and experts, the embedding alike): bound 5e-2. The
  // losses drift with them: the loss rises over the 3 steps (6.82 to 7.1-7.2: a chaotic path, on
  // which the routers' top-k choices flip), and any change to a kernel's rounding moves where it
  // ends. On the H200 (forty-first session), one-step segments within 9e-4 throughout, step 2 and 3
  // losses 8.9e-4 and 2.4e-3 apart with the rule's products on the FMA pipes, 6.4e-3 and 7.4e-3 in two
  // builds with them on the tensor cores (tf32 pairs, 1e-6 from the reference like the FMA ones):
  // bound 2e-2 there, 5e-3 for the parts alone. test_cuda_decoder_layer and test_cuda_hybrid_layer bound the chunks'
  // effect on one layer tightly.
  // After one step, segment by segment: only gradients near 0 can change sign there, so every
  // segment stays within 1e-2 (a wrong chunk's dK/dV would flip a good part of that layer's k/v
  // weight gradients: about 2 lr / |w| sqrt(f) = 0.1 sqrt(f), several 1e-2). Measured on the H200
  // (thirty-eighth session): the linear parts alone leave every segment within 5e-7, the query
  // chunks too move the furthest by 9.1e-4 (layer 0's linear attention, through d xn1).
  const Run first_ref = run_steps(spec, reference, 1);
  for (const bool query_chunks : {false, true}) {
    CAPTURE(query_chunks);
    Plan parts = reference;
    for (const int l : {0, 2}) parts.chunks[static_cast<std::size_t>(l)].attention = {64, 128, T};
    if (query_chunks) parts.chunks[1].attention = {64, 128, T};
    CHECK(describe_chunks(spec, parts) == (query_chunks ? "MoE whole, attention in query chunks of 128 tokens, linear attention in parts of 64 tokens"
                                                        : "MoE whole, linear attention in parts of 64 tokens"));
    const Run want = run_steps(spec, parts);
    Plan streamed = parts;
    streamed.resident_segments.clear();
    streamed.prefetch_depth = 1;
    streamed.retention[0][0] = RetentionDecision::offload();
    for (int l = 0; l < spec.num_layers(); ++l)
      for (int c = 1; c < activation_class_count; ++c)
        streamed.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)] = RetentionDecision::recompute(l);
    const Run got = run_steps(spec, streamed);
    CHECK(got.losses == want.losses);
    CHECK(same(got.state, want.state));
    CHECK(want.losses[0] == expect.losses[0]);
    for (std::size_t s = 1; s < want.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(std::abs(want.losses[s] - expect.losses[s]) <= (query_chunks ? 2e-2 : 5e-3) * std::abs(expect.losses[s]));
    }
    const double rel = master_rel_l2(want.state, expect.state);
    const std::string what = query_chunks ? "linear layers in parts of 64, attention in query chunks of 128" : "linear layers in parts of 64";
    MESSAGE("hybrid, " << what << ": losses " << want.losses[1] << " " << want.losses[2] << " against the whole plan's "
                       << expect.losses[1] << " " << expect.losses[2] << ", master weights rel. L2 " << rel
                       << "; furthest segments: " << furthest_segments(spec, want.state, expect.state));
    CHECK(rel <= (query_chunks ? 5e-2 : 1e-2));
    const Run first = run_steps(spec, parts, 1);
    double worst = 0;
    for (std::size_t i = 0; i < first.state.size(); ++i) worst = std::max(worst, master_rel_l2({first.state[i]}, {first_ref.state[i]}));
    MESSAGE("  after one step: the furthest segments " << furthest_segments(spec, first.state, first_ref.state));
    CHECK(worst <= 1e-2);
  }
}

TEST_CASE("Mixtral, OLMoE and Qwen2-MoE models (no q/k norm; q/k norm over the whole projection; q/k/v biases): every "
          "plan the resident plan's step") {
  // tests/data/gpu-mixtral-layers.json, gpu-olmoe-layers.json and gpu-qwen2-moe-layers.json: 2
  // layers of full attention, 8 experts top-2 (OLMoE's and Qwen2-MoE's weights not renormalised;
  // Qwen2-MoE's shared expert), the layers test_cuda_hybrid_layer checks.
  for (const char* file : {"gpu-mixtral-layers.json", "gpu-olmoe-layers.json", "gpu-qwen2-moe-layers.json"}) {
    CAPTURE(file);
    const auto spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/tests/data/" + file);
    const Plan reference = resident_plan(spec);
    const Run expect = run_steps(spec, reference);
    MESSAGE(file << " resident plan: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
    for (const double loss : expect.losses) CHECK(std::isfinite(loss));
    std::mt19937_64 rng(44);
    for (int i = 0; i < 4; ++i) {
      Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
      CAPTURE(i);
      const Run got = run_steps(spec, p, 3, false, CudaCausalLmOptions{}.grad_staging_layers, /*keep_attention_state=*/i % 2 == 0);
      CHECK(got.losses == expect.losses);
      CHECK(same(got.state, expect.state));
    }
  }
}

TEST_CASE("a model built from a weight source: each segment asked once, in spec order; the model the weights in memory build") {
  const auto spec = small_spec();
  const auto w = init(spec);
  std::mt19937_64 rng(5);
  const Plan p = random_variant(spec, resident_plan(spec), rng, /*all_streamed=*/false);
  REQUIRE(!p.resident_segments.empty());  // streamed segments are filled in pinned memory, resident ones uploaded
  REQUIRE(p.resident_segments.size() < spec.segments().size());
  std::vector<std::size_t> asked;
  const SegmentWeightSource source = [&](std::size_t s, std::span<float> out) {
    asked.push_back(s);
    REQUIRE(out.size() == w[s].size());
    std::copy(w[s].begin(), w[s].end(), out.begin());
  };
  CudaCausalLmOptions opt;
  opt.adamw.lr = 3e-3f;
  {
    CudaCausalLm lm(spec, p, source, opt);
    std::vector<std::size_t> order(spec.segments().size());
    for (std::size_t s = 0; s < order.size(); ++s) order[s] = s;
    CHECK(asked == order);
    const auto st = lm.state();
    for (std::size_t s = 0; s < w.size(); ++s) {
      CAPTURE(spec.segments()[s].name);
      CHECK(std::memcmp(st[s].master.data(), w[s].data(), w[s].size() * sizeof(float)) == 0);
      CHECK(std::all_of(st[s].exp_avg.begin(), st[s].exp_avg.end(), [](float x) { return x == 0.0f; }));
      CHECK(std::all_of(st[s].exp_avg_sq.begin(), st[s].exp_avg_sq.end(), [](float x) { return x == 0.0f; }));
    }
  }
  // A source that fails part way: its error comes out of the constructor.
  const SegmentWeightSource failing = [&](std::size_t s, std::span<float> out) {
    if (s == 3) OOM_THROW(Errc::io, "weights.bin: read failed");
    std::fill(out.begin(), out.end(), 0.0f);
  };
  CHECK_THROWS_WITH_AS(CudaCausalLm(spec, p, failing, opt), doctest::Contains("weights.bin: read failed"), Error);
}

TEST_CASE("clipping by global norm: every plan the same clipped step, bit for bit, and the clip acts") {
  const auto spec = small_spec();
  const Plan reference = resident_plan(spec);
  const Run plain = run_steps(spec, reference);
  CHECK(plain.grad_norms == std::vector<double>(plain.grad_norms.size(), -1.0));  // not computed without clipping
  constexpr double clip = 0.05;
  const Run expect = run_steps(spec, reference, 3, false, 0, true, clip);
  for (const double norm : expect.grad_norms) {
    CHECK(std::isfinite(norm));
    CHECK(norm > clip);  // the factor is < 1 at every step: the clip acts
  }
  CHECK(expect.losses[0] == plain.losses[0]);  // the same first forward
  CHECK(!same(expect.state, plain.state));
  CHECK(same(run_steps(spec, reference, 3, false, 0, true, clip).state, expect.state));  // deterministic
  // Streamed segments (CPU AdamW, sums of squares taken on the gradient slots), offloads and
  // recomputes: the same norms, losses and state as the resident plan.
  std::mt19937_64 rng(5);
  for (int i = 0; i < 3; ++i) {
    Plan p = reference;
    p.resident_segments.clear();
    for (const auto& s : spec.segments())
      if (i > 0 && rng() % 2) p.resident_segments.push_back(s.name);
    for (int l = 0; l < spec.num_layers(); ++l) {
      auto& row = p.retention[static_cast<std::size_t>(l)];
      row[0] = rng() % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
      row[static_cast<std::size_t>(ActivationClass::expert_intermediate)] =
          rng() % 2 ? RetentionDecision::offload() : RetentionDecision::recompute(l);
    }
    CAPTURE(i);
    // A ring is asked for (the default): clipping stages per parameter instead.
    const Run got = run_steps(spec, p, 3, false, 3, true, clip);
    CHECK(got.grad_norms == expect.grad_norms);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
  }
}

TEST_CASE("experts no token reaches: left unwritten and stepped with zeros, bit for bit the zeroing step") {
  // 2 tokens routed top-2 reach at most 4 of the 8 experts of each layer: the others' gradients
  // are left unwritten (CudaCausalLmOptions::leave_unrouted_expert_grads) and their AdamW steps
  // take zeros unread. Against zeroing them (and reading the zeros): the same losses, weights and
  // moments after 3 steps, with and without clipping (a zero gradient's sum of squares 0), and with
  // the experts streamed (their gradients then always zeroed on the host path).
  const auto spec = small_spec();
  constexpr std::uint64_t few = 2;
  const Plan p = resident_plan(spec, few);
  const unsigned ring = CudaCausalLmOptions{}.grad_staging_layers;
  const bool keep = CudaCausalLmOptions{}.keep_attention_state;
  for (const double clip : {0.0, 0.05}) {
    CAPTURE(clip);
    const unsigned staging = clip > 0 ? 0 : ring;  // clipping stages per parameter
    const Run zeroed = run_steps(spec, p, 3, false, staging, keep, clip, false, few);
    const Run left = run_steps(spec, p, 3, false, staging, keep, clip, true, few);
    CHECK(left.losses == zeroed.losses);
    CHECK(left.grad_norms == zeroed.grad_norms);
    CHECK(same(left.state, zeroed.state));
    // Every segment moved (weight decay and the moments move an unrouted expert too).
    const auto start = init(spec);
    for (std::size_t i = 0; i < start.size(); ++i) CHECK(left.state[i].master != start[i]);
    Plan streamed = p;
    streamed.resident_segments.clear();
    const Run s = run_steps(spec, streamed, 3, false, staging, keep, clip, true, few);
    CHECK(s.losses == zeroed.losses);
    CHECK(same(s.state, zeroed.state));
  }
}

TEST_CASE("the resident updates beside the backward: the step of updates on the compute stream, bit for bit") {
  // CudaCausalLmOptions::overlap_updates runs each layer's resident AdamW on a lower-priority
  // stream once that layer's backward has ended, while the next layers' backward runs. Against
  // every update on the compute stream: the same losses, weights and moments after 3 steps, all
  // resident and with layer 0 streamed (its CPU update unchanged, the ends resident).
  const auto spec = small_spec();
  const Plan p = resident_plan(spec);
  const unsigned ring = CudaCausalLmOptions{}.grad_staging_layers;
  const bool keep = CudaCausalLmOptions{}.keep_attention_state;
  const bool leave = CudaCausalLmOptions{}.leave_unrouted_expert_grads;
  Plan half = p;
  half.resident_segments.clear();
  for (const auto& seg : spec.segments())
    if (seg.layer != 0) half.resident_segments.push_back(seg.name);  // layer 0 streamed
  REQUIRE(half.resident_segments.size() < p.resident_segments.size());
  for (const Plan* plan : {&p, static_cast<const Plan*>(&half)}) {
    const Run serial = run_steps(spec, *plan, 3, false, ring, keep, 0, leave, T, false);
    const Run beside = run_steps(spec, *plan, 3, false, ring, keep, 0, leave, T, true);
    CHECK(beside.losses == serial.losses);
    CHECK(same(beside.state, serial.state));
    const auto start = init(spec);
    for (std::size_t i = 0; i < start.size(); ++i) CHECK(beside.state[i].master != start[i]);
  }
}

TEST_CASE("a plan with MoE token chunks: its own step under any retention, close to the whole plan's") {
  const auto spec = small_spec();
  const Plan whole = resident_plan(spec);
  Plan chunked = whole;
  for (auto& c : chunked.chunks) c.moe_tokens = 50;  // 157 tokens: chunks of 50, 50, 50 and 7
  const Run expect = run_steps(spec, chunked);
  CHECK(same(run_steps(spec, chunked).state, expect.state));  // deterministic run to run
  // Streamed, offloaded and recomputed with the same chunks: bit for bit (the backward's per-chunk
  // recomputation repeats the forward's launches).
  Plan streamed = chunked;
  streamed.resident_segments.clear();
  streamed.prefetch_depth = 1;
  streamed.retention[0][0] = RetentionDecision::offload();
  streamed.retention[1][static_cast<std::size_t>(ActivationClass::expert_intermediate)] = RetentionDecision::offload();
  streamed.retention[2][static_cast<std::size_t>(ActivationClass::expert_intermediate)] = RetentionDecision::recompute(2);
  const Run got = run_steps(spec, streamed);
  CHECK(got.losses == expect.losses);
  CHECK(same(got.state, expect.state));

  // Against the whole plan. The layer's outputs and gradients agree within 1e-3 relative L2
  // (tests/model/test_cuda_decoder_layer.cpp), so the loss, a mean over tokens of smooth functions
  // of the last layer's output, within 1e-3 relative. AdamW's first steps move each weight by about
  // lr * sign(gradient), so the rare elements whose gradient is within the noise of 0 (a fraction
  // of order 1e-3) move by up to 2 lr = 6e-3 differently against weights of about 0.05 (1 for
  // the norms): a relative L2 over all master weights of order 0.05^-1 * 6e-3 * sqrt(1e-3) = 4e-3;
  // bound 1e-2.
  const Run ref = run_steps(spec, whole);
  for (std::size_t s = 0; s < ref.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(expect.losses[s] - ref.losses[s]) <= 1e-3 * std::abs(ref.losses[s]));
  }
  const double rel = master_rel_l2(expect.state, ref.state);
  MESSAGE("chunked vs whole plan: losses " << expect.losses[2] << " / " << ref.losses[2] << ", master weights rel. L2 " << rel);
  CHECK(rel <= 1e-2);
}

TEST_CASE("dropping the wait for a layer's weights on the GPU is caught") {
  const auto spec = small_spec();
  Plan p = resident_plan(spec);
  const Run expect = run_steps(spec, p, 2);
  p.resident_segments.clear();
  p.prefetch_depth = 1;
  CHECK(same(run_steps(spec, p, 2).state, expect.state));
  CHECK_FALSE(same(run_steps(spec, p, 2, /*drop_wait=*/true).state, expect.state));
}

TEST_CASE("exported state resumes the same run on the GPU") {
  const auto spec = small_spec();
  Plan p = resident_plan(spec);
  p.resident_segments.resize(p.resident_segments.size() / 2);
  const Run straight = run_steps(spec, p, 4);
  CudaCausalLmOptions opt;
  opt.adamw.lr = 3e-3f;
  std::vector<SegmentOptimizerState> saved;
  std::mt19937_64 rng(7);
  std::vector<std::vector<std::uint32_t>> ins, tgts;
  for (int s = 0; s < 4; ++s) {
    std::vector<std::uint32_t> in(T), tgt(T);
    for (auto& v : in) v = static_cast<std::uint32_t>(rng() % 300);
    for (std::uint64_t i = 0; i < T; ++i) tgt[i] = (in[i] * 7 + 3) % 300;
    ins.push_back(in);
    tgts.push_back(tgt);
  }
  {
    CudaCausalLm lm(spec, p, init(spec), opt);
    for (int s = 0; s < 2; ++s) CHECK(lm.step(ins[static_cast<std::size_t>(s)], tgts[static_cast<std::size_t>(s)]).loss == straight.losses[static_cast<std::size_t>(s)]);
    saved = lm.state();
    // The views a checkpoint writes from: no copy; resident segments read from the GPU a range at a
    // time, streamed ones viewed in the pinned state, the same bits at any range either way.
    const StateSnapshot snap = lm.state_views();
    CHECK(snap.owned.empty());
    REQUIRE(snap.views.size() == saved.size());
    std::size_t read_from_gpu = 0;
    for (std::size_t s = 0; s < saved.size(); ++s) {
      CAPTURE(s);
      read_from_gpu += snap.views[s].read ? 1 : 0;
      check_view_range(snap.views[s], saved[s]);
    }
    // The executor makes more segments resident than planned where the GPU has room (fit's fill).
    CHECK(read_from_gpu >= p.resident_segments.size());
    CHECK(read_from_gpu < saved.size());  // and some are streamed: both kinds of view were read
  }
  CudaCausalLm resumed(spec, p, init(spec), opt);
  resumed.load(saved, 2);
  for (int s = 2; s < 4; ++s) CHECK(resumed.step(ins[static_cast<std::size_t>(s)], tgts[static_cast<std::size_t>(s)]).loss == straight.losses[static_cast<std::size_t>(s)]);
  CHECK(same(resumed.state(), straight.state));
}

TEST_CASE("a recorded GPU step: spans per resource, serial within each, inside the step") {
  const auto spec = small_spec();
  Plan p = resident_plan(spec);
  p.resident_segments.clear();
  p.retention[1][0] = RetentionDecision::offload();
  p.retention[2][static_cast<std::size_t>(ActivationClass::expert_intermediate)] = RetentionDecision::recompute(2);
  CudaCausalLm lm(spec, p, init(spec), CudaCausalLmOptions{});
  Timeline tl;
  record_second_step(lm, tl);
  const auto spans = tl.spans();
  auto count = [&](const std::string& prefix, Resource r) {
    return std::count_if(spans.begin(), spans.end(), [&](const TimelineSpan& s) { return s.resource == r && s.name.starts_with(prefix); });
  };
  CHECK(count("fwd layers.", Resource::gpu_compute) == 3);
  CHECK(count("bwd layers.", Resource::gpu_compute) == 3);
  // Layer 2 keeps its attention state (the plan recomputes only the expert intermediates): the
  // backward reruns it around that state (the default, keep_attention_state).
  CHECK(count("recompute (attention kept) layers.2", Resource::gpu_compute) == 1);
  CHECK(count("h2d weights", Resource::h2d) == 6);
  CHECK(count("d2h grads", Resource::d2h) == 3);
  CHECK(count("adamw layers.", Resource::cpu) == 3);
  CHECK(count("d2h activations layers.1", Resource::d2h) == 1);
  for (const auto& s : spans) {
    CHECK(s.begin_s >= 0);
    CHECK(s.end_s >= s.begin_s);
  }
  // Each layer call split at its halves (DecoderLayerContext::halves), under the planner's op names.
  for (int l = 0; l < 3; ++l) {
    const std::string layer = "layers." + std::to_string(l);
    check_halves(spans, "fwd " + layer, "fwd.attention " + layer, "fwd.mlp " + layer);
    check_halves(spans, "bwd " + layer, "bwd.mlp " + layer, "bwd.attention " + layer);
  }
  check_halves(spans, "recompute (attention kept) layers.2", "recompute.attention layers.2", "recompute.mlp layers.2");
  CHECK(count("fwd.attention layers.", Resource::gpu_compute) == 3);
  CHECK(count("bwd.mlp layers.", Resource::gpu_compute) == 3);
  CHECK(count("recompute.mlp layers.", Resource::gpu_compute) == 1);
  CHECK(tl.busy()[Resource::gpu_compute] > 0);
  // The issuing thread's track: each layer pass issued once, and the wait for the loss.
  const auto host = tl.host_spans();
  auto host_count = [&](const std::string& prefix) {
    return std::count_if(host.begin(), host.end(), [&](const TimelineSpan& s) { return s.name.starts_with(prefix); });
  };
  CHECK(host_count("issue fwd layers.") == 3);
  CHECK(host_count("issue bwd layers.") == 3);
  CHECK(host_count("wait for the loss") == 1);
  // Each layer's forward reads them back (3) and so does layer 2's recompute (1, the experts
  // again); the backwards take the forward's (DecoderLayerContext::expert_counts), reading none.
  CHECK(host_count("wait for expert counts") == 4);
  // Each layer's expert GEMMs, with how they were issued (recomputed layers issue the forward's again).
  for (const char* op : {"gate_up", "down", "down backward", "gate_up backward"})
    CHECK(host_count(std::string("issue expert ") + op + " GEMMs: ") >= 3);
  CHECK(host_count("row GEMMs: ") >= 12);
  for (const auto& s : host) {
    CHECK(s.begin_s >= 0);
    CHECK(s.end_s >= s.begin_s);
  }
}

TEST_CASE("a recorded hybrid step: Gated DeltaNet and attention layers split at their halves, a whole recompute too") {
  // Layers 0 and 2 (Gated DeltaNet) recomputed whole, layer 2 with its MoE in token chunks (its
  // recompute stops after the router); layer 1 (gated attention) kept.
  const auto spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/tests/data/gpu-qwen3-next-layers.json");
  Plan p = resident_plan(spec);
  for (const int l : {0, 2})
    for (int c = 1; c < activation_class_count; ++c) p.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(c)] = RetentionDecision::recompute(l);
  p.chunks[2].moe_tokens = 50;
  CudaCausalLm lm(spec, p, init(spec), CudaCausalLmOptions{});
  Timeline tl;
  record_second_step(lm, tl);
  const auto spans = tl.spans();
  for (int l = 0; l < 3; ++l) {
    const std::string layer = "layers." + std::to_string(l);
    check_halves(spans, "fwd " + layer, "fwd.attention " + layer, "fwd.mlp " + layer);
    check_halves(spans, "bwd " + layer, "bwd.mlp " + layer, "bwd.attention " + layer);
  }
  check_halves(spans, "recompute layers.0", "recompute.attention layers.0", "recompute.mlp layers.0");
  check_halves(spans, "recompute layers.2", "recompute.attention layers.2", "recompute.mlp layers.2");
  // The next step, unrecorded, runs as before (nothing left behind by the recording).
  const std::vector<std::uint32_t> in(T, 5), tgt(T, 7);
  const auto loss = lm.step(in, tgt).loss;
  CHECK(std::isfinite(loss));
}

// The smallest run that still goes through every path of the executor (streamed and resident
// segments, offloaded boundary and saved buffer, a recompute, CPU and GPU AdamW): what the
// compute-sanitizer runs in scripts/gpu-check.sh use, since racecheck is slow.
TEST_CASE("one streamed step with offload and recompute") {
  const auto spec = small_spec();
  Plan p = resident_plan(spec);
  p.resident_segments = {spec.segments()[1].name, spec.segments()[3].name};  // one attention, one router
  p.prefetch_depth = 1;
  p.retention[0][0] = RetentionDecision::offload();
  p.retention[1][static_cast<std::size_t>(ActivationClass::router_output)] = RetentionDecision::offload();
  p.retention[2][static_cast<std::size_t>(ActivationClass::expert_intermediate)] = RetentionDecision::recompute(2);
  const Run one = run_steps(spec, p, 1);
  const Run reference = run_steps(spec, resident_plan(spec), 1);
  CHECK(one.losses == reference.losses);
  CHECK(same(one.state, reference.state));
}

TEST_CASE("a gradient staging ring gives the same step, bit for bit, in less pinned memory") {
  // Every segment streamed: each layer's gradients go home through the ring; a ring of 1 makes
  // every layer's D2H wait for the previous layer's CPU update (the tightest reuse).
  const auto spec = small_spec();
  const Plan reference = resident_plan(spec);
  const Run expect = run_steps(spec, reference);
  Plan streamed = reference;
  streamed.resident_segments.clear();
  const Run whole = run_steps(spec, streamed, 3, false, /*grad_staging_layers=*/0);
  CHECK(whole.losses == expect.losses);
  for (unsigned n : {1u, 2u, 3u, 5u}) {
    CAPTURE(n);
    const Run ring = run_steps(spec, streamed, 3, false, n);
    CHECK(ring.losses == expect.losses);
    CHECK(same(ring.state, expect.state));
    if (n < static_cast<unsigned>(spec.num_layers())) CHECK(ring.staging < whole.staging);
    CHECK(ring.staging == CudaCausalLm::footprint(spec, streamed, staging_ring(n))
                              [static_cast<std::size_t>(Claimant::host_staging)]);
  }
}

TEST_CASE("recomputing around kept or offloaded attention state gives the same step, bit for bit") {
  // Plans that recompute a layer's MoE classes but keep or offload its attention output and LSE:
  // with keep_attention_state the backward reruns the layer without the attention kernel, from
  // the kept state; every kernel being deterministic, the step is the resident plan's.
  const auto spec = small_spec();
  const Plan reference = resident_plan(spec);
  const Run expect = run_steps(spec, reference);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 4; ++i) {
    Plan p = reference;
    p.resident_segments.clear();
    for (const auto& s : spec.segments())
      if (rng() % 2) p.resident_segments.push_back(s.name);
    for (int l = 0; l < spec.num_layers(); ++l) {
      auto& row = p.retention[static_cast<std::size_t>(l)];
      row[0] = rng() % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
      const auto attn = (i + l) % 2 ? RetentionDecision::keep() : RetentionDecision::offload();
      row[static_cast<std::size_t>(ActivationClass::attention_output)] = attn;
      row[static_cast<std::size_t>(ActivationClass::softmax_stats)] = attn;
      for (auto c : {ActivationClass::norm_output, ActivationClass::router_output, ActivationClass::permuted_tokens,
                     ActivationClass::expert_intermediate})
        row[static_cast<std::size_t>(c)] = RetentionDecision::recompute(l);
    }
    // Neighbours of other kinds: with layer 1 keeping its saved buffer, layers 0 and 2 take
    // rotating buffers 0 and 1 in the forward but both take 0 in the backward (layer % 2), so a
    // refill lands in a buffer another layer's forward (or whole offload, i = 2) last used.
    if (i == 1 || i == 2) p.retention[1] = reference.retention[1];
    if (i == 2)
      for (int c = 1; c < activation_class_count; ++c) p.retention[0][static_cast<std::size_t>(c)] = RetentionDecision::offload();
    if (i == 3)
      for (auto& c : p.chunks) c.moe_tokens = 50;  // chunked MoE too (its own reference below)
    CAPTURE(i);
    const Run got = run_steps(spec, p, 3, false, 0, /*keep_attention_state=*/true);
    const Run whole_recompute = run_steps(spec, p, 3, false, 0, /*keep_attention_state=*/false);
    CHECK(got.losses == whole_recompute.losses);
    CHECK(same(got.state, whole_recompute.state));
    if (i < 3) {
      CHECK(got.losses == expect.losses);
      CHECK(same(got.state, expect.state));
    }
    // It keeps the attention state on the GPU (or pinned) where the whole recompute kept nothing.
    const auto kept = CudaCausalLm::footprint(spec, p, attention_state(true));
    const auto rerun = CudaCausalLm::footprint(spec, p, attention_state(false));
    const auto act = static_cast<std::size_t>(Claimant::retained_activations);
    const auto off = static_cast<std::size_t>(Claimant::host_offload);
    CHECK(kept[act] + kept[off] > rerun[act] + rerun[off]);
  }
}

TEST_CASE("gradient accumulation over micro-batches: every plan gives the resident plan's step, bit for bit") {
  const auto spec = small_spec();
  Plan reference = resident_plan(spec);
  reference.micro_batches = 3;
  const Run expect = run_steps(spec, reference);
  MESSAGE("resident plan, 3 micro-batches: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
  CHECK(same(run_steps(spec, reference).state, expect.state));  // deterministic run to run
  // The other micro-batches count: one micro-batch of the same first windows is another step.
  Plan one = reference;
  one.micro_batches = 1;
  CHECK(run_steps(spec, one).losses[0] != expect.losses[0]);

  const Run clipped_resident = run_steps(spec, reference, 3, false, 3, true, /*max_grad_norm=*/0.05);
  CHECK(clipped_resident.grad_norms[0] > 0.05);  // the clip acts
  std::mt19937_64 rng(43);
  for (int i = 0; i < 5; ++i) {
    const Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
    CAPTURE(i);
    const Run got = run_steps(spec, p);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
    // Clipped: the same norms and step as the resident plan's, bit for bit.
    const Run clipped = run_steps(spec, p, 3, false, 3, true, /*max_grad_norm=*/0.05);
    CHECK(clipped.grad_norms == clipped_resident.grad_norms);
    CHECK(same(clipped.state, clipped_resident.state));
    if (i == 0) {
      // The gradients accumulate in their staging: one pinned buffer per streamed parameter, with a
      // ring of 2 asked for or not; with one micro-batch the same ring stages less.
      const Run ring = run_steps(spec, p, 3, false, /*grad_staging_layers=*/2);
      CHECK(ring.staging == run_steps(spec, p, 3, false, 0).staging);
      CHECK(run_steps(spec, single(p), 1, false, 2).staging < run_steps(spec, single(p), 1, false, 0).staging);
      CHECK(same(ring.state, expect.state));
      // The host not waiting for each window's loss, and the resident updates on the compute
      // stream: the same step.
      const bool keep = CudaCausalLmOptions{}.keep_attention_state, leave = CudaCausalLmOptions{}.leave_unrouted_expert_grads;
      const Run unsynced = run_steps(spec, p, 3, false, 3, keep, 0, leave, T, /*overlap_updates=*/false, false, /*skip_nonfinite_loss=*/false);
      CHECK(unsynced.losses == expect.losses);
      CHECK(same(unsynced.state, expect.state));
    }
  }
}

TEST_CASE("the load-balancing loss (output_router_logits): every plan the resident plan's step, bit for bit; the loss adds it") {
  // Coefficient 0.5 (transformers' defaults are 1e-3 to 2e-2: large here so that it moves the step).
  // Two micro-batches: each its own loss over its L x T rows, carrying 1/2.
  const auto spec = test::small_qwen3_moe(3, 0.5);
  Plan reference = resident_plan(spec);
  reference.micro_batches = 2;
  const Run expect = run_steps(spec, reference);
  MESSAGE("load-balancing loss 0.5, 2 micro-batches: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]);
  CHECK(same(run_steps(spec, reference).state, expect.state));  // deterministic run to run

  // The first step's loss is the cross-entropy's (the same forward) plus coefficient x aux, linear
  // in the coefficient. aux = E sum_e f_e p_e (sum_e f_e = k, sum_e p_e = 1) is at most E k, and
  // k = 2 for balanced routing, which these random initial weights about give: more than 1.
  const Run plain = run_steps(test::small_qwen3_moe(3), reference, 1);
  const Run twice = run_steps(test::small_qwen3_moe(3, 1.0), reference, 1);
  const double aux = (expect.losses[0] - plain.losses[0]) / 0.5;
  MESSAGE("aux at the first step " << aux << " (uniform routing: k = 2)");
  CHECK(aux > 1.0);
  CHECK(aux <= 8.0 * 2);
  CHECK((twice.losses[0] - plain.losses[0]) == doctest::Approx(2 * (expect.losses[0] - plain.losses[0])).epsilon(1e-9));
  // Its gradient moves the routers, so the next steps differ from the plain loss's by more than it.
  CHECK_FALSE(same(run_steps(test::small_qwen3_moe(3), reference, 1).state, run_steps(spec, reference, 1).state));

  // Streamed, offloaded, recomputed (the recompute adds no rows a second time): bit for bit.
  std::mt19937_64 rng(45);
  for (int i = 0; i < 4; ++i) {
    const Plan p = random_variant(spec, reference, rng, /*all_streamed=*/i == 0);
    CAPTURE(i);
    const Run got = run_steps(spec, p, 3, false, 0, /*keep_attention_state=*/i % 2 == 0);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
  }
  // MoE token chunks: the counts summed over the chunks give the whole layer's loss; the chunked
  // plan's own step under any retention (the chunked recompute stops after the router).
  Plan chunked = reference;
  for (auto& c : chunked.chunks) c.moe_tokens = 50;
  const Run chunked_expect = run_steps(spec, chunked);
  CHECK(std::abs(chunked_expect.losses[0] - expect.losses[0]) <= 1e-3 * std::abs(expect.losses[0]));
  Plan streamed = chunked;
  streamed.resident_segments.clear();
  streamed.prefetch_depth = 1;
  for (int l = 0; l < 3; ++l)
    streamed.retention[static_cast<std::size_t>(l)][static_cast<std::size_t>(ActivationClass::expert_intermediate)] =
        RetentionDecision::recompute(l);
  const Run got = run_steps(spec, streamed);
  CHECK(got.losses == chunked_expect.losses);
  CHECK(same(got.state, chunked_expect.state));
}

TEST_CASE("the load-balancing loss on the GPU: the host backend's loss term and router gradients, within bf16's noise") {
  // One step of 2 micro-batches from the same weights and tokens on both backends, with the loss
  // at 0.5 and without. Its term in the loss (the difference of the two losses: the forwards are
  // the same) and its router gradients (the difference of the routers' exp_avg, which after one
  // AdamW step from zero moments is (1 - beta1) g) against the host backend's fp32 RouterBalanceLoss.
  // A gradient scaled wrongly (1/L for 1/L^2, the layer's own counts for the micro-batch's, no 1/K)
  // is 2x or 3x off; bf16 activations and a near-tie routed the other way move it by ~1e-2.
  const auto with = test::small_qwen3_moe(3, 0.5), without = test::small_qwen3_moe(3);
  Plan plan = resident_plan(with);
  plan.micro_batches = 2;
  std::mt19937_64 rng(7);
  std::vector<std::uint32_t> in(2 * T), tgt(2 * T);
  for (auto& v : in) v = static_cast<std::uint32_t>(rng() % 300);
  for (std::size_t i = 0; i < in.size(); ++i) tgt[i] = (in[i] * 7 + 3) % 300;
  struct Step {
    double loss;
    std::vector<float> router_m;  // every router's exp_avg, layer after layer
  };
  const auto routers = [&](const std::vector<SegmentOptimizerState>& state, double loss) {
    Step s{loss, {}};
    for (std::size_t i = 0; i < state.size(); ++i)
      if (with.segments()[i].role == SegmentRole::router) s.router_m.insert(s.router_m.end(), state[i].exp_avg.begin(), state[i].exp_avg.end());
    return s;
  };
  const auto on_gpu = [&](const ModelSpec& spec) {
    CudaCausalLm lm(spec, plan, init(spec), CudaCausalLmOptions{});
    const double loss = lm.step(in, tgt).loss;
    return routers(lm.state(), loss);
  };
  const auto on_host = [&](const ModelSpec& spec) {
    train::HostCausalLm lm(spec, plan, init(spec), optim::AdamWConfig{}, HostBackend::Options{4_GiB, 4_GiB, false});
    const double loss = lm.step(in, tgt).loss;
    return routers(lm.state(), loss);
  };
  const Step gpu_with = on_gpu(with), gpu_without = on_gpu(without), host_with = on_host(with), host_without = on_host(without);
  const double gpu_term = gpu_with.loss - gpu_without.loss, host_term = host_with.loss - host_without.loss;
  double num = 0, den = 0, ce = 0;
  for (std::size_t i = 0; i < host_with.router_m.size(); ++i) {
    const double h = static_cast<double>(host_with.router_m[i]) - host_without.router_m[i];
    const double g = static_cast<double>(gpu_with.router_m[i]) - gpu_without.router_m[i];
    num += (g - h) * (g - h);
    den += h * h;
    ce += static_cast<double>(host_without.router_m[i]) * host_without.router_m[i];
  }
  const double rel = std::sqrt(num / den);
  MESSAGE("loss term 0.5 x aux: GPU " << gpu_term << ", host " << host_term << "; router gradient of the term: rel. L2 " << rel
                                      << " (its norm " << std::sqrt(den / ce) << "x the cross-entropy's)");
  CHECK(host_term > 0.5);  // 0.5 x aux, aux about k = 2 at these weights
  CHECK(std::abs(gpu_term - host_term) <= 1e-2 * host_term);
  CHECK(rel <= 5e-2);
}

TEST_CASE("micro-batches: an expert one window does not reach gets that window's zeros") {
  // Windows of 2 tokens routed top-2 reach at most 4 of the 8 experts of each layer, each window
  // others. With several micro-batches the unreached experts are zeroed, not left unwritten
  // (a later window would add to what the buffer held): leave_unrouted_expert_grads on or off,
  // resident or streamed, the same step.
  const auto spec = small_spec();
  constexpr std::uint64_t few = 2;
  Plan p = resident_plan(spec, few);
  p.micro_batches = 2;
  const bool keep = CudaCausalLmOptions{}.keep_attention_state;
  const Run zeroed = run_steps(spec, p, 3, false, 3, keep, 0, /*leave_unrouted=*/false, few);
  const Run left = run_steps(spec, p, 3, false, 3, keep, 0, true, few);
  CHECK(left.losses == zeroed.losses);
  CHECK(same(left.state, zeroed.state));
  Plan streamed = p;
  streamed.resident_segments.clear();
  const Run s = run_steps(spec, streamed, 3, false, 3, keep, 0, true, few);
  CHECK(s.losses == zeroed.losses);
  CHECK(same(s.state, zeroed.state));
}

TEST_CASE("micro-batches of one window repeated: that window's loss and gradient") {
  const auto spec = small_spec();
  const Plan one = resident_plan(spec);
  Plan two = one;
  two.micro_batches = 2;
  // A clip no norm reaches, for the gradient norm.
  const Run a = run_steps(spec, one, 3, false, 3, true, /*max_grad_norm=*/1e9);
  const Run b = run_steps(spec, two, 3, false, 3, true, 1e9, true, T, true, /*repeat_window=*/true);
  MESSAGE("one window: loss " << a.losses[0] << ", gradient norm " << a.grad_norms[0] << "; twice: " << b.losses[0] << ", "
                              << b.grad_norms[0] << " (relative difference " << std::abs(b.grad_norms[0] / a.grad_norms[0] - 1) << ")");
  CHECK(b.losses[0] == a.losses[0]);  // the same forward twice: (L + L) / 2T == L / T exactly
  // Each micro-batch's gradient carries 1/(2T): the sum is the window's gradient, not twice it
  // (halving is exact, so only the order of additions into an accumulated gradient can differ).
  CHECK(b.grad_norms[0] == doctest::Approx(a.grad_norms[0]).epsilon(1e-6));
  // The steps after it, the same windows again.
  for (std::size_t s = 1; s < 3; ++s) {
    CHECK(b.losses[s] == doctest::Approx(a.losses[s]).epsilon(1e-4));
    CHECK(b.grad_norms[s] == doctest::Approx(a.grad_norms[s]).epsilon(1e-4));
  }
}

TEST_CASE("several sequences in one micro-batch: the step of those windows as micro-batches; every plan bit for bit") {
  // B sequences of S tokens in one micro-batch, against the same B windows run one after another as
  // micro-batches (the same token draws): each row's forward is that window's alone but for the GEMMs
  // seeing B S rows instead of S (cuBLAS may pick other kernels, so not bit for bit), the weight
  // gradients the same sum in another order. One sequence of B S tokens attends across: another step.
  const auto spec = small_spec();
  constexpr std::uint64_t S = 79, B = 3;  // odd, not a multiple of any tile
  Plan batched = resident_plan(spec, S * B);
  batched.workload = {B, S};
  for (auto& c : batched.chunks) c.attention = {S};  // query chunks per sequence
  Plan windows = resident_plan(spec, S);
  windows.micro_batches = static_cast<int>(B);
  const bool keep = CudaCausalLmOptions{}.keep_attention_state, leave = CudaCausalLmOptions{}.leave_unrouted_expert_grads;
  const Run expect = run_steps(spec, batched, 3, false, 3, keep, 0, leave, S * B);
  const Run apart = run_steps(spec, windows, 3, false, 3, keep, 0, leave, S);
  const Run joined = run_steps(spec, resident_plan(spec, S * B), 3, false, 3, keep, 0, leave, S * B);
  MESSAGE("3 sequences of 79: losses " << expect.losses[0] << " " << expect.losses[1] << " " << expect.losses[2]
                                       << "; as 3 micro-batches " << apart.losses[0] << " " << apart.losses[1] << " " << apart.losses[2]
                                       << "; as one sequence of 237 " << joined.losses[0] << " " << joined.losses[1] << " "
                                       << joined.losses[2]);
  // The first step's loss is the forward alone (2e-8 apart on the H200): positions that did not
  // restart in each sequence would move it by more than rounding (checked by breaking them).
  // Later steps pass through AdamW, which magnifies the gradients' rounding (6e-5 by the third).
  CHECK(expect.losses[0] == doctest::Approx(apart.losses[0]).epsilon(1e-6));
  for (std::size_t s = 0; s < 3; ++s) {
    CAPTURE(s);
    CHECK(expect.losses[s] == doctest::Approx(apart.losses[s]).epsilon(1e-3));
    // Attention across the windows, at other positions: not the batched step.
    CHECK(std::abs(joined.losses[s] - expect.losses[s]) > std::abs(apart.losses[s] - expect.losses[s]));
  }
  std::mt19937_64 rng(47);
  for (int i = 0; i < 3; ++i) {
    const Plan p = random_variant(spec, batched, rng, /*all_streamed=*/i == 0);
    CAPTURE(i);
    const Run got = run_steps(spec, p, 3, false, 3, keep, 0, leave, S * B);
    CHECK(got.losses == expect.losses);
    CHECK(same(got.state, expect.state));
  }
}

TEST_CASE("micro-batches: a step of the wrong token count is refused, naming micro-batches x tokens") {
  const auto spec = small_spec();
  Plan p = resident_plan(spec);
  p.micro_batches = 2;
  CudaCausalLm lm(spec, p, init(spec), CudaCausalLmOptions{});
  std::vector<std::uint32_t> in(T, 1), tgt(T, 2);
  CHECK_THROWS_WITH_AS(lm.step(in, tgt), doctest::Contains("2 x 157 tokens"), Error);
  CHECK(lm.optimizer_steps() == 0);
}

TEST_CASE("a NaN gradient is caught: the step throws naming where, resident or streamed, one micro-batch or two") {
  // The test hook puts a NaN into one segment's gradient in the first micro-batch; with two, it
  // stays a NaN through the second's additions (and, streamed, through the trip home and back).
  const auto spec = small_spec();
  std::string attention, expert, embedding;  // layer 0's attention segment, one of its experts, the embedding
  for (const auto& s : spec.segments()) {
    if (attention.empty() && s.role == SegmentRole::attention) attention = s.name;
    if (expert.empty() && s.role == SegmentRole::expert) expert = s.name;
    if (embedding.empty() && s.role == SegmentRole::embedding) embedding = s.name;
  }
  REQUIRE(!attention.empty());
  REQUIRE(!expert.empty());
  REQUIRE(!embedding.empty());
  std::mt19937_64 rng(11);
  const auto step_with = [&](const Plan& p, CudaCausalLmOptions opt) {
    opt.adamw.lr = 3e-3f;
    CudaCausalLm lm(spec, p, init(spec), opt);
    const std::uint64_t n = T * static_cast<std::uint64_t>(p.micro_batches);
    std::vector<std::uint32_t> in(n), tgt(n);
    for (std::uint64_t i = 0; i < n; ++i) in[i] = static_cast<std::uint32_t>(rng() % 300), tgt[i] = (in[i] * 7 + 3) % 300;
    return lm.step(in, tgt);
  };
  for (const int k : {1, 2}) {
    for (const bool streamed : {false, true}) {
      for (const std::string& poisoned : {attention, expert, embedding}) {
        Plan p = resident_plan(spec);
        p.micro_batches = k;
        if (streamed) p.resident_segments.clear();  // (the embedding stays resident)
        CudaCausalLmOptions opt;
        opt.leave_unrouted_expert_grads = false;  // (an expert no token reached passes no gradient to poison)
        opt.poison_gradient = poisoned;
        CAPTURE(k);
        CAPTURE(streamed);
        CAPTURE(poisoned);
        const std::string want = streamed && poisoned != embedding ? "in the streamed segments of layers.0"
                                                                   : "in segment '" + poisoned + "'";
        CHECK_THROWS_WITH_AS(step_with(p, opt), doctest::Contains(("non-finite gradient (NaN or infinite) " + want).c_str()), Error);
        if (!streamed) {  // the resident updates on the compute stream instead of beside the backward
          opt.overlap_updates = false;
          CHECK_THROWS_WITH_AS(step_with(p, opt), doctest::Contains(want.c_str()), Error);
          opt.overlap_updates = true;
        }
        // The check is what catches it: without it the step ends with a finite loss.
        opt.check_gradients = false;
        CHECK(std::isfinite(step_with(p, opt).loss));
        // Clipped, the norm refuses it before any update.
        opt.check_gradients = true;
        opt.max_grad_norm = 1.0;
        CHECK_THROWS_WITH_AS(step_with(p, opt), doctest::Contains("sum of squares"), Error);
      }
    }
  }
}
