// HostBackend: the reference backend. Each stream is a worker thread draining its queue in order,
// events are generations a stream completes and another waits for, "device" memory is a budgeted
// host arena whose budget holds in the order the work runs: an allocation that does not fit waits
// while queued work may still free memory, and is refused once none is left. Streams really run concurrently, and copies poison their destination and then copy
// in pieces, so a missing wait between streams reads NaNs or stale bytes instead of passing by luck.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "oom/concepts/backend.hpp"
#include "oom/runtime/arena.hpp"

namespace oom {

class HostBackend {
 public:
  struct Options {
    Bytes device_budget;  ///< the "GPU" arena
    Bytes pinned_budget;  ///< pinned host memory (streamed state, staging, offloaded activations)
    /// Copies poison their destination first and move 64 KiB at a time, yielding in between,
    /// so that races surface. Off only to time things.
    bool expose_races = true;
  };

  class Worker;
  using Stream = std::shared_ptr<Worker>;
  struct EventState {
    std::mutex mutex;
    std::condition_variable done;
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
  };
  using Event = std::shared_ptr<EventState>;

  explicit HostBackend(Options options);
  ~HostBackend();
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  Stream make_stream(std::string name = "stream");
  /// Drains `s`, forgets it and empties the handle; its worker thread ends with the handle. A
  /// stream that another handle still holds is not forgotten: the backend keeps counting its
  /// work (an allocation may be waiting for it) and its thread until the backend goes. Never from
  /// a task of that stream. An executor retires its streams when it is destroyed, so a backend
  /// that outlives many executors does not keep their threads. A task's error is left for the
  /// next synchronize(), as drain() leaves it.
  void retire(Stream& s) noexcept;
  /// Blocks until `s` has run everything submitted so far, like synchronize(), but leaves a task's
  /// error where it is, for the next synchronize() to throw: what a destructor calls, so that it
  /// neither throws nor swallows an error that another user of the backend must see. Never from
  /// a task of that stream (it would wait for itself).
  void drain(Stream& s) noexcept;
  /// Streams made and not forgotten (a retired stream another handle holds still counts).
  [[nodiscard]] std::size_t stream_count();
  Event make_event();
  void submit(Stream& s, std::function<void()> fn);
  void record(Event& e, Stream& s);
  void wait(Stream& s, Event& e);
  void copy(void* dst, const void* src, Bytes bytes, Stream& s);
  /// Memory accounted to `claimant` in `space`'s arena. Bytes that do not fit wait while any
  /// stream has work queued or running (whose frees may make room: the queueing thread runs
  /// ahead of the streams, so a budget checked when work is queued would count buffers that the
  /// work before them frees); Errc::out_of_budget once the streams are idle and they still do
  /// not fit. From a stream's task, bytes that do not fit are refused at once: another stream
  /// may be blocked on that task's stream, so waiting for the streams could never end.
  void* allocate(MemorySpace space, Bytes bytes, Claimant claimant);
  /// Gives back a block as allocate() returned it: Errc::invalid_argument, the block left as it
  /// is, for a pointer this backend does not hold (a double free) or another size, space or
  /// claimant than it was taken with.
  void free(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant);
  /// Blocks until s has run everything submitted so far; rethrows the first exception a task
  /// on any stream threw. From that exception until this hands it over, the tasks of every stream
  /// are skipped, their work not done, as a CUDA context's error stops its work: a step whose loss
  /// or a layer threw runs no backward and no update on what was never written. Event records and
  /// waits, drains and free_after still run, so no stream waits forever and no memory is held.
  /// Never from a task of any stream (handing an error over drains every stream, its own too).
  void synchronize(Stream& s);

  // ---- the executor's own work on memory (concepts/backend.hpp, executor_backend) ----
  /// A task on s: the host backend's streams are host threads already.
  void host_task(Stream& s, std::function<void()> fn) { submit(s, std::move(fn)); }
  /// Frees p when s reaches this point (a task of s). Null p: nothing.
  void free_after(Stream& s, void* p, MemorySpace space, Bytes bytes, Claimant claimant);
  void zero(float* g, std::uint64_t n, Stream& s);
  /// g[i] += x[i] (one fp32 rounding each).
  void add(float* g, const float* x, std::uint64_t n, Stream& s);
  /// optim::adamw_element over n elements, weights[i] = to_bf16(master[i]); `what` not empty: a
  /// NaN or infinite gradient is an error (Errc::invalid_argument) naming it, before any element
  /// is updated. Moments in fp32 or bf16 (widened exactly, stored to nearest even: adamw.hpp).
  void device_adamw(const optim::AdamWStepScalars& sc, float* master, float* m, float* v, const float* grad, bf16* weights,
                    std::uint64_t n, Stream& s, std::string what);
  void device_adamw(const optim::AdamWStepScalars& sc, float* master, bf16* m, bf16* v, const float* grad, bf16* weights,
                    std::uint64_t n, Stream& s, std::string what);
  /// Layers run inside the stream's tasks: no handle to enqueue on.
  static void* native(const Stream& /*s*/) { return nullptr; }
  /// n doubles, zeroed (host memory is the "device's" here).
  static std::shared_ptr<double[]> host_words(std::uint64_t n) { return std::shared_ptr<double[]>(new double[n]()); }

  [[nodiscard]] Arena& device_arena() { return device_; }
  [[nodiscard]] Arena& pinned_arena() { return pinned_; }

 private:
  template <class M>
  void adamw_task(const optim::AdamWStepScalars& sc, float* master, M* m, M* v, const float* grad, bf16* weights, std::uint64_t n,
                  Stream& s, std::string what);

  Options options_;
  Arena device_, pinned_;
  std::mutex error_mutex_;
  std::exception_ptr first_error_;
  std::atomic<bool> failed_{false};  ///< first_error_ is set: workers skip all but ordering tasks
  struct Block {
    MemorySpace space;
    Bytes bytes;
    Claimant claimant;
  };
  std::mutex blocks_mutex_;
  std::unordered_map<void*, Block> blocks_;  ///< every block allocate() handed out and free() did not take back
  std::mutex streams_mutex_;
  std::vector<Stream> streams_;
  friend class Worker;
  void fail(std::exception_ptr e);
  bool work_pending();
};

static_assert(executor_backend<HostBackend>);
template <>
inline constexpr bool device_memory_is_host<HostBackend> = true;

}  // namespace oom
