// GPU checks of the gated delta rule kernels (oom/kernels/gated_delta.hpp) against the CPU
// reference (oom/reference/gated_delta.hpp): fresh random inputs, shapes no tile divides (odd
// token counts, head dims of 4 to 128 that are no multiple of 32, chunks that do not divide the
// sequence), several sequences, outputs poisoned (NaN) before every run, every run repeated for
// the same bits. Tolerances are justified next to each check. The last case times the Qwen3-Next
// linear layer's shape at 4K tokens (printed, not asserted; scripts/bench_gated_delta_torch.py
// times PyTorch's chunked rule on the same shape for the ratio).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/kernels/gated_delta.hpp"
#include "oom/kernels/refusal.hpp"
#include "oom/reference/gated_delta.hpp"
#include "support/check_scaled.hpp"

namespace k = oom::kernels;
namespace ref = oom::reference;
using oom::bf16;
using oom::test::Bf16Data;
using oom::test::check_scaled;
using oom::test::DeviceBuffer;
using oom::test::random_normal;
using oom::test::to_floats;

namespace {

struct Inputs {
  Bf16Data q, k, v, d_out;
  std::vector<float> g, beta;
};

Inputs make_inputs(const k::GatedDeltaDims& d, std::uint64_t seed) {
  const auto T = static_cast<std::size_t>(d.tokens());
  const auto qk = T * static_cast<std::size_t>(d.k_heads * d.k_dim), vv = T * static_cast<std::size_t>(d.v_heads * d.v_dim);
  std::vector<float> g(T * static_cast<std::size_t>(d.v_heads)), beta(g.size());
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = -(0.01f + 1.5f * u(rng));  // decays exp(g) from 0.22 to 0.99, as the models' gates give
    beta[i] = 1.0f / (1.0f + std::exp(-3.0f * (u(rng) - 0.5f)));
  }
  return {Bf16Data(random_normal(qk, seed + 1)), Bf16Data(random_normal(qk, seed + 2)), Bf16Data(random_normal(vv, seed + 3)),
          Bf16Data(random_normal(vv, seed + 4)), std::move(g), std::move(beta)};
}

/// Rows [b S, (b + 1) S) of a (T, width) array.
std::vector<float> rows(const std::vector<float>& a, std::int64_t b, std::int64_t S, std::int64_t width) {
  return {a.begin() + b * S * width, a.begin() + (b + 1) * S * width};
}

struct Reference {
  std::vector<float> out, states, dq, dk, dv, dg, dbeta;
};

/// The reference run per sequence, concatenated in the kernels' layouts.
Reference reference(const k::GatedDeltaDims& d, const Inputs& in) {
  Reference r;
  const ref::GatedDeltaShape shape{d.seq_len, d.k_heads, d.v_heads, d.k_dim, d.v_dim};
  for (std::int64_t b = 0; b < d.sequences; ++b) {
    const auto q = rows(in.q.values, b, d.seq_len, d.k_heads * d.k_dim), kk = rows(in.k.values, b, d.seq_len, d.k_heads * d.k_dim);
    const auto v = rows(in.v.values, b, d.seq_len, d.v_heads * d.v_dim), dout = rows(in.d_out.values, b, d.seq_len, d.v_heads * d.v_dim);
    const auto g = rows(in.g, b, d.seq_len, d.v_heads), beta = rows(in.beta, b, d.seq_len, d.v_heads);
    const auto fwd = ref::gated_delta_rule_chunked_forward(shape, q, kk, v, g, beta, d.chunk);
    const auto bwd = ref::gated_delta_rule_backward(shape, q, kk, v, g, beta, dout);
    auto append = [](std::vector<float>& to, const std::vector<float>& from) { to.insert(to.end(), from.begin(), from.end()); };
    append(r.out, fwd.out);
    append(r.states, fwd.states);  // (v_heads, chunks + 1, dk, dv) per sequence: the kernels' (B, v_heads, ...) order
    append(r.dq, bwd.dq);
    append(r.dk, bwd.dk);
    append(r.dv, bwd.dv);
    append(r.dg, bwd.dg);
    append(r.dbeta, bwd.dbeta);
  }
  return r;
}


struct Run {
  std::vector<bf16> out, dq, dk, dv;
  std::vector<float> states, dg, dbeta;
};

