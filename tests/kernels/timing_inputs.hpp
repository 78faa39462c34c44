// What the timing runs feed the kernels: random values, never zeros or one repeated constant. A
// matrix product on constant data switches fewer bits than on real data and can run faster (a
// bf16 product 13% faster on zeros than on random data on an H200: the device method notes), so a
// ratio between a kernel timed on zeros and a peer timed on random data (PyTorch's SDPA on randn)
// flatters the kernel, and a ratio between two compute-bound runs on constant data shifts against
// a memory-bound one.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"
#include "support/compare.hpp"

namespace oom::test {

/// The fresh values fill_repeating draws before it repeats them: 2^22.
inline constexpr std::size_t kFillBlock = std::size_t{1} << 22;

/// `n` values at device address `p`: a block of up to kFillBlock fresh ones (`make(i)`, i = 0, 1, ...)
/// built on the host, then repeated over the rest by device-to-device copies (each copy doubling
/// the filled part), so a GiB-sized operand is filled in a fraction of a second. Synchronous. The
/// period (8 or 16 MiB) is far beyond any tile, row or cache line a kernel reuses.
template <class T, class Make>
void fill_repeating(T* p, std::size_t n, Make&& make) {
  if (n == 0) return;
  const std::size_t first = std::min(n, kFillBlock);
  std::vector<T> block(first);
  for (std::size_t i = 0; i < first; ++i) block[i] = make(i);
  OOM_CUDA_CHECK(cudaMemcpy(p, block.data(), first * sizeof(T), cudaMemcpyHostToDevice));
  for (std::size_t filled = first; filled < n;) {
    const std::size_t count = std::min(filled, n - filled);
    OOM_CUDA_CHECK(cudaMemcpy(p + filled, p, count * sizeof(T), cudaMemcpyDeviceToDevice));
    filled += count;
  }
  OOM_CUDA_CHECK(cudaDeviceSynchronize());
}

/// N(0, stddev) bf16 values from `seed` (fill_repeating).
inline void fill_random_bf16(bf16* p, std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  const std::vector<float> f = random_normal(std::min(n, kFillBlock), seed, stddev);
  fill_repeating(p, n, [&](std::size_t i) { return to_bf16(f[i]); });
}

/// N(0, stddev) fp32 values from `seed`, or their magnitudes (`magnitudes`: for what must not be
/// negative, as AdamW's second moment) (fill_repeating).
inline void fill_random_f32(float* p, std::size_t n, std::uint64_t seed, float stddev = 1.0f, bool magnitudes = false) {
  const std::vector<float> f = random_normal(std::min(n, kFillBlock), seed, stddev);
  fill_repeating(p, n, [&](std::size_t i) { return magnitudes ? std::abs(f[i]) : f[i]; });
}

}  // namespace oom::test
