// GPU flash attention (src/kernels/attention_*.cu) against the CPU reference on fresh random
// inputs: sequence lengths that are no multiple of any tile (1, 17, 1000, 4099), D = 128 and 256,
// GQA (16/4) and MHA, Q/K/V and dQ/dK/dV both as separate tensors and as views into one packed
// projection buffer, outputs poisoned (NaN) before every run; chunked execution; determinism;
// and one forward+backward at S = 1M tokens checked on sampled rows.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/attention_test_util.hpp"
#include "kernels/device_buffer.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"
#include "kernels/attention_fused_dq.hpp"
#include "kernels/attention_paths.hpp"
#include "oom/reference/attention.hpp"
#include "support/compare.hpp"

namespace {

using oom::bf16;
using oom::kernels::AttentionProblem;
using oom::kernels::TokenRows;
using oom::reference::AttentionDims;
using oom::test::DeviceBuffer;
using oom::test::attention::as_const;
using oom::test::attention::check_bounded;
using oom::test::attention::DeviceQkv;
using oom::test::attention::download;
using oom::test::attention::hashed_bf16;
using oom::test::attention::Prepared;
using oom::test::attention::random_bf16;
using oom::test::attention::relative_l2;
using oom::test::attention::to_float;
using oom::test::attention::upload;

// Tolerances (bf16 inputs and outputs, fp32 accumulation):
// - O: the output is rounded to bf16 (2^-9 relative) and P is rounded to bf16 before P V (2^-9
//   relative per term, random signs): rtol 2e-2, plus atol 1e-2 * rms(O) for entries near zero.
// - LSE: fp32 sums of exact bf16 products, no bf16 rounding: 1e-3.
// - dQ, dK, dV: P and dS are rounded to bf16 before their products and each gradient entry is a
//   sum with cancellation (rows of dS sum to zero), so an entry's error scales with the gradient's
//   rms rather than its own size: rtol 3e-2 plus atol 3e-2 * rms, and the whole tensor's relative
//   L2 error below 1e-2 (a systematic bug moves that to O(1)).
constexpr double lse_tol = 1e-3;
constexpr double grad_rtol = 3e-2, grad_atol_rms = 3e-2, rel_l2_max = 1e-2;

double rms(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return x.empty() ? 0.0 : std::sqrt(s / static_cast<double>(x.size()));
}

void check_close(const std::vector<float>& got, const std::vector<float>& ref, double rtol, double atol_rms,
                 const char* what, bool check_l2) {
  // A floor under the tensor's rms: rows whose exact gradient is 0 (the first query, whose only key
  // gets all the weight) come out as fp32 rounding noise around 1e-7.
  const double atol = atol_rms * std::max(rms(ref), 1e-4);
  const auto r = oom::test::compare(got, ref, rtol, atol, what);
  INFO(std::string(what) << ": max abs err " << r.max_abs_err << ", rms(ref) " << rms(ref) << "\n" << r.first);
  CHECK(r.ok());
  if (check_l2) {
    const double l2 = relative_l2(got, ref);
    INFO(std::string(what) << ": relative L2 error " << l2);
    CHECK(l2 < rel_l2_max);
  }
}

struct Case {
  int batch, seq, heads_q, heads_kv, head_dim;
  bool packed;
};

std::string describe(const Case& c, const std::vector<int>& chunk_starts) {
  return "B=" + std::to_string(c.batch) + " S=" + std::to_string(c.seq) + " Hq=" + std::to_string(c.heads_q) +
         " Hkv=" + std::to_string(c.heads_kv) + " D=" + std::to_string(c.head_dim) +
         (c.packed ? " packed" : " separate") + " chunks=" + std::to_string(chunk_starts.size());
}

/// Runs the kernels on one shape, optionally split into query chunks (forward first-to-last,
/// backward last-to-first, as the planner does), and compares everything with the reference.
void check_case(const Case& c, std::uint64_t seed, std::vector<int> chunk_starts = {0}) {
  INFO(describe(c, chunk_starts));
  const Prepared t({c.batch, c.seq, c.heads_q, c.heads_kv, c.head_dim}, c.packed, seed, std::move(chunk_starts));
  const auto o_got = download(t.o, t.d, c.heads_q);
  check_bounded(o_got, t.o_ref, t.o_mag, 3, "O");
  CHECK(relative_l2(o_got, t.o_ref) < rel_l2_max);
  {
    const auto r = oom::test::compare(download(t.lse), t.lse_ref, lse_tol, lse_tol, "LSE");
    INFO(r.first);
    CHECK(r.ok());
  }

  DeviceQkv grad(t.d, c.packed);
  DeviceBuffer<unsigned char> ws(t.workspace_bytes(oom::kernels::attention_backward_workspace_bytes));
  const auto backward = [&] { return t.backward(oom::kernels::attention_backward, grad, ws.get(), ws.bytes()); };
  const auto [dq, dk, dv] = backward();
  // dK/dV of chunked runs are rounded to bf16 after each chunk: one more u·mag per chunk.
  const double chunks = static_cast<double>(t.chunk_starts.size());
  check_bounded(dq, t.dq_ref, t.dq_mag, 4, "dQ");
  check_bounded(dk, t.dk_ref, t.dk_mag, 4 + chunks, "dK");
  check_bounded(dv, t.dv_ref, t.dv_mag, 4 + chunks, "dV");
  CHECK(relative_l2(dq, t.dq_ref) < rel_l2_max);
  CHECK(relative_l2(dk, t.dk_ref) < rel_l2_max);
  CHECK(relative_l2(dv, t.dv_ref) < rel_l2_max);

  // No atomics anywhere: a second run is bit-identical.
  const auto [dq2, dk2, dv2] = backward();
  CHECK(dq2 == dq);
  CHECK(dk2 == dk);
  CHECK(dv2 == dv);
}

}  // namespace

