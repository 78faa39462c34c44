// The Hopper (wgmma) attention backward (src/kernels/hopper/attention_backward_wgmma.cu) against
// the CPU reference and against the mma.sync backward (oom::kernels::attention_backward_mma_sync) on the
// same inputs (Q, K, V, dO random bf16; O and LSE from attention_forward): sequence lengths that
// are no multiple of the 64/128-row tiles (1, 17, 1000, 4099) and ones that are (64, 128), GQA (4/2)
// and MHA (2/2), batch 1 and 2, Q/K/V and dQ/dK/dV separate and packed. Two kinds of runs:
//   - whole sequences, in one call or in query chunks run last to first with dK/dV accumulated
//     (accumulate_dkv true after the first call): dQ, dK, dV within their bf16 bounds of the
//     reference, and of the mma.sync kernel's; a second run bit-identical;
//   - one query sub-range [q_begin, q_end) alone, accumulate_dkv false (outputs poisoned) and true
//     (dK/dV pre-filled): dQ rows in the range within the bound of the reference; dK/dV rows
//     [0, q_end) (the chunk's partial sums, which the reference does not produce) within the
//     bound of the mma.sync kernel's; every dQ row outside the range and every dK/dV row >= q_end
//     untouched (still poison, or still the pre-filled value).
// The same runs at head_dim 256 for attention_backward_wgmma_d256, and head-dim-128 problems
// embedded in 128 of its 256 columns, whose dV must be the head-dim-128 kernel's bits (S = 300,
// 777 and 16384). Then the refusals (as
// attention_backward's, plus another head_dim: NotSupported), attention_backward_dkv_sum's query
// chunks with fp32 dK/dV sums (both kernels, against their whole calls), the dispatch (attention_forward /
// attention_backward give the wgmma kernels' bits at head_dim 128 and 256), and a timing report
// (printed, not asserted) at S = 4096, 16384, 65536, head_dim 128 and 256, against the mma.sync
// backward, with the wgmma results there checked against mma.sync's and bit-identical on a second
// run.
// Needs compute capability 9.0 (sm_90a code only): elsewhere it prints why and exits 77 (skipped).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention_paths.hpp"
#include "kernels/attention_test_util.hpp"
#include "kernels/device_buffer.hpp"
#include "kernels/hopper/attention_wgmma.hpp"
#include "kernels/sm90.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"
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

constexpr int kD = 128;
constexpr std::uint16_t kPoison = 0xFFFF;

void require_sm90() { oom::test::require_sm90("test_attention_backward_wgmma"); }

using BackwardFn = decltype(&oom::kernels::attention_backward_mma_sync);
static_assert(std::is_same_v<BackwardFn, decltype(&oom::kernels::hopper::attention_backward_wgmma)>,
              "the wgmma backward takes attention_backward's arguments");
constexpr BackwardFn kMma = &oom::kernels::attention_backward_mma_sync;
constexpr BackwardFn kWgmma = &oom::kernels::hopper::attention_backward_wgmma;
/// The head-dim-256 kernel (both warpgroups on the same rows, each on half the output columns).
constexpr BackwardFn kWgmmaD256 = &oom::kernels::hopper::attention_backward_wgmma_d256;

/// Raw bf16 rows of a strided (B, S, H, D) device tensor, contiguous on the host.
std::vector<bf16> download_bits(TokenRows<bf16> src, const AttentionDims& d, int heads) {
  std::vector<bf16> host(static_cast<std::size_t>(d.batch) * d.seq * heads * d.head_dim);
  const std::size_t width = static_cast<std::size_t>(heads) * d.head_dim * sizeof(bf16);
  OOM_CUDA_CHECK(cudaDeviceSynchronize());
  for (int b = 0; b < d.batch; ++b)
    OOM_CUDA_CHECK(cudaMemcpy2D(host.data() + static_cast<std::size_t>(b) * d.seq * heads * d.head_dim, width,
                                src.data + b * src.batch_stride, src.token_stride * sizeof(bf16), width,
                                static_cast<std::size_t>(d.seq), cudaMemcpyDeviceToHost));
  return host;
}

struct Grads {
  std::vector<bf16> dq, dk, dv;  // contiguous (B, S, H, D)
};
bool bits_equal(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}

/// One problem's inputs on the device: Q, K, V, dO random; O and LSE of the forward over the whole
/// sequence; the CPU reference gradients and their error scales (Prepared, attention_test_util.hpp),
/// and backward calls over any query range.
struct Problem : Prepared {
  Problem(const AttentionDims& dims, bool packed, std::uint64_t seed) : Prepared(dims, packed, seed, {0}) {
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  [[nodiscard]] AttentionProblem problem(int q_begin, int q_end) const {
    AttentionProblem p{.batch = d.batch, .seq = d.seq, .heads_q = d.heads_q, .heads_kv = d.heads_kv,
                       .head_dim = d.head_dim, .softmax_scale = scale};
    p.q_begin = q_begin;
    p.q_end = q_end;
    REQUIRE(oom::kernels::attention_can_implement(p));
    return p;
  }
  /// One backward call into `grad` with a fresh workspace of exactly the size asked for.
  void backward(BackwardFn fn, const AttentionProblem& p, DeviceQkv& grad, bool accumulate_dkv) const {
    DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));
    OOM_CUDA_CHECK(fn(p, as_const(in.q), as_const(in.k), as_const(in.v), as_const(o), dor, lse.get(), grad.q,
                      grad.k, grad.v, accumulate_dkv, ws.get(), ws.bytes(), nullptr));
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  [[nodiscard]] Grads download_grads(DeviceQkv& grad) const {
    return {download_bits(grad.q, d, d.heads_q), download_bits(grad.k, d, d.heads_kv),
            download_bits(grad.v, d, d.heads_kv)};
  }
};