/// The forward with dims `fwd`, then the backward with `bwd` (the same shape; the forms may differ)
/// from the states that forward kept.
Run run(const k::GatedDeltaDims& fwd, const k::GatedDeltaDims& bwd, const Inputs& in) {
  const DeviceBuffer<bf16> q(in.q.bits), kk(in.k.bits), v(in.v.bits), dout(in.d_out.bits);
  const DeviceBuffer<float> g(in.g), beta(in.beta);
  DeviceBuffer<bf16> out(in.v.bits.size()), dq(in.q.bits.size()), dk(in.k.bits.size()), dv(in.v.bits.size());
  DeviceBuffer<float> states(k::gated_delta_states_floats(fwd)), dg(in.g.size()), dbeta(in.g.size());
  DeviceBuffer<std::byte> ws(k::gated_delta_backward_workspace_bytes(bwd));
  OOM_CUDA_CHECK(k::gated_delta_forward(fwd, q.get(), kk.get(), v.get(), g.get(), beta.get(), out.get(), states.get(), nullptr));
  OOM_CUDA_CHECK(k::gated_delta_backward(bwd, q.get(), kk.get(), v.get(), g.get(), beta.get(), dout.get(), states.get(), dq.get(),
                                         dk.get(), dv.get(), dg.get(), dbeta.get(), ws.get(), ws.size(), nullptr));
  return {out.download(), dq.download(), dk.download(), dv.download(), states.download(), dg.download(), dbeta.download()};
}
Run run(const k::GatedDeltaDims& d, const Inputs& in) { return run(d, d, in); }

/// `d` with the forward in form `fwd` and the backward in form `bwd`.
Run run_forms(k::GatedDeltaDims d, k::GatedDeltaDims::Form fwd, k::GatedDeltaDims::Form bwd, const Inputs& in) {
  k::GatedDeltaDims backward = d;
  d.form = fwd;
  backward.form = bwd;
  return run(d, backward, in);
}

bool same_bits(const auto& a, const auto& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

/// The forward's output and the backward's five gradients of two runs: each the same bits.
void check_same_bits(const Run& got, const Run& want) {
  CHECK_MESSAGE(same_bits(got.out, want.out), "out differs");
  CHECK_MESSAGE(same_bits(got.dq, want.dq), "dq differs");
  CHECK_MESSAGE(same_bits(got.dk, want.dk), "dk differs");
  CHECK_MESSAGE(same_bits(got.dv, want.dv), "dv differs");
  CHECK_MESSAGE(same_bits(got.dg, want.dg), "dg differs");
  CHECK_MESSAGE(same_bits(got.dbeta, want.dbeta), "dbeta differs");
}

}  // namespace

TEST_CASE("the gated delta rule's forward and backward match the CPU reference") {
  // {sequences, seq_len, k_heads, v_heads, k_dim, v_dim, chunk}
  const k::GatedDeltaDims cases[] = {
      {1, 1, 1, 1, 4, 4, 64},      // one token
      {2, 37, 2, 4, 16, 24, 16},   // grouped value heads, a chunk that does not divide the sequence
      {3, 9, 2, 2, 33, 7, 4},      // head dims no multiple of anything; 3 chunks of 4, 4, 1
      {1, 130, 1, 2, 128, 128, 64},  // the models' head dims, several tiles of the forward
      {2, 50, 2, 4, 100, 70, 24},    // padded rows (100 of 128) and columns (70 of 72): a forward block
                                     // of 6 columns at j0 = 64, backward padding lanes in the 9th warp
      {1, 300, 2, 4, 128, 128, 64},  // the models' chunk: four whole chunks and a short one
      {2, 45, 1, 1, 17, 33, 7},      // a chunked block's tiles cut at 1 column (33 = 32 + 1, 16 + 16 + 1)
  };
  using Form = k::GatedDeltaDims::Form;
  std::uint64_t seed = 100;
  const bool chunked_here = k::gated_delta_chunked_supported();
  if (!chunked_here) MESSAGE("this GPU cannot run the chunked form (compute capability 9.0 and its shared memory): the recurrent one only");
  // Each form, and the recurrent forward's states taken by the chunked backward (what `automatic`
  // runs from three waves of the chunked form's blocks on).
  for (const auto& [form, backward_form] :
       {std::pair{Form::chunked, Form::chunked}, std::pair{Form::recurrent, Form::recurrent}, std::pair{Form::recurrent, Form::chunked}})
  for (k::GatedDeltaDims d : cases) {
    if (backward_form == Form::chunked && !chunked_here) continue;
    d.form = form;
    k::GatedDeltaDims bd = d;
    bd.form = backward_form;
    CAPTURE(static_cast<int>(form));
    CAPTURE(static_cast<int>(backward_form));
    CAPTURE(d.sequences);
    CAPTURE(d.seq_len);
    CAPTURE(d.k_dim);
    CAPTURE(d.v_dim);
    CAPTURE(d.chunk);
    const Inputs in = make_inputs(d, seed += 10);
    const Reference want = reference(d, in);
    const Run got = run(d, bd, in);
    // bf16 outputs: one rounding of an fp32 result (<= 2^-9 relative) and the fp32-vs-fp64 sums
    // on either side of a rounding boundary: 2^-7 relative; plus 1e-3 of the tensor's scale for
    // values that cancel to near zero (the recurrence's sums run over dk terms a token, T tokens).
    check_scaled(to_floats(got.out), want.out, 1.0 / 128, 1e-3, "out");
    check_scaled(to_floats(got.dv), want.dv, 1.0 / 128, 1e-3, "dv");
    check_scaled(to_floats(got.dq), want.dq, 1.0 / 128, 1e-3, "dq");
    check_scaled(to_floats(got.dk), want.dk, 1.0 / 128, 1e-3, "dk");
    // fp32 outputs: the same sums in fp32 against fp64 (rounding ~1e-7 a term over up to dk x dv
    // terms a token): 1e-4 relative plus 1e-5 of the scale for the states, which carry no bf16
    // rounding, and 1e-3 / 1e-4 for the gates' gradients, which sum dk x dv products of gradients
    // that passed through bf16 inputs.
    check_scaled(got.states, want.states, 1e-4, 1e-5, "states");
    check_scaled(got.dg, want.dg, 1e-3, 1e-4, "dg");
    check_scaled(got.dbeta, want.dbeta, 1e-3, 1e-4, "dbeta");
    // The same bits again (fresh, poisoned buffers).
    const Run again = run(d, bd, in);
    check_same_bits(again, got);
    CHECK(same_bits(again.states, got.states));
  }
}

