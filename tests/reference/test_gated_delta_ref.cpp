// Host checks of the Gated DeltaNet CPU references (hybrid models' linear attention): each backward
// against central finite differences of its forward, the forward against the delta rule written
// out for one token, and forward and backward against PyTorch's autograd through transformers'
// own functions (tests/data/gated_delta_torch.safetensors, made by scripts/make_gated_delta_fixture.py).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/reference/gated_delta.hpp"
#include "support/compare.hpp"
#include "support/finite_differences.hpp"

namespace ref = oom::reference;
using oom::test::check_fd;
using oom::test::dot;
using oom::test::random_normal;

namespace {

std::vector<float> uniform(std::size_t n, std::uint64_t seed, float lo, float hi) {
  auto v = random_normal(n, seed);
  for (auto& x : v) x = lo + (hi - lo) * (0.5f + 0.5f * std::tanh(x));
  return v;
}

}  // namespace

TEST_CASE("gated delta rule: one token is the rule written out; the state carries to the next token") {
  // One key head, one value head, dk = dv = 2, from a zero state: out_0 = beta (q.k) v with q, k
  // unit vectors and q scaled by 1/sqrt(2). A second token decays the state by exp(g).
  const ref::GatedDeltaShape s{.tokens = 2, .k_heads = 1, .v_heads = 1, .k_dim = 2, .v_dim = 2};
  const std::vector<float> q = {3, 4, 0, 1}, k = {1, 0, 0, 2}, v = {2, -1, 5, 7}, g = {0, std::log(0.5f)}, beta = {0.5f, 1};
  const auto out = ref::gated_delta_rule_forward(s, q, k, v, g, beta);
  const double r = 1 / std::sqrt(25 + 1e-6), scale = 1 / std::sqrt(2.0), kk = 1 / std::sqrt(1 + 1e-6);
  // S_1 = k1 (beta v)^T with k1 = (kk, 0): column i = 0 only.
  CHECK(out[0] == doctest::Approx(3 * r * scale * kk * 0.5 * 2).epsilon(1e-6));
  CHECK(out[1] == doctest::Approx(3 * r * scale * kk * 0.5 * -1).epsilon(1e-6));
  // Token 2: S = 0.5 S_1; k2 = (0, ~1) reads nothing of it (u = 0), so S_2 = 0.5 S_1 + k2 v2^T;
  // q2 = (0, ~1) sees only k2's row.
  const double k2 = 2 / std::sqrt(4 + 1e-6), q2 = 1 / std::sqrt(1 + 1e-6);
  CHECK(out[2] == doctest::Approx(q2 * scale * k2 * 5).epsilon(1e-6));
  CHECK(out[3] == doctest::Approx(q2 * scale * k2 * 7).epsilon(1e-6));
}

TEST_CASE("gated delta rule: backward matches finite differences, value heads sharing key heads") {
  // 2 key heads, 4 value heads (2 per key head), odd sizes.
  const ref::GatedDeltaShape s{.tokens = 7, .k_heads = 2, .v_heads = 4, .k_dim = 3, .v_dim = 5};
  const auto nq = static_cast<std::size_t>(s.tokens * s.k_heads * s.k_dim);
  const auto nv = static_cast<std::size_t>(s.tokens * s.v_heads * s.v_dim);
  const auto ng = static_cast<std::size_t>(s.tokens * s.v_heads);
  auto q = random_normal(nq, 1), k = random_normal(nq, 2), v = random_normal(nv, 3);
  auto g = uniform(ng, 4, -1.5f, -0.05f), beta = uniform(ng, 5, 0.1f, 0.9f);
  const auto w = random_normal(nv, 6);  // loss = sum w * out
  const auto gr = ref::gated_delta_rule_backward(s, q, k, v, g, beta, w);
  const auto loss = [&] { return dot(ref::gated_delta_rule_forward(s, q, k, v, g, beta), w); };
  check_fd(q, gr.dq, loss, "dq");
  check_fd(k, gr.dk, loss, "dk");
  check_fd(v, gr.dv, loss, "dv");
  check_fd(g, gr.dg, loss, "dg");
  check_fd(beta, gr.dbeta, loss, "dbeta");
}

