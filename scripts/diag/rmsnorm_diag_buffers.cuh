// The RMSNorm backward harnesses' device buffers (scripts/diag/rmsnorm_partials.cu,
// rmsnorm_fused_sum.cu): dy, x, dx (rows x dim bf16 bits), w (dim), rstd (rows), grad_w (dim fp32)
// and room for 4096 partials of dim floats; freed when it goes out of scope. Contents unset.
#pragma once

#include <cstdint>

#include "diag_timing.cuh"

struct RmsnormDiagBuffers {
  std::uint16_t *dy = nullptr, *x = nullptr, *w = nullptr, *dx = nullptr;
  float *rstd = nullptr, *partial = nullptr, *gw = nullptr;

  RmsnormDiagBuffers(long long rows, long long dim) {
    const long long n = rows * dim;
    CK(cudaMalloc(&dy, n * 2));
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMalloc(&dx, n * 2));
    CK(cudaMalloc(&w, dim * 2));
    CK(cudaMalloc(&rstd, rows * 4));
    CK(cudaMalloc(&gw, dim * 4));
    CK(cudaMalloc(&partial, 4096 * dim * 4));
  }
  RmsnormDiagBuffers(const RmsnormDiagBuffers&) = delete;
  RmsnormDiagBuffers& operator=(const RmsnormDiagBuffers&) = delete;
  ~RmsnormDiagBuffers() {
    for (void* p : {static_cast<void*>(dy), static_cast<void*>(x), static_cast<void*>(dx), static_cast<void*>(w),
                    static_cast<void*>(rstd), static_cast<void*>(gw), static_cast<void*>(partial)})
      CK(cudaFree(p));
  }
};
