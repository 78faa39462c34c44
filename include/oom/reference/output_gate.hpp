// CPU reference of the attention output gate of Qwen3-Next and Qwen3.5 (oom/kernels/output_gate.hpp):
// o = ctx * sigmoid(gate) elementwise, its backward d_ctx = d_o * s, d_gate = d_o * ctx * s (1 - s),
// s = sigmoid(gate) = 1 / (1 + exp(-gate)) taken in fp64 and rounded to float. The arrays here are
// packed: the caller gathers the gate from q_proj's [q | gate] heads.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

namespace oom::reference {

inline float output_gate_sigmoid(float g) { return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(g)))); }

inline void output_gate_forward(std::span<const float> ctx, std::span<const float> gate, std::span<float> o) {
  for (std::size_t i = 0; i < o.size(); ++i) o[i] = ctx[i] * output_gate_sigmoid(gate[i]);
}

inline void output_gate_backward(std::span<const float> ctx, std::span<const float> gate, std::span<const float> d_o,
                                 std::span<float> d_ctx, std::span<float> d_gate) {
  for (std::size_t i = 0; i < d_o.size(); ++i) {
    const float s = output_gate_sigmoid(gate[i]);
    d_gate[i] = static_cast<float>(static_cast<double>(d_o[i]) * ctx[i] * s * (1.0 - static_cast<double>(s)));
    d_ctx[i] = d_o[i] * s;
  }
}

}  // namespace oom::reference
