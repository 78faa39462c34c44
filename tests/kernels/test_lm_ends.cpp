// GPU test of the ends of a causal LM step (oom/model/cuda_lm_ends.hpp): embedding forward and
// backward, and final norm + fused LM head cross-entropy (forward, backward, loss only), against
// CPU references built from oom/reference/{embedding,rmsnorm,lm_head_loss}.hpp. Random inputs at
// odd T (37, 300), vocabularies that are no multiple of any tile (256 is one, 1000 is not) and
// H = 64 / 256. Outputs are poisoned (all bytes 0xFF: NaN for floats, -1 for int32) before each
// run so an unwritten element fails; accumulated gradients start from random values so a missing
// or doubled accumulation fails. Workspaces are exactly lm_ends_workspace_bytes and poisoned too.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/model/cuda_lm_ends.hpp"
#include "oom/reference/embedding.hpp"
#include "oom/reference/lm_head_loss.hpp"
#include "oom/reference/rmsnorm.hpp"
#include "support/compare.hpp"

namespace ref = oom::reference;
namespace m = oom::model;
using oom::bf16;
using oom::test::Bf16Data;
using oom::test::Blas;
using oom::test::compare;
using oom::test::DeviceBuffer;
using oom::test::Stream;
using oom::test::random_normal;
using oom::test::rel_l2;
using oom::test::to_floats;

namespace {

// Tolerances. Inputs and activation outputs (x, r, dr, dy) are bf16, every accumulation is fp32
// (the reference's fp64). One bf16 rounding is <= 2^-9 relative; the GPU additionally rounds the
// d logits to bf16 before the dx / dW GEMMs, and its r or dr can sit one bf16 ulp from the
// reference's where the unrounded values straddle a rounding boundary. Those errors are
// independent from element to element, so the relative L2 error of a bf16 output is a few 2^-9
// at most: <= 1e-2 for dy (rounded once more at its output). The fp32 gradients are sums of such
// terms, not rounded to bf16 at the end: <= 5e-3 relative L2 (measured against the increment, not
// the accumulated total, so the random starting values do not hide anything). The loss is a sum
// of fp32 logsumexps over the rows (|logit| of order 1, fp64 accumulation): 1e-3 relative
// leaves room only for the bf16 ulps of r.
// A CPU emulation of the GPU's rounding points (fp32 logits, bf16 d logits, bf16 dr and dy) on
// these very cases measured relative L2 errors of 2.5-3.1e-3 (dy), 1.4-2.3e-3 (grad_final_norm),
// 0.9-1.5e-3 (grad_head) and a loss error below 2e-8, so the bounds leave a margin of 2x or more.
constexpr double dy_rel_l2 = 1e-2;
constexpr double grad_rel_l2 = 5e-3;
constexpr double loss_rtol = 1e-3;


std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = oom::to_float(oom::to_bf16(x));
  return v;
}

/// Relative L2 of an accumulated gradient's increment: (got - start) vs expected_increment.
double rel_l2_increment(const std::vector<float>& got, const std::vector<float>& start,
                        const std::vector<float>& expected_increment) {
  REQUIRE(got.size() == start.size());
  std::vector<float> inc(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) inc[i] = got[i] - start[i];  // NaN stays NaN
  return rel_l2(inc, expected_increment);
}

bool all_poison(const std::vector<float>& v) {
  for (const float x : v) {
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if (bits != 0xFFFFFFFFu) return false;
  }
  return true;
}

#define CHECK_REPORT(report)                                                       \
  do {                                                                             \
    const auto& r_ = (report);                                                     \
    INFO("max abs err " << r_.max_abs_err << ", first mismatches:\n" << r_.first); \
    CHECK(r_.ok());                                                                \
  } while (0)

struct Case {
  std::int64_t tokens, hidden, vocab;
};
constexpr Case cases[] = {{37, 64, 256}, {37, 256, 1000}, {300, 64, 1000}, {300, 256, 256}};

}  // namespace