TEST_CASE("attention forward and backward match the reference, D = 128") {
  std::uint64_t seed = 100;
  for (const Case c : {Case{2, 1, 16, 4, 128, true}, Case{2, 17, 16, 4, 128, false}, Case{1, 17, 4, 4, 128, true},
                       Case{1, 1000, 16, 4, 128, true}, Case{2, 1000, 4, 4, 128, false},
                       Case{1, 4099, 16, 4, 128, true}})
    check_case(c, seed += 10);
}

TEST_CASE("attention forward and backward match the reference, D = 256") {
  std::uint64_t seed = 200;
  for (const Case c : {Case{2, 1, 16, 4, 256, false}, Case{2, 17, 16, 4, 256, true}, Case{1, 17, 4, 4, 256, false},
                       Case{1, 1000, 16, 4, 256, true}, Case{2, 1000, 4, 4, 256, true},
                       Case{1, 4099, 4, 4, 256, false}, Case{1, 4099, 8, 2, 256, true}})
    check_case(c, seed += 10);
}

TEST_CASE("attention in query chunks (causal prefix) equals the whole sequence") {
  // Chunk edges on no tile boundary; the backward runs last chunk first and accumulates dK/dV.
  check_case(Case{1, 1000, 8, 2, 128, true}, 300, {0, 333, 600});
  check_case(Case{2, 1000, 8, 2, 256, false}, 310, {0, 517});
}

TEST_CASE("attention launchers reject what they cannot do") {
  AttentionProblem p{.batch = 1, .seq = 64, .heads_q = 4, .heads_kv = 2, .head_dim = 128, .softmax_scale = 0.1f};
  CHECK(oom::kernels::attention_can_implement(p));
  auto bad = p;
  bad.head_dim = 64;
  CHECK_FALSE(oom::kernels::attention_can_implement(bad));
  bad = p;
  bad.heads_q = 3;
  CHECK_FALSE(oom::kernels::attention_can_implement(bad));
  bad = p;
  bad.q_end = 65;
  CHECK_FALSE(oom::kernels::attention_can_implement(bad));
  bad = p;
  bad.softmax_scale = NAN;
  CHECK_FALSE(oom::kernels::attention_can_implement(bad));

  DeviceBuffer<bf16> buf(64 * 4 * 128 * 4);
  DeviceBuffer<float> lse(4 * 64);
  const TokenRows<const bf16> ok{buf.get(), 64 * 512, 512};
  const TokenRows<const bf16> odd_stride{buf.get(), 64 * 512, 500};
  CHECK(oom::kernels::attention_forward(p, odd_stride, ok, ok, {buf.get(), 64 * 512, 512}, lse.get(), nullptr) ==
        cudaErrorInvalidValue);
  CHECK(oom::kernels::attention_forward(bad, ok, ok, ok, {buf.get(), 64 * 512, 512}, lse.get(), nullptr) ==
        cudaErrorInvalidValue);
}

