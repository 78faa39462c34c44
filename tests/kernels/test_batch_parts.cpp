// The split of the expert GEMMs' batch counts (src/kernels/batch_parts.hpp): every count covered
// exactly, in order, by parts from a small fixed set of sizes; and the depth of the deep row GEMMs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "kernels/batch_parts.hpp"

using oom::kernels::detail::batch_cap;
using oom::kernels::detail::for_each_batch_part;

TEST_CASE("a batch count splits into consecutive parts of recurring sizes") {
  std::set<std::size_t> sizes;
  for (std::size_t count = 0; count <= 5000; ++count) {
    CAPTURE(count);
    std::size_t next = 0;
    std::vector<std::size_t> parts;
    for_each_batch_part(count, [&](std::size_t first, std::size_t n) {
      CHECK(first == next);  // consecutive, in order, no gap or overlap
      CHECK(n >= 1);
      CHECK(n <= batch_cap);
      next = first + n;
      parts.push_back(n);
      sizes.insert(n);
    });
    CHECK(next == count);  // all of it
    // Full parts of the cap first, then strictly decreasing sizes.
    for (std::size_t i = 1; i < parts.size(); ++i)
      if (parts[i - 1] != batch_cap || parts[i] != batch_cap) CHECK(parts[i] < parts[i - 1]);
  }
  // 5001 different counts, 20 different part sizes: 256, 128, 64, 32, 16 and 1..15.
  CHECK(sizes.size() == 20);
  for (std::size_t n : {256u, 128u, 64u, 32u, 16u}) CHECK(sizes.count(n) == 1);
  for (std::size_t n = 1; n < 16; ++n) CHECK(sizes.count(n) == 1);
}

TEST_CASE("deep row depth: recurring values, at least 4 chunks, only when it saves rows") {
  using oom::kernels::detail::deep_row_depth;
  // No rows, or experts too small for 4 chunks: no depth.
  CHECK(deep_row_depth({}, 128) == 0);
  CHECK(deep_row_depth({0, 0, 0}, 128) == 0);
  CHECK(deep_row_depth({511, 300, 100}, 128) == 0);
  CHECK(deep_row_depth({2048, 2048}, 0) == 0);
  // Equal experts of a recurring size: that size, all of their rows deep.
  CHECK(deep_row_depth(std::vector<std::int64_t>(64, 2048), 128) == 2048);
  CHECK(deep_row_depth(std::vector<std::int64_t>(8, 1536), 128) == 1536);
  // The 5.13B routing at T = 16384 (64 experts, ~2048 +- 45 rows): a depth every expert reaches,
  // so no expert is left wholly to the chunks.
  std::vector<std::int64_t> rows;
  for (int e = 0; e < 64; ++e) rows.push_back(2048 + (e * 37 % 91) - 45);
  const auto d = deep_row_depth(rows, 128);
  CHECK(d >= 1536);
  CHECK(d <= *std::min_element(rows.begin(), rows.end()));
  // Every value it returns is q 2^p with q in 4..7 and at least 4 chunks.
  std::set<std::int64_t> seen;
  for (std::int64_t m = 0; m <= 9000; m += 7) {
    const auto v = deep_row_depth({m, m / 2 + 1, 3 * m / 4}, 128);
    if (v == 0) continue;
    CHECK(v >= 512);
    CHECK(v <= m);
    std::int64_t q = v;
    while (q >= 8 && q % 2 == 0) q /= 2;
    CHECK(q >= 4);
    CHECK(q < 8);
    seen.insert(v);
  }
  CHECK(seen.size() < 30);  // few shapes over 1286 routings
  // test_moe_kernels' deep-rows case relies on this depth: tails of 8, 18 and 5 rows after it.
  CHECK(deep_row_depth({520, 530, 517, 700, 0, 130, 5}, 128) == 512);
  // One big expert among small ones still goes deep: its rows dominate.
  CHECK(deep_row_depth({4096, 10, 20, 0}, 128) == 4096);
}

