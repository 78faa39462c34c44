// GPU checks of the Gated DeltaNet's conv, gates and gated norm (oom/kernels/deltanet.hpp), and of
// the hybrid models' attention output gate (oom/kernels/output_gate.hpp), against
// the CPU reference (oom/reference/gated_delta.hpp): fresh random inputs, sizes no tile divides,
// several sequences (the conv restarts in each), strided inputs and outputs whose other columns
// stay untouched, every output poisoned (NaN) before the run, the parameter gradients' partial
// sums over several blocks, and the same bits on a second run.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/kernels/deltanet.hpp"
#include "oom/kernels/output_gate.hpp"
#include "oom/reference/gated_delta.hpp"
#include "oom/reference/output_gate.hpp"
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


// bf16 outputs: one rounding of an fp32 result (2^-9) and fp32-vs-fp64 arithmetic on either side
// of a rounding boundary: 2^-7 relative, plus 1e-3 of the tensor's scale where terms cancel.
constexpr double bf16_rtol = 1.0 / 128, bf16_atol = 1e-3;

/// Columns [0, width) of each of `rows` rows at `stride` (a strided device array read back).
std::vector<float> columns(const std::vector<bf16>& a, std::int64_t rows, std::int64_t stride, std::int64_t width, std::int64_t at = 0) {
  std::vector<float> out;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < width; ++c) out.push_back(oom::to_float(a[r * stride + at + c]));
  return out;
}

/// Every element of a strided array outside columns [at, at + width) of each row is still NaN.
bool untouched_outside(const std::vector<bf16>& a, std::int64_t stride, std::int64_t at, std::int64_t width) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto c = static_cast<std::int64_t>(i) % stride;
    if ((c < at || c >= at + width) && !std::isnan(oom::to_float(a[i]))) return false;
  }
  return true;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE("causal conv1d + SiLU: forward and backward against the reference, per sequence, strided") {
  // {sequences, seq_len, channels, kernel, x_stride}
  const k::ConvDims cases[] = {{2, 13, 37, 4, 50}, {1, 2, 5, 4, 5}, {3, 300, 64, 1, 70}, {1, 700, 19, 8, 19}};
  std::uint64_t seed = 10;
  for (const auto& d : cases) {
    CAPTURE(d.seq_len);
    CAPTURE(d.channels);
    CAPTURE(d.kernel);
    const std::int64_t T = d.tokens(), C = d.channels, K = d.kernel;
    const Bf16Data x(random_normal(static_cast<std::size_t>(T * d.x_stride), seed += 3));
    const Bf16Data w(random_normal(static_cast<std::size_t>(C * K), seed + 1, 0.5f));
    const Bf16Data dy(random_normal(static_cast<std::size_t>(T * C), seed + 2));
    const DeviceBuffer<bf16> xd(x.bits), wd(w.bits), dyd(dy.bits);
    DeviceBuffer<bf16> y(static_cast<std::size_t>(T * C)), dx(static_cast<std::size_t>(T * d.x_stride));
    DeviceBuffer<float> dw(static_cast<std::size_t>(C * K));
    DeviceBuffer<std::byte> ws(k::causal_conv1d_silu_backward_workspace_bytes(d));
    OOM_CUDA_CHECK(k::causal_conv1d_silu_forward(d, xd.get(), wd.get(), y.get(), nullptr));
    OOM_CUDA_CHECK(k::causal_conv1d_silu_backward(d, xd.get(), wd.get(), dyd.get(), dx.get(), dw.get(), ws.get(), ws.size(), nullptr));
    const auto dx_got = dx.download();
    const auto dw_got = dw.download();
    std::vector<float> y_want, dx_want;
    std::vector<double> dw_sum(static_cast<std::size_t>(C * K), 0.0);
    const auto xs = columns(x.bits, T, d.x_stride, C);
    for (std::int64_t b = 0; b < d.sequences; ++b) {
      const std::vector<float> xb(xs.begin() + b * d.seq_len * C, xs.begin() + (b + 1) * d.seq_len * C);
      const std::vector<float> dyb(dy.values.begin() + b * d.seq_len * C, dy.values.begin() + (b + 1) * d.seq_len * C);
      const auto yb = ref::causal_conv1d_silu_forward(d.seq_len, C, K, xb, w.values);
      const auto g = ref::causal_conv1d_silu_backward(d.seq_len, C, K, xb, w.values, dyb);
      y_want.insert(y_want.end(), yb.begin(), yb.end());
      dx_want.insert(dx_want.end(), g.dx.begin(), g.dx.end());
      for (std::size_t i = 0; i < dw_sum.size(); ++i) dw_sum[i] += g.dw[i];
    }
    check_scaled(to_floats(y.download()), y_want, bf16_rtol, bf16_atol, "y");
    check_scaled(columns(dx_got, T, d.x_stride, C), dx_want, bf16_rtol, bf16_atol, "dx");
    CHECK(untouched_outside(dx_got, d.x_stride, 0, C));
    // dw sums T products in fp32 (block partials, then the blocks): 1e-4 relative plus 1e-5 of
    // the scale covers fp32 rounding over up to 2,100 terms against the fp64 sum.
    check_scaled(dw_got, std::vector<float>(dw_sum.begin(), dw_sum.end()), 1e-4, 1e-5, "dw");
    dw.poison();
    OOM_CUDA_CHECK(k::causal_conv1d_silu_backward(d, xd.get(), wd.get(), dyd.get(), dx.get(), dw.get(), ws.get(), ws.size(), nullptr));
    CHECK(same_bits(dw.download(), dw_got));
  }
}