/// |a - m| of two kernels' outputs that are each within slack u mag + 2u |ref| of the exact value
/// (|ref| <= mag: mag sums the magnitudes of the terms of ref): at most (2 slack + 4) u mag;
/// check_bounded adds 2u |m| + 1e-7 on top.
void check_against_mma(const char* what, const std::vector<bf16>& wg, const std::vector<bf16>& mma,
                       const std::vector<double>& mag, double slack) {
  check_bounded(to_float(wg), to_float(mma), mag, 2 * slack + 4, what);
}

const char* name(BackwardFn fn) {
  return fn == kMma ? "mma.sync" : fn == kWgmmaD256 ? "wgmma d256" : "wgmma";
}
/// The wgmma kernel of the head dim.
BackwardFn wgmma_for(const AttentionDims& d) { return d.head_dim == 256 ? kWgmmaD256 : kWgmma; }

/// Whole sequences, in query chunks run last to first (chunk_starts = {0} is one call).
void check_whole(const AttentionDims& d, bool packed, std::uint64_t seed, const std::vector<int>& chunk_starts = {0}) {
  require_sm90();
  INFO("B=" << d.batch << " S=" << d.seq << " Hq=" << d.heads_q << " Hkv=" << d.heads_kv
            << (packed ? " packed" : " separate") << " chunks=" << chunk_starts.size());
  const Problem pr(d, packed, seed);
  const auto run = [&](BackwardFn fn) {
    DeviceQkv grad(d, packed);  // poisoned
    for (std::size_t ch = chunk_starts.size(); ch-- > 0;) {
      const int qe = ch + 1 < chunk_starts.size() ? chunk_starts[ch + 1] : d.seq;
      pr.backward(fn, pr.problem(chunk_starts[ch], qe), grad, /*accumulate_dkv=*/ch + 1 < chunk_starts.size());
    }
    return pr.download_grads(grad);
  };
  const BackwardFn wgmma = wgmma_for(d);
  const Grads mma = run(kMma), wg = run(wgmma);
  // dK/dV of chunked runs are rounded to bf16 after each chunk: one more u mag per chunk.
  const double chunks = static_cast<double>(chunk_starts.size());
  for (const BackwardFn fn : {kMma, wgmma}) {
    const Grads& g = fn == kMma ? mma : wg;
    const std::string who = name(fn);
    check_bounded(to_float(g.dq), pr.dq_ref, pr.dq_mag, 4, (who + " dQ vs reference").c_str());
    check_bounded(to_float(g.dk), pr.dk_ref, pr.dk_mag, 4 + chunks, (who + " dK vs reference").c_str());
    check_bounded(to_float(g.dv), pr.dv_ref, pr.dv_mag, 4 + chunks, (who + " dV vs reference").c_str());
    if (d.seq > 1) {  // at S = 1 the exact dQ and dK are 0 and both are rounding noise
      INFO(who << ": relative L2 vs reference: dQ " << relative_l2(to_float(g.dq), pr.dq_ref) << ", dK "
               << relative_l2(to_float(g.dk), pr.dk_ref) << ", dV " << relative_l2(to_float(g.dv), pr.dv_ref));
      CHECK(relative_l2(to_float(g.dq), pr.dq_ref) < 1e-2);
      CHECK(relative_l2(to_float(g.dk), pr.dk_ref) < 1e-2);
      CHECK(relative_l2(to_float(g.dv), pr.dv_ref) < 1e-2);
    }
  }
  check_against_mma("dQ wgmma vs mma.sync", wg.dq, mma.dq, pr.dq_mag, 4);
  check_against_mma("dK wgmma vs mma.sync", wg.dk, mma.dk, pr.dk_mag, 4 + chunks);
  check_against_mma("dV wgmma vs mma.sync", wg.dv, mma.dv, pr.dv_mag, 4 + chunks);

  // No atomics: a second run is bit-identical.
  const Grads again = run(wgmma);
  CHECK_MESSAGE(bits_equal(again.dq, wg.dq), "wgmma dQ differs between two runs");
  CHECK_MESSAGE(bits_equal(again.dk, wg.dk), "wgmma dK differs between two runs");
  CHECK_MESSAGE(bits_equal(again.dv, wg.dv), "wgmma dV differs between two runs");
}

