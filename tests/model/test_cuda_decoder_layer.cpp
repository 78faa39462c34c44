// GPU test of the CUDA decoder layer's MoE token chunks (oom/model/cuda_decoder_layer.hpp): on a
// small Qwen3-MoE layer (T = 1000, H 256, 4/2 heads of 128, 8 experts top-2, I 128) with random
// weights and inputs, forward y, dx and every parameter gradient with moe_chunk_tokens in
// {333, 1} match the whole layer's within the tolerances below; chunks of 1000 and 4096 (>= T)
// are the whole layer bit for bit; a chunked layer is bit-identical run to run, and routes
// exactly as the whole one (the router runs over all T either way). y and dx are poisoned (NaN)
// before each run, `saved` and the workspace too, so a row no chunk wrote fails. (The byte
// counts and the refusal of a negative chunk need no GPU: tests/cuda/test_footprint.cpp.)
//
// Run: build-gpu/tests/test_cuda_decoder_layer (or -tc="*chunk*").
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/model/cuda_decoder_layer.hpp"
#include "oom/model/model_spec.hpp"
#include "support/compare.hpp"
#include "support/small_moe.hpp"

using namespace oom;
using oom::test::Blas;
using oom::test::DeviceBuffer;
using oom::test::Stream;
using oom::test::rel_l2;
using oom::test::to_bf16s;
using oom::test::to_floats;

namespace {

// Tolerances (relative L2 against the whole layer). A chunked layer runs the same launches on the
// same inputs except the expert GEMMs, which see other row counts per expert (cuBLAS may pick other
// kernels, so other fp32 summation orders) and whose weight gradients are summed chunk by chunk
// (fp32, beta = 1) instead of in one GEMM. The fp32 sums then differ by a few 2^-24 relative;
// that flips the bf16 rounding (a step of at most 2^-7 relative) of only the elements sitting
// within that distance of a rounding boundary, a small fraction f of them. A relative L2 of
// 2^-7 * sqrt(f) stays below 1e-3 while f < 0.6%, which bounds y and dx (bf16 outputs, each
// element a few such roundings deep). The parameter gradients are fp32 sums over all T of products
// of those bf16 activations and gradients, so the same flips, averaged over T, bound them: 1e-3
// as well. The routing is computed by identical launches in every case: equal bit for bit.
constexpr double y_rel_l2 = 1e-3;
constexpr double dx_rel_l2 = 1e-3;
constexpr double grad_rel_l2 = 1e-3;

constexpr std::int64_t T = 1000;

ModelSpec layer_spec() { return test::small_qwen3_moe(1); }

/// Layer 0 of layer_spec() on the device: weights (bf16) and gradients (fp32) in one block per
/// segment, bound as the executor binds them; inputs x, dy and positions for `tokens` tokens.
struct Fixture {
  std::int64_t tokens;
  ModelSpec spec = layer_spec();
  model::DecoderLayerShape shape = model::DecoderLayerShape::from_spec(spec, 0, tokens);
  std::vector<DeviceBuffer<bf16>> weights;
  std::vector<DeviceBuffer<float>> grads;
  model::DecoderLayerParams params;
  model::DecoderLayerGrads grad_ptrs;
  DeviceBuffer<bf16> x, dy, y, dx;
  DeviceBuffer<std::int32_t> positions;
  Blas blas;
  Stream stream;
  kernels::ExpertGemmStreams expert_streams;
  std::int64_t attention_chunk = 0;  ///< DecoderLayerShape::attention_chunk_tokens of every run