TEST_CASE("causal conv1d + SiLU over parts of one sequence (history and future rows) gives the whole run's rows") {
  // One sequence of 300 tokens cut at 3 and 130 (a part shorter than the kernel's reach), strided x.
  const std::int64_t S = 300, C = 37, K = 4, stride = 41;
  const k::ConvDims whole{1, S, C, K, stride};
  const Bf16Data x(random_normal(static_cast<std::size_t>(S * stride), 31));
  const Bf16Data w(random_normal(static_cast<std::size_t>(C * K), 32, 0.5f));
  const Bf16Data dy(random_normal(static_cast<std::size_t>(S * C), 33));
  const DeviceBuffer<bf16> xd(x.bits), wd(w.bits), dyd(dy.bits);
  DeviceBuffer<bf16> y(static_cast<std::size_t>(S * C)), dx(static_cast<std::size_t>(S * stride));
  DeviceBuffer<float> dw(static_cast<std::size_t>(C * K));
  DeviceBuffer<std::byte> ws(k::causal_conv1d_silu_backward_workspace_bytes(whole));
  OOM_CUDA_CHECK(k::causal_conv1d_silu_forward(whole, xd.get(), wd.get(), y.get(), nullptr));
  OOM_CUDA_CHECK(k::causal_conv1d_silu_backward(whole, xd.get(), wd.get(), dyd.get(), dx.get(), dw.get(), ws.get(), ws.size(), nullptr));
  const auto y_whole = y.download(), dx_whole = dx.download();
  const auto dw_whole = dw.download();
  y.poison();
  dx.poison();
  const std::int64_t cuts[] = {0, 3, 130, S};
  std::vector<double> dw_sum(static_cast<std::size_t>(C * K), 0.0);
  for (int i = 0; i < 3; ++i) {
    const std::int64_t c0 = cuts[i], c1 = cuts[i + 1];
    k::ConvDims part{1, c1 - c0, C, K, stride};
    part.history = std::min(K - 1, c0);
    part.future = std::min(K - 1, S - c1);
    DeviceBuffer<std::byte> pws(k::causal_conv1d_silu_backward_workspace_bytes(part));
    k::ConvDims forward = part;
    forward.future = 0;  // the forward reads no rows after the part (and refuses them)
    OOM_CUDA_CHECK(k::causal_conv1d_silu_forward(forward, xd.get() + c0 * stride, wd.get(), y.get() + c0 * C, nullptr));
    OOM_CUDA_CHECK(k::causal_conv1d_silu_backward(part, xd.get() + c0 * stride, wd.get(), dyd.get() + c0 * C, dx.get() + c0 * stride,
                                                  dw.get(), pws.get(), pws.size(), nullptr));
    const auto dw_part = dw.download();
    for (std::size_t j = 0; j < dw_sum.size(); ++j) dw_sum[j] += dw_part[j];
  }
  // Every row's taps are the whole run's, in the same order: the same bits.
  CHECK(same_bits(y.download(), y_whole));
  CHECK(same_bits(dx.download(), dx_whole));
  // dw: the parts' sums added, against the whole's (fp32 sums of 300 terms grouped differently).
  check_scaled(std::vector<float>(dw_sum.begin(), dw_sum.end()), dw_whole, 1e-5, 1e-6, "dw summed over the parts");
  // Without the history and future rows the cut edges lose their taps: the check above can fail.
  k::ConvDims cut{1, 130 - 3, C, K, stride};
  OOM_CUDA_CHECK(k::causal_conv1d_silu_forward(cut, xd.get() + 3 * stride, wd.get(), y.get() + 3 * C, nullptr));
  CHECK_FALSE(same_bits(y.download(), y_whole));
  // Refused: history beyond the kernel's reach, and parts of several sequences.
  k::ConvDims bad = whole;
  bad.history = K;
  CHECK(k::causal_conv1d_silu_forward(bad, xd.get(), wd.get(), y.get(), nullptr) == cudaErrorInvalidValue);
  bad = {2, 150, C, K, stride};
  bad.future = 1;
  CHECK(k::causal_conv1d_silu_forward(bad, xd.get(), wd.get(), y.get(), nullptr) == cudaErrorInvalidValue);
}

