// CudaBackend (host C++ over the CUDA runtime; no kernels here).
#include "oom/runtime/cuda_backend.hpp"

#include <fmt/format.h>

#include "oom/core/cuda_check.hpp"
#include "oom/core/log.hpp"

namespace oom {

CudaBackend::CudaBackend(Options options)
    : options_(options), device_(fmt::format("cuda:{} arena", options.device), options.device_budget),
      pinned_("pinned host memory", options.pinned_budget) {
  if (options_.pinned_slab.count() == 0) options_.pinned_slab = Bytes{1ull << 30};
  OOM_CUDA_CHECK(cudaSetDevice(options_.device));
  if (options_.device_budget.count() > 0) {
    const cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&device_base_), options_.device_budget.count());
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      OOM_THROW(Errc::out_of_budget, fmt::format("cannot reserve the plan's GPU budget of {} on cuda:{}: {} free of {} ({})",
                                                 options_.device_budget, options_.device, Bytes{free_b}, Bytes{total_b},
                                                 cudaGetErrorString(status)));
    }
    device_heap_ = FirstFitHeap(options_.device_budget, 256);
  }
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(options_.device);
  cudaDeviceSynchronize();
  for (auto& s : slabs_) cudaFreeHost(s.base);
  cudaFree(device_base_);
}

CudaBackend::Stream CudaBackend::make_stream(int priority) {
  cudaStream_t s = nullptr;
  OOM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return Stream(s, [](cudaStream_t p) { cudaStreamDestroy(p); });
}

CudaBackend::Event CudaBackend::make_event() {
  cudaEvent_t e = nullptr;
  OOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return Event(e, [](cudaEvent_t p) { cudaEventDestroy(p); });
}

void CudaBackend::record(Event& e, Stream& s) { OOM_CUDA_CHECK(cudaEventRecord(e.get(), s.get())); }
void CudaBackend::wait(Stream& s, Event& e) { OOM_CUDA_CHECK(cudaStreamWaitEvent(s.get(), e.get(), 0)); }
void CudaBackend::copy(void* dst, const void* src, Bytes bytes, Stream& s) {
  OOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes.count(), cudaMemcpyDefault, s.get()));
}
void CudaBackend::synchronize(Stream& s) { OOM_CUDA_CHECK(cudaStreamSynchronize(s.get())); }

void* CudaBackend::allocate(MemorySpace space, Bytes bytes, Claimant claimant) {
  std::lock_guard lock(mutex_);
  if (space.is_device()) {
    device_.take(claimant, bytes);
    if (auto at = device_heap_.allocate(bytes)) return device_base_ + *at;
    device_.give(claimant, bytes);
    OOM_THROW(Errc::out_of_budget, fmt::format("{}: {} for {} does not fit in one piece ({} in use, largest free range {})",
                                               device_.name(), bytes, to_string(claimant), device_.in_use(),
                                               device_heap_.largest_free()));
  }
  if (space.kind == MemorySpace::Kind::pinned_host) {
    // Slab heaps hand out whole 4 KiB pages: compare what a request really takes.
    if (bytes.align_up(4096) > options_.pinned_slab)
      OOM_THROW(Errc::invalid_argument, fmt::format("pinned allocation of {} for {} exceeds the slab size {}; split it",
                                                    bytes, to_string(claimant), options_.pinned_slab));
    pinned_.take(claimant, bytes);
    for (auto& slab : slabs_)
      if (auto at = slab.heap.allocate(bytes)) return slab.base + *at;
    Slab slab;
    const cudaError_t status = cudaHostAlloc(reinterpret_cast<void**>(&slab.base), options_.pinned_slab.count(), cudaHostAllocPortable);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      pinned_.give(claimant, bytes);
      OOM_THROW(Errc::out_of_budget, fmt::format("pinning a {} slab for {} failed ({}); {} pinned so far", options_.pinned_slab,
                                                 to_string(claimant), cudaGetErrorString(status), pinned_.in_use()));
    }
    slab.heap = FirstFitHeap(options_.pinned_slab, 4096);
    const auto at = slab.heap.allocate(bytes);
    if (!at) {  // cannot happen after the size check above; never hand out an unaccounted range
      (void)cudaFreeHost(slab.base);
      pinned_.give(claimant, bytes);
      OOM_THROW(Errc::internal, fmt::format("a fresh {} pinned slab cannot hold {} for {}", options_.pinned_slab, bytes, to_string(claimant)));
    }
    slabs_.push_back(std::move(slab));
    return slabs_.back().base + *at;
  }
  OOM_THROW(Errc::invalid_argument, "CudaBackend allocates device and pinned memory only");
}

void CudaBackend::free(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant) {
  std::lock_guard lock(mutex_);
  auto* p = static_cast<unsigned char*>(ptr);
  if (space.is_device()) {
    device_heap_.free(static_cast<std::uint64_t>(p - device_base_));
    device_.give(claimant, bytes);
    return;
  }
  for (auto& slab : slabs_)
    if (p >= slab.base && p < slab.base + slab.heap.capacity().count()) {
      slab.heap.free(static_cast<std::uint64_t>(p - slab.base));
      pinned_.give(claimant, bytes);
      return;
    }
  OOM_THROW(Errc::internal, "CudaBackend::free of pinned memory it did not allocate");
}

}  // namespace oom
