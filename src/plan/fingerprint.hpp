// The text and the hash of the plans' fingerprints (model_fingerprint, layer_stack_fingerprint):
// what each reads of a model or a stack, written out in a fixed order, hashed to 16 hex digits.
// Private to src/plan.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oom/model/segment.hpp"

namespace oom::detail {

/// Appends a segment's name and its tensors' names and shapes, then ';'.
inline void append_segment(std::string& text, const StateSegment& seg) {
  text += seg.name;
  for (const auto& t : seg.tensors) text += fmt::format(" {}[{}]", t.name, fmt::join(t.shape, ","));
  text += ';';
}

/// FNV-1a (64 bits) of `text`, as 16 lowercase hex digits.
inline std::string fingerprint_of(std::string_view text) {
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace oom::detail
