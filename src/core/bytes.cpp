// Formatting and parsing of Bytes, DType and MemorySpace.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <ostream>
#include <iterator>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"
#include "oom/core/memory_space.hpp"

namespace oom {

std::string to_string(Bytes b) {
  static constexpr const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  const std::uint64_t n = b.count();
  if (n < 1024) return fmt::format("{} B", n);
  double v = static_cast<double>(n) / 1024.0;
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", v, units[unit]);
}

std::ostream& operator<<(std::ostream& os, Bytes b) { return os << to_string(b); }

void Bytes::refuse_align_up(std::uint64_t count, std::uint64_t alignment) {
  if (alignment == 0) OOM_THROW(Errc::invalid_argument, fmt::format("{} B aligned to a multiple of 0 bytes", count));
  OOM_THROW(Errc::invalid_argument, fmt::format("{} B ({}) rounded up to a multiple of {} B is past 2^64 - 1 bytes", count,
                                                to_string(Bytes{count}), alignment));
}

Bytes parse_bytes(std::string_view text) {
  auto fail = [&](const char* why) {
    OOM_THROW(Errc::parse, fmt::format("'{}' is not a byte size ({}); write e.g. 80GiB, 512MiB, 1.5TiB, 0.5 GB or 4096",
                                       text, why));
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) fail("empty");
  if (s.front() == '-' || s.front() == '+') fail("a sign: a size has none");
  std::size_t whole_end = 0;
  while (whole_end < s.size() && std::isdigit(static_cast<unsigned char>(s[whole_end]))) ++whole_end;
  const std::string_view whole = s.substr(0, whole_end);
  std::string_view fraction;
  std::size_t num_end = whole_end;
  if (num_end < s.size() && s[num_end] == '.') {
    ++num_end;
    while (num_end < s.size() && std::isdigit(static_cast<unsigned char>(s[num_end]))) ++num_end;
    fraction = s.substr(whole_end + 1, num_end - whole_end - 1);
  }
  if (whole.empty() && fraction.empty()) fail("no number");
  std::string unit;
  for (char c : s.substr(num_end))
    if (!std::isspace(static_cast<unsigned char>(c))) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // Every unit to_string prints (up to PiB) reads back, and each decimal one beside it.
  std::uint64_t scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kib" || unit == "k") scale = std::uint64_t{1} << 10;
  else if (unit == "mib" || unit == "m") scale = std::uint64_t{1} << 20;
  else if (unit == "gib" || unit == "g") scale = std::uint64_t{1} << 30;
  else if (unit == "tib" || unit == "t") scale = std::uint64_t{1} << 40;
  else if (unit == "pib" || unit == "p") scale = std::uint64_t{1} << 50;
  else if (unit == "kb") scale = 1'000;
  else if (unit == "mb") scale = 1'000'000;
  else if (unit == "gb") scale = 1'000'000'000;
  else if (unit == "tb") scale = 1'000'000'000'000;
  else if (unit == "pb") scale = 1'000'000'000'000'000;
  else if (unit.size() > 1 && unit[0] == 'e' && (std::isdigit(static_cast<unsigned char>(unit[1])) || unit[1] == '+' || unit[1] == '-'))
    fail("an exponent: write the number in full");  // "1e3GiB" had been an "unknown unit"
  else fail("unknown unit");
  // In integers, so the result is exactly the floor of what was written (a double's product may
  // land a hair under a whole number and lose a byte): floor(0.fraction x scale) digit by digit
  // from the last, each step floor((digit x scale + carry) / 10), which stays below scale.
  std::uint64_t part = 0;
  for (auto d = fraction.rbegin(); d != fraction.rend(); ++d) part = (static_cast<std::uint64_t>(*d - '0') * scale + part) / 10;
  std::uint64_t bytes = 0;
  for (const char d : whole) {
    const auto digit = static_cast<std::uint64_t>(d - '0');
    if (bytes > (~std::uint64_t{0} - digit) / 10) fail("too large");
    bytes = bytes * 10 + digit;
  }
  if (bytes > (~std::uint64_t{0} - part) / scale) fail("too large");
  bytes = bytes * scale + part;
  // A fraction of a byte is dropped, not rounded up: these sizes are budgets, upper bounds. One
  // that leaves nothing was not meant as 0.
  const bool nonzero = whole.find_first_not_of('0') != std::string_view::npos || fraction.find_first_not_of('0') != std::string_view::npos;
  if (bytes == 0 && nonzero) fail("less than one byte");
  return Bytes{bytes};
}

std::string_view name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp32: return "fp32";
    case DType::fp64: return "fp64";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::fp8_e5m2: return "fp8_e5m2";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint8: return "uint8";
    case DType::uint16: return "uint16";
    case DType::uint32: return "uint32";
  }
  return "?";
}

