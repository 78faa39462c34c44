// CPU reference of the MoE expert MLPs (Qwen3-MoE SwiGLU experts over permuted rows, grouped by
// expert) and the shared expert gate of Qwen3-Next/3.5. Weight layout per expert as HF checkpoints,
// with gate_proj and up_proj stacked: w_gate_up (E, 2I, H) = [gate_proj (I, H); up_proj (I, H)],
// w_down (E, H, I). The GEMM stages mirror the GPU launchers in oom/kernels/expert_gemm.hpp one to
// one; SwiGLU here is a local reference (the GPU SwiGLU kernel lives with the other activations).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oom::reference {

struct ExpertShape {
  std::int64_t hidden = 0;        ///< H
  std::int64_t intermediate = 0;  ///< I (per expert)
  std::int64_t experts = 0;       ///< E
};

/// gate_up (N, 2I) = x_perm (N, H) . w_gate_up[e]^T for the rows of each expert; N = sum(counts).
std::vector<float> expert_gate_up(const ExpertShape& s, std::span<const std::int32_t> counts,
                                  std::span<const float> x_perm, std::span<const float> w_gate_up);
/// y (N, H) = h (N, I) . w_down[e]^T.
std::vector<float> expert_down(const ExpertShape& s, std::span<const std::int32_t> counts, std::span<const float> h,
                               std::span<const float> w_down);

struct DownGrads {
  std::vector<float> dh;      // (N, I) = dy . w_down[e]
  std::vector<float> dw_down; // (E, H, I) = dy^T . h per expert (zero for experts without rows)
};
DownGrads expert_down_backward(const ExpertShape& s, std::span<const std::int32_t> counts, std::span<const float> dy,
                               std::span<const float> h, std::span<const float> w_down);

struct GateUpGrads {
  std::vector<float> dx;          // (N, H) = d_gate_up . w_gate_up[e]
  std::vector<float> dw_gate_up;  // (E, 2I, H) = d_gate_up^T . x_perm per expert
};
GateUpGrads expert_gate_up_backward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                    std::span<const float> d_gate_up, std::span<const float> x_perm,
                                    std::span<const float> w_gate_up);

/// h (N, I) = silu(gate) * up from gate_up (N, 2I) = [gate | up]. Local reference only.
std::vector<float> swiglu(std::span<const float> gate_up, std::int64_t intermediate);
/// d gate_up (N, 2I) from dh (N, I).
std::vector<float> swiglu_backward(std::span<const float> gate_up, std::span<const float> dh, std::int64_t intermediate);

struct ExpertMlpForward {
  std::vector<float> gate_up;  // (N, 2I)
  std::vector<float> h;        // (N, I)
  std::vector<float> y;        // (N, H)
};
ExpertMlpForward expert_mlp_forward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                    std::span<const float> x_perm, std::span<const float> w_gate_up,
                                    std::span<const float> w_down);
struct ExpertMlpGrads {
  std::vector<float> dx;          // (N, H)
  std::vector<float> dw_gate_up;  // (E, 2I, H)
  std::vector<float> dw_down;     // (E, H, I)
};
ExpertMlpGrads expert_mlp_backward(const ExpertShape& s, std::span<const std::int32_t> counts,
                                   std::span<const float> x_perm, std::span<const float> w_gate_up,
                                   std::span<const float> w_down, const ExpertMlpForward& fwd,
                                   std::span<const float> dy);

/// Shared expert gate (Qwen3-Next): out = routed + sigmoid(x . w_gate) * y, with the gate logit
/// (T) saved for backward. `routed` may be empty (taken as zero).
struct SharedGateForward {
  std::vector<float> gate_logit;  // (T)
  std::vector<float> out;         // (T, H)
};
SharedGateForward shared_expert_gate_forward(std::int64_t tokens, std::int64_t hidden, std::span<const float> x,
                                             std::span<const float> w_gate, std::span<const float> y,
                                             std::span<const float> routed);
struct SharedGateGrads {
  std::vector<float> dy;       // (T, H) = sigmoid(s) * d_out
  std::vector<float> dx;       // (T, H) the gate's share of dx: ds * w_gate
  std::vector<float> dw_gate;  // (H) sum_t ds_t x_t
};
SharedGateGrads shared_expert_gate_backward(std::int64_t tokens, std::int64_t hidden, std::span<const float> x,
                                            std::span<const float> w_gate, std::span<const float> y,
                                            std::span<const float> gate_logit, std::span<const float> d_out);

}  // namespace oom::reference
