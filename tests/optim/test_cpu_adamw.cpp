// CPU AdamW: the kernels against an independent fp32 restatement of the formula (bit for bit) and
// an fp64 evaluation (within a rounding bound derived below); bit-identity across every ISA this
// CPU runs, thread counts and odd lengths; the bf16 outputs; weight decay; gradient scaling; the
// deterministic sum of squares; and the errors callers get.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/optim/cpu_adamw.hpp"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

using namespace oom;
using namespace oom::optim;

namespace {

constexpr double u32 = 0x1p-24;  // unit roundoff of fp32

// The formula of torch.optim.AdamW, written out again here from its definition (not by calling
// adamw_element), in the rounding order adamw.hpp documents.
void reference_fp32(const AdamWStepScalars& s, float& p, float& m, float& v, float grad) {
  const float g = grad * s.grad_scale;
  const float decayed = p * s.decay;
  const float m_new = std::fma(s.beta1, m, s.one_minus_beta1 * g);
  const float gg = s.one_minus_beta2 * g;
  const float v_new = std::fma(s.beta2, v, gg * g);
  const float root = std::sqrt(v_new);
  const float denom = root / s.bias_correction2_sqrt + s.eps;
  const float ratio = m_new / denom;
  p = std::fma(s.neg_step_size, ratio, decayed);
  m = m_new;
  v = v_new;
}

struct Fp64Step {
  double p, m, v;
  double p_scale, m_scale;  // magnitudes of the terms that each result sums (for error bounds)
};

// The same step in double from the same fp32 inputs and the config itself (not the fp32 scalars).
Fp64Step reference_fp64(const AdamWConfig& c, std::int64_t t, float scale, float p0, float m0, float v0, float grad) {
  const double lr = c.lr, b1 = c.beta1, b2 = c.beta2, wd = c.weight_decay, eps = c.eps;
  const double g = static_cast<double>(grad) * scale;
  const double decayed = static_cast<double>(p0) * (1.0 - lr * wd);
  const double m = b1 * m0 + (1.0 - b1) * g;
  const double v = b2 * v0 + (1.0 - b2) * g * g;
  const double bc1 = c.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(t)) : 1.0;
  const double bc2 = c.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(t)) : 1.0;
  const double denom = std::sqrt(v) / std::sqrt(bc2) + eps;
  const double step = lr / bc1;
  const double m_scale = std::fabs(b1 * m0) + std::fabs((1.0 - b1) * g);
  return {decayed - step * m / denom, m, v, std::fabs(decayed) + step * m_scale / denom, m_scale};
}

// Rounding bounds, in units of fp32 roundoff u = 2^-24 (each fp32 op contributes <= u relative to
// its result; the fp32 constants are within u/2 of the exact ones):
//  m: g (1) + (1-b1)*g (1) + fma (1) + constant (1/2), relative to |b1 m| + |(1-b1) g|  -> 4u
//  v: all terms >= 0, so relative to v: g^2 (2) + products (2) + fma (1) + constant (1/2) -> 6u
//  p: decayed (1.5) relative to |p decay|; the update relative to step*m_scale/denom:
//     m (4) + sqrt(v) (3 + 1/2) + /bc2 (1.5) + eps (1) + m/d (1) + step constant (1/2) + fma (1)
//     -> 13u; we allow 16u of the sum of both magnitudes.
void check_against_fp64(const Fp64Step& r, float p, float m, float v) {
  REQUIRE(std::fabs(m - r.m) <= 4 * u32 * r.m_scale);
  REQUIRE(std::fabs(v - r.v) <= 6 * u32 * r.v);
  REQUIRE(std::fabs(p - r.p) <= 16 * u32 * r.p_scale);
}

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

// Gradients over many magnitudes, with exact zeros, so cancellation in m and tiny v both occur.
std::vector<float> random_grads(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 6);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = i % 13 == 5 ? 0.0f : std::ldexp(normal(rng), exponent(rng));
  return g;
}
std::vector<float> random_weights(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> p(n);
  for (auto& x : p) x = uni(rng);
  return p;
}

AdamWConfig config_with(float wd, bool bias_correction) {
  AdamWConfig c;
  c.lr = 3e-3f;
  c.weight_decay = wd;
  c.bias_correction = bias_correction;
  return c;
}