/// One query sub-range [q_begin, q_end) alone, accumulate_dkv false (dQ/dK/dV poisoned) or true
/// (dK/dV pre-filled with random bf16 values, dQ poisoned).
void check_range(const AttentionDims& d, bool packed, std::uint64_t seed, int q_begin, int q_end, bool accumulate) {
  require_sm90();
  INFO("B=" << d.batch << " S=" << d.seq << " Hq=" << d.heads_q << " Hkv=" << d.heads_kv
            << (packed ? " packed" : " separate") << " rows [" << q_begin << ", " << q_end << ")"
            << (accumulate ? " accumulate_dkv" : ""));
  const Problem pr(d, packed, seed);
  const std::size_t nkv = static_cast<std::size_t>(d.batch) * d.seq * d.heads_kv * d.head_dim;
  const auto dk_old = random_bf16(nkv, seed + 7), dv_old = random_bf16(nkv, seed + 8);
  const auto run = [&](BackwardFn fn) {
    DeviceQkv grad(d, packed);  // poisoned
    if (accumulate) {
      upload(grad.k, dk_old, d, d.heads_kv);
      upload(grad.v, dv_old, d, d.heads_kv);
    }
    pr.backward(fn, pr.problem(q_begin, q_end), grad, accumulate);
    return pr.download_grads(grad);
  };
  const BackwardFn wgmma = wgmma_for(d);
  const Grads mma = run(kMma);
  {
    const Grads wg = run(wgmma);

    // Rows outside what the call may write: untouched.
    std::size_t dq_touched = 0, dkv_touched = 0;
    for (int b = 0; b < d.batch; ++b)
      for (int i = 0; i < d.seq; ++i) {
        if (i < q_begin || i >= q_end)
          for (std::size_t x = 0; x < static_cast<std::size_t>(d.heads_q) * d.head_dim; ++x)
            dq_touched += wg.dq[(static_cast<std::size_t>(b) * d.seq + i) * d.heads_q * d.head_dim + x].bits != kPoison;
        if (i >= q_end)
          for (std::size_t x = 0; x < static_cast<std::size_t>(d.heads_kv) * d.head_dim; ++x) {
            const std::size_t e = (static_cast<std::size_t>(b) * d.seq + i) * d.heads_kv * d.head_dim + x;
            const std::uint16_t k_was = accumulate ? dk_old[e].bits : kPoison;
            const std::uint16_t v_was = accumulate ? dv_old[e].bits : kPoison;
            dkv_touched += (wg.dk[e].bits != k_was) + (wg.dv[e].bits != v_was);
          }
      }
    CHECK_MESSAGE(dq_touched == 0, dq_touched << " dQ elements written outside [q_begin, q_end)");
    CHECK_MESSAGE(dkv_touched == 0, dkv_touched << " dK/dV elements written at rows >= q_end");

    // dQ rows in the range against the reference (a row's dQ does not depend on the chunking); the
    // rest (poison in both kernels' outputs and NaN in neither reference) left out of the check.
    std::vector<float> dq_wg, dq_mma, dq_ref;
    std::vector<double> dq_mag;
    for (int b = 0; b < d.batch; ++b)
      for (int i = q_begin; i < q_end; ++i)
        for (std::size_t x = 0; x < static_cast<std::size_t>(d.heads_q) * d.head_dim; ++x) {
          const std::size_t e = (static_cast<std::size_t>(b) * d.seq + i) * d.heads_q * d.head_dim + x;
          dq_wg.push_back(oom::to_float(wg.dq[e]));
          dq_mma.push_back(oom::to_float(mma.dq[e]));
          dq_ref.push_back(pr.dq_ref[e]);
          dq_mag.push_back(pr.dq_mag[e]);
        }
    check_bounded(dq_wg, dq_ref, dq_mag, 4, "wgmma dQ vs reference");
    check_bounded(dq_mma, dq_ref, dq_mag, 4, "mma.sync dQ vs reference");
    // dK/dV rows [0, q_end): the chunk's partial sums (plus the old values) against mma.sync's. The
    // full sums' error scales bound the partial sums' (a subset of the same non-negative terms).
    std::vector<float> dk_wg, dk_mma, dv_wg, dv_mma;
    std::vector<double> dk_mag, dv_mag;
    for (int b = 0; b < d.batch; ++b)
      for (int j = 0; j < q_end; ++j)
        for (std::size_t x = 0; x < static_cast<std::size_t>(d.heads_kv) * d.head_dim; ++x) {
          const std::size_t e = (static_cast<std::size_t>(b) * d.seq + j) * d.heads_kv * d.head_dim + x;
          dk_wg.push_back(oom::to_float(wg.dk[e]));
          dk_mma.push_back(oom::to_float(mma.dk[e]));
          dv_wg.push_back(oom::to_float(wg.dv[e]));
          dv_mma.push_back(oom::to_float(mma.dv[e]));
          // an accumulated value carries one more rounding of the sum: u |old + partial| <= u (|old| + mag)
          dk_mag.push_back(pr.dk_mag[e] + (accumulate ? std::abs(oom::to_float(dk_old[e])) : 0.0));
          dv_mag.push_back(pr.dv_mag[e] + (accumulate ? std::abs(oom::to_float(dv_old[e])) : 0.0));
        }
    check_bounded(dk_wg, dk_mma, dk_mag, 2 * 5 + 4, "dK wgmma vs mma.sync (rows < q_end)");
    check_bounded(dv_wg, dv_mma, dv_mag, 2 * 5 + 4, "dV wgmma vs mma.sync (rows < q_end)");

    const Grads again = run(wgmma);
    CHECK_MESSAGE(bits_equal(again.dq, wg.dq), "wgmma dQ differs between two runs");
    CHECK_MESSAGE(bits_equal(again.dk, wg.dk), "wgmma dK differs between two runs");
    CHECK_MESSAGE(bits_equal(again.dv, wg.dv), "wgmma dV differs between two runs");
  }
}

using SumFn = decltype(&oom::kernels::attention_backward_mma_sync_dkv_sum);
static_assert(std::is_same_v<SumFn, decltype(&oom::kernels::hopper::attention_backward_wgmma_dkv_sum)>);
constexpr SumFn kMmaSum = &oom::kernels::attention_backward_mma_sync_dkv_sum;
constexpr SumFn kWgmmaSum = &oom::kernels::hopper::attention_backward_wgmma_dkv_sum;

/// fp32 (B, S, Hkv, D) sums rounded once to bf16, the way the layer rounds them.
std::vector<bf16> rounded(const std::vector<float>& sums) {
  std::vector<bf16> out(sums.size());
  for (std::size_t i = 0; i < sums.size(); ++i) out[i] = oom::to_bf16(sums[i]);
  return out;
}