TEST_CASE("gated delta rule from a carried state: a sequence split in two is the whole; the state's gradients match finite differences") {
  // docs/hybrid.md, slice 6: the block run in token chunks hands the rule's state forward and its
  // gradient backward. T = 11 split at m = 4 (no chunk-size multiple), value heads sharing keys.
  const ref::GatedDeltaShape whole{.tokens = 11, .k_heads = 2, .v_heads = 4, .k_dim = 3, .v_dim = 5};
  const std::int64_t m = 4, dk = whole.k_dim, dv = whole.v_dim, kh = whole.k_heads, vh = whole.v_heads;
  const auto nq = static_cast<std::size_t>(whole.tokens * kh * dk), nv = static_cast<std::size_t>(whole.tokens * vh * dv);
  const auto ng = static_cast<std::size_t>(whole.tokens * vh);
  auto q = random_normal(nq, 11), k = random_normal(nq, 12), v = random_normal(nv, 13);
  auto g = uniform(ng, 14, -1.5f, -0.05f), beta = uniform(ng, 15, 0.1f, 0.9f);
  const auto w = random_normal(nv, 16);  // loss = sum w * out
  // Rows [from, to) of a (T, heads, dim) array.
  const auto rows = [](const std::vector<float>& x, std::int64_t per_token, std::int64_t from, std::int64_t to) {
    return std::vector<float>(x.begin() + from * per_token, x.begin() + to * per_token);
  };
  const ref::GatedDeltaShape first{.tokens = m, .k_heads = kh, .v_heads = vh, .k_dim = dk, .v_dim = dv};
  ref::GatedDeltaShape second = first;
  second.tokens = whole.tokens - m;
  const auto part = [&](const ref::GatedDeltaShape& s, std::int64_t from, std::int64_t to, std::span<const float> initial) {
    return ref::gated_delta_rule_forward_from(s, rows(q, kh * dk, from, to), rows(k, kh * dk, from, to), rows(v, vh * dv, from, to),
                                              rows(g, vh, from, to), rows(beta, vh, from, to), initial);
  };
  const auto out = ref::gated_delta_rule_forward(whole, q, k, v, g, beta);
  const auto a = part(first, 0, m, {});
  const auto b = part(second, m, whole.tokens, a.final_state);
  std::vector<float> joined = a.out;
  joined.insert(joined.end(), b.out.begin(), b.out.end());
  // The state handed over is rounded to fp32 once: the second part's outputs move by ~1e-7.
  CHECK(oom::test::rel_l2(joined, out) <= 1e-6);
  CHECK(oom::test::rel_l2(a.out, rows(out, vh * dv, 0, m)) == 0.0);  // from zeros: the same arithmetic

  // Backward: the second part from d_final = 0 gives d_initial; the first takes it as its d_final.
  const auto gw = ref::gated_delta_rule_backward(whole, q, k, v, g, beta, w);
  const auto part_back = [&](const ref::GatedDeltaShape& s, std::int64_t from, std::int64_t to, std::span<const float> initial,
                             std::span<const float> d_final) {
    return ref::gated_delta_rule_backward_from(s, rows(q, kh * dk, from, to), rows(k, kh * dk, from, to), rows(v, vh * dv, from, to),
                                               rows(g, vh, from, to), rows(beta, vh, from, to), rows(w, vh * dv, from, to), initial,
                                               d_final);
  };
  const auto gb = part_back(second, m, whole.tokens, a.final_state, {});
  const auto ga = part_back(first, 0, m, {}, gb.d_initial);
  const auto join = [](const std::vector<float>& x, const std::vector<float>& y) {
    std::vector<float> z = x;
    z.insert(z.end(), y.begin(), y.end());
    return z;
  };
  CHECK(oom::test::rel_l2(join(ga.grads.dq, gb.grads.dq), gw.dq) <= 1e-6);
  CHECK(oom::test::rel_l2(join(ga.grads.dk, gb.grads.dk), gw.dk) <= 1e-6);
  CHECK(oom::test::rel_l2(join(ga.grads.dv, gb.grads.dv), gw.dv) <= 1e-6);
  CHECK(oom::test::rel_l2(join(ga.grads.dg, gb.grads.dg), gw.dg) <= 1e-6);
  CHECK(oom::test::rel_l2(join(ga.grads.dbeta, gb.grads.dbeta), gw.dbeta) <= 1e-6);

  // The state's own gradients against central differences, with a nonzero d_final: the loss of
  // the second part is sum w * out + sum wf * final_state, from a given initial state.
  auto initial = random_normal(static_cast<std::size_t>(vh * dk * dv), 17, 0.5f);
  const auto wf = random_normal(initial.size(), 18);
  const auto loss = [&] {
    const auto c = part(second, m, whole.tokens, initial);
    return dot(c.out, rows(w, vh * dv, m, whole.tokens)) + dot(c.final_state, wf);
  };
  const auto gi = part_back(second, m, whole.tokens, initial, wf);
  check_fd(initial, gi.d_initial, loss, "d_initial");
  auto vs = rows(v, vh * dv, m, whole.tokens);  // and an input, through the carried state and d_final
  const auto loss_v = [&] {
    const auto c = ref::gated_delta_rule_forward_from(second, rows(q, kh * dk, m, whole.tokens), rows(k, kh * dk, m, whole.tokens), vs,
                                                      rows(g, vh, m, whole.tokens), rows(beta, vh, m, whole.tokens), initial);
    return dot(c.out, rows(w, vh * dv, m, whole.tokens)) + dot(c.final_state, wf);
  };
  check_fd(vs, gi.grads.dv, loss_v, "dv with d_final");
  // A carried state of the wrong size is named.
  CHECK_THROWS_WITH_AS(part(second, m, whole.tokens, std::vector<float>(3)), doctest::Contains("initial"), oom::Error);
}