TEST_CASE("attention forward+backward at S = 1M tokens (B=1, Hq=16, Hkv=4, D=128), sampled rows") {
  const AttentionDims d{1, 1 << 20, 16, 4, 128};
  const float scale = 1.0f / std::sqrt(128.0f);
  const std::size_t nq = static_cast<std::size_t>(d.seq) * d.heads_q * d.head_dim;
  const std::size_t nkv = static_cast<std::size_t>(d.seq) * d.heads_kv * d.head_dim;
  const auto q = hashed_bf16(nq, 1), k = hashed_bf16(nkv, 2), v = hashed_bf16(nkv, 3), d_o = hashed_bf16(nq, 4);

  // Packed QKV and dQKV: token stride 3072 elements, so offsets pass 2^31 (64-bit indexing).
  DeviceQkv in(d, true), grad(d, true);
  upload(in.q, q, d, d.heads_q);
  upload(in.k, k, d, d.heads_kv);
  upload(in.v, v, d, d.heads_kv);
  DeviceBuffer<bf16> o_buf(nq), do_buf(d_o);
  DeviceBuffer<float> lse(static_cast<std::size_t>(d.heads_q) * d.seq);
  const std::int64_t q_row = 16 * 128;
  const TokenRows<bf16> o{o_buf.get(), d.seq * q_row, q_row};
  const AttentionProblem p{.batch = 1, .seq = d.seq, .heads_q = 16, .heads_kv = 4, .head_dim = 128,
                           .softmax_scale = scale};
  DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));

  cudaEvent_t e0, e1, e2;
  OOM_CUDA_CHECK(cudaEventCreate(&e0));
  OOM_CUDA_CHECK(cudaEventCreate(&e1));
  OOM_CUDA_CHECK(cudaEventCreate(&e2));
  OOM_CUDA_CHECK(cudaEventRecord(e0));
  OOM_CUDA_CHECK(oom::kernels::attention_forward(p, as_const(in.q), as_const(in.k), as_const(in.v), o, lse.get(), nullptr));
  OOM_CUDA_CHECK(cudaEventRecord(e1));
  OOM_CUDA_CHECK(oom::kernels::attention_backward(p, as_const(in.q), as_const(in.k), as_const(in.v), as_const(o),
                                                  {do_buf.get(), d.seq * q_row, q_row}, lse.get(), grad.q, grad.k,
                                                  grad.v, false, ws.get(), ws.bytes(), nullptr));
  OOM_CUDA_CHECK(cudaEventRecord(e2));
  OOM_CUDA_CHECK(cudaEventSynchronize(e2));
  float fwd_ms = 0, bwd_ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&fwd_ms, e0, e1));
  OOM_CUDA_CHECK(cudaEventElapsedTime(&bwd_ms, e1, e2));
  const double fwd_flops = 2.0 * 16 * static_cast<double>(d.seq) * d.seq * 128;  // causal: half of 4 B H S^2 D
  std::printf("S=1M: forward %.0f ms (%.0f TFLOP/s), backward %.0f ms (%.0f TFLOP/s at 2.5x forward)\n", fwd_ms,
              fwd_flops / fwd_ms / 1e9, bwd_ms, 2.5 * fwd_flops / bwd_ms / 1e9);

  const auto lse_gpu = download(lse);
  // Only the sampled rows come back (the full tensors would be 24 GB as floats).
  const auto fetch_row = [](TokenRows<bf16> src, int i, int h) {
    std::vector<bf16> row(128);
    OOM_CUDA_CHECK(cudaMemcpy(row.data(), src.data + i * src.token_stride + h * 128, 128 * sizeof(bf16),
                              cudaMemcpyDeviceToHost));
    return to_float(row);
  };

  // Sampled rows: early, tile-edge, middle and last queries on three heads; the last two keys on
  // two KV heads (a key's gradient needs every later query: only keys near the end are cheap).
  struct QuerySample {
    int h, i;
    std::vector<float> o, dq;
    float lse;
    std::vector<double> o_mag = std::vector<double>(128), dq_mag = std::vector<double>(128);
  };
  struct KeySample {
    int hk, j;
    std::vector<float> dk, dv;
  };
  std::vector<QuerySample> qs;
  for (int h : {0, 7, 15})
    for (int i : {0, 1, 127, 4097, 65535, 500001, d.seq - 1}) qs.push_back({h, i, std::vector<float>(128), std::vector<float>(128), 0});
  std::vector<KeySample> ks;
  for (int hk : {0, 3})
    for (int j : {d.seq - 1, d.seq - 2}) ks.push_back({hk, j, std::vector<float>(128), std::vector<float>(128)});
  {
    const std::span<const bf16> sq(q), sk(k), sv(v), sdo(d_o);
    std::vector<std::thread> pool;
    for (auto& s : qs)
      pool.emplace_back([&] {
        s.lse = oom::reference::attention_forward_row<bf16>(d, scale, sq, sk, sv, 0, s.h, s.i, s.o);
        oom::reference::attention_backward_dq_row<bf16>(d, scale, sq, sk, sv, sdo, 0, s.h, s.i, s.dq);
        oom::reference::attention_error_scales_row<bf16>(d, scale, sq, sk, sv, sdo, 0, s.h, s.i, s.o_mag, s.dq_mag);
      });
    for (auto& s : ks)
      pool.emplace_back([&] { oom::reference::attention_backward_dkv_row<bf16>(d, scale, sq, sk, sv, sdo, 0, s.hk, s.j, s.dk, s.dv); });
    for (auto& t : pool) t.join();
  }

  std::vector<float> o_got, o_ref, dq_got, dq_ref, dk_got, dk_ref, dv_got, dv_ref, lse_got, lse_ref;
  for (const auto& s : qs) {
    const auto o_row = fetch_row(o, s.i, s.h), dq_row = fetch_row(grad.q, s.i, s.h);
    o_got.insert(o_got.end(), o_row.begin(), o_row.end());
    dq_got.insert(dq_got.end(), dq_row.begin(), dq_row.end());
    o_ref.insert(o_ref.end(), s.o.begin(), s.o.end());
    dq_ref.insert(dq_ref.end(), s.dq.begin(), s.dq.end());
    lse_got.push_back(lse_gpu[static_cast<std::size_t>(s.h) * d.seq + s.i]);
    lse_ref.push_back(s.lse);
  }
  for (const auto& s : ks) {
    const auto dk_row = fetch_row(grad.k, s.j, s.hk), dv_row = fetch_row(grad.v, s.j, s.hk);
    dk_got.insert(dk_got.end(), dk_row.begin(), dk_row.end());
    dv_got.insert(dv_got.end(), dv_row.begin(), dv_row.end());
    dk_ref.insert(dk_ref.end(), s.dk.begin(), s.dk.end());
    dv_ref.insert(dv_ref.end(), s.dv.begin(), s.dv.end());
  }
  // Rows differ in scale by orders of magnitude (row 0 is one V row; row 1M-1 averages 1M of
  // them), so O and dQ rows are compared row by row, each with its own rms.
  for (std::size_t r = 0; r < qs.size(); ++r) {
    INFO("query row " << qs[r].i << " head " << qs[r].h);
    const auto slice = [r](const std::vector<float>& x) {
      return std::vector<float>(x.begin() + r * 128, x.begin() + (r + 1) * 128);
    };
    check_bounded(slice(o_got), slice(o_ref), qs[r].o_mag, 3, "O");
    check_bounded(slice(dq_got), slice(dq_ref), qs[r].dq_mag, 4, "dQ");
    // Over a row with many keys the roundings average out: a systematic error would not.
    if (qs[r].i >= 127) {
      CHECK(relative_l2(slice(o_got), slice(o_ref)) < rel_l2_max);
      CHECK(relative_l2(slice(dq_got), slice(dq_ref)) < rel_l2_max);
    }
  }
  for (std::size_t r = 0; r < ks.size(); ++r) {
    INFO("key row " << ks[r].j << " KV head " << ks[r].hk);
    const auto slice = [r](const std::vector<float>& x) {
      return std::vector<float>(x.begin() + r * 128, x.begin() + (r + 1) * 128);
    };
    check_close(slice(dk_got), slice(dk_ref), grad_rtol, grad_atol_rms, "dK", true);
    check_close(slice(dv_got), slice(dv_ref), grad_rtol, grad_atol_rms, "dV", true);
  }
  const auto r = oom::test::compare(lse_got, lse_ref, lse_tol, lse_tol, "LSE");
  INFO(r.first);
  CHECK(r.ok());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
}

