// CPU reference of the MoE expert MLPs and the shared expert gate; see oom/reference/moe.hpp.
#include "oom/reference/moe.hpp"

#include <cmath>
#include <numeric>
#include <string>

#include "oom/core/error.hpp"

namespace oom::reference {
namespace {

std::int64_t total_rows(const ExpertShape& s, std::span<const std::int32_t> counts) {
  if (static_cast<std::int64_t>(counts.size()) != s.experts || s.hidden < 1 || s.intermediate < 1)
    OOM_THROW(Errc::invalid_argument, "expert reference: counts must hold E entries, H and I >= 1");
  std::int64_t n = 0;
  for (const auto c : counts) {
    if (c < 0) OOM_THROW(Errc::invalid_argument, "expert reference: negative count");
    n += c;
  }
  return n;
}

void check_size(std::size_t got, std::int64_t want, const char* what) {
  if (got != static_cast<std::size_t>(want))
    OOM_THROW(Errc::invalid_argument, std::string("expert reference: ") + what + " has " + std::to_string(got) +
                                          " elements, expected " + std::to_string(want));
}

/// Row-major C (M, N) = A (M, K) . B^T with B stored (N, K), for rows [r0, r0+M) of A and C.
void gemm_abt(const float* a, const float* b, float* c, std::int64_t m, std::int64_t n, std::int64_t k) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t l = 0; l < k; ++l) acc += static_cast<double>(a[i * k + l]) * b[j * k + l];
      c[i * n + j] = static_cast<float>(acc);
    }
}
/// C (M, N) = A (M, K) . B (K, N).
void gemm_ab(const float* a, const float* b, float* c, std::int64_t m, std::int64_t n, std::int64_t k) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t l = 0; l < k; ++l) acc += static_cast<double>(a[i * k + l]) * b[l * n + j];
      c[i * n + j] = static_cast<float>(acc);
    }
}
/// C (M, N) = A^T . B with A stored (K, M), B (K, N).
void gemm_atb(const float* a, const float* b, float* c, std::int64_t m, std::int64_t n, std::int64_t k) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t l = 0; l < k; ++l) acc += static_cast<double>(a[l * m + i]) * b[l * n + j];
      c[i * n + j] = static_cast<float>(acc);
    }
}

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

}  // namespace

std::vector<float> expert_gate_up(const ExpertShape& s, std::span<const std::int32_t> counts,
                                  std::span<const float> x_perm, std::span<const float> w_gate_up) {
  const auto n = total_rows(s, counts), H = s.hidden, I2 = 2 * s.intermediate;
  check_size(x_perm.size(), n * H, "x_perm");
  check_size(w_gate_up.size(), s.experts * I2 * H, "w_gate_up");
  std::vector<float> out(static_cast<std::size_t>(n * I2));
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    gemm_abt(&x_perm[r * H], &w_gate_up[e * I2 * H], &out[r * I2], counts[e], I2, H);
    r += counts[e];
  }
  return out;
}

std::vector<float> expert_down(const ExpertShape& s, std::span<const std::int32_t> counts, std::span<const float> h,
                               std::span<const float> w_down) {
  const auto n = total_rows(s, counts), H = s.hidden, I = s.intermediate;
  check_size(h.size(), n * I, "h");
  check_size(w_down.size(), s.experts * H * I, "w_down");
  std::vector<float> out(static_cast<std::size_t>(n * H));
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    gemm_abt(&h[r * I], &w_down[e * H * I], &out[r * H], counts[e], H, I);
    r += counts[e];
  }
  return out;
}

DownGrads expert_down_backward(const ExpertShape& s, std::span<const std::int32_t> counts, std::span<const float> dy,
                               std::span<const float> h, std::span<const float> w_down) {
  const auto n = total_rows(s, counts), H = s.hidden, I = s.intermediate;
  check_size(dy.size(), n * H, "dy");
  check_size(h.size(), n * I, "h");
  check_size(w_down.size(), s.experts * H * I, "w_down");
  DownGrads g;
  g.dh.resize(static_cast<std::size_t>(n * I));
  g.dw_down.resize(static_cast<std::size_t>(s.experts * H * I));
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    gemm_ab(&dy[r * H], &w_down[e * H * I], &g.dh[r * I], counts[e], I, H);
    gemm_atb(&dy[r * H], &h[r * I], &g.dw_down[e * H * I], H, I, counts[e]);
    r += counts[e];
  }
  return g;
}

GateUpGrads expert_gate_up_backward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                    std::span<const float> d_gate_up, std::span<const float> x_perm,
                                    std::span<const float> w_gate_up) {
  const auto n = total_rows(s, counts), H = s.hidden, I2 = 2 * s.intermediate;
  check_size(d_gate_up.size(), n * I2, "d_gate_up");
  check_size(x_perm.size(), n * H, "x_perm");
  check_size(w_gate_up.size(), s.experts * I2 * H, "w_gate_up");
  GateUpGrads g;
  g.dx.resize(static_cast<std::size_t>(n * H));
  g.dw_gate_up.resize(static_cast<std::size_t>(s.experts * I2 * H));
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    gemm_ab(&d_gate_up[r * I2], &w_gate_up[e * I2 * H], &g.dx[r * H], counts[e], H, I2);
    gemm_atb(&d_gate_up[r * I2], &x_perm[r * H], &g.dw_gate_up[e * I2 * H], I2, H, counts[e]);
    r += counts[e];
  }
  return g;
}