TEST_CASE("lm_head_forward_backward matches rmsnorm + lm_head_loss + rmsnorm backward references") {
  Blas blas;
  Stream stream;
  // norm_offset 1: the hybrid families' (1 + w) final norm, w stored less the 1 and the 1 added in fp32.
  for (const auto& c : cases)
  for (const float offset : {0.0f, 1.0f}) {
    const std::int64_t T = c.tokens, H = c.hidden, V = c.vocab;
    CAPTURE(T);
    CAPTURE(H);
    CAPTURE(V);
    CAPTURE(offset);
    const m::LmEndsShape s{.tokens = T, .hidden = H, .vocab = V, .rms_norm_eps = 1e-6f, .norm_offset = offset};
    const m::LmEndsContext ctx{.stream = stream.s, .blas = blas.get()};
    const auto seed = static_cast<std::uint64_t>(T * 1000003 + H * 1009 + V);

    // y ~ N(0, 1); final_norm ~ 1 + N(0, 0.1); head ~ N(0, 1/H) so logits are of order 1.
    const Bf16Data y(random_normal(static_cast<std::size_t>(T * H), seed + 1));
    auto wn = random_normal(static_cast<std::size_t>(H), seed + 2, 0.1f);
    for (auto& w : wn) w += 1.0f - offset;
    const Bf16Data w_norm(wn);
    std::vector<float> w_applied = w_norm.values;  // what the norm scales by: the stored weight + the offset, in fp32
    for (auto& w : w_applied) w += offset;
    const Bf16Data head(random_normal(static_cast<std::size_t>(V * H), seed + 3, 1.0f / std::sqrt(static_cast<float>(H))));
    std::vector<std::int32_t> targets(static_cast<std::size_t>(T));
    std::mt19937_64 rng(seed + 4);
    std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(V - 1));
    for (std::int64_t t = 0; t < T; ++t) targets[t] = (t % 11 == 5) ? ref::ignore_index : pick(rng);
    const auto gnorm0 = random_normal(static_cast<std::size_t>(H), seed + 5, 0.01f);
    const auto ghead0 = random_normal(static_cast<std::size_t>(V * H), seed + 6, 1e-4f);

    // ---- reference: r = bf16(rms(y) * w) (the GPU's r is bf16), CE with grad_scale 1/T,
    // dr rounded to bf16 (the GPU writes it into dy), then the norm's backward.
    std::vector<float> r(static_cast<std::size_t>(T * H)), rstd(static_cast<std::size_t>(T));
    ref::rmsnorm_forward<float>(y.values, w_applied, r, rstd, T, H, s.rms_norm_eps);
    r = round_bf16(r);
    const double scale = 1.0 / static_cast<double>(T);
    const auto lm = ref::lm_head_loss(T, H, V, r, head.values, targets, true, scale);
    const auto dr = round_bf16(lm.dx);
    std::vector<float> dy_ref(static_cast<std::size_t>(T * H)), gnorm_inc(static_cast<std::size_t>(H), 0.0f);
    ref::rmsnorm_backward<float>(dr, y.values, w_applied, rstd, dy_ref, gnorm_inc, T, H);
    dy_ref = round_bf16(dy_ref);  // the GPU's dy is bf16

    // ---- GPU
    DeviceBuffer<bf16> d_y(y.bits), d_w(w_norm.bits), d_head(head.bits), dy(static_cast<std::size_t>(T * H));
    DeviceBuffer<std::int32_t> d_targets(targets), valid(1);
    DeviceBuffer<float> loss(1), gnorm(gnorm0), ghead(ghead0);
    DeviceBuffer<std::uint8_t> ws(m::lm_ends_workspace_bytes(s));
    m::lm_head_forward_backward(ctx, s, d_y.get(), d_w.get(), d_head.get(), d_targets.get(), loss.get(), valid.get(), dy.get(),
                                gnorm.get(), ghead.get(), ws.get(), ws.size());
    OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));

    const float loss_gpu = loss.download()[0];
    CHECK(valid.download()[0] == lm.valid_count);
    CHECK(std::isfinite(loss_gpu));
    CHECK(loss_gpu == doctest::Approx(lm.loss_sum).epsilon(loss_rtol));

    const double e_dy = rel_l2(to_floats(dy.download()), dy_ref);
    INFO("dy relative L2 error " << e_dy);
    CHECK(e_dy <= dy_rel_l2);
    const double e_gnorm = rel_l2_increment(gnorm.download(), gnorm0, gnorm_inc);
    INFO("grad_final_norm relative L2 error " << e_gnorm);
    CHECK(e_gnorm <= grad_rel_l2);
    const double e_ghead = rel_l2_increment(ghead.download(), ghead0, lm.dw);
    INFO("grad_head relative L2 error " << e_ghead);
    CHECK(e_ghead <= grad_rel_l2);
    MESSAGE("T=" << T << " H=" << H << " V=" << V << " offset " << offset << ": loss " << loss_gpu << " (ref " << lm.loss_sum << "), rel L2 dy "
                 << e_dy << ", grad_final_norm " << e_gnorm << ", grad_head " << e_ghead);

    // ---- loss only: the same loss bits, and no gradient buffer touched (they stay poisoned).
    DeviceBuffer<float> loss2(1), gnorm2(static_cast<std::size_t>(H)), ghead2(static_cast<std::size_t>(V * H));
    DeviceBuffer<std::int32_t> valid2(1);
    ws.poison();
    m::lm_head_forward_backward(ctx, s, d_y.get(), d_w.get(), d_head.get(), d_targets.get(), loss2.get(), valid2.get(), nullptr,
                                gnorm2.get(), ghead2.get(), ws.get(), ws.size());
    OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    CHECK(loss2.download()[0] == loss_gpu);
    CHECK(valid2.download()[0] == lm.valid_count);
    CHECK(all_poison(gnorm2.download()));
    CHECK(all_poison(ghead2.download()));
  }
}