/// Whole sequences in query chunks with dK/dV summed in fp32 (attention_backward_dkv_sum), the
/// chunks first to last or last to first, each kernel against its own whole call: dQ the same bits;
/// the sums, rounded once, within the whole call's bound of the reference (4 u mag) plus one u mag
/// for the fp32 summation order, and within the two kernels' bound of the whole call's dK/dV.
void check_sums(const AttentionDims& d, bool packed, std::uint64_t seed, const std::vector<int>& starts, bool reversed) {
  require_sm90();
  INFO("B=" << d.batch << " S=" << d.seq << " Hq=" << d.heads_q << " Hkv=" << d.heads_kv << " D=" << d.head_dim
            << (packed ? " packed" : " separate") << " chunks=" << starts.size() << (reversed ? " last first" : " first first"));
  const Problem pr(d, packed, seed);
  const std::size_t nkv = static_cast<std::size_t>(d.batch) * d.seq * d.heads_kv * d.head_dim;
  const std::int64_t kv_row = std::int64_t{d.heads_kv} * d.head_dim;
  for (const SumFn fn : {kMmaSum, kWgmmaSum}) {
    const BackwardFn whole_fn = fn == kMmaSum ? kMma : wgmma_for(d);
    CAPTURE(name(whole_fn));
    DeviceQkv whole(d, packed);
    pr.backward(whole_fn, pr.problem(0, d.seq), whole, false);
    const Grads w = pr.download_grads(whole);

    DeviceQkv grad(d, packed);  // poisoned: dQ rows are written chunk by chunk
    DeviceBuffer<float> dk_sum(nkv), dv_sum(nkv);
    dk_sum.zero();
    dv_sum.zero();
    const oom::kernels::AttentionDkvSums sums{{dk_sum.get(), d.seq * kv_row, kv_row}, {dv_sum.get(), d.seq * kv_row, kv_row}};
    for (std::size_t i = 0; i < starts.size(); ++i) {
      const std::size_t ch = reversed ? starts.size() - 1 - i : i;
      const int qe = ch + 1 < starts.size() ? starts[ch + 1] : d.seq;
      const AttentionProblem p = pr.problem(starts[ch], qe);
      DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));
      OOM_CUDA_CHECK(fn(p, as_const(pr.in.q), as_const(pr.in.k), as_const(pr.in.v), as_const(pr.o), pr.dor, pr.lse.get(),
                        grad.q, sums, ws.get(), ws.bytes(), nullptr));
    }
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_MESSAGE(bits_equal(download_bits(grad.q, d, d.heads_q), w.dq), "dQ in chunks differs from the whole call's");
    const auto dk = rounded(dk_sum.download()), dv = rounded(dv_sum.download());
    check_bounded(to_float(dk), pr.dk_ref, pr.dk_mag, 5, "summed dK vs reference");
    check_bounded(to_float(dv), pr.dv_ref, pr.dv_mag, 5, "summed dV vs reference");
    check_against_mma("summed dK vs the whole call's", dk, w.dk, pr.dk_mag, 5);
    check_against_mma("summed dV vs the whole call's", dv, w.dv, pr.dv_mag, 5);
    if (d.seq > 1) {
      CHECK(relative_l2(to_float(dk), to_float(w.dk)) < 2e-3);
      CHECK(relative_l2(to_float(dv), to_float(w.dv)) < 2e-3);
    }
  }
}

/// One chunk [0, q_end) added onto random sums: rows >= q_end keep their bits, rows below moved.
void check_sums_untouched(const AttentionDims& d, std::uint64_t seed, int q_end) {
  require_sm90();
  const Problem pr(d, false, seed);
  const std::size_t nkv = static_cast<std::size_t>(d.batch) * d.seq * d.heads_kv * d.head_dim;
  const std::int64_t kv_row = std::int64_t{d.heads_kv} * d.head_dim;
  const std::vector<float> old = to_float(random_bf16(nkv, seed + 1));
  for (const SumFn fn : {kMmaSum, kWgmmaSum}) {
    DeviceQkv grad(d, false);
    DeviceBuffer<float> dk_sum(nkv), dv_sum(nkv);
    dk_sum.upload(old);
    dv_sum.upload(old);
    const oom::kernels::AttentionDkvSums sums{{dk_sum.get(), d.seq * kv_row, kv_row}, {dv_sum.get(), d.seq * kv_row, kv_row}};
    const AttentionProblem p = pr.problem(0, q_end);
    DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));
    OOM_CUDA_CHECK(fn(p, as_const(pr.in.q), as_const(pr.in.k), as_const(pr.in.v), as_const(pr.o), pr.dor, pr.lse.get(), grad.q,
                      sums, ws.get(), ws.bytes(), nullptr));
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    std::size_t past_changed = 0, below_changed = 0;
    for (const auto& got : {dk_sum.download(), dv_sum.download()})
      for (std::size_t e = 0; e < nkv; ++e) {
        const int row = static_cast<int>((e / static_cast<std::size_t>(kv_row)) % static_cast<std::size_t>(d.seq));
        const bool changed = std::memcmp(&got[e], &old[e], sizeof(float)) != 0;
        (row >= q_end ? past_changed : below_changed) += changed;
      }
    CHECK_MESSAGE(past_changed == 0, name(fn == kMmaSum ? kMma : wgmma_for(d)) << ": " << past_changed << " sums changed at rows >= q_end");
    CHECK(below_changed > 0);
  }
}

}  // namespace

TEST_CASE("attention_backward_dkv_sum: query chunks with dK/dV summed in fp32, either order, against the whole call") {
  // Chunk edges on the layer's 128-token granularity and off every tile; head dims 128 and 256.
  check_sums(AttentionDims{1, 1000, 4, 2, kD}, true, 2100, {0, 384, 768}, false);
  check_sums(AttentionDims{2, 1000, 2, 2, kD}, false, 2110, {0, 512}, true);
  check_sums(AttentionDims{1, 700, 16, 2, 256}, false, 2120, {0, 256, 512}, false);
  check_sums(AttentionDims{2, 333, 4, 2, 256}, true, 2130, {0, 128, 256}, true);
  check_sums(AttentionDims{1, 300, 4, 2, kD}, false, 2140, {0, 63, 65, 190}, false);
  check_sums_untouched(AttentionDims{1, 500, 4, 2, kD}, 2150, 256);
  check_sums_untouched(AttentionDims{2, 300, 4, 2, 256}, 2160, 130);
}

