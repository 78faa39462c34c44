// Test support: the CUDA executor's options, its defaults but for one (designated initializers
// would leave the fields before it uninitialised in the eyes of -Wmissing-field-initializers).
#pragma once

#include "oom/runtime/cuda_causal_lm.hpp"

namespace oom::test {

inline CudaCausalLmOptions staging_ring(unsigned layers) {
  CudaCausalLmOptions o;
  o.grad_staging_layers = layers;
  return o;
}

inline CudaCausalLmOptions attention_state(bool keep) {
  CudaCausalLmOptions o;
  o.keep_attention_state = keep;
  return o;
}

}  // namespace oom::test
