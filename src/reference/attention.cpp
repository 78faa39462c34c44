// CPU reference of causal GQA attention, forward and backward, row by row in fp64 (see
// include/oom/reference/attention.hpp). Instantiated for float, double and bf16 inputs.
#include "oom/reference/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "oom/core/error.hpp"

namespace oom::reference {
namespace {

inline double value(float x) { return x; }
inline double value(double x) { return x; }
inline double value(bf16 x) { return to_float(x); }

/// Offsets into the contiguous (B, S, H, D) tensors and the (B, Hq, S) LSE.
struct Index {
  const AttentionDims& d;
  [[nodiscard]] std::size_t q(int b, int i, int h) const {
    return ((static_cast<std::size_t>(b) * d.seq + i) * d.heads_q + h) * d.head_dim;
  }
  [[nodiscard]] std::size_t kv(int b, int j, int hk) const {
    return ((static_cast<std::size_t>(b) * d.seq + j) * d.heads_kv + hk) * d.head_dim;
  }
  [[nodiscard]] std::size_t lse(int b, int h, int i) const {
    return (static_cast<std::size_t>(b) * d.heads_q + h) * d.seq + i;
  }
  [[nodiscard]] int kv_head(int h) const { return h / (d.heads_q / d.heads_kv); }
};

template <class A, class B>
double dot(const A* a, const B* b, int n) {
  double s = 0;
  for (int x = 0; x < n; ++x) s += value(a[x]) * value(b[x]);
  return s;
}

void check_dims(const AttentionDims& d, std::size_t q, std::size_t kv) {
  if (d.batch < 0 || d.seq < 0 || d.heads_q <= 0 || d.heads_kv <= 0 || d.head_dim <= 0 || d.heads_q % d.heads_kv != 0)
    OOM_THROW(Errc::invalid_argument, "attention reference: heads_q must be a positive multiple of heads_kv");
  const std::size_t tokens = static_cast<std::size_t>(d.batch) * d.seq * d.head_dim;
  if (q < tokens * d.heads_q || kv < tokens * d.heads_kv)
    OOM_THROW(Errc::invalid_argument, "attention reference: a tensor is smaller than (B, S, H, D)");
}

/// Runs fn(0..n-1) on up to hardware_concurrency threads (tasks write disjoint outputs).
void parallel_for(int n, const std::function<void(int)>& fn) {
  const int threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, std::max(n, 1));
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (int task = w; task < n; task += threads) fn(task);
    });
  for (int task = 0; task < n; task += threads) fn(task);
  for (auto& t : pool) t.join();
}

/// Scores s_j = scale q_i . k_j for j <= i, their max and LSE: the O(i) state of one row.
template <class In>
struct RowSoftmax {
  std::vector<double> p;  // P_ij = exp(s_j - LSE_i)
  double lse = 0;
  RowSoftmax(const AttentionDims& d, double scale, std::span<const In> q, std::span<const In> k, int b, int h, int i) {
    const Index ix{d};
    const int hk = ix.kv_head(h);
    const In* qi = q.data() + ix.q(b, i, h);
    p.resize(static_cast<std::size_t>(i) + 1);
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j <= i; ++j) {
      p[j] = scale * dot(qi, k.data() + ix.kv(b, j, hk), d.head_dim);
      m = std::max(m, p[j]);
    }
    double l = 0;
    for (auto& s : p) {
      s = std::exp(s - m);
      l += s;
    }
    for (auto& s : p) s /= l;
    lse = m + std::log(l);
  }
};

template <class In>
std::vector<double> forward_row(const AttentionDims& d, const RowSoftmax<In>& row, std::span<const In> v, int b, int h) {
  const Index ix{d};
  std::vector<double> o(static_cast<std::size_t>(d.head_dim), 0.0);
  for (std::size_t j = 0; j < row.p.size(); ++j) {
    const In* vj = v.data() + ix.kv(b, static_cast<int>(j), ix.kv_head(h));
    for (int x = 0; x < d.head_dim; ++x) o[x] += row.p[j] * value(vj[x]);
  }
  return o;
}

}  // namespace

