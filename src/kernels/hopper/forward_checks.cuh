// What both wgmma attention forwards check before they launch (private, like the kernels).
#pragma once

#include <cuda_runtime.h>

#include "../attention_common.cuh"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::hopper {

/// cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned pointer or
/// stride (as attention_forward); cudaErrorNotSupported for another head_dim than `head_dim` or a
/// current device other than compute capability 9.0 (the only code built is sm_90a, which loads
/// there alone); else cudaSuccess, with *empty set when there are no query rows to compute.
inline cudaError_t forward_checks(const AttentionProblem& p, int head_dim, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                  TokenRows<const bf16> v, TokenRows<bf16> o, const float* lse, bool* empty) {
  using attention_detail::aligned_rows;
  *empty = false;
  if (!attention_can_implement(p)) return cudaErrorInvalidValue;
  if (p.head_dim != head_dim) return cudaErrorNotSupported;
  if (p.query_end() == p.q_begin) {
    *empty = true;
    return cudaSuccess;
  }
  if (!aligned_rows(q) || !aligned_rows(k) || !aligned_rows(v) || !aligned_rows(o) || lse == nullptr) return cudaErrorInvalidValue;
  int dev = 0, major = 0, minor = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev); e != cudaSuccess) return e;
  return major == 9 && minor == 0 ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace oom::kernels::hopper