TEST_CASE("attention_backward_wgmma refuses what attention_backward refuses, and another head_dim") {
  AttentionProblem p{.batch = 1, .seq = 64, .heads_q = 4, .heads_kv = 2, .head_dim = 128, .softmax_scale = 0.1f};
  DeviceBuffer<bf16> buf(64 * 512 * 4);
  DeviceBuffer<float> lse(4 * 64);
  const TokenRows<const bf16> in{buf.get(), 64 * 512, 512};
  const TokenRows<bf16> out{buf.get() + 64 * 512 * 2, 64 * 512, 512};
  const std::size_t need = oom::kernels::attention_backward_workspace_bytes(p);
  DeviceBuffer<unsigned char> ws(need + 256);
  const auto run = [&](BackwardFn fn, const AttentionProblem& prob, TokenRows<const bf16> q, TokenRows<bf16> dq,
                       void* w, std::size_t w_bytes) {
    return fn(prob, q, in, in, in, in, lse.get(), dq, out, out, false, w, w_bytes, nullptr);
  };
  for (const BackwardFn fn : {kMma, kWgmma}) {
    CAPTURE(name(fn));
    auto bad = p;
    bad.head_dim = 64;  // valid for none
    CHECK(run(fn, bad, in, out, ws.get(), ws.bytes()) == cudaErrorInvalidValue);
    bad = p;
    bad.heads_q = 3;
    CHECK(run(fn, bad, in, out, ws.get(), ws.bytes()) == cudaErrorInvalidValue);
    bad = p;
    bad.q_end = 65;
    CHECK(run(fn, bad, in, out, ws.get(), ws.bytes()) == cudaErrorInvalidValue);
    const TokenRows<const bf16> misaligned{buf.get() + 1, 64 * 512, 512};
    CHECK(run(fn, p, misaligned, out, ws.get(), ws.bytes()) == cudaErrorInvalidValue);
    const TokenRows<bf16> odd_stride{buf.get(), 64 * 512, 500};
    CHECK(run(fn, p, in, odd_stride, ws.get(), ws.bytes()) == cudaErrorInvalidValue);
    CHECK(fn(p, in, in, in, in, in, nullptr, out, out, out, false, ws.get(), ws.bytes(), nullptr) ==
          cudaErrorInvalidValue);
    CHECK(run(fn, p, in, out, ws.get(), need - 1) == cudaErrorInvalidValue);           // short workspace
    CHECK(run(fn, p, in, out, ws.get() + 16, need) == cudaErrorInvalidValue);         // misaligned workspace
    CHECK(run(fn, p, in, out, nullptr, need) == cudaErrorInvalidValue);
    auto empty = p;
    empty.q_begin = empty.q_end = 17;
    CHECK(run(fn, empty, in, out, nullptr, 0) == cudaSuccess);  // nothing to do
  }
  auto d256 = p;
  d256.head_dim = 256;  // valid for the mma.sync kernels and the d256 one, not for this one
  CHECK(run(kWgmma, d256, in, out, ws.get(), ws.bytes()) == cudaErrorNotSupported);
  CHECK(run(kWgmmaD256, p, in, out, ws.get(), ws.bytes()) == cudaErrorNotSupported);  // and the other way round
  // Off compute capability 9.0 there is no code to run: refused, not launched.
  if (!oom::test::device_is_sm90()) CHECK(run(kWgmma, p, in, out, ws.get(), ws.bytes()) == cudaErrorNotSupported);
}

TEST_CASE("attention_backward_wgmma matches the reference and the mma.sync backward, whole sequences") {
  std::uint64_t seed = 900;
  struct C {
    int batch, seq, hq, hkv;
    bool packed;
  };
  for (const C c : {C{1, 1, 4, 2, false}, C{2, 1, 2, 2, true}, C{2, 17, 4, 2, false}, C{1, 17, 2, 2, true},
                    C{1, 64, 4, 2, true}, C{2, 64, 2, 2, false}, C{1, 128, 4, 2, false}, C{2, 128, 2, 2, true},
                    C{1, 1000, 4, 2, true}, C{2, 1000, 2, 2, false}, C{1, 4099, 4, 2, false},
                    C{2, 4099, 2, 2, true}})
    check_whole(AttentionDims{c.batch, c.seq, c.hq, c.hkv, kD}, c.packed, seed += 10);
}

TEST_CASE("attention_backward_wgmma in query chunks, last to first with dK/dV accumulated") {
  // Chunk edges on no tile boundary, and chunks shorter than a tile ([63, 65)).
  check_whole(AttentionDims{1, 1000, 4, 2, kD}, true, 1100, {0, 333, 600});
  check_whole(AttentionDims{2, 1000, 2, 2, kD}, false, 1110, {0, 517});
  check_whole(AttentionDims{1, 300, 4, 2, kD}, false, 1120, {0, 63, 65, 190});
  check_whole(AttentionDims{2, 4099, 4, 2, kD}, true, 1130, {0, 1000, 2077, 4000});
}

TEST_CASE("attention_backward_wgmma_d256 matches the reference and the mma.sync backward: whole, chunked, sub-ranges") {
  // Sequences off the 64-row tiles, GQA and MHA, packed and separate; query chunks last to first
  // with dK/dV accumulated; single sub-ranges with and without accumulation.
  std::uint64_t seed = 1500;
  for (const AttentionDims d : {AttentionDims{1, 1, 4, 2, 256}, AttentionDims{2, 17, 4, 2, 256},
                                AttentionDims{1, 64, 2, 2, 256}, AttentionDims{2, 128, 4, 2, 256},
                                AttentionDims{1, 1000, 4, 2, 256}, AttentionDims{1, 2051, 2, 2, 256},
                                AttentionDims{1, 700, 16, 2, 256},  // the hybrid models' 16 / 2 heads
                                AttentionDims{2, 333, 16, 2, 256}})
    check_whole(d, d.seq % 2 == 0, seed += 10);
  check_whole(AttentionDims{1, 1000, 4, 2, 256}, true, 1600, {0, 333, 600});
  check_whole(AttentionDims{1, 300, 4, 2, 256}, false, 1610, {0, 63, 65, 190});
  for (const bool accumulate : {false, true}) {
    check_range(AttentionDims{1, 1000, 4, 2, 256}, false, seed += 10, 333, 700, accumulate);
    check_range(AttentionDims{2, 200, 4, 2, 256}, true, seed += 10, 130, 131, accumulate);
    check_range(AttentionDims{1, 700, 2, 2, 256}, true, seed += 10, 64, 600, accumulate);
  }
}

