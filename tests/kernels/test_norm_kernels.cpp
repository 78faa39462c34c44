// GPU tests of the embedding, RMSNorm, RoPE, SwiGLU, cast and AdamW kernels against their CPU
// references, on fresh random inputs at sizes that are no multiple of any tile (T = 1, 7, 1000,
// 4099; widths 2050, 130, 80 that take the scalar paths), outputs poisoned (NaN) before each run.
// The casts, the accumulate, AdamW and the sum of squares must match the host bit for bit; the
// others within tolerances justified next to each comparison. A last case prints each kernel's
// achieved bandwidth next to a device-to-device cudaMemcpy measured in the same run, the token
// permutation kernels (tested in test_moe_kernels) included.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "kernels/timing_inputs.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/adamw_gpu.hpp"
#include "oom/kernels/cast.hpp"
#include "oom/kernels/embedding.hpp"
#include "oom/kernels/permute.hpp"
#include "oom/kernels/rmsnorm.hpp"
#include "oom/kernels/rope.hpp"
#include "oom/kernels/swiglu.hpp"
#include "oom/optim/cpu_adamw.hpp"
#include "oom/reference/embedding.hpp"
#include "oom/reference/rmsnorm.hpp"
#include "oom/reference/rope.hpp"
#include "oom/reference/swiglu.hpp"
#include "support/compare.hpp"

namespace k = oom::kernels;
namespace ref = oom::reference;
using oom::bf16;
using oom::test::compare;
using oom::test::CompareReport;
using oom::test::DeviceBuffer;
using oom::test::Stream;
using oom::test::random_normal;

namespace {

// bf16 rounding is at most half an ulp, 2^-9 relative; 2^-7 leaves room for the few fp32 ulps by
// which the kernel's and the reference's unrounded values differ (summation order, expf/sincosf
// vs libm) when they straddle a bf16 rounding boundary.
constexpr double bf16_rtol = 1.0 / 128;


std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = oom::to_bf16(v[i]);
  return out;
}
std::vector<float> widen(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = oom::to_float(v[i]);
  return out;
}
/// Values exactly representable in bf16 (the kernels' inputs), widened.
std::vector<float> bf16_normal(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  return widen(to_bf16(random_normal(n, seed, stddev)));
}

void expect_close(const std::vector<float>& got, const std::vector<float>& expected, double rtol, double atol,
                  const char* what) {
  const CompareReport r = compare(got, expected, rtol, atol, what);
  if (!r.ok()) MESSAGE(r.first);
  CHECK_MESSAGE(r.ok(), std::string(what) << ": " << r.mismatches << " of " << r.checked << " mismatch (" << r.non_finite
                             << " non-finite), max abs err " << r.max_abs_err << ", max rel err " << r.max_rel_err);
}

/// Bit equality of two arrays of trivially copyable values; prints the first differences.
template <class T>
void expect_bits(const std::vector<T>& got, const std::vector<T>& expected, const char* what) {
  REQUIRE_MESSAGE(got.size() == expected.size(), std::string(what) << ": sizes differ");
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &expected[i], sizeof(T)) != 0 && ++bad <= 5) {
      std::uint64_t g = 0, e = 0;
      std::memcpy(&g, &got[i], sizeof(T));
      std::memcpy(&e, &expected[i], sizeof(T));
      MESSAGE(std::string(what) << "[" << i << "]: got bits 0x" << std::hex << g << " expected 0x" << e << std::dec);
    }
  }
  CHECK_MESSAGE(bad == 0, std::string(what) << ": " << bad << " of " << got.size() << " elements differ in their bits");
}

std::vector<float> widen_bits(const DeviceBuffer<bf16>& d) { return widen(d.download()); }

std::int32_t read_count(const DeviceBuffer<std::int32_t>& d) { return d.download().at(0); }

}  // namespace

// ----------------------------------------------------------------------------------------------
TEST_CASE("embedding: forward gathers rows exactly; backward scatter-adds like the reference, deterministically") {
  Stream stream;
  const std::int64_t V = 1003;
  for (const std::int64_t H : {128, 2050, 4096}) {
    const std::vector<float> table_f = bf16_normal(static_cast<std::size_t>(V * H), 100 + H);
    DeviceBuffer<bf16> table(to_bf16(table_f));
    for (const std::int64_t T : {1, 7, 1000, 4099}) {
      CAPTURE(H);
      CAPTURE(T);
      // 30% of the tokens share one id (a long run to sum), the rest uniform.
      std::mt19937_64 rng(7 * T + H);
      std::vector<std::int32_t> ids_h(T);
      for (auto& id : ids_h) id = (rng() % 10 < 3) ? 5 : static_cast<std::int32_t>(rng() % V);
      DeviceBuffer<std::int32_t> ids(ids_h);
      DeviceBuffer<std::int32_t> invalid(1);

      DeviceBuffer<bf16> out(static_cast<std::size_t>(T * H));
      invalid.zero();
      OOM_CUDA_CHECK(k::embedding_forward(ids.get(), table.get(), out.get(), invalid.get(), T, V, H, stream.s));
      std::vector<float> expected(static_cast<std::size_t>(T * H));
      CHECK(ref::embedding_forward<float>(ids_h, table_f, expected, V, H) == 0);
      expect_close(widen_bits(out), expected, 0.0, 0.0, "embedding forward (a copy: exact)");
      CHECK(read_count(invalid) == 0);

      const std::vector<float> dout_f = bf16_normal(static_cast<std::size_t>(T * H), 200 + T);
      DeviceBuffer<bf16> dout(to_bf16(dout_f));
      const std::vector<float> grad0 = random_normal(static_cast<std::size_t>(V * H), 300 + T);
      DeviceBuffer<float> grad(grad0);
      DeviceBuffer<unsigned char> ws(k::embedding_backward_workspace_bytes(T, V, H));
      invalid.zero();
      OOM_CUDA_CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, H, ws.get(),
                                           ws.size(), stream.s));
      std::vector<float> grad_ref = grad0;
      ref::embedding_backward<float>(ids_h, dout_f, grad_ref, V, H);
      const std::vector<float> grad_gpu = grad.download();
      // fp32 sums in token order of up to ~1230 O(1) terms vs an fp64 sum: typical error
      // sqrt(n) * |sum| * 2^-24 ~ 1e-4 for the long run; one token missing or added is O(1).
      expect_close(grad_gpu, grad_ref, 1e-5, 1e-3, "embedding backward");
      CHECK(read_count(invalid) == 0);

      // Same inputs, same bits (no atomics on the gradient).
      grad.upload(grad0);
      OOM_CUDA_CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, H, ws.get(),
                                           ws.size(), stream.s));
      expect_bits(grad.download(), grad_gpu, "embedding backward, second run");
    }
  }
}

TEST_CASE("embedding backward: runs that end on, cross and fill the 64-token segments, with invalid ids last") {
  // Sorted, each layout's ids make runs that meet the segments' edges every way: layout 0 runs of
  // 64 (one whole segment), 64 (the next, exactly), 1, 130 (across three), 63, 200 and 2, then 4
  // invalid ids; layout 1 a run from position 0 across a segment edge ending on one (128), a whole
  // segment (64), a run from a segment's start across two edges (130), one ending on an edge (62)
  // and a segment of invalid ids (T = 448, a multiple of 64); layout 2 the same with 100 invalid
  // ids, across an edge.
  Stream stream;
  const std::int64_t V = 40, H = 2048 + 8;
  using Runs = std::vector<std::pair<std::int32_t, int>>;
  const std::vector<std::pair<Runs, int>> layouts = {
      {Runs{{0, 64}, {1, 64}, {2, 1}, {3, 130}, {4, 63}, {5, 200}, {39, 2}}, 4},
      {Runs{{0, 128}, {1, 64}, {2, 130}, {3, 62}}, 64},
      {Runs{{0, 128}, {1, 64}, {2, 130}, {3, 62}}, 100},
  };
  for (std::size_t layout = 0; layout < layouts.size(); ++layout) {
    CAPTURE(layout);
    std::vector<std::int32_t> ids_h;
    for (const auto& [id, n] : layouts[layout].first) ids_h.insert(ids_h.end(), static_cast<std::size_t>(n), id);
    const int invalid_ids = layouts[layout].second;
    for (int i = 0; i < invalid_ids; ++i) ids_h.push_back(i % 2 == 0 ? -1 - i : static_cast<std::int32_t>(V) + i);
    std::mt19937_64 rng(11 + layout);
    std::shuffle(ids_h.begin(), ids_h.end(), rng);
    const auto T = static_cast<std::int64_t>(ids_h.size());
    for (const std::int64_t h : {H, H - 3}) {  // the 8-column path and the scalar one
      CAPTURE(h);
      const std::vector<float> dout_f = bf16_normal(static_cast<std::size_t>(T * h), 5 + h);
      DeviceBuffer<bf16> dout(to_bf16(dout_f));
      DeviceBuffer<std::int32_t> ids(ids_h), invalid(1);
      const std::vector<float> grad0 = random_normal(static_cast<std::size_t>(V * h), 6 + h);
      DeviceBuffer<float> grad(grad0);
      DeviceBuffer<unsigned char> ws(k::embedding_backward_workspace_bytes(T, V, h));
      invalid.zero();
      OOM_CUDA_CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, h, ws.get(), ws.size(), stream.s));
      CHECK(read_count(invalid) == invalid_ids);
      std::vector<float> grad_ref = grad0;
      ref::embedding_backward<float>(ids_h, dout_f, grad_ref, V, h);
      const std::vector<float> first = grad.download();
      expect_close(first, grad_ref, 1e-5, 1e-4, "embedding backward over segment edges");
      // Ids that occur nowhere keep their rows bit for bit.
      for (std::int64_t v = 0; v < V; ++v) {
        const auto& runs = layouts[layout].first;
        if (std::any_of(runs.begin(), runs.end(), [&](const auto& r) { return r.first == v; })) continue;
        for (std::int64_t c = 0; c < h; ++c) REQUIRE(first[v * h + c] == grad0[v * h + c]);
      }
      grad.upload(grad0);
      invalid.zero();
      OOM_CUDA_CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, h, ws.get(), ws.size(), stream.s));
      expect_bits(grad.download(), first, "embedding backward over segment edges, second run");
    }
  }
}

