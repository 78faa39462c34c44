// GPU test support: a cudaMalloc'd buffer that is poisoned before each run (so an element the
// kernel forgot to write fails the comparison), copied up and down synchronously, and a timer.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "oom/core/cuda_check.hpp"

namespace oom::test {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) OOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), n_ * sizeof(T)));
    poison();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  [[nodiscard]] T* get() const { return ptr_; }
  [[nodiscard]] std::size_t size() const { return n_; }
  [[nodiscard]] std::size_t bytes() const { return n_ * sizeof(T); }

  /// All bytes 0xFF: NaN for every float format, -1 for signed integers.
  void poison() {
    if (n_ > 0) OOM_CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes()));
  }
  void zero() {
    if (n_ > 0) OOM_CUDA_CHECK(cudaMemset(ptr_, 0, bytes()));
  }
  void upload(const std::vector<T>& host) {
    OOM_ASSERT(host.size() == n_);
    if (n_ > 0) OOM_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(n_);
    OOM_CUDA_CHECK(cudaDeviceSynchronize());
    if (n_ > 0) OOM_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

/// A blocking stream: it waits for the legacy-stream cudaMemset/cudaMemcpy of DeviceBuffer, so a
/// poison or an upload is always complete before a kernel on it reads or writes.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { OOM_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

/// Median milliseconds of `repeats` runs of `launch(stream)` after `warmup` runs, by CUDA events.
template <class F>
double time_ms(F&& launch, cudaStream_t stream, int repeats = 10, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) launch(stream);
  cudaEvent_t a, b;
  OOM_CUDA_CHECK(cudaEventCreate(&a));
  OOM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms(static_cast<std::size_t>(repeats));
  for (auto& m : ms) {
    OOM_CUDA_CHECK(cudaEventRecord(a, stream));
    launch(stream);
    OOM_CUDA_CHECK(cudaEventRecord(b, stream));
    OOM_CUDA_CHECK(cudaEventSynchronize(b));
    OOM_CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

/// Device memory's bandwidth as a device-to-device cudaMemcpy of `bytes` reaches it: the bytes it
/// reads plus those it writes, per second (time_ms' median). The physical limit the memory-bound
/// kernels' reports are written against.
inline double copy_bytes_per_s(cudaStream_t stream, std::size_t bytes = std::size_t{1} << 30) {
  DeviceBuffer<unsigned char> a(bytes), b(bytes);
  const double ms = time_ms(
      [&](cudaStream_t s) { OOM_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, s)); }, stream);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

}  // namespace oom::test
