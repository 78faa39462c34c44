// Host conversions between float and the narrow storage formats (bf16, fp16, fp8 e4m3/e5m2).
// Round-to-nearest-even everywhere, as the CUDA intrinsics do; these are the references that
// the host backend and the kernels' CPU references use.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace oom {

/// bf16 as stored: the upper half of an IEEE binary32.
struct bf16 {
  std::uint16_t bits = 0;
};
/// IEEE binary16 as stored.
struct fp16 {
  std::uint16_t bits = 0;
};
/// OCP FP8 E4M3 as stored (bias 7, max 448, no infinities, 0x7f/0xff are NaN).
struct fp8_e4m3 {
  std::uint8_t bits = 0;
};
/// OCP FP8 E5M2 as stored (bias 15, IEEE-like with infinities).
struct fp8_e5m2 {
  std::uint8_t bits = 0;
};

inline bf16 to_bf16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<std::uint16_t>(u >> 16)};
}
inline float to_float(bf16 h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h.bits) << 16); }

namespace detail {

/// Encodes |a| (finite, non-negative) into a format with `E` exponent bits, `M` mantissa bits,
/// round-to-nearest-even, gradual underflow. Returns the magnitude bits, or `overflow` when the
/// rounded value exceeds `max_bits`'s value.
template <int E, int M>
inline std::uint32_t encode_magnitude(float a, std::uint32_t max_bits, bool* overflow) {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr int emin = 1 - bias;
  *overflow = false;
  if (a == 0.0f) return 0;
  int e = 0;
  (void)std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  e -= 1;                   // a = 1.x * 2^e
  const bool subnormal = e < emin;
  const int quantum_exp = (subnormal ? emin : e) - M;
  const double n = std::nearbyint(std::ldexp(static_cast<double>(a), -quantum_exp));
  std::uint64_t bits = 0;
  if (subnormal) {
    bits = static_cast<std::uint64_t>(n);  // 2^M lands exactly on the smallest normal
  } else {
    std::uint64_t mant = static_cast<std::uint64_t>(n);
    int biased = e + bias;
    if (mant == (1ull << (M + 1))) {
      mant >>= 1;
      biased += 1;
    }
    bits = (static_cast<std::uint64_t>(biased) << M) | (mant - (1ull << M));
  }
  if (bits > max_bits) {
    *overflow = true;
    return max_bits;
  }
  return static_cast<std::uint32_t>(bits);
}

template <int E, int M>
inline float decode_magnitude(std::uint32_t bits) {
  constexpr int bias = (1 << (E - 1)) - 1;
  const std::uint32_t exp = bits >> M;
  const std::uint32_t mant = bits & ((1u << M) - 1);
  if (exp == 0) return std::ldexp(static_cast<float>(mant), 1 - bias - M);
  return std::ldexp(static_cast<float>(mant | (1u << M)), static_cast<int>(exp) - bias - M);
}

}  // namespace detail

inline fp16 to_fp16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return fp16{static_cast<std::uint16_t>(sign | 0x7e00u)};
  if (std::isinf(f)) return fp16{static_cast<std::uint16_t>(sign | 0x7c00u)};
  bool overflow = false;
  const std::uint32_t mag = detail::encode_magnitude<5, 10>(std::fabs(f), 0x7bffu, &overflow);
  return fp16{static_cast<std::uint16_t>(sign | (overflow ? 0x7c00u : mag))};
}
inline float to_float(fp16 h) {
  const float sign = (h.bits & 0x8000u) ? -1.0f : 1.0f;
  const std::uint32_t mag = h.bits & 0x7fffu;
  if (mag == 0x7c00u) return sign * INFINITY;
  if (mag > 0x7c00u) return NAN;
  return sign * detail::decode_magnitude<5, 10>(mag);
}

/// Saturates to ±448 (the `satfinite` conversion CUDA uses for training data); NaN stays NaN.
inline fp8_e4m3 to_fp8_e4m3(float f) {
  const std::uint8_t sign = (std::bit_cast<std::uint32_t>(f) >> 24) & 0x80u;
  if (std::isnan(f)) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7fu)};
  if (std::isinf(f)) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7eu)};
  bool overflow = false;
  const std::uint32_t mag = detail::encode_magnitude<4, 3>(std::fabs(f), 0x7eu, &overflow);
  return fp8_e4m3{static_cast<std::uint8_t>(sign | mag)};
}
inline float to_float(fp8_e4m3 h) {
  const float sign = (h.bits & 0x80u) ? -1.0f : 1.0f;
  const std::uint32_t mag = h.bits & 0x7fu;
  if (mag == 0x7fu) return NAN;
  return sign * detail::decode_magnitude<4, 3>(mag);
}

/// Saturates to ±57344 for finite inputs; infinities and NaN are kept.
inline fp8_e5m2 to_fp8_e5m2(float f) {
  const std::uint8_t sign = (std::bit_cast<std::uint32_t>(f) >> 24) & 0x80u;
  if (std::isnan(f)) return fp8_e5m2{static_cast<std::uint8_t>(sign | 0x7eu)};
  if (std::isinf(f)) return fp8_e5m2{static_cast<std::uint8_t>(sign | 0x7cu)};
  bool overflow = false;
  const std::uint32_t mag = detail::encode_magnitude<5, 2>(std::fabs(f), 0x7bu, &overflow);
  return fp8_e5m2{static_cast<std::uint8_t>(sign | mag)};
}
inline float to_float(fp8_e5m2 h) {
  const float sign = (h.bits & 0x80u) ? -1.0f : 1.0f;
  const std::uint32_t mag = h.bits & 0x7fu;
  if (mag == 0x7cu) return sign * INFINITY;
  if (mag > 0x7cu) return NAN;
  return sign * detail::decode_magnitude<5, 2>(mag);
}

}  // namespace oom