TEST_CASE("embedding: out-of-range ids are counted, give zero rows and no gradient") {
  Stream stream;
  const std::int64_t V = 50, H = 24, T = 6;
  const std::vector<std::int32_t> ids_h = {3, -1, 50, 7, std::numeric_limits<std::int32_t>::max(), 3};
  const std::vector<float> table_f = bf16_normal(V * H, 1);
  DeviceBuffer<bf16> table(to_bf16(table_f));
  DeviceBuffer<std::int32_t> ids(ids_h);
  DeviceBuffer<std::int32_t> invalid(1);
  invalid.zero();
  DeviceBuffer<bf16> out(T * H);
  OOM_CUDA_CHECK(k::embedding_forward(ids.get(), table.get(), out.get(), invalid.get(), T, V, H, stream.s));
  CHECK(read_count(invalid) == 3);
  std::vector<float> expected(T * H);
  ref::embedding_forward<float>(ids_h, table_f, expected, V, H);
  expect_close(widen_bits(out), expected, 0.0, 0.0, "embedding forward with invalid ids");

  const std::vector<float> dout_f = bf16_normal(T * H, 2);
  DeviceBuffer<bf16> dout(to_bf16(dout_f));
  DeviceBuffer<float> grad(std::vector<float>(V * H, 0.0f));
  DeviceBuffer<unsigned char> ws(k::embedding_backward_workspace_bytes(T, V, H));
  invalid.zero();
  OOM_CUDA_CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, H, ws.get(), ws.size(),
                                       stream.s));
  CHECK(read_count(invalid) == 3);
  std::vector<float> grad_ref(V * H, 0.0f);
  ref::embedding_backward<float>(ids_h, dout_f, grad_ref, V, H);
  expect_close(grad.download(), grad_ref, 1e-6, 1e-6, "embedding backward with invalid ids");

  // A null counter or a short workspace is refused, not ignored.
  CHECK(k::embedding_forward(ids.get(), table.get(), out.get(), nullptr, T, V, H, stream.s) == cudaErrorInvalidValue);
  CHECK(k::embedding_backward(ids.get(), dout.get(), grad.get(), invalid.get(), T, V, H, ws.get(), 1, stream.s) ==
        cudaErrorInvalidValue);
}

// ----------------------------------------------------------------------------------------------
TEST_CASE("rmsnorm: forward, rstd, input and weight gradients match the reference (hidden and q/k-norm rows)") {
  Stream stream;
  struct Shape {
    std::int64_t rows, dim;
  };
  // (1000 * 32, 128): Qwen3's per-head q-norm over T = 1000 tokens x 32 heads; 2050 and 130 take
  // the scalar path; 3000, 1000 and 40 are register-path widths that leave lanes without columns
  // (3000 and 4096: a row over two warps in the backward); 4099, 2001 and 20001 rows end in a part
  // chunk.
  for (const Shape s : {Shape{1, 128}, Shape{7, 2048}, Shape{1000, 2050}, Shape{4099, 2048}, Shape{1000 * 32, 128},
                        Shape{7, 130}, Shape{1000, 4096}, Shape{2001, 3000}, Shape{20001, 1000}, Shape{20001, 40}}) {
    CAPTURE(s.rows);
    CAPTURE(s.dim);
    const std::size_t n = static_cast<std::size_t>(s.rows * s.dim);
    const float eps = 1e-6f;
    const std::vector<float> x_f = bf16_normal(n, 11 + s.rows);
    std::vector<float> w_f = random_normal(s.dim, 12 + s.dim, 0.1f);
    for (auto& w : w_f) w = oom::to_float(oom::to_bf16(1.0f + w));
    const std::vector<float> dy_f = bf16_normal(n, 13 + s.rows);
    DeviceBuffer<bf16> x(to_bf16(x_f)), w(to_bf16(w_f)), dy(to_bf16(dy_f));
    DeviceBuffer<bf16> y(n), dx(n);
    DeviceBuffer<float> rstd(s.rows);

    OOM_CUDA_CHECK(k::rmsnorm_forward(x.get(), w.get(), y.get(), rstd.get(), s.rows, s.dim, eps, stream.s));
    std::vector<float> y_ref(n), rstd_ref(s.rows);
    ref::rmsnorm_forward<float>(x_f, w_f, y_ref, rstd_ref, s.rows, s.dim, eps);
    expect_close(widen_bits(y), y_ref, bf16_rtol, 1e-6, "rmsnorm y");
    // fp32 lane sums of D/32 squares then a 5-level tree: relative error <= (D/32 + 5) 2^-24 < 1e-5.
    expect_close(rstd.download(), rstd_ref, 2e-5, 0.0, "rmsnorm rstd");

    const std::vector<float> gw0 = random_normal(s.dim, 14);
    DeviceBuffer<float> gw(gw0);
    DeviceBuffer<unsigned char> ws(k::rmsnorm_backward_workspace_bytes(s.rows, s.dim));
    OOM_CUDA_CHECK(k::rmsnorm_backward(dy.get(), x.get(), w.get(), rstd.get(), dx.get(), gw.get(), s.rows, s.dim,
                                       ws.get(), ws.size(), stream.s));
    std::vector<float> dx_ref(n), gw_ref = gw0;
    // The reference backward gets the kernel's rstd, so this checks the backward on its own.
    ref::rmsnorm_backward<float>(dy_f, x_f, w_f, rstd.download(), dx_ref, gw_ref, s.rows, s.dim);
    // dx = rstd (dy w - xhat mean) cancels: O(1) terms carry ~1e-6 absolute fp32 differences
    // (and the rstd difference), hence atol 1e-4 beside one bf16 rounding.
    expect_close(widen_bits(dx), dx_ref, bf16_rtol, 1e-4, "rmsnorm dx");
    // dw sums R products of O(1) in fp32 (chunks of >= 16 rows, <= 512 chunks in order): error
    // well under 1e-4 sqrt(R); one row missing or doubled changes it by O(1).
    const std::vector<float> gw_gpu = gw.download();
    expect_close(gw_gpu, gw_ref, 1e-4, 1e-4 * std::sqrt(static_cast<double>(s.rows)), "rmsnorm dweight");

    // Deterministic, and in place (grad_x == grad_y) gives the same bits.
    const std::vector<bf16> dx_first = dx.download();
    gw.upload(gw0);
    DeviceBuffer<bf16> inplace(to_bf16(dy_f));
    OOM_CUDA_CHECK(k::rmsnorm_backward(inplace.get(), x.get(), w.get(), rstd.get(), inplace.get(), gw.get(), s.rows,
                                       s.dim, ws.get(), ws.size(), stream.s));
    expect_bits(gw.download(), gw_gpu, "rmsnorm dweight, second run");
    std::vector<std::uint16_t> a, b;
    for (bf16 v : inplace.download()) a.push_back(v.bits);
    for (bf16 v : dx_first) b.push_back(v.bits);
    expect_bits(a, b, "rmsnorm dx in place");
  }
}

