// ThreadPool: persistent std::thread workers for the CPU optimizer (and any other host loop that
// splits into independent tasks). The calling thread works too, so a pool of N threads starts N-1
// workers and a pool of 1 runs everything inline. Task *results* never depend on which thread ran
// a task, which is what keeps the optimizer bit-identical across thread counts.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace oom::optim {

/// Threads for a CPU optimizer that runs beside a thread issuing GPU work: `requested` when
/// positive, else one fewer than the hardware threads (at least 1), so the issuing thread is never
/// queued behind the optimizer's. What the GPU executors and oom-calibrate's profile use.
inline std::size_t optimizer_threads(unsigned requested = 0) {
  if (requested > 0) return requested;
  return std::max(2u, std::thread::hardware_concurrency()) - 1;  // 0 when unknown: 1 thread
}

class ThreadPool {
 public:
  /// `threads` == 0 means std::thread::hardware_concurrency() (at least 1).
  explicit ThreadPool(std::size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Threads that run tasks, the caller included.
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }

  /// Runs fn(0) .. fn(tasks-1), each exactly once, spread over the pool; returns when all are
  /// done. Tasks are handed out dynamically (an atomic counter), so load balances; the first
  /// exception a task throws is rethrown here after the others finish. Calls from several threads
  /// are serialised; a task must not call run() on the same pool.
  void run(std::size_t tasks, const std::function<void(std::size_t)>& fn);

 private:
  void worker_loop();
  void drain();  // takes tasks from the current job until none are left

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;  // bumped per job; workers wait for a new one
  bool stop_ = false;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t tasks_ = 0;
  std::size_t next_ = 0;     // next task to hand out (under mutex_)
  std::size_t pending_ = 0;  // tasks not finished yet
  std::exception_ptr error_;
};

}  // namespace oom::optim