/// Owns the buffers of one span, each at its own offset from its allocation so vector loads are
/// misaligned relative to each other.
template <class Moment>
struct State {
  std::vector<float> p, g;
  std::vector<Moment> m, v;
  std::vector<bf16> out;
  std::size_t n;

  State(std::size_t n_, std::uint32_t seed) : n(n_) {
    p = random_weights(n + 1, seed);
    g = random_grads(n + 3, seed + 1);
    m.assign(n + 2, Moment{});
    v.assign(n + 1, Moment{});
    out.assign(n + 1, bf16{0xdead});
  }
  AdamWSpan<Moment> span(bool with_out = true) {
    return {std::span(p).subspan(1, n), std::span(m).subspan(2, n), std::span(v).subspan(0, n),
            std::span<const float>(g).subspan(3, n), with_out ? std::span(out).subspan(1, n) : std::span<bf16>{}};
  }
  void new_grads(std::uint32_t seed) { g = random_grads(n + 3, seed); }
};

std::uint32_t raw_bits(float x) { return bits(x); }
std::uint32_t raw_bits(bf16 x) { return x.bits; }

template <class Moment>
void require_same_bits(State<Moment>& a, State<Moment>& b, const char* what) {
  INFO(what);
  auto sa = a.span(), sb = b.span();
  for (std::size_t i = 0; i < a.n; ++i) {
    INFO("element " << i);
    REQUIRE(bits(sa.master[i]) == bits(sb.master[i]));
    REQUIRE(raw_bits(sa.exp_avg[i]) == raw_bits(sb.exp_avg[i]));
    REQUIRE(raw_bits(sa.exp_avg_sq[i]) == raw_bits(sb.exp_avg_sq[i]));
    REQUIRE(sa.weights_out[i].bits == sb.weights_out[i].bits);
  }
}

}  // namespace

TEST_CASE("step scalars are the torch formula's constants, validated") {
  const AdamWConfig c = config_with(0.1f, true);
  const AdamWStepScalars s = adamw_step_scalars(c, 3, 0.5f);
  CHECK(s.grad_scale == 0.5f);
  CHECK(s.decay == static_cast<float>(1.0 - 3e-3 * 0.1));
  CHECK(s.neg_step_size == doctest::Approx(-3e-3 / (1.0 - std::pow(0.9, 3))).epsilon(1e-6));
  CHECK(s.bias_correction2_sqrt == doctest::Approx(std::sqrt(1.0 - std::pow(0.999, 3))).epsilon(1e-6));
  const AdamWStepScalars plain = adamw_step_scalars(config_with(0.0f, false), 7);
  CHECK(plain.decay == 1.0f);  // weight decay 0 leaves p * decay exact
  CHECK(plain.bias_correction2_sqrt == 1.0f);
  CHECK(plain.neg_step_size == -3e-3f);

  CHECK_THROWS_WITH_AS(adamw_step_scalars(c, 0), doctest::Contains("step is 0"), Error);
  AdamWConfig bad = c;
  bad.beta2 = 1.0f;
  CHECK_THROWS_WITH_AS(adamw_step_scalars(bad, 1), doctest::Contains("beta2 is 1"), Error);
  bad = c;
  bad.eps = 0.0f;
  CHECK_THROWS_AS(adamw_step_scalars(bad, 1), Error);
  bad = c;
  bad.lr = -1.0f;
  CHECK_THROWS_AS(adamw_step_scalars(bad, 1), Error);
  CHECK_THROWS_AS(adamw_step_scalars(c, 1, std::numeric_limits<float>::quiet_NaN()), Error);
  // A finite lr whose step size is not (lr / (1 - 0.9) = 1e39 at step 1): named as what it is (it
  // had read "bias correction underflows"); from step 22 on the same lr is within range.
  bad = c;
  bad.lr = 1e38f;
  bad.weight_decay = 0.0f;
  CHECK_THROWS_WITH_AS(adamw_step_scalars(bad, 1), doctest::Contains("step size lr / (1 - beta1^step) = 1e+39"), Error);
  CHECK_NOTHROW((void)adamw_step_scalars(bad, 22));
}

