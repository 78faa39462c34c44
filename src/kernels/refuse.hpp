// For the launchers in src/kernels/: return refuse("rmsnorm_backward: workspace of ", bytes, ...)
// records why (oom/kernels/refusal.hpp) and gives cudaErrorInvalidValue. Host code only; the parts
// are streamed into one string (no fmt in .cu files: docs/kernels.md).
#pragma once

#include <cuda_runtime_api.h>

#include <sstream>
#include <string>
#include <utility>

namespace oom::kernels::detail {

/// This thread's reason (oom::kernels::last_refusal). A static of an inline function: one object
/// in the program however many translation units include this, so that a harness compiling a
/// kernel file on its own (scripts/diag) needs no library for it.
inline std::string& refusal_text() noexcept {
  thread_local std::string text;
  return text;
}

/// Stores the reason for this thread and returns cudaErrorInvalidValue.
inline cudaError_t set_refusal(std::string reason) noexcept {
  refusal_text() = std::move(reason);
  return cudaErrorInvalidValue;
}

/// The parts (strings and numbers, by value so that literals decay) written one after another.
template <class... Parts>
cudaError_t refuse(Parts... parts) noexcept {
  try {
    std::ostringstream text;
    (text << ... << parts);
    return set_refusal(text.str());
  } catch (...) {  // no memory for the text: the status still says what happened
    return set_refusal({});
  }
}

}  // namespace oom::kernels::detail
