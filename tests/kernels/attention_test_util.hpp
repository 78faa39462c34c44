// Helpers of the GPU attention tests (test_attention.cpp, test_attention_backward_wgmma.cpp): bf16
// inputs, Q/K/V (or dQ/dK/dV) as separate tensors or packed column views on the device, strided
// upload/download, the per-element bf16 error bound of the checks, and one case's inputs with the
// CPU reference and the chunked GPU forward (Prepared).
#pragma once

#include <cuda_runtime_api.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "oom/kernels/attention.hpp"
#include "oom/reference/attention.hpp"
#include "support/compare.hpp"

namespace oom::test::attention {

using oom::bf16;
using oom::kernels::TokenRows;
using oom::reference::AttentionDims;

inline double relative_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<float> to_float(const std::vector<bf16>& x) {
  std::vector<float> f(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) f[i] = oom::to_float(x[i]);
  return f;
}

/// |got - ref| <= slack·u·mag + 2u·|ref| per element, u = 2^-8 the unit roundoff of bf16: the
/// kernel rounds P and dS to bf16 for its tensor-core products (as FA2 does) and its outputs to bf16;
/// `mag` is the reference's sum of the magnitudes those roundings scale (attention_error_scales).
inline void check_bounded(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<double>& mag,
                   double slack, const char* what) {
  constexpr double u = 1.0 / 256;
  REQUIRE(got.size() == ref.size());
  REQUIRE(mag.size() == ref.size());
  std::size_t bad = 0;
  std::string first;
  double worst = 0;  // largest error as a fraction of its bound
  for (std::size_t x = 0; x < ref.size(); ++x) {
    const double bound = slack * u * mag[x] + 2 * u * std::abs(static_cast<double>(ref[x])) + 1e-7;
    const double err = std::abs(static_cast<double>(got[x]) - ref[x]);
    if (std::isfinite(err)) worst = std::max(worst, err / bound);
    if (!(err <= bound)) {
      if (++bad <= 5)
        first += std::string(what) + "[" + std::to_string(x) + "]: got " + std::to_string(got[x]) + " expected " +
                 std::to_string(ref[x]) + " bound " + std::to_string(bound) + "\n";
    }
  }
  INFO(std::string(what) << ": " << bad << " elements outside their bound; worst error/bound " << worst << "\n" << first);
  CHECK(bad == 0);
}

/// Fresh bf16 inputs, N(0, 1) rounded (Q, K at unit variance make scale * q.k ~ N(0, 1)).
inline std::vector<bf16> random_bf16(std::size_t n, std::uint64_t seed) {
  const auto f = oom::test::random_normal(n, seed);
  std::vector<bf16> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = oom::to_bf16(f[i]);
  return b;
}

/// Q, K, V (or dQ, dK, dV) on the device: three contiguous tensors, or column views into one
/// packed (B*S, (Hq + 2 Hkv) * D) buffer as a fused QKV projection produces.
struct DeviceQkv {
  DeviceBuffer<bf16> packed, q_buf, k_buf, v_buf;
  TokenRows<bf16> q, k, v;
  DeviceQkv(const AttentionDims& d, bool is_packed) {
    const std::int64_t s = d.seq, hd = d.head_dim;
    if (is_packed) {
      const std::int64_t row = (d.heads_q + 2 * d.heads_kv) * hd;
      packed = DeviceBuffer<bf16>(static_cast<std::size_t>(d.batch * s * row));
      q = {packed.get(), s * row, row};
      k = {packed.get() + d.heads_q * hd, s * row, row};
      v = {packed.get() + (d.heads_q + d.heads_kv) * hd, s * row, row};
    } else {
      q_buf = DeviceBuffer<bf16>(static_cast<std::size_t>(d.batch * s * d.heads_q * hd));
      k_buf = DeviceBuffer<bf16>(static_cast<std::size_t>(d.batch * s * d.heads_kv * hd));
      v_buf = DeviceBuffer<bf16>(k_buf.size());
      q = {q_buf.get(), s * d.heads_q * hd, d.heads_q * hd};
      k = {k_buf.get(), s * d.heads_kv * hd, d.heads_kv * hd};
      v = {v_buf.get(), s * d.heads_kv * hd, d.heads_kv * hd};
    }
  }
  void poison() {
    for (auto* b : {&packed, &q_buf, &k_buf, &v_buf}) b->poison();
  }
};

inline TokenRows<const bf16> as_const(TokenRows<bf16> r) { return {r.data, r.batch_stride, r.token_stride}; }

/// Copies a contiguous host (B, S, H, D) tensor into strided device rows, and back.
inline void upload(TokenRows<bf16> dst, const std::vector<bf16>& host, const AttentionDims& d, int heads) {
  const std::size_t width = static_cast<std::size_t>(heads) * d.head_dim * sizeof(bf16);
  for (int b = 0; b < d.batch; ++b)
    OOM_CUDA_CHECK(cudaMemcpy2D(dst.data + b * dst.batch_stride, dst.token_stride * sizeof(bf16),
                                host.data() + static_cast<std::size_t>(b) * d.seq * heads * d.head_dim, width, width,
                                static_cast<std::size_t>(d.seq), cudaMemcpyHostToDevice));
}
inline std::vector<float> download(TokenRows<bf16> src, const AttentionDims& d, int heads) {
  std::vector<bf16> host(static_cast<std::size_t>(d.batch) * d.seq * heads * d.head_dim);
  const std::size_t width = static_cast<std::size_t>(heads) * d.head_dim * sizeof(bf16);
  OOM_CUDA_CHECK(cudaDeviceSynchronize());
  for (int b = 0; b < d.batch; ++b)
    OOM_CUDA_CHECK(cudaMemcpy2D(host.data() + static_cast<std::size_t>(b) * d.seq * heads * d.head_dim, width,
                                src.data + b * src.batch_stride, src.token_stride * sizeof(bf16), width,
                                static_cast<std::size_t>(d.seq), cudaMemcpyDeviceToHost));
  return to_float(host);
}
inline std::vector<float> download(const DeviceBuffer<float>& b) { return b.download(); }

/// Uniform on [-sqrt(3), sqrt(3)] (unit variance) from a counter hash, on all threads: 10 GB of
/// inputs in seconds.
inline std::vector<bf16> hashed_bf16(std::size_t n, std::uint64_t seed) {
  std::vector<bf16> out(n);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (std::size_t i = n * w / threads; i < n * (w + 1) / threads; ++i) {
        std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;  // splitmix64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const double u = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
        out[i] = oom::to_bf16(static_cast<float>((2 * u - 1) * 1.7320508075688772));
      }
    });
  for (auto& t : pool) t.join();
  return out;
}

