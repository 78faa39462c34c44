// CPU reference of the Gated DeltaNet pieces; see oom/reference/gated_delta.hpp.
#include "oom/reference/gated_delta.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include "oom/core/error.hpp"

namespace oom::reference {
namespace {

using Vec = std::vector<double>;

void check_size(const char* fn, std::size_t got, std::int64_t want, const char* what) {
  if (got != static_cast<std::size_t>(want))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: {} has {} elements, expected {}", fn, what, got, want));
}

void check_shape(const GatedDeltaShape& s) {
  if (s.tokens < 0 || s.k_heads < 1 || s.v_heads < 1 || s.k_dim < 1 || s.v_dim < 1 || s.v_heads % s.k_heads != 0)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("gated delta rule: need T >= 0, dims >= 1 and value heads a multiple of key heads (T {}, "
                          "heads {}/{}, dims {}/{})", s.tokens, s.k_heads, s.v_heads, s.k_dim, s.v_dim));
}

void check_inputs(const char* fn, const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                  std::span<const float> v, std::span<const float> g, std::span<const float> beta) {
  check_shape(s);
  check_size(fn, q.size(), s.tokens * s.k_heads * s.k_dim, "q");
  check_size(fn, k.size(), s.tokens * s.k_heads * s.k_dim, "k");
  check_size(fn, v.size(), s.tokens * s.v_heads * s.v_dim, "v");
  check_size(fn, g.size(), s.tokens * s.v_heads, "g");
  check_size(fn, beta.size(), s.tokens * s.v_heads, "beta");
}

constexpr double l2_eps = 1e-6;  // transformers' l2norm (FLA's)

/// x / sqrt(sum x^2 + eps) of `n` values, and 1 / sqrt(...) for the backward.
double l2_normalise(const float* x, std::int64_t n, double* out) {
  double ss = 0;
  for (std::int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double r = 1.0 / std::sqrt(ss + l2_eps);
  for (std::int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  return r;
}

/// d x from d y of y = x r, r = (sum x^2 + eps)^(-1/2): r dy - x r^3 (x . dy); added to dx.
void l2_normalise_backward(const float* x, std::int64_t n, double r, const double* dy, double* dx) {
  double xdy = 0;
  for (std::int64_t i = 0; i < n; ++i) xdy += static_cast<double>(x[i]) * dy[i];
  for (std::int64_t i = 0; i < n; ++i) dx[i] += r * dy[i] - static_cast<double>(x[i]) * r * r * r * xdy;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {
  const double sg = sigmoid(x);
  return sg * (1.0 + x * (1.0 - sg));
}
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double softplus_grad(double x) { return x > 20.0 ? 1.0 : sigmoid(x); }

void check_conv(const char* fn, std::int64_t tokens, std::int64_t channels, std::int64_t kernel, std::span<const float> w) {
  if (tokens < 0 || channels < 1 || kernel < 1)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: need T >= 0, C >= 1, K >= 1 (T {}, C {}, K {})", fn, tokens, channels, kernel));
  check_size(fn, w.size(), channels * kernel, "w");
}

/// The conv's output at (t, c) before the SiLU: the taps over tokens t - K + 1 .. t (none before 0).
double conv_pre(std::int64_t t, std::int64_t c, std::int64_t channels, std::int64_t kernel, std::span<const float> x,
                std::span<const float> w) {
  double acc = 0;
  for (std::int64_t j = 0; j < kernel; ++j) {
    const std::int64_t src = t - kernel + 1 + j;
    if (src >= 0) acc += static_cast<double>(w[c * kernel + j]) * x[src * channels + c];
  }
  return acc;
}

void check_gates(const char* fn, std::int64_t tokens, std::int64_t heads, std::span<const float> a_log, std::span<const float> dt_bias) {
  if (tokens < 0 || heads < 1) OOM_THROW(Errc::invalid_argument, fmt::format("{}: need T >= 0, H >= 1 (T {}, H {})", fn, tokens, heads));
  check_size(fn, a_log.size(), heads, "A_log");
  check_size(fn, dt_bias.size(), heads, "dt_bias");
}

void check_norm(const char* fn, std::int64_t rows, std::int64_t dim, std::span<const float> w, double eps) {
  if (rows < 0 || dim < 1 || !(eps > 0))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: need rows >= 0, dim >= 1, eps > 0 (rows {}, dim {}, eps {})", fn, rows, dim, eps));
  check_size(fn, w.size(), dim, "w");
}

/// One value head's normalised q and k (q also scaled by 1 / sqrt(dk)) and their l2 factors, and,
/// where the recurrence is run (run_head), every state S_0 .. S_T (S_0 = 0; S_t after token t - 1),
/// dk x dv each, row-major by key dimension.
struct HeadRun {
  Vec qn, kn;   // (T, dk)
  Vec rq, rk;   // (T): l2 factors
  Vec states;   // (T + 1, dk, dv); empty from normalise_head
};

HeadRun normalise_head(const GatedDeltaShape& s, std::int64_t h, std::span<const float> q, std::span<const float> k) {
  const std::int64_t T = s.tokens, dk = s.k_dim, kh = h / (s.v_heads / s.k_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  HeadRun r;
  r.qn.resize(static_cast<std::size_t>(T * dk));
  r.kn.resize(r.qn.size());
  r.rq.resize(static_cast<std::size_t>(T));
  r.rk.resize(r.rq.size());
  for (std::int64_t t = 0; t < T; ++t) {
    r.rq[t] = l2_normalise(&q[(t * s.k_heads + kh) * dk], dk, &r.qn[t * dk]);
    r.rk[t] = l2_normalise(&k[(t * s.k_heads + kh) * dk], dk, &r.kn[t * dk]);
    for (std::int64_t i = 0; i < dk; ++i) r.qn[t * dk + i] *= scale;
  }
  return r;
}

/// `initial`: the states entering token 0, (v_heads, dk, dv), or empty for zeros.
HeadRun run_head(const GatedDeltaShape& s, std::int64_t h, std::span<const float> q, std::span<const float> k,
                 std::span<const float> v, std::span<const float> g, std::span<const float> beta, float* out,
                 std::span<const float> initial = {}) {
  const std::int64_t T = s.tokens, dk = s.k_dim, dv = s.v_dim;
  HeadRun r = normalise_head(s, h, q, k);
  r.states.assign(static_cast<std::size_t>((T + 1) * dk * dv), 0.0);
  if (!initial.empty())
    for (std::int64_t i = 0; i < dk * dv; ++i) r.states[i] = initial[h * dk * dv + i];
  Vec d(static_cast<std::size_t>(dv));
  for (std::int64_t t = 0; t < T; ++t) {
    const double* qn = &r.qn[t * dk];
    const double* kn = &r.kn[t * dk];
    const double* prev = &r.states[t * dk * dv];
    double* S = &r.states[(t + 1) * dk * dv];
    const double alpha = std::exp(static_cast<double>(g[t * s.v_heads + h]));
    const double b = beta[t * s.v_heads + h];
    const float* vt = &v[(t * s.v_heads + h) * dv];
    for (std::int64_t i = 0; i < dk * dv; ++i) S[i] = alpha * prev[i];
    for (std::int64_t j = 0; j < dv; ++j) {
      double acc = 0;
      for (std::int64_t i = 0; i < dk; ++i) acc += S[i * dv + j] * kn[i];
      d[j] = b * (vt[j] - acc);
    }
    for (std::int64_t i = 0; i < dk; ++i)
      for (std::int64_t j = 0; j < dv; ++j) S[i * dv + j] += kn[i] * d[j];
    if (out != nullptr)
      for (std::int64_t j = 0; j < dv; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += S[i * dv + j] * qn[i];
        out[(t * s.v_heads + h) * dv + j] = static_cast<float>(acc);
      }
  }
  return r;
}

}  // namespace

namespace {
/// A carried state's size: empty, or one dk x dv state per value head.
void check_state(const char* fn, const GatedDeltaShape& s, std::span<const float> state, const char* what) {
  if (!state.empty()) check_size(fn, state.size(), s.v_heads * s.k_dim * s.v_dim, what);
}

/// The recurrence from `initial` (empty: zeros); `fn` names the caller in errors.
GatedDeltaCarried rule_forward(const char* fn, const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                               std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                               std::span<const float> initial) {
  check_inputs(fn, s, q, k, v, g, beta);
  check_state(fn, s, initial, "initial");
  const std::int64_t T = s.tokens, n = s.k_dim * s.v_dim;
  GatedDeltaCarried c;
  c.out.resize(static_cast<std::size_t>(T * s.v_heads * s.v_dim));
  c.final_state.resize(static_cast<std::size_t>(s.v_heads * n));
  for (std::int64_t h = 0; h < s.v_heads; ++h) {
    const HeadRun r = run_head(s, h, q, k, v, g, beta, c.out.data(), initial);
    for (std::int64_t i = 0; i < n; ++i) c.final_state[h * n + i] = static_cast<float>(r.states[T * n + i]);
  }
  return c;
}
}  // namespace

std::vector<float> gated_delta_rule_forward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                            std::span<const float> v, std::span<const float> g,
                                            std::span<const float> beta) {
  return rule_forward("gated_delta_rule_forward", s, q, k, v, g, beta, {}).out;
}

GatedDeltaCarried gated_delta_rule_forward_from(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                std::span<const float> v, std::span<const float> g,
                                                std::span<const float> beta, std::span<const float> initial) {
  return rule_forward("gated_delta_rule_forward_from", s, q, k, v, g, beta, initial);
}

namespace {

/// One chunk of the chunked rule for value head h: tokens [t0, t0 + n) and the state S entering it
/// (dk x dv), as gated_delta_rule_chunked_forward's contract writes it out.
struct ChunkRun {
  std::int64_t t0 = 0, n = 0;
  Vec G;   // (n): the decay summed from the chunk's start, token i's included
  Vec kk;  // (n, n): exp(G_i - G_j) (k_i . k_j) for j < i
  Vec qk;  // (n, n): exp(G_i - G_j) (q_i . k_j) for j <= i
  Vec u;   // (n, dv): S^T k_i, before the decay
  Vec d;   // (n, dv): the deltas
};

ChunkRun run_chunk(const GatedDeltaShape& s, const HeadRun& r, std::int64_t h, std::span<const float> v, std::span<const float> g,
                   std::span<const float> beta, std::int64_t t0, std::int64_t n, const Vec& S) {
  const std::int64_t dk = s.k_dim, dv = s.v_dim;
  ChunkRun c;
  c.t0 = t0;
  c.n = n;
  c.G.resize(static_cast<std::size_t>(n));
  c.kk.assign(static_cast<std::size_t>(n * n), 0.0);
  c.qk.assign(c.kk.size(), 0.0);
  c.u.resize(static_cast<std::size_t>(n * dv));
  c.d.resize(c.u.size());
  double acc_g = 0;
  for (std::int64_t i = 0; i < n; ++i) c.G[i] = acc_g += g[(t0 + i) * s.v_heads + h];
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j <= i; ++j) {
      double dot_k = 0, dot_q = 0;
      for (std::int64_t a = 0; a < dk; ++a) {
        dot_k += r.kn[(t0 + i) * dk + a] * r.kn[(t0 + j) * dk + a];
        dot_q += r.qn[(t0 + i) * dk + a] * r.kn[(t0 + j) * dk + a];
      }
      c.kk[i * n + j] = std::exp(c.G[i] - c.G[j]) * dot_k;
      c.qk[i * n + j] = std::exp(c.G[i] - c.G[j]) * dot_q;
    }
  // The deltas by forward substitution.
  for (std::int64_t i = 0; i < n; ++i) {
    const double* ki = &r.kn[(t0 + i) * dk];
    const double b = beta[(t0 + i) * s.v_heads + h];
    for (std::int64_t e = 0; e < dv; ++e) {
      double sk = 0;
      for (std::int64_t a = 0; a < dk; ++a) sk += S[a * dv + e] * ki[a];
      c.u[i * dv + e] = sk;
      double rhs = v[((t0 + i) * s.v_heads + h) * dv + e] - std::exp(c.G[i]) * sk;
      for (std::int64_t j = 0; j < i; ++j) rhs -= c.kk[i * n + j] * c.d[j * dv + e];
      c.d[i * dv + e] = b * rhs;
    }
  }
  return c;
}

/// The state leaving chunk c, in place: exp(G_last) S + sum_j exp(G_last - G_j) k_j d_j^T.
void leave_chunk(const GatedDeltaShape& s, const HeadRun& r, const ChunkRun& c, Vec& S) {
  const std::int64_t dk = s.k_dim, dv = s.v_dim;
  const double last = c.G[c.n - 1];
  for (std::int64_t a = 0; a < dk; ++a)
    for (std::int64_t e = 0; e < dv; ++e) {
      double x = std::exp(last) * S[a * dv + e];
      for (std::int64_t j = 0; j < c.n; ++j) x += std::exp(last - c.G[j]) * r.kn[(c.t0 + j) * dk + a] * c.d[j * dv + e];
      S[a * dv + e] = x;
    }
}

void check_chunk(const char* fn, std::int64_t chunk) {
  if (chunk < 1) OOM_THROW(Errc::invalid_argument, fmt::format("{}: chunk {} < 1", fn, chunk));
}

}  // namespace

GatedDeltaChunked gated_delta_rule_chunked_forward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                   std::span<const float> v, std::span<const float> g,
                                                   std::span<const float> beta, std::int64_t chunk) {
  check_inputs("gated_delta_rule_chunked_forward", s, q, k, v, g, beta);
  check_chunk("gated_delta_rule_chunked_forward", chunk);
  const std::int64_t T = s.tokens, dk = s.k_dim, dv = s.v_dim, chunks = (T + chunk - 1) / chunk;
  GatedDeltaChunked out;
  out.out.resize(static_cast<std::size_t>(T * s.v_heads * dv));
  out.states.resize(static_cast<std::size_t>(s.v_heads * (chunks + 1) * dk * dv));
  for (std::int64_t h = 0; h < s.v_heads; ++h) {
    const HeadRun r = normalise_head(s, h, q, k);
    Vec S(static_cast<std::size_t>(dk * dv), 0.0);
    for (std::int64_t c = 0; c < chunks; ++c) {
      std::copy(S.begin(), S.end(), out.states.begin() + (h * (chunks + 1) + c) * dk * dv);
      const std::int64_t t0 = c * chunk, n = std::min(chunk, T - t0);
      const ChunkRun run = run_chunk(s, r, h, v, g, beta, t0, n, S);
      // The outputs from the entering state and the chunk's deltas.
      for (std::int64_t i = 0; i < n; ++i) {
        const double* qi = &r.qn[(t0 + i) * dk];
        for (std::int64_t e = 0; e < dv; ++e) {
          double sq = 0;
          for (std::int64_t a = 0; a < dk; ++a) sq += S[a * dv + e] * qi[a];
          double o = std::exp(run.G[i]) * sq;
          for (std::int64_t j = 0; j <= i; ++j) o += run.qk[i * n + j] * run.d[j * dv + e];
          out.out[((t0 + i) * s.v_heads + h) * dv + e] = static_cast<float>(o);
        }
      }
      leave_chunk(s, r, run, S);
    }
    std::copy(S.begin(), S.end(), out.states.begin() + (h * (chunks + 1) + chunks) * dk * dv);
  }
  return out;
}

GatedDeltaGrads gated_delta_rule_chunked_backward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                  std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                                  std::span<const float> d_out, std::int64_t chunk) {
  check_inputs("gated_delta_rule_chunked_backward", s, q, k, v, g, beta);
  check_size("gated_delta_rule_chunked_backward", d_out.size(), s.tokens * s.v_heads * s.v_dim, "d_out");
  check_chunk("gated_delta_rule_chunked_backward", chunk);
  const std::int64_t T = s.tokens, dk = s.k_dim, dv = s.v_dim, group = s.v_heads / s.k_heads, chunks = (T + chunk - 1) / chunk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  GatedDeltaGrads gr;
  Vec dq(q.size(), 0.0), dk_sum(k.size(), 0.0);
  gr.dv.assign(v.size(), 0.0f);
  gr.dg.assign(g.size(), 0.0f);
  gr.dbeta.assign(beta.size(), 0.0f);
  for (std::int64_t h = 0; h < s.v_heads; ++h) {
    const std::int64_t kh = h / group;
    const HeadRun r = normalise_head(s, h, q, k);
    // The states entering each chunk, as the forward makes them.
    std::vector<Vec> entering;
    Vec S(static_cast<std::size_t>(dk * dv), 0.0);
    for (std::int64_t c = 0; c < chunks; ++c) {
      entering.push_back(S);
      const std::int64_t t0 = c * chunk;
      leave_chunk(s, r, run_chunk(s, r, h, v, g, beta, t0, std::min(chunk, T - t0), S), S);
    }
    Vec dS(static_cast<std::size_t>(dk * dv), 0.0);  // of the state leaving the chunk being differentiated
    Vec dqn(static_cast<std::size_t>(T * dk), 0.0), dkn(dqn.size(), 0.0);  // of the normalised (q scaled) rows
    for (std::int64_t c = chunks - 1; c >= 0; --c) {
      const Vec& S0 = entering[static_cast<std::size_t>(c)];
      const std::int64_t t0 = c * chunk, n = std::min(chunk, T - t0);
      const ChunkRun run = run_chunk(s, r, h, v, g, beta, t0, n, S0);
      const double* kn = &r.kn[t0 * dk];
      const double* qn = &r.qn[t0 * dk];
      double* dkc = &dkn[t0 * dk];
      double* dqc = &dqn[t0 * dk];
      Vec dD(static_cast<std::size_t>(n * dv), 0.0), dG(static_cast<std::size_t>(n), 0.0), dS0(dS.size(), 0.0);
      const double last = run.G[n - 1];
      // X_ij = exp(G_i - G_j) (a_i . k_j), a = q (qk) or k (kk): its gradient dx into a_i, k_j, G_i and G_j.
      auto masked_dot_backward = [&](double dx, std::int64_t i, std::int64_t j, const double* a_rows, double* da_rows) {
        const double gamma = std::exp(run.G[i] - run.G[j]);
        double adotk = 0;
        for (std::int64_t a = 0; a < dk; ++a) {
          da_rows[i * dk + a] += dx * gamma * kn[j * dk + a];
          dkc[j * dk + a] += dx * gamma * a_rows[i * dk + a];
          adotk += a_rows[i * dk + a] * kn[j * dk + a];
        }
        dG[i] += dx * adotk * gamma;
        dG[j] -= dx * adotk * gamma;
      };
      // S_leaving = exp(G_last) S0 + sum_j w_j k_j d_j^T, w_j = exp(G_last - G_j).
      double s_ds = 0;
      for (std::int64_t i = 0; i < dk * dv; ++i) {
        s_ds += S0[i] * dS[i];
        dS0[i] = std::exp(last) * dS[i];
      }
      dG[n - 1] += std::exp(last) * s_ds;
      for (std::int64_t j = 0; j < n; ++j) {
        const double w = std::exp(last - run.G[j]);
        double dw = 0;
        for (std::int64_t a = 0; a < dk; ++a)
          for (std::int64_t e = 0; e < dv; ++e) {
            dD[j * dv + e] += w * kn[j * dk + a] * dS[a * dv + e];
            dkc[j * dk + a] += w * dS[a * dv + e] * run.d[j * dv + e];
            dw += kn[j * dk + a] * dS[a * dv + e] * run.d[j * dv + e];
          }
        dG[n - 1] += dw * w;
        dG[j] -= dw * w;
      }
      // out_i = exp(G_i) S0^T q_i + sum_{j<=i} qk_ij d_j, qk_ij = exp(G_i - G_j) (q_i . k_j).
      for (std::int64_t i = 0; i < n; ++i) {
        const float* doi = &d_out[((t0 + i) * s.v_heads + h) * dv];
        const double ei = std::exp(run.G[i]);
        double sqd = 0;
        for (std::int64_t a = 0; a < dk; ++a) {
          double sd = 0;
          for (std::int64_t e = 0; e < dv; ++e) {
            dS0[a * dv + e] += ei * qn[i * dk + a] * doi[e];
            sd += S0[a * dv + e] * doi[e];
          }
          dqc[i * dk + a] += ei * sd;
          sqd += qn[i * dk + a] * sd;
        }
        dG[i] += ei * sqd;
        for (std::int64_t j = 0; j <= i; ++j) {
          double dqk = 0;
          for (std::int64_t e = 0; e < dv; ++e) {
            dD[j * dv + e] += run.qk[i * n + j] * doi[e];
            dqk += doi[e] * run.d[j * dv + e];
          }
          masked_dot_backward(dqk, i, j, qn, dqc);
        }
      }
      // d_i = beta_i (v_i - exp(G_i) u_i - sum_{j<i} kk_ij d_j), u_i = S0^T k_i: back substitution,
      // each dD_i complete once the later tokens have added to it.
      for (std::int64_t i = n - 1; i >= 0; --i) {
        const double b = beta[(t0 + i) * s.v_heads + h], ei = std::exp(run.G[i]);
        const float* vi = &v[((t0 + i) * s.v_heads + h) * dv];
        Vec hi(static_cast<std::size_t>(dv));  // d loss / d rhs_i
        double dbeta = 0, u_h = 0;
        for (std::int64_t e = 0; e < dv; ++e) {
          double rhs = vi[e] - ei * run.u[i * dv + e];
          for (std::int64_t j = 0; j < i; ++j) rhs -= run.kk[i * n + j] * run.d[j * dv + e];
          dbeta += dD[i * dv + e] * rhs;
          hi[e] = b * dD[i * dv + e];
          gr.dv[((t0 + i) * s.v_heads + h) * dv + e] = static_cast<float>(hi[e]);
          u_h += run.u[i * dv + e] * hi[e];
        }
        gr.dbeta[(t0 + i) * s.v_heads + h] = static_cast<float>(dbeta);
        // The u_i term: du_i = -exp(G_i) h_i.
        dG[i] -= ei * u_h;
        for (std::int64_t a = 0; a < dk; ++a) {
          double acc = 0;
          for (std::int64_t e = 0; e < dv; ++e) {
            dS0[a * dv + e] -= ei * kn[i * dk + a] * hi[e];
            acc -= ei * S0[a * dv + e] * hi[e];
          }
          dkc[i * dk + a] += acc;
        }
        // The kk_ij d_j terms, kk_ij = exp(G_i - G_j) (k_i . k_j).
        for (std::int64_t j = 0; j < i; ++j) {
          double dkk = 0;
          for (std::int64_t e = 0; e < dv; ++e) {
            dD[j * dv + e] -= run.kk[i * n + j] * hi[e];
            dkk -= hi[e] * run.d[j * dv + e];
          }
          masked_dot_backward(dkk, i, j, kn, dkc);
        }
      }
      // G_i = g_0 + ... + g_i within the chunk.
      double tail = 0;
      for (std::int64_t i = n - 1; i >= 0; --i) {
        tail += dG[i];
        gr.dg[(t0 + i) * s.v_heads + h] = static_cast<float>(tail);
      }
      dS = dS0;
    }
    // Through the scale and the l2 normalisations, into the shared key head.
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t a = 0; a < dk; ++a) dqn[t * dk + a] *= scale;
      l2_normalise_backward(&q[(t * s.k_heads + kh) * dk], dk, r.rq[t], &dqn[t * dk], &dq[(t * s.k_heads + kh) * dk]);
      l2_normalise_backward(&k[(t * s.k_heads + kh) * dk], dk, r.rk[t], &dkn[t * dk], &dk_sum[(t * s.k_heads + kh) * dk]);
    }
  }
  gr.dq.assign(dq.begin(), dq.end());
  gr.dk.assign(dk_sum.begin(), dk_sum.end());
  return gr;
}