// ---- attention_backward_fused_dq (run alone with -tc="fused dQ*") ----
// Against the CPU reference up to S = 1000 (its cost grows as S^2 and the whole set must stay
// under a minute); the long hand-over chains (64 to 1024 key blocks) are checked against the
// mma.sync backward in the timing case: dK/dV bit for bit, dQ finite and close. The fused variant
// is built from the mma.sync kernels, so it is compared with attention_backward_mma_sync (what
// attention_backward runs off compute capability 9.0 or at head_dim 256), not with the wgmma
// backward attention_backward dispatches to on an H100/H200.

namespace {

/// How many elements differ bit for bit (a NaN matches only the same NaN), naming the first few.
std::size_t count_bit_differences(const std::vector<float>& got, const std::vector<float>& want, const char* what,
                                  std::string& first) {
  REQUIRE(got.size() == want.size());
  std::size_t n = 0;
  for (std::size_t x = 0; x < got.size(); ++x)
    if (std::memcmp(&got[x], &want[x], sizeof(float)) != 0 && ++n <= 5)
      first += std::string(what) + "[" + std::to_string(x) + "]: " + std::to_string(got[x]) + " vs " +
               std::to_string(want[x]) + "\n";
  return n;
}

void check_bit_identical(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  std::string first;
  const std::size_t n = count_bit_differences(got, want, what, first);
  INFO(what << ": " << n << " of " << got.size() << " elements differ in their bits\n" << first);
  CHECK(n == 0);
}

using BackwardFn = decltype(&oom::kernels::attention_backward_mma_sync);
static_assert(std::is_same_v<BackwardFn, decltype(&oom::kernels::attention_backward_fused_dq)>,
              "the fused variant takes attention_backward's arguments");

/// attention_backward_fused_dq on one shape, optionally in query chunks (last to first, dK/dV
/// accumulated), against the mma.sync backward and the CPU reference:
/// - dK, dV bit-identical to attention_backward_mma_sync's (the same products in the same order);
/// - dQ within check_case's bound of the reference (4 u·mag + 2 u·|ref|), and within 12 u·mag of
///   attention_backward_mma_sync's dQ: both are within that bound of the reference and |ref| <= mag, so they
///   differ by at most 8 u·mag + 4 u·|ref| <= 12 u·mag (check_bounded adds 2 u·|theirs| on top);
/// - a second run bit-identical to the first; outputs poisoned (NaN) before every run.
void check_fused_dq_case(const Case& c, std::uint64_t seed, std::vector<int> chunk_starts = {0}) {
  INFO(describe(c, chunk_starts));
  const Prepared t({c.batch, c.seq, c.heads_q, c.heads_kv, c.head_dim}, c.packed, seed, std::move(chunk_starts));
  const std::size_t ws_a = t.workspace_bytes(oom::kernels::attention_backward_workspace_bytes);
  const std::size_t ws_f = t.workspace_bytes(oom::kernels::attention_backward_fused_dq_workspace_bytes);
  DeviceBuffer<unsigned char> ws(std::max(ws_a, ws_f));
  DeviceQkv grad_a(t.d, c.packed), grad_f(t.d, c.packed);
  auto backward = [&](BackwardFn fn, DeviceQkv& grad, std::size_t ws_bytes) {
    ws.poison();  // the fused variant must not depend on the workspace's previous contents
    return t.backward(fn, grad, ws.get(), ws_bytes);
  };
  const auto [dq_a, dk_a, dv_a] = backward(&oom::kernels::attention_backward_mma_sync, grad_a, ws_a);
  const auto [dq_f, dk_f, dv_f] = backward(&oom::kernels::attention_backward_fused_dq, grad_f, ws_f);
  check_bit_identical(dk_f, dk_a, "dK (fused vs mma.sync backward)");
  check_bit_identical(dv_f, dv_a, "dV (fused vs mma.sync backward)");
  const double chunks = static_cast<double>(t.chunk_starts.size());
  check_bounded(dk_f, t.dk_ref, t.dk_mag, 4 + chunks, "dK (fused)");
  check_bounded(dv_f, t.dv_ref, t.dv_mag, 4 + chunks, "dV (fused)");
  check_bounded(dq_f, t.dq_ref, t.dq_mag, 4, "dQ (fused vs reference)");
  check_bounded(dq_f, dq_a, t.dq_mag, 12, "dQ (fused vs mma.sync backward)");
  if (c.seq > 1) {  // at S = 1 the exact dQ is 0 and both are rounding noise: the bounds above apply
    const double l2 = relative_l2(dq_f, t.dq_ref), l2_a = relative_l2(dq_f, dq_a);
    INFO("dQ relative L2 error: " << l2 << " vs reference, " << l2_a << " vs the mma.sync backward");
    CHECK(l2 < rel_l2_max);
    CHECK(l2_a < rel_l2_max);
  }

  const auto [dq_f2, dk_f2, dv_f2] = backward(&oom::kernels::attention_backward_fused_dq, grad_f, ws_f);
  check_bit_identical(dq_f2, dq_f, "dQ (fused, run 2 vs run 1)");
  check_bit_identical(dk_f2, dk_f, "dK (fused, run 2 vs run 1)");
  check_bit_identical(dv_f2, dv_f, "dV (fused, run 2 vs run 1)");
}

}  // namespace