  explicit Fixture(std::int64_t tokens_ = T) : tokens(tokens_) {
    std::mt19937_64 rng(11);
    std::normal_distribution<float> d(0.0f, 0.05f);
    std::vector<const bf16*> wb;
    std::vector<float*> gb;
    for (const StateSegment& seg : spec.layer_segments(0)) {
      std::vector<float> w;
      for (const TensorSpec& t : seg.tensors)
        for (std::uint64_t i = 0; i < t.elements(); ++i) w.push_back(t.name.ends_with("norm.weight") ? 1.0f + d(rng) : d(rng));
      weights.emplace_back(to_bf16s(w));
      grads.emplace_back(w.size());
      wb.push_back(weights.back().get());
      gb.push_back(grads.back().get());
    }
    params = model::bind_decoder_layer_params(spec, 0, wb);
    grad_ptrs = model::bind_decoder_layer_grads(spec, 0, gb);
    const auto n = static_cast<std::size_t>(tokens * shape.hidden);
    x = DeviceBuffer<bf16>(to_bf16s(test::random_normal(n, 21)));
    dy = DeviceBuffer<bf16>(to_bf16s(test::random_normal(n, 22)));
    y = DeviceBuffer<bf16>(n);
    dx = DeviceBuffer<bf16>(n);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) pos[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t);
    positions = DeviceBuffer<std::int32_t>(pos);
  }
};

struct Result {
  std::vector<float> y, dx;
  std::vector<std::int32_t> expert_ids;
  std::vector<float> routing_weights;
  std::vector<std::vector<float>> grads;  ///< per segment, fp32, TensorSpec order
};

/// What run() may also do with the expert counts: keep them from the forward for the backward
/// (DecoderLayerContext::expert_counts), call `between` after the forward (to spoil them), and
/// count their read-backs (the "wait for expert counts" host spans) over the forward and backward.
struct CountsOptions {
  std::vector<std::int32_t>* kept = nullptr;
  std::function<void()> between;
  int* read_backs = nullptr;
};

/// Records the expert launchers' host spans into `spans` while alive.
struct RecordHostSpans {
  explicit RecordHostSpans(std::vector<kernels::HostSpan>* spans) { kernels::record_host_spans(spans); }
  ~RecordHostSpans() { kernels::record_host_spans(nullptr); }
  RecordHostSpans(const RecordHostSpans&) = delete;
  RecordHostSpans& operator=(const RecordHostSpans&) = delete;
};

