// CudaBackend (host C++ over the CUDA runtime; no kernels here).
#include "oom/runtime/cuda_backend.hpp"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "oom/core/cuda_check.hpp"
#include "oom/core/log.hpp"
#include "oom/kernels/adamw_gpu.hpp"
#include "oom/kernels/cast.hpp"

namespace oom {

CudaBackend::CudaBackend(Options options)
    : options_(options), device_(fmt::format("cuda:{} arena", options.device), options.device_budget),
      pinned_("pinned host memory", options.pinned_budget) {
  if (options_.pinned_slab.count() == 0) options_.pinned_slab = Bytes{1ull << 30};
  OOM_CUDA_CHECK(cudaSetDevice(options_.device));
  if (options_.device_reserve.count() == 0) options_.device_reserve = options_.device_budget;
  if (options_.device_reserve < options_.device_budget)
    OOM_THROW(Errc::invalid_argument, fmt::format("cuda:{}: a device reserve of {} is below the budget of {}", options_.device,
                                                  options_.device_reserve, options_.device_budget));
  if (options_.device_reserve.count() > 0) {
    const cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&device_base_), options_.device_reserve.count());
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      OOM_THROW(Errc::out_of_budget, fmt::format("cannot reserve the plan's GPU budget of {} on cuda:{}: {} free of {} ({})",
                                                 options_.device_reserve, options_.device, Bytes{free_b}, Bytes{total_b},
                                                 cudaGetErrorString(status)));
    }
    device_heap_ = FirstFitHeap(options_.device_reserve, 256);
  }
}

namespace {
constexpr std::size_t flag_block = 256;  // device_adamw's flags are pinned this many at a time
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(options_.device);
  cudaDeviceSynchronize();
  pending_.clear();
  for (int* block : flag_blocks_) cudaFreeHost(block);
  for (auto& s : slabs_) cudaFreeHost(s.base);
  cudaFree(device_base_);
}

CudaBackend::Stream CudaBackend::make_stream(int priority) {
  cudaStream_t s = nullptr;
  OOM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return Stream(s, [](cudaStream_t p) { cudaStreamDestroy(p); });
}

CudaBackend::EventPool::~EventPool() {
  for (cudaEvent_t e : spare) cudaEventDestroy(e);
}

CudaBackend::Event CudaBackend::make_event() {
  cudaEvent_t e = nullptr;
  {
    std::lock_guard lock(events_->mutex);
    if (!events_->spare.empty()) {
      e = events_->spare.back();
      events_->spare.pop_back();
    }
  }
  if (e == nullptr) {
    OOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard lock(events_->mutex);
    ++events_->created;
  }
  // Should making the handle fail, shared_ptr hands e to the deleter: back to the pool.
  return Event(e, [pool = events_](cudaEvent_t p) {
    try {
      std::lock_guard lock(pool->mutex);
      pool->spare.push_back(p);
    } catch (...) {  // no room to keep it: let it go
      cudaEventDestroy(p);
    }
  });
}

CudaBackend::TimeMark CudaBackend::time_mark(Stream& s) {
  cudaEvent_t e = nullptr;
  OOM_CUDA_CHECK(cudaEventCreate(&e));
  TimeMark m{std::shared_ptr<CUevent_st>(e, [](cudaEvent_t p) { cudaEventDestroy(p); })};
  OOM_CUDA_CHECK(cudaEventRecord(e, s.get()));
  return m;
}

double CudaBackend::seconds_between(const TimeMark& a, const TimeMark& b) {
  if (!a.event || !b.event) OOM_THROW(Errc::invalid_argument, "seconds_between: a time mark that was never recorded");
  float ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&ms, a.event.get(), b.event.get()));
  return static_cast<double>(ms) * 1e-3;
}

std::size_t CudaBackend::events_created() const {
  std::lock_guard lock(events_->mutex);
  return events_->created;
}