TEST_CASE("lm_embed_forward / lm_embed_backward match the gather / scatter-add reference") {
  Blas blas;
  Stream stream;
  for (const auto& c : cases) {
    const std::int64_t T = c.tokens, H = c.hidden, V = c.vocab;
    CAPTURE(T);
    CAPTURE(H);
    CAPTURE(V);
    const m::LmEndsShape s{.tokens = T, .hidden = H, .vocab = V, .rms_norm_eps = 1e-6f};
    const m::LmEndsContext ctx{.stream = stream.s, .blas = blas.get()};
    const auto seed = static_cast<std::uint64_t>(T * 7919 + H * 31 + V) + 77;

    const Bf16Data table(random_normal(static_cast<std::size_t>(V * H), seed + 1));
    // Ids drawn from a quarter of the vocabulary, so ids repeat (the scatter-add sums runs) and
    // most rows of the gradient are untouched (they must keep their starting values).
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T));
    std::mt19937_64 rng(seed + 2);
    std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(std::max<std::int64_t>(1, V / 4) - 1));
    for (auto& id : ids) id = pick(rng) * 4 + 1;  // 1, 5, 9, ... < V
    const Bf16Data dx(random_normal(static_cast<std::size_t>(T * H), seed + 3));
    const auto gemb0 = random_normal(static_cast<std::size_t>(V * H), seed + 4, 0.1f);

    std::vector<float> x_ref(static_cast<std::size_t>(T * H));
    CHECK(ref::embedding_forward<float>(ids, table.values, x_ref, V, H) == 0);
    auto gemb_ref = gemb0;
    CHECK(ref::embedding_backward<float>(ids, dx.values, gemb_ref, V, H) == 0);

    DeviceBuffer<bf16> d_table(table.bits), x(static_cast<std::size_t>(T * H)), d_dx(dx.bits);
    DeviceBuffer<std::int32_t> d_ids(ids), invalid(std::vector<std::int32_t>{0});
    DeviceBuffer<float> gemb(gemb0);
    DeviceBuffer<std::uint8_t> ws(m::lm_ends_workspace_bytes(s));
    m::lm_embed_forward(ctx, s, d_table.get(), d_ids.get(), x.get(), invalid.get());
    m::lm_embed_backward(ctx, s, d_ids.get(), d_dx.get(), gemb.get(), invalid.get(), ws.get(), ws.size());
    OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));

    CHECK(invalid.download()[0] == 0);
    // A gather copies bf16 values: bit exact.
    CHECK_REPORT(compare(to_floats(x.download()), x_ref, 0.0, 0.0, "embedding x"));
    // fp32 sums in token order of a few bf16 rows (vs the reference's fp64 sum, then the same one
    // fp32 add): a few fp32 ulps of the largest terms, |dx| <~ 5 and at most T of them.
    CHECK_REPORT(compare(gemb.download(), gemb_ref, 1e-5, 1e-6 * static_cast<double>(T), "grad_embedding"));
  }
}