TEST_CASE("precision: both forms' fp32 results within 1e-5 relative L2 of the fp64 reference") {
  // The chunked form takes its products on the tensor cores as tf32 pairs (three tf32 products for
  // each fp32 one, within ~2^-20 relative each); the recurrent form takes them on the FMA pipes. At the
  // models' head dims, over seven chunks, the fp32 outputs (the kept states and the gates'
  // gradients, which carry no bf16 rounding of their own) are compared with the fp64 reference by
  // relative L2 error. Measured on the H200 (2026-12-04): chunked 0.8-1.6e-6 (its FMA version
  // 0.5-1.3e-6: the chunk's decays exp(G_i - G_j) and its solve cost an order over the recurrence),
  // recurrent 0.8-1.7e-7. Products in plain tf32 (10 mantissa bits) would leave ~1e-4 or more.
  const bool chunked_here = k::gated_delta_chunked_supported();
  if (!chunked_here) MESSAGE("this GPU cannot run the chunked form: the recurrent one only");
  using Form = k::GatedDeltaDims::Form;
  k::GatedDeltaDims d{1, 448, 1, 2, 128, 128, 64};
  const Inputs in = make_inputs(d, 77);
  const Reference want = reference(d, in);
  auto rel_l2 = [](const std::vector<float>& got, const std::vector<float>& ref) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
      den += static_cast<double>(ref[i]) * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
  };
  d.form = Form::recurrent;
  const Run recurrent = run(d, in);
  d.form = chunked_here ? Form::chunked : Form::recurrent;
  const Run chunked = run(d, in);
  const std::pair<const char*, std::vector<float> Run::*> fp32_outputs[] = {
      {"states", &Run::states}, {"dg", &Run::dg}, {"dbeta", &Run::dbeta}};
  std::vector<float> Reference::*const wants[] = {&Reference::states, &Reference::dg, &Reference::dbeta};
  for (std::size_t o = 0; o < std::size(fp32_outputs); ++o) {
    const auto& [name, member] = fp32_outputs[o];
    const double c = rel_l2(chunked.*member, want.*wants[o]), r = rel_l2(recurrent.*member, want.*wants[o]);
    MESSAGE(std::string(name) << ": relative L2 error, chunked " << c << ", recurrent " << r);
    CHECK_MESSAGE(c <= 1e-5, std::string(name));
    CHECK_MESSAGE(r <= 1e-5, std::string(name));
  }
  const std::pair<const char*, std::vector<bf16> Run::*> bf16_outputs[] = {
      {"out", &Run::out}, {"dq", &Run::dq}, {"dk", &Run::dk}, {"dv", &Run::dv}};
  std::vector<float> Reference::*const bf16_wants[] = {&Reference::out, &Reference::dq, &Reference::dk, &Reference::dv};
  for (std::size_t o = 0; o < std::size(bf16_outputs); ++o) {  // bf16 rounding (~2^-9) dominates both: printed
    const auto& [name, member] = bf16_outputs[o];
    MESSAGE(std::string(name) << ": relative L2 error, chunked " << rel_l2(to_floats(chunked.*member), want.*bf16_wants[o]) << ", recurrent "
                 << rel_l2(to_floats(recurrent.*member), want.*bf16_wants[o]));
  }
}