TEST_CASE("chunked gated delta rule: the recurrence's outputs, and its states at every chunk boundary") {
  const ref::GatedDeltaShape s{.tokens = 11, .k_heads = 2, .v_heads = 4, .k_dim = 3, .v_dim = 5};
  const auto nq = static_cast<std::size_t>(s.tokens * s.k_heads * s.k_dim);
  const auto q = random_normal(nq, 21), k = random_normal(nq, 22);
  const auto v = random_normal(static_cast<std::size_t>(s.tokens * s.v_heads * s.v_dim), 23);
  const auto g = uniform(static_cast<std::size_t>(s.tokens * s.v_heads), 24, -1.5f, -0.05f);
  const auto beta = uniform(g.size(), 25, 0.1f, 0.9f);
  const auto recurrent = ref::gated_delta_rule_forward(s, q, k, v, g, beta);
  const auto each = ref::gated_delta_rule_chunked_forward(s, q, k, v, g, beta, 1);  // a state after every token
  const std::int64_t per_state = s.k_dim * s.v_dim;
  for (std::int64_t chunk : {1, 3, 4, 11, 64}) {
    CAPTURE(chunk);
    const auto c = ref::gated_delta_rule_chunked_forward(s, q, k, v, g, beta, chunk);
    const auto r = oom::test::compare(std::span<const float>(c.out), std::span<const float>(recurrent), 1e-5, 1e-6, "out");
    INFO(r.first);
    CHECK(r.ok());
    const std::int64_t chunks = (s.tokens + chunk - 1) / chunk;
    REQUIRE(c.states.size() == static_cast<std::size_t>(s.v_heads * (chunks + 1) * per_state));
    for (std::int64_t h = 0; h < s.v_heads; ++h)
      for (std::int64_t b = 0; b <= chunks; ++b) {
        const std::int64_t token = std::min(b * chunk, s.tokens);  // the state entering this token
        const std::span<const float> got(&c.states[(h * (chunks + 1) + b) * per_state], static_cast<std::size_t>(per_state));
        const std::span<const float> want(&each.states[(h * (s.tokens + 1) + token) * per_state], static_cast<std::size_t>(per_state));
        CHECK(oom::test::compare(got, want, 1e-5, 1e-6, "state").ok());
      }
  }
  CHECK_THROWS_WITH_AS(ref::gated_delta_rule_chunked_forward(s, q, k, v, g, beta, 0), doctest::Contains("chunk 0"), oom::Error);
}

TEST_CASE("chunked gated delta rule backward: the recurrence's gradients at every chunk size") {
  // Both in fp64 in other orders, each rounded to fp32 once: within a few fp32 ulps.
  const ref::GatedDeltaShape s{.tokens = 23, .k_heads = 2, .v_heads = 4, .k_dim = 5, .v_dim = 3};
  const auto nq = static_cast<std::size_t>(s.tokens * s.k_heads * s.k_dim);
  const auto q = random_normal(nq, 31), k = random_normal(nq, 32);
  const auto v = random_normal(static_cast<std::size_t>(s.tokens * s.v_heads * s.v_dim), 33);
  const auto g = uniform(static_cast<std::size_t>(s.tokens * s.v_heads), 34, -1.5f, -0.05f);
  const auto beta = uniform(g.size(), 35, 0.1f, 0.9f);
  const auto d_out = random_normal(v.size(), 36);
  const auto want = ref::gated_delta_rule_backward(s, q, k, v, g, beta, d_out);
  for (std::int64_t chunk : {1, 3, 4, 11, 64}) {
    CAPTURE(chunk);
    const auto got = ref::gated_delta_rule_chunked_backward(s, q, k, v, g, beta, d_out, chunk);
    const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
        {&got.dq, &want.dq}, {&got.dk, &want.dk}, {&got.dv, &want.dv}, {&got.dg, &want.dg}, {&got.dbeta, &want.dbeta}};
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
    for (int i = 0; i < 5; ++i) {
      double scale = 0;
      for (float x : *pairs[i].second) scale = std::max(scale, static_cast<double>(std::abs(x)));
      const auto r = oom::test::compare(std::span<const float>(*pairs[i].first), std::span<const float>(*pairs[i].second), 1e-6,
                                        1e-6 * scale, names[i]);
      INFO(names[i] << ": " << r.first);
      CHECK(r.checked == pairs[i].second->size());
      CHECK(r.ok());
    }
  }
  CHECK_THROWS_WITH_AS(ref::gated_delta_rule_chunked_backward(s, q, k, v, g, beta, d_out, 0), doctest::Contains("chunk 0"), oom::Error);
}

TEST_CASE("gated delta rule: shapes are checked by name") {
  const ref::GatedDeltaShape s{.tokens = 2, .k_heads = 2, .v_heads = 3, .k_dim = 2, .v_dim = 2};
  const std::vector<float> x(8);
  CHECK_THROWS_WITH_AS(ref::gated_delta_rule_forward(s, x, x, x, x, x), doctest::Contains("multiple of key heads"), oom::Error);
  const ref::GatedDeltaShape ok{.tokens = 2, .k_heads = 1, .v_heads = 1, .k_dim = 2, .v_dim = 2};
  CHECK_THROWS_WITH_AS(ref::gated_delta_rule_forward(ok, x, std::vector<float>(4), std::vector<float>(4), std::vector<float>(2),
                                                     std::vector<float>(2)),
                       doctest::Contains("q has 8 elements, expected 4"), oom::Error);
}

