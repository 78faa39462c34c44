// cost_model: predicts each operation's time on each resource of the machine (GPU compute, the two
// PCIe directions, the CPU pool, the network), from constants measured on that machine.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"

namespace oom {

enum class Resource : unsigned char { gpu_compute, h2d, d2h, cpu, network };
inline constexpr int resource_count = 5;

const char* to_string(Resource r) noexcept;

/// Seconds an operation occupies each resource. Resources run concurrently, so an operation
/// alone takes the maximum; the simulator overlaps operations on different resources.
struct ResourceTimes {
  std::array<double, resource_count> seconds{};

  [[nodiscard]] constexpr double& operator[](Resource r) { return seconds[static_cast<std::size_t>(r)]; }
  [[nodiscard]] constexpr double operator[](Resource r) const { return seconds[static_cast<std::size_t>(r)]; }
  [[nodiscard]] constexpr double longest() const {
    double m = 0;
    for (double s : seconds) m = s > m ? s : m;
    return m;
  }
  friend constexpr bool operator==(const ResourceTimes&, const ResourceTimes&) = default;
};

enum class OpKind : unsigned char {
  gemm,                ///< m×n×k (× batch) matrix product
  attention_forward,   ///< causal attention over `m` query tokens, `n` keys, `k` head dim, `batch` heads
  attention_backward,
  memory_bound,        ///< an elementwise / reduction kernel moving `bytes` through HBM
  copy_h2d,            ///< `bytes` host -> device
  copy_d2h,            ///< `bytes` device -> host
  cpu_optimizer,       ///< CPU AdamW over `elements` parameters, while `bytes` of host<->device copies
                       ///< stream through host memory (they share its bandwidth)
  gpu_optimizer,       ///< GPU AdamW over `elements` parameters
  all_to_all,          ///< `bytes` per GPU
  all_reduce,          ///< `bytes` per GPU
  /// The gated delta rule's recurrence (the hybrid models' linear attention) over `m` tokens in
  /// `batch` heads, each head's state `k` x `n` (key dim x value dim) updated once per token.
  delta_rule_forward,
  delta_rule_backward,
};

struct Operation {
  OpKind kind = OpKind::gemm;
  std::uint64_t m = 0, n = 0, k = 0, batch = 1;
  std::uint64_t elements = 0;
  Bytes bytes;
  DType dtype = DType::bf16;

  static constexpr Operation gemm(std::uint64_t m, std::uint64_t n, std::uint64_t k, std::uint64_t batch = 1) {
    return {OpKind::gemm, m, n, k, batch, 0, Bytes{}, DType::bf16};
  }
  static constexpr Operation attention(bool backward, std::uint64_t queries, std::uint64_t n, std::uint64_t head_dim,
                                       std::uint64_t heads) {
    return {backward ? OpKind::attention_backward : OpKind::attention_forward, queries, n, head_dim, heads, 0, Bytes{},
            DType::bf16};
  }
  /// The gated delta rule over `tokens` rows (all sequences' together) of `heads` value heads of
  /// k_dim x v_dim states, `sequences` of them side by side (the recurrences run in parallel:
  /// sequences x heads of them; kept in `elements`).
  static constexpr Operation delta_rule(bool backward, std::uint64_t tokens, std::uint64_t k_dim, std::uint64_t v_dim,
                                        std::uint64_t heads, std::uint64_t sequences = 1) {
    return {backward ? OpKind::delta_rule_backward : OpKind::delta_rule_forward, tokens, v_dim, k_dim, heads, sequences, Bytes{},
            DType::bf16};
  }
  /// Ops that move `bytes`: memory_bound, copies, collectives.
  static constexpr Operation moving(OpKind kind, Bytes bytes) { return {kind, 0, 0, 0, 1, 0, bytes, DType::bf16}; }
  /// Ops over `elements` parameters: the optimizers, their AdamW moments kept as `moments` (fp32 or
  /// bf16: in `dtype`); `concurrent` bytes of other traffic through host memory meanwhile
  /// (cpu_optimizer: copies, a gradient check's read).
  static constexpr Operation over(OpKind kind, std::uint64_t elements, Bytes concurrent = Bytes{}, DType moments = DType::fp32) {
    return {kind, 0, 0, 0, 1, elements, concurrent, moments};
  }

  /// Recurrences a delta_rule op runs side by side: sequences x heads (0 for others).
  [[nodiscard]] constexpr std::uint64_t recurrences() const {
    return kind == OpKind::delta_rule_forward || kind == OpKind::delta_rule_backward ? std::max<std::uint64_t>(elements, 1) * batch : 0;
  }
  /// State elements a delta_rule op updates: tokens x heads x k x n (0 for others).
  [[nodiscard]] constexpr double state_updates() const {
    return kind == OpKind::delta_rule_forward || kind == OpKind::delta_rule_backward
               ? static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * static_cast<double>(batch)
               : 0.0;
  }

  /// FLOPs of a gemm, attention or delta_rule op, 2 per multiply-add; 0 for others. Attention forward is
  /// two products (QK^T and PV), 4·m·n·k per head, of which causal masking computes half; its
  /// backward does 2.5 times the forward's work (the usual 3.5× for forward plus backward).
  [[nodiscard]] constexpr double flops() const {
    switch (kind) {
      case OpKind::gemm: return 2.0 * static_cast<double>(m) * n * k * batch;
      case OpKind::attention_forward: return 0.5 * 4.0 * static_cast<double>(m) * n * k * batch;
      case OpKind::attention_backward: return 2.5 * 0.5 * 4.0 * static_cast<double>(m) * n * k * batch;
      // Per token and head, k x n state: read it against k (2kn), update it (2kn), read it out
      // against q (2kn); the backward about 2.5x, as attention's.
      case OpKind::delta_rule_forward: return 6.0 * state_updates();
      case OpKind::delta_rule_backward: return 2.5 * 6.0 * state_updates();
      default: return 0;
    }
  }
};

/// Requirements, for `const M& model` and `const Operation& op`:
///   1. `model.predict(op)` returns ResourceTimes: non-negative, and zero on resources the op
///      does not use (a copy_h2d uses only h2d);
///   2. monotone: more work (larger m, n, k, batch, elements or bytes) never predicts less time
///      (a delta_rule op's elements are its sequences, parallelism rather than work: the same
///      tokens in more sequences side by side may predict less);
///   3. deterministic (the planner compares thousands of candidates by it).
///
/// **Customization**
/// @code
///   struct Roofline {  // two numbers, for a quick estimate
///     double flops_per_s, pcie_bytes_per_s;
///     oom::ResourceTimes predict(const oom::Operation& op) const;
///   };
/// @endcode
/// @see tests/concepts/test_policies.cpp
template <class M>
concept cost_model = requires(const M& model, const Operation& op) {
  { model.predict(op) } -> std::same_as<ResourceTimes>;
};

}  // namespace oom
