// The CPU attention reference: its forward matches the textbook dense formula (causal mask, GQA
// head mapping), its backward matches central finite differences of its forward in fp64, and the
// single-row helpers the 1M-token GPU test relies on agree with the full passes.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "oom/reference/attention.hpp"
#include "support/compare.hpp"

namespace {

using oom::reference::AttentionDims;

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::size_t q_size(const AttentionDims& d) {
  return static_cast<std::size_t>(d.batch) * d.seq * d.heads_q * d.head_dim;
}
std::size_t kv_size(const AttentionDims& d) {
  return static_cast<std::size_t>(d.batch) * d.seq * d.heads_kv * d.head_dim;
}

/// Dense textbook attention: full S x S score matrix, mask j > i to -inf, softmax, times V.
std::vector<double> dense_forward(const AttentionDims& d, double scale, const std::vector<double>& q,
                                  const std::vector<double>& k, const std::vector<double>& v) {
  std::vector<double> o(q_size(d), 0.0);
  const int n = d.head_dim;
  for (int b = 0; b < d.batch; ++b)
    for (int h = 0; h < d.heads_q; ++h) {
      const int hk = h * d.heads_kv / d.heads_q;
      std::vector<double> s(static_cast<std::size_t>(d.seq) * d.seq);
      for (int i = 0; i < d.seq; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < d.seq; ++j) {
          double x = 0;
          for (int c = 0; c < n; ++c)
            x += q[((b * d.seq + i) * d.heads_q + h) * n + c] * k[((b * d.seq + j) * d.heads_kv + hk) * n + c];
          s[i * d.seq + j] = j > i ? -std::numeric_limits<double>::infinity() : scale * x;
          m = std::max(m, s[i * d.seq + j]);
        }
        double l = 0;
        for (int j = 0; j < d.seq; ++j) l += std::exp(s[i * d.seq + j] - m);
        for (int j = 0; j < d.seq; ++j)
          for (int c = 0; c < n; ++c)
            o[((b * d.seq + i) * d.heads_q + h) * n + c] +=
                std::exp(s[i * d.seq + j] - m) / l * v[((b * d.seq + j) * d.heads_kv + hk) * n + c];
      }
    }
  return o;
}

double loss(const AttentionDims& d, double scale, const std::vector<double>& q, const std::vector<double>& k,
            const std::vector<double>& v, const std::vector<double>& w) {
  std::vector<double> o(q_size(d)), lse(static_cast<std::size_t>(d.batch) * d.heads_q * d.seq);
  oom::reference::attention_forward<double>(d, scale, q, k, v, o, lse);
  double l = 0;
  for (std::size_t x = 0; x < o.size(); ++x) l += w[x] * o[x];  // L = sum(dO o O): dL/dO = dO
  return l;
}

/// Central differences of L with respect to every element of `x` (one of q, k, v).
std::vector<double> finite_differences(const AttentionDims& d, double scale, std::vector<double>& q,
                                       std::vector<double>& k, std::vector<double>& v, const std::vector<double>& w,
                                       std::vector<double>& x) {
  const double eps = 1e-5;  // truncation ~eps^2, rounding ~1e-16/eps: both far below the 1e-7 tolerance
  std::vector<double> g(x.size());
  for (std::size_t e = 0; e < x.size(); ++e) {
    const double saved = x[e];
    x[e] = saved + eps;
    const double up = loss(d, scale, q, k, v, w);
    x[e] = saved - eps;
    const double down = loss(d, scale, q, k, v, w);
    x[e] = saved;
    g[e] = (up - down) / (2 * eps);
  }
  return g;
}

}  // namespace

TEST_CASE("attention reference forward equals the dense causal softmax formula (GQA and MHA)") {
  for (const AttentionDims d : {AttentionDims{2, 7, 4, 2, 5}, AttentionDims{1, 9, 3, 3, 4}, AttentionDims{1, 6, 4, 1, 3}}) {
    const double scale = 1.0 / std::sqrt(d.head_dim);
    const auto q = to_double(oom::test::random_normal(q_size(d), 1));
    const auto k = to_double(oom::test::random_normal(kv_size(d), 2));
    const auto v = to_double(oom::test::random_normal(kv_size(d), 3));
    std::vector<double> o(q_size(d)), lse(static_cast<std::size_t>(d.batch) * d.heads_q * d.seq);
    oom::reference::attention_forward<double>(d, scale, q, k, v, o, lse);
    const auto r = oom::test::compare(o, dense_forward(d, scale, q, k, v), 1e-12, 1e-12, "O");
    INFO(r.first);
    CHECK(r.ok());
    // Row 0 attends key 0 only: O_0 = V_0 of its KV head, LSE_0 = scale q_0.k_0.
    for (int c = 0; c < d.head_dim; ++c) CHECK(o[c] == doctest::Approx(v[c]).epsilon(1e-12));
  }
}