TEST_CASE("the weight gradients' FLOPs per byte of dW traffic, against the device's balance") {
  using oom::kernels::detail::device_balance;
  using oom::kernels::detail::weight_gradient_intensity;
  // 64 experts of 512 rows (the 5.13B model at T = 4096): 1024 FLOPs per element against 8 bytes
  // when adding, 4 when overwriting.
  const std::vector<std::int64_t> even(64, 512);
  CHECK(weight_gradient_intensity(even, true) == doctest::Approx(128.0));
  CHECK(weight_gradient_intensity(even, false) == doctest::Approx(256.0));
  // An expert without rows: no traffic when adding, its zeros written when overwriting.
  const std::vector<std::int64_t> one_idle = {512, 0};
  CHECK(weight_gradient_intensity(one_idle, true) == doctest::Approx(128.0));
  CHECK(weight_gradient_intensity(one_idle, false) == doctest::Approx(128.0));
  CHECK(weight_gradient_intensity({}, true) == 0.0);
  CHECK(weight_gradient_intensity({0, 0}, true) == 0.0);
  CHECK(weight_gradient_intensity({0, 0}, false) == 0.0);
  // Doubling the rows doubles the FLOPs, not the traffic.
  CHECK(weight_gradient_intensity(std::vector<std::int64_t>(64, 1024), true) == doctest::Approx(256.0));
  // An H100 SXM's attributes (132 SMs, 1.98 GHz, 2.619 GHz HBM3 on 5120 bits: 3.35 TB/s) at 4096
  // dense bf16 FLOPs per clock and SM: 1.07 PFLOP/s, 319 FLOPs per byte.
  CHECK(device_balance(132, 1.98e6, 2.619e6, 5120, 4096) == doctest::Approx(132 * 1.98e9 * 4096 / 3.352e12).epsilon(1e-3));
  CHECK(device_balance(132, 1.98e6, 0, 5120, 4096) == 0.0);
}

TEST_CASE("expert_gemm_min_bytes: each operand read once, each output written once, dW in fp32") {
  using oom::kernels::detail::expert_gemm_min_bytes;
  using P = oom::kernels::detail::ExpertGemmPass;
  // The 5.13B down pass at T = 4096 (32768 routed rows, 768 -> 2048, 64 experts of 1.57M weights):
  // forward h 50.3 MB + W 201.3 MB read, y 134.2 MB written.
  CHECK(expert_gemm_min_bytes(P::forward, 32768, 768, 2048, 64) == 2.0 * (32768 * 768 + 64 * 768 * 2048 + 32768 * 2048));
  CHECK(expert_gemm_min_bytes(P::forward, 32768, 768, 2048, 64) == 385875968.0);
  // Backward: dy 134.2 + W 201.3 + h 50.3 MB read, dh 50.3 MB and the fp32 dW 402.7 MB written.
  CHECK(expert_gemm_min_bytes(P::backward_overwrite, 32768, 768, 2048, 64) == 838860800.0);
  // Adding into dW reads it too: 402.7 MB more, half again the overwriting pass at this T.
  CHECK(expert_gemm_min_bytes(P::backward_accumulate, 32768, 768, 2048, 64) - expert_gemm_min_bytes(P::backward_overwrite, 32768, 768, 2048, 64) ==
        4.0 * 64 * 768 * 2048);
  // No rows: the weights are still read (forward, backward), and dW still written when overwriting.
  CHECK(expert_gemm_min_bytes(P::forward, 0, 768, 2048, 64) == 2.0 * 64 * 768 * 2048);
  CHECK(expert_gemm_min_bytes(P::backward_overwrite, 0, 768, 2048, 64) == 6.0 * 64 * 768 * 2048);
  // The rows' share grows with T, the weights' does not: at 8x the rows the forward moves
  // 8 x (h + y) + W.
  const double w = 2.0 * 64 * 768 * 2048;
  CHECK(expert_gemm_min_bytes(P::forward, 8 * 32768, 768, 2048, 64) - w ==
        8 * (expert_gemm_min_bytes(P::forward, 32768, 768, 2048, 64) - w));
}

TEST_CASE("memory_cap: the most a kernel moving its least traffic reaches against a compute-bound reference") {
  using oom::kernels::detail::expert_gemm_min_bytes;
  using oom::kernels::detail::memory_cap;
  using P = oom::kernels::detail::ExpertGemmPass;
  // Traffic shorter than the products: no cap.
  CHECK(memory_cap(1e-3, 1e9, 3e12) == 1.0);
  CHECK(memory_cap(1e-3, 3e9, 3e12) == 1.0);  // exactly as long
  // The 5.13B down backward at T = 4096 adding into fp32 dW on an H100 (2026-12-07: dense GEMM
  // 0.290 ms, a copy 2,996 GB/s): 1,241.5 MB take 0.414 ms, so no kernel passes 0.70x.
  const double adding = expert_gemm_min_bytes(P::backward_accumulate, 32768, 768, 2048, 64);
  CHECK(memory_cap(0.290e-3, adding, 2996e9) == doctest::Approx(0.290e-3 / (adding / 2996e9)));
  CHECK(memory_cap(0.290e-3, adding, 2996e9) == doctest::Approx(0.70).epsilon(0.01));
  // Overwriting moves 838.9 MB, 0.280 ms: under the dense time, so not capped.
  CHECK(memory_cap(0.290e-3, expert_gemm_min_bytes(P::backward_overwrite, 32768, 768, 2048, 64), 2996e9) == 1.0);
  // No measured bandwidth: no cap to give.
  CHECK(memory_cap(1e-3, 1e9, 0) == 0.0);
}