TEST_CASE("an id outside [0, V) reads and writes nothing and increments invalid_count") {
  Blas blas;
  Stream stream;
  const std::int64_t T = 37, H = 64, V = 1000;
  const m::LmEndsShape s{.tokens = T, .hidden = H, .vocab = V, .rms_norm_eps = 1e-6f};
  const m::LmEndsContext ctx{.stream = stream.s, .blas = blas.get()};
  const Bf16Data table(random_normal(static_cast<std::size_t>(V * H), 4242));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) ids[t] = static_cast<std::int32_t>((t * 37) % V);
  ids[3] = static_cast<std::int32_t>(V);         // one past the end
  ids[10] = static_cast<std::int32_t>(V + 1000);  // far past the end
  ids[20] = -1;                                   // negative
  const Bf16Data dx(random_normal(static_cast<std::size_t>(T * H), 4343));
  const auto gemb0 = random_normal(static_cast<std::size_t>(V * H), 4444, 0.1f);

  std::vector<float> x_ref(static_cast<std::size_t>(T * H));
  CHECK(ref::embedding_forward<float>(ids, table.values, x_ref, V, H) == 3);
  auto gemb_ref = gemb0;
  CHECK(ref::embedding_backward<float>(ids, dx.values, gemb_ref, V, H) == 3);

  DeviceBuffer<bf16> d_table(table.bits), x(static_cast<std::size_t>(T * H)), d_dx(dx.bits);
  DeviceBuffer<std::int32_t> d_ids(ids), invalid_fwd(std::vector<std::int32_t>{0}), invalid_bwd(std::vector<std::int32_t>{0});
  DeviceBuffer<float> gemb(gemb0);
  DeviceBuffer<std::uint8_t> ws(m::lm_ends_workspace_bytes(s));
  m::lm_embed_forward(ctx, s, d_table.get(), d_ids.get(), x.get(), invalid_fwd.get());
  m::lm_embed_backward(ctx, s, d_ids.get(), d_dx.get(), gemb.get(), invalid_bwd.get(), ws.get(), ws.size());
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  CHECK(invalid_fwd.download()[0] == 3);
  CHECK(invalid_bwd.download()[0] == 3);
  // Invalid rows are zeros, the rest the gathered rows (bit exact).
  CHECK_REPORT(compare(to_floats(x.download()), x_ref, 0.0, 0.0, "embedding x with invalid ids"));
  CHECK_REPORT(compare(gemb.download(), gemb_ref, 1e-5, 1e-6 * static_cast<double>(T), "grad_embedding with invalid ids"));
}