namespace {
/// The recurrent backward, from `initial` and `d_final` (empty: zeros); `fn` names the caller in errors.
GatedDeltaCarriedGrads rule_backward(const char* fn, const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                     std::span<const float> d_out, std::span<const float> initial, std::span<const float> d_final);
}  // namespace

GatedDeltaGrads gated_delta_rule_backward(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                          std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                          std::span<const float> d_out) {
  return rule_backward("gated_delta_rule_backward", s, q, k, v, g, beta, d_out, {}, {}).grads;
}

GatedDeltaCarriedGrads gated_delta_rule_backward_from(const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                                      std::span<const float> v, std::span<const float> g,
                                                      std::span<const float> beta, std::span<const float> d_out,
                                                      std::span<const float> initial, std::span<const float> d_final) {
  return rule_backward("gated_delta_rule_backward_from", s, q, k, v, g, beta, d_out, initial, d_final);
}

namespace {
GatedDeltaCarriedGrads rule_backward(const char* fn, const GatedDeltaShape& s, std::span<const float> q, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                                     std::span<const float> d_out, std::span<const float> initial, std::span<const float> d_final) {
  check_inputs(fn, s, q, k, v, g, beta);
  check_size(fn, d_out.size(), s.tokens * s.v_heads * s.v_dim, "d_out");
  check_state(fn, s, initial, "initial");
  check_state(fn, s, d_final, "d_final");
  const std::int64_t T = s.tokens, dk = s.k_dim, dv = s.v_dim, group = s.v_heads / s.k_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  GatedDeltaCarriedGrads carried;
  carried.d_initial.resize(static_cast<std::size_t>(s.v_heads * dk * dv));
  GatedDeltaGrads& gr = carried.grads;
  Vec dq(q.size(), 0.0), dk_sum(k.size(), 0.0);  // summed over the value heads of a key head, in fp64
  gr.dv.assign(v.size(), 0.0f);
  gr.dg.assign(g.size(), 0.0f);
  gr.dbeta.assign(beta.size(), 0.0f);
  Vec dS(static_cast<std::size_t>(dk * dv)), u(static_cast<std::size_t>(dv)), dd(u.size()), du(u.size());
  Vec dqn(static_cast<std::size_t>(dk)), dkn(dqn.size());
  for (std::int64_t h = 0; h < s.v_heads; ++h) {
    const std::int64_t kh = h / group;
    const HeadRun r = run_head(s, h, q, k, v, g, beta, nullptr, initial);
    for (std::int64_t i = 0; i < dk * dv; ++i) dS[i] = d_final.empty() ? 0.0 : d_final[h * dk * dv + i];
    for (std::int64_t t = T - 1; t >= 0; --t) {
      const double* qn = &r.qn[t * dk];
      const double* kn = &r.kn[t * dk];
      const double* prev = &r.states[t * dk * dv];
      const double* S = &r.states[(t + 1) * dk * dv];
      const double alpha = std::exp(static_cast<double>(g[t * s.v_heads + h]));
      const double b = beta[t * s.v_heads + h];
      const float* vt = &v[(t * s.v_heads + h) * dv];
      const float* dot = &d_out[(t * s.v_heads + h) * dv];
      // u and the delta of this token, from the decayed state alpha * prev.
      for (std::int64_t j = 0; j < dv; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += alpha * prev[i * dv + j] * kn[i];
        u[j] = acc;
      }
      // out = S^T q: into dS and dq.
      for (std::int64_t i = 0; i < dk; ++i) {
        double acc = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          dS[i * dv + j] += qn[i] * dot[j];
          acc += S[i * dv + j] * dot[j];
        }
        dqn[i] = acc;
      }
      // S = decayed + k d^T, d = beta (v - u).
      for (std::int64_t j = 0; j < dv; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += dS[i * dv + j] * kn[i];
        dd[j] = acc;
      }
      double dbeta = 0;
      for (std::int64_t i = 0; i < dk; ++i) {
        double acc = 0;
        for (std::int64_t j = 0; j < dv; ++j) acc += dS[i * dv + j] * b * (vt[j] - u[j]);
        dkn[i] = acc;
      }
      for (std::int64_t j = 0; j < dv; ++j) {
        dbeta += dd[j] * (vt[j] - u[j]);
        gr.dv[(t * s.v_heads + h) * dv + j] = static_cast<float>(b * dd[j]);
        du[j] = -b * dd[j];
      }
      gr.dbeta[t * s.v_heads + h] = static_cast<float>(dbeta);
      // u = decayed^T k: the decayed state's gradient gains k du^T, and k gains decayed du.
      for (std::int64_t i = 0; i < dk; ++i) {
        double acc = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          acc += alpha * prev[i * dv + j] * du[j];
          dS[i * dv + j] += kn[i] * du[j];
        }
        dkn[i] += acc;
      }
      // decayed = alpha prev, alpha = exp(g).
      double dalpha = 0;
      for (std::int64_t i = 0; i < dk * dv; ++i) {
        dalpha += dS[i] * prev[i];
        dS[i] *= alpha;
      }
      gr.dg[t * s.v_heads + h] = static_cast<float>(dalpha * alpha);
      // Through the scale and the l2 normalisations, into the shared key head.
      for (std::int64_t i = 0; i < dk; ++i) dqn[i] *= scale;
      l2_normalise_backward(&q[(t * s.k_heads + kh) * dk], dk, r.rq[t], dqn.data(), &dq[(t * s.k_heads + kh) * dk]);
      l2_normalise_backward(&k[(t * s.k_heads + kh) * dk], dk, r.rk[t], dkn.data(), &dk_sum[(t * s.k_heads + kh) * dk]);
    }
    // dS is now the gradient of the state entering token 0.
    for (std::int64_t i = 0; i < dk * dv; ++i) carried.d_initial[h * dk * dv + i] = static_cast<float>(dS[i]);
  }
  gr.dq.assign(dq.begin(), dq.end());
  gr.dk.assign(dk_sum.begin(), dk_sum.end());
  return carried;
}
}  // namespace