TEST_CASE("the backward as a cluster of blocks per head gives the one-block backward's bits") {
  int device = 0, major = 0;
  OOM_CUDA_CHECK(cudaGetDevice(&device));
  OOM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  using Path = k::GatedDeltaDims::Backward;
  if (major < 9) {
    // Refused, named, where the device has no clusters; `automatic` takes one block a head there.
    k::GatedDeltaDims d{1, 5, 1, 1, 8, 8, 4};
    d.form = k::GatedDeltaDims::Form::recurrent;
    d.backward = Path::cluster;
    DeviceBuffer<std::byte> ws(k::gated_delta_backward_workspace_bytes(d));
    const DeviceBuffer<bf16> x(std::vector<bf16>(40));
    DeviceBuffer<bf16> dx(40);
    DeviceBuffer<float> gates(std::vector<float>(5, -0.1f)), dgates(5), states(k::gated_delta_states_floats(d));
    CHECK(k::gated_delta_backward(d, x.get(), x.get(), x.get(), gates.get(), gates.get(), x.get(), states.get(), dx.get(), dx.get(),
                                  dx.get(), dgates.get(), dgates.get(), ws.get(), ws.size(), nullptr) == cudaErrorInvalidValue);
    MESSAGE("compute capability ", major, ".x has no clusters: the cluster backward is refused there, not compared");
    return;
  }
  // {sequences, seq_len, k_heads, v_heads, k_dim, v_dim, chunk}: clusters of 1 (dv <= 32), 2 (a
  // second block of 6 real columns and 26 idle), 3 and 4 blocks; every row width R; chunks that do
  // not divide the sequence and tiles cut short.
  const k::GatedDeltaDims cases[] = {
      {3, 9, 2, 2, 33, 7, 4},  {2, 37, 2, 4, 16, 24, 16}, {2, 50, 2, 4, 100, 70, 24},
      {1, 77, 1, 3, 64, 96, 32}, {1, 130, 1, 2, 128, 128, 64},
  };
  std::uint64_t seed = 500;
  for (k::GatedDeltaDims d : cases) {
    CAPTURE(d.v_dim);
    CAPTURE(d.k_dim);
    const Inputs in = make_inputs(d, seed += 10);
    d.form = k::GatedDeltaDims::Form::recurrent;
    d.backward = Path::one_block;
    const Run one = run(d, in);
    d.backward = Path::cluster;
    const Run clustered = run(d, in);
    check_same_bits(clustered, one);
    // And the reference's values, so that two equally wrong paths cannot pass (tolerances as above).
    const Reference want = reference(d, in);
    check_scaled(to_floats(clustered.dq), want.dq, 1.0 / 128, 1e-3, "dq");
    check_scaled(to_floats(clustered.dk), want.dk, 1.0 / 128, 1e-3, "dk");
    check_scaled(to_floats(clustered.dv), want.dv, 1.0 / 128, 1e-3, "dv");
    check_scaled(clustered.dg, want.dg, 1e-3, 1e-4, "dg");
    check_scaled(clustered.dbeta, want.dbeta, 1e-3, 1e-4, "dbeta");
  }
}