TEST_CASE("causal conv1d + SiLU: causal, and its backward matches finite differences") {
  const std::int64_t T = 9, C = 5, K = 4;
  auto x = random_normal(static_cast<std::size_t>(T * C), 7), w = random_normal(static_cast<std::size_t>(C * K), 8, 0.5f);
  const auto y = ref::causal_conv1d_silu_forward(T, C, K, x, w);
  // Causal: changing token 5 leaves tokens 0-4 as they were, and changes token 5.
  auto x2 = x;
  for (std::int64_t c = 0; c < C; ++c) x2[5 * C + c] += 1.0f;
  const auto y2 = ref::causal_conv1d_silu_forward(T, C, K, x2, w);
  for (std::int64_t i = 0; i < 5 * C; ++i) CHECK(y2[i] == y[i]);
  CHECK(y2[5 * C] != y[5 * C]);
  // Token 0 sees only its own input, through the last tap.
  for (std::int64_t c = 0; c < C; ++c) {
    const double z = static_cast<double>(w[c * K + K - 1]) * x[c];
    CHECK(y[c] == doctest::Approx(z / (1 + std::exp(-z))).epsilon(1e-6));
  }
  const auto dy = random_normal(y.size(), 9);
  const auto gr = ref::causal_conv1d_silu_backward(T, C, K, x, w, dy);
  const auto loss = [&] { return dot(ref::causal_conv1d_silu_forward(T, C, K, x, w), dy); };
  check_fd(x, gr.dx, loss, "dx");
  check_fd(w, gr.dw, loss, "dw");
}

TEST_CASE("causal conv1d + SiLU continuing a sequence: a split in two is the whole, the forward bit for bit, the gradients within fp32 rounding") {
  // T = 9 split at 2 (fewer tokens than the K - 1 = 3 rows of history: the second part's history
  // reaches into the zeros before the sequence) and at 6.
  const std::int64_t T = 9, C = 5, K = 4;
  const auto x = random_normal(static_cast<std::size_t>(T * C), 21), w = random_normal(static_cast<std::size_t>(C * K), 22, 0.5f);
  const auto dy = random_normal(x.size(), 23);
  const auto y = ref::causal_conv1d_silu_forward(T, C, K, x, w);
  const auto gw = ref::causal_conv1d_silu_backward(T, C, K, x, w, dy);
  for (const std::int64_t m : {std::int64_t{2}, std::int64_t{6}}) {
    CAPTURE(m);
    const std::vector<float> x1(x.begin(), x.begin() + m * C), x2(x.begin() + m * C, x.end());
    const std::vector<float> dy1(dy.begin(), dy.begin() + m * C), dy2(dy.begin() + m * C, dy.end());
    // The history: the K - 1 input rows before token m, zeros before token 0.
    std::vector<float> history(static_cast<std::size_t>((K - 1) * C), 0.0f);
    for (std::int64_t r = 0; r < K - 1; ++r) {
      const std::int64_t t = m - (K - 1) + r;
      if (t >= 0) std::copy(x.begin() + t * C, x.begin() + (t + 1) * C, history.begin() + r * C);
    }
    auto y1 = ref::causal_conv1d_silu_forward_from(m, C, K, x1, w, {});
    const auto y2 = ref::causal_conv1d_silu_forward_from(T - m, C, K, x2, w, history);
    y1.insert(y1.end(), y2.begin(), y2.end());
    CHECK(y1 == y);
    // Backward: the second part's d_history lands on the K - 1 rows before token m.
    const auto g2 = ref::causal_conv1d_silu_backward_from(T - m, C, K, x2, w, history, dy2);
    const auto g1 = ref::causal_conv1d_silu_backward_from(m, C, K, x1, w, {}, dy1);
    std::vector<double> dx(g1.grads.dx.begin(), g1.grads.dx.end());
    dx.insert(dx.end(), g2.grads.dx.begin(), g2.grads.dx.end());
    for (std::int64_t r = 0; r < K - 1; ++r) {
      const std::int64_t t = m - (K - 1) + r;
      if (t >= 0)
        for (std::int64_t c = 0; c < C; ++c) dx[t * C + c] += g2.d_history[r * C + c];
    }
    for (std::size_t i = 0; i < dx.size(); ++i) CHECK(dx[i] == doctest::Approx(gw.dx[i]).epsilon(1e-6));
    for (std::size_t i = 0; i < gw.dw.size(); ++i)
      CHECK(static_cast<double>(g1.grads.dw[i]) + g2.grads.dw[i] == doctest::Approx(gw.dw[i]).epsilon(1e-5));
  }
  CHECK_THROWS_WITH_AS(ref::causal_conv1d_silu_forward_from(T, C, K, x, w, std::vector<float>(C)), doctest::Contains("history"), oom::Error);
}

