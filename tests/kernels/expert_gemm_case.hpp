// The expert GEMM launchers' inputs at small widths the grouped wgmma kernels take (H = I = 256:
// every output width a multiple of 256, every reduction of 64; 8 experts, top-2, 300 tokens, the
// last expert without rows), from one seed: shared by test_grouped_rows and test_grouped_wgrad.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/moe_test_util.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/reference/moe.hpp"
#include "oom/reference/permute.hpp"
#include "support/compare.hpp"

namespace oom::test {

struct ExpertGemmCase {
  static constexpr std::int64_t H = 256, I = 256, E = 8, K = 2, T = 300, dead = 1, N = T * K;
  kernels::ExpertGemmShape s{.hidden = H, .intermediate = I, .experts = E, .rows = N};
  reference::ExpertShape rs{.hidden = H, .intermediate = I, .experts = E};
  std::vector<std::int32_t> counts;  ///< per expert, from the routing of seed
  Bf16Data x, h;                     ///< x_perm (N, H), the SwiGLU output (N, I)
  Bf16Data wd, wgu;                  ///< w_down (E, H, I), w_gate_up (E, 2I, H)
  Bf16Data dy, dgu;                  ///< gradients of the down output (N, H) and of gate_up (N, 2I)
  explicit ExpertGemmCase(std::uint64_t seed)
      : counts(reference::permute_plan(random_routing(T, K, E - dead, seed), T, K, E).expert_counts),
        x(random_normal(static_cast<std::size_t>(N * H), seed + 1)),
        h(random_normal(static_cast<std::size_t>(N * I), seed + 2)),
        wd(random_normal(static_cast<std::size_t>(E * H * I), seed + 3, 0.1f)),
        wgu(random_normal(static_cast<std::size_t>(E * 2 * I * H), seed + 4, 0.1f)),
        dy(random_normal(static_cast<std::size_t>(N * H), seed + 5)),
        dgu(random_normal(static_cast<std::size_t>(N * 2 * I), seed + 6)) {}
};

}  // namespace oom::test