TEST_CASE("a sequence run in parts gives the whole run's bits, the state and its gradient carried between them") {
  // {sequences, seq_len, k_heads, v_heads, k_dim, v_dim, chunk}: one sequence cut at tokens 64 and
  // 160 (multiples of the chunk), the last part short of a whole chunk.
  const k::GatedDeltaDims whole{1, 200, 2, 4, 64, 48, 32};
  const Inputs in = make_inputs(whole, 900);
  const ref::GatedDeltaShape shape{whole.seq_len, whole.k_heads, whole.v_heads, whole.k_dim, whole.v_dim};
  const std::int64_t kw = whole.k_heads * whole.k_dim, vw = whole.v_heads * whole.v_dim, H = whole.v_heads;
  const std::int64_t state = whole.k_dim * whole.v_dim, stride = (whole.chunks() + 1) * state;
  const std::int64_t cuts[] = {0, 64, 160, 200};
  using Path = k::GatedDeltaDims::Backward;
  // d_state on entry to the last part: zeros (a whole sequence), then a random gradient of the final state.
  const std::vector<float> zeros(static_cast<std::size_t>(H * state), 0.0f);
  const std::vector<float> d_final = random_normal(static_cast<std::size_t>(H * state), 901);
  for (const bool carried_in : {false, true}) {
    const auto want = ref::gated_delta_rule_backward_from(shape, in.q.values, in.k.values, in.v.values, in.g, in.beta, in.d_out.values,
                                                          {}, carried_in ? std::span<const float>(d_final) : std::span<const float>());
    using Form = k::GatedDeltaDims::Form;
    for (const auto& [form, path] : {std::pair{Form::chunked, Path::automatic}, std::pair{Form::recurrent, Path::one_block},
                                     std::pair{Form::recurrent, Path::cluster}}) {
      if ((form == Form::chunked && !k::gated_delta_chunked_supported()) || (path == Path::cluster && !k::gated_delta_chunked_supported()))
        continue;  // (the recurrent cluster path needs compute capability 9.0 as well)
      CAPTURE(carried_in);
      CAPTURE(static_cast<int>(form));
      CAPTURE(static_cast<int>(path));
      k::GatedDeltaDims wd = whole;
      wd.form = form;
      wd.backward = path;
      // The whole run, with the same incoming gradient of the final state.
      const DeviceBuffer<bf16> q(in.q.bits), kk(in.k.bits), v(in.v.bits), dout(in.d_out.bits);
      const DeviceBuffer<float> g(in.g), beta(in.beta);
      DeviceBuffer<bf16> out(in.v.bits.size()), dq(in.q.bits.size()), dk(in.k.bits.size()), dv(in.v.bits.size());
      DeviceBuffer<float> states(k::gated_delta_states_floats(wd)), dg(in.g.size()), dbeta(in.g.size());
      DeviceBuffer<float> d_state(carried_in ? d_final : zeros);
      DeviceBuffer<std::byte> ws(k::gated_delta_backward_workspace_bytes(wd));
      OOM_CUDA_CHECK(k::gated_delta_forward(wd, q.get(), kk.get(), v.get(), g.get(), beta.get(), out.get(), states.get(), nullptr));
      OOM_CUDA_CHECK(k::gated_delta_backward(wd, q.get(), kk.get(), v.get(), g.get(), beta.get(), dout.get(), states.get(), dq.get(),
                                             dk.get(), dv.get(), dg.get(), dbeta.get(), d_state.get(), ws.get(), ws.size(), nullptr));
      const Run one{out.download(), dq.download(), dk.download(), dv.download(), states.download(), dg.download(), dbeta.download()};
      const auto one_d_initial = d_state.download();
      // Against the reference (tolerances as in the first case; the carried gradient like the states').
      check_scaled(to_floats(one.dq), want.grads.dq, 1.0 / 128, 1e-3, "dq");
      check_scaled(to_floats(one.dk), want.grads.dk, 1.0 / 128, 1e-3, "dk");
      check_scaled(to_floats(one.dv), want.grads.dv, 1.0 / 128, 1e-3, "dv");
      check_scaled(one.dg, want.grads.dg, 1e-3, 1e-4, "dg");
      check_scaled(one_d_initial, want.d_initial, 1e-3, 1e-4, "d_initial");
      // In parts: the forward in order, each from the state the part before kept; the backward in
      // reverse, each taking the part after's gradient of the state between them.
      out.poison(), states.poison(), dq.poison(), dk.poison(), dv.poison(), dg.poison(), dbeta.poison();
      d_state.upload(carried_in ? d_final : zeros);
      for (int i = 0; i + 1 < 4; ++i) {
        k::GatedDeltaDims pd = wd;
        const std::int64_t c0 = cuts[i];
        pd.seq_len = cuts[i + 1] - c0;
        pd.states_stride = stride;
        pd.from_kept_state = c0 > 0;
        OOM_CUDA_CHECK(k::gated_delta_forward(pd, q.get() + c0 * kw, kk.get() + c0 * kw, v.get() + c0 * vw, g.get() + c0 * H,
                                              beta.get() + c0 * H, out.get() + c0 * vw, states.get() + c0 / whole.chunk * state,
                                              nullptr));
      }
      for (int i = 2; i >= 0; --i) {
        k::GatedDeltaDims pd = wd;
        const std::int64_t c0 = cuts[i];
        pd.seq_len = cuts[i + 1] - c0;
        pd.states_stride = stride;
        DeviceBuffer<std::byte> pws(k::gated_delta_backward_workspace_bytes(pd));
        OOM_CUDA_CHECK(k::gated_delta_backward(pd, q.get() + c0 * kw, kk.get() + c0 * kw, v.get() + c0 * vw, g.get() + c0 * H,
                                               beta.get() + c0 * H, dout.get() + c0 * vw, states.get() + c0 / whole.chunk * state,
                                               dq.get() + c0 * kw, dk.get() + c0 * kw, dv.get() + c0 * vw, dg.get() + c0 * H,
                                               dbeta.get() + c0 * H, d_state.get(), pws.get(), pws.size(), nullptr));
      }
      CHECK(same_bits(out.download(), one.out));
      CHECK(same_bits(states.download(), one.states));
      CHECK(same_bits(dq.download(), one.dq));
      CHECK(same_bits(dk.download(), one.dk));
      CHECK(same_bits(dv.download(), one.dv));
      CHECK(same_bits(dg.download(), one.dg));
      CHECK(same_bits(dbeta.download(), one.dbeta));
      CHECK(same_bits(d_state.download(), one_d_initial));
    }
  }
}

