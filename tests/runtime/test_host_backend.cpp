// HostBackend's arenas hold their budget in the order the work runs: an allocation that does not
// fit waits while a stream's queued work may still free memory, and is refused by name once the
// streams are idle; a stream's task that asks for too much is refused at once (a stream waiting
// on it would never go idle).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "oom/core/error.hpp"
#include "oom/runtime/host_backend.hpp"

using namespace oom;
using namespace oom::literals;

TEST_CASE("an allocation that does not fit waits for the frees queued before it, then fits") {
  HostBackend b({1_MiB, 1_MiB, false});
  auto s = b.make_stream("frees");
  const MemorySpace dev = MemorySpace::device(0);
  void* first = b.allocate(dev, Bytes{768 << 10}, Claimant::retained_activations);
  std::atomic<bool> freed{false};
  // The stream frees `first` only after a while: the allocation below must wait for it.
  b.submit(s, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    freed = true;
    b.free(first, dev, Bytes{768 << 10}, Claimant::retained_activations);
  });
  void* second = b.allocate(dev, Bytes{512 << 10}, Claimant::worksets);
  CHECK(freed.load());
  CHECK(b.device_arena().in_use() == Bytes{512 << 10});
  CHECK(b.device_arena().peak() == Bytes{768 << 10});  // never both at once
  b.free(second, dev, Bytes{512 << 10}, Claimant::worksets);
}

TEST_CASE("an allocation that does not fit once the streams are idle is refused, naming the claimant and the budget") {
  HostBackend b({1_MiB, 1_MiB, false});
  auto s = b.make_stream("idle");
  const MemorySpace pinned = MemorySpace::pinned_host();
  void* held = b.allocate(pinned, Bytes{768 << 10}, Claimant::host_state);
  std::atomic<bool> ran{false};
  b.submit(s, [&] {  // work that frees nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran = true;
  });
  try {
    (void)b.allocate(pinned, Bytes{512 << 10}, Claimant::host_offload);
    FAIL("the allocation should have been refused");
  } catch (const Error& e) {
    CHECK(ran.load());  // refused only after the queued work had run, not at once
    CHECK(e.code() == Errc::out_of_budget);
    const std::string what = e.what();
    CHECK(what.find("host_offload asks for 512.00 KiB") != std::string::npos);
    CHECK(what.find("once the queued work had run") != std::string::npos);
    CHECK(what.find("the budget is 1.00 MiB") != std::string::npos);
  }
  CHECK(b.pinned_arena().in_use() == Bytes{768 << 10});  // the refusal took nothing
  // More than the whole budget is refused at once, whatever is queued.
  CHECK_THROWS_WITH_AS((void)b.allocate(pinned, 2_MiB, Claimant::host_state), doctest::Contains("the budget is 1.00 MiB"), Error);
  b.free(held, pinned, Bytes{768 << 10}, Claimant::host_state);
}

TEST_CASE("a stream's task that asks for too much is refused at once, not left waiting on streams that wait on it") {
  HostBackend b({1_MiB, 1_MiB, false});
  auto s = b.make_stream("allocates");
  auto other = b.make_stream("waits");
  const MemorySpace dev = MemorySpace::device(0);
  void* held = b.allocate(dev, Bytes{768 << 10}, Claimant::resident_state);
  // `other` waits for an event `s` records after the allocating task: it stays busy until that
  // task ends, so the task must not wait for it to go idle.
  auto before = b.make_event();
  auto after = b.make_event();
  b.record(before, s);
  std::atomic<bool> refused{false};
  b.submit(s, [&] {
    try {
      (void)b.allocate(dev, Bytes{512 << 10}, Claimant::worksets);
    } catch (const Error& e) {
      refused = e.code() == Errc::out_of_budget;
    }
  });
  b.record(after, s);
  b.wait(other, after);
  b.submit(s, [] {});  // later work on the same stream, which cannot run before the task above
  b.synchronize(s);
  b.synchronize(other);
  CHECK(refused.load());
  b.free(held, dev, Bytes{768 << 10}, Claimant::resident_state);
}

TEST_CASE("a retired stream runs what was queued on it, then leaves the backend") {
  HostBackend b({1_MiB, 1_MiB, false});
  auto s = b.make_stream("short-lived");
  auto keep = b.make_stream("kept");
  CHECK(b.stream_count() == 2);
  std::atomic<int> ran{0};
  for (int i = 0; i < 3; ++i)
    b.submit(s, [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ++ran;
    });
  b.retire(s);
  CHECK(ran.load() == 3);
  CHECK(!s);
  CHECK(b.stream_count() == 1);
  b.retire(s);  // an empty handle: nothing
  CHECK(b.stream_count() == 1);
}

