// CPU reference of SwiGLU (oom/kernels/swiglu.hpp) on (T, 2I) [gate | up] rows. `Real` is float
// for comparisons with the kernels and double for the finite-difference checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

namespace oom::reference {

template <class Real>
Real sigmoid(Real g) {
  return Real(1) / (Real(1) + std::exp(-g));
}

/// out[t, i] = silu(gate[t, i]) * up[t, i], silu(g) = g * sigmoid(g).
template <class Real>
void swiglu_forward(std::span<const Real> gate_up,  // (T, 2I)
                    std::span<Real> out,            // (T, I)
                    std::int64_t tokens, std::int64_t intermediate) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < intermediate; ++i) {
      const Real g = gate_up[t * 2 * intermediate + i];
      const Real u = gate_up[t * 2 * intermediate + intermediate + i];
      out[t * intermediate + i] = g * sigmoid(g) * u;
    }
  }
}

/// grad_gate = dout * up * s * (1 + g (1 - s)), grad_up = dout * silu(g), s = sigmoid(g).
template <class Real>
void swiglu_backward(std::span<const Real> grad_out,  // (T, I)
                     std::span<const Real> gate_up,   // (T, 2I)
                     std::span<Real> grad_gate_up,    // (T, 2I)
                     std::int64_t tokens, std::int64_t intermediate) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < intermediate; ++i) {
      const std::int64_t gi = t * 2 * intermediate + i;
      const Real g = gate_up[gi];
      const Real u = gate_up[gi + intermediate];
      const Real d = grad_out[t * intermediate + i];
      const Real s = sigmoid(g);
      grad_gate_up[gi + intermediate] = d * (g * s);
      grad_gate_up[gi] = d * u * (s * (Real(1) + g * (Real(1) - s)));
    }
  }
}

}  // namespace oom::reference
