// HostBackend: worker-thread streams, generation events, budgeted arenas.
#include "oom/runtime/host_backend.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"

namespace oom {

class HostBackend::Worker {
 public:
  Worker(HostBackend& owner, std::string name) : owner_(owner), name_(std::move(name)), thread_([this] { run(); }) {}
  ~Worker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  /// Whether work is queued or running on this stream.
  bool pending() {
    std::lock_guard lock(mutex_);
    return busy_ || !queue_.empty();
  }
  [[nodiscard]] bool runs_on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  /// `always`: runs even after a task of any stream threw (events, waits, frees: the stream order
  /// itself); other tasks are skipped then, until synchronize() hands the error over.
  void push(std::function<void()> fn, bool always = false) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({std::move(fn), always});
    }
    ready_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        busy_ = false;
        ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      if (!task.always && owner_.failed_.load(std::memory_order_acquire)) continue;
      try {
        task.fn();
      } catch (...) {
        owner_.fail(std::current_exception());
      }
    }
  }

  HostBackend& owner_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable ready_;
  struct Task {
    std::function<void()> fn;
    bool always = false;
  };
  std::deque<Task> queue_;
  bool stop_ = false;
  bool busy_ = false;
  std::thread thread_;
};

HostBackend::HostBackend(Options options)
    : options_(options), device_("host-backend device arena", options.device_budget),
      pinned_("host-backend pinned memory", options.pinned_budget) {}

HostBackend::~HostBackend() {
  std::vector<Stream> streams;
  {
    std::lock_guard lock(streams_mutex_);
    streams.swap(streams_);
  }
  streams.clear();  // joins the workers the callers no longer hold, outside the lock
}

HostBackend::Stream HostBackend::make_stream(std::string name) {
  auto s = std::make_shared<Worker>(*this, std::move(name));
  std::lock_guard lock(streams_mutex_);
  streams_.push_back(s);
  return s;
}

void HostBackend::retire(Stream& s) noexcept {
  if (!s) return;
  drain(s);
  {
    std::lock_guard lock(streams_mutex_);
    // Forgotten only when the registry's and this are the only handles: a stream that another
    // handle still feeds stays counted (its work may free memory an allocation waits for).
    if (s.use_count() != 2) {
      s.reset();  // under the lock, so two users retiring one stream cannot both see the other
      return;     // (the registry's handle keeps the worker: nothing joins here)
    }
    std::erase(streams_, s);
  }
  s.reset();  // outside the lock: the last handle joins the worker
}

std::size_t HostBackend::stream_count() {
  std::lock_guard lock(streams_mutex_);
  return streams_.size();
}

bool HostBackend::work_pending() {
  std::lock_guard lock(streams_mutex_);
  // A stream's own task does not wait: another stream may be waiting on an event that task's
  // stream records later, or allocating from its own task, so neither would ever be idle.
  for (auto& s : streams_)
    if (s->runs_on_this_thread()) return false;
  for (auto& s : streams_)
    if (s->pending()) return true;
  return false;
}

HostBackend::Event HostBackend::make_event() { return std::make_shared<EventState>(); }

void HostBackend::submit(Stream& s, std::function<void()> fn) { s->push(std::move(fn)); }

void HostBackend::record(Event& e, Stream& s) {
  std::uint64_t generation = 0;
  {
    std::lock_guard lock(e->mutex);
    generation = ++e->recorded;
  }
  s->push([e, generation] {
    {
      std::lock_guard lock(e->mutex);
      if (generation > e->completed) e->completed = generation;
    }
    e->done.notify_all();
  }, /*always=*/true);
}

void HostBackend::wait(Stream& s, Event& e) {
  std::uint64_t generation = 0;
  {
    std::lock_guard lock(e->mutex);
    generation = e->recorded;  // the latest record at the time of the call, as cudaStreamWaitEvent
  }
  if (generation == 0) return;
  s->push([e, generation] {
    std::unique_lock lock(e->mutex);
    e->done.wait(lock, [&] { return e->completed >= generation; });
  }, /*always=*/true);
}

void HostBackend::copy(void* dst, const void* src, Bytes bytes, Stream& s) {
  const bool slow = options_.expose_races;
  s->push([dst, src, n = bytes.count(), slow] {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* from = static_cast<const unsigned char*>(src);
    if (!slow) {
      std::memcpy(d, from, n);
      return;
    }
    std::memset(d, 0xFF, n);  // NaN in every float format: an early reader sees garbage
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // ... and has time to
    constexpr std::size_t piece = 64 << 10;
    for (std::size_t at = 0; at < n; at += piece) {
      std::memcpy(d + at, from + at, std::min(piece, n - at));
      std::this_thread::yield();
    }
  });
}

void* HostBackend::allocate(MemorySpace space, Bytes bytes, Claimant claimant) {
  Arena* arena = space.is_device() ? &device_ : space.kind == MemorySpace::Kind::pinned_host ? &pinned_ : nullptr;
  const std::size_t align = space.is_device() ? 256 : 4096;
  const Bytes rounded = bytes.align_up(align);  // before the arena is charged: a size near 2^64 throws here
  if (arena) arena->take_when_free(claimant, bytes, [this] { return work_pending(); });
  void* p = std::aligned_alloc(align, std::max<std::size_t>(align, rounded.count()));
  if (p == nullptr) {
    if (arena) arena->give(claimant, bytes);
    OOM_THROW(Errc::out_of_budget, fmt::format("host allocation of {} for {} failed", bytes, to_string(claimant)));
  }
  try {
    std::lock_guard lock(blocks_mutex_);
    blocks_.emplace(p, Block{space, bytes, claimant});
  } catch (...) {  // no memory for the record: the block goes back, and its charge
    std::free(p);
    if (arena) arena->give(claimant, bytes);
    throw;
  }
  return p;
}