template <class In>
AttentionReal<In> attention_forward_row(const AttentionDims& dims, double scale, std::span<const In> q,
                                        std::span<const In> k, std::span<const In> v, int b, int h, int i,
                                        std::span<AttentionReal<In>> o_row) {
  check_dims(dims, q.size(), std::min(k.size(), v.size()));
  const RowSoftmax<In> row(dims, scale, q, k, b, h, i);
  const auto o = forward_row(dims, row, v, b, h);
  for (int x = 0; x < dims.head_dim; ++x) o_row[x] = static_cast<AttentionReal<In>>(o[x]);
  return static_cast<AttentionReal<In>>(row.lse);
}

template <class In>
void attention_forward(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                       std::span<const In> v, std::span<AttentionReal<In>> o, std::span<AttentionReal<In>> lse) {
  check_dims(dims, std::min(q.size(), o.size()), std::min(k.size(), v.size()));
  const Index ix{dims};
  parallel_for(dims.batch * dims.heads_q, [&](int task) {
    const int b = task / dims.heads_q, h = task % dims.heads_q;
    for (int i = 0; i < dims.seq; ++i)
      lse[ix.lse(b, h, i)] = attention_forward_row(dims, scale, q, k, v, b, h, i, o.subspan(ix.q(b, i, h), dims.head_dim));
  });
}

template <class In>
void attention_backward(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                        std::span<const In> v, std::span<const AttentionReal<In>> o,
                        std::span<const AttentionReal<In>> lse, std::span<const In> d_o,
                        std::span<AttentionReal<In>> dq, std::span<AttentionReal<In>> dk,
                        std::span<AttentionReal<In>> dv) {
  check_dims(dims, std::min({q.size(), o.size(), d_o.size(), dq.size()}),
             std::min({k.size(), v.size(), dk.size(), dv.size()}));
  const Index ix{dims};
  const int n = dims.head_dim, group = dims.heads_q / dims.heads_kv;
  // One task per (b, KV head): it owns that head's dK/dV rows and its group's dQ rows.
  parallel_for(dims.batch * dims.heads_kv, [&](int task) {
    const int b = task / dims.heads_kv, hk = task % dims.heads_kv;
    std::vector<double> dk_acc(static_cast<std::size_t>(dims.seq) * n, 0.0), dv_acc(dk_acc.size(), 0.0);
    std::vector<double> dq_acc(static_cast<std::size_t>(n));
    for (int h = hk * group; h < (hk + 1) * group; ++h)
      for (int i = 0; i < dims.seq; ++i) {
        const In* qi = q.data() + ix.q(b, i, h);
        const In* doi = d_o.data() + ix.q(b, i, h);
        const double delta = dot(doi, o.data() + ix.q(b, i, h), n);  // D_i = dO_i . O_i
        const double lse_i = lse[ix.lse(b, h, i)];
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
        for (int j = 0; j <= i; ++j) {
          const In* kj = k.data() + ix.kv(b, j, hk);
          const In* vj = v.data() + ix.kv(b, j, hk);
          const double p = std::exp(scale * dot(qi, kj, n) - lse_i);
          const double ds = p * (dot(doi, vj, n) - delta);
          double* dkj = dk_acc.data() + static_cast<std::size_t>(j) * n;
          double* dvj = dv_acc.data() + static_cast<std::size_t>(j) * n;
          for (int x = 0; x < n; ++x) {
            dq_acc[x] += ds * value(kj[x]);
            dkj[x] += ds * value(qi[x]);
            dvj[x] += p * value(doi[x]);
          }
        }
        for (int x = 0; x < n; ++x) dq[ix.q(b, i, h) + x] = static_cast<AttentionReal<In>>(scale * dq_acc[x]);
      }
    for (int j = 0; j < dims.seq; ++j)
      for (int x = 0; x < n; ++x) {
        dk[ix.kv(b, j, hk) + x] = static_cast<AttentionReal<In>>(scale * dk_acc[static_cast<std::size_t>(j) * n + x]);
        dv[ix.kv(b, j, hk) + x] = static_cast<AttentionReal<In>>(dv_acc[static_cast<std::size_t>(j) * n + x]);
      }
  });
}

