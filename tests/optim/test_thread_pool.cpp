// ThreadPool: every task runs exactly once whatever the pool size, jobs can follow one another,
// and a task's exception reaches the caller after the other tasks finish.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "oom/optim/thread_pool.hpp"

using oom::optim::ThreadPool;

TEST_CASE("thread pool runs each task exactly once, for any size and task count") {
  for (std::size_t threads : {1u, 2u, 3u, 7u}) {
    ThreadPool pool(threads);
    CHECK(pool.size() == threads);
    for (std::size_t tasks : {0u, 1u, 2u, 5u, 1000u}) {
      std::vector<std::atomic<int>> runs(tasks);
      pool.run(tasks, [&](std::size_t t) { runs[t].fetch_add(1); });
      for (std::size_t t = 0; t < tasks; ++t) REQUIRE(runs[t].load() == 1);
    }
  }
}

TEST_CASE("thread pool of size 0 uses the hardware concurrency") {
  ThreadPool pool(0);
  CHECK(pool.size() == std::max(1u, std::thread::hardware_concurrency()));
}

TEST_CASE("thread pool uses its workers, not only the caller") {
  ThreadPool pool(3);
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  // Each task waits until another is running at the same time (or gives up after a while), so a
  // pool that ran everything on the caller would report 1.
  pool.run(3, [&](std::size_t) {
    const int now = inside.fetch_add(1) + 1;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {}
    for (int spin = 0; spin < 4000 && inside.load() < 2; ++spin) std::this_thread::sleep_for(std::chrono::microseconds(250));
    inside.fetch_sub(1);
  });
  CHECK(most.load() >= 2);
}

TEST_CASE("thread pool rethrows a task's exception after running every task, and stays usable") {
  // Size 1 runs inline on the caller: it must keep the same contract (it used to stop at the throw).
  for (std::size_t threads : {1u, 2u, 4u}) {
    CAPTURE(threads);
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> runs(100);
    CHECK_THROWS_AS(pool.run(100,
                             [&](std::size_t t) {
                               runs[t].fetch_add(1);
                               if (t == 0 || t == 37) throw std::runtime_error("task " + std::to_string(t));
                             }),
                    std::runtime_error);
    for (std::size_t t = 0; t < runs.size(); ++t) REQUIRE(runs[t].load() == 1);
    std::atomic<int> again{0};
    pool.run(10, [&](std::size_t) { again.fetch_add(1); });
    CHECK(again.load() == 10);
  }
}