TEST_CASE("fused dQ: matches the mma.sync backward and the reference, D = 128") {
  std::uint64_t seed = 500;
  for (const Case c : {Case{2, 1, 16, 4, 128, true}, Case{2, 17, 16, 4, 128, false}, Case{1, 17, 4, 4, 128, true},
                       Case{1, 1000, 16, 4, 128, true}, Case{2, 1000, 4, 4, 128, false}})
    check_fused_dq_case(c, seed += 10);
}

TEST_CASE("fused dQ: matches the mma.sync backward and the reference, D = 256") {
  std::uint64_t seed = 600;
  for (const Case c : {Case{2, 1, 16, 4, 256, false}, Case{2, 17, 16, 4, 256, true}, Case{1, 1000, 8, 2, 256, true},
                       Case{2, 1000, 4, 4, 256, false}})
    check_fused_dq_case(c, seed += 10);
}

TEST_CASE("fused dQ: in query chunks (causal prefix, dK/dV accumulated)") {
  // Chunk edges on no tile boundary, and chunks shorter than a tile ([63, 65)).
  check_fused_dq_case(Case{1, 1000, 8, 2, 128, true}, 700, {0, 333, 600});
  check_fused_dq_case(Case{2, 1000, 8, 2, 256, false}, 710, {0, 517});
  check_fused_dq_case(Case{1, 300, 8, 2, 128, false}, 720, {0, 63, 65, 200});
  check_fused_dq_case(Case{1, 300, 8, 4, 256, true}, 730, {0, 63, 65, 200});
}