std::vector<float> causal_conv1d_silu_forward(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                              std::span<const float> x, std::span<const float> w) {
  check_conv("causal_conv1d_silu_forward", tokens, channels, kernel, w);
  check_size("causal_conv1d_silu_forward", x.size(), tokens * channels, "x");
  std::vector<float> y(x.size());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t c = 0; c < channels; ++c) {
      y[t * channels + c] = static_cast<float>(silu(conv_pre(t, c, channels, kernel, x, w)));
    }
  return y;
}

CausalConvGrads causal_conv1d_silu_backward(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                            std::span<const float> x, std::span<const float> w, std::span<const float> dy) {
  check_conv("causal_conv1d_silu_backward", tokens, channels, kernel, w);
  check_size("causal_conv1d_silu_backward", x.size(), tokens * channels, "x");
  check_size("causal_conv1d_silu_backward", dy.size(), tokens * channels, "dy");
  Vec dx(x.size(), 0.0), dw(w.size(), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t c = 0; c < channels; ++c) {
      const double dz = dy[t * channels + c] * silu_grad(conv_pre(t, c, channels, kernel, x, w));
      for (std::int64_t j = 0; j < kernel; ++j) {
        const std::int64_t src = t - kernel + 1 + j;
        if (src < 0) continue;
        dw[c * kernel + j] += dz * x[src * channels + c];
        dx[src * channels + c] += dz * w[c * kernel + j];
      }
    }
  return {std::vector<float>(dx.begin(), dx.end()), std::vector<float>(dw.begin(), dw.end())};
}