TEST_CASE("the gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), forward and backward") {
  const std::int64_t T = 2500, H = 6, stride = 2 * H + 3;  // 40 partial blocks of 64 tokens, the last part-filled
  std::vector<float> ab = random_normal(static_cast<std::size_t>(T * stride), 5, 2.0f);
  for (std::int64_t t = 0; t < T; t += 7) ab[t * stride + H + 1] = 25.0f;  // a + dt_bias past softplus' threshold
  const Bf16Data abd(ab), a_log(random_normal(H, 6, 1.0f)), dt_bias(random_normal(H, 7, 0.5f));
  const auto dg = random_normal(static_cast<std::size_t>(T * H), 8), dbeta = random_normal(static_cast<std::size_t>(T * H), 9);
  const k::GateDims d{T, H, stride};
  const DeviceBuffer<bf16> abdev(abd.bits), al(a_log.bits), db_(dt_bias.bits);
  const DeviceBuffer<float> dgd(dg), dbetad(dbeta);
  DeviceBuffer<float> g(static_cast<std::size_t>(T * H)), beta(g.size()), dal(H), ddt(H);
  DeviceBuffer<bf16> dab(abd.bits.size());
  DeviceBuffer<std::byte> ws(k::delta_gates_backward_workspace_bytes(d));
  const bf16* b_ptr = abdev.get();      // columns [0, H): b
  const bf16* a_ptr = abdev.get() + H;  // columns [H, 2H): a (the [b | a] projection)
  OOM_CUDA_CHECK(k::delta_gates_forward(d, a_ptr, b_ptr, al.get(), db_.get(), g.get(), beta.get(), nullptr));
  OOM_CUDA_CHECK(k::delta_gates_backward(d, a_ptr, b_ptr, al.get(), db_.get(), dgd.get(), dbetad.get(), dab.get() + H, dab.get(),
                                         dal.get(), ddt.get(), ws.get(), ws.size(), nullptr));
  const auto a = columns(abd.bits, T, stride, H, H), b = columns(abd.bits, T, stride, H, 0);
  const auto fwd = ref::delta_gates_forward(T, H, a, b, a_log.values, dt_bias.values);
  const auto bwd = ref::delta_gates_backward(T, H, a, b, a_log.values, dt_bias.values, dbeta, dg);
  // fp32 outputs of exp, log1p and sigmoid (a few ulp) against fp64.
  check_scaled(g.download(), fwd.g, 1e-5, 1e-6, "g");
  check_scaled(beta.download(), fwd.beta, 1e-5, 1e-6, "beta");
  const auto dab_got = dab.download();
  check_scaled(columns(dab_got, T, stride, H, H), bwd.da, bf16_rtol, bf16_atol, "da");
  check_scaled(columns(dab_got, T, stride, H, 0), bwd.db, bf16_rtol, bf16_atol, "db");
  CHECK(untouched_outside(dab_got, stride, 0, 2 * H));
  // Sums over 2,500 tokens in fp32: 1e-4 relative plus 1e-5 of the scale.
  const auto dal_got = dal.download(), ddt_got = ddt.download();
  check_scaled(dal_got, bwd.da_log, 1e-4, 1e-5, "dA_log");
  check_scaled(ddt_got, bwd.ddt_bias, 1e-4, 1e-5, "ddt_bias");
  dal.poison();
  ddt.poison();
  OOM_CUDA_CHECK(k::delta_gates_backward(d, a_ptr, b_ptr, al.get(), db_.get(), dgd.get(), dbetad.get(), dab.get() + H, dab.get(),
                                         dal.get(), ddt.get(), ws.get(), ws.size(), nullptr));
  CHECK(same_bits(dal.download(), dal_got));
  CHECK(same_bits(ddt.download(), ddt_got));
}