TEST_CASE("fused dQ: rejects what attention_backward rejects") {
  AttentionProblem p{.batch = 1, .seq = 64, .heads_q = 4, .heads_kv = 2, .head_dim = 128, .softmax_scale = 0.1f};
  DeviceBuffer<bf16> buf(64 * 4 * 128);
  DeviceBuffer<float> lse(4 * 64);
  const std::size_t need = oom::kernels::attention_backward_fused_dq_workspace_bytes(p);
  CHECK(need > oom::kernels::attention_backward_workspace_bytes(p));
  DeviceBuffer<unsigned char> ws(need);
  const TokenRows<const bf16> in{buf.get(), 64 * 512, 512};
  const TokenRows<bf16> out{buf.get(), 64 * 512, 512};
  auto run = [&](const AttentionProblem& prob, TokenRows<const bf16> q, std::size_t ws_bytes) {
    return oom::kernels::attention_backward_fused_dq(prob, q, in, in, in, in, lse.get(), out, out, out, false,
                                                     ws.get(), ws_bytes, nullptr);
  };
  CHECK(run(p, {buf.get(), 64 * 512, 500}, need) == cudaErrorInvalidValue);  // stride not a multiple of 8
  CHECK(run(p, in, need - 1) == cudaErrorInvalidValue);                    // workspace too small
  auto bad = p;
  bad.head_dim = 64;
  CHECK(run(bad, in, need) == cudaErrorInvalidValue);
  auto empty = p;
  empty.q_begin = empty.q_end = 32;
  CHECK(run(empty, in, 0) == cudaSuccess);  // nothing to do, as attention_backward
}