namespace {
/// history (K - 1 rows, or zeros when empty) then x, as one sequence.
std::vector<float> with_history(const char* fn, std::int64_t channels, std::int64_t kernel, std::span<const float> x,
                                std::span<const float> history) {
  if (!history.empty()) check_size(fn, history.size(), (kernel - 1) * channels, "history");
  std::vector<float> joined(static_cast<std::size_t>((kernel - 1) * channels), 0.0f);
  if (!history.empty()) std::copy(history.begin(), history.end(), joined.begin());
  joined.insert(joined.end(), x.begin(), x.end());
  return joined;
}
}  // namespace

std::vector<float> causal_conv1d_silu_forward_from(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                                   std::span<const float> x, std::span<const float> w,
                                                   std::span<const float> history) {
  constexpr const char* fn = "causal_conv1d_silu_forward_from";
  check_conv(fn, tokens, channels, kernel, w);
  check_size(fn, x.size(), tokens * channels, "x");
  const auto joined = with_history(fn, channels, kernel, x, history);
  const auto y = causal_conv1d_silu_forward(tokens + kernel - 1, channels, kernel, joined, w);
  return std::vector<float>(y.begin() + (kernel - 1) * channels, y.end());
}

CausalConvCarriedGrads causal_conv1d_silu_backward_from(std::int64_t tokens, std::int64_t channels, std::int64_t kernel,
                                                        std::span<const float> x, std::span<const float> w,
                                                        std::span<const float> history, std::span<const float> dy) {
  constexpr const char* fn = "causal_conv1d_silu_backward_from";
  check_conv(fn, tokens, channels, kernel, w);
  check_size(fn, x.size(), tokens * channels, "x");
  check_size(fn, dy.size(), tokens * channels, "dy");
  const auto joined = with_history(fn, channels, kernel, x, history);
  std::vector<float> dy_joined(static_cast<std::size_t>((kernel - 1) * channels), 0.0f);  // the history's outputs are not ours
  dy_joined.insert(dy_joined.end(), dy.begin(), dy.end());
  CausalConvGrads g = causal_conv1d_silu_backward(tokens + kernel - 1, channels, kernel, joined, w, dy_joined);
  CausalConvCarriedGrads c;
  const auto split = g.dx.begin() + (kernel - 1) * channels;
  c.d_history.assign(g.dx.begin(), split);
  c.grads.dx.assign(split, g.dx.end());
  c.grads.dw = std::move(g.dw);
  return c;
}