TEST_CASE("the recurrent form's chunk only changes what is kept: every chunk gives the same outputs") {
  k::GatedDeltaDims d{2, 29, 1, 2, 40, 70, 1};  // several warps, padded rows and columns
  d.form = k::GatedDeltaDims::Form::recurrent;
  const Inputs in = make_inputs(d, 7);
  const Run one = run(d, in);
  for (const std::int64_t chunk : {3, 29, 64}) {
    CAPTURE(chunk);
    d.chunk = chunk;
    const Run r = run(d, in);
    check_same_bits(r, one);
  }
}

namespace {
/// The strided case below, in one form.
void check_column_ranges(k::GatedDeltaDims::Form form) {
  CAPTURE(static_cast<int>(form));
  k::GatedDeltaDims packed{2, 21, 2, 4, 16, 8, 8};
  packed.form = form;
  const Inputs in = make_inputs(packed, 77);
  const Run want = run(packed, in);
  const std::int64_t T = packed.tokens(), kw = packed.k_heads * packed.k_dim, vw = packed.v_heads * packed.v_dim;
  const std::int64_t C = 2 * kw + vw + 5;  // 5 columns no one reads or writes
  std::vector<bf16> mixed(static_cast<std::size_t>(T * C), oom::to_bf16(0.0f));
  for (std::int64_t t = 0; t < T; ++t) {
    std::copy_n(in.q.bits.begin() + t * kw, kw, mixed.begin() + t * C);
    std::copy_n(in.k.bits.begin() + t * kw, kw, mixed.begin() + t * C + kw);
    std::copy_n(in.v.bits.begin() + t * vw, vw, mixed.begin() + t * C + 2 * kw);
  }
  k::GatedDeltaDims d = packed;
  d.qk_stride = d.v_stride = C;
  const DeviceBuffer<bf16> m(mixed), dout(in.d_out.bits);
  const DeviceBuffer<float> g(in.g), beta(in.beta);
  DeviceBuffer<bf16> out(in.v.bits.size()), dmixed(mixed.size());
  DeviceBuffer<float> states(k::gated_delta_states_floats(d)), dg(in.g.size()), dbeta(in.g.size());
  DeviceBuffer<std::byte> ws(k::gated_delta_backward_workspace_bytes(d));
  const bf16 *q = m.get(), *kk = m.get() + kw, *v = m.get() + 2 * kw;
  OOM_CUDA_CHECK(k::gated_delta_forward(d, q, kk, v, g.get(), beta.get(), out.get(), states.get(), nullptr));
  OOM_CUDA_CHECK(k::gated_delta_backward(d, q, kk, v, g.get(), beta.get(), dout.get(), states.get(), dmixed.get(), dmixed.get() + kw,
                                         dmixed.get() + 2 * kw, dg.get(), dbeta.get(), ws.get(), ws.size(), nullptr));
  CHECK(same_bits(out.download(), want.out));
  CHECK(same_bits(states.download(), want.states));
  CHECK(same_bits(dg.download(), want.dg));
  CHECK(same_bits(dbeta.download(), want.dbeta));
  const auto dm = dmixed.download();
  std::vector<bf16> dq, dk, dv, pad;
  for (std::int64_t t = 0; t < T; ++t) {
    dq.insert(dq.end(), dm.begin() + t * C, dm.begin() + t * C + kw);
    dk.insert(dk.end(), dm.begin() + t * C + kw, dm.begin() + t * C + 2 * kw);
    dv.insert(dv.end(), dm.begin() + t * C + 2 * kw, dm.begin() + t * C + 2 * kw + vw);
    pad.insert(pad.end(), dm.begin() + t * C + 2 * kw + vw, dm.begin() + (t + 1) * C);
  }
  CHECK(same_bits(dq, want.dq));
  CHECK(same_bits(dk, want.dk));
  CHECK(same_bits(dv, want.dv));
  CHECK(std::all_of(pad.begin(), pad.end(), [](bf16 x) { return std::isnan(oom::to_float(x)); }));  // still the poison
}
}  // namespace

