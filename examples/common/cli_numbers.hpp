// Number arguments of the example programs' command lines, with errors naming the flag.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"

namespace oom::examples {

/// A positive integer (or 0 with allow_zero); anything else throws invalid_argument naming `flag`.
inline std::uint64_t parse_count(std::string_view flag, const char* text, bool allow_zero = false) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0' || text[0] == '-' || (v == 0 && !allow_zero))
    OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a positive integer, got '{}'", flag, text));
  if (errno == ERANGE)  // strtoull saturates: a count past 2^64 - 1 would read as that
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: '{}' is out of range (at most {})", flag, text, ~0ull));
  return v;
}

/// parse_count for a flag held as an int: above 2^31 - 1 throws invalid_argument naming `flag`
/// (a cast would wrap it).
inline int parse_int_count(std::string_view flag, const char* text, bool allow_zero = false) {
  const std::uint64_t v = parse_count(flag, text, allow_zero);
  if (v > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: '{}' is out of range (at most {})", flag, text, std::numeric_limits<int>::max()));
  return static_cast<int>(v);
}

/// A finite non-negative number; anything else throws invalid_argument naming `flag`.
inline float parse_real(std::string_view flag, const char* text) {
  char* end = nullptr;
  const float v = std::strtof(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(v) || v < 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a non-negative number, got '{}'", flag, text));
  return v;
}

/// A byte size (oom::parse_bytes: "80GiB", "512MiB", a plain count); anything else throws
/// invalid_argument naming `flag` as well as the text.
inline Bytes parse_size(std::string_view flag, const char* text) {
  try {
    return parse_bytes(text);
  } catch (const Error& e) {
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: {}", flag, e.message()));
  }
}

}  // namespace oom::examples