TEST_CASE("the public element math is the formula, within the fp64 bound") {
  // adamw_element is what the scalar kernel runs; check it once against both references.
  for (bool bc : {true, false}) {
    const AdamWConfig c = config_with(0.05f, bc);
    auto p = random_weights(5000, 1);
    std::vector<float> m(5000), v(5000);
    for (std::int64_t t = 1; t <= 6; ++t) {
      const auto g = random_grads(5000, static_cast<std::uint32_t>(10 + t));
      const AdamWStepScalars s = adamw_step_scalars(c, t, 0.75f);
      for (std::size_t i = 0; i < p.size(); ++i) {
        float rp = p[i], rm = m[i], rv = v[i];
        reference_fp32(s, rp, rm, rv, g[i]);
        const Fp64Step r = reference_fp64(c, t, 0.75f, p[i], m[i], v[i], g[i]);
        adamw_element(s, p[i], m[i], v[i], g[i]);
        REQUIRE(bits(p[i]) == bits(rp));
        REQUIRE(bits(m[i]) == bits(rm));
        REQUIRE(bits(v[i]) == bits(rv));
        check_against_fp64(r, p[i], m[i], v[i]);
      }
    }
  }
}

TEST_CASE("every ISA matches the fp32 reference bit for bit and fp64 within the bound, over steps") {
  const std::size_t n = 4099;  // vector blocks of 16 and 8 plus a scalar tail of 3
  for (CpuIsa isa : supported_cpu_isas()) {
    for (float wd : {0.0f, 0.1f}) {
      for (float scale : {1.0f, 0.3f}) {
        INFO("isa " << to_string(isa));
        CAPTURE(wd);
        CAPTURE(scale);
        ThreadPool pool(2);
        const AdamWConfig c = config_with(wd, true);
        State<float> st(n, 21);
        for (std::int64_t t = 1; t <= 5; ++t) {
          st.new_grads(static_cast<std::uint32_t>(100 + t));
          auto s = st.span();
          std::vector<float> p0(s.master.begin(), s.master.end()), m0(s.exp_avg.begin(), s.exp_avg.end()),
              v0(s.exp_avg_sq.begin(), s.exp_avg_sq.end());
          const AdamWStepScalars k = adamw_step_scalars(c, t, scale);
          adamw_update(s, k, pool, isa);
          for (std::size_t i = 0; i < n; ++i) {
            INFO("step " << t << " element " << i);
            float rp = p0[i], rm = m0[i], rv = v0[i];
            reference_fp32(k, rp, rm, rv, s.grads[i]);
            REQUIRE(bits(s.master[i]) == bits(rp));
            REQUIRE(bits(s.exp_avg[i]) == bits(rm));
            REQUIRE(bits(s.exp_avg_sq[i]) == bits(rv));
            check_against_fp64(reference_fp64(c, t, scale, p0[i], m0[i], v0[i], s.grads[i]), s.master[i],
                               s.exp_avg[i], s.exp_avg_sq[i]);
            REQUIRE(s.weights_out[i].bits == to_bf16(s.master[i]).bits);
          }
        }
      }
    }
  }
}

TEST_CASE("bf16 moments: widened exactly, used unrounded, stored rounded to nearest even") {
  const std::size_t n = 1037;
  const AdamWConfig c = config_with(0.01f, true);
  for (CpuIsa isa : supported_cpu_isas()) {
    INFO("isa " << to_string(isa));
    ThreadPool pool(3);
    State<bf16> st(n, 5);
    for (std::int64_t t = 1; t <= 4; ++t) {
      st.new_grads(static_cast<std::uint32_t>(200 + t));
      auto s = st.span();
      std::vector<float> p0(s.master.begin(), s.master.end());
      std::vector<bf16> m0(s.exp_avg.begin(), s.exp_avg.end()), v0(s.exp_avg_sq.begin(), s.exp_avg_sq.end());
      const AdamWStepScalars k = adamw_step_scalars(c, t);
      adamw_update(s, k, pool, isa);
      for (std::size_t i = 0; i < n; ++i) {
        INFO("step " << t << " element " << i);
        float rp = p0[i], rm = to_float(m0[i]), rv = to_float(v0[i]);
        reference_fp32(k, rp, rm, rv, s.grads[i]);
        REQUIRE(bits(s.master[i]) == bits(rp));
        REQUIRE(s.exp_avg[i].bits == to_bf16(rm).bits);
        REQUIRE(s.exp_avg_sq[i].bits == to_bf16(rv).bits);
        REQUIRE(s.weights_out[i].bits == to_bf16(s.master[i]).bits);
        // Against fp64: p as in the fp32 case (it used the unrounded moments); the stored moments
        // add at most half a bf16 ulp: bf16 keeps 8 significant bits, so 2^-8 relative.
        const Fp64Step r = reference_fp64(c, t, 1.0f, p0[i], to_float(m0[i]), to_float(v0[i]), s.grads[i]);
        REQUIRE(std::fabs(s.master[i] - r.p) <= 16 * u32 * r.p_scale);
        REQUIRE(std::fabs(to_float(s.exp_avg[i]) - r.m) <= 0x1p-8 * std::fabs(r.m) + 5 * u32 * r.m_scale);
        REQUIRE(std::fabs(to_float(s.exp_avg_sq[i]) - r.v) <= (0x1p-8 + 7 * u32) * r.v);
      }
    }
  }
}

