// Helpers of the GPU attention tests (test_attention.cpp, test_attention_backward_wgmma.cu): bf16
// inputs, Q/K/V (or dQ/dK/dV) as separate tensors or packed column views on the device, strided
// upload/download, and the per-element bf16 error bound of the checks.
#pragma once

#include <cuda_runtime_api.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
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

}  // namespace oom::test::attention