TEST_CASE("LM head chunking keeps the logits workspace within ~2 GiB and scales down for small T") {
  const auto mib = [](std::size_t b) { return static_cast<double>(b) / (1 << 20); };
  const m::LmEndsShape big{.tokens = 65536, .hidden = 2048, .vocab = 32000, .rms_norm_eps = 1e-6f};
  const auto rows = m::lm_head_chunk_rows(big);
  CHECK(rows % 64 == 0);
  CHECK(static_cast<double>(rows) * 32000 * 6 <= 2048.0 * (1 << 20));
  // Long enough that each chunk's read and write of the fp32 head gradient (8 V H bytes) is small
  // against its three GEMMs (6 V H FLOPs a row): at least 2048 rows at both vocabularies.
  CHECK(rows >= 2048);
  // The workspace also holds rstd and r (T, H) bf16: 256 MiB more at this T.
  MESSAGE("V=32000 T=65536 H=2048: chunk_rows " << rows << ", workspace " << mib(m::lm_ends_workspace_bytes(big)) << " MiB");
  CHECK(mib(m::lm_ends_workspace_bytes(big)) <= 2048.0 + 256.0 + 1.0);
  const m::LmEndsShape qwen{.tokens = 262144, .hidden = 2048, .vocab = 151936, .rms_norm_eps = 1e-6f};
  const auto qwen_rows = m::lm_head_chunk_rows(qwen);
  CHECK(static_cast<double>(qwen_rows) * 151936 * 6 <= 2048.0 * (1 << 20));
  CHECK(qwen_rows >= 2048);
  // The rows follow the vocabulary, not the length (every plan of a model, every length past a
  // chunk, sums the head gradient in chunks of one size), and a short call takes all its rows at once.
  const m::LmEndsShape qwen_64k{.tokens = 65536, .hidden = 2048, .vocab = 151936, .rms_norm_eps = 1e-6f};
  CHECK(m::lm_head_chunk_rows(qwen_64k) == qwen_rows);
  const m::LmEndsShape short_qwen{.tokens = 1000, .hidden = 2048, .vocab = 151936, .rms_norm_eps = 1e-6f};
  CHECK(m::lm_head_chunk_rows(short_qwen) == 1000);
  const m::LmEndsShape small{.tokens = 37, .hidden = 64, .vocab = 32000, .rms_norm_eps = 1e-6f};
  CHECK(m::lm_head_chunk_rows(small) == 37);
  CHECK(m::lm_ends_workspace_bytes(small) < m::lm_ends_workspace_bytes(big) / 16);
}

TEST_CASE("bad arguments are refused with oom::Error") {
  Blas blas;
  Stream stream;
  const m::LmEndsContext ctx{.stream = stream.s, .blas = blas.get()};
  const m::LmEndsShape s{.tokens = 37, .hidden = 64, .vocab = 256, .rms_norm_eps = 1e-6f};
  DeviceBuffer<bf16> y(37 * 64), w(64), head(256 * 64), dy(37 * 64);
  DeviceBuffer<std::int32_t> targets(std::vector<std::int32_t>(37, 1)), valid(1);
  DeviceBuffer<float> loss(1), gnorm(64), ghead(256 * 64);
  DeviceBuffer<std::uint8_t> ws(m::lm_ends_workspace_bytes(s));
  // Workspace one byte short.
  CHECK_THROWS_AS(m::lm_head_forward_backward(ctx, s, y.get(), w.get(), head.get(), targets.get(), loss.get(), valid.get(),
                                              dy.get(), gnorm.get(), ghead.get(), ws.get(), ws.size() - 1),
                  oom::Error);
  // Backward without a gradient buffer.
  CHECK_THROWS_AS(m::lm_head_forward_backward(ctx, s, y.get(), w.get(), head.get(), targets.get(), loss.get(), valid.get(),
                                              dy.get(), gnorm.get(), nullptr, ws.get(), ws.size()),
                  oom::Error);
  const m::LmEndsShape bad{.tokens = 37, .hidden = 0, .vocab = 256, .rms_norm_eps = 1e-6f};
  CHECK_THROWS_AS((void)m::lm_ends_workspace_bytes(bad), oom::Error);
}