TEST_CASE("bit-identical across ISAs, thread counts and odd lengths, with awkward values") {
  const AdamWConfig c = config_with(0.1f, true);
  for (std::size_t n : {0u, 1u, 15u, 17u, 1000003u}) {
    CAPTURE(n);
    auto prepare = [&](auto& st) {
      // Values that trip a careless vector path: subnormal and tie-rounding masters (bf16 output),
      // NaN and infinite gradients (NaN quieting), negative zero.
      auto s = st.span();
      const float specials_p[] = {1e-40f, -3e-39f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -0.0f, 65504.0f};
      const float specials_g[] = {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY, 0.0f, 1e-30f, -0.0f};
      for (std::size_t i = 0; i < 6 && 3 * i < st.n; ++i) {
        s.master[3 * i] = specials_p[i];
        st.g[3 + 3 * i] = specials_g[i];
      }
    };
    auto run_both = [&](auto moment_tag) {
      using Moment = decltype(moment_tag);
      State<Moment> base(n, 77);
      prepare(base);
      {
        ThreadPool one(1);
        for (std::int64_t t = 1; t <= 2; ++t) adamw_update(base.span(), adamw_step_scalars(c, t, 0.9f), one, CpuIsa::scalar);
      }
      for (CpuIsa isa : supported_cpu_isas()) {
        for (std::size_t threads : {1u, 2u, 3u, 7u}) {
          if (n > 100000 && isa == CpuIsa::scalar && threads == 1) continue;  // that is `base`
          ThreadPool pool(threads);
          State<Moment> st(n, 77);
          prepare(st);
          for (std::int64_t t = 1; t <= 2; ++t) adamw_update(st.span(), adamw_step_scalars(c, t, 0.9f), pool, isa);
          const std::string what = std::string(to_string(isa)) + " with " + std::to_string(threads) + " threads";
          require_same_bits(base, st, what.c_str());
        }
      }
    };
    run_both(float{});
    run_both(bf16{});
  }
}

TEST_CASE("bf16 weights are to_bf16(master), including subnormals the hardware convert would flush") {
  const std::size_t n = 64;
  for (CpuIsa isa : supported_cpu_isas()) {
    INFO("isa " << to_string(isa));
    ThreadPool pool(1);
    State<float> st(n, 3);
    auto s = st.span();
    // Zero gradients and moments with no decay leave the master unchanged, so the output must be
    // exactly the rounding of the values put in.
    for (std::size_t i = 0; i < n; ++i) {
      s.master[i] = std::bit_cast<float>(static_cast<std::uint32_t>(0x00400000u + 0x8000u * i));  // subnormals
      if (i % 2) s.master[i] = std::bit_cast<float>(0x3f808000u + (static_cast<std::uint32_t>(i) << 16));  // ties
      st.g[3 + i] = 0.0f;
    }
    adamw_update(s, adamw_step_scalars(config_with(0.0f, true), 1), pool, isa);
    for (std::size_t i = 0; i < n; ++i) {
      INFO("element " << i);
      REQUIRE(s.weights_out[i].bits == to_bf16(s.master[i]).bits);
      REQUIRE(s.weights_out[i].bits != 0);  // a flush-to-zero convert would give 0 for the subnormals
    }
  }
}