TEST_CASE("rmsnorm with weight_offset 1: Qwen3-Next's (1 + w) norms, the 1 added in fp32 on every path") {
  Stream stream;
  // The register paths (8 and 32 lanes a row, a row over two warps in the backward) and the looped one.
  for (const auto [rows, dim] : {std::pair<std::int64_t, std::int64_t>{1000 * 16, 128}, {7, 2048}, {2001, 3000}, {7, 130}}) {
    CAPTURE(rows);
    CAPTURE(dim);
    const std::size_t n = static_cast<std::size_t>(rows * dim);
    const float eps = 1e-6f;
    const std::vector<float> x_f = bf16_normal(n, 21 + rows), dy_f = bf16_normal(n, 22 + rows);
    // Stored w near 0, as these norms are initialised and stay: most of it below bf16's spacing at
    // 1 (2^-7), so a bf16 1 + w would lose it.
    std::vector<float> w_f = random_normal(dim, 23 + dim, 0.004f);
    for (auto& w : w_f) w = oom::to_float(oom::to_bf16(w));
    std::vector<float> applied(w_f);
    for (auto& w : applied) w += 1.0f;  // fp32, as transformers' (1.0 + weight.float())
    DeviceBuffer<bf16> x(to_bf16(x_f)), w(to_bf16(w_f)), dy(to_bf16(dy_f)), y(n), dx(n);
    DeviceBuffer<float> rstd(rows);
    OOM_CUDA_CHECK(k::rmsnorm_forward(x.get(), w.get(), y.get(), rstd.get(), rows, dim, eps, stream.s, 1.0f));
    std::vector<float> y_ref(n), rstd_ref(rows);
    ref::rmsnorm_forward<float>(x_f, applied, y_ref, rstd_ref, rows, dim, eps);
    expect_close(widen_bits(y), y_ref, bf16_rtol, 1e-6, "rmsnorm y, offset 1");
    DeviceBuffer<float> gw(std::vector<float>(dim, 0.0f));
    DeviceBuffer<unsigned char> ws(k::rmsnorm_backward_workspace_bytes(rows, dim));
    OOM_CUDA_CHECK(k::rmsnorm_backward(dy.get(), x.get(), w.get(), rstd.get(), dx.get(), gw.get(), rows, dim, ws.get(), ws.size(),
                                       stream.s, 1.0f));
    std::vector<float> dx_ref(n), gw_ref(dim, 0.0f);
    ref::rmsnorm_backward<float>(dy_f, x_f, applied, rstd.download(), dx_ref, gw_ref, rows, dim);
    expect_close(widen_bits(dx), dx_ref, bf16_rtol, 1e-4, "rmsnorm dx, offset 1");
    expect_close(gw.download(), gw_ref, 1e-4, 1e-4 * std::sqrt(static_cast<double>(rows)), "rmsnorm dweight, offset 1");
  }
}

TEST_CASE("rmsnorm backward: calls back to back on one stream add up as calls with a wait between") {
  // On sm_90+ both kernels of a backward are programmatic dependents and the partial sum loads
  // grad_w before its wait: that load must see the previous call's sum. Four calls into one
  // grad_w (and a second weight sharing the workspace, as the decoder layer's q- and k-norms do)
  // queued with no wait must give the bits of the same calls with a stream wait after each.
  Stream stream;
  struct Shape {
    std::int64_t rows, dim;
  };
  // The 5.13B hidden norm (one warp a row), q-norm rows (8 lanes a row), a row over two warps, the
  // looped path.
  for (const Shape s : {Shape{4096, 2048}, Shape{1000 * 32, 128}, Shape{1000, 4096}, Shape{1000, 2050}}) {
    CAPTURE(s.rows);
    CAPTURE(s.dim);
    const std::size_t n = static_cast<std::size_t>(s.rows * s.dim);
    const std::int64_t rows_b = s.rows / 4 + 3;  // the second weight's rows: a different chunking
    const std::vector<float> x_f = bf16_normal(n, 21 + s.rows), dy_f = bf16_normal(n, 22 + s.rows);
    std::vector<float> w_f = random_normal(s.dim, 23, 0.1f);
    for (auto& w : w_f) w = oom::to_float(oom::to_bf16(1.0f + w));
    DeviceBuffer<bf16> x(to_bf16(x_f)), dy(to_bf16(dy_f)), w(to_bf16(w_f)), dx(n);
    DeviceBuffer<float> rstd(s.rows);
    OOM_CUDA_CHECK(k::rmsnorm_forward(x.get(), w.get(), dx.get(), rstd.get(), s.rows, s.dim, 1e-6f, stream.s));
    // The partial count is not monotone in the rows (8192 rows: 512 partials, 8193: 482).
    DeviceBuffer<unsigned char> ws(std::max(k::rmsnorm_backward_workspace_bytes(s.rows, s.dim),
                                            k::rmsnorm_backward_workspace_bytes(rows_b, s.dim)));
    const std::vector<float> gw0 = random_normal(s.dim, 24);
    const auto run = [&](bool wait_each) {
      DeviceBuffer<float> gw(gw0), gw_b(gw0);
      const auto call = [&](float* g, std::int64_t rows) {
        OOM_CUDA_CHECK(k::rmsnorm_backward(dy.get(), x.get(), w.get(), rstd.get(), dx.get(), g, rows, s.dim, ws.get(),
                                           ws.size(), stream.s));
        if (wait_each) OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
      };
      // Two calls into the same grad_w back to back (the sum of the second must see the first's),
      // then the other weight (its kernels reuse the workspace the first's sum is reading).
      for (int round = 0; round < 2; ++round) {
        call(gw.get(), s.rows);
        call(gw.get(), s.rows);
        call(gw_b.get(), rows_b);
        call(gw_b.get(), rows_b);
      }
      OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
      return std::make_pair(gw.download(), gw_b.download());
    };
    const auto waited = run(true);
    const auto queued = run(false);
    expect_bits(queued.first, waited.first, "rmsnorm dweight, four calls queued");
    expect_bits(queued.second, waited.second, "rmsnorm dweight sharing the workspace, four calls queued");
    // The calls did add up: every column finite and moved away from its start, in both weights.
    for (const std::vector<float>* g : {&waited.first, &waited.second}) {
      std::size_t bad = 0;
      for (std::size_t c = 0; c < gw0.size(); ++c) bad += !std::isfinite((*g)[c]) || (*g)[c] == gw0[c];
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("rmsnorm: rstd may be null for inference; bad shapes are refused") {
  Stream stream;
  const std::int64_t rows = 3, dim = 64;
  DeviceBuffer<bf16> x(to_bf16(bf16_normal(rows * dim, 1))), w(to_bf16(std::vector<float>(dim, 1.0f))), y(rows * dim);
  OOM_CUDA_CHECK(k::rmsnorm_forward(x.get(), w.get(), y.get(), nullptr, rows, dim, 1e-6f, stream.s));
  for (float v : widen_bits(y)) REQUIRE(std::isfinite(v));
  CHECK(k::rmsnorm_forward(x.get(), w.get(), y.get(), nullptr, rows, 0, 1e-6f, stream.s) == cudaErrorInvalidValue);
}

// ----------------------------------------------------------------------------------------------
namespace {

/// Packed sequences: lengths up to 2048, positions restarting at 0, one chunk starting at 30000
/// (a later chunk of a long sequence).
std::vector<std::int32_t> packed_positions(std::int64_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> pos(tokens);
  std::int32_t p = 30000;
  std::int32_t left = 1 + static_cast<std::int32_t>(rng() % 2048);
  for (auto& q : pos) {
    if (left-- == 0) {
      p = 0;
      left = static_cast<std::int32_t>(rng() % 2048);
    }
    q = p++;
  }
  return pos;
}

}  // namespace

TEST_CASE("rope: forward and backward match the reference, full and partial rotary, packed positions") {
  Stream stream;
  struct Shape {
    std::int64_t tokens, heads, head_dim, rotary_dim;
    float theta;
  };
  // (80, 40): rotary_dim/2 = 20 is no multiple of 8 -> scalar path.
  for (const Shape s : {Shape{1, 32, 128, 128, 1e6f}, Shape{7, 4, 128, 128, 1e6f}, Shape{1000, 32, 128, 64, 1e6f},
                        Shape{4099, 4, 128, 128, 1e6f}, Shape{1000, 3, 80, 40, 1e4f}, Shape{7, 2, 64, 32, 1e4f}}) {
    CAPTURE(s.tokens);
    CAPTURE(s.heads);
    CAPTURE(s.head_dim);
    CAPTURE(s.rotary_dim);
    const std::size_t n = static_cast<std::size_t>(s.tokens * s.heads * s.head_dim);
    const std::vector<std::int32_t> pos_h = packed_positions(s.tokens, 5 + s.tokens);
    DeviceBuffer<std::int32_t> pos(pos_h);
    const std::vector<float> x_f = bf16_normal(n, 21 + s.tokens);
    const std::vector<float> dy_f = bf16_normal(n, 22 + s.tokens);
    DeviceBuffer<bf16> x(to_bf16(x_f)), dy(to_bf16(dy_f)), y(n), dx(n);

    OOM_CUDA_CHECK(k::rope_forward(x.get(), pos.get(), y.get(), s.tokens, s.heads, s.head_dim, s.rotary_dim, s.theta,
                                   stream.s));
    std::vector<float> y_ref(n), dx_ref(n);
    ref::rope_forward<float>(x_f, pos_h, y_ref, s.heads, s.head_dim, s.rotary_dim, s.theta);
    // Same fp32 angle bits on both sides; sincosf vs libm and fp32 products differ by a few 1e-7
    // of |x| ~ 5, so atol 1e-5 covers outputs near zero; otherwise one bf16 rounding.
    const std::vector<float> y_gpu = widen_bits(y);
    expect_close(y_gpu, y_ref, bf16_rtol, 1e-5, "rope forward");

    OOM_CUDA_CHECK(k::rope_backward(dy.get(), pos.get(), dx.get(), s.tokens, s.heads, s.head_dim, s.rotary_dim,
                                    s.theta, stream.s));
    ref::rope_backward<float>(dy_f, pos_h, dx_ref, s.heads, s.head_dim, s.rotary_dim, s.theta);
    expect_close(widen_bits(dx), dx_ref, bf16_rtol, 1e-5, "rope backward");

    // In place gives the same bits as out of place.
    OOM_CUDA_CHECK(k::rope_forward(x.get(), pos.get(), x.get(), s.tokens, s.heads, s.head_dim, s.rotary_dim, s.theta,
                                   stream.s));
    expect_close(widen_bits(x), y_gpu, 0.0, 0.0, "rope forward in place");
  }
}

// ----------------------------------------------------------------------------------------------
TEST_CASE("swiglu: forward and backward over [gate | up] rows match the reference") {
  Stream stream;
  struct Shape {
    std::int64_t tokens, intermediate;
  };
  for (const Shape s : {Shape{1, 768}, Shape{7, 770}, Shape{1000, 768}, Shape{4099, 1536}, Shape{7, 5}}) {
    CAPTURE(s.tokens);
    CAPTURE(s.intermediate);
    const std::size_t n_in = static_cast<std::size_t>(s.tokens * 2 * s.intermediate);
    const std::size_t n_out = static_cast<std::size_t>(s.tokens * s.intermediate);
    // stddev 3 reaches the sigmoid's saturated tails.
    const std::vector<float> gu_f = bf16_normal(n_in, 31 + s.tokens, 3.0f);
    const std::vector<float> dout_f = bf16_normal(n_out, 32 + s.tokens);
    DeviceBuffer<bf16> gu(to_bf16(gu_f)), dout(to_bf16(dout_f)), out(n_out), dgu(n_in);

    OOM_CUDA_CHECK(k::swiglu_forward(gu.get(), out.get(), s.tokens, s.intermediate, stream.s));
    std::vector<float> out_ref(n_out), dgu_ref(n_in);
    ref::swiglu_forward<float>(gu_f, out_ref, s.tokens, s.intermediate);
    // Products only (no cancellation): expf vs std::exp (~2 ulp) then one bf16 rounding.
    expect_close(widen_bits(out), out_ref, bf16_rtol, 1e-6, "swiglu forward");

    OOM_CUDA_CHECK(k::swiglu_backward(dout.get(), gu.get(), dgu.get(), s.tokens, s.intermediate, stream.s));
    ref::swiglu_backward<float>(dout_f, gu_f, dgu_ref, s.tokens, s.intermediate);
    // 1 + g(1 - s) cancels near g = -1.28: absolute fp32 error ~1e-7 |dout up|, hence atol 1e-5.
    expect_close(widen_bits(dgu), dgu_ref, bf16_rtol, 1e-5, "swiglu backward");
  }
}

// ----------------------------------------------------------------------------------------------
namespace {

/// fp32 values with every rounding case: random magnitudes over the whole range, signed zeros,
/// infinities, NaNs with payloads, subnormals, ties to even both ways, values rounding to inf.
std::vector<float> cast_inputs(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  const std::uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                    0x7f800001u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x7f7fffffu,
                                    0x7f7f8000u, 0x3f80ffffu, 0xbf807fffu, 0x00408000u};
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t bits = i < std::size(specials) ? specials[i] : static_cast<std::uint32_t>(rng());
    v[i] = std::bit_cast<float>(bits);
  }
  return v;
}

std::vector<std::uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<std::uint32_t>(v[i]);
  return out;
}
std::vector<std::uint16_t> bits_of(const std::vector<bf16>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i].bits;
  return out;
}

}  // namespace

