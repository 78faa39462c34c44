// Number arguments of the example programs' command lines, with errors naming the flag; and counts
// as the programs print them.
//
// Only what a number needs is read: digits (and, for a real, a '.' and an exponent). strtoull and
// strtof skip leading whitespace and take a sign, so " -1" had read as 2^64 - 1 steps, and they
// round a real past fp32's range to 0 or infinity without a word: both are refused here instead.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"

namespace oom::examples {

namespace detail {
constexpr bool is_digit(char c) { return c >= '0' && c <= '9'; }
}  // namespace detail

/// The value after option `flag` (argv[i + 1], i moved onto it), where `flag` is one of `valued`
/// (the options that take one). Errors (invalid_argument) name what is wrong: an option none of
/// them is ("unknown option", also when it is last), no value after it, or an option where its
/// value should be (a forgotten value: "--out --overwrite" had trained into a directory named
/// "--overwrite"). A value that starts with "--" is refused; a path that does can be written
/// "./--name".
inline const char* option_value(int argc, char** argv, int& i, std::string_view flag, std::initializer_list<std::string_view> valued) {
  if (std::find(valued.begin(), valued.end(), flag) == valued.end())
    OOM_THROW(Errc::invalid_argument, fmt::format("unknown option '{}' (see --help)", flag));
  if (i + 1 >= argc) OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a value (see --help)", flag));
  const std::string_view next = argv[i + 1];
  if (next.starts_with("--"))
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{} needs a value, got the option '{}' (a value that starts with '--' is refused: write a path so "
                          "named as ./{})", flag, next, next));
  return argv[++i];
}

/// A parameter count as the programs print it: oom::count_label (oom/core/bytes.hpp).
using oom::count_label;

/// AdamW moments' precision as the executors keep it: "fp32" or "bf16", else invalid_argument
/// naming `what` (a flag, or a file's field).
inline DType parse_moments(std::string_view what, std::string_view text) {
  if (text != "fp32" && text != "bf16")
    OOM_THROW(Errc::invalid_argument, fmt::format("{} is fp32 or bf16 (AdamW moments), got '{}'", what, text));
  return text == "bf16" ? DType::bf16 : DType::fp32;
}

/// A positive integer (or 0 with allow_zero) written in decimal digits alone: a sign, a space or
/// anything else throws invalid_argument naming `flag`, and so does a count past 2^64 - 1.
inline std::uint64_t parse_count(std::string_view flag, std::string_view text, bool allow_zero = false) {
  const auto refuse = [&] {
    OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a {} integer, got '{}' (decimal digits only: no sign, no spaces)", flag,
                                                  allow_zero ? "non-negative" : "positive", text));
  };
  for (const char c : text)
    if (!detail::is_digit(c)) refuse();
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: '{}' is out of range (at most {})", flag, text, ~0ull));
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || (v == 0 && !allow_zero)) refuse();
  return v;
}

/// parse_count for a flag held as an int: above 2^31 - 1 throws invalid_argument naming `flag`
/// (a cast would wrap it).
inline int parse_int_count(std::string_view flag, std::string_view text, bool allow_zero = false) {
  const std::uint64_t v = parse_count(flag, text, allow_zero);
  if (v > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: '{}' is out of range (at most {})", flag, text, std::numeric_limits<int>::max()));
  return static_cast<int>(v);
}

/// A non-negative fp32 number: digits with at most one '.', then perhaps an exponent ("3e-4",
/// "1.5E+2"); a sign, a space, "inf", "nan" or hex throw invalid_argument naming `flag`. 0 is
/// taken; a nonzero value that fp32 holds only as 0, a subnormal or infinity (below FLT_MIN or
/// above FLT_MAX) throws naming the range: clipping at a norm of 1e-50 had silently become no
/// clipping at all.
inline float parse_real(std::string_view flag, std::string_view text) {
  std::size_t i = 0, mantissa_digits = 0;
  bool nonzero = false;  // a nonzero digit before the exponent: the value is not 0
  for (; i < text.size() && detail::is_digit(text[i]); ++i, ++mantissa_digits) nonzero |= text[i] != '0';
  if (i < text.size() && text[i] == '.')
    for (++i; i < text.size() && detail::is_digit(text[i]); ++i, ++mantissa_digits) nonzero |= text[i] != '0';
  bool well_formed = mantissa_digits > 0;
  if (well_formed && i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    const std::size_t exponent_begin = i;
    while (i < text.size() && detail::is_digit(text[i])) ++i;
    well_formed = i > exponent_begin;
  }
  if (!well_formed || i != text.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a non-negative number (digits, a '.', an exponent as in 3e-4: no sign, "
                                                  "no spaces), got '{}'", flag, text));
  float v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, std::chars_format::general);
  // from_chars reports a value past the range as out of range, or rounds it to 0 or a subnormal:
  // either way it is not the number asked for.
  if (ec == std::errc::result_out_of_range || (ec == std::errc{} && nonzero && !std::isnormal(v)))
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{}: '{}' is outside fp32's range (a nonzero value must lie between {} and {})", flag, text,
                          std::numeric_limits<float>::min(), std::numeric_limits<float>::max()));
  if (ec != std::errc{} || end != text.data() + text.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a non-negative number, got '{}'", flag, text));
  return v;
}

/// A byte size (oom::parse_bytes: "80GiB", "3.84 GiB", "0.5GB", a plain count; a fraction of a
/// byte rounded down); anything else throws invalid_argument naming `flag` as well as the text.
inline Bytes parse_size(std::string_view flag, std::string_view text) {
  try {
    return parse_bytes(text);
  } catch (const Error& e) {
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: {}", flag, e.message()));
  }
}

/// A count and its noun as a sentence reads: "1 window", "0 windows", "2 windows" (the plural by an
/// added "s", which every noun the programs count takes).
inline std::string counted(std::uint64_t n, std::string_view noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

}  // namespace oom::examples