#if defined(__x86_64__)
TEST_CASE("a caller with flush-to-zero set gets the same bits as the workers") {
  // The caller runs tiles too; frameworks often set FTZ/DAZ on their threads. Subnormal masters
  // and gradients would be flushed under FTZ/DAZ, so a kernel that inherited them would differ.
  const std::size_t n = 100000;
  const AdamWConfig c = config_with(0.1f, true);
  auto subnormalise = [](State<float>& st) {
    for (std::size_t i = 0; i < st.p.size(); i += 2) st.p[i] *= 1e-39f;
    for (std::size_t i = 0; i < st.g.size(); i += 3) st.g[i] *= 1e-39f;
  };
  for (CpuIsa isa : supported_cpu_isas()) {
    INFO("isa " << to_string(isa));
    State<float> base(n, 12), flushed(n, 12);
    subnormalise(base);
    subnormalise(flushed);
    ThreadPool workers(3);
    adamw_update(base.span(), adamw_step_scalars(c, 1), workers, isa);
    ThreadPool caller_only(1);
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);  // FTZ | DAZ
    adamw_update(flushed.span(), adamw_step_scalars(c, 1), caller_only, isa);
    const double flushed_sum = grad_sum_of_squares(std::span<const float>(flushed.g), caller_only, isa);
    const unsigned after = _mm_getcsr();
    _mm_setcsr(saved);
    CHECK((after & 0x8040u) == 0x8040u);  // the caller's environment is restored
    require_same_bits(base, flushed, "FTZ/DAZ caller vs worker threads");
    CHECK(flushed_sum == grad_sum_of_squares(std::span<const float>(base.g), workers, isa));
  }
}
#endif

TEST_CASE("weight decay is decoupled: with zero gradients and moments, p becomes p * (1 - lr*wd) exactly") {
  const std::size_t n = 1000;
  const AdamWConfig c = config_with(0.2f, true);
  const AdamWStepScalars k = adamw_step_scalars(c, 1);
  for (CpuIsa isa : supported_cpu_isas()) {
    ThreadPool pool(2);
    State<float> st(n, 9);
    std::fill(st.g.begin(), st.g.end(), 0.0f);
    auto s = st.span();
    std::vector<float> p0(s.master.begin(), s.master.end());
    adamw_update(s, k, pool, isa);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(bits(s.master[i]) == bits(p0[i] * k.decay));
  }
  // And with gradients, decay 0 vs > 0 differs by lr*wd*p0 (the decay is applied once, to the old
  // p): up to the roundings of the two results and of p0*decay, each within u of |p|.
  State<float> a(n, 9), b(n, 9);
  const std::vector<float> p0(a.span().master.begin(), a.span().master.end());
  ThreadPool pool(2);
  adamw_update(a.span(), adamw_step_scalars(config_with(0.0f, true), 1), pool);
  adamw_update(b.span(), adamw_step_scalars(config_with(0.2f, true), 1), pool);
  for (std::size_t i = 0; i < n; ++i) {
    const double expected = -3e-3 * 0.2 * p0[i];
    const double diff = static_cast<double>(b.span().master[i]) - a.span().master[i];
    REQUIRE(std::fabs(diff - expected) <= 4 * u32 * (std::fabs(p0[i]) + 1e-2));
  }
}

TEST_CASE("grad scale multiplies the gradient before anything else") {
  const std::size_t n = 3001;
  const AdamWConfig c = config_with(0.1f, true);
  ThreadPool pool(3);
  State<float> scaled(n, 4), prescaled(n, 4);
  for (float& g : prescaled.g) g = g * 0.37f;
  for (std::int64_t t = 1; t <= 3; ++t) {
    adamw_update(scaled.span(), adamw_step_scalars(c, t, 0.37f), pool);
    adamw_update(prescaled.span(), adamw_step_scalars(c, t, 1.0f), pool);
  }
  require_same_bits(scaled, prescaled, "scale 0.37 vs gradients pre-multiplied by 0.37");
  // A scale of 0 is a step with zero gradients: only decay and the old moments act.
  State<float> zero(n, 4);
  adamw_update(zero.span(), adamw_step_scalars(c, 1, 0.0f), pool);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(zero.span().exp_avg[i] == 0.0f);
}

