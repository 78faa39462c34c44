// What the wgmma kernels check before they launch (private, like the kernels): the attention
// forwards' whole check, the device check the others use too, and the grouped GEMMs' prologue.
#pragma once

#include <cuda_runtime.h>

#include "../attention_common.cuh"
#include "oom/kernels/attention.hpp"

namespace oom::kernels::hopper {

/// cudaSuccess when the current device is compute capability 9.0 (the only one the sm_90a code
/// loads on), cudaErrorNotSupported when it is another, or the runtime's error.
inline cudaError_t current_device_is_cc90() {
  int dev = 0, major = 0, minor = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev); e != cudaSuccess) return e;
  return major == 9 && minor == 0 ? cudaSuccess : cudaErrorNotSupported;
}

/// What a persistent launch (one block per SM at most) needs first: the current device checked
/// as above, its SM count into *sms, and `kernel` allowed `smem_bytes` of dynamic shared memory.
template <class Kernel>
inline cudaError_t prepare_persistent_launch(Kernel kernel, int smem_bytes, int* sms) {
  if (const cudaError_t e = current_device_is_cc90(); e != cudaSuccess) return e;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

/// cudaErrorInvalidValue for a problem attention_can_implement rejects or a misaligned pointer or
/// stride (as attention_forward, with the same refusal reasons); cudaErrorNotSupported for another head_dim than `head_dim` or a
/// current device other than compute capability 9.0 (the only code built is sm_90a, which loads
/// there alone); else cudaSuccess, with *empty set when there are no query rows to compute.
inline cudaError_t forward_checks(const AttentionProblem& p, int head_dim, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                  TokenRows<const bf16> v, TokenRows<bf16> o, const float* lse, bool* empty) {
  *empty = false;
  if (const cudaError_t e = attention_detail::check_problem("attention_forward", p); e != cudaSuccess) return e;
  if (p.head_dim != head_dim) return cudaErrorNotSupported;
  if (p.query_end() == p.q_begin) {
    *empty = true;
    return cudaSuccess;
  }
  if (const cudaError_t e = attention_detail::check_forward_args("attention_forward", q, k, v, o, lse); e != cudaSuccess)
    return e;
  return current_device_is_cc90();
}

}  // namespace oom::kernels::hopper
