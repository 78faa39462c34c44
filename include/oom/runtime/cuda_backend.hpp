// CudaBackend: the product backend. CUDA streams and events; one device arena per GPU (a single
// cudaMalloc of the plan's budget, or of a larger reserve for fragments, sub-allocated first fit;
// the budget is what the accounting allows) and pinned host memory in bounded slabs
// (cudaHostAlloc, never per tensor), both accounted by claimant with a measured peak. Frees may
// be queued behind a stream's work (free_after); an allocation that does not fit waits for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "oom/concepts/backend.hpp"
#include "oom/runtime/arena.hpp"
#include "oom/runtime/first_fit.hpp"

namespace oom {

class CudaBackend {
 public:
  struct Options {
    int device = 0;
    Bytes device_budget;   ///< the most device bytes held at once (the arena's accounting)
    Bytes pinned_budget;   ///< upper bound on pinned slabs
    Bytes pinned_slab;     ///< slab size (default 1 GiB); pinning one huge block can fail (DeepSpeed #7150)
    /// Bytes reserved with one cudaMalloc at construction, for the first-fit heap the budget's
    /// allocations come from: 0 means device_budget. More than the budget leaves room for the
    /// heap's fragments when allocations of many sizes come and go (a LayerExecutor's), so that
    /// the budget, not the heap's layout, decides when an allocation waits or is refused.
    Bytes device_reserve;
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
  /// An event without timing. Events are pooled: one whose last handle is dropped goes back to the
  /// pool and is handed out again (re-recorded), so an executor that takes a few events per layer
  /// and step creates them once. A wait already enqueued on an event is unaffected by a later
  /// record (cudaStreamWaitEvent takes the record current at the call). A pooled event keeps its
  /// last record until it is recorded again: a wait on it before that waits for work already
  /// queued (a needless dependency, never a missing one).
  Event make_event();
  /// Events created so far (the pool's size): a schedule that drops its events takes the same
  /// ones again, creating more only where more are held at once (frees reaped later).
  [[nodiscard]] std::size_t events_created() const;
  /// A timed event recorded on s (concepts/backend.hpp, timed_marks): a recorded step's spans.
  /// Its own type, so that a pooled Event (no timing) cannot be passed to seconds_between. Not
  /// pooled and not counted in events_created(): two a span, in recorded steps only.
  struct TimeMark {
    std::shared_ptr<CUevent_st> event;
  };
  TimeMark time_mark(Stream& s);
  /// Seconds from a to b on the device (cudaEventElapsedTime, ~0.5 us resolution); both reached.
  double seconds_between(const TimeMark& a, const TimeMark& b);
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

  // ---- the executor's own work on memory (concepts/backend.hpp, executor_backend) ----
  /// `fn` on CUDA's host-function thread once s's work before it has run (cudaLaunchHostFunc):
  /// it must not call CUDA. What it throws is kept for the next synchronize().
  void host_task(Stream& s, std::function<void()> fn);
  /// p goes back to its arena once s's work before this point has run (an event). An allocation
  /// that does not fit waits for these, oldest first, and is refused only when none is pending.
  void free_after(Stream& s, void* p, MemorySpace space, Bytes bytes, Claimant claimant);
  void zero(float* g, std::uint64_t n, Stream& s);
  /// g[i] += x[i], one rounding (kernels::accumulate_scaled with scale 1: the host's bits).
  void add(float* g, const float* x, std::uint64_t n, Stream& s);
  /// kernels::adamw_update (bit for bit optim::adamw_element). `what` not empty: the gradients
  /// are checked first (kernels::flag_nonfinite into a flag of mapped host memory), and a NaN or
  /// infinity is an error naming `what`, thrown by the synchronize() of s (drain() keeps it for
  /// the next). The update runs all the same (the stream does not stop), so that segment's state
  /// is unusable: the caller must stop the run, as CudaCausalLm's do. Moments in fp32 or bf16.
  void device_adamw(const optim::AdamWStepScalars& sc, float* master, float* m, float* v, const float* grad, bf16* weights,
                    std::uint64_t n, Stream& s, std::string what);
  void device_adamw(const optim::AdamWStepScalars& sc, float* master, bf16* m, bf16* v, const float* grad, bf16* weights,
                    std::uint64_t n, Stream& s, std::string what);
  static void* native(const Stream& s) { return s.get(); }
  /// n zeroed doubles of pinned, mapped host memory: a kernel on any stream may write them (the
  /// same address on the device, unified addressing); not counted in the budgets.
  std::shared_ptr<double[]> host_words(std::uint64_t n);
  /// Waits for s like synchronize() without throwing; an error stays for synchronize().
  void drain(Stream& s) noexcept;
  /// Drains s and empties the handle.
  void retire(Stream& s) noexcept;

  static cudaStream_t raw(const Stream& s) { return s.get(); }
  [[nodiscard]] Arena& device_arena() { return device_; }
  [[nodiscard]] Arena& pinned_arena() { return pinned_; }
  [[nodiscard]] int device() const { return options_.device; }
  /// The highest device address range used so far, from the arena's start (<= the reserve).
  [[nodiscard]] Bytes device_high_water();

 private:
  // device_adamw's gradient check (`what` not empty): a flag the kernel sets, read by synchronize().
  void check_gradients(const float* grad, std::uint64_t n, Stream& s, std::string what);

  struct Slab {
    unsigned char* base = nullptr;
    FirstFitHeap heap;
  };
  struct PendingFree {
    Event done;
    void* ptr;
    MemorySpace space;
    Bytes bytes;
    Claimant claimant;
  };
  void* allocate_locked(MemorySpace space, Bytes bytes, Claimant claimant);
  void free_locked(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant);
  void reap_locked();  // gives back the pending frees whose event has completed
  void fail(std::exception_ptr e);

  // The event pool, shared with each event's deleter so that an event that outlives the backend
  // still has somewhere to go (and is destroyed with the last of them).
  struct EventPool {
    std::mutex mutex;
    std::vector<cudaEvent_t> spare;
    std::size_t created = 0;
    ~EventPool();
  };
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  Options options_;
  Arena device_, pinned_;
  std::mutex mutex_;
  std::deque<PendingFree> pending_;  // under mutex_, in the order they were queued
  std::mutex error_mutex_;
  std::exception_ptr first_error_;
  // device_adamw's non-finite checks: a flag each (pinned, mapped) until its stream is synchronized.
  struct Check {
    cudaStream_t stream;
    int* flag;
    std::string what;
  };
  void read_checks(cudaStream_t s) noexcept;  // the checks of s: a set flag becomes the backend's error
  std::vector<Check> checks_;                 // under mutex_
  std::vector<int*> free_flags_;              // under mutex_
  std::vector<int*> flag_blocks_;             // under mutex_: freed with the backend
  unsigned char* device_base_ = nullptr;
  FirstFitHeap device_heap_;
  std::vector<Slab> slabs_;
};

static_assert(executor_backend<CudaBackend>);
static_assert(timed_marks<CudaBackend>);

}  // namespace oom