TEST_CASE("fused dQ: timing against the mma.sync backward (B=1, Hq=16, Hkv=4, D=128)") {
  // Counted as the existing test and oom-calibrate count: 2.5x the causal forward's 2 S^2 Hq D.
  for (const int seq : {4096, 16384, 65536}) {
    const AttentionDims d{1, seq, 16, 4, 128};
    const float scale = 1.0f / std::sqrt(128.0f);
    const std::size_t nq = static_cast<std::size_t>(seq) * 16 * 128, nkv = static_cast<std::size_t>(seq) * 4 * 128;
    const auto q = hashed_bf16(nq, 11), k = hashed_bf16(nkv, 12), v = hashed_bf16(nkv, 13), d_o = hashed_bf16(nq, 14);
    DeviceQkv in(d, true), grad_a(d, true), grad_f(d, true);
    upload(in.q, q, d, 16);
    upload(in.k, k, d, 4);
    upload(in.v, v, d, 4);
    DeviceBuffer<bf16> o_buf(nq), do_buf(d_o);
    DeviceBuffer<float> lse(static_cast<std::size_t>(16) * seq);
    const std::int64_t q_row = 16 * 128;
    const TokenRows<bf16> o{o_buf.get(), seq * q_row, q_row};
    const TokenRows<const bf16> dor{do_buf.get(), seq * q_row, q_row};
    const AttentionProblem p{.batch = 1, .seq = seq, .heads_q = 16, .heads_kv = 4, .head_dim = 128,
                             .softmax_scale = scale};
    OOM_CUDA_CHECK(oom::kernels::attention_forward(p, as_const(in.q), as_const(in.k), as_const(in.v), o, lse.get(), nullptr));
    DeviceBuffer<unsigned char> ws_a(oom::kernels::attention_backward_workspace_bytes(p));
    DeviceBuffer<unsigned char> ws_f(oom::kernels::attention_backward_fused_dq_workspace_bytes(p));
    auto run = [&](BackwardFn fn, DeviceQkv& grad, DeviceBuffer<unsigned char>& ws) {
      OOM_CUDA_CHECK(fn(p, as_const(in.q), as_const(in.k), as_const(in.v), as_const(o), dor, lse.get(), grad.q, grad.k,
                        grad.v, false, ws.get(), ws.bytes(), nullptr));
    };
    cudaEvent_t e0, e1;
    OOM_CUDA_CHECK(cudaEventCreate(&e0));
    OOM_CUDA_CHECK(cudaEventCreate(&e1));
    auto time_ms = [&](BackwardFn fn, DeviceQkv& grad, DeviceBuffer<unsigned char>& ws) {
      OOM_CUDA_CHECK(cudaEventRecord(e0));
      run(fn, grad, ws);
      OOM_CUDA_CHECK(cudaEventRecord(e1));
      OOM_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      OOM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    run(&oom::kernels::attention_backward_mma_sync, grad_a, ws_a);  // warm-up (and the outputs compared below)
    run(&oom::kernels::attention_backward_fused_dq, grad_f, ws_f);
    double best_a = 1e30, best_f = 1e30;
    const int reps = seq >= 65536 ? 2 : 5;
    for (int r = 0; r < reps; ++r) {
      best_a = std::min(best_a, time_ms(&oom::kernels::attention_backward_mma_sync, grad_a, ws_a));
      best_f = std::min(best_f, time_ms(&oom::kernels::attention_backward_fused_dq, grad_f, ws_f));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    const double flops = 2.5 * 2.0 * 16 * static_cast<double>(seq) * seq * 128;
    MESSAGE("S=" << seq << ": attention_backward_mma_sync " << best_a << " ms (" << flops / best_a / 1e9
                 << " TFLOP/s), attention_backward_fused_dq " << best_f << " ms (" << flops / best_f / 1e9
                 << " TFLOP/s), speed-up " << best_a / best_f << "x");

    INFO("S=" << seq);
    check_bit_identical(download(grad_f.k, d, 4), download(grad_a.k, d, 4), "dK (fused vs mma.sync backward)");
    check_bit_identical(download(grad_f.v, d, 4), download(grad_a.v, d, 4), "dV (fused vs mma.sync backward)");
    const auto dq_f = download(grad_f.q, d, 16), dq_a = download(grad_a.q, d, 16);
    const auto bad = static_cast<std::size_t>(std::count_if(dq_f.begin(), dq_f.end(), [](float x) { return !std::isfinite(x); }));
    const double l2 = relative_l2(dq_f, dq_a);
    INFO("dQ: " << bad << " non-finite elements, relative L2 difference to the mma.sync backward " << l2);
    CHECK(bad == 0);
    CHECK(l2 < rel_l2_max);
  }
}