TEST_CASE("q, k and v as column ranges of one [q | k | v | pad] array: the packed run's bits, dq, dk, dv in place") {
  if (k::gated_delta_chunked_supported()) check_column_ranges(k::GatedDeltaDims::Form::chunked);
  check_column_ranges(k::GatedDeltaDims::Form::recurrent);
}

TEST_CASE("the chunked form refuses a chunk over 64 tokens, and automatic takes the recurrent form there") {
  k::GatedDeltaDims d{1, 130, 1, 2, 32, 32, 65};
  const Inputs in = make_inputs(d, 11);
  d.form = k::GatedDeltaDims::Form::chunked;
  const DeviceBuffer<bf16> q(in.q.bits), kk(in.k.bits), v(in.v.bits);
  const DeviceBuffer<float> g(in.g), beta(in.beta);
  DeviceBuffer<bf16> out(in.v.bits.size());
  DeviceBuffer<float> states(k::gated_delta_states_floats(d));
  CHECK(k::gated_delta_forward(d, q.get(), kk.get(), v.get(), g.get(), beta.get(), out.get(), states.get(), nullptr) ==
        cudaErrorInvalidValue);
  CHECK(std::string(k::last_refusal()).find("chunk <= 64") != std::string::npos);
  d.form = k::GatedDeltaDims::Form::automatic;
  const Run automatic = run(d, in);
  d.form = k::GatedDeltaDims::Form::recurrent;
  check_same_bits(automatic, run(d, in));
}

TEST_CASE("automatic: the chunked backward always, the chunked forward where its carrying blocks run in two waves") {
  using Form = k::GatedDeltaDims::Form;
  int device = 0, sms = 0;
  OOM_CUDA_CHECK(cudaGetDevice(&device));
  OOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const bool chunked_here = k::gated_delta_chunked_supported();
  // Past two waves the forward is the recurrent form's; the backward the chunked form's where the
  // device runs it (else the recurrent one's).
  const Form past_backward = chunked_here ? Form::chunked : Form::recurrent;
  // Past two waves: as many sequences as SMs, 2 value heads of 2 column blocks each (4x the SMs).
  k::GatedDeltaDims many{sms, 16, 1, 2, 16, 64, 16};
  const Inputs in_many = make_inputs(many, 23);
  const Run many_auto = run(many, in_many), many_recurrent = run_forms(many, Form::recurrent, Form::recurrent, in_many);
  check_same_bits(many_auto, run_forms(many, Form::recurrent, past_backward, in_many));
  CHECK(same_bits(many_auto.states, many_recurrent.states));
  // The backward's forms give different bits there (so the check above tells them apart): the
  // fp32 gate gradients, summed in other orders.
  if (chunked_here) CHECK_FALSE(same_bits(many_recurrent.dg, many_auto.dg));
  // One block past two waves: 2 x SMs + 1 sequences of one value head of one column block.
  k::GatedDeltaDims past{2 * static_cast<std::int64_t>(sms) + 1, 16, 1, 1, 16, 32, 16};
  const Inputs in_past = make_inputs(past, 27);
  const Run past_auto = run(past, in_past), past_mixed = run_forms(past, Form::recurrent, past_backward, in_past);
  check_same_bits(past_auto, past_mixed);
  CHECK(same_bits(past_auto.states, past_mixed.states));  // the forward's form
  // Two waves exactly: one value head of 2 column blocks a sequence (2x the SMs).
  k::GatedDeltaDims two{sms, 16, 1, 1, 16, 64, 16};
  const Inputs in_two = make_inputs(two, 25);
  const Run two_auto = run(two, in_two);
  two.form = chunked_here ? Form::chunked : Form::recurrent;
  check_same_bits(two_auto, run(two, in_two));
  k::GatedDeltaDims one{1, 130, 1, 2, 64, 64, 64};  // 4 blocks
  const Inputs in = make_inputs(one, 21);
  const Run automatic = run(one, in);
  one.form = chunked_here ? Form::chunked : Form::recurrent;
  check_same_bits(automatic, run(one, in));
  // And the two forms give different bits there (so the check above tells them apart). Their
  // fp32 gate gradients, summed in different orders: at this size every bf16 output of the two
  // forms rounds to the same bits (the H200, 2026-12-04), so those cannot tell them apart; the
  // forward's kept states tell the forward's forms apart.
  one.form = one.form == Form::chunked ? Form::recurrent : Form::chunked;
  if (chunked_here) {
    const Run other = run(one, in);
    CHECK_FALSE(same_bits(other.dg, automatic.dg));
    CHECK_FALSE(same_bits(other.states, automatic.states));
  }
}