TEST_CASE("draining or retiring a stream leaves another stream's task error for the next synchronize") {
  // Two users of one backend: the first's stream fails; the second, draining and retiring its own
  // stream (as an executor's destructor does), neither throws it nor loses it.
  HostBackend b({1_MiB, 1_MiB, false});
  auto failing = b.make_stream("failing");
  auto other = b.make_stream("other");
  b.submit(failing, [] { throw Error(Errc::internal, "the first user's task failed"); });
  auto done = b.make_event();
  b.record(done, failing);
  b.wait(other, done);
  b.submit(other, [] {});
  b.drain(other);
  b.retire(other);
  CHECK(!other);
  CHECK_THROWS_WITH_AS(b.synchronize(failing), doctest::Contains("the first user's task failed"), Error);
  CHECK_NOTHROW(b.synchronize(failing));  // thrown once
  b.retire(failing);
  HostBackend::Stream none;
  b.drain(none);  // an empty handle: nothing
}

TEST_CASE("a stream retired while another handle holds it stays counted: an allocation still waits for its work") {
  HostBackend b({1_MiB, 1_MiB, false});
  const auto dev = MemorySpace::device(0);
  auto s = b.make_stream("shared");
  auto other = s;  // a second user of the same stream
  b.retire(s);
  CHECK(!s);
  CHECK(b.stream_count() == 1);  // still there: `other` feeds it
  void* held = b.allocate(dev, Bytes{768 << 10}, Claimant::resident_state);
  b.submit(other, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    b.free(held, dev, Bytes{768 << 10}, Claimant::resident_state);
  });
  // Does not fit until the stream's task has run: waited for, not refused.
  void* p = nullptr;
  CHECK_NOTHROW(p = b.allocate(dev, Bytes{512 << 10}, Claimant::worksets));
  b.free(p, dev, Bytes{512 << 10}, Claimant::worksets);
  b.retire(other);
  CHECK(b.stream_count() == 0);
}

TEST_CASE("after a task throws, later tasks of every stream are skipped until synchronize hands the error over; ordering and frees still run") {
  HostBackend b({1_MiB, 1_MiB, false});
  auto first = b.make_stream("first");
  auto second = b.make_stream("second");
  std::atomic<int> ran{0};
  b.submit(first, [] { throw Error(Errc::internal, "a layer failed"); });
  auto after = b.make_event();
  b.record(after, first);
  b.wait(second, after);  // runs (no hang) though everything queued before it was skipped
  b.submit(second, [&] { ++ran; });  // an update of never-written gradients: skipped
  void* p = b.allocate(MemorySpace::device(0), 64_KiB, Claimant::worksets);
  b.free_after(second, p, MemorySpace::device(0), 64_KiB, Claimant::worksets);  // still given back
  b.drain(second);
  CHECK(ran == 0);
  CHECK(b.device_arena().in_use() == 0_B);
  CHECK_THROWS_WITH_AS(b.synchronize(first), doctest::Contains("a layer failed"), Error);
  b.submit(second, [&] { ++ran; });  // the error handed over: work runs again
  b.synchronize(second);
  CHECK(ran == 1);
}

TEST_CASE("a block is freed once, as it was taken: a double free or another size is refused, the accounts unchanged") {
  HostBackend b({1_MiB, 1_MiB, false});
  void* p = b.allocate(MemorySpace::device(0), 1_KiB, Claimant::worksets);
  CHECK_THROWS_WITH_AS(b.free(p, MemorySpace::device(0), 2_KiB, Claimant::worksets), doctest::Contains("it was allocated as 1.00 KiB"),
                       Error);
  CHECK_THROWS_WITH_AS(b.free(p, MemorySpace::pinned_host(), 1_KiB, Claimant::worksets), doctest::Contains("it was allocated as"),
                       Error);
  CHECK(b.device_arena().in_use() == 1_KiB);
  b.free(p, MemorySpace::device(0), 1_KiB, Claimant::worksets);
  CHECK(b.device_arena().in_use() == 0_B);
  CHECK_THROWS_WITH_AS(b.free(p, MemorySpace::device(0), 1_KiB, Claimant::worksets), doctest::Contains("not a block this backend holds"),
                       Error);
  int local = 0;
  CHECK_THROWS_AS(b.free(&local, MemorySpace::device(0), 1_KiB, Claimant::worksets), Error);
}
