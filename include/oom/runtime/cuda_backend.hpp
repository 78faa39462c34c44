// CudaBackend: the product backend. CUDA streams and events; one device arena per GPU (a single
// cudaMalloc of the plan's budget, sub-allocated first fit) and pinned host memory in bounded
// slabs (cudaHostAlloc, never per tensor), both accounted by claimant with a measured peak.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "oom/concepts/backend.hpp"
#include "oom/runtime/arena.hpp"
#include "oom/runtime/first_fit.hpp"

namespace oom {

class CudaBackend {
 public:
  struct Options {
    int device = 0;
    Bytes device_budget;   ///< reserved at construction with one cudaMalloc
    Bytes pinned_budget;   ///< upper bound on pinned slabs
    Bytes pinned_slab;     ///< slab size (default 1 GiB); pinning one huge block can fail (DeepSpeed #7150)
  };
  using Stream = std::shared_ptr<CUstream_st>;
  using Event = std::shared_ptr<CUevent_st>;

  explicit CudaBackend(Options options);
  ~CudaBackend();
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  /// A non-blocking stream. `priority` as cudaStreamCreateWithPriority takes it: 0 is the default
  /// and the lowest; lower numbers run first (cudaDeviceGetStreamPriorityRange: -5 on Hopper).
  Stream make_stream(int priority = 0);
  Event make_event();
  /// Runs `fn` now: it enqueues kernels on the stream (kernels take `raw(s)`).
  void submit(Stream& s, std::function<void()> fn) {
    (void)s;
    fn();
  }
  void record(Event& e, Stream& s);
  void wait(Stream& s, Event& e);
  void copy(void* dst, const void* src, Bytes bytes, Stream& s);
  void* allocate(MemorySpace space, Bytes bytes, Claimant claimant);
  void free(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant);
  void synchronize(Stream& s);

  static cudaStream_t raw(const Stream& s) { return s.get(); }
  [[nodiscard]] Arena& device_arena() { return device_; }
  [[nodiscard]] Arena& pinned_arena() { return pinned_; }
  [[nodiscard]] int device() const { return options_.device; }

 private:
  struct Slab {
    unsigned char* base = nullptr;
    FirstFitHeap heap;
  };
  Options options_;
  Arena device_, pinned_;
  std::mutex mutex_;
  unsigned char* device_base_ = nullptr;
  FirstFitHeap device_heap_;
  std::vector<Slab> slabs_;
};

static_assert(backend<CudaBackend>);

}  // namespace oom
