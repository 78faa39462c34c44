// Expert GEMM throughput as a ratio to ONE dense cuBLAS GEMM of the same total FLOPs, measured in
// the same run: the dense GEMM is the same launcher with E = 1 and all N rows on that expert, so
// only the grouping differs; the dense run always uses the plain loop (one cublasGemmEx per GEMM),
// whatever the method measured. Used by the gpu test (one shape) and bench_moe_kernels (the sweep).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kernels/batch_parts.hpp"
#include "kernels/device_buffer.hpp"
#include "kernels/moe_test_util.hpp"
#include "kernels/timing_inputs.hpp"
#include "oom/kernels/expert_gemm.hpp"

namespace oom::test {

struct ExpertGemmRatio {
  std::string op;
  double grouped_ms = 0, dense_ms = 0, tflops = 0;  ///< tflops of the grouped run
  /// Diagnostics of the grouped run: the host's time to issue one call (median over the timed
  /// calls, the warm-up calls' first encodes and attribute settings left out: grouped_ms includes
  /// it where the GPU waited for it), and the GPU time per call of 10 calls issued back to back
  /// (the host's issue hidden behind the previous call's work where shorter).
  double host_us = 0, pipelined_ms = 0;
  /// The vendor on the same per-expert problems at its best case (with_batched only; else 0):
  /// cuBLAS strided batched GEMMs over equal rows per expert (N / E each), the same FLOPs and the
  /// same per-expert outputs as the grouped run, no routing skew.
  double batched_ms = 0;
  /// The least device-memory traffic the op moves (kernels::detail::expert_gemm_min_bytes).
  double min_bytes = 0;
  [[nodiscard]] double ratio() const { return dense_ms / grouped_ms; }
  /// The highest ratio() any kernel could reach where memory moves `bytes_per_s` (a copy's, measured
  /// in the same run): min_bytes at that rate against the dense GEMM's time, as if the products ran
  /// at the dense GEMM's rate the whole time beside the traffic. 1 where the products take longer.
  [[nodiscard]] double memory_cap(double bytes_per_s) const {
    return kernels::detail::memory_cap(dense_ms * 1e-3, min_bytes, bytes_per_s);
  }
  [[nodiscard]] double batched_ratio() const { return batched_ms > 0 ? dense_ms / batched_ms : 0; }
};

/// A method with its tuning, as the test and the benchmark report it.
struct ExpertGemmVariant {
  std::string name;
  kernels::ExpertGemmMethod method = kernels::ExpertGemmMethod::per_expert_loop;
  kernels::ExpertGemmStreamsOptions options{};
};

/// Every method once with its default tuning; `sweep` adds other stream counts and chunk sizes.
inline std::vector<ExpertGemmVariant> expert_gemm_variants(bool sweep) {
  using M = kernels::ExpertGemmMethod;
  // cublasGemmEx for every GEMM (the default, row_chunked, takes cuBLASLt's bucketed algorithms);
  // chunk128bw: the weight gradients' common rows batched (ExpertGemmStreamsOptions::
  // batched_weight_gradients, off by default: slower on the H200)
  const kernels::ExpertGemmStreamsOptions gemm_ex{.bucketed_algorithms = false};
  std::vector<ExpertGemmVariant> v = {{"loop", M::per_expert_loop, gemm_ex},
                                      {"grouped", M::grouped_batched, gemm_ex},
                                      {"streams4", M::multi_stream, gemm_ex},
                                      {"chunk128ex", M::row_chunked, gemm_ex},
                                      {"chunk128bw", M::row_chunked, {.batched_weight_gradients = true}},
                                      {"chunk128", M::row_chunked, {}},
                                      // the row GEMMs as cuBLAS batched chunks (never the
                                      // grouped wgmma launch chunk128 takes where it applies)
                                      {"chunk128nr", M::row_chunked, {.wgmma_rows = false}},
                                      // the grouped wgmma row GEMMs one block per tile, not in
                                      // 2-CTA clusters sharing the weights' tiles (paired_rows)
                                      {"chunk128up", M::row_chunked, {.paired_rows = false}},
                                      // those chunks without the deep row GEMMs
                                      {"chunk128nd", M::row_chunked, {.deep_rows = false, .wgmma_rows = false}},
                                      // every weight gradient a cuBLAS GEMM (never the grouped
                                      // wgmma launch chunk128 takes where it applies)
                                      {"chunk128nw", M::row_chunked, {.wgmma_weight_gradients = false}},
                                      // the grouped wgmma dW after the row GEMMs, on the caller's
                                      // stream (chunk128 runs it beside them on a side stream)
                                      {"chunk128sr", M::row_chunked, {.overlap_weight_gradients = false}},
                                      // beside them, the row GEMMs never split (row_sm_share)
                                      {"chunk128ns", M::row_chunked, {.row_sm_share = 1}}};
  if (sweep) {
    v.push_back({"streams2", M::multi_stream, {.streams = 2}});
    v.push_back({"streams8", M::multi_stream, {.streams = 8}});
    v.push_back({"chunk256", M::row_chunked, {.row_chunk = 256}});
    v.push_back({"chunk512", M::row_chunked, {.row_chunk = 512}});
    v.push_back({"chunk128s8", M::row_chunked, {.streams = 8}});
    v.push_back({"share30", M::row_chunked, {.row_sm_share = 0.3}});
    v.push_back({"share50", M::row_chunked, {.row_sm_share = 0.5}});
  }
  return v;
}

/// The warm-up calls time_ms makes before the timed ones, here named: the host's issue time is
/// read from the calls after them.
inline constexpr int kWarmupCalls = 2;

/// The rounds in which measure_expert_gemm_ratio times the grouped run, the dense GEMM and the
/// vendor's batched GEMMs by turns.
inline constexpr int kRatioRounds = 3;

/// The median of values[skip..] (0 where none are left).
inline double median_after(std::vector<double> values, int skip) {
  if (static_cast<std::size_t>(skip) >= values.size()) return 0;
  values.erase(values.begin(), values.begin() + skip);
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

/// Times the four expert GEMM launchers for `tokens` tokens routed uniformly at random (k of E).
inline std::vector<ExpertGemmRatio> measure_expert_gemm_ratio(std::int64_t tokens, std::int64_t hidden, std::int64_t inter,
                                                              std::int64_t experts, std::int64_t top_k,
                                                              const ExpertGemmVariant& variant, int repeats = 10,
                                                              bool with_batched = false) {
  namespace k = oom::kernels;
  const std::int64_t N = tokens * top_k, H = hidden, I = inter, E = experts;
  std::vector<std::int32_t> counts(static_cast<std::size_t>(E), 0);
  for (const auto e : random_routing(tokens, top_k, E, 42)) ++counts[static_cast<std::size_t>(e)];
  const std::vector<std::int32_t> dense_counts = {static_cast<std::int32_t>(N)};
  const k::ExpertGemmShape s{.hidden = H, .intermediate = I, .experts = E, .rows = N};
  const k::ExpertGemmShape d{.hidden = H, .intermediate = I, .experts = 1, .rows = N};
  DeviceBuffer<bf16> x(N * H), wgu(E * 2 * I * H), gu(N * 2 * I), h(N * I), wd(E * H * I), y(N * H);
  DeviceBuffer<float> dwgu(E * 2 * I * H), dwd(E * H * I);
  // Random operands (timing_inputs.hpp: constant data runs products faster than real data does):
  // activations and their gradients N(0, 1), weights N(0, 0.02) as the models initialise them.
  std::uint64_t seed = 1000;
  for (auto* b : {&x, &gu, &h, &y}) fill_random_bf16(b->get(), b->size(), seed++);
  for (auto* b : {&wgu, &wd}) fill_random_bf16(b->get(), b->size(), seed++, 0.02f);
  dwgu.zero();
  dwd.zero();
  k::ExpertGemmStreams streams(variant.options);
  DeviceBuffer<std::uint8_t> ws(k::expert_gemm_workspace_bytes(s, variant.method, &streams));
  Blas blas;
  cudaStream_t stream;
  OOM_CUDA_CHECK(cudaStreamCreate(&stream));
  const auto fwd_gu = [&](const k::ExpertGemmShape& sh, const std::int32_t* c, k::ExpertGemmMethod method) {
    return k::expert_gate_up_forward(blas.get(), stream, sh, c, x.get(), wgu.get(), gu.get(), method, ws.get(), ws.size(), &streams);
  };
  const auto fwd_down = [&](const k::ExpertGemmShape& sh, const std::int32_t* c, k::ExpertGemmMethod method) {
    return k::expert_down_forward(blas.get(), stream, sh, c, h.get(), wd.get(), y.get(), method, ws.get(), ws.size(), &streams);
  };
  // Backward reads y as dy and gu as d gate_up; it writes h (dh) and x (dx): values are irrelevant here.
  const auto bwd_down = [&](k::GradWrite write) {
    return [&, write](const k::ExpertGemmShape& sh, const std::int32_t* c, k::ExpertGemmMethod method) {
      return k::expert_down_backward(blas.get(), stream, sh, c, y.get(), h.get(), wd.get(), h.get(), dwd.get(), method, ws.get(),
                                     ws.size(), &streams, write);
    };
  };
  const auto bwd_gu = [&](k::GradWrite write) {
    return [&, write](const k::ExpertGemmShape& sh, const std::int32_t* c, k::ExpertGemmMethod method) {
      return k::expert_gate_up_backward(blas.get(), stream, sh, c, gu.get(), x.get(), wgu.get(), x.get(), dwgu.get(), method,
                                        ws.get(), ws.size(), &streams, write);
    };
  };
  // The batched comparison: row-major C = op(A) op(B) per expert e as one column-major strided
  // batched call C^T = op(B)^T op(A)^T (R = N / E rows each).
  const int R = static_cast<int>(N / E);
  const auto batched = [&](bool ta, bool tb, int m, int n, int kk, const bf16* a, int lda, std::int64_t sa, const bf16* b, int ldb,
                           std::int64_t sb, void* c, cudaDataType ct, int ldc, std::int64_t sc, float beta) {
    const float alpha = 1.0f;
    OOM_CUBLAS_CHECK(cublasSetStream(blas.get(), stream));  // (the launchers move the handle to their streams)
    OOM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(blas.get(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, kk,
                                                &alpha, b, CUDA_R_16BF, ldb, sb, a, CUDA_R_16BF, lda, sa, &beta, c, ct, ldc, sc,
                                                static_cast<int>(E), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  const int hh = static_cast<int>(H), i2 = static_cast<int>(2 * I), i1 = static_cast<int>(I);
  const auto batched_fwd_gu = [&] {
    batched(false, true, R, i2, hh, x.get(), hh, R * H, wgu.get(), hh, 2 * I * H, gu.get(), CUDA_R_16BF, i2, R * 2 * I, 0.f);
  };
  const auto batched_fwd_down = [&] {
    batched(false, true, R, hh, i1, h.get(), i1, R * I, wd.get(), i1, H * I, y.get(), CUDA_R_16BF, hh, R * H, 0.f);
  };
  const auto batched_bwd_down = [&](k::GradWrite write) {  // dh = dy Wd, dWd (+)= dy^T h
    return [&, write] {
      batched(false, false, R, i1, hh, y.get(), hh, R * H, wd.get(), i1, H * I, h.get(), CUDA_R_16BF, i1, R * I, 0.f);
      batched(true, false, hh, i1, R, y.get(), hh, R * H, h.get(), i1, R * I, dwd.get(), CUDA_R_32F, i1, H * I,
              write == k::GradWrite::accumulate ? 1.f : 0.f);
    };
  };
  const auto batched_bwd_gu = [&](k::GradWrite write) {  // dx = dgu Wgu, dWgu (+)= dgu^T x
    return [&, write] {
      batched(false, false, R, hh, i2, gu.get(), i2, R * 2 * I, wgu.get(), hh, 2 * I * H, x.get(), CUDA_R_16BF, hh, R * H, 0.f);
      batched(true, false, i2, hh, R, gu.get(), i2, R * 2 * I, x.get(), hh, R * H, dwgu.get(), CUDA_R_32F, hh, 2 * I * H,
              write == k::GradWrite::accumulate ? 1.f : 0.f);
    };
  };
  const double f_gu = 2.0 * N * 2 * I * H, f_down = 2.0 * N * H * I;
  struct Op {
    const char* name;
    std::function<cudaError_t(const k::ExpertGemmShape&, const std::int32_t*, k::ExpertGemmMethod)> run;
    double flops;
    std::function<void()> batched;  ///< the same work as cuBLAS strided batched GEMMs over equal rows
    double min_bytes;
  };
  // The backward twice: dW += (a step's later chunks) and dW = (its first: GradWrite::overwrite),
  // the dense GEMM the same way.
  using GW = k::GradWrite;
  using P = k::detail::ExpertGemmPass;
  const auto gu_bytes = [&](P p) { return k::detail::expert_gemm_min_bytes(p, N, H, 2 * I, E); };
  const auto down_bytes = [&](P p) { return k::detail::expert_gemm_min_bytes(p, N, I, H, E); };
  const Op ops[] = {
      {"fwd gate_up", fwd_gu, f_gu, batched_fwd_gu, gu_bytes(P::forward)},
      {"fwd down", fwd_down, f_down, batched_fwd_down, down_bytes(P::forward)},
      {"bwd down (dh+dW)", bwd_down(GW::accumulate), 2 * f_down, batched_bwd_down(GW::accumulate), down_bytes(P::backward_accumulate)},
      {"bwd gate_up (dx+dW)", bwd_gu(GW::accumulate), 2 * f_gu, batched_bwd_gu(GW::accumulate), gu_bytes(P::backward_accumulate)},
      {"bwd down (dh+dW=)", bwd_down(GW::overwrite), 2 * f_down, batched_bwd_down(GW::overwrite), down_bytes(P::backward_overwrite)},
      {"bwd gate_up (dx+dW=)", bwd_gu(GW::overwrite), 2 * f_gu, batched_bwd_gu(GW::overwrite), gu_bytes(P::backward_overwrite)}};
  std::vector<ExpertGemmRatio> out;
  for (const Op& op : ops) {
    ExpertGemmRatio r;
    r.op = op.name;
    r.min_bytes = op.min_bytes;
    // The grouped run, the dense GEMM and the vendor's batched one take turns over kRatioRounds
    // rounds, and each figure is the median of its rounds: a clock that drifts while one op is
    // timed (the H100's, under its power limit on random data, moved the dense GEMM by 9% between
    // variants of one call, 2026-12-07) then moves all three alike instead of only the one timed
    // while it drifted.
    std::vector<double> host_us;  // the first round's calls, time_ms' warm-up calls first
    std::vector<double> grouped, dense, batched;
    for (int round = 0; round < kRatioRounds; ++round) {
      grouped.push_back(time_ms(
          [&](cudaStream_t) {
            const auto t0 = std::chrono::steady_clock::now();
            OOM_CUDA_CHECK(op.run(s, counts.data(), variant.method));
            if (round == 0) host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
          },
          stream, repeats, kWarmupCalls));
      dense.push_back(time_ms(
          [&](cudaStream_t) { OOM_CUDA_CHECK(op.run(d, dense_counts.data(), k::ExpertGemmMethod::per_expert_loop)); }, stream,
          repeats));
      if (with_batched && N % E == 0) batched.push_back(time_ms([&](cudaStream_t) { op.batched(); }, stream, repeats));
    }
    r.grouped_ms = median_after(grouped, 0);
    r.dense_ms = median_after(dense, 0);
    r.batched_ms = median_after(batched, 0);
    r.host_us = median_after(host_us, kWarmupCalls);
    r.pipelined_ms = time_ms(
                         [&](cudaStream_t) {
                           for (int i = 0; i < 10; ++i) OOM_CUDA_CHECK(op.run(s, counts.data(), variant.method));
                         },
                         stream, 3, 1) /
                     10;
    r.tflops = op.flops / (r.grouped_ms * 1e-3) / 1e12;
    out.push_back(r);
  }
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  return out;
}

}  // namespace oom::test
