// Shared by the scripts/diag harnesses: CK (exit with the file and line on any non-zero status),
// time_us (best of 7 samples of `reps` back-to-back calls, after 3 warm-up calls, in microseconds
// a call, timed by events on the default stream), copy_bandwidth (the bytes a second a 1 GiB
// device-to-device copy moves, read and written: the reference the memory-bound figures use), and
// the random operands products are timed on (fill_random_bf16 in device memory, random_bf16x2 in a
// kernel): constant data switches fewer bits, so products on it run faster than on real data
// (tests/kernels/timing_inputs.hpp says why; the diags stand alone, so they do not include it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

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

/// n bf16 of N(0, stddev) at device address p: 2^22 drawn on the host, repeated over the rest by
/// device-to-device copies (far beyond any tile's reuse). Synchronous.
inline void fill_random_bf16(__nv_bfloat16* p, long long n, unsigned seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  const long long first = n < (1LL << 22) ? n : (1LL << 22);
  std::vector<__nv_bfloat16> block(static_cast<size_t>(first));
  for (auto& v : block) v = __float2bfloat16(dist(rng));
  CK(cudaMemcpy(p, block.data(), first * 2, cudaMemcpyHostToDevice));
  for (long long filled = first; filled < n;) {
    const long long count = filled < n - filled ? filled : n - filled;
    CK(cudaMemcpy(p + filled, p, count * 2, cudaMemcpyDeviceToDevice));
    filled += count;
  }
}

/// Two bf16 values uniform in [-1, 1), packed low then high, from a hash of (i, seed): for filling
/// shared memory in a kernel, where a host-drawn block cannot reach.
__device__ inline std::uint32_t random_bf16x2(std::uint32_t i, std::uint32_t seed) {
  std::uint32_t h = i * 0x9E3779B9u ^ seed;  // a murmur3 finaliser over the index and seed
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  const float lo = static_cast<float>(h & 0xFFFFu) / 32768.0f - 1.0f, hi = static_cast<float>(h >> 16) / 32768.0f - 1.0f;
  return static_cast<std::uint32_t>(__bfloat16_as_ushort(__float2bfloat16(lo))) |
         static_cast<std::uint32_t>(__bfloat16_as_ushort(__float2bfloat16(hi))) << 16;
}
