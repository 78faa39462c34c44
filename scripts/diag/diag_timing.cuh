// Shared by the scripts/diag harnesses: CK (exit with the file and line on any non-zero status),
// time_us (best of 7 samples of `reps` back-to-back calls, after 3 warm-up calls, in microseconds
// a call, timed by events on the default stream) and copy_bandwidth (the bytes a second a 1 GiB
// device-to-device copy moves, read and written: the reference the memory-bound figures use).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(...)                                                                     \
  do {                                                                              \
    auto e_ = (__VA_ARGS__);                                                        \
    if (e_ != 0) {                                                                  \
      std::printf("error %d at %s:%d\n", static_cast<int>(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

template <class F>
float time_us(F&& f, int reps = 20) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int s = 0; s < 7; ++s) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    best = ms * 1e3f / reps < best ? ms * 1e3f / reps : best;
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return best;
}

/// Bytes a second (read + written) of a 1 GiB device-to-device copy, best of time_us's samples of
/// 3 copies; printed.
inline double copy_bandwidth() {
  const size_t big = size_t{1} << 30;
  void *a, *b;
  CK(cudaMalloc(&a, big));
  CK(cudaMalloc(&b, big));
  const float us = time_us([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); }, 3);
  CK(cudaFree(a));
  CK(cudaFree(b));
  const double bps = 2.0 * big / (us * 1e-6);
  std::printf("D2D copy %.0f GB/s\n", bps / 1e9);
  return bps;
}