/// A head-dim-128 problem run by the head-dim-128 kernel, and embedded in columns [128 c, 128 c +
/// 128) of a head-dim-256 problem (zeros elsewhere; the same LSE and softmax scale) run by the
/// head-dim-256 kernel: the narrow gradients, the wide ones' live columns, and the count of wide
/// elements outside them that are not zero. Inputs are host (B, S, H, 128) rows.
struct LiveColumns {
  Grads narrow;
  std::vector<bf16> dq, dk, dv;  // live columns of the wide gradients, contiguous (B, S, H, 128)
  std::size_t dead_nonzero = 0;
  /// Elements of the live dV that are the narrow dV's bits.
  [[nodiscard]] std::size_t dv_same_bits() const {
    std::size_t same = 0;
    for (std::size_t x = 0; x < dv.size(); ++x) same += dv[x].bits == narrow.dv[x].bits;
    return same;
  }
};
LiveColumns run_live_columns(const AttentionDims& d128, int c, const AttentionProblem& p128, const std::vector<bf16>& q,
                             const std::vector<bf16>& k, const std::vector<bf16>& v, const std::vector<bf16>& o,
                             const std::vector<bf16>& d_o, const float* lse) {
  const AttentionDims d256{d128.batch, d128.seq, d128.heads_q, d128.heads_kv, 256};
  // (B, S, H, 128) host rows into the live columns of (B, S, H, 256), zeros elsewhere.
  const auto widen = [&](const std::vector<bf16>& narrow) {
    std::vector<bf16> wide(narrow.size() * 2, bf16{});
    for (std::size_t r = 0; r < narrow.size() / 128; ++r)
      std::copy_n(narrow.begin() + static_cast<std::ptrdiff_t>(r * 128), 128,
                  wide.begin() + static_cast<std::ptrdiff_t>(r * 256 + 128 * c));
    return wide;
  };
  const auto up = [](const std::vector<bf16>& host, const AttentionDims& d, int heads, DeviceBuffer<bf16>& buf) {
    buf = DeviceBuffer<bf16>(host);
    const std::int64_t row = std::int64_t{heads} * d.head_dim;
    return TokenRows<const bf16>{buf.get(), d.seq * row, row};
  };
  DeviceBuffer<bf16> nq, nk, nv, no, ndo, wq, wk, wv, wo, wdo;
  AttentionProblem p256 = p128;
  p256.head_dim = 256;  // softmax_scale kept: the narrow problem's
  DeviceQkv g128(d128, false), g256(d256, false);  // poisoned
  DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p256));
  OOM_CUDA_CHECK(kWgmma(p128, up(q, d128, d128.heads_q, nq), up(k, d128, d128.heads_kv, nk),
                        up(v, d128, d128.heads_kv, nv), up(o, d128, d128.heads_q, no), up(d_o, d128, d128.heads_q, ndo),
                        lse, g128.q, g128.k, g128.v, false, ws.get(), ws.bytes(), nullptr));
  OOM_CUDA_CHECK(kWgmmaD256(p256, up(widen(q), d256, d256.heads_q, wq), up(widen(k), d256, d256.heads_kv, wk),
                            up(widen(v), d256, d256.heads_kv, wv), up(widen(o), d256, d256.heads_q, wo),
                            up(widen(d_o), d256, d256.heads_q, wdo), lse, g256.q, g256.k, g256.v, false, ws.get(),
                            ws.bytes(), nullptr));
  LiveColumns out;
  out.narrow = {download_bits(g128.q, d128, d128.heads_q), download_bits(g128.k, d128, d128.heads_kv),
                download_bits(g128.v, d128, d128.heads_kv)};
  // Split each wide gradient into its live columns and the rest.
  const auto split = [&](const std::vector<bf16>& w, std::vector<bf16>* live) {
    for (std::size_t r = 0; r < w.size() / 256; ++r)
      for (std::size_t x = 0; x < 256; ++x) {
        const bf16 e = w[r * 256 + x];
        if (x / 128 == static_cast<std::size_t>(c))
          live->push_back(e);
        else if (oom::to_float(e) != 0.0f)
          ++out.dead_nonzero;
      }
  };
  split(download_bits(g256.q, d256, d256.heads_q), &out.dq);
  split(download_bits(g256.k, d256, d256.heads_kv), &out.dk);
  split(download_bits(g256.v, d256, d256.heads_kv), &out.dv);
  return out;
}

TEST_CASE("attention_backward_wgmma_d256 on 128 live columns: the head-dim-128 kernel's gradients to rounding, zeros elsewhere") {
  // A head-dim-128 problem embedded in a head-dim-256 one (run_live_columns). Every S^T, dP^T and
  // P the head-dim-256 kernel forms is then the head-dim-128 kernel's, bit for bit (its other eight
  // k-steps add exact zeros; both sum a key's dV over the same 64-query steps, and a row's dQ over
  // the same 64-key tiles, in the same order). So dV in the live columns must be the head-dim-128
  // kernel's bits (every H200 run so far: all of them), and every gradient is zero outside them.
  // dK and dQ also use D_i = rowsum(dO o O), which the head-dim-256 preprocess may sum in another
  // order: checked to within a rounding of the head-dim-128 values (a wrong panel or descriptor
  // gives errors of the values' own size). c = 0 checks warpgroup 0's panels (0, 1), c = 1
  // warpgroup 1's (2, 3). An exact check of the column halves that the comparisons with the
  // reference and the mma.sync kernel bound only loosely, and of the P^T exchange between the
  // warpgroups.
  require_sm90();
  for (const AttentionDims d128 : {AttentionDims{1, 777, 4, 2, 128}, AttentionDims{2, 300, 2, 2, 128}})
    for (const int c : {0, 1}) {
      INFO("B=" << d128.batch << " S=" << d128.seq << " Hq=" << d128.heads_q << " Hkv=" << d128.heads_kv
                << " live columns [" << 128 * c << ", " << 128 * c + 128 << ")");
      const Prepared t(d128, false, 2100 + static_cast<std::uint64_t>(c), {0});  // O, LSE by attention_forward
      const LiveColumns r = run_live_columns(
          d128, c, t.problem(0), download_bits(t.in.q, d128, d128.heads_q), download_bits(t.in.k, d128, d128.heads_kv),
          download_bits(t.in.v, d128, d128.heads_kv), download_bits(t.o, d128, d128.heads_q), t.do_buf.download(),
          t.lse.get());
      CHECK_MESSAGE(r.dead_nonzero == 0, r.dead_nonzero << " elements non-zero outside the live columns");
      CHECK_MESSAGE(r.dv_same_bits() == r.dv.size(), "dV, live columns: " << r.dv_same_bits() << " of " << r.dv.size()
                                                                          << " the head-dim-128 kernel's bits");
      check_bounded(to_float(r.dv), to_float(r.narrow.dv), t.dv_mag, 1, "dV, live columns, vs the head-dim-128 kernel");
      check_bounded(to_float(r.dk), to_float(r.narrow.dk), t.dk_mag, 1, "dK, live columns, vs the head-dim-128 kernel");
      check_bounded(to_float(r.dq), to_float(r.narrow.dq), t.dq_mag, 1, "dQ, live columns, vs the head-dim-128 kernel");
    }
}

