// ThreadPool: workers sleep on a condition variable between jobs; a job is (function, task count)
// and tasks are handed out one at a time under the pool's mutex (tasks are tens of microseconds,
// so the lock is not what limits us, and it keeps the hand-off and the completion count simple).
#include "oom/optim/thread_pool.hpp"

#include <algorithm>

namespace oom::optim {

ThreadPool::ThreadPool(std::size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  for (std::size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::drain() {
  std::unique_lock lock(mutex_);
  while (next_ < tasks_) {
    const std::size_t task = next_++;
    const auto* job = job_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*job)(task);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    if (--pending_ == 0) done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::run(std::size_t tasks, const std::function<void(std::size_t)>& fn) {
  if (tasks == 0) return;
  std::lock_guard serial(run_mutex_);
  if (workers_.empty() || tasks == 1) {
    // Inline, yet as the contract says: every task runs, the first exception comes after them.
    std::exception_ptr error;
    for (std::size_t t = 0; t < tasks; ++t) {
      try {
        fn(t);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    pending_ = tasks;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  // A late-waking worker sees next_ == tasks_ and goes back to sleep; it never touches `fn` again.
  job_ = nullptr;
  tasks_ = 0;
  next_ = 0;
  if (error_) {
    auto error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace oom::optim