/// One shape's random bf16 inputs on the device, the CPU reference's O, LSE and gradients on exactly
/// those bf16 values with their error scales, and the GPU forward over the query chunks (first to
/// last, as the planner runs them, through kernels::attention_forward): where the backward checks
/// start.
struct Prepared {
  AttentionDims d;
  float scale;
  std::vector<int> chunk_starts;
  std::vector<float> o_ref, lse_ref, dq_ref, dk_ref, dv_ref;
  std::vector<double> o_mag, dq_mag, dk_mag, dv_mag;
  DeviceQkv in;
  DeviceBuffer<bf16> o_buf, do_buf;
  DeviceBuffer<float> lse;
  TokenRows<bf16> o;
  TokenRows<const bf16> dor;

  Prepared(const AttentionDims& dims, bool packed, std::uint64_t seed, std::vector<int> starts)
      : d(dims), scale(1.0f / std::sqrt(static_cast<float>(dims.head_dim))), chunk_starts(std::move(starts)),
        in(dims, packed) {
    const std::size_t nq = static_cast<std::size_t>(d.batch) * d.seq * d.heads_q * d.head_dim;
    const std::size_t nkv = static_cast<std::size_t>(d.batch) * d.seq * d.heads_kv * d.head_dim;
    const std::size_t nlse = static_cast<std::size_t>(d.batch) * d.heads_q * d.seq;
    const auto q = random_bf16(nq, seed), k = random_bf16(nkv, seed + 1), v = random_bf16(nkv, seed + 2);
    const auto d_o = random_bf16(nq, seed + 3);

    const auto qf = to_float(q), kf = to_float(k), vf = to_float(v), dof = to_float(d_o);
    o_ref.resize(nq), lse_ref.resize(nlse), dq_ref.resize(nq), dk_ref.resize(nkv), dv_ref.resize(nkv);
    reference::attention_forward<float>(d, scale, qf, kf, vf, o_ref, lse_ref);
    reference::attention_backward<float>(d, scale, qf, kf, vf, o_ref, lse_ref, dof, dq_ref, dk_ref, dv_ref);
    o_mag.resize(nq), dq_mag.resize(nq), dk_mag.resize(nkv), dv_mag.resize(nkv);
    reference::attention_error_scales<float>(d, scale, qf, kf, vf, o_ref, dof, o_mag, dq_mag, dk_mag, dv_mag);

    upload(in.q, q, d, d.heads_q);
    upload(in.k, k, d, d.heads_kv);
    upload(in.v, v, d, d.heads_kv);
    o_buf = DeviceBuffer<bf16>(nq);
    do_buf = DeviceBuffer<bf16>(d_o);
    lse = DeviceBuffer<float>(nlse);
    const std::int64_t q_row = static_cast<std::int64_t>(d.heads_q) * d.head_dim;
    o = {o_buf.get(), d.seq * q_row, q_row};
    dor = {do_buf.get(), d.seq * q_row, q_row};
    for (std::size_t ch = 0; ch < chunk_starts.size(); ++ch)
      OOM_CUDA_CHECK(
          kernels::attention_forward(problem(ch), as_const(in.q), as_const(in.k), as_const(in.v), o, lse.get(), nullptr));
  }

