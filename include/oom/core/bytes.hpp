// Bytes: a strong type for memory sizes, so budgets and buffer sizes never mix with counts.
#pragma once

#include <compare>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>

namespace oom {

/// A byte count. Arithmetic with other Bytes and scaling by integers are allowed; mixing with a
/// bare integer elsewhere is not (use `Bytes{n}` to say what the number is).
class Bytes {
 public:
  constexpr Bytes() = default;
  constexpr explicit Bytes(std::uint64_t count) : count_(count) {}

  [[nodiscard]] constexpr std::uint64_t count() const { return count_; }
  [[nodiscard]] constexpr double gib() const { return static_cast<double>(count_) / (1ull << 30); }
  [[nodiscard]] constexpr double mib() const { return static_cast<double>(count_) / (1ull << 20); }

  constexpr auto operator<=>(const Bytes&) const = default;

  constexpr Bytes& operator+=(Bytes o) { count_ += o.count_; return *this; }
  /// Subtraction below zero is a logic error in accounting; callers check with `<=` first.
  constexpr Bytes& operator-=(Bytes o) { count_ -= o.count_; return *this; }
  friend constexpr Bytes operator+(Bytes a, Bytes b) { return a += b; }
  friend constexpr Bytes operator-(Bytes a, Bytes b) { return a -= b; }
  friend constexpr Bytes operator*(Bytes a, std::uint64_t k) { return Bytes{a.count_ * k}; }
  friend constexpr Bytes operator*(std::uint64_t k, Bytes a) { return Bytes{a.count_ * k}; }
  friend constexpr Bytes operator/(Bytes a, std::uint64_t k) { return Bytes{a.count_ / k}; }
  /// How many times `b` fits in `a` (a ratio, not a size).
  friend constexpr std::uint64_t operator/(Bytes a, Bytes b) { return a.count_ / b.count_; }

  /// Rounds up to a multiple of `alignment` (a power of two is not required). Throws
  /// Errc::invalid_argument for an alignment of 0 or a multiple past 2^64 - 1 bytes (which would
  /// wrap to a small size: a huge request must be refused, not handed a few bytes).
  [[nodiscard]] constexpr Bytes align_up(std::uint64_t alignment) const {
    if (alignment == 0) refuse_align_up(count_, alignment);
    const std::uint64_t rest = count_ % alignment;
    if (rest == 0) return *this;
    if (count_ > ~std::uint64_t{0} - (alignment - rest)) refuse_align_up(count_, alignment);
    return Bytes{count_ + (alignment - rest)};
  }

 private:
  [[noreturn]] static void refuse_align_up(std::uint64_t count, std::uint64_t alignment);  // bytes.cpp: no error.hpp here

  std::uint64_t count_ = 0;
};

constexpr Bytes max(Bytes a, Bytes b) { return a < b ? b : a; }
constexpr Bytes min(Bytes a, Bytes b) { return a < b ? a : b; }

/// "0 B", "512 B", "1.50 KiB", "80.00 GiB", "1.00 TiB": binary units up to PiB, two decimals above
/// bytes; parse_bytes reads each back (to within the rounding of the two decimals).
std::string to_string(Bytes b);
std::ostream& operator<<(std::ostream& os, Bytes b);

/// Parses "80GiB", "1.5 TiB", "4096", "512 MiB", "2GB", "0.5 GB" (binary units K/KiB to P/PiB,
/// every unit to_string prints; decimal units KB to PB; any case, spaces around and between). A
/// fraction of a byte is rounded down ("3.84GiB" is 4123168604 bytes): callers take sizes as
/// budgets, which must not grow. Throws oom::Error (Errc::parse) naming the text when it is not a
/// size: a sign, an exponent, an unknown unit, past 2^64 - 1 bytes, or a nonzero size under one
/// byte ("0.5").
Bytes parse_bytes(std::string_view text);

/// A count (of parameters, say) to three significant digits at its scale: "3.94M", "5.13B",
/// "812K", "12"; 999,999 is "1.00M", not "1000K".
std::string count_label(std::uint64_t n);

/// Seconds for a line of text, without an exponent: three decimals ("983.045", "0.500"), more below
/// 0.1 s so that three significant digits show ("0.0123", "0.000615"; at most nine decimals), so a
/// small model's predicted step does not read "0.000". Negative, zero and non-finite values as
/// "{:.3f}" prints them.
std::string seconds_label(double s);

inline namespace literals {
constexpr Bytes operator""_B(unsigned long long n) { return Bytes{n}; }
constexpr Bytes operator""_KiB(unsigned long long n) { return Bytes{n << 10}; }
constexpr Bytes operator""_MiB(unsigned long long n) { return Bytes{n << 20}; }
constexpr Bytes operator""_GiB(unsigned long long n) { return Bytes{n << 30}; }
constexpr Bytes operator""_TiB(unsigned long long n) { return Bytes{n << 40}; }
}  // namespace literals

}  // namespace oom