TEST_CASE("attention_backward_wgmma_d256 on 128 live columns at S = 16384, Hq/Hkv = 16/4: dV the head-dim-128 kernel's bits") {
  // The case above where the CPU reference cannot go: every dK/dV block runs up to 1,024 steps
  // through the single exchange buffers, and a race there would change dV bits. Hashed inputs,
  // O and LSE from attention_forward at head_dim 128.
  require_sm90();
  const AttentionDims d128{1, 16384, 16, 4, 128};
  const std::size_t nq = static_cast<std::size_t>(d128.seq) * d128.heads_q * 128;
  const std::size_t nkv = static_cast<std::size_t>(d128.seq) * d128.heads_kv * 128;
  const auto q = hashed_bf16(nq, 31), k = hashed_bf16(nkv, 32), v = hashed_bf16(nkv, 33), d_o = hashed_bf16(nq, 34);
  DeviceQkv in(d128, false);
  upload(in.q, q, d128, d128.heads_q);
  upload(in.k, k, d128, d128.heads_kv);
  upload(in.v, v, d128, d128.heads_kv);
  DeviceBuffer<bf16> o_buf(nq);
  DeviceBuffer<float> lse(static_cast<std::size_t>(d128.heads_q) * d128.seq);
  const std::int64_t q_row = std::int64_t{d128.heads_q} * 128;
  const AttentionProblem p{.batch = 1, .seq = d128.seq, .heads_q = d128.heads_q, .heads_kv = d128.heads_kv,
                           .head_dim = 128, .softmax_scale = 1.0f / std::sqrt(128.0f)};
  OOM_CUDA_CHECK(oom::kernels::attention_forward(p, as_const(in.q), as_const(in.k), as_const(in.v),
                                                 TokenRows<bf16>{o_buf.get(), d128.seq * q_row, q_row}, lse.get(),
                                                 nullptr));
  const auto o = o_buf.download();
  for (const int c : {0, 1}) {
    INFO("live columns [" << 128 * c << ", " << 128 * c + 128 << ")");
    const LiveColumns r = run_live_columns(d128, c, p, q, k, v, o, d_o, lse.get());
    CHECK_MESSAGE(r.dead_nonzero == 0, r.dead_nonzero << " elements non-zero outside the live columns");
    CHECK_MESSAGE(r.dv_same_bits() == r.dv.size(), "dV, live columns: " << r.dv_same_bits() << " of " << r.dv.size()
                                                                        << " the head-dim-128 kernel's bits");
    // dK, dQ: within bf16 roundings of D_i's summation order (a wrong panel or descriptor: errors of
    // the values' own size).
    const double l2_dk = relative_l2(to_float(r.dk), to_float(r.narrow.dk));
    const double l2_dq = relative_l2(to_float(r.dq), to_float(r.narrow.dq));
    MESSAGE("live columns [" << 128 * c << ", +128): relative L2 against the head-dim-128 kernel: dK " << l2_dk
                             << ", dQ " << l2_dq);
    CHECK(l2_dk < 1e-2);
    CHECK(l2_dq < 1e-2);
  }
}

TEST_CASE("attention_backward_wgmma on one query sub-range: rows outside it untouched") {
  std::uint64_t seed = 1300;
  struct R {
    int batch, seq, hq, hkv;
    bool packed;
    int q_begin, q_end;
  };
  for (const bool accumulate : {false, true})
    for (const R r : {R{1, 1000, 4, 2, false, 333, 700}, R{2, 4099, 4, 2, true, 1000, 2077},
                      R{1, 64, 2, 2, false, 17, 40}, R{2, 200, 4, 2, true, 130, 131}, R{1, 1000, 2, 2, true, 0, 1},
                      R{2, 1000, 4, 2, false, 936, 1000}, R{1, 700, 2, 2, false, 64, 600},
                      R{1, 300, 4, 2, true, 190, 300}, R{1, 1000, 4, 2, false, 128, 256}})
      check_range(AttentionDims{r.batch, r.seq, r.hq, r.hkv, kD}, r.packed, seed += 10, r.q_begin, r.q_end,
                  accumulate);
}