/// One forward and backward with MoE chunks of `chunk` tokens, from zeroed gradients and poisoned
/// outputs, `saved` and workspace; with `overwrite_experts`, the routed experts' gradients start
/// poisoned instead (DecoderLayerGrads::overwrite_experts: never read), and `unrouted`, if given,
/// receives DecoderLayerGrads::unrouted_experts.
Result run(Fixture& f, std::int64_t chunk, bool overwrite_experts = false, std::vector<std::uint8_t>* unrouted = nullptr,
           const CountsOptions& counts = {}) {
  model::DecoderLayerShape shape = f.shape;
  shape.moe_chunk_tokens = chunk;
  shape.attention_chunk_tokens = f.attention_chunk;
  const std::size_t saved_bytes = model::decoder_layer_saved_bytes(shape);
  const std::size_t ws_bytes = model::decoder_layer_workspace_bytes(shape, f.expert_streams);
  DeviceBuffer<std::byte> saved(saved_bytes), workspace(ws_bytes);  // poisoned
  f.y.poison();
  f.dx.poison();
  const auto segs = f.spec.layer_segments(0);
  for (std::size_t i = 0; i < f.grads.size(); ++i) {
    if (overwrite_experts && segs[i].role == SegmentRole::expert)
      f.grads[i].poison();
    else
      f.grads[i].zero();
  }
  model::DecoderLayerGrads grads = f.grad_ptrs;
  grads.overwrite_experts = overwrite_experts;
  grads.unrouted_experts = unrouted;
  const model::DecoderLayerContext ctx{f.stream.s, f.blas.get(), &f.expert_streams, counts.kept};
  std::vector<kernels::HostSpan> spans;
  {
    const RecordHostSpans recording(&spans);
    model::decoder_layer_forward(ctx, shape, f.params, f.positions.get(), f.x.get(), f.y.get(), saved.get(), saved_bytes,
                                 workspace.get(), ws_bytes);
    if (counts.between) counts.between();
    model::decoder_layer_backward(ctx, shape, f.params, f.positions.get(), f.x.get(), f.dy.get(), saved.get(),
                                  saved_bytes, f.dx.get(), grads, workspace.get(), ws_bytes);
  }
  if (counts.read_backs != nullptr)
    *counts.read_backs = static_cast<int>(
        std::count_if(spans.begin(), spans.end(), [](const kernels::HostSpan& h) { return h.what == "wait for expert counts"; }));
  OOM_CUDA_CHECK(cudaStreamSynchronize(f.stream.s));
  Result r;
  r.y = to_floats(f.y.download());
  r.dx = to_floats(f.dx.download());
  const auto routing = model::decoder_layer_routing(shape, saved.get());
  const auto tk = static_cast<std::size_t>(f.tokens * shape.top_k);
  r.expert_ids.resize(tk);
  r.routing_weights.resize(tk);
  OOM_CUDA_CHECK(cudaMemcpy(r.expert_ids.data(), routing.expert_ids, tk * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  OOM_CUDA_CHECK(cudaMemcpy(r.routing_weights.data(), routing.weights, tk * sizeof(float), cudaMemcpyDeviceToHost));
  for (const auto& g : f.grads) r.grads.push_back(g.download());
  return r;
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

template <class V>
bool same_bits(const V& a, const V& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

bool same_bits(const Result& a, const Result& b) {
  if (!same_bits(a.y, b.y) || !same_bits(a.dx, b.dx) || a.grads.size() != b.grads.size()) return false;
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    if (!same_bits(a.grads[i], b.grads[i])) return false;
  return same_bits(a.expert_ids, b.expert_ids) && same_bits(a.routing_weights, b.routing_weights);
}

}  // namespace

TEST_CASE("MoE token chunks: the whole layer's results, deterministic, every row written") {
  Fixture f;
  const Result whole = run(f, 0);
  // The whole run itself wrote every row and moved every gradient segment.
  CHECK(all_finite(whole.y));
  CHECK(all_finite(whole.dx));
  for (const auto& g : whole.grads) {
    CHECK(all_finite(g));
    CHECK(std::any_of(g.begin(), g.end(), [](float v) { return v != 0.0f; }));
  }
  CHECK(same_bits(run(f, 0), whole));  // deterministic run to run

  const auto segs = f.spec.layer_segments(0);
  for (const std::int64_t chunk : {std::int64_t{333}, std::int64_t{1}, std::int64_t{1000}, std::int64_t{4096}}) {
    CAPTURE(chunk);
    const Result got = run(f, chunk);
    if (chunk >= T) {  // one chunk of all T: the whole layer
      CHECK(same_bits(got, whole));
      continue;
    }
    CHECK(same_bits(got, run(f, chunk)));  // deterministic: the chunks run and accumulate in one order
    CHECK(same_bits(got.expert_ids, whole.expert_ids));
    CHECK(same_bits(got.routing_weights, whole.routing_weights));
    const double e_y = rel_l2(got.y, whole.y);
    const double e_dx = rel_l2(got.dx, whole.dx);
    MESSAGE("chunk " << chunk << ": y rel. L2 " << e_y << ", dx " << e_dx);
    CHECK(e_y <= y_rel_l2);
    CHECK(e_dx <= dx_rel_l2);
    for (std::size_t i = 0; i < segs.size(); ++i) {
      std::uint64_t offset = 0;
      for (const TensorSpec& t : segs[i].tensors) {
        const std::span<const float> g(got.grads[i].data() + offset, t.elements());
        const std::span<const float> w(whole.grads[i].data() + offset, t.elements());
        offset += t.elements();
        CAPTURE(t.name);
        CHECK(rel_l2(g, w) <= grad_rel_l2);
      }
    }
  }
}

TEST_CASE("attention query chunks: the whole layer's results, deterministic; one or two sequences") {
  // One sequence of 1000 and two of 500, the queries in chunks of 384 and 128 (ends on no tile of
  // the kernels: 1000 = 2 x 384 + 232), then beside MoE chunks of 333. The chunks change only
  // summation orders (dK/dV summed in fp32 over chunks and rounded once, o_proj's and q_proj's
  // weight gradients chunk by chunk, chunk-shaped GEMMs): the MoE chunks' bounds hold. (The bytes
  // they save need more query heads per key head than this layer's 4 / 2: the fp32 dK/dV sums
  // cost 8 kv-wide bytes a token of T, the chunk saves 4 q-wide a token past it;
  // test_cuda_deltanet_shape weighs them at the real models' widths.)
  for (const std::int64_t sequences : {std::int64_t{1}, std::int64_t{2}}) {
    Fixture f;
    f.shape.sequences = sequences;
    const Result whole = run(f, 0);
    for (const std::int64_t chunk : {std::int64_t{384}, std::int64_t{128}, T / sequences}) {
      for (const std::int64_t moe : {std::int64_t{0}, std::int64_t{333}}) {
        CAPTURE(sequences);
        CAPTURE(chunk);
        CAPTURE(moe);
        f.attention_chunk = chunk;
        const Result got = run(f, moe);
        if (chunk == T / sequences && moe == 0) {  // a chunk of each whole sequence: the whole layer
          CHECK(same_bits(got, whole));
          continue;
        }
        CHECK(same_bits(got, run(f, moe)));
        CHECK(same_bits(got.expert_ids, whole.expert_ids));
        const double e_y = rel_l2(got.y, whole.y), e_dx = rel_l2(got.dx, whole.dx);
        double e_grad = 0;
        for (std::size_t i = 0; i < got.grads.size(); ++i) e_grad = std::max(e_grad, rel_l2(got.grads[i], whole.grads[i]));
        MESSAGE(sequences << " sequence(s), query chunk " << chunk << ", MoE chunk " << moe << ": y rel. L2 " << e_y << ", dx "
                          << e_dx << ", worst gradient segment " << e_grad);
        CHECK(e_y <= y_rel_l2);
        CHECK(e_dx <= dx_rel_l2);
        CHECK(e_grad <= grad_rel_l2);
      }
    }
  }
}

TEST_CASE("kept expert counts: the backward reads none back, the same bits, whole and chunked; bad ones refused") {
  Fixture f;
  const std::int64_t experts = f.shape.experts, top_k = f.shape.top_k;
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{333}}) {
    CAPTURE(chunk);
    const std::int64_t chunks = chunk == 0 ? 1 : (T + chunk - 1) / chunk;
    int read_backs = -1;
    const Result read_back = run(f, chunk, false, nullptr, {.read_backs = &read_backs});
    CHECK(read_backs == 2 * chunks);  // the forward's and the backward's

    std::vector<std::int32_t> kept;
    const Result with_kept = run(f, chunk, false, nullptr, {.kept = &kept, .read_backs = &read_backs});
    CHECK(read_backs == chunks);  // the forward's only
    CHECK(same_bits(with_kept, read_back));
    REQUIRE(kept.size() == static_cast<std::size_t>(chunks * experts));
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t n = chunk == 0 ? T : std::min(chunk, T - c * chunk);
      CHECK(std::accumulate(kept.begin() + c * experts, kept.begin() + (c + 1) * experts, std::int64_t{0}) == n * top_k);
    }

    // Counts of another size (another chunking's, say) are not used: read back as without them.
    const Result other_size =
        run(f, chunk, false, nullptr, {.kept = &kept, .between = [&] { kept.push_back(0); }, .read_backs = &read_backs});
    CHECK(read_backs == 2 * chunks);
    CHECK(same_bits(other_size, read_back));

    // Counts that do not sum to their chunk's rows are refused, the last chunk's too, before the
    // backward launches anything: the gradients stay as they were (zeros; run() zeroes them).
    for (const std::int64_t spoiled : {std::int64_t{0}, chunks - 1}) {
      CAPTURE(spoiled);
      try {
        run(f, chunk, false, nullptr, {.kept = &kept, .between = [&] { kept[spoiled * experts + 1] += 1; }});
        FAIL("spoiled expert counts were used");
      } catch (const Error& e) {
        CHECK(e.code() == Errc::invalid_argument);
        CHECK(e.message().find("DecoderLayerContext::expert_counts, chunk " + std::to_string(spoiled)) != std::string::npos);
      }
      OOM_CUDA_CHECK(cudaStreamSynchronize(f.stream.s));
      for (const auto& g : f.grads) {
        const std::vector<float> h = g.download();
        CHECK(std::all_of(h.begin(), h.end(), [](float v) { return v == 0.0f; }));
      }
    }

    // A forward that fails leaves no counts behind to be taken for another forward's.
    kept.assign(static_cast<std::size_t>(chunks * experts), 1);
    model::DecoderLayerShape bad = f.shape;
    bad.moe_chunk_tokens = chunk;
    const model::DecoderLayerContext ctx{f.stream.s, f.blas.get(), &f.expert_streams, &kept};
    CHECK_THROWS_AS(model::decoder_layer_forward(ctx, bad, f.params, f.positions.get(), f.x.get(), f.y.get(), nullptr, 0,
                                                 nullptr, 0),
                    Error);
    CHECK(kept.empty());
  }
}