TEST_CASE("casts: fp32 -> bf16 has oom::to_bf16's bits (NaN, inf, ties, subnormals); bf16 -> fp32 is exact") {
  Stream stream;
  for (const std::int64_t n : {1, 7, 1000, 4099, (1 << 20) + 3}) {
    // offset 1: a 4-byte-aligned start takes the scalar path; offset 0 the vector one.
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(n);
      CAPTURE(offset);
      const std::vector<float> in_h = cast_inputs(static_cast<std::size_t>(n + offset), 41 + n);
      DeviceBuffer<float> in(in_h);
      DeviceBuffer<bf16> out(static_cast<std::size_t>(n + offset));
      OOM_CUDA_CHECK(k::cast_fp32_to_bf16(in.get() + offset, out.get() + offset, n, stream.s));
      const std::vector<bf16> got = out.download();
      std::vector<std::uint16_t> got_bits, want_bits;
      for (std::int64_t i = 0; i < n; ++i) {
        got_bits.push_back(got[offset + i].bits);
        want_bits.push_back(oom::to_bf16(in_h[offset + i]).bits);
      }
      expect_bits(got_bits, want_bits, "fp32 -> bf16");
    }
  }
  // Every bf16 bit pattern widens exactly (NaN payloads included).
  std::vector<bf16> all(65536 + 3);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = static_cast<std::uint16_t>(i);
  for (const std::int64_t offset : {0, 3}) {
    DeviceBuffer<bf16> in(all);
    DeviceBuffer<float> out(all.size());
    const std::int64_t n = 65536;
    OOM_CUDA_CHECK(k::cast_bf16_to_fp32(in.get() + offset, out.get() + offset, n, stream.s));
    const std::vector<float> got = out.download();
    std::vector<std::uint32_t> got_bits, want_bits;
    for (std::int64_t i = 0; i < n; ++i) {
      got_bits.push_back(std::bit_cast<std::uint32_t>(got[offset + i]));
      want_bits.push_back(std::bit_cast<std::uint32_t>(oom::to_float(all[offset + i])));
    }
    expect_bits(got_bits, want_bits, "bf16 -> fp32");
  }
}

TEST_CASE("repeat_row_bf16 and fill_bf16: every row the given one, every element the value; nothing past the end") {
  Stream stream;
  // Widths a multiple of 8 and not, starts 16-byte aligned and not (the vector and scalar paths).
  for (const std::int64_t width : {1, 7, 8, 256, 1000}) {
    for (const std::int64_t rows : {1, 3, 61, 1029}) {
      for (const std::int64_t offset : {0, 1}) {
        CAPTURE(width);
        CAPTURE(rows);
        CAPTURE(offset);
        const std::vector<bf16> row = to_bf16(random_normal(static_cast<std::size_t>(width + offset), 71 + width));
        const std::size_t total = static_cast<std::size_t>(rows * width + offset + 8);
        DeviceBuffer<bf16> in(row), out(total);  // poisoned, 8 past the end included
        const std::vector<bf16> before = out.download();
        OOM_CUDA_CHECK(k::repeat_row_bf16(in.get() + offset, width, out.get() + offset, rows, stream.s));
        const std::vector<bf16> got = out.download();
        std::vector<std::uint16_t> got_bits, want_bits;
        for (std::size_t i = 0; i < total; ++i) {
          got_bits.push_back(got[i].bits);
          const auto j = static_cast<std::int64_t>(i) - offset;
          want_bits.push_back(j >= 0 && j < rows * width ? row[static_cast<std::size_t>(offset + j % width)].bits : before[i].bits);
        }
        expect_bits(got_bits, want_bits, "repeat_row_bf16");
      }
    }
  }
  for (const std::int64_t n : {1, 7, 1000, 4099}) {
    for (const float value : {1.0f, -0.3f}) {
      CAPTURE(n);
      DeviceBuffer<bf16> out(static_cast<std::size_t>(n + 9));
      const std::vector<bf16> before = out.download();
      OOM_CUDA_CHECK(k::fill_bf16(out.get() + 1, n, value, stream.s));
      const std::vector<bf16> got = out.download();
      std::vector<std::uint16_t> got_bits, want_bits;
      for (std::int64_t i = 0; i < n + 9; ++i) {
        got_bits.push_back(got[static_cast<std::size_t>(i)].bits);
        want_bits.push_back(i >= 1 && i <= n ? oom::to_bf16(value).bits : before[static_cast<std::size_t>(i)].bits);
      }
      expect_bits(got_bits, want_bits, "fill_bf16");
    }
  }
}

TEST_CASE("accumulate_scaled: acc = fma(scale, grad, acc) bit for bit, bf16 and fp32 gradients") {
  Stream stream;
  const float scale = 0.37f;
  for (const std::int64_t n : {1, 7, 1000, 4099, (1 << 20) + 3}) {
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(n);
      CAPTURE(offset);
      const std::size_t total = static_cast<std::size_t>(n + offset);
      const std::vector<float> acc0 = random_normal(total, 51 + n);
      const std::vector<float> g32 = random_normal(total, 52 + n, 3.0f);
      const std::vector<bf16> g16 = to_bf16(random_normal(total, 53 + n));

      DeviceBuffer<float> acc(acc0), grad32(g32);
      DeviceBuffer<bf16> grad16(g16);
      OOM_CUDA_CHECK(k::accumulate_scaled(acc.get() + offset, grad32.get() + offset, scale, n, stream.s));
      std::vector<float> want = acc0;
      for (std::int64_t i = offset; i < n + offset; ++i) want[i] = std::fma(scale, g32[i], want[i]);
      expect_bits(bits_of(acc.download()), bits_of(want), "accumulate_scaled fp32");

      OOM_CUDA_CHECK(k::accumulate_scaled(acc.get() + offset, grad16.get() + offset, scale, n, stream.s));
      for (std::int64_t i = offset; i < n + offset; ++i) want[i] = std::fma(scale, oom::to_float(g16[i]), want[i]);
      expect_bits(bits_of(acc.download()), bits_of(want), "accumulate_scaled bf16");
    }
  }
}