TEST_CASE("sum of squares is bit-identical across ISAs and thread counts, and accurate") {
  for (std::size_t n : {0u, 1u, 15u, 17u, 65536u * 3u + 5u, 1000003u}) {
    CAPTURE(n);
    const auto g = random_grads(n, 31);
    long double exact = 0.0L;  // 64-bit mantissa; the squares are exact in it too
    for (float x : g) exact += static_cast<long double>(x) * x;
    ThreadPool one(1);
    const double base = grad_sum_of_squares(g, one, CpuIsa::scalar);
    // Per tile each lane adds at most 4096 exact squares in double; bound (4096 + 16 + tiles) * 2^-53.
    CHECK(std::fabs(static_cast<long double>(base) - exact) <= 1e-12L * exact);
    for (CpuIsa isa : supported_cpu_isas()) {
      for (std::size_t threads : {1u, 2u, 3u, 7u}) {
        ThreadPool pool(threads);
        const double s = grad_sum_of_squares(g, pool, isa);
        INFO(to_string(isa) << " with " << threads << " threads");
        REQUIRE(std::bit_cast<std::uint64_t>(s) == std::bit_cast<std::uint64_t>(base));
      }
    }
  }
  ThreadPool pool(2);
  const std::vector<float> three_four = {3.0f, 4.0f};
  CHECK(grad_sum_of_squares(three_four, pool) == 25.0);
}

TEST_CASE("clip_grad_scale follows torch's clip_grad_norm_") {
  CHECK(clip_grad_scale(25.0, 1.0) == static_cast<float>(1.0 / (5.0 + 1e-6)));
  CHECK(clip_grad_scale(25.0, 10.0) == 1.0f);
  CHECK(clip_grad_scale(0.0, 1.0) == 1.0f);
  CHECK_THROWS_AS(clip_grad_scale(1.0, 0.0), Error);
  // A non-finite sum is refused: an infinite one had given a factor of 0, and the host trainer
  // then updated the decoder stack (weight decay, decayed moments) before an end's check threw.
  CHECK_THROWS_WITH_AS(clip_grad_scale(std::numeric_limits<double>::infinity(), 1.0), doctest::Contains("infinite gradient"), Error);
  CHECK_THROWS_AS(clip_grad_scale(std::numeric_limits<double>::quiet_NaN(), 1.0), Error);
}

TEST_CASE("mismatched, misaligned and overlapping spans are refused with their numbers") {
  ThreadPool pool(1);
  const AdamWStepScalars k = adamw_step_scalars(AdamWConfig{}, 1);
  std::vector<float> p(10), m(10), v(9), g(10);
  CHECK_THROWS_WITH_AS(adamw_update(AdamWSpan<float>{p, m, v, g}, k, pool),
                       doctest::Contains("master has 10 elements, exp_avg_sq has 9"), Error);
  std::vector<bf16> out(11);
  v.resize(10);
  CHECK_THROWS_WITH_AS(adamw_update(AdamWSpan<float>{p, m, v, g, out}, k, pool),
                       doctest::Contains("weights_out has 11"), Error);
  // m and v in the same buffer.
  CHECK_THROWS_WITH_AS(adamw_update(AdamWSpan<float>{p, m, std::span(m), g}, k, pool), doctest::Contains("overlaps"),
                       Error);
  // A float pointer one byte off its alignment.
  alignas(16) unsigned char raw[64] = {};
  float* odd = reinterpret_cast<float*>(raw + 1);
  CHECK_THROWS_WITH_AS(adamw_update(AdamWSpan<float>{std::span(odd, 4), std::span(m).first(4), std::span(v).first(4),
                                                     std::span<const float>(g).first(4)},
                                    k, pool),
                       doctest::Contains("not aligned to its 4-byte elements"), Error);
}

TEST_CASE("the ISA can be forced by API and by OOM_CPU_ISA, and a bad request is an error") {
  CHECK(parse_cpu_isa("avx2") == CpuIsa::avx2);
  CHECK_THROWS_WITH_AS(parse_cpu_isa("sse9"), doctest::Contains("'sse9'"), Error);
  CHECK(cpu_supports(CpuIsa::scalar));
  CHECK(supported_cpu_isas().front() == CpuIsa::scalar);
  CHECK(supported_cpu_isas().back() == best_cpu_isa());

  ::unsetenv("OOM_CPU_ISA");
  CHECK(active_cpu_isa() == best_cpu_isa());
  ::setenv("OOM_CPU_ISA", "scalar", 1);
  CHECK(active_cpu_isa() == CpuIsa::scalar);
  ::setenv("OOM_CPU_ISA", "avx9000", 1);
  CHECK_THROWS_WITH_AS(active_cpu_isa(), doctest::Contains("OOM_CPU_ISA"), Error);
  force_cpu_isa(CpuIsa::scalar);  // the API wins over the environment
  CHECK(active_cpu_isa() == CpuIsa::scalar);
  force_cpu_isa(std::nullopt);
  ::unsetenv("OOM_CPU_ISA");
  CHECK(active_cpu_isa() == best_cpu_isa());
  for (CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512}) {
    if (!cpu_supports(isa)) CHECK_THROWS_AS(force_cpu_isa(isa), Error);
  }
}