void HostBackend::free(void* ptr, MemorySpace space, Bytes bytes, Claimant claimant) {
  {
    // A block is given back as it was taken, once: the reference backend says so where a real
    // allocator would corrupt its heap or its accounts.
    std::lock_guard lock(blocks_mutex_);
    const auto it = blocks_.find(ptr);
    if (it == blocks_.end())
      OOM_THROW(Errc::invalid_argument, fmt::format("free of {} ({} for {}): not a block this backend holds (freed already, or "
                                                    "never allocated here)", fmt::ptr(ptr), bytes, to_string(claimant)));
    const Block& b = it->second;
    if (!(b.space == space) || b.bytes != bytes || b.claimant != claimant)
      OOM_THROW(Errc::invalid_argument, fmt::format("free of {} as {} in {} for {}: it was allocated as {} in {} for {}", fmt::ptr(ptr), bytes,
                                                    to_string(space), to_string(claimant), b.bytes, to_string(b.space), to_string(b.claimant)));
    blocks_.erase(it);
  }
  std::free(ptr);
  if (space.is_device()) device_.give(claimant, bytes);
  else if (space.kind == MemorySpace::Kind::pinned_host) pinned_.give(claimant, bytes);
}

void HostBackend::drain(Stream& s) noexcept {
  if (!s) return;
  // A marker task behind everything queued; a stream's tasks never throw past its worker (errors
  // go to fail()), so the marker runs. It captures one pointer, which std::function holds without
  // allocating; a condition variable, not a promise, whose calls may throw.
  struct Marker {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
  } marker;
  try {
    s->push([p = &marker] {
      std::lock_guard lock(p->m);
      p->done = true;
      p->cv.notify_one();
    }, /*always=*/true);
  } catch (...) {  // no memory to queue the marker: poll until the stream is idle instead
    while (s->pending()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  std::unique_lock lock(marker.m);
  marker.cv.wait(lock, [&] { return marker.done; });
}

void HostBackend::synchronize(Stream& s) {
  drain(s);
  if (!failed_.load(std::memory_order_acquire)) return;
  // Every stream runs out what was queued before the error is handed over, skipped as it is: once
  // the work may run again, a task queued behind the error (an update of gradients never written)
  // must not. Their waits are for records queued already, which run, so the drains end.
  std::vector<Stream> streams;
  {
    std::lock_guard lock(streams_mutex_);
    streams = streams_;
  }
  for (auto& other : streams) drain(other);
  std::lock_guard lock(error_mutex_);
  failed_.store(false, std::memory_order_release);
  if (first_error_) std::rethrow_exception(std::exchange(first_error_, nullptr));
}

void HostBackend::fail(std::exception_ptr e) {
  std::lock_guard lock(error_mutex_);
  if (!first_error_) first_error_ = e;
  failed_.store(true, std::memory_order_release);
}

void HostBackend::free_after(Stream& s, void* p, MemorySpace space, Bytes bytes, Claimant claimant) {
  if (p == nullptr) return;
  s->push([this, p, space, bytes, claimant] { free(p, space, bytes, claimant); }, /*always=*/true);
}

void HostBackend::zero(float* g, std::uint64_t n, Stream& s) {
  submit(s, [g, n] { std::fill(g, g + n, 0.0f); });
}

void HostBackend::add(float* g, const float* x, std::uint64_t n, Stream& s) {
  submit(s, [g, x, n] {
    for (std::uint64_t i = 0; i < n; ++i) g[i] += x[i];
  });
}

namespace {
float widen(float x) { return x; }
float widen(bf16 x) { return to_float(x); }
void narrow(float x, float& out) { out = x; }
void narrow(float x, bf16& out) { out = to_bf16(x); }
}  // namespace

template <class M>
void HostBackend::adamw_task(const optim::AdamWStepScalars& sc, float* master, M* m, M* v, const float* grad, bf16* weights,
                             std::uint64_t n, Stream& s, std::string what) {
  submit(s, [=, what = std::move(what)] {
    if (!what.empty()) optim::require_finite_gradients({grad, n}, what);
    for (std::uint64_t i = 0; i < n; ++i) {
      float mi = widen(m[i]), vi = widen(v[i]);
      optim::adamw_element(sc, master[i], mi, vi, grad[i]);
      narrow(mi, m[i]);
      narrow(vi, v[i]);
      weights[i] = to_bf16(master[i]);
    }
  });
}

void HostBackend::device_adamw(const optim::AdamWStepScalars& sc, float* master, float* m, float* v, const float* grad, bf16* weights,
                               std::uint64_t n, Stream& s, std::string what) {
  adamw_task(sc, master, m, v, grad, weights, n, s, std::move(what));
}
void HostBackend::device_adamw(const optim::AdamWStepScalars& sc, float* master, bf16* m, bf16* v, const float* grad, bf16* weights,
                               std::uint64_t n, Stream& s, std::string what) {
  adamw_task(sc, master, m, v, grad, weights, n, s, std::move(what));
}

}  // namespace oom