DeltaGates delta_gates_forward(std::int64_t tokens, std::int64_t heads, std::span<const float> a, std::span<const float> b,
                               std::span<const float> a_log, std::span<const float> dt_bias) {
  check_gates("delta_gates_forward", tokens, heads, a_log, dt_bias);
  check_size("delta_gates_forward", a.size(), tokens * heads, "a");
  check_size("delta_gates_forward", b.size(), tokens * heads, "b");
  DeltaGates out{std::vector<float>(a.size()), std::vector<float>(a.size())};
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t i = t * heads + h;
      out.beta[i] = static_cast<float>(sigmoid(b[i]));
      out.g[i] = static_cast<float>(-std::exp(static_cast<double>(a_log[h])) * softplus(static_cast<double>(a[i]) + dt_bias[h]));
    }
  return out;
}

DeltaGateGrads delta_gates_backward(std::int64_t tokens, std::int64_t heads, std::span<const float> a, std::span<const float> b,
                                    std::span<const float> a_log, std::span<const float> dt_bias,
                                    std::span<const float> dbeta, std::span<const float> dg) {
  check_gates("delta_gates_backward", tokens, heads, a_log, dt_bias);
  check_size("delta_gates_backward", a.size(), tokens * heads, "a");
  check_size("delta_gates_backward", b.size(), tokens * heads, "b");
  check_size("delta_gates_backward", dbeta.size(), tokens * heads, "dbeta");
  check_size("delta_gates_backward", dg.size(), tokens * heads, "dg");
  DeltaGateGrads gr{std::vector<float>(a.size()), std::vector<float>(b.size()), {}, {}};
  Vec da_log(static_cast<std::size_t>(heads), 0.0), ddt(da_log.size(), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t i = t * heads + h;
      const double sb = sigmoid(b[i]);
      gr.db[i] = static_cast<float>(dbeta[i] * sb * (1.0 - sb));
      const double x = static_cast<double>(a[i]) + dt_bias[h], decay = std::exp(static_cast<double>(a_log[h]));
      const double dx = -dg[i] * decay * softplus_grad(x);
      gr.da[i] = static_cast<float>(dx);
      ddt[h] += dx;
      da_log[h] += dg[i] * -decay * softplus(x);  // d g / d A_log = g
    }
  gr.da_log.assign(da_log.begin(), da_log.end());
  gr.ddt_bias.assign(ddt.begin(), ddt.end());
  return gr;
}