// ----------------------------------------------------------------------------------------------
namespace {

template <class Moment>
void check_adamw_against_cpu(std::int64_t n, std::int64_t offset, bool with_out, oom::optim::ThreadPool& pool,
                             cudaStream_t stream, bool null_grads = false) {
  namespace optim = oom::optim;
  const std::size_t total = static_cast<std::size_t>(n + offset);
  std::vector<float> master = random_normal(total, 61 + n, 0.02f);
  std::vector<float> m_f = random_normal(total, 62 + n, 1e-3f);
  std::vector<float> v_f = random_normal(total, 63 + n, 1e-3f);
  for (auto& x : v_f) x = x * x;
  std::vector<Moment> m(total), v(total);
  for (std::size_t i = 0; i < total; ++i) {
    if constexpr (std::is_same_v<Moment, float>) {
      m[i] = m_f[i], v[i] = v_f[i];
    } else {
      m[i] = oom::to_bf16(m_f[i]), v[i] = oom::to_bf16(v_f[i]);
    }
  }
  DeviceBuffer<float> d_master(master);
  DeviceBuffer<Moment> d_m(m), d_v(v);
  DeviceBuffer<bf16> d_out(total);
  std::vector<bf16> out(total);

  optim::AdamWConfig config;
  config.lr = 3e-4f;
  config.weight_decay = 0.1f;
  for (std::int64_t step = 1; step <= 3; ++step) {
    std::vector<float> grads = random_normal(total, 64 + n + step, 1.0f);
    // Zeros and values whose squares are fp32 subnormals: no flush to zero on either side.
    for (std::size_t i = 0; i < total; i += 97) grads[i] = 0.0f;
    for (std::size_t i = 5; i < total; i += 89) grads[i] = 3e-21f;
    if (null_grads) std::fill(grads.begin(), grads.end(), 0.0f);  // the GPU gets no buffer, the CPU zeros
    const auto scalars = optim::adamw_step_scalars(config, step, 0.5f);
    DeviceBuffer<float> d_grads(grads);
    OOM_CUDA_CHECK(k::adamw_update(scalars, d_master.get() + offset, d_m.get() + offset, d_v.get() + offset,
                                   null_grads ? nullptr : d_grads.get() + offset, with_out ? d_out.get() + offset : nullptr, n,
                                   stream));
    optim::AdamWSpan<Moment> span{std::span<float>(master).subspan(offset), std::span<Moment>(m).subspan(offset),
                                  std::span<Moment>(v).subspan(offset),
                                  std::span<const float>(grads).subspan(offset),
                                  with_out ? std::span<bf16>(out).subspan(offset) : std::span<bf16>{}};
    optim::adamw_update(span, scalars, pool);
  }
  expect_bits(bits_of(d_master.download()), bits_of(master), "adamw master");
  if constexpr (std::is_same_v<Moment, float>) {
    expect_bits(bits_of(d_m.download()), bits_of(m), "adamw exp_avg");
    expect_bits(bits_of(d_v.download()), bits_of(v), "adamw exp_avg_sq");
  } else {
    expect_bits(bits_of(d_m.download()), bits_of(m), "adamw exp_avg (bf16)");
    expect_bits(bits_of(d_v.download()), bits_of(v), "adamw exp_avg_sq (bf16)");
  }
  if (with_out) {
    const std::vector<bf16> got = d_out.download();
    std::vector<std::uint16_t> g, w;
    for (std::size_t i = static_cast<std::size_t>(offset); i < total; ++i) {
      g.push_back(got[i].bits);
      w.push_back(out[i].bits);
    }
    expect_bits(g, w, "adamw bf16 weights");
  }
}

}  // namespace

TEST_CASE("adamw: GPU update is bit-identical to the CPU optimizer (fp32 and bf16 moments, 3 steps)") {
  Stream stream;
  oom::optim::ThreadPool pool(4);
  for (const std::int64_t n : {1, 7, 1000, 4099, (1 << 20) + 3}) {
    for (const std::int64_t offset : {0, 1}) {  // 1: unaligned arrays take the scalar path
      CAPTURE(n);
      CAPTURE(offset);
      check_adamw_against_cpu<float>(n, offset, true, pool, stream.s);
      check_adamw_against_cpu<bf16>(n, offset, true, pool, stream.s);
    }
  }
  check_adamw_against_cpu<float>(4099, 0, false, pool, stream.s);
}

TEST_CASE("adamw: null gradients update as zeros, bit for bit (an expert no token reached)") {
  // The executor passes no gradient for an expert its layer's backward left unwritten
  // (DecoderLayerGrads::unrouted_experts): the step must be the one a zeroed buffer gives, moments
  // decaying and weight decay applied, on both the vector and the scalar path.
  Stream stream;
  oom::optim::ThreadPool pool(4);
  for (const std::int64_t n : {1, 7, 4099}) {
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(n);
      CAPTURE(offset);
      check_adamw_against_cpu<float>(n, offset, true, pool, stream.s, true);
      check_adamw_against_cpu<bf16>(n, offset, true, pool, stream.s, true);
    }
  }
}

TEST_CASE("adamw_update_many: one launch over many segments, the bits of one launch each") {
  // Segments of every shape the executor hands it: tiny, not a multiple of the 1024 elements a
  // block takes, large, empty, misaligned by one element (the scalar path), without a gradient
  // (zeros) or without a bf16 copy; and 300 of them, more than one launch holds.
  namespace optim = oom::optim;
  Stream stream;
  optim::AdamWConfig config;
  config.lr = 3e-4f;
  config.weight_decay = 0.1f;
  const auto scalars = optim::adamw_step_scalars(config, 2, 0.5f);
  for (const int count : {9, 300}) {
    CAPTURE(count);
    std::vector<std::int64_t> sizes;
    for (int k = 0; k < count; ++k) {
      const std::int64_t pick[] = {1, 7, 1000, 1024, 4099, 0, (1 << 20) + 3, 33};
      sizes.push_back(count > 9 ? 1 + (k * 37) % 3000 : pick[k % 8]);
    }
    std::int64_t total = 0;
    for (const auto n : sizes) total += n + 1;  // + 1: room to misalign every other segment
    const auto t = static_cast<std::size_t>(total);
    std::vector<float> master = random_normal(t, 71, 0.02f), m = random_normal(t, 72, 1e-3f), v = random_normal(t, 73, 1e-3f);
    for (auto& x : v) x = x * x;
    const std::vector<float> grads = random_normal(t, 74, 1.0f);
    // Two copies of the state: one stepped segment by segment, one by adamw_update_many.
    DeviceBuffer<float> p1(master), m1(m), v1(v), p2(master), m2(m), v2(v), g(grads);
    DeviceBuffer<bf16> o1(t), o2(t);
    o1.zero();
    o2.zero();
    std::vector<k::AdamWSegment> list;
    std::int64_t at = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::int64_t off = at + static_cast<std::int64_t>(i % 2);  // odd segments misaligned
      const bool no_grad = i % 3 == 1, no_out = i % 5 == 2;
      OOM_CUDA_CHECK(k::adamw_update(scalars, p1.get() + off, m1.get() + off, v1.get() + off, no_grad ? nullptr : g.get() + off,
                                     no_out ? nullptr : o1.get() + off, sizes[i], stream.s));
      list.push_back({p2.get() + off, m2.get() + off, v2.get() + off, no_grad ? nullptr : g.get() + off, no_out ? nullptr : o2.get() + off,
                      sizes[i]});
      at += sizes[i] + 1;
    }
    OOM_CUDA_CHECK(k::adamw_update_many(scalars, list, stream.s));
    OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    expect_bits(bits_of(p2.download()), bits_of(p1.download()), "many: master");
    expect_bits(bits_of(m2.download()), bits_of(m1.download()), "many: exp_avg");
    expect_bits(bits_of(v2.download()), bits_of(v1.download()), "many: exp_avg_sq");
    expect_bits(bits_of(o2.download()), bits_of(o1.download()), "many: bf16 weights");
    CHECK(bits_of(p2.download()) != bits_of(master));  // it moved
  }
  const k::AdamWSegment bad{nullptr, nullptr, nullptr, nullptr, nullptr, 5};
  CHECK(k::adamw_update_many(scalars, std::span<const k::AdamWSegment>(&bad, 1), stream.s) == cudaErrorInvalidValue);
}