DType parse_dtype(std::string_view text) {
  struct Spelling {
    std::string_view text;
    DType type;
  };
  static constexpr Spelling spellings[] = {
      {"bf16", DType::bf16},         {"BF16", DType::bf16},         {"bfloat16", DType::bf16},
      {"fp16", DType::fp16},         {"F16", DType::fp16},          {"float16", DType::fp16},
      {"fp32", DType::fp32},         {"F32", DType::fp32},          {"float32", DType::fp32},
      {"fp64", DType::fp64},         {"F64", DType::fp64},          {"float64", DType::fp64},
      {"fp8_e4m3", DType::fp8_e4m3}, {"F8_E4M3", DType::fp8_e4m3}, {"fp8_e5m2", DType::fp8_e5m2},
      {"F8_E5M2", DType::fp8_e5m2},  {"int32", DType::int32},       {"I32", DType::int32},
      {"int64", DType::int64},       {"I64", DType::int64},         {"uint8", DType::uint8},
      {"U8", DType::uint8},          {"uint16", DType::uint16},     {"U16", DType::uint16},
      {"uint32", DType::uint32},     {"U32", DType::uint32},
  };
  for (const auto& s : spellings)
    if (s.text == text) return s.type;
  OOM_THROW(Errc::parse, fmt::format("unknown dtype '{}' (expected bf16, fp16, fp32, fp64, fp8_e4m3, fp8_e5m2, "
                                     "int32, int64, uint8, uint16 or uint32)",
                                     text));
}

std::ostream& operator<<(std::ostream& os, DType t) { return os << name(t); }

std::string to_string(MemorySpace s) {
  switch (s.kind) {
    case MemorySpace::Kind::device: return fmt::format("cuda:{}", s.device_index);
    case MemorySpace::Kind::pinned_host: return "pinned";
    case MemorySpace::Kind::pageable_host: return "pageable";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, MemorySpace s) { return os << to_string(s); }

std::string count_label(std::uint64_t n) {
  if (n < 1000) return std::to_string(n);
  const auto x = static_cast<double>(n);
  constexpr std::pair<double, const char*> units[] = {{1e3, "K"}, {1e6, "M"}, {1e9, "B"}, {1e12, "T"}};
  std::size_t u = 0;
  while (u + 1 < std::size(units) && x >= units[u + 1].first) ++u;
  for (;; ++u) {  // the unit whose three digits it rounds to below 1000 (999,999 is 1.00M, not 1000K)
    const double v = x / units[u].first;
    const int decimals = v < 9.995 ? 2 : v < 99.95 ? 1 : 0;
    if (v >= 999.5 && u + 1 < std::size(units)) continue;
    return fmt::format("{:.{}f}{}", v, decimals, units[u].second);
  }
}

std::string seconds_label(double s) {
  int decimals = 3;
  if (std::isfinite(s) && s > 0 && s < 0.1) {
    decimals = std::min(9, 2 - static_cast<int>(std::floor(std::log10(s))));
    // Rounded up into the next decade (0.0999999 to "0.1000"), one decimal fewer keeps three digits.
    const double scale = std::pow(10.0, decimals);
    if (decimals > 3 && std::round(s * scale) >= 1000.0) --decimals;
  }
  return fmt::format("{:.{}f}", s, decimals);
}

}  // namespace oom