TEST_CASE("the gated RMSNorm: forward and backward against the reference, z strided") {
  // {tokens, heads, dim, z_stride}
  const k::GatedNormDims cases[] = {{77, 3, 40, 3 * 40 + 5, 1e-6f}, {300, 4, 128, 4 * 128 + 8, 1e-6f}, {9, 1, 1000, 1003, 1e-5f}};
  std::uint64_t seed = 40;
  for (const auto& d : cases) {
    CAPTURE(d.dim);
    const std::int64_t rows = d.tokens * d.heads, D = d.dim;
    const Bf16Data x(random_normal(static_cast<std::size_t>(rows * D), seed += 3)), dy(random_normal(static_cast<std::size_t>(rows * D), seed + 1));
    const Bf16Data zs(random_normal(static_cast<std::size_t>(d.tokens * d.z_stride), seed + 2, 2.0f)), w(random_normal(D, seed + 3, 0.5f));
    const DeviceBuffer<bf16> xd(x.bits), zd(zs.bits), wd(w.bits), dyd(dy.bits);
    DeviceBuffer<bf16> y(x.bits.size()), dx(x.bits.size()), dz(zs.bits.size());
    DeviceBuffer<float> rstd(static_cast<std::size_t>(rows)), dw(static_cast<std::size_t>(D));
    DeviceBuffer<std::byte> ws(k::gated_rmsnorm_backward_workspace_bytes(d));
    OOM_CUDA_CHECK(k::gated_rmsnorm_forward(d, xd.get(), zd.get(), wd.get(), y.get(), rstd.get(), nullptr));
    OOM_CUDA_CHECK(k::gated_rmsnorm_backward(d, xd.get(), zd.get(), wd.get(), rstd.get(), dyd.get(), dx.get(), dz.get(), dw.get(),
                                             ws.get(), ws.size(), nullptr));
    const auto z = columns(zs.bits, d.tokens, d.z_stride, d.heads * D);  // (rows, D) contiguous for the reference
    const auto y_want = ref::gated_rmsnorm_forward(rows, D, x.values, z, w.values, d.eps);
    const auto g = ref::gated_rmsnorm_backward(rows, D, x.values, z, w.values, d.eps, dy.values);
    check_scaled(to_floats(y.download()), y_want, bf16_rtol, bf16_atol, "y");
    std::vector<float> rstd_want(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (std::int64_t i = 0; i < D; ++i) ss += static_cast<double>(x.values[r * D + i]) * x.values[r * D + i];
      rstd_want[r] = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + d.eps));
    }
    check_scaled(rstd.download(), rstd_want, 1e-5, 0, "rstd");
    check_scaled(to_floats(dx.download()), g.dx, bf16_rtol, bf16_atol, "dx");
    const auto dz_got = dz.download();
    check_scaled(columns(dz_got, d.tokens, d.z_stride, d.heads * D), g.dz, bf16_rtol, bf16_atol, "dz");
    CHECK(untouched_outside(dz_got, d.z_stride, 0, d.heads * D));
    const auto dw_got = dw.download();
    check_scaled(dw_got, g.dw, 1e-4, 1e-5, "dw");
    dw.poison();
    OOM_CUDA_CHECK(k::gated_rmsnorm_backward(d, xd.get(), zd.get(), wd.get(), rstd.get(), dyd.get(), dx.get(), dz.get(), dw.get(),
                                             ws.get(), ws.size(), nullptr));
    CHECK(same_bits(dw.download(), dw_got));
  }
}