TEST_CASE("delta gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); backward matches finite differences") {
  const std::int64_t T = 6, H = 3;
  auto a = random_normal(static_cast<std::size_t>(T * H), 10, 2.0f), b = random_normal(a.size(), 11);
  auto a_log = uniform(static_cast<std::size_t>(H), 12, -1.0f, 1.0f), dt = uniform(static_cast<std::size_t>(H), 13, 0.5f, 1.5f);
  a[0] = 30.0f;  // past softplus's threshold of 20, as torch's
  const auto f = ref::delta_gates_forward(T, H, a, b, a_log, dt);
  CHECK(f.g[0] == doctest::Approx(-std::exp(a_log[0]) * (30.0 + dt[0])).epsilon(1e-6));
  CHECK(f.beta[1] == doctest::Approx(1 / (1 + std::exp(-static_cast<double>(b[1])))).epsilon(1e-6));
  for (float gi : f.g) CHECK(gi < 0.0f);
  // The threshold is what keeps a large a finite: log1p(exp(1000)) overflows.
  auto big = a;
  big[1] = 1000.0f;
  const auto fb = ref::delta_gates_forward(T, H, big, b, a_log, dt);
  const auto gb = ref::delta_gates_backward(T, H, big, b, a_log, dt, std::vector<float>(a.size(), 1.0f), std::vector<float>(a.size(), 1.0f));
  CHECK(std::isfinite(fb.g[1]));
  CHECK(std::isfinite(gb.da[1]));
  CHECK(std::isfinite(gb.da_log[1]));
  const auto wb = random_normal(a.size(), 14), wg = random_normal(a.size(), 15);
  const auto gr = ref::delta_gates_backward(T, H, a, b, a_log, dt, wb, wg);
  const auto loss = [&] {
    const auto o = ref::delta_gates_forward(T, H, a, b, a_log, dt);
    return dot(o.beta, wb) + dot(o.g, wg);
  };
  check_fd(a, gr.da, loss, "da");
  check_fd(b, gr.db, loss, "db");
  check_fd(a_log, gr.da_log, loss, "dA_log");
  check_fd(dt, gr.ddt_bias, loss, "ddt_bias");
}

TEST_CASE("gated RMSNorm: y = w x / rms(x) silu(z); backward matches finite differences") {
  const std::int64_t rows = 5, dim = 7;
  const double eps = 1e-6;
  auto x = random_normal(static_cast<std::size_t>(rows * dim), 16), z = random_normal(x.size(), 17);
  auto w = uniform(static_cast<std::size_t>(dim), 18, 0.5f, 1.5f);
  const auto y = ref::gated_rmsnorm_forward(rows, dim, x, z, w, eps);
  double ms = 0;
  for (std::int64_t i = 0; i < dim; ++i) ms += static_cast<double>(x[i]) * x[i] / dim;
  const double z0 = z[0];
  CHECK(y[0] == doctest::Approx(w[0] * x[0] / std::sqrt(ms + eps) * z0 / (1 + std::exp(-z0))).epsilon(1e-6));
  const auto dy = random_normal(y.size(), 19);
  const auto gr = ref::gated_rmsnorm_backward(rows, dim, x, z, w, eps, dy);
  const auto loss = [&] { return dot(ref::gated_rmsnorm_forward(rows, dim, x, z, w, eps), dy); };
  check_fd(x, gr.dx, loss, "dx");
  check_fd(z, gr.dz, loss, "dz");
  check_fd(w, gr.dw, loss, "dw");
}