TEST_CASE("attention reference backward equals central finite differences of its forward (fp64)") {
  for (const AttentionDims d : {AttentionDims{2, 5, 4, 2, 4}, AttentionDims{1, 6, 2, 2, 3}, AttentionDims{1, 4, 3, 1, 2}}) {
    const double scale = 0.7;  // not 1/sqrt(D): the scale must enter dQ and dK exactly once
    auto q = to_double(oom::test::random_normal(q_size(d), 11));
    auto k = to_double(oom::test::random_normal(kv_size(d), 12));
    auto v = to_double(oom::test::random_normal(kv_size(d), 13));
    const auto w = to_double(oom::test::random_normal(q_size(d), 14));
    std::vector<double> o(q_size(d)), lse(static_cast<std::size_t>(d.batch) * d.heads_q * d.seq);
    oom::reference::attention_forward<double>(d, scale, q, k, v, o, lse);
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    oom::reference::attention_backward<double>(d, scale, q, k, v, o, lse, w, dq, dk, dv);
    // fp64 throughout: agreement to ~1e-9 is expected; 1e-7 leaves room for FD truncation.
    using Grad = std::tuple<const char*, std::vector<double>*, std::vector<double>*>;
    for (auto [name, analytic, x] : {Grad{"dQ", &dq, &q}, Grad{"dK", &dk, &k}, Grad{"dV", &dv, &v}}) {
      const auto numeric = finite_differences(d, scale, q, k, v, w, *x);
      const auto r = oom::test::compare(*analytic, numeric, 1e-7, 1e-7, name);
      INFO(r.first);
      CHECK(r.ok());
    }
  }
}

TEST_CASE("attention reference: fp32 storage agrees with fp64, and the row helpers with the full passes") {
  const AttentionDims d{2, 13, 4, 2, 8};
  const double scale = 1.0 / std::sqrt(d.head_dim);
  const auto qf = oom::test::random_normal(q_size(d), 21);
  const auto kf = oom::test::random_normal(kv_size(d), 22);
  const auto vf = oom::test::random_normal(kv_size(d), 23);
  const auto wf = oom::test::random_normal(q_size(d), 24);
  const std::size_t n_lse = static_cast<std::size_t>(d.batch) * d.heads_q * d.seq;

  std::vector<float> o(q_size(d)), lse(n_lse), dq(q_size(d)), dk(kv_size(d)), dv(kv_size(d));
  oom::reference::attention_forward<float>(d, scale, qf, kf, vf, o, lse);
  oom::reference::attention_backward<float>(d, scale, qf, kf, vf, o, lse, wf, dq, dk, dv);

  const auto q = to_double(qf), k = to_double(kf), v = to_double(vf), w = to_double(wf);
  std::vector<double> o64(q_size(d)), lse64(n_lse), dq64(q_size(d)), dk64(kv_size(d)), dv64(kv_size(d));
  oom::reference::attention_forward<double>(d, scale, q, k, v, o64, lse64);
  oom::reference::attention_backward<double>(d, scale, q, k, v, o64, lse64, w, dq64, dk64, dv64);
  // fp64 accumulation, fp32 storage of results (and of O/LSE fed to backward): ~1e-7 relative.
  using Pair = std::tuple<const char*, std::vector<float>*, std::vector<double>*>;
  for (auto [name, a, b] : {Pair{"O", &o, &o64}, Pair{"LSE", &lse, &lse64}, Pair{"dQ", &dq, &dq64},
                            Pair{"dK", &dk, &dk64}, Pair{"dV", &dv, &dv64}}) {
    const auto r = oom::test::compare(*a, *b, 1e-5, 1e-6, name);
    INFO(r.first);
    CHECK(r.ok());
  }

  // Row helpers, as the 1M-token GPU test calls them.
  const int n = d.head_dim;
  std::vector<float> row(n), row2(n);
  for (int b = 0; b < d.batch; ++b)
    for (int h = 0; h < d.heads_q; ++h)
      for (int i : {0, 5, d.seq - 1}) {
        const std::size_t at = ((static_cast<std::size_t>(b) * d.seq + i) * d.heads_q + h) * n;
        const float l = oom::reference::attention_forward_row<float>(d, scale, qf, kf, vf, b, h, i, row);
        CHECK(l == doctest::Approx(lse[(static_cast<std::size_t>(b) * d.heads_q + h) * d.seq + i]).epsilon(1e-6));
        for (int c = 0; c < n; ++c) CHECK(row[c] == doctest::Approx(o[at + c]).epsilon(1e-5));
        oom::reference::attention_backward_dq_row<float>(d, scale, qf, kf, vf, wf, b, h, i, row);
        for (int c = 0; c < n; ++c) CHECK(row[c] == doctest::Approx(dq[at + c]).epsilon(1e-5));
      }
  for (int b = 0; b < d.batch; ++b)
    for (int hk = 0; hk < d.heads_kv; ++hk)
      for (int j : {0, 7, d.seq - 1}) {
        const std::size_t at = ((static_cast<std::size_t>(b) * d.seq + j) * d.heads_kv + hk) * n;
        oom::reference::attention_backward_dkv_row<float>(d, scale, qf, kf, vf, wf, b, hk, j, row, row2);
        for (int c = 0; c < n; ++c) {
          CHECK(row[c] == doctest::Approx(dk[at + c]).epsilon(1e-5));
          CHECK(row2[c] == doctest::Approx(dv[at + c]).epsilon(1e-5));
        }
      }
}