void CudaBackend::record(Event& e, Stream& s) { OOM_CUDA_CHECK(cudaEventRecord(e.get(), s.get())); }
void CudaBackend::wait(Stream& s, Event& e) { OOM_CUDA_CHECK(cudaStreamWaitEvent(s.get(), e.get(), 0)); }
void CudaBackend::copy(void* dst, const void* src, Bytes bytes, Stream& s) {
  OOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes.count(), cudaMemcpyDefault, s.get()));
}
void CudaBackend::synchronize(Stream& s) {
  OOM_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  {
    std::lock_guard lock(mutex_);  // what the stream's frees gave back shows in the arenas now
    if (!pending_.empty()) reap_locked();
  }
  read_checks(s.get());
  std::exception_ptr e;
  {
    std::lock_guard lock(error_mutex_);
    e = std::exchange(first_error_, nullptr);
  }
  if (e) std::rethrow_exception(e);
}

void CudaBackend::drain(Stream& s) noexcept {
  if (!s) return;
  // A failed synchronize leaves the error where it is: the next synchronize() meets it again.
  if (cudaStreamSynchronize(s.get()) != cudaSuccess) return;
  try {
    std::lock_guard lock(mutex_);
    if (!pending_.empty()) reap_locked();
  } catch (...) {  // a failed event query: the frees stay pending, the next allocate or synchronize reports it
  }
  read_checks(s.get());
}

void CudaBackend::read_checks(cudaStream_t s) noexcept {
  std::string bad;
  {
    std::lock_guard lock(mutex_);
    for (auto it = checks_.begin(); it != checks_.end();) {
      if (it->stream != s) {
        ++it;
        continue;
      }
      volatile int* f = it->flag;
      if (*f != 0 && bad.empty()) bad = it->what;
      *f = 0;
      free_flags_.push_back(it->flag);
      it = checks_.erase(it);
    }
  }
  if (bad.empty()) return;
  try {
    OOM_THROW(Errc::invalid_argument, fmt::format("non-finite gradient (NaN or infinite) in {}; its update ran with it, so that state "
                                                  "is unusable: stop the run",
                                                  bad));
  } catch (...) {
    fail(std::current_exception());
  }
}

void CudaBackend::retire(Stream& s) noexcept {
  drain(s);
  if (s) {  // checks a failed drain left unread go with the stream (its handle may be reused)
    std::lock_guard lock(mutex_);
    std::erase_if(checks_, [&](const Check& c) { return c.stream == s.get(); });
  }
  s.reset();
}

void CudaBackend::fail(std::exception_ptr e) {
  std::lock_guard lock(error_mutex_);
  if (!first_error_) first_error_ = std::move(e);
}

void CudaBackend::host_task(Stream& s, std::function<void()> fn) {
  struct Task {
    CudaBackend* backend;
    std::function<void()> fn;
  };
  auto task = std::make_unique<Task>(Task{this, std::move(fn)});
  OOM_CUDA_CHECK(cudaLaunchHostFunc(
      s.get(),
      [](void* p) {
        std::unique_ptr<Task> t(static_cast<Task*>(p));
        try {
          t->fn();
        } catch (...) {
          t->backend->fail(std::current_exception());
        }
      },
      task.get()));
  (void)task.release();  // the host function owns it now
}

void CudaBackend::free_after(Stream& s, void* p, MemorySpace space, Bytes bytes, Claimant claimant) {
  if (p == nullptr) return;
  Event done = make_event();
  record(done, s);
  std::lock_guard lock(mutex_);
  pending_.push_back({std::move(done), p, space, bytes, claimant});
}

void CudaBackend::zero(float* g, std::uint64_t n, Stream& s) {
  OOM_CUDA_CHECK(cudaMemsetAsync(g, 0, n * sizeof(float), s.get()));
}

void CudaBackend::add(float* g, const float* x, std::uint64_t n, Stream& s) {
  OOM_CUDA_CHECK(kernels::accumulate_scaled(g, x, 1.0f, static_cast<std::int64_t>(n), s.get()));
}

