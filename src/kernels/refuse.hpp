// For the launchers in src/kernels/: return refuse("rmsnorm_backward: workspace of ", bytes, ...)
// records why (oom/kernels/refusal.hpp) and gives cudaErrorInvalidValue. Host code only; the parts
// are streamed into one string (no fmt in .cu files: docs/kernels.md).
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>
#include <locale>
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

/// The parts (strings and numbers, by value so that literals decay) written one after another, in
/// the classic locale (no digit grouping whatever the program's global locale).
template <class... Parts>
std::string concat(Parts... parts) {
  std::ostringstream text;
  text.imbue(std::locale::classic());
  (text << ... << parts);
  return text.str();
}

/// Records concat(parts...) as this thread's reason and returns cudaErrorInvalidValue.
template <class... Parts>
cudaError_t refuse(Parts... parts) noexcept {
  try {
    return set_refusal(concat(parts...));
  } catch (...) {  // no memory for the text: the status still says what happened
    return set_refusal({});
  }
}

/// A refusal naming the first of `arrays` (name, pointer) that is null, else cudaSuccess: for the
/// arrays a launch with work reads or writes (a null one would fault on the device and end the
/// context).
inline cudaError_t refuse_null(const char* name, std::initializer_list<std::pair<const char*, const void*>> arrays) noexcept {
  for (const auto& [what, p] : arrays)
    if (p == nullptr) return refuse(name, ": ", what, " is null");
  return cudaSuccess;
}

/// A refusal for a workspace that is null or smaller than the `need` bytes its size function gives
/// (`source...`, written after it: "rmsnorm_backward_workspace_bytes(", rows, ", ", dim, ")").
template <class... Source>
cudaError_t refuse_workspace(const char* name, const void* workspace, std::size_t bytes, std::size_t need,
                             Source... source) noexcept {
  if (workspace == nullptr && need == 0) return refuse(name, ": workspace is null (this call needs one, of any size)");
  if (workspace == nullptr) return refuse(name, ": workspace is null, needs ", need, " bytes (", source..., ")");
  return refuse(name, ": workspace of ", bytes, " bytes, needs ", need, " (", source..., ")");
}

}  // namespace oom::kernels::detail
