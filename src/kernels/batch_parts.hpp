// How the row-chunked expert GEMMs split a batch count, how deep their per-expert row GEMMs go,
// when their weight gradients are bound by memory, and the least traffic a pass moves (host code,
// no CUDA).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace oom::kernels::detail {

inline constexpr std::size_t batch_granule = 16;
inline constexpr std::size_t batch_cap = 256;

/// Calls f(first, n) for consecutive parts of [0, count), in order, whose sizes recur from call to
/// call and stay small: parts of batch_cap, then the powers of two below it down to batch_granule,
/// then the rest (< batch_granule) in one part; nothing for count 0. Every count splits into sizes
/// from {256, 128, 64, 32, 16} and 1..15.
///
/// Why: cuBLAS chooses cublasGemmBatchedEx's algorithm on the host for every (shape, batch count)
/// it has not seen: 3.5-4 ms a call on the H200 at the 5.13B widths for counts up to 256,
/// 100-119 ms for 2047 or 2048 (the 32K backward), 15 us once seen (scripts/diag/
/// batched_issue.cu). The routing changes every step, so a count issued whole is often new.
template <class F>
void for_each_batch_part(std::size_t count, F&& f) {
  std::size_t done = 0;
  for (; count - done >= batch_cap; done += batch_cap) f(done, batch_cap);
  for (std::size_t part = batch_cap / 2; part >= batch_granule; part /= 2)
    if (count - done >= part) {
      f(done, part);
      done += part;
    }
  if (count > done) f(done, count - done);
}

/// The depth of row_chunked's deep row GEMMs (ExpertGemmStreamsOptions::deep_rows) for experts of
/// `rows` rows: the one that minimises a cost of rows computed, where a deep row costs 1 and a
/// chunked one chunked_row_cost (a 128-row batched GEMM ran the 5.13B dh at 0.71x of a dense
/// GEMM, a strided batched one over 2048-row experts at 1.00x: H200, 2026-12-01), the rows after
/// the deep ones rounded up to whole chunks (a remainder is computed as a whole chunk) and an
/// expert below one chunk, which runs alone, counted as its rows. Candidates are at least 4 chunks and of the form q 2^p, q in 4..7, so few
/// shapes recur step after step (cuBLAS chooses an algorithm on the host per shape it has not
/// seen, see for_each_batch_part). 0 when no depth beats chunking every row; ties go to the
/// smaller depth.
inline std::int64_t deep_row_depth(const std::vector<std::int64_t>& rows, std::int64_t chunk,
                                   double chunked_row_cost = 1.4) {
  if (chunk < 1) return 0;
  const auto chunked = [&](std::int64_t m) {  // an expert's rows, none of them deep
    const std::int64_t computed = m < chunk ? m : (m + chunk - 1) / chunk * chunk;
    return chunked_row_cost * static_cast<double>(std::max<std::int64_t>(computed, 0));
  };
  const auto tail = [&](std::int64_t m) {  // the rows after the deep ones: whole chunks, however few
    return chunked_row_cost * static_cast<double>((std::max<std::int64_t>(m, 0) + chunk - 1) / chunk * chunk);
  };
  double best_cost = 0;
  for (const auto m : rows) best_cost += chunked(m);
  std::int64_t best = 0;
  const std::int64_t top = rows.empty() ? 0 : *std::max_element(rows.begin(), rows.end());
  for (std::int64_t unit = 1; 4 * unit <= top; unit *= 2)
    for (std::int64_t q = 4; q < 8; ++q) {
      const std::int64_t d = q * unit;
      if (d < 4 * chunk || d > top) continue;
      double cost = 0;
      for (const auto m : rows) cost += m >= d ? static_cast<double>(d) + tail(m - d) : chunked(m);
      if (cost < best_cost) best_cost = cost, best = d;
    }
  return best;
}

/// The grouped weight gradients' FLOPs per byte of fp32 dW traffic (dW_e (+)= A_e^T B_e, the same
/// m x n for every expert, k = rows[e]): 2 rows[e] m n FLOPs per expert against 4 m n bytes
/// written, or 8 read and written when adding; an expert without rows costs its write (zeros)
/// when overwriting and nothing when adding. m n cancels. 0 when there is no traffic.
inline double weight_gradient_intensity(const std::vector<std::int64_t>& rows, bool accumulate) {
  double flops = 0, bytes = 0;
  for (const auto r : rows) {
    flops += 2.0 * static_cast<double>(std::max<std::int64_t>(r, 0));
    bytes += accumulate ? (r > 0 ? 8.0 : 0.0) : 4.0;
  }
  return bytes > 0 ? flops / bytes : 0.0;
}

/// The least device-memory traffic, in bytes, of one expert GEMM pass y_e (rows_e x out) = x_e
/// (rows_e x in) W_e (in x out) over `experts` experts and `rows` routed rows in all: every operand
/// read once and every output written once, activations and weights in bf16, the weight gradients
/// in fp32. Forward: x and every W read, y written. Backward: dy, every W and x read, dx and every
/// dW written, each dW read too when added into. The gate_up pass is in = hidden, out = 2 x
/// intermediate; the down pass in = intermediate, out = hidden. What a grouped launch moves beyond
/// this is re-reads that missed L2; over a copy's bytes per second it is the time below which no
/// kernel can run the pass (memory_cap below; bench_moe_kernels' "mem_cap").
enum class ExpertGemmPass { forward, backward_overwrite, backward_accumulate };
inline double expert_gemm_min_bytes(ExpertGemmPass pass, std::int64_t rows, std::int64_t in, std::int64_t out, std::int64_t experts) {
  const auto n = static_cast<double>(rows), d_in = static_cast<double>(in), d_out = static_cast<double>(out);
  const double weights = static_cast<double>(experts) * d_in * d_out, bf16 = 2, fp32 = 4;
  if (pass == ExpertGemmPass::forward) return bf16 * (n * d_in + weights + n * d_out);
  const double dw = fp32 * weights * (pass == ExpertGemmPass::backward_accumulate ? 2 : 1);
  return bf16 * (n * d_out + weights + 2 * n * d_in) + dw;
}

/// The highest speed, as a ratio to a compute-bound reference taking `reference_s` for the same
/// FLOPs, that a kernel moving at least `bytes` at `bytes_per_s` can reach: the reference's time
/// over the longer of it and the traffic's time, as if the products ran at the reference's rate the
/// whole time beside the traffic. 1 where the products take longer; 0 without a bandwidth.
inline double memory_cap(double reference_s, double bytes, double bytes_per_s) {
  if (bytes_per_s <= 0) return 0.0;
  return reference_s / std::max(reference_s, bytes / bytes_per_s);
}

/// A device's balance: its dense bf16 tensor FLOPs per second (SMs x clock x FLOPs per clock and
/// SM) over its memory's bytes per second (two transfers per memory clock over the bus), from the
/// attributes CUDA reports (clocks in kHz, the bus in bits). 0 when an attribute is missing.
/// Kernels whose FLOPs per byte fall below it are bound by memory.
inline double device_balance(int sms, double clock_khz, double memory_clock_khz, int bus_bits, double flops_per_clock_per_sm) {
  const double bytes_per_s = 2.0 * memory_clock_khz * 1e3 * bus_bits / 8.0;
  const double flops_per_s = sms * clock_khz * 1e3 * flops_per_clock_per_sm;
  return bytes_per_s > 0 ? flops_per_s / bytes_per_s : 0.0;
}

}  // namespace oom::kernels::detail