namespace {

/// PyTorch's run of each piece (scripts/make_gated_delta_fixture.py): fp32 tensors by name.
struct TorchFixture {
  oom::SafetensorsFile file = oom::SafetensorsFile::open(std::filesystem::path(OOM_SOURCE_DIR) / "tests/data/gated_delta_torch.safetensors");
  [[nodiscard]] std::vector<float> operator[](const char* name) const {
    const auto& t = file.at(name);
    REQUIRE(t.dtype == oom::DType::fp32);
    std::vector<float> v(t.elements());
    std::memcpy(v.data(), t.data.data(), v.size() * sizeof(float));
    return v;
  }
  [[nodiscard]] std::int64_t dim(const char* name, std::size_t i) const {
    return static_cast<std::int64_t>(file.at(name).shape.at(i));
  }
  [[nodiscard]] std::string meta(const char* key) const {
    for (const auto& [k, v] : file.metadata())
      if (k == key) return v;
    FAIL("the fixture has no metadata '" << key << "': make it again with scripts/make_gated_delta_fixture.py");
    return {};
  }
};

/// fp32 PyTorch against fp64 arithmetic on the same fp32 inputs. PyTorch's own rounding, measured
/// against an fp64 run of the block (thirty-fourth session): up to 6e-5 on d in_proj_qkvz, whose
/// largest value is 36.5, i.e. 1.6e-6 of the tensor's scale; we were within 6e-6 of the fp64 run
/// there. So: 1e-4 relative, plus 1e-5 of the tensor's largest magnitude (at least 1e-5), far below
/// any error of the math (a wrong term moves a gradient by its own size).
void check_torch(std::span<const float> ours, std::span<const float> torch_values, const char* what) {
  double scale = 0;
  for (float v : torch_values) scale = std::max(scale, static_cast<double>(std::abs(v)));
  const auto r = oom::test::compare(ours, torch_values, 1e-4, std::max(1e-5, 1e-5 * scale), what);
  INFO(std::string(what) << ": max abs err " << r.max_abs_err << "\n" << r.first);
  CHECK(r.checked == torch_values.size());
  CHECK(r.ok());
}

/// A whole block of the fixture (tensors named `prefix` + ...), in `layout`, against PyTorch.
void check_block(const TorchFixture& fx, const std::string& prefix, ref::DeltaNetLayout layout) {
  const auto name = [&](const char* n) { return prefix + n; };
  const auto get = [&](const char* n) { return fx[name(n).c_str()]; };
  const ref::GatedDeltaNetShape s{.tokens = fx.dim(name("x").c_str(), 1), .hidden = fx.dim(name("x").c_str(), 2),
                                  .k_heads = std::stoll(fx.meta(name("key_heads").c_str())), .v_heads = std::stoll(fx.meta(name("value_heads").c_str())),
                                  .k_dim = std::stoll(fx.meta(name("key_head_dim").c_str())), .v_dim = std::stoll(fx.meta(name("value_head_dim").c_str())),
                                  .conv_kernel = fx.dim(name("conv").c_str(), 1), .eps = std::stod(fx.meta(name("eps").c_str())),
                                  .layout = layout};
  REQUIRE(s.k_heads > 1);  // the two layouts coincide with one key head
  REQUIRE(s.v_heads > s.k_heads);  // and grouped value heads are exercised
  REQUIRE(fx.dim(name("in_proj_qkvz").c_str(), 0) == 2 * s.key_width() + 2 * s.value_width());
  REQUIRE(fx.dim(name("conv").c_str(), 0) == s.conv_channels());
  const auto x = get("x"), qkvz = get("in_proj_qkvz"), ba = get("in_proj_ba"), conv = get("conv");
  const auto a_log = get("A_log"), dt = get("dt_bias"), norm = get("norm"), out = get("out_proj");
  const ref::GatedDeltaNetWeights w{qkvz, ba, conv, a_log, dt, norm, out};
  check_torch(ref::gated_deltanet_forward(s, x, w), get("y"), "y");
  const auto gr = ref::gated_deltanet_backward(s, x, w, get("dy"));
  check_torch(gr.dx, get("dx"), "dx");
  check_torch(gr.in_proj_qkvz, get("din_proj_qkvz"), "d in_proj_qkvz");
  check_torch(gr.in_proj_ba, get("din_proj_ba"), "d in_proj_ba");
  check_torch(gr.conv, get("dconv"), "d conv");
  check_torch(gr.a_log, get("dA_log"), "d A_log");
  check_torch(gr.dt_bias, get("ddt_bias"), "d dt_bias");
  check_torch(gr.norm, get("dnorm"), "d norm");
  check_torch(gr.out_proj, get("dout_proj"), "d out_proj");
}

}  // namespace

TEST_CASE("gated delta pieces against PyTorch's autograd through transformers' Qwen3-Next functions") {
  const TorchFixture fx;
  std::string made_with;
  for (const auto& [key, value] : fx.file.metadata()) made_with += key + " " + value + "; ";
  INFO("fixture: " << made_with);

  SUBCASE("the gated delta rule (recurrent; the chunked form the model runs agrees)") {
    const ref::GatedDeltaShape s{.tokens = fx.dim("core_q", 1), .k_heads = fx.dim("core_q", 2), .v_heads = fx.dim("core_v", 2),
                                 .k_dim = fx.dim("core_q", 3), .v_dim = fx.dim("core_v", 3)};
    REQUIRE(s.v_heads > s.k_heads);  // grouped value heads are exercised
    const auto q = fx["core_q"], k = fx["core_k"], v = fx["core_v"], g = fx["core_g"], beta = fx["core_beta"];
    const auto out = ref::gated_delta_rule_forward(s, q, k, v, g, beta);
    check_torch(out, fx["core_out"], "out");
    check_torch(out, fx["core_out_chunked"], "out vs the chunked form");
    check_torch(ref::gated_delta_rule_chunked_forward(s, q, k, v, g, beta, 4).out, fx["core_out_chunked"],
                "our chunks of 4 vs transformers' chunks of 4");
    const auto gr = ref::gated_delta_rule_backward(s, q, k, v, g, beta, fx["core_w"]);
    check_torch(gr.dq, fx["core_dq"], "dq");
    check_torch(gr.dk, fx["core_dk"], "dk");
    check_torch(gr.dv, fx["core_dv"], "dv");
    check_torch(gr.dg, fx["core_dg"], "dg");
    check_torch(gr.dbeta, fx["core_dbeta"], "dbeta");
  }
  SUBCASE("the causal conv1d + SiLU") {
    const std::int64_t T = fx.dim("conv_x", 1), C = fx.dim("conv_x", 2), K = fx.dim("conv_w", 1);
    const auto x = fx["conv_x"], w = fx["conv_w"];
    check_torch(ref::causal_conv1d_silu_forward(T, C, K, x, w), fx["conv_y"], "y");
    const auto gr = ref::causal_conv1d_silu_backward(T, C, K, x, w, fx["conv_dy"]);
    check_torch(gr.dx, fx["conv_dx"], "dx");
    check_torch(gr.dw, fx["conv_dw"], "dw");
  }
  SUBCASE("the gates") {
    const std::int64_t T = fx.dim("gates_a", 1), H = fx.dim("gates_a", 2);
    const auto a = fx["gates_a"], b = fx["gates_b"], a_log = fx["gates_A_log"], dt = fx["gates_dt_bias"];
    REQUIRE(a[0] > 20.0f);  // past softplus's threshold (where the two branches agree to ~1e-11)
    const auto f = ref::delta_gates_forward(T, H, a, b, a_log, dt);
    check_torch(f.beta, fx["gates_beta"], "beta");
    check_torch(f.g, fx["gates_g"], "g");
    const auto gr = ref::delta_gates_backward(T, H, a, b, a_log, dt, fx["gates_wbeta"], fx["gates_wg"]);
    check_torch(gr.da, fx["gates_da"], "da");
    check_torch(gr.db, fx["gates_db"], "db");
    check_torch(gr.da_log, fx["gates_dA_log"], "dA_log");
    check_torch(gr.ddt_bias, fx["gates_ddt_bias"], "ddt_bias");
  }
  SUBCASE("the whole block, Qwen3NextGatedDeltaNet: its fused layout and every gradient") {
    check_block(fx, "block_", ref::DeltaNetLayout::qwen3_next_fused);
  }
  SUBCASE("the whole block, Qwen3_5MoeGatedDeltaNet: its stacked layout and every gradient") {
    check_block(fx, "b35_", ref::DeltaNetLayout::qwen3_5_stacked);
  }
  SUBCASE("the gated RMSNorm") {
    const std::int64_t rows = fx.dim("norm_x", 0), dim = fx.dim("norm_x", 1);
    const auto x = fx["norm_x"], z = fx["norm_z"], w = fx["norm_w"];
    check_torch(ref::gated_rmsnorm_forward(rows, dim, x, z, w, 1e-6), fx["norm_y"], "y");
    const auto gr = ref::gated_rmsnorm_backward(rows, dim, x, z, w, 1e-6, fx["norm_dy"]);
    check_torch(gr.dx, fx["norm_dx"], "dx");
    check_torch(gr.dz, fx["norm_dz"], "dz");
    check_torch(gr.dw, fx["norm_dw"], "dw");
  }
}