TEST_CASE("adamw_update_many with bf16 moments: the CPU optimizer's bits (AdamWSpan<bf16>), 2 steps") {
  // The resident update of a plan of bf16 moments (Plan::precision.moments): every segment's m and
  // v widened, updated in fp32, stored rounded to nearest even, as optim::adamw_update on
  // AdamWSpan<bf16> does on the host for streamed segments. Segments of sizes off every tile, empty
  // ones, starting 4 elements aligned (the vector path: 16-byte fp32, 8-byte bf16) or one element
  // past (the scalar path), without a gradient (zeros on the CPU) or without a bf16 copy; 300 of
  // them take two launches. Both sides start from the same state with the bf16 copies poisoned (NaN
  // bits); the whole buffers are compared, so nothing outside a segment may be written either.
  namespace optim = oom::optim;
  Stream stream;
  optim::ThreadPool pool(4);
  optim::AdamWConfig config;
  config.lr = 3e-4f;
  config.weight_decay = 0.1f;
  for (const int count : {9, 300}) {
    CAPTURE(count);
    std::vector<std::int64_t> sizes, offsets;
    for (int k = 0; k < count; ++k) {
      const std::int64_t pick[] = {1, 7, 1000, 1024, 4099, 0, (1 << 20) + 3, 33};
      sizes.push_back(count > 9 ? 1 + (k * 37) % 3000 : pick[k % 8]);
    }
    std::int64_t at = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      at = (at + 3) / 4 * 4;
      offsets.push_back(at + static_cast<std::int64_t>(i % 2));  // odd segments misaligned by one element
      at = offsets.back() + sizes[i];
    }
    const auto t = static_cast<std::size_t>(at);
    std::vector<float> master = random_normal(t, 91, 0.02f);
    const std::vector<float> m_f = random_normal(t, 92, 1e-3f);
    std::vector<float> v_f = random_normal(t, 93, 1e-3f);
    for (auto& x : v_f) x = x * x;
    std::vector<bf16> m = to_bf16(m_f), v = to_bf16(v_f);
    std::vector<bf16> out(t, bf16{0xffff});  // the poison DeviceBuffer writes
    DeviceBuffer<float> d_master(master);
    DeviceBuffer<bf16> d_m(m), d_v(v), d_out(t);  // d_out poisoned
    const std::vector<float> zeros(t, 0.0f);
    for (std::int64_t step = 1; step <= 2; ++step) {
      CAPTURE(step);
      std::vector<float> grads = random_normal(t, 94 + static_cast<std::uint64_t>(step), 1.0f);
      for (std::size_t i = 0; i < t; i += 97) grads[i] = 0.0f;
      DeviceBuffer<float> d_grads(grads);
      const auto scalars = optim::adamw_step_scalars(config, step, 0.5f);
      std::vector<k::AdamWSegmentBf16> list;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const auto off = static_cast<std::size_t>(offsets[i]);
        const auto n = static_cast<std::size_t>(sizes[i]);
        const bool no_grad = i % 3 == 1, no_out = i % 5 == 2;
        list.push_back({d_master.get() + off, d_m.get() + off, d_v.get() + off, no_grad ? nullptr : d_grads.get() + off,
                        no_out ? nullptr : d_out.get() + off, sizes[i]});
        if (n == 0) continue;
        optim::AdamWSpan<bf16> span{std::span<float>(master).subspan(off, n), std::span<bf16>(m).subspan(off, n),
                                    std::span<bf16>(v).subspan(off, n),
                                    std::span<const float>(no_grad ? zeros : grads).subspan(off, n),
                                    no_out ? std::span<bf16>{} : std::span<bf16>(out).subspan(off, n)};
        optim::adamw_update(span, scalars, pool);
      }
      OOM_CUDA_CHECK(k::adamw_update_many(scalars, list, stream.s));
      OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
      expect_bits(bits_of(d_master.download()), bits_of(master), "many bf16: master");
      expect_bits(bits_of(d_m.download()), bits_of(m), "many bf16: exp_avg");
      expect_bits(bits_of(d_v.download()), bits_of(v), "many bf16: exp_avg_sq");
      expect_bits(bits_of(d_out.download()), bits_of(out), "many bf16: bf16 weights");
    }
    CHECK(bits_of(m) != bits_of(to_bf16(m_f)));  // the moments moved
  }
  const k::AdamWSegmentBf16 bad{nullptr, nullptr, nullptr, nullptr, nullptr, 5};
  CHECK(k::adamw_update_many(oom::optim::adamw_step_scalars(config, 1), std::span<const k::AdamWSegmentBf16>(&bad, 1), stream.s) ==
        cudaErrorInvalidValue);
}

TEST_CASE("non-finite gradients: flagged by adamw_update_many as it reads them, and by flag_nonfinite") {
  // Segments of sizes off the vector width, 16-byte aligned ones (the float4 path) and misaligned
  // ones (the scalar path), one past 4M floats (flag_nonfinite's grid-stride loop), each with one
  // NaN, +inf or -inf at its first, a middle or its last element, or none; a flag per segment, poisoned
  // to 0 beforehand. Exactly the segments with a bad value are flagged, by both kernels; the
  // updates of the others are the bits of an unflagged launch.
  namespace optim = oom::optim;
  Stream stream;
  optim::AdamWConfig config;
  config.lr = 3e-4f;
  const auto scalars = optim::adamw_step_scalars(config, 1, 1.0f);
  // (offsets alternate aligned / misaligned by one float from 0: the even segments start 16-byte
  // aligned when their predecessors' sizes keep them so, which the sizes below do for 4096, 4100
  // and the 4M + 4 that takes the grid-stride loop more than once.)
  const std::vector<std::int64_t> sizes = {1, 7, 4096, 4099, 4100, (1 << 18) + 5, (1 << 22) + 4, 12, 4096, 33};
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  std::int64_t total = 0;
  for (const auto n : sizes) total += n + 5;  // + 5: room to align and to misalign
  const auto t = static_cast<std::size_t>(total);
  std::vector<float> grads = random_normal(t, 81, 1.0f);
  std::vector<int> expect(sizes.size(), 0);
  std::vector<std::int64_t> offsets;
  std::int64_t at = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i % 2 == 0) at = (at + 3) / 4 * 4;  // even segments 16-byte aligned: the float4 path
    const std::int64_t off = at + static_cast<std::int64_t>(i % 2);
    offsets.push_back(off);
    if (i % 4 != 3) {  // every fourth segment stays finite
      const std::int64_t where[] = {0, sizes[i] / 2, sizes[i] - 1};
      grads[static_cast<std::size_t>(off + where[i % 3])] = bad_values[i % 3];
      expect[i] = 1;
    }
    at += sizes[i] + 1;
  }
  const std::vector<float> master = random_normal(t, 82, 0.02f), zeros(t, 0.0f);
  DeviceBuffer<float> g(grads), p1(master), m1(zeros), v1(zeros), p2(master), m2(zeros), v2(zeros);
  DeviceBuffer<int> by_update(sizes.size()), by_pass(sizes.size());
  by_update.zero();
  by_pass.zero();
  std::vector<k::AdamWSegment> flagged, plain;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto off = offsets[i];
    flagged.push_back({p1.get() + off, m1.get() + off, v1.get() + off, g.get() + off, nullptr, sizes[i], by_update.get() + i});
    plain.push_back({p2.get() + off, m2.get() + off, v2.get() + off, g.get() + off, nullptr, sizes[i]});
    OOM_CUDA_CHECK(k::flag_nonfinite(g.get() + off, sizes[i], by_pass.get() + i, stream.s));
  }
  OOM_CUDA_CHECK(k::adamw_update_many(scalars, flagged, stream.s));
  OOM_CUDA_CHECK(k::adamw_update_many(scalars, plain, stream.s));
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  CHECK(by_update.download() == expect);
  CHECK(by_pass.download() == expect);
  expect_bits(bits_of(p1.download()), bits_of(p2.download()), "flagged: master");
  expect_bits(bits_of(m1.download()), bits_of(m2.download()), "flagged: exp_avg");
  expect_bits(bits_of(v1.download()), bits_of(v2.download()), "flagged: exp_avg_sq");
  // A set flag stays set; n = 0 and null gradients (zeros) flag nothing; bad arguments are refused.
  OOM_CUDA_CHECK(k::flag_nonfinite(g.get() + offsets[3], sizes[3], by_pass.get() + 0, stream.s));
  DeviceBuffer<int> none(1);
  none.zero();
  OOM_CUDA_CHECK(k::flag_nonfinite(g.get(), 0, none.get(), stream.s));
  const k::AdamWSegment zero_grads{p2.get(), m2.get(), v2.get(), nullptr, nullptr, 100, none.get()};
  OOM_CUDA_CHECK(k::adamw_update_many(scalars, std::span<const k::AdamWSegment>(&zero_grads, 1), stream.s));
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  CHECK(by_pass.download()[0] == 1);
  CHECK(none.download()[0] == 0);
  CHECK(k::flag_nonfinite(g.get(), 5, nullptr, stream.s) == cudaErrorInvalidValue);
  CHECK(k::flag_nonfinite(nullptr, 5, none.get(), stream.s) == cudaErrorInvalidValue);
  CHECK(k::flag_nonfinite(g.get(), -1, none.get(), stream.s) == cudaErrorInvalidValue);
}