std::vector<float> gated_rmsnorm_forward(std::int64_t rows, std::int64_t dim, std::span<const float> x,
                                         std::span<const float> z, std::span<const float> w, double eps) {
  check_norm("gated_rmsnorm_forward", rows, dim, w, eps);
  check_size("gated_rmsnorm_forward", x.size(), rows * dim, "x");
  check_size("gated_rmsnorm_forward", z.size(), rows * dim, "z");
  std::vector<float> y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (std::int64_t i = 0; i < dim; ++i)
      y[r * dim + i] = static_cast<float>(w[i] * (x[r * dim + i] * inv) * silu(z[r * dim + i]));
  }
  return y;
}

GatedRmsNormGrads gated_rmsnorm_backward(std::int64_t rows, std::int64_t dim, std::span<const float> x,
                                         std::span<const float> z, std::span<const float> w, double eps,
                                         std::span<const float> dy) {
  check_norm("gated_rmsnorm_backward", rows, dim, w, eps);
  check_size("gated_rmsnorm_backward", x.size(), rows * dim, "x");
  check_size("gated_rmsnorm_backward", z.size(), rows * dim, "z");
  check_size("gated_rmsnorm_backward", dy.size(), rows * dim, "dy");
  GatedRmsNormGrads gr{std::vector<float>(x.size()), std::vector<float>(z.size()), {}};
  Vec dw(static_cast<std::size_t>(dim), 0.0), dn(dw.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = &x[r * dim];
    double ss = 0;
    for (std::int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    // y = w n silu(z), n = x inv: dn = dy w silu(z); dx = inv (dn - n mean(n dn)).
    double n_dn = 0;
    for (std::int64_t i = 0; i < dim; ++i) {
      const double zi = z[r * dim + i], n = xr[i] * inv, d = dy[r * dim + i];
      dw[i] += d * n * silu(zi);
      gr.dz[r * dim + i] = static_cast<float>(d * w[i] * n * silu_grad(zi));
      dn[i] = d * w[i] * silu(zi);
      n_dn += n * dn[i];
    }
    for (std::int64_t i = 0; i < dim; ++i)
      gr.dx[r * dim + i] = static_cast<float>(inv * (dn[i] - xr[i] * inv * n_dn / static_cast<double>(dim)));
  }
  gr.dw.assign(dw.begin(), dw.end());
  return gr;
}


namespace {

/// y (M, N) = a (M, K) w^T, w (N, K): nn.Linear without bias, fp64 accumulation.
std::vector<float> linear(std::int64_t m, std::int64_t k, std::int64_t n, std::span<const float> a, std::span<const float> w) {
  std::vector<float> y(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t c = 0; c < k; ++c) acc += static_cast<double>(a[i * k + c]) * w[j * k + c];
      y[i * n + j] = static_cast<float>(acc);
    }
  return y;
}

/// Of y = a w^T: da (M, K) = dy w, dw (N, K) = dy^T a.
void linear_backward(std::int64_t m, std::int64_t k, std::int64_t n, std::span<const float> a, std::span<const float> w,
                     std::span<const float> dy, std::vector<float>& da, std::vector<float>& dw) {
  da.assign(static_cast<std::size_t>(m * k), 0.0f);
  dw.assign(static_cast<std::size_t>(n * k), 0.0f);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < k; ++c) {
      double acc = 0;
      for (std::int64_t j = 0; j < n; ++j) acc += static_cast<double>(dy[i * n + j]) * w[j * k + c];
      da[i * k + c] = static_cast<float>(acc);
    }
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t c = 0; c < k; ++c) {
      double acc = 0;
      for (std::int64_t i = 0; i < m; ++i) acc += static_cast<double>(dy[i * n + j]) * a[i * k + c];
      dw[j * k + c] = static_cast<float>(acc);
    }
}

/// Where each value of a projection row goes, by the layout (DeltaNetLayout): q, k and v to the
/// conv's channels [q | k | v] (v by value head), z, b and a to (T, v_heads[, dv]). `move(from, to)` is called for every pair: the split forward, its
/// adjoint backward.
template <class Move>
void route_qkvz(const GatedDeltaNetShape& s, Move&& move) {
  const std::int64_t r = s.v_heads / s.k_heads, dk = s.k_dim, dv = s.v_dim, row = 2 * s.key_width() + 2 * s.value_width();
  const std::int64_t C = s.conv_channels(), zrow = s.value_width();
  if (s.layout == DeltaNetLayout::qwen3_5_stacked) {  // [q | k | v | z]: already the conv's order
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      for (std::int64_t c = 0; c < C; ++c) move(0, t * row + c, t * C + c);
      for (std::int64_t e = 0; e < zrow; ++e) move(1, t * row + C + e, t * zrow + e);
    }
    return;
  }
  for (std::int64_t t = 0; t < s.tokens; ++t)
    for (std::int64_t kh = 0; kh < s.k_heads; ++kh) {
      const std::int64_t base = t * row + kh * (2 * dk + 2 * r * dv);
      for (std::int64_t i = 0; i < dk; ++i) {
        move(0, base + i, t * C + kh * dk + i);                      // q
        move(0, base + dk + i, t * C + s.key_width() + kh * dk + i);  // k
      }
      for (std::int64_t j = 0; j < r; ++j)
        for (std::int64_t d = 0; d < dv; ++d) {
          const std::int64_t h = kh * r + j;
          move(0, base + 2 * dk + j * dv + d, t * C + 2 * s.key_width() + h * dv + d);  // v
          move(1, base + 2 * dk + r * dv + j * dv + d, t * zrow + h * dv + d);          // z
        }
    }
}
template <class Move>
void route_ba(const GatedDeltaNetShape& s, Move&& move) {
  const std::int64_t r = s.v_heads / s.k_heads;
  if (s.layout == DeltaNetLayout::qwen3_5_stacked) {  // [b | a]
    for (std::int64_t t = 0; t < s.tokens; ++t)
      for (std::int64_t h = 0; h < s.v_heads; ++h) {
        move(2, t * 2 * s.v_heads + h, t * s.v_heads + h);
        move(3, t * 2 * s.v_heads + s.v_heads + h, t * s.v_heads + h);
      }
    return;
  }
  for (std::int64_t t = 0; t < s.tokens; ++t)
    for (std::int64_t kh = 0; kh < s.k_heads; ++kh)
      for (std::int64_t j = 0; j < r; ++j) {
        const std::int64_t from = t * 2 * s.v_heads + kh * 2 * r, h = t * s.v_heads + kh * r + j;
        move(2, from + j, h);      // b
        move(3, from + r + j, h);  // a
      }
}