template <class In>
void attention_backward_dq_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                               std::span<const In> v, std::span<const In> d_o, int b, int h, int i,
                               std::span<AttentionReal<In>> dq_row) {
  check_dims(dims, std::min(q.size(), d_o.size()), std::min(k.size(), v.size()));
  const Index ix{dims};
  const int n = dims.head_dim, hk = ix.kv_head(h);
  const RowSoftmax<In> row(dims, scale, q, k, b, h, i);
  const auto o = forward_row(dims, row, v, b, h);
  const In* doi = d_o.data() + ix.q(b, i, h);
  const double delta = dot(doi, o.data(), n);
  std::vector<double> acc(static_cast<std::size_t>(n), 0.0);
  for (int j = 0; j <= i; ++j) {
    const In* kj = k.data() + ix.kv(b, j, hk);
    const double ds = row.p[j] * (dot(doi, v.data() + ix.kv(b, j, hk), n) - delta);
    for (int x = 0; x < n; ++x) acc[x] += ds * value(kj[x]);
  }
  for (int x = 0; x < n; ++x) dq_row[x] = static_cast<AttentionReal<In>>(scale * acc[x]);
}

template <class In>
void attention_backward_dkv_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                                std::span<const In> v, std::span<const In> d_o, int b, int hk, int j,
                                std::span<AttentionReal<In>> dk_row, std::span<AttentionReal<In>> dv_row) {
  check_dims(dims, std::min(q.size(), d_o.size()), std::min(k.size(), v.size()));
  const Index ix{dims};
  const int n = dims.head_dim, group = dims.heads_q / dims.heads_kv;
  std::vector<double> dk_acc(static_cast<std::size_t>(n), 0.0), dv_acc(dk_acc.size(), 0.0);
  for (int h = hk * group; h < (hk + 1) * group; ++h)
    for (int i = j; i < dims.seq; ++i) {
      const RowSoftmax<In> row(dims, scale, q, k, b, h, i);
      const auto o = forward_row(dims, row, v, b, h);
      const In* qi = q.data() + ix.q(b, i, h);
      const In* doi = d_o.data() + ix.q(b, i, h);
      const double p = row.p[j];
      const double ds = p * (dot(doi, v.data() + ix.kv(b, j, hk), n) - dot(doi, o.data(), n));
      for (int x = 0; x < n; ++x) {
        dk_acc[x] += ds * value(qi[x]);
        dv_acc[x] += p * value(doi[x]);
      }
    }
  for (int x = 0; x < n; ++x) {
    dk_row[x] = static_cast<AttentionReal<In>>(scale * dk_acc[x]);
    dv_row[x] = static_cast<AttentionReal<In>>(dv_acc[x]);
  }
}

namespace {

/// The error scales of query row (b, h, i) from its softmax row and its O (stored or recomputed):
/// fills the row's o_mag `om` and dq_mag `qm`, and hands each key j its P_ij and
/// w_ij = |dS_ij| + P_ij Dabs_i through per_key(j, p, w), for the dK/dV sums.
template <class In, class O, class PerKey>
void error_scales_of_row(const AttentionDims& dims, double scale, const RowSoftmax<In>& row, std::span<const In> k,
                         std::span<const In> v, const In* doi, const O* oi, int b, int hk, double* om, double* qm,
                         PerKey&& per_key) {
  const Index ix{dims};
  const int n = dims.head_dim;
  double delta = 0, dabs = 0;
  for (int x = 0; x < n; ++x) {
    delta += value(doi[x]) * static_cast<double>(oi[x]);
    dabs += std::abs(value(doi[x]) * static_cast<double>(oi[x]));
  }
  for (int x = 0; x < n; ++x) om[x] = qm[x] = 0;
  for (std::size_t j = 0; j < row.p.size(); ++j) {
    const In* kj = k.data() + ix.kv(b, static_cast<int>(j), hk);
    const In* vj = v.data() + ix.kv(b, static_cast<int>(j), hk);
    const double p = row.p[j];
    const double w = std::abs(p * (dot(doi, vj, n) - delta)) + p * dabs;
    for (int x = 0; x < n; ++x) {
      om[x] += p * std::abs(value(vj[x]));
      qm[x] += scale * w * std::abs(value(kj[x]));
    }
    per_key(static_cast<int>(j), p, w);
  }
}

}  // namespace