TEST_CASE("on compute capability 9.0 attention_forward/backward run the wgmma kernels at head_dim 128 and 256") {
  // The dispatch in src/kernels/attention_{forward,backward}.cu: the public entry points must give
  // the bits of the kernel they are meant to run (the wgmma and mma.sync kernels sum in different
  // orders, so their bits differ: the warning below says so if this test ever loses that power).
  require_sm90();
  for (const int hd : {128, 256}) {
    CAPTURE(hd);
    const Prepared t({1, 300, 4, 2, hd}, true, 900 + static_cast<std::uint64_t>(hd), {0});  // forward by attention_forward
    const auto forward_bits = [&](auto&& fn) {
      DeviceBuffer<bf16> o_buf(t.o_buf.size());
      DeviceBuffer<float> lse(t.lse.size());
      const TokenRows<bf16> o{o_buf.get(), t.o.batch_stride, t.o.token_stride};
      OOM_CUDA_CHECK(fn(t.problem(0), as_const(t.in.q), as_const(t.in.k), as_const(t.in.v), o, lse.get(), nullptr));
      return std::pair{o_buf.download(), lse.download()};
    };
    const auto mma = forward_bits(oom::kernels::attention_forward_mma_sync);
    const auto want = forward_bits(hd == 128 ? &oom::kernels::hopper::attention_forward_wgmma
                                             : &oom::kernels::hopper::attention_forward_wgmma_d256);
    const auto o_public = t.o_buf.download();
    const auto lse_public = t.lse.download();
    CHECK(bits_equal(o_public, want.first));
    CHECK(std::memcmp(lse_public.data(), want.second.data(), lse_public.size() * sizeof(float)) == 0);
    WARN_FALSE(bits_equal(want.first, mma.first));

    DeviceQkv g_public(t.d, true), g_want(t.d, true);
    DeviceBuffer<unsigned char> ws(t.workspace_bytes(oom::kernels::attention_backward_workspace_bytes));
    const auto [dq, dk, dv] = t.backward(oom::kernels::attention_backward, g_public, ws.get(), ws.bytes());
    const BackwardFn meant = hd == 128 ? kWgmma : kWgmmaD256;
    const auto [dq_w, dk_w, dv_w] = t.backward(meant, g_want, ws.get(), ws.bytes());
    CHECK(dq == dq_w);
    CHECK(dk == dk_w);
    CHECK(dv == dv_w);
  }
}

TEST_CASE("attention_backward_wgmma vs mma.sync at head dims 128 and 256: timing at S = 4096, 16384, 65536 (B = 1, Hq/Hkv = 16/4)") {
  // Printed, not asserted. Backward FLOPs counted as 2.5x the causal forward's 2 S^2 Hq D (as
  // test_attention's 1M case): five S x S products of 2 D FLOP per entry over half the square.
  require_sm90();
  const int hq = 16, hkv = 4;
  for (const auto& [hd, s] : {std::pair{128, 4096}, std::pair{128, 16384}, std::pair{128, 65536}, std::pair{256, 4096},
                              std::pair{256, 16384}, std::pair{256, 65536}}) {
    const AttentionDims d{1, s, hq, hkv, hd};
    const BackwardFn wgmma = wgmma_for(d);
    const std::size_t nq = static_cast<std::size_t>(s) * hq * hd, nkv = static_cast<std::size_t>(s) * hkv * hd;
    DeviceQkv in(d, false), grad_mma(d, false), grad_wg(d, false), grad_again(d, false);
    upload(in.q, hashed_bf16(nq, 1), d, hq);
    upload(in.k, hashed_bf16(nkv, 2), d, hkv);
    upload(in.v, hashed_bf16(nkv, 3), d, hkv);
    DeviceBuffer<bf16> o_buf(nq), do_buf(hashed_bf16(nq, 4));
    DeviceBuffer<float> lse(static_cast<std::size_t>(hq) * s);
    const std::int64_t q_row = std::int64_t{hq} * hd;
    const TokenRows<bf16> o{o_buf.get(), s * q_row, q_row};
    const TokenRows<const bf16> dor{do_buf.get(), s * q_row, q_row};
    const AttentionProblem p{.batch = 1, .seq = s, .heads_q = hq, .heads_kv = hkv, .head_dim = hd,
                             .softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd))};
    OOM_CUDA_CHECK(oom::kernels::attention_forward(p, as_const(in.q), as_const(in.k), as_const(in.v), o, lse.get(),
                                                   nullptr));
    DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));
    oom::test::Stream stream;
    const auto launcher = [&](BackwardFn fn, DeviceQkv& grad) {
      return [&, fn](cudaStream_t st) {
        OOM_CUDA_CHECK(fn(p, as_const(in.q), as_const(in.k), as_const(in.v), as_const(o), dor, lse.get(), grad.q,
                          grad.k, grad.v, false, ws.get(), ws.bytes(), st));
      };
    };
    const int repeats = s >= 65536 ? 3 : 10;
    const double ms_mma = oom::test::time_ms(launcher(kMma, grad_mma), stream.s, repeats);
    const double ms_wg = oom::test::time_ms(launcher(wgmma, grad_wg), stream.s, repeats);
    const double flops = 2.5 * 2.0 * static_cast<double>(s) * s * hq * hd;
    std::printf("S=%5d B=1 Hq/Hkv=%d/%d D=%d causal backward: mma.sync %.3f ms = %.0f TFLOP/s | %s %.3f ms = %.0f "
                "TFLOP/s (%.2fx)\n",
                s, hq, hkv, hd, ms_mma, flops / ms_mma / 1e9, name(wgmma), ms_wg, flops / ms_wg / 1e9, ms_mma / ms_wg);
    std::fflush(stdout);
    // No atomics: one more run, into fresh (poisoned) buffers, gives the timed runs' bits at sizes
    // the other cases do not reach.
    launcher(wgmma, grad_again)(stream.s);  // (download_bits synchronises)
    CHECK_MESSAGE(bits_equal(download_bits(grad_wg.q, d, hq), download_bits(grad_again.q, d, hq)),
                  "wgmma dQ differs between two runs at S=" << s);
    CHECK_MESSAGE(bits_equal(download_bits(grad_wg.k, d, hkv), download_bits(grad_again.k, d, hkv)),
                  "wgmma dK differs between two runs at S=" << s);
    CHECK_MESSAGE(bits_equal(download_bits(grad_wg.v, d, hkv), download_bits(grad_again.v, d, hkv)),
                  "wgmma dV differs between two runs at S=" << s);
    // A size the CPU reference cannot afford: the two kernels against each other.
    for (const auto& [what, a, m] :
         {std::tuple{"dQ", download(grad_wg.q, d, hq), download(grad_mma.q, d, hq)},
          std::tuple{"dK", download(grad_wg.k, d, hkv), download(grad_mma.k, d, hkv)},
          std::tuple{"dV", download(grad_wg.v, d, hkv), download(grad_mma.v, d, hkv)}}) {
      const double l2 = relative_l2(a, m);
      INFO("S=" << s << ": relative L2 of the wgmma " << what << " vs mma.sync " << l2);
      CHECK(l2 < 1e-2);
    }
  }
}