TEST_CASE("the finiteness check: every NaN and infinity caught at any place, the first one named, every finite value passed") {
  // Odd length over several pool tiles; a bad value at the start, at a tile's edges, at the end.
  const std::size_t n = 3 * sum_of_squares_tile_elements + 77;
  std::vector<float> g(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1e3f);
  for (auto& v : g) v = normal(rng);
  // The finite extremes and the oddities pass: the largest, the smallest normal, a subnormal,
  // both zeros.
  const float finite[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f};
  for (std::size_t k = 0; k < std::size(finite); ++k) g[k * 1000 + 3] = finite[k];
  ThreadPool one(1), four(4);
  CHECK(all_finite(g));
  CHECK_NOTHROW(require_finite_gradients(g, "layer 3"));
  CHECK_NOTHROW(require_finite_gradients(g, "layer 3", four));
  const float bad[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                       std::bit_cast<float>(0x7f800001u) /* a signalling NaN's bits */, std::bit_cast<float>(0xffffffffu)};
  const std::size_t places[] = {0, sum_of_squares_tile_elements - 1, sum_of_squares_tile_elements, 2 * sum_of_squares_tile_elements + 5, n - 1};
  for (const float b : bad)
    for (const std::size_t at : places) {
      CAPTURE(at);
      CAPTURE(std::bit_cast<std::uint32_t>(b));
      std::vector<float> h = g;
      h[at] = b;
      if (at + 9 < n) h[at + 9] = b;  // a second one after it: the first is named
      CHECK_FALSE(all_finite(h));
      const std::string want = fmt::format("in layer 3 at element {}", at);
      CHECK_THROWS_WITH_AS(require_finite_gradients(h, "layer 3"), doctest::Contains(want.c_str()), Error);
      CHECK_THROWS_WITH_AS(require_finite_gradients(h, "layer 3", one), doctest::Contains(want.c_str()), Error);
      CHECK_THROWS_WITH_AS(require_finite_gradients(h, "layer 3", four), doctest::Contains(want.c_str()), Error);
    }
  CHECK(all_finite(std::span<const float>{}));
  CHECK_NOTHROW(require_finite_gradients(std::span<const float>{}, "nothing", four));
}

TEST_CASE("add_gradients adds element by element, the same bits on any thread count and caller's float mode; mismatched lengths are refused") {
  const std::size_t n = 2 * sum_of_squares_tile_elements + 13;
  std::vector<float> a(n), b(n);
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : a) v = normal(rng);
  for (auto& v : b) v = normal(rng);
  std::vector<float> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = a[i] + b[i];
  for (const std::size_t threads : {1, 3, 8}) {
    ThreadPool pool(threads);
    std::vector<float> got = a;
    add_gradients(got, b, pool);
    CHECK(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
  }
#if defined(__x86_64__)
  // A caller with flush-to-zero set (it runs tiles too) gets the IEEE sums: subnormal terms kept.
  std::vector<float> tiny_a(n), tiny_b(n), tiny_want(n);
  for (std::size_t i = 0; i < n; ++i) {
    tiny_a[i] = a[i] * 1e-39f;
    tiny_b[i] = b[i] * 1e-39f;
    tiny_want[i] = tiny_a[i] + tiny_b[i];
  }
  ThreadPool caller_only(1);
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ | DAZ
  add_gradients(tiny_a, tiny_b, caller_only);
  _mm_setcsr(saved);
  CHECK(std::memcmp(tiny_a.data(), tiny_want.data(), n * sizeof(float)) == 0);
#endif
  ThreadPool pool(2);
  std::vector<float> shorter(n - 1);
  CHECK_THROWS_WITH_AS(add_gradients(shorter, b, pool), doctest::Contains(fmt::format("{} elements into {}", n, n - 1).c_str()), Error);
}
