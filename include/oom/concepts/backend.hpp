// backend: what the executor needs of a machine: streams that run work in order, events between
// them, asynchronous copies, and budgeted memory with accounting by claimant.
#pragma once

#include <concepts>
#include <functional>

#include "oom/core/bytes.hpp"
#include "oom/core/memory_space.hpp"
#include "oom/plan/simulator.hpp"

namespace oom {

/// Requirements, for `B& b`, `typename B::Stream s`, `typename B::Event e`:
///   1. `b.make_stream()` returns a Stream; work submitted to one stream runs in submission order;
///      different streams run concurrently;
///   2. `b.submit(s, fn)` runs `fn` (a `std::function<void()>`) in s's order: on the host backend
///      on s's worker; on a GPU backend, at once on the caller's thread, where `fn` enqueues kernels;
///   3. `b.make_event()`, `b.record(e, s)` (e completes when the work before it on s has run) and
///      `b.wait(s, e)` (work after it on s starts only once e has completed);
///   4. `b.copy(dst, src, bytes, s)` copies asynchronously in s's order;
///   5. `b.allocate(space, bytes, claimant)` returns memory accounted to `claimant` in that
///      space's arena (throwing Errc::out_of_budget past the budget); `b.free(ptr, space, bytes,
///      claimant)` returns it;
///   6. `b.synchronize(s)` blocks the caller until s's work has run.
///
/// **Customization**: see runtime/host_backend.hpp for a complete implementation.
template <class B>
concept backend = requires(B& b, typename B::Stream& s, typename B::Event& e, void* dst, const void* src, Bytes n,
                           MemorySpace space, Claimant c, std::function<void()> fn) {
  { b.make_stream() } -> std::same_as<typename B::Stream>;
  { b.make_event() } -> std::same_as<typename B::Event>;
  b.submit(s, fn);
  b.record(e, s);
  b.wait(s, e);
  b.copy(dst, src, n, s);
  { b.allocate(space, n, c) } -> std::same_as<void*>;
  b.free(dst, space, n, c);
  b.synchronize(s);
};

}  // namespace oom