TEST_CASE("the Gated DeltaNet block in token chunks (slice 6): chunks run in order, carrying state and conv rows, are the whole block") {
  // Both layouts (2 key heads of 2 value heads each, so the two route differently); T = 13 cut
  // into chunks of 5, 2, 1 and 5: the middle ones shorter than the conv's K - 1 = 3 history rows,
  // so their history reaches back over more than one chunk. The forward's outputs and, running the
  // chunks' backwards last to first with the carried gradients, dx and every weight gradient
  // (summed over chunks) equal the whole block's within the fp32 handover of the state.
  for (const auto layout : {ref::DeltaNetLayout::qwen3_next_fused, ref::DeltaNetLayout::qwen3_5_stacked}) {
    CAPTURE(static_cast<int>(layout));
    const ref::GatedDeltaNetShape s{.tokens = 13, .hidden = 6, .k_heads = 2, .v_heads = 4, .k_dim = 3, .v_dim = 2,
                                    .conv_kernel = 4, .eps = 1e-6, .layout = layout};
    const auto o = ref::gated_deltanet_offsets(s);
    auto segment = random_normal(static_cast<std::size_t>(o.end), 31, 0.4f);
    for (std::int64_t i = o.a_log; i < o.norm; ++i) segment[i] = 0.3f * segment[i];  // A_log, norm near 0 / 1
    for (std::int64_t i = o.norm; i < o.out_proj; ++i) segment[i] = 1.0f + 0.1f * segment[i];
    const auto w = ref::gated_deltanet_weights(s, segment);
    const auto x = random_normal(static_cast<std::size_t>(s.tokens * s.hidden), 32);
    const auto d_out = random_normal(x.size(), 33);
    const auto y = ref::gated_deltanet_forward(s, x, w);
    const auto whole = ref::gated_deltanet_backward(s, x, w, d_out);

    const std::vector<std::int64_t> cuts = {0, 5, 7, 8, 13};
    std::vector<ref::GatedDeltaNetCarry> carry_in(cuts.size() - 1);  // carry_in[0]: zeros
    std::vector<float> y_chunks;
    const auto rows = [&](const std::vector<float>& v, std::size_t c) {
      return std::vector<float>(v.begin() + cuts[c] * s.hidden, v.begin() + cuts[c + 1] * s.hidden);
    };
    const auto shape = [&](std::size_t c) {
      ref::GatedDeltaNetShape sc = s;
      sc.tokens = cuts[c + 1] - cuts[c];
      return sc;
    };
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      auto chunk = ref::gated_deltanet_forward_from(shape(c), rows(x, c), w, carry_in[c]);
      y_chunks.insert(y_chunks.end(), chunk.out.begin(), chunk.out.end());
      if (c + 2 < cuts.size()) carry_in[c + 1] = std::move(chunk.carry);
    }
    CHECK(oom::test::rel_l2(y_chunks, y) <= 1e-6);

    ref::GatedDeltaNetCarry d_carry;  // the last chunk's: zeros
    std::vector<float> dx(x.size());
    std::vector<double> sums[7];
    const auto add = [](std::vector<double>& to, const std::vector<float>& g) {
      to.resize(g.size(), 0.0);
      for (std::size_t i = 0; i < g.size(); ++i) to[i] += g[i];
    };
    for (std::size_t c = cuts.size() - 1; c-- > 0;) {
      auto g = ref::gated_deltanet_backward_from(shape(c), rows(x, c), w, rows(d_out, c), carry_in[c], d_carry);
      std::copy(g.grads.dx.begin(), g.grads.dx.end(), dx.begin() + cuts[c] * s.hidden);
      const std::vector<float>* parts[7] = {&g.grads.in_proj_qkvz, &g.grads.in_proj_ba, &g.grads.conv, &g.grads.a_log,
                                            &g.grads.dt_bias, &g.grads.norm, &g.grads.out_proj};
      for (int i = 0; i < 7; ++i) add(sums[i], *parts[i]);
      d_carry = std::move(g.d_carry_in);
    }
    CHECK(oom::test::rel_l2(dx, whole.dx) <= 1e-5);
    const std::vector<float>* want[7] = {&whole.in_proj_qkvz, &whole.in_proj_ba, &whole.conv, &whole.a_log,
                                         &whole.dt_bias, &whole.norm, &whole.out_proj};
    for (int i = 0; i < 7; ++i) {
      CAPTURE(i);
      const std::vector<float> got(sums[i].begin(), sums[i].end());
      CHECK(oom::test::rel_l2(got, *want[i]) <= 1e-5);
    }
  }
}