TEST_CASE("timing: the Qwen3-Next linear layer's rule at 4K tokens (1 sequence, 16 key / 32 value heads of 128)") {
  using Form = k::GatedDeltaDims::Form;
  if (!k::gated_delta_chunked_supported()) {
    MESSAGE("this GPU cannot run the chunked form: nothing to compare");
    return;
  }
  k::GatedDeltaDims d{1, 4096, 16, 32, 128, 128, 64};
  const Inputs in = make_inputs(d, 3);
  const DeviceBuffer<bf16> q(in.q.bits), kk(in.k.bits), v(in.v.bits), dout(in.d_out.bits);
  const DeviceBuffer<float> g(in.g), beta(in.beta);
  DeviceBuffer<bf16> out(in.v.bits.size()), dq(in.q.bits.size()), dk(in.k.bits.size()), dv(in.v.bits.size());
  DeviceBuffer<float> states(k::gated_delta_states_floats(d)), dg(in.g.size()), dbeta(in.g.size());
  k::GatedDeltaDims recurrent = d;
  recurrent.form = Form::recurrent;
  d.form = Form::chunked;
  DeviceBuffer<std::byte> ws(std::max(k::gated_delta_backward_workspace_bytes(d), k::gated_delta_backward_workspace_bytes(recurrent)));
  auto forward = [&](const k::GatedDeltaDims& dims) {
    OOM_CUDA_CHECK(k::gated_delta_forward(dims, q.get(), kk.get(), v.get(), g.get(), beta.get(), out.get(), states.get(), nullptr));
  };
  auto backward = [&](const k::GatedDeltaDims& dims) {
    OOM_CUDA_CHECK(k::gated_delta_backward(dims, q.get(), kk.get(), v.get(), g.get(), beta.get(), dout.get(), states.get(),
                                           dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), ws.get(), ws.size(), nullptr));
  };
  auto time_ms = [](auto&& fn) {
    fn();
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    constexpr int reps = 3;
    for (int i = 0; i < reps; ++i) fn();
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  // The two forms at the models' shape, each against the other: each is within 2^-7 (bf16) or 1e-3
  // (fp32 gates' gradients) of the reference at the small shapes above, so within twice that here.
  auto results = [&] {
    return Run{out.download(), dq.download(), dk.download(), dv.download(), states.download(), dg.download(), dbeta.download()};
  };
  const double f = time_ms([&] { forward(d); }), b = time_ms([&] { backward(d); });
  const Run chunked = results();
  const double fr = time_ms([&] { forward(recurrent); }), br = time_ms([&] { backward(recurrent); });
  recurrent.backward = k::GatedDeltaDims::Backward::one_block;
  const double b_one = time_ms([&] { backward(recurrent); });
  const Run rec = results();
  check_scaled(to_floats(chunked.out), to_floats(rec.out), 2.0 / 128, 2e-3, "out");
  check_scaled(to_floats(chunked.dq), to_floats(rec.dq), 2.0 / 128, 2e-3, "dq");
  check_scaled(to_floats(chunked.dk), to_floats(rec.dk), 2.0 / 128, 2e-3, "dk");
  check_scaled(to_floats(chunked.dv), to_floats(rec.dv), 2.0 / 128, 2e-3, "dv");
  check_scaled(chunked.states, rec.states, 2e-4, 2e-5, "states");
  check_scaled(chunked.dg, rec.dg, 2e-3, 2e-4, "dg");
  check_scaled(chunked.dbeta, rec.dbeta, 2e-3, 2e-4, "dbeta");
  // The rule's own FLOPs as the recurrence counts them (per token and value head: S^T k, the
  // update, S^T q, 2 dk dv each), for a rate to compare across versions.
  const double flops = 6.0 * static_cast<double>(d.tokens() * d.v_heads * d.k_dim * d.v_dim);
  std::printf("gated_delta 4K x 32 heads of 128: chunked forward %.3f ms, backward %.3f ms; recurrent forward %.3f ms, backward %.3f ms "
              "(cluster or automatic), %.3f ms (one block a head); chunked / recurrent %.2fx forward, %.2fx backward; "
              "%.1f GFLOP/s chunked forward; states %.1f MiB, chunked backward workspace %.1f MiB\n",
              f, b, fr, br, b_one, fr / f, br / b, flops / f * 1e-6, static_cast<double>(states.bytes()) / (1 << 20),
              static_cast<double>(k::gated_delta_backward_workspace_bytes(d)) / (1 << 20));
}