TEST_CASE("decoder_layer_recompute regenerates the saved buffer bit for bit around the kept attention state") {
  // Forward into A; B = a poisoned buffer holding only A's attention output and LSE; recompute
  // into B: B must equal A byte for byte (every kernel deterministic, the attention not rerun).
  Fixture f;
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{333}}) {
    CAPTURE(chunk);
    model::DecoderLayerShape shape = f.shape;
    shape.moe_chunk_tokens = chunk;
    const std::size_t saved_bytes = model::decoder_layer_saved_bytes(shape);
    const std::size_t ws_bytes = model::decoder_layer_workspace_bytes(shape, f.expert_streams);
    DeviceBuffer<std::byte> a(saved_bytes), b(saved_bytes), workspace(ws_bytes);  // poisoned
    const model::DecoderLayerContext ctx{f.stream.s, f.blas.get(), &f.expert_streams};
    model::decoder_layer_forward(ctx, shape, f.params, f.positions.get(), f.x.get(), f.y.get(), a.get(), saved_bytes,
                                 workspace.get(), ws_bytes);
    const auto sa = model::decoder_layer_attention_state(shape, a.get());
    const auto sb = model::decoder_layer_attention_state(shape, b.get());
    REQUIRE(sa.output_bytes == static_cast<std::size_t>(T * shape.heads_q * shape.head_dim) * sizeof(bf16));
    REQUIRE(sa.lse_bytes == static_cast<std::size_t>(T * shape.heads_q) * sizeof(float));
    OOM_CUDA_CHECK(cudaMemcpyAsync(sb.output, sa.output, sa.output_bytes, cudaMemcpyDeviceToDevice, f.stream.s));
    OOM_CUDA_CHECK(cudaMemcpyAsync(sb.lse, sa.lse, sa.lse_bytes, cudaMemcpyDeviceToDevice, f.stream.s));
    OOM_CUDA_CHECK(cudaStreamSynchronize(f.stream.s));  // the poisoning below runs on the legacy stream
    workspace.poison();
    f.y.poison();
    model::decoder_layer_recompute(ctx, shape, f.params, f.positions.get(), f.x.get(), f.y.get(), b.get(), saved_bytes,
                                   workspace.get(), ws_bytes, /*attention_state_kept=*/true);
    OOM_CUDA_CHECK(cudaStreamSynchronize(f.stream.s));
    const auto ha = a.download(), hb = b.download();
    // Bytes between the carved tensors are padding nobody writes: compare the tensors' bytes only,
    // which is every byte but the 256-byte alignment gaps; the poison pattern stays there in both.
    std::size_t differ = 0;
    for (std::size_t i = 0; i < ha.size(); ++i) differ += ha[i] != hb[i] ? 1 : 0;
    CHECK(differ == 0);
    // A whole MoE half writes y on the way; a chunked one stops after the router.
    const auto y = to_floats(f.y.download());
    CHECK((chunk == 0 ? all_finite(y) : std::none_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); })));
    // From the boundary (the attention state rerun too): the same bytes.
    DeviceBuffer<std::byte> c(saved_bytes);
    model::decoder_layer_recompute(ctx, shape, f.params, f.positions.get(), f.x.get(), f.y.get(), c.get(), saved_bytes,
                                   workspace.get(), ws_bytes, /*attention_state_kept=*/false);
    OOM_CUDA_CHECK(cudaStreamSynchronize(f.stream.s));
    CHECK(c.download() == ha);
  }
}