void CudaBackend::device_adamw(const optim::AdamWStepScalars& sc, float* master, float* m, float* v, const float* grad, bf16* weights,
                               std::uint64_t n, Stream& s, std::string what) {
  check_gradients(grad, n, s, std::move(what));
  OOM_CUDA_CHECK(kernels::adamw_update(sc, master, m, v, grad, weights, static_cast<std::int64_t>(n), s.get()));
}
void CudaBackend::device_adamw(const optim::AdamWStepScalars& sc, float* master, bf16* m, bf16* v, const float* grad, bf16* weights,
                               std::uint64_t n, Stream& s, std::string what) {
  check_gradients(grad, n, s, std::move(what));
  OOM_CUDA_CHECK(kernels::adamw_update(sc, master, m, v, grad, weights, static_cast<std::int64_t>(n), s.get()));
}

void CudaBackend::check_gradients(const float* grad, std::uint64_t n, Stream& s, std::string what) {
  if (!what.empty()) {
    // A flag the kernel sets on a NaN or infinity, read once the stream has been synchronized
    // (read_checks): no host function on the stream, which would wait behind another stream's
    // (CUDA runs them on one thread).
    int* flag = nullptr;
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (!free_flags_.empty()) {
          flag = free_flags_.back();
          free_flags_.pop_back();
          break;
        }
      }
      int* block = nullptr;  // pinned outside the lock
      OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&block), flag_block * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
      std::fill(block, block + flag_block, 0);
      std::lock_guard lock(mutex_);
      flag_blocks_.push_back(block);
      for (std::size_t i = 0; i < flag_block; ++i) free_flags_.push_back(block + i);
    }
    int* device_flag = nullptr;
    cudaError_t status = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), flag, 0);
    if (status == cudaSuccess) status = kernels::flag_nonfinite(grad, static_cast<std::int64_t>(n), device_flag, s.get());
    // On an error the flag is not reused: the kernel may have been queued all the same (the error
    // can be an earlier one) and may still write it.
    if (status == cudaSuccess) {
      std::lock_guard lock(mutex_);
      checks_.push_back({s.get(), flag, std::move(what)});
    }
    OOM_CUDA_CHECK(status);
  }
}

std::shared_ptr<double[]> CudaBackend::host_words(std::uint64_t n) {
  double* p = nullptr;
  OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), std::max<std::uint64_t>(n, 1) * sizeof(double),
                               cudaHostAllocMapped | cudaHostAllocPortable));
  std::fill(p, p + n, 0.0);
  return std::shared_ptr<double[]>(p, [](double* q) { cudaFreeHost(q); });
}

void CudaBackend::reap_locked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    const cudaError_t status = cudaEventQuery(it->done.get());
    if (status == cudaErrorNotReady) {
      ++it;
      continue;
    }
    OOM_CUDA_CHECK(status);
    free_locked(it->ptr, it->space, it->bytes, it->claimant);
    it = pending_.erase(it);
  }
}

void* CudaBackend::allocate(MemorySpace space, Bytes bytes, Claimant claimant) {
  for (;;) {
    Event oldest;
    {
      std::lock_guard lock(mutex_);
      if (!pending_.empty()) reap_locked();
      try {
        return allocate_locked(space, bytes, claimant);
      } catch (const Error& e) {
        // Frees queued behind work still running may make room: wait for the oldest, then retry.
        if (e.code() != Errc::out_of_budget || pending_.empty()) throw;
      }
      oldest = pending_.front().done;
    }
    // Outside the lock: a host task that frees memory (free()) may be what the event waits for.
    OOM_CUDA_CHECK(cudaEventSynchronize(oldest.get()));
  }
}

void* CudaBackend::allocate_locked(MemorySpace space, Bytes bytes, Claimant claimant) {
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

Bytes CudaBackend::device_high_water() {
  std::lock_guard lock(mutex_);
  return device_heap_.high_water();
}

void CudaBackend::free(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant) {
  std::lock_guard lock(mutex_);
  free_locked(ptr, space, bytes, claimant);
}

void CudaBackend::free_locked(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant) {
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