struct DeltaNetRun {
  std::vector<float> qkvz, ba;             // the projections
  std::vector<float> mixed, conv;          // (T, C): before and after the conv + SiLU
  std::vector<float> q, k, v, z, a, b;     // split
  DeltaGates gates;
  std::vector<float> core, normed;         // (T, v_heads, dv)
  std::vector<float> final_state;          // run from a carry only: the rule's state after the last token
};

/// The block's backward, whole (in == nullptr) or from a carry (then d_carry_out given, d_carry_in filled).
GatedDeltaNetGrads gated_deltanet_backward_impl(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                                std::span<const float> d_out, const GatedDeltaNetCarry* in,
                                                const GatedDeltaNetCarry* d_carry_out, GatedDeltaNetCarry* d_carry_in);

void check_block(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w) {
  if (s.tokens < 0 || s.hidden < 1 || s.k_heads < 1 || s.v_heads < 1 || s.k_dim < 1 || s.v_dim < 1 || s.conv_kernel < 1 ||
      s.v_heads % s.k_heads != 0 || !(s.eps > 0))
    OOM_THROW(Errc::invalid_argument,
              fmt::format("gated deltanet: need T >= 0, every width >= 1, value heads a multiple of key heads and eps > 0 (T {}, "
                          "hidden {}, heads {}/{}, dims {}/{}, kernel {}, eps {})",
                          s.tokens, s.hidden, s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel, s.eps));
  const char* fn = "gated_deltanet";
  check_size(fn, x.size(), s.tokens * s.hidden, "x");
  check_size(fn, w.in_proj_qkvz.size(), (2 * s.key_width() + 2 * s.value_width()) * s.hidden, "in_proj_qkvz");
  check_size(fn, w.in_proj_ba.size(), 2 * s.v_heads * s.hidden, "in_proj_ba");
  check_size(fn, w.conv.size(), s.conv_channels() * s.conv_kernel, "conv");
  check_size(fn, w.a_log.size(), s.v_heads, "A_log");
  check_size(fn, w.dt_bias.size(), s.v_heads, "dt_bias");
  check_size(fn, w.norm.size(), s.v_dim, "norm");
  check_size(fn, w.out_proj.size(), s.hidden * s.value_width(), "out_proj");
}

GatedDeltaShape core_shape(const GatedDeltaNetShape& s) {
  return {.tokens = s.tokens, .k_heads = s.k_heads, .v_heads = s.v_heads, .k_dim = s.k_dim, .v_dim = s.v_dim};
}

DeltaNetRun run_block(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                      const GatedDeltaNetCarry* in = nullptr) {
  check_block(s, x, w);
  const std::int64_t T = s.tokens, C = s.conv_channels(), kw = s.key_width(), vw = s.value_width();
  DeltaNetRun r;
  r.qkvz = linear(T, s.hidden, 2 * kw + 2 * vw, x, w.in_proj_qkvz);
  r.ba = linear(T, s.hidden, 2 * s.v_heads, x, w.in_proj_ba);
  r.mixed.resize(static_cast<std::size_t>(T * C));
  r.z.resize(static_cast<std::size_t>(T * vw));
  r.a.resize(static_cast<std::size_t>(T * s.v_heads));
  r.b.resize(r.a.size());
  std::vector<float>* qkvz_to[] = {&r.mixed, &r.z};
  route_qkvz(s, [&](int to, std::int64_t from, std::int64_t at) { (*qkvz_to[to])[at] = r.qkvz[from]; });
  route_ba(s, [&](int to, std::int64_t from, std::int64_t at) { (to == 2 ? r.b : r.a)[at] = r.ba[from]; });
  r.conv = in == nullptr ? causal_conv1d_silu_forward(T, C, s.conv_kernel, r.mixed, w.conv)
                         : causal_conv1d_silu_forward_from(T, C, s.conv_kernel, r.mixed, w.conv, in->conv_history);
  for (std::int64_t t = 0; t < T; ++t) {
    const float* row = &r.conv[t * C];
    r.q.insert(r.q.end(), row, row + kw);
    r.k.insert(r.k.end(), row + kw, row + 2 * kw);
    r.v.insert(r.v.end(), row + 2 * kw, row + C);
  }
  r.gates = delta_gates_forward(T, s.v_heads, r.a, r.b, w.a_log, w.dt_bias);
  if (in == nullptr) {
    r.core = gated_delta_rule_forward(core_shape(s), r.q, r.k, r.v, r.gates.g, r.gates.beta);
  } else {
    auto carried = gated_delta_rule_forward_from(core_shape(s), r.q, r.k, r.v, r.gates.g, r.gates.beta, in->state);
    r.core = std::move(carried.out);
    r.final_state = std::move(carried.final_state);
  }
  r.normed = gated_rmsnorm_forward(T * s.v_heads, s.v_dim, r.core, r.z, w.norm, s.eps);
  return r;
}

}  // namespace

GatedDeltaNetOffsets gated_deltanet_offsets(const GatedDeltaNetShape& s) {
  GatedDeltaNetOffsets o;
  o.in_proj_ba = o.in_proj_qkvz + (2 * s.key_width() + 2 * s.value_width()) * s.hidden;
  o.conv = o.in_proj_ba + 2 * s.v_heads * s.hidden;
  o.dt_bias = o.conv + s.conv_channels() * s.conv_kernel;
  o.a_log = o.dt_bias + s.v_heads;
  o.norm = o.a_log + s.v_heads;
  o.out_proj = o.norm + s.v_dim;
  o.end = o.out_proj + s.hidden * s.value_width();
  return o;
}

GatedDeltaNetWeights gated_deltanet_weights(const GatedDeltaNetShape& s, std::span<const float> segment) {
  const GatedDeltaNetOffsets o = gated_deltanet_offsets(s);
  check_size("gated_deltanet_weights", segment.size(), o.end, "segment");
  auto part = [&](std::int64_t at, std::int64_t to) {
    return segment.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(to - at));
  };
  return {part(o.in_proj_qkvz, o.in_proj_ba), part(o.in_proj_ba, o.conv), part(o.conv, o.dt_bias), part(o.a_log, o.norm),
          part(o.dt_bias, o.a_log), part(o.norm, o.out_proj), part(o.out_proj, o.end)};
}

std::vector<float> gated_deltanet_forward(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w) {
  const DeltaNetRun r = run_block(s, x, w);
  return linear(s.tokens, s.value_width(), s.hidden, r.normed, w.out_proj);
}