TEST_CASE("the full attention's output gate: o = ctx * sigmoid(gate), the gate read from q_proj's [q | gate] heads") {
  const std::int64_t T = 37, heads = 3, D = 40, row = 2 * heads * D;  // q_proj's output: per head [q | gate]
  const Bf16Data ctx(random_normal(static_cast<std::size_t>(T * heads * D), 51));
  const Bf16Data qg(random_normal(static_cast<std::size_t>(T * row), 52, 3.0f)), d_o(random_normal(static_cast<std::size_t>(T * heads * D), 53));
  const k::OutputGateDims d{T, heads, D, row, 2 * D};
  const DeviceBuffer<bf16> c(ctx.bits), g(qg.bits), dod(d_o.bits);
  DeviceBuffer<bf16> o(ctx.bits.size()), dc(ctx.bits.size()), dqg(qg.bits.size());
  const bf16* gate = g.get() + D;  // the second half of each head
  OOM_CUDA_CHECK(k::output_gate_forward(d, c.get(), gate, o.get(), nullptr));
  OOM_CUDA_CHECK(k::output_gate_backward(d, c.get(), gate, dod.get(), dc.get(), dqg.get() + D, nullptr));
  std::vector<float> gate_packed;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < D; ++i) gate_packed.push_back(qg.values[t * row + h * 2 * D + D + i]);
  std::vector<float> o_want(ctx.values.size()), dc_want(o_want.size()), dg_want(o_want.size());
  ref::output_gate_forward(ctx.values, gate_packed, o_want);
  ref::output_gate_backward(ctx.values, gate_packed, d_o.values, dc_want, dg_want);
  check_scaled(to_floats(o.download()), o_want, bf16_rtol, bf16_atol, "o");
  check_scaled(to_floats(dc.download()), dc_want, bf16_rtol, bf16_atol, "d ctx");
  const auto dqg_got = dqg.download();
  std::vector<float> dg_got;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < 2 * D; ++i) {
        const float v = oom::to_float(dqg_got[t * row + h * 2 * D + i]);
        if (i >= D) dg_got.push_back(v);
        else CHECK(std::isnan(v));  // the q half is not the gate's to write
      }
  check_scaled(dg_got, dg_want, bf16_rtol, bf16_atol, "d gate");
}

TEST_CASE("no tokens: the parameter gradients are zeroed, and no other array is needed") {
  DeviceBuffer<float> dw(4 * 3), dal(5), ddt(5), dn(7);  // poisoned
  OOM_CUDA_CHECK(k::causal_conv1d_silu_backward({1, 0, 4, 3, 4}, nullptr, nullptr, nullptr, nullptr, dw.get(), nullptr, 0, nullptr));
  OOM_CUDA_CHECK(k::delta_gates_backward({0, 5, 10}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, dal.get(),
                                         ddt.get(), nullptr, 0, nullptr));
  OOM_CUDA_CHECK(k::gated_rmsnorm_backward({0, 2, 7, 14, 1e-6f}, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, dn.get(),
                                           nullptr, 0, nullptr));
  for (const auto* b : {&dw, &dal, &ddt, &dn})
    for (float v : b->download()) CHECK(v == 0.0f);
}