TEST_CASE("the Gated DeltaNet block from a carry: the carry's and dx's gradients match finite differences; bad carries named") {
  // A chunk of 2 tokens (shorter than K - 1 = 3) from a nonzero carry, with a nonzero gradient of
  // the carry it hands on: loss = out . d_out + carry_out . d_carry_out.
  const ref::GatedDeltaNetShape s{.tokens = 2, .hidden = 6, .k_heads = 2, .v_heads = 4, .k_dim = 3, .v_dim = 2,
                                  .conv_kernel = 4, .eps = 1e-6, .layout = ref::DeltaNetLayout::qwen3_next_fused};
  const auto o = ref::gated_deltanet_offsets(s);
  auto segment = random_normal(static_cast<std::size_t>(o.end), 41, 0.4f);
  for (std::int64_t i = o.norm; i < o.out_proj; ++i) segment[i] = 1.0f + 0.1f * segment[i];
  const auto w = ref::gated_deltanet_weights(s, segment);
  auto x = random_normal(static_cast<std::size_t>(s.tokens * s.hidden), 42);
  const auto d_out = random_normal(x.size(), 43);
  ref::GatedDeltaNetCarry in{random_normal(static_cast<std::size_t>(s.v_heads * s.k_dim * s.v_dim), 44, 0.5f),
                             random_normal(static_cast<std::size_t>((s.conv_kernel - 1) * s.conv_channels()), 45)};
  const ref::GatedDeltaNetCarry d_carry_out{random_normal(in.state.size(), 46), random_normal(in.conv_history.size(), 47)};
  const auto g = ref::gated_deltanet_backward_from(s, x, w, d_out, in, d_carry_out);
  const auto loss = [&] {
    const auto c = ref::gated_deltanet_forward_from(s, x, w, in);
    return dot(c.out, d_out) + dot(c.carry.state, d_carry_out.state) + dot(c.carry.conv_history, d_carry_out.conv_history);
  };
  check_fd(in.state, g.d_carry_in.state, loss, "d_carry_in.state");
  check_fd(in.conv_history, g.d_carry_in.conv_history, loss, "d_carry_in.conv_history");
  check_fd(x, g.grads.dx, loss, "dx");

  // Wrongly sized carries are named by the block's function and the carry's part.
  ref::GatedDeltaNetCarry bad = in;
  bad.state.resize(5);
  CHECK_THROWS_WITH_AS(ref::gated_deltanet_forward_from(s, x, w, bad), doctest::Contains("gated_deltanet_forward_from: in.state"),
                       oom::Error);
  bad = in;
  bad.conv_history.resize(5);
  CHECK_THROWS_WITH_AS(ref::gated_deltanet_forward_from(s, x, w, bad),
                       doctest::Contains("gated_deltanet_forward_from: in.conv_history"), oom::Error);
  bad = d_carry_out;
  bad.state.resize(5);
  CHECK_THROWS_WITH_AS(ref::gated_deltanet_backward_from(s, x, w, d_out, in, bad),
                       doctest::Contains("gated_deltanet_backward_from: d_carry_out.state"), oom::Error);
  bad = d_carry_out;
  bad.conv_history.resize(5);
  CHECK_THROWS_WITH_AS(ref::gated_deltanet_backward_from(s, x, w, d_out, in, bad),
                       doctest::Contains("gated_deltanet_backward_from: d_carry_out.conv_history"), oom::Error);
}