namespace {
/// A carry's two parts are empty (zeros) or of their sizes; `fn` and `what` name it in errors.
void check_carry(const char* fn, const GatedDeltaNetShape& s, const GatedDeltaNetCarry& c, const char* what) {
  if (!c.state.empty())
    check_size(fn, c.state.size(), s.v_heads * s.k_dim * s.v_dim, fmt::format("{}.state", what).c_str());
  if (!c.conv_history.empty())
    check_size(fn, c.conv_history.size(), (s.conv_kernel - 1) * s.conv_channels(), fmt::format("{}.conv_history", what).c_str());
}
}  // namespace

GatedDeltaNetChunk gated_deltanet_forward_from(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                               const GatedDeltaNetCarry& in) {
  check_block(s, x, w);
  check_carry("gated_deltanet_forward_from", s, in, "in");
  DeltaNetRun r = run_block(s, x, w, &in);
  GatedDeltaNetChunk c;
  c.out = linear(s.tokens, s.value_width(), s.hidden, r.normed, w.out_proj);
  c.carry.state = std::move(r.final_state);
  const auto joined = with_history("gated_deltanet_forward_from", s.conv_channels(), s.conv_kernel, r.mixed,
                                   in.conv_history);  // the last K - 1 rows go on
  c.carry.conv_history.assign(joined.end() - (s.conv_kernel - 1) * s.conv_channels(), joined.end());
  return c;
}

GatedDeltaNetChunkGrads gated_deltanet_backward_from(const GatedDeltaNetShape& s, std::span<const float> x,
                                                     const GatedDeltaNetWeights& w, std::span<const float> d_out,
                                                     const GatedDeltaNetCarry& in, const GatedDeltaNetCarry& d_carry_out) {
  constexpr const char* fn = "gated_deltanet_backward_from";
  check_block(s, x, w);
  check_carry(fn, s, in, "in");
  check_carry(fn, s, d_carry_out, "d_carry_out");
  check_size(fn, d_out.size(), s.tokens * s.hidden, "d_out");
  GatedDeltaNetChunkGrads out;
  out.grads = gated_deltanet_backward_impl(s, x, w, d_out, &in, &d_carry_out, &out.d_carry_in);
  return out;
}

GatedDeltaNetGrads gated_deltanet_backward(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                           std::span<const float> d_out) {
  return gated_deltanet_backward_impl(s, x, w, d_out, nullptr, nullptr, nullptr);
}

namespace {

GatedDeltaNetGrads gated_deltanet_backward_impl(const GatedDeltaNetShape& s, std::span<const float> x, const GatedDeltaNetWeights& w,
                                                std::span<const float> d_out, const GatedDeltaNetCarry* in,
                                                const GatedDeltaNetCarry* d_carry_out, GatedDeltaNetCarry* d_carry_in) {
  const DeltaNetRun r = run_block(s, x, w, in);
  check_size("gated_deltanet_backward", d_out.size(), s.tokens * s.hidden, "d_out");
  const std::int64_t T = s.tokens, C = s.conv_channels(), kw = s.key_width(), vw = s.value_width();
  GatedDeltaNetGrads gr;
  std::vector<float> d_normed;
  linear_backward(T, vw, s.hidden, r.normed, w.out_proj, d_out, d_normed, gr.out_proj);
  const auto norm = gated_rmsnorm_backward(T * s.v_heads, s.v_dim, r.core, r.z, w.norm, s.eps, d_normed);
  gr.norm = norm.dw;
  GatedDeltaGrads core;
  if (in == nullptr) {
    core = gated_delta_rule_backward(core_shape(s), r.q, r.k, r.v, r.gates.g, r.gates.beta, norm.dx);
  } else {
    auto carried = gated_delta_rule_backward_from(core_shape(s), r.q, r.k, r.v, r.gates.g, r.gates.beta, norm.dx, in->state,
                                                  d_carry_out->state);
    core = std::move(carried.grads);
    d_carry_in->state = std::move(carried.d_initial);
  }
  const auto gates = delta_gates_backward(T, s.v_heads, r.a, r.b, w.a_log, w.dt_bias, core.dbeta, core.dg);
  gr.a_log = gates.da_log;
  gr.dt_bias = gates.ddt_bias;
  std::vector<float> d_conv(static_cast<std::size_t>(T * C));
  for (std::int64_t t = 0; t < T; ++t) {
    std::copy_n(&core.dq[t * kw], kw, &d_conv[t * C]);
    std::copy_n(&core.dk[t * kw], kw, &d_conv[t * C + kw]);
    std::copy_n(&core.dv[t * vw], vw, &d_conv[t * C + 2 * kw]);
  }
  CausalConvGrads conv;
  if (in == nullptr) {
    conv = causal_conv1d_silu_backward(T, C, s.conv_kernel, r.mixed, w.conv, d_conv);
  } else {
    auto carried = causal_conv1d_silu_backward_from(T, C, s.conv_kernel, r.mixed, w.conv, in->conv_history, d_conv);
    // The rows handed on (the last K - 1 of history + this chunk's inputs) take the next chunk's
    // gradient of them; the history's part goes back with d_carry_in.
    const std::int64_t hist = (s.conv_kernel - 1) * C;
    std::vector<double> d_joined(static_cast<std::size_t>(hist + T * C));
    for (std::int64_t i = 0; i < hist; ++i) d_joined[i] = carried.d_history[i];
    for (std::int64_t i = 0; i < T * C; ++i) d_joined[hist + i] = carried.grads.dx[i];
    if (!d_carry_out->conv_history.empty()) {  // (its size checked on entry)
      for (std::int64_t i = 0; i < hist; ++i) d_joined[T * C + i] += d_carry_out->conv_history[i];
    }
    d_carry_in->conv_history.assign(d_joined.begin(), d_joined.begin() + hist);
    conv.dx.assign(d_joined.begin() + hist, d_joined.end());
    conv.dw = std::move(carried.grads.dw);
  }
  gr.conv = conv.dw;
  std::vector<float> d_qkvz(r.qkvz.size()), d_ba(r.ba.size());
  const std::vector<float>* qkvz_from[] = {&conv.dx, &norm.dz};
  route_qkvz(s, [&](int to, std::int64_t from, std::int64_t at) { d_qkvz[from] = (*qkvz_from[to])[at]; });
  route_ba(s, [&](int to, std::int64_t from, std::int64_t at) { d_ba[from] = (to == 2 ? gates.db : gates.da)[at]; });
  std::vector<float> dx_qkvz, dx_ba;
  linear_backward(T, s.hidden, 2 * kw + 2 * vw, x, w.in_proj_qkvz, d_qkvz, dx_qkvz, gr.in_proj_qkvz);
  linear_backward(T, s.hidden, 2 * s.v_heads, x, w.in_proj_ba, d_ba, dx_ba, gr.in_proj_ba);
  gr.dx.resize(dx_qkvz.size());
  for (std::size_t i = 0; i < gr.dx.size(); ++i) gr.dx[i] = static_cast<float>(static_cast<double>(dx_qkvz[i]) + dx_ba[i]);
  return gr;
}

}  // namespace

}  // namespace oom::reference