TEST_CASE("attention error scales bound the magnitudes they stand for, and the row helper agrees") {
  const AttentionDims d{1, 17, 4, 2, 8};
  const double scale = 1.0 / std::sqrt(d.head_dim);
  const auto q = oom::test::random_normal(q_size(d), 31), k = oom::test::random_normal(kv_size(d), 32);
  const auto v = oom::test::random_normal(kv_size(d), 33), w = oom::test::random_normal(q_size(d), 34);
  std::vector<float> o(q_size(d)), lse(static_cast<std::size_t>(d.heads_q) * d.seq), dq(q_size(d)), dk(kv_size(d)),
      dv(kv_size(d));
  oom::reference::attention_forward<float>(d, scale, q, k, v, o, lse);
  oom::reference::attention_backward<float>(d, scale, q, k, v, o, lse, w, dq, dk, dv);
  std::vector<double> om(q_size(d)), qm(q_size(d)), km(kv_size(d)), vm(kv_size(d));
  oom::reference::attention_error_scales<float>(d, scale, q, k, v, o, w, om, qm, km, vm);
  // Each scale is a sum of the magnitudes of the terms summing to its value: never below |value|.
  for (std::size_t x = 0; x < o.size(); ++x) {
    CHECK(om[x] >= std::abs(o[x]) * (1 - 1e-6));
    CHECK(qm[x] >= std::abs(dq[x]) * (1 - 1e-6));
  }
  for (std::size_t x = 0; x < dk.size(); ++x) {
    CHECK(km[x] >= std::abs(dk[x]) * (1 - 1e-6));
    CHECK(vm[x] >= std::abs(dv[x]) * (1 - 1e-6));
  }
  // Query 0 has one key: its O is that key's V row exactly, so o_mag = |O|.
  for (int c = 0; c < d.head_dim; ++c) CHECK(om[static_cast<std::size_t>(c)] == doctest::Approx(std::abs(o[static_cast<std::size_t>(c)])));
  std::vector<double> orow(static_cast<std::size_t>(d.head_dim)), qrow(orow.size());
  for (int h = 0; h < d.heads_q; ++h)
    for (int i : {0, 9, d.seq - 1}) {
      oom::reference::attention_error_scales_row<float>(d, scale, q, k, v, w, 0, h, i, orow, qrow);
      const std::size_t at = (static_cast<std::size_t>(i) * d.heads_q + h) * d.head_dim;
      for (int c = 0; c < d.head_dim; ++c) {
        CHECK(orow[static_cast<std::size_t>(c)] == doctest::Approx(om[at + c]).epsilon(1e-6));
        CHECK(qrow[static_cast<std::size_t>(c)] == doctest::Approx(qm[at + c]).epsilon(1e-4));
      }
    }
}
