// Shared by the MoE GPU test and benchmark: bf16 host data, a cuBLAS handle, checked launches.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"

namespace oom::test {

/// Host values rounded to bf16, kept both as bits (to upload) and as floats (for references).
struct Bf16Data {
  std::vector<bf16> bits;
  std::vector<float> values;
  explicit Bf16Data(const std::vector<float>& v) : bits(v.size()), values(v.size()) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      bits[i] = to_bf16(v[i]);
      values[i] = to_float(bits[i]);
    }
  }
};

inline std::vector<float> to_floats(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = to_float(v[i]);
  return f;
}
/// Each value rounded to bf16.
inline std::vector<bf16> to_bf16s(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(v[i]);
  return out;
}

class Blas {
 public:
  Blas() { OOM_CUBLAS_CHECK(cublasCreate(&h_)); }
  ~Blas() { cublasDestroy(h_); }
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  [[nodiscard]] cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

/// k distinct experts per token drawn uniformly from [0, usable) (experts >= usable get nothing).
inline std::vector<std::int32_t> random_routing(std::int64_t tokens, std::int64_t top_k, std::int64_t usable, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> ids;
  ids.reserve(static_cast<std::size_t>(tokens * top_k));
  std::vector<std::int32_t> pool(static_cast<std::size_t>(usable));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t e = 0; e < usable; ++e) pool[e] = static_cast<std::int32_t>(e);
    for (std::int64_t j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<std::int64_t> d(j, usable - 1);
      std::swap(pool[j], pool[d(rng)]);
      ids.push_back(pool[j]);
    }
  }
  return ids;
}

}  // namespace oom::test