std::vector<float> swiglu(std::span<const float> gate_up, std::int64_t intermediate) {
  const auto I = intermediate, n = static_cast<std::int64_t>(gate_up.size()) / (2 * I);
  std::vector<float> h(static_cast<std::size_t>(n * I));
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < I; ++i) {
      const double g = gate_up[r * 2 * I + i], u = gate_up[r * 2 * I + I + i];
      h[r * I + i] = static_cast<float>(g * sigmoid(g) * u);
    }
  return h;
}

std::vector<float> swiglu_backward(std::span<const float> gate_up, std::span<const float> dh, std::int64_t intermediate) {
  const auto I = intermediate, n = static_cast<std::int64_t>(gate_up.size()) / (2 * I);
  std::vector<float> d(gate_up.size());
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < I; ++i) {
      const double g = gate_up[r * 2 * I + i], u = gate_up[r * 2 * I + I + i], sg = sigmoid(g);
      const double silu = g * sg, dsilu = sg * (1.0 + g * (1.0 - sg));
      d[r * 2 * I + i] = static_cast<float>(dh[r * I + i] * u * dsilu);
      d[r * 2 * I + I + i] = static_cast<float>(dh[r * I + i] * silu);
    }
  return d;
}

ExpertMlpForward expert_mlp_forward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                    std::span<const float> x_perm, std::span<const float> w_gate_up,
                                    std::span<const float> w_down) {
  ExpertMlpForward f;
  f.gate_up = expert_gate_up(s, counts, x_perm, w_gate_up);
  f.h = swiglu(f.gate_up, s.intermediate);
  f.y = expert_down(s, counts, f.h, w_down);
  return f;
}

ExpertMlpGrads expert_mlp_backward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                   std::span<const float> x_perm, std::span<const float> w_gate_up,
                                   std::span<const float> w_down, const ExpertMlpForward& fwd,
                                   std::span<const float> dy) {
  auto down = expert_down_backward(s, counts, dy, fwd.h, w_down);
  const auto d_gate_up = swiglu_backward(fwd.gate_up, down.dh, s.intermediate);
  auto gu = expert_gate_up_backward(s, counts, d_gate_up, x_perm, w_gate_up);
  return {std::move(gu.dx), std::move(gu.dw_gate_up), std::move(down.dw_down)};
}

SharedGateForward shared_expert_gate_forward(std::int64_t tokens, std::int64_t hidden, std::span<const float> x,
                                             std::span<const float> w_gate, std::span<const float> y,
                                             std::span<const float> routed) {
  check_size(x.size(), tokens * hidden, "x");
  check_size(w_gate.size(), hidden, "w_gate");
  check_size(y.size(), tokens * hidden, "y");
  if (!routed.empty()) check_size(routed.size(), tokens * hidden, "routed");
  SharedGateForward f;
  f.gate_logit.resize(static_cast<std::size_t>(tokens));
  f.out.resize(static_cast<std::size_t>(tokens * hidden));
  for (std::int64_t t = 0; t < tokens; ++t) {
    double z = 0;
    for (std::int64_t h = 0; h < hidden; ++h) z += static_cast<double>(x[t * hidden + h]) * w_gate[h];
    f.gate_logit[t] = static_cast<float>(z);
    const double g = sigmoid(f.gate_logit[t]);
    for (std::int64_t h = 0; h < hidden; ++h)
      f.out[t * hidden + h] = static_cast<float>((routed.empty() ? 0.0 : routed[t * hidden + h]) + g * y[t * hidden + h]);
  }
  return f;
}

SharedGateGrads shared_expert_gate_backward(std::int64_t tokens, std::int64_t hidden, std::span<const float> x,
                                            std::span<const float> w_gate, std::span<const float> y,
                                            std::span<const float> gate_logit, std::span<const float> d_out) {
  check_size(gate_logit.size(), tokens, "gate_logit");
  check_size(d_out.size(), tokens * hidden, "d_out");
  SharedGateGrads g;
  g.dy.resize(static_cast<std::size_t>(tokens * hidden));
  g.dx.resize(static_cast<std::size_t>(tokens * hidden));
  std::vector<double> dw(static_cast<std::size_t>(hidden), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double sg = sigmoid(gate_logit[t]);
    double dot = 0;
    for (std::int64_t h = 0; h < hidden; ++h) {
      g.dy[t * hidden + h] = static_cast<float>(sg * d_out[t * hidden + h]);
      dot += static_cast<double>(d_out[t * hidden + h]) * y[t * hidden + h];
    }
    const double ds = dot * sg * (1.0 - sg);
    for (std::int64_t h = 0; h < hidden; ++h) {
      g.dx[t * hidden + h] = static_cast<float>(ds * w_gate[h]);
      dw[h] += ds * x[t * hidden + h];
    }
  }
  g.dw_gate.assign(dw.begin(), dw.end());
  return g;
}

}  // namespace oom::reference