TEST_CASE("overwritten expert gradients: the accumulated ones from zero, whole and chunked, old contents never read") {
  // Overwriting equals adding onto zeros but for signed zeros and, where the grouped wgmma kernel
  // adds (its L2 reductions flush them), subnormals: compared with those equated. At these widths
  // the gate_up dW runs the grouped wgmma kernel and the down dW cuBLAS (beta 0 against 1); a
  // chunk of 1 token routes to 2 of the 8 experts, so the first chunk zeroes six idle experts.
  Fixture f;
  const auto segs = f.spec.layer_segments(0);
  const auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!(a[i] == b[i] || (std::abs(a[i]) < 0x1p-126f && std::abs(b[i]) < 0x1p-126f))) return false;
    return true;
  };
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{333}, std::int64_t{1}}) {
    CAPTURE(chunk);
    const Result added = run(f, chunk), written = run(f, chunk, true);
    CHECK(same_bits(written.y, added.y));
    CHECK(same_bits(written.dx, added.dx));
    for (std::size_t i = 0; i < segs.size(); ++i) {
      CAPTURE(segs[i].name);
      CHECK(all_finite(written.grads[i]));
      if (segs[i].role == SegmentRole::expert)
        CHECK(close(written.grads[i], added.grads[i]));
      else
        CHECK(same_bits(written.grads[i], added.grads[i]));
    }
    CHECK(same_bits(run(f, chunk, true), written));  // deterministic
  }
}

