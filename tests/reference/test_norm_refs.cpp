// The CPU references of the embedding, RMSNorm, RoPE and SwiGLU kernels: each backward equals
// central finite differences of its forward (in fp64), plus the properties the kernels' contracts
// promise (invalid ids counted and zeroed, rope orthogonal and identity at position 0, partial
// rotary passes dimensions through, rmsnorm rows of unit RMS).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "oom/reference/embedding.hpp"
#include "oom/reference/rmsnorm.hpp"
#include "oom/reference/rope.hpp"
#include "oom/reference/swiglu.hpp"

namespace ref = oom::reference;

namespace {

using Vec = std::vector<double>;

Vec random_vec(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

/// Checks grad[i] == d loss / d input[i] by central differences at (up to) `samples` indices
/// spread over the input. The loss is smooth and O(1)-scaled, so with h = 1e-5 the truncation
/// error is ~h^2 = 1e-10 and the rounding error ~1e-16 / h = 1e-11; 1e-6 relative (plus 1e-8
/// absolute for near-zero derivatives) leaves margin while any formula error (O(1)) fails.
void check_gradient(Vec& input, const Vec& grad, const std::function<double()>& loss, const char* what,
                    std::size_t samples = 64) {
  REQUIRE(grad.size() == input.size());
  const double h = 1e-5;
  const std::size_t step = std::max<std::size_t>(1, input.size() / samples);
  int failures = 0;
  for (std::size_t i = 0; i < input.size(); i += step) {
    const double saved = input[i];
    input[i] = saved + h;
    const double up = loss();
    input[i] = saved - h;
    const double down = loss();
    input[i] = saved;
    const double fd = (up - down) / (2 * h);
    const bool ok = std::abs(fd - grad[i]) <= 1e-8 + 1e-6 * std::abs(fd);
    if (!ok && ++failures <= 5) {
      MESSAGE(std::string(what) << "[" << i << "]: backward " << grad[i] << " vs finite difference " << fd);
    }
  }
  loss();  // leave the forward's outputs as they are at the unperturbed input
  CHECK_MESSAGE(failures == 0, std::string(what) << ": " << failures << " gradient entries disagree with finite differences");
}

}  // namespace

TEST_CASE("embedding backward is the adjoint of the gather; invalid ids are zero rows, counted") {
  const std::int64_t V = 11, H = 5;
  const std::vector<std::int32_t> ids = {3, 0, 3, 10, 7, 3, 0};
  Vec table = random_vec(V * H, 1);
  const Vec r = random_vec(ids.size() * H, 2);
  Vec out(ids.size() * H);
  auto loss = [&] {
    ref::embedding_forward<double>(ids, table, out, V, H);
    return dot(out, r);
  };
  Vec grad(V * H, 0.0);
  CHECK(ref::embedding_backward<double>(ids, r, grad, V, H) == 0);
  check_gradient(table, grad, loss, "d table");
  // Rows of ids that never occur stay untouched (exactly zero here).
  for (std::int64_t c = 0; c < H; ++c) CHECK(grad[1 * H + c] == 0.0);

  const std::vector<std::int32_t> bad = {2, -1, 11, 4};
  Vec out_bad(bad.size() * H, 7.0);
  CHECK(ref::embedding_forward<double>(bad, table, out_bad, V, H) == 2);
  for (std::int64_t c = 0; c < H; ++c) {
    CHECK(out_bad[1 * H + c] == 0.0);
    CHECK(out_bad[2 * H + c] == 0.0);
    CHECK(out_bad[0 * H + c] == table[2 * H + c]);
  }
  Vec grad_bad(V * H, 0.0);
  CHECK(ref::embedding_backward<double>(bad, random_vec(bad.size() * H, 3), grad_bad, V, H) == 2);
}

TEST_CASE("rmsnorm backward matches finite differences for hidden rows and per-head q/k rows") {
  struct Shape {
    std::int64_t rows, dim;
  };
  for (const Shape s : {Shape{3, 16}, Shape{1, 7}, Shape{6 * 4, 8} /* T=6 tokens x 4 heads, head_dim 8 */}) {
    CAPTURE(s.rows);
    CAPTURE(s.dim);
    Vec x = random_vec(s.rows * s.dim, 10 + s.dim, -2, 2);
    Vec w = random_vec(s.dim, 20 + s.dim, 0.5, 1.5);
    const Vec r = random_vec(s.rows * s.dim, 30 + s.dim);
    const double eps = 1e-6;
    Vec y(x.size()), rstd(s.rows);
    auto loss = [&] {
      ref::rmsnorm_forward<double>(x, w, y, rstd, s.rows, s.dim, eps);
      return dot(y, r);
    };
    loss();
    Vec dx(x.size()), dw(s.dim, 0.0);
    ref::rmsnorm_backward<double>(r, x, w, rstd, dx, dw, s.rows, s.dim);
    check_gradient(x, dx, loss, "rmsnorm dx");
    check_gradient(w, dw, loss, "rmsnorm dw");

    // The weight gradient accumulates: a second backward doubles it.
    Vec dx2(x.size());
    Vec dw2 = dw;
    ref::rmsnorm_backward<double>(r, x, w, rstd, dx2, dw2, s.rows, s.dim);
    for (std::int64_t c = 0; c < s.dim; ++c) CHECK(dw2[c] == doctest::Approx(2 * dw[c]).epsilon(1e-12));
  }
}

TEST_CASE("rmsnorm forward gives rows of unit RMS with a unit weight, in float as in double") {
  const std::int64_t rows = 4, dim = 64;
  const Vec xd = random_vec(rows * dim, 5, -3, 3);
  std::vector<float> x(xd.begin(), xd.end()), w(dim, 1.0f), y(rows * dim), rstd(rows);
  ref::rmsnorm_forward<float>(x, w, y, rstd, rows, dim, 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t c = 0; c < dim; ++c) ss += double(y[r * dim + c]) * y[r * dim + c];
    CHECK(std::sqrt(ss / dim) == doctest::Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("rope backward matches finite differences; full and partial rotary; packed positions") {
  struct Shape {
    std::int64_t heads, head_dim, rotary_dim;
  };
  // Packed sequences: positions restart at 0 mid-batch; one large position exercises big angles.
  const std::vector<std::int32_t> positions = {0, 1, 2, 0, 1, 40000};
  const float theta = 1e6f;
  for (const Shape s : {Shape{2, 8, 8}, Shape{3, 12, 8}, Shape{1, 10, 6}}) {
    CAPTURE(s.head_dim);
    CAPTURE(s.rotary_dim);
    const std::size_t n = positions.size() * s.heads * s.head_dim;
    Vec x = random_vec(n, 40 + s.head_dim);
    const Vec r = random_vec(n, 50 + s.head_dim);
    Vec y(n);
    auto loss = [&] {
      ref::rope_forward<double>(x, positions, y, s.heads, s.head_dim, s.rotary_dim, theta);
      return dot(y, r);
    };
    loss();
    Vec dx(n);
    ref::rope_backward<double>(r, positions, dx, s.heads, s.head_dim, s.rotary_dim, theta);
    check_gradient(x, dx, loss, "rope dx");

    // Orthogonal: norms kept, backward(forward(x)) == x; position 0 is the identity; dimensions
    // past rotary_dim pass through.
    Vec back(n);
    ref::rope_backward<double>(y, positions, back, s.heads, s.head_dim, s.rotary_dim, theta);
    for (std::size_t i = 0; i < n; ++i) CHECK(back[i] == doctest::Approx(x[i]).epsilon(1e-12));
    CHECK(dot(y, y) == doctest::Approx(dot(x, x)).epsilon(1e-12));
    for (std::int64_t i = 0; i < s.heads * s.head_dim; ++i) CHECK(y[i] == x[i]);
    for (std::size_t t = 0; t < positions.size(); ++t) {
      for (std::int64_t h = 0; h < s.heads; ++h) {
        for (std::int64_t d = s.rotary_dim; d < s.head_dim; ++d) {
          const std::size_t i = (t * s.heads + h) * s.head_dim + d;
          CHECK(y[i] == x[i]);
        }
      }
    }
  }
}

TEST_CASE("rope frequencies follow HF: inv_freq[j] = theta^(-2j/rotary_dim), angle in fp32") {
  CHECK(ref::rope_inv_freq(1e6f, 128, 0) == 1.0f);
  CHECK(ref::rope_inv_freq(1e6f, 128, 32) == static_cast<float>(1.0 / std::pow(1e6, 0.5)));
  CHECK(ref::rope_angle(40000, 1e6f, 128, 1) == 40000.0f * ref::rope_inv_freq(1e6f, 128, 1));
  // Rotating pair 0 at position p by angle p: (1, 0) -> (cos p, sin p) as rotate_half implies.
  const std::vector<std::int32_t> pos = {3};
  const std::vector<float> x = {1.0f, 0.0f};
  std::vector<float> y(2);
  ref::rope_forward<float>(x, pos, y, 1, 2, 2, 1e6f);
  CHECK(y[0] == doctest::Approx(std::cos(3.0)).epsilon(1e-6));
  CHECK(y[1] == doctest::Approx(std::sin(3.0)).epsilon(1e-6));
}

TEST_CASE("swiglu backward matches finite differences over [gate | up] rows") {
  const std::int64_t T = 3, I = 5;
  Vec gu = random_vec(T * 2 * I, 60, -4, 4);
  const Vec r = random_vec(T * I, 61);
  Vec out(T * I);
  auto loss = [&] {
    ref::swiglu_forward<double>(gu, out, T, I);
    return dot(out, r);
  };
  loss();
  Vec grad(gu.size());
  ref::swiglu_backward<double>(r, gu, grad, T, I);
  check_gradient(gu, grad, loss, "swiglu d[gate|up]", 1000);
  // silu(0) = 0, silu(g) -> g for large g, -> 0 for very negative g.
  CHECK(ref::sigmoid(0.0) == 0.5);
  const std::vector<float> in = {0.0f, 30.0f, -100.0f, 2.0f, 2.0f, 2.0f};  // T=1, I=3
  std::vector<float> o(3);
  ref::swiglu_forward<float>(in, o, 1, 3);
  CHECK(o[0] == 0.0f);
  CHECK(o[1] == doctest::Approx(60.0f));
  CHECK(std::abs(o[2]) < 1e-30f);
}