  [[nodiscard]] kernels::AttentionProblem problem(std::size_t chunk) const {
    kernels::AttentionProblem p{.batch = d.batch, .seq = d.seq, .heads_q = d.heads_q, .heads_kv = d.heads_kv,
                                .head_dim = d.head_dim, .softmax_scale = scale};
    p.q_begin = chunk_starts[chunk];
    p.q_end = chunk + 1 < chunk_starts.size() ? chunk_starts[chunk + 1] : d.seq;
    REQUIRE(kernels::attention_can_implement(p));
    return p;
  }

  /// The workspace `bytes(problem)` asks for, at most over the chunks.
  template <class Bytes>
  [[nodiscard]] std::size_t workspace_bytes(Bytes&& bytes) const {
    std::size_t n = 0;
    for (std::size_t ch = 0; ch < chunk_starts.size(); ++ch) n = std::max(n, bytes(problem(ch)));
    return n;
  }

  /// `backward` (attention_backward's signature) over the chunks, last to first, dK/dV accumulated
  /// after the first; `grad` poisoned before. Returns dQ, dK, dV on the host.
  template <class Backward>
  auto backward(Backward&& fn, DeviceQkv& grad, void* ws, std::size_t ws_bytes) const {
    grad.poison();
    for (std::size_t ch = chunk_starts.size(); ch-- > 0;)
      OOM_CUDA_CHECK(fn(problem(ch), as_const(in.q), as_const(in.k), as_const(in.v), as_const(o), dor, lse.get(), grad.q,
                        grad.k, grad.v, /*accumulate_dkv=*/ch + 1 < chunk_starts.size(), ws, ws_bytes, nullptr));
    return std::tuple{download(grad.q, d, d.heads_q), download(grad.k, d, d.heads_kv), download(grad.v, d, d.heads_kv)};
  }
};

}  // namespace oom::test::attention