TEST_CASE("grad_sum_of_squares: bit-identical to oom::optim::grad_sum_of_squares") {
  Stream stream;
  oom::optim::ThreadPool pool(4);
  const std::int64_t tile = static_cast<std::int64_t>(oom::optim::sum_of_squares_tile_elements);
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, tile, tile + 1, 3 * tile + 5,
                               std::int64_t{(1 << 22) + 9}}) {
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(n);
      CAPTURE(offset);
      // Magnitudes spread over 2^-20 .. 2^20 so the summation order shows in the last bits.
      std::vector<float> g = random_normal(static_cast<std::size_t>(n + offset), 71 + n);
      std::mt19937_64 rng(72 + n);
      for (auto& x : g) x = std::ldexp(x, static_cast<int>(rng() % 41) - 20);
      DeviceBuffer<float> d_g(g.empty() ? std::vector<float>(1) : g);
      DeviceBuffer<double> result(1);
      DeviceBuffer<unsigned char> ws(std::max<std::size_t>(1, k::grad_sum_of_squares_workspace_bytes(n)));
      OOM_CUDA_CHECK(k::grad_sum_of_squares(d_g.get() + offset, n, result.get(), ws.get(), ws.size(), stream.s));
      const double cpu = oom::optim::grad_sum_of_squares(std::span<const float>(g).subspan(offset, n), pool);
      const double gpu = result.download().at(0);
      CHECK_MESSAGE(std::bit_cast<std::uint64_t>(gpu) == std::bit_cast<std::uint64_t>(cpu),
                    "GPU " << gpu << " vs CPU " << cpu << " (difference " << gpu - cpu << ")");
    }
  }
}

// ----------------------------------------------------------------------------------------------
TEST_CASE("bandwidth: each memory-bound kernel as a fraction of a device-to-device cudaMemcpy") {
  Stream stream;
  const double copy_gbs = oom::test::copy_bytes_per_s(stream.s) / 1e9;  // read + write
  std::printf("cudaMemcpy D2D: %.0f GB/s (read + write)\n", copy_gbs);
  CHECK(copy_gbs > 0);
  // Writes alone, for the kernels that mostly write (the gather): the percentages stay of memcpy.
  const std::size_t copy_bytes = std::size_t{1} << 30;
  DeviceBuffer<unsigned char> b(copy_bytes);
  const double set_ms = oom::test::time_ms(
      [&](cudaStream_t s) { OOM_CUDA_CHECK(cudaMemsetAsync(b.get(), 0, copy_bytes, s)); }, stream.s);
  std::printf("cudaMemset: %.0f GB/s (write only)\n", copy_bytes / (set_ms * 1e-3) / 1e9);

  // Each timing covers `back_to_back` launches queued together, as a step runs them: one launch
  // between two events would also count the event-to-kernel gaps (a few microseconds, a fifth of a
  // 25-us kernel at the 5.13B layer's T = 4096 shapes).
  constexpr int back_to_back = 20;
  auto report = [&](const char* name, double bytes, auto&& launch) {
    const double ms = oom::test::time_ms(
                          [&](cudaStream_t s) {
                            for (int i = 0; i < back_to_back; ++i) OOM_CUDA_CHECK(launch(s));
                          },
                          stream.s, 5, 1) /
                      back_to_back;
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-60s %8.3f ms %7.0f GB/s  %5.1f%% of memcpy\n", name, ms, gbs, 100.0 * gbs / copy_gbs);
    CHECK(gbs > 0);
  };

  {
    const std::int64_t n = std::int64_t{1} << 27;
    DeviceBuffer<float> f(n);
    DeviceBuffer<bf16> h(n);
    oom::test::fill_random_f32(f.get(), f.size(), 21);
    oom::test::fill_random_bf16(h.get(), h.size(), 22);
    report("cast fp32 -> bf16 (128M)", 6.0 * n, [&](cudaStream_t s) { return k::cast_fp32_to_bf16(f.get(), h.get(), n, s); });
    report("accumulate_scaled bf16 (128M)", 10.0 * n,
           [&](cudaStream_t s) { return k::accumulate_scaled(f.get(), h.get(), 0.5f, n, s); });
    DeviceBuffer<unsigned char> ws(k::grad_sum_of_squares_workspace_bytes(n));
    DeviceBuffer<double> result(1);
    report("grad_sum_of_squares (128M fp32)", 4.0 * n,
           [&](cudaStream_t s) { return k::grad_sum_of_squares(f.get(), n, result.get(), ws.get(), ws.size(), s); });
  }
  {
    const std::int64_t n = std::int64_t{1} << 26;
    DeviceBuffer<float> p(n), m(n), v(n), g(n);
    DeviceBuffer<bf16> out(n);
    oom::test::fill_random_f32(p.get(), p.size(), 23, 0.02f);
    oom::test::fill_random_f32(m.get(), m.size(), 24, 1e-3f);
    oom::test::fill_random_f32(v.get(), v.size(), 25, 1e-6f, true);
    oom::test::fill_random_f32(g.get(), g.size(), 26, 1e-3f);
    const auto scalars = oom::optim::adamw_step_scalars(oom::optim::AdamWConfig{}, 10);
    report("adamw fp32 moments + bf16 copy (64M)", 30.0 * n, [&](cudaStream_t s) {
      return k::adamw_update(scalars, p.get(), m.get(), v.get(), g.get(), out.get(), n, s);
    });
  }
  {
    const std::int64_t rows = 65536, dim = 4096;
    DeviceBuffer<bf16> x(rows * dim), y(rows * dim), w(dim);
    DeviceBuffer<float> rstd(rows), gw(dim);
    oom::test::fill_random_bf16(x.get(), x.size(), 27);
    oom::test::fill_random_bf16(w.get(), w.size(), 28);
    gw.zero();
    report("rmsnorm forward (65536 x 4096)", 4.0 * rows * dim,
           [&](cudaStream_t s) { return k::rmsnorm_forward(x.get(), w.get(), y.get(), rstd.get(), rows, dim, 1e-6f, s); });
    DeviceBuffer<unsigned char> ws(k::rmsnorm_backward_workspace_bytes(rows, dim));
    // dy and x read, dx written: 6 bytes an element (until 2026-12-01 this line counted 8, so it
    // printed 4/3 of the real fraction).
    report("rmsnorm backward, dx in place (65536 x 4096)", 6.0 * rows * dim, [&](cudaStream_t s) {
      return k::rmsnorm_backward(y.get(), x.get(), w.get(), rstd.get(), y.get(), gw.get(), rows, dim, ws.get(),
                                 ws.size(), s);
    });
    const std::int64_t heads = rows * dim / 128;
    report("rmsnorm forward, q-norm rows (x 128)", 4.0 * rows * dim, [&](cudaStream_t s) {
      return k::rmsnorm_forward(x.get(), w.get(), y.get(), nullptr, heads, 128, 1e-6f, s);
    });
    // The 5.13B layer's width (2048) at 65536 rows, dx beside dy.
    report("rmsnorm backward (65536 x 2048)", 6.0 * 65536 * 2048, [&](cudaStream_t s) {
      return k::rmsnorm_backward(y.get(), x.get(), w.get(), rstd.get(), y.get() + 65536 * 2048, gw.get(), 65536, 2048,
                                 ws.get(), ws.size(), s);
    });
    // The 5.13B layer's backwards at T = 4096: the hidden norm (2048 wide) and the q-norm (16 heads
    // of 128); dy and x read, dx written, the weight gradient's partials not counted.
    report("rmsnorm backward (4096 x 2048)", 6.0 * 4096 * 2048, [&](cudaStream_t s) {
      return k::rmsnorm_backward(y.get(), x.get(), w.get(), rstd.get(), y.get(), gw.get(), 4096, 2048, ws.get(),
                                 ws.size(), s);
    });
    // The same bytes as one copy: what a 50-MB transfer reaches at all (launch and ramp included).
    report("cudaMemcpy D2D of the same 50 MB (a size reference)", 6.0 * 4096 * 2048, [&](cudaStream_t s) {
      return cudaMemcpyAsync(x.get(), y.get(), 3 * 4096 * 2048, cudaMemcpyDeviceToDevice, s);
    });
    report("rmsnorm backward, q-norm rows (4096 x 16 x 128)", 6.0 * 4096 * 16 * 128, [&](cudaStream_t s) {
      return k::rmsnorm_backward(y.get(), x.get(), w.get(), rstd.get(), y.get(), gw.get(), 4096 * 16, 128, ws.get(),
                                 ws.size(), s);
    });
  }
  {
    const std::int64_t tokens = 65536, heads = 32, head_dim = 128;
    DeviceBuffer<bf16> x(tokens * heads * head_dim), y(tokens * heads * head_dim);
    DeviceBuffer<std::int32_t> pos(tokens);
    oom::test::fill_random_bf16(x.get(), x.size(), 29);
    std::vector<std::int32_t> positions(static_cast<std::size_t>(tokens));
    for (std::size_t t = 0; t < positions.size(); ++t) positions[t] = static_cast<std::int32_t>(t);
    pos.upload(positions);
    report("rope forward (65536 x 32 x 128)", 4.0 * tokens * heads * head_dim, [&](cudaStream_t s) {
      return k::rope_forward(x.get(), pos.get(), y.get(), tokens, heads, head_dim, head_dim, 1e6f, s);
    });
  }
  {
    const std::int64_t tokens = 65536, inter = 1536;
    DeviceBuffer<bf16> gu(tokens * 2 * inter), out(tokens * inter), dgu(tokens * 2 * inter);
    oom::test::fill_random_bf16(gu.get(), gu.size(), 30);
    report("swiglu forward (65536 x 1536)", 6.0 * tokens * inter,
           [&](cudaStream_t s) { return k::swiglu_forward(gu.get(), out.get(), tokens, inter, s); });
    report("swiglu backward (65536 x 1536)", 10.0 * tokens * inter,
           [&](cudaStream_t s) { return k::swiglu_backward(out.get(), gu.get(), dgu.get(), tokens, inter, s); });
  }
  {
    const std::int64_t tokens = 65536, vocab = 151936, hidden = 2048;
    DeviceBuffer<bf16> table(vocab * hidden), out(tokens * hidden);
    DeviceBuffer<float> grad(vocab * hidden);
    std::vector<std::int32_t> ids_h(tokens);
    std::mt19937_64 rng(1);
    for (auto& id : ids_h) id = static_cast<std::int32_t>(rng() % vocab);
    DeviceBuffer<std::int32_t> ids(ids_h), invalid(1);
    oom::test::fill_random_bf16(table.get(), table.size(), 31, 0.02f);
    grad.zero(), invalid.zero();
    report("embedding forward (65536 x 2048)", 4.0 * tokens * hidden, [&](cudaStream_t s) {
      return k::embedding_forward(ids.get(), table.get(), out.get(), invalid.get(), tokens, vocab, hidden, s);
    });
    DeviceBuffer<unsigned char> ws(k::embedding_backward_workspace_bytes(tokens, vocab, hidden));
    // bf16 grads read + fp32 rows read and written (distinct ids ~ tokens).
    report("embedding backward (65536 x 2048)", 10.0 * tokens * hidden, [&](cudaStream_t s) {
      return k::embedding_backward(ids.get(), out.get(), grad.get(), invalid.get(), tokens, vocab, hidden, ws.get(),
                                   ws.size(), s);
    });
    // Text's ids are far from uniform: here one id in 30% of the tokens (a long run to sum).
    for (auto& id : ids_h)
      if (rng() % 10 < 3) id = 13;
    ids.upload(ids_h);
    report("embedding backward, one id in 30% of tokens (65536 x 2048)", 10.0 * tokens * hidden, [&](cudaStream_t s) {
      return k::embedding_backward(ids.get(), out.get(), grad.get(), invalid.get(), tokens, vocab, hidden, ws.get(),
                                   ws.size(), s);
    });
  }
  // Token permutation at the 5.13B layer's width and top-k (H = 2048, k = 8, 64 experts), real
  // routing from permute_plan. Bytes are the least each kernel must move: every row read or
  // written once (the gather's x rows and the combine backward's d_out rows count once, though
  // read k times: the repeats come from L2 or not at all).
  for (const std::int64_t tokens : {std::int64_t{4096}, std::int64_t{32768}}) {
    const std::int64_t hidden = 2048, top_k = 8, experts = 64, routed = tokens * top_k;
    const k::PermuteShape ps{.tokens = tokens, .top_k = top_k, .experts = experts};
    DeviceBuffer<std::int32_t> ids(oom::test::random_routing(tokens, top_k, experts, 77 + tokens)), r2s(routed),
        s2r(routed), counts(experts), offsets(experts + 1);
    DeviceBuffer<unsigned char> plan_ws(k::permute_plan_workspace_bytes(ps));
    OOM_CUDA_CHECK(k::permute_plan(stream.s, ps, ids.get(), r2s.get(), s2r.get(), counts.get(), offsets.get(),
                                   plan_ws.get(), plan_ws.size()));
    DeviceBuffer<bf16> x(tokens * hidden), rows(routed * hidden), drows(routed * hidden), out(tokens * hidden);
    DeviceBuffer<float> w(routed), dw(routed);
    oom::test::fill_random_bf16(x.get(), x.size(), 32);
    oom::test::fill_random_bf16(rows.get(), rows.size(), 33);
    oom::test::fill_random_f32(w.get(), w.size(), 34, 0.1f, true);
    const double row_bytes = 2.0 * hidden, n = static_cast<double>(tokens), nk = static_cast<double>(routed);
    const std::string at = " (T " + std::to_string(tokens) + ", k 8, H 2048)";
    report(("gather (permute_rows)" + at).c_str(), row_bytes * (n + nk), [&](cudaStream_t s) {
      return k::permute_rows(s, ps, hidden, s2r.get(), x.get(), rows.get());
    });
    report(("combine (unpermute_combine)" + at).c_str(), row_bytes * (nk + n) + 4.0 * nk, [&](cudaStream_t s) {
      return k::unpermute_combine(s, ps, hidden, s2r.get(), rows.get(), w.get(), out.get());
    });
    report(("combine backward" + at).c_str(), row_bytes * (n + 2 * nk) + 8.0 * nk, [&](cudaStream_t s) {
      return k::unpermute_combine_backward(s, ps, hidden, s2r.get(), out.get(), rows.get(), w.get(), drows.get(), dw.get());
    });
    report(("gather backward (permute_rows_backward)" + at).c_str(), row_bytes * (nk + n), [&](cudaStream_t s) {
      return k::permute_rows_backward(s, ps, hidden, s2r.get(), drows.get(), out.get());
    });
  }
}

