// backend: what the executor needs of a machine: streams that run work in order, events between
// them, asynchronous copies, and budgeted memory with accounting by claimant.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>

#include "oom/core/bytes.hpp"
#include "oom/core/memory_space.hpp"
#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"
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

/// Optional: marks timed by the device, for a LayerExecutor's recorded step (which otherwise times
/// its spans with host tasks, whose own latency, and on a GPU their wait for the one thread CUDA
/// runs host functions on, would count in the spans and stall the stream). For `B& b`,
/// `typename B::Stream s`, `typename B::TimeMark m`:
///   `b.time_mark(s)` is a mark recorded in s's order; `b.seconds_between(m0, m1)` the device's
///   time from m0 to m1, once both have been reached (after a synchronize of their streams).
template <class B>
concept timed_marks = requires(B& b, typename B::Stream& s, const typename B::TimeMark& m) {
  { b.time_mark(s) } -> std::same_as<typename B::TimeMark>;
  { b.seconds_between(m, m) } -> std::convertible_to<double>;
};

/// B::TimeMark for a backend with timed_marks, else an empty type.
template <class B>
struct time_mark_of {
  using type = std::monostate;
};
template <timed_marks B>
struct time_mark_of<B> {
  using type = typename B::TimeMark;
};
template <class B>
using TimeMarkOf = typename time_mark_of<B>::type;

/// Whether a backend's "device" memory is host memory the caller's CPU code may read in a stream
/// task (a LayerExecutor's HostLossFn steps need it). runtime/host_backend.hpp says yes for its own.
template <class B>
inline constexpr bool device_memory_is_host = false;

/// What a LayerExecutor (runtime/layer_executor.hpp) needs beyond `backend`: the few things it does
/// to memory itself, in stream order. For `B& b`, `typename B::Stream s`, `float* g`, `const float*
/// x`, `std::uint64_t n`, `void* p`, `double* d`:
///   7. `b.host_task(s, fn)` runs `fn` on a host thread once s's work before it has run; later
///      work on s starts after it. An exception it throws is kept for the next synchronize()
///      (cudaLaunchHostFunc on a GPU: `fn` must not call CUDA);
///   8. `b.free_after(s, p, space, bytes, claimant)` gives p back once s's work before it has run;
///      an allocation that does not fit meanwhile waits for such frees (never refused while one
///      is pending);
///   9. `b.zero(g, n, s)` and `b.add(g, x, n, s)` (g[i] = g[i] + x[i], one fp32 rounding) on
///      device memory in s's order;
///  10. `b.device_adamw(scalars, master, m, v, grad, weights, n, s, what)` is
///      optim::adamw_element over n device elements with the bf16 copy written, bit for bit the
///      CPU's (where `what` is not empty, a NaN or infinite gradient is an error naming it, thrown
///      by the next synchronize() of s, or of any stream once drain(s) has kept it), with moments
///      m and v in fp32 (float*) or bf16 (bf16*: widened exactly, stored to nearest even);
///  11. `b.native(s)` is the handle a layer enqueues its work on (`cudaStream_t` on a GPU; null on
///      the host backend, where the layer runs inside the stream's task);
///  12. `b.host_words(n)` is n doubles of host memory the device can write (pinned and mapped on a
///      GPU), outside the budgets (bookkeeping, like events);
///  13. `b.drain(s)` waits like synchronize() but never throws, leaving an error for the next
///      synchronize(); `b.retire(s)` drains s and lets the backend forget it.
template <class B>
concept executor_backend =
    backend<B> && requires(B& b, typename B::Stream& s, std::function<void()> fn, void* p, float* g, const float* x, std::uint64_t n,
                           MemorySpace space, Bytes bytes, Claimant c, const optim::AdamWStepScalars& sc, bf16* w, std::string what) {
      b.host_task(s, fn);
      b.free_after(s, p, space, bytes, c);
      b.zero(g, n, s);
      b.add(g, x, n, s);
      b.device_adamw(sc, g, g, g, x, w, n, s, what);
      b.device_adamw(sc, g, w, w, x, w, n, s, what);
      { b.native(s) } -> std::convertible_to<void*>;
      { b.host_words(n) } -> std::same_as<std::shared_ptr<double[]>>;
      b.drain(s);
      b.retire(s);
    };

}  // namespace oom