TEST_CASE("unrouted experts: their gradients left unwritten and flagged, the others as overwritten, whole and chunked") {
  // 3 tokens routed top-2 to 8 experts reach at most 6, so at least two are flagged; in chunks of
  // 1 or 2 tokens a later chunk reaches experts the first did not (their gradients zeroed, then
  // added, which must give the bits the plain overwrite gives).
  Fixture f(3);
  const auto segs = f.spec.layer_segments(0);
  const auto E = static_cast<std::size_t>(f.shape.experts);
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{2}}) {
    CAPTURE(chunk);
    const Result written = run(f, chunk, true);
    std::vector<std::uint8_t> unrouted;
    const Result left = run(f, chunk, true, &unrouted);
    REQUIRE(unrouted.size() == E);
    std::vector<std::uint8_t> reached(E, 0);
    for (const std::int32_t e : left.expert_ids) reached.at(static_cast<std::size_t>(e)) = 1;
    int flagged = 0;
    for (std::size_t e = 0; e < E; ++e) {
      CAPTURE(e);
      CHECK(unrouted[e] == (reached[e] != 0 ? 0 : 1));
      flagged += unrouted[e];
    }
    CHECK(flagged >= 2);
    CHECK(same_bits(left.y, written.y));
    CHECK(same_bits(left.dx, written.dx));
    CHECK(same_bits(left.expert_ids, written.expert_ids));
    for (std::size_t i = 0; i < segs.size(); ++i) {
      CAPTURE(segs[i].name);
      if (segs[i].role == SegmentRole::expert && unrouted.at(static_cast<std::size_t>(segs[i].expert)) != 0)
        CHECK(std::all_of(left.grads[i].begin(), left.grads[i].end(), [](float g) { return std::isnan(g); }));  // the poison, untouched
      else
        CHECK(same_bits(left.grads[i], written.grads[i]));
    }
  }
}