template <class In>
void attention_error_scales(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                            std::span<const In> v, std::span<const AttentionReal<In>> o, std::span<const In> d_o,
                            std::span<double> o_mag, std::span<double> dq_mag, std::span<double> dk_mag,
                            std::span<double> dv_mag) {
  check_dims(dims, std::min({q.size(), o.size(), d_o.size(), o_mag.size(), dq_mag.size()}),
             std::min({k.size(), v.size(), dk_mag.size(), dv_mag.size()}));
  const Index ix{dims};
  const int n = dims.head_dim, group = dims.heads_q / dims.heads_kv;
  parallel_for(dims.batch * dims.heads_kv, [&](int task) {
    const int b = task / dims.heads_kv, hk = task % dims.heads_kv;
    for (int j = 0; j < dims.seq; ++j)
      for (int x = 0; x < n; ++x) dk_mag[ix.kv(b, j, hk) + x] = dv_mag[ix.kv(b, j, hk) + x] = 0;
    for (int h = hk * group; h < (hk + 1) * group; ++h)
      for (int i = 0; i < dims.seq; ++i) {
        const In* qi = q.data() + ix.q(b, i, h);
        const In* doi = d_o.data() + ix.q(b, i, h);
        error_scales_of_row(dims, scale, RowSoftmax<In>(dims, scale, q, k, b, h, i), k, v, doi, o.data() + ix.q(b, i, h),
                            b, hk, o_mag.data() + ix.q(b, i, h), dq_mag.data() + ix.q(b, i, h),
                            [&](int j, double p, double w) {
                              double* km = dk_mag.data() + ix.kv(b, j, hk);
                              double* vm = dv_mag.data() + ix.kv(b, j, hk);
                              for (int x = 0; x < n; ++x) {
                                km[x] += scale * w * std::abs(value(qi[x]));
                                vm[x] += p * std::abs(value(doi[x]));
                              }
                            });
      }
  });
}

template <class In>
void attention_error_scales_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                                std::span<const In> v, std::span<const In> d_o, int b, int h, int i,
                                std::span<double> o_mag_row, std::span<double> dq_mag_row) {
  check_dims(dims, std::min(q.size(), d_o.size()), std::min(k.size(), v.size()));
  const Index ix{dims};
  const RowSoftmax<In> row(dims, scale, q, k, b, h, i);
  const auto o = forward_row(dims, row, v, b, h);
  error_scales_of_row(dims, scale, row, k, v, d_o.data() + ix.q(b, i, h), o.data(), b, ix.kv_head(h), o_mag_row.data(),
                      dq_mag_row.data(), [](int, double, double) {});
}

#define OOM_INSTANTIATE_ATTENTION_REFERENCE(In)                                                                      \
  template AttentionReal<In> attention_forward_row<In>(const AttentionDims&, double, std::span<const In>,             \
                                                       std::span<const In>, std::span<const In>, int, int, int,       \
                                                       std::span<AttentionReal<In>>);                                 \
  template void attention_forward<In>(const AttentionDims&, double, std::span<const In>, std::span<const In>,         \
                                      std::span<const In>, std::span<AttentionReal<In>>, std::span<AttentionReal<In>>); \
  template void attention_backward<In>(const AttentionDims&, double, std::span<const In>, std::span<const In>,        \
                                       std::span<const In>, std::span<const AttentionReal<In>>,                       \
                                       std::span<const AttentionReal<In>>, std::span<const In>,                       \
                                       std::span<AttentionReal<In>>, std::span<AttentionReal<In>>,                    \
                                       std::span<AttentionReal<In>>);                                                 \
  template void attention_backward_dq_row<In>(const AttentionDims&, double, std::span<const In>, std::span<const In>, \
                                              std::span<const In>, std::span<const In>, int, int, int,                \
                                              std::span<AttentionReal<In>>);                                          \
  template void attention_backward_dkv_row<In>(const AttentionDims&, double, std::span<const In>,                     \
                                               std::span<const In>, std::span<const In>, std::span<const In>, int,    \
                                               int, int, std::span<AttentionReal<In>>, std::span<AttentionReal<In>>); \
  template void attention_error_scales<In>(const AttentionDims&, double, std::span<const In>, std::span<const In>,    \
                                           std::span<const In>, std::span<const AttentionReal<In>>,                  \
                                           std::span<const In>, std::span<double>, std::span<double>,                \
                                           std::span<double>, std::span<double>);                                    \
  template void attention_error_scales_row<In>(const AttentionDims&, double, std::span<const In>,                    \
                                               std::span<const In>, std::span<const In>, std::span<const In>, int,   \
                                               int, int, std::span<double>, std::span<double>);

OOM_INSTANTIATE_ATTENTION_REFERENCE(float)
OOM_INSTANTIATE_ATTENTION_REFERENCE(double)
OOM_INSTANTIATE_ATTENTION_REFERENCE(bf16)

}  // namespace oom::reference