// ----------------------------------------------------------------------------------------------
TEST_CASE("timing inputs: random values of the asked scale, one block repeated, never constant") {
  // What every benchmark and timing case feeds the kernels (timing_inputs.hpp). A fill that fell
  // back to zeros or a constant would leave every timing running, only faster than real data.
  using oom::test::kFillBlock;
  const std::size_t n = kFillBlock + 12345;  // a whole block and part of its repeat
  DeviceBuffer<oom::bf16> a(n), w(n);
  oom::test::fill_random_bf16(a.get(), n, 7);
  oom::test::fill_random_bf16(w.get(), n, 7, 0.02f);
  const auto ha = a.download(), hw = w.download();
  const auto moments = [](const std::vector<oom::bf16>& v, std::size_t count) {
    double sum = 0, sq = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const double x = oom::to_float(v[i]);
      sum += x;
      sq += x * x;
    }
    const double mean = sum / static_cast<double>(count);
    return std::pair{mean, std::sqrt(sq / static_cast<double>(count) - mean * mean)};
  };
  const auto [mean_a, sd_a] = moments(ha, kFillBlock);
  CHECK(std::abs(mean_a) < 0.01);
  CHECK(sd_a == doctest::Approx(1.0).epsilon(0.01));
  const auto [mean_w, sd_w] = moments(hw, kFillBlock);
  CHECK(std::abs(mean_w) < 0.0002);
  CHECK(sd_w == doctest::Approx(0.02).epsilon(0.01));
  // The same seed gives the same values whatever the scale: the weights are the activations x 0.02.
  for (std::size_t i = 0; i < 1000; ++i)
    if (std::abs(oom::to_float(ha[i])) > 0.1f) CHECK(oom::to_float(hw[i]) == doctest::Approx(0.02 * oom::to_float(ha[i])).epsilon(0.01));
  // Past the block the fill repeats it, element for element.
  CHECK(std::equal(ha.begin() + static_cast<std::ptrdiff_t>(kFillBlock), ha.end(), ha.begin(),
                   [](oom::bf16 x, oom::bf16 y) { return x.bits == y.bits; }));
  // Many distinct values, few zeros.
  std::vector<std::uint16_t> bits(kFillBlock);
  for (std::size_t i = 0; i < kFillBlock; ++i) bits[i] = ha[i].bits;
  std::sort(bits.begin(), bits.end());
  CHECK(std::unique(bits.begin(), bits.end()) - bits.begin() > 2000);  // ~4,100 of N(0, 1) in bf16
  CHECK(std::count_if(ha.begin(), ha.begin() + static_cast<std::ptrdiff_t>(kFillBlock),
                      [](oom::bf16 x) { return oom::to_float(x) == 0.0f; }) < static_cast<std::ptrdiff_t>(kFillBlock / 1000));
  // fp32, magnitudes only (for what must not be negative, as AdamW's second moment).
  DeviceBuffer<float> m(1000);
  oom::test::fill_random_f32(m.get(), m.size(), 3, 1.0f, true);
  const auto hm = m.download();
  CHECK(std::all_of(hm.begin(), hm.end(), [](float x) { return x >= 0.0f; }));
  CHECK(*std::max_element(hm.begin(), hm.end()) > 1.0f);
}
