// Narrow-format conversions: round-to-nearest-even, gradual underflow, saturation, NaN. Checked
// against the compiler's own _Float16 conversion and against exhaustive properties of each format.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "oom/core/numeric.hpp"

using namespace oom;

TEST_CASE("bf16 keeps the upper half, rounding to nearest even") {
  CHECK(to_bf16(1.0f).bits == 0x3f80);
  CHECK(to_float(to_bf16(1.0f)) == 1.0f);
  // 1 + 2^-8 is exactly half-way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(to_bf16(1.0f + 0x1p-8f).bits == 0x3f80);
  // 1 + 3*2^-8 is half-way between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  CHECK(to_bf16(1.0f + 3 * 0x1p-8f).bits == 0x3f82);
  CHECK(to_bf16(-2.0f).bits == 0xc000);
  CHECK(std::isnan(to_float(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(to_float(to_bf16(INFINITY))));
  // The largest float rounds to infinity in bf16 (its upper mantissa bits are all ones).
  CHECK(std::isinf(to_float(to_bf16(std::numeric_limits<float>::max()))));
}

TEST_CASE("bf16 rounding agrees with the generic encoder on random floats") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(any(rng));
    if (!std::isfinite(f) || std::fabs(f) > 3.0e38f) continue;
    bool overflow = false;
    const std::uint32_t mag = detail::encode_magnitude<8, 7>(std::fabs(f), 0x7f7fu, &overflow);
    if (overflow) continue;
    const std::uint16_t expect = static_cast<std::uint16_t>((f < 0 || std::signbit(f) ? 0x8000u : 0u) | mag);
    REQUIRE(to_bf16(f).bits == expect);
    ++checked;
  }
  CHECK(checked > 100000);
}

#if defined(__FLT16_MAX__)
TEST_CASE("fp16 matches the compiler's _Float16 conversion") {
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 300000; ++i) {
    // Bias towards fp16's range so normals, subnormals and overflow are all exercised.
    const float f = i % 2 ? std::bit_cast<float>(any(rng))
                          : std::ldexp(static_cast<float>(any(rng) % 4096) - 2048.0f, static_cast<int>(any(rng) % 44) - 32);
    const _Float16 ref = static_cast<_Float16>(f);
    const std::uint16_t ref_bits = std::bit_cast<std::uint16_t>(ref);
    const fp16 ours = to_fp16(f);
    if (std::isnan(f)) {
      CHECK(std::isnan(to_float(ours)));
      continue;
    }
    CAPTURE(f);
    REQUIRE(ours.bits == ref_bits);
    REQUIRE((std::isnan(to_float(ours)) || to_float(ours) == static_cast<float>(ref)));
  }
}
#endif

template <class Fp8, class Encode>
void check_fp8_codes(Encode encode, float max_finite) {
  // Every finite code decodes to a value that encodes back to the same code (zero's sign aside).
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = to_float(Fp8{static_cast<std::uint8_t>(code)});
    if (!std::isfinite(v)) continue;
    ++finite;
    CAPTURE(code);
    CHECK(encode(v).bits == code);
    CHECK(std::fabs(v) <= max_finite);
  }
  CHECK(finite >= 240);
  // Between consecutive positive codes, the midpoint rounds to the even code.
  for (int code = 0; code + 1 < 0x7f; ++code) {
    const float lo = to_float(Fp8{static_cast<std::uint8_t>(code)});
    const float hi = to_float(Fp8{static_cast<std::uint8_t>(code + 1)});
    if (!std::isfinite(hi)) break;
    const float mid = lo + (hi - lo) / 2;
    CAPTURE(code);
    CHECK(encode(mid).bits == (code % 2 == 0 ? code : code + 1));
    CHECK(encode(std::nextafter(mid, 0.0f)).bits == code);
    CHECK(encode(std::nextafter(mid, INFINITY)).bits == code + 1);
  }
  CHECK(to_float(encode(max_finite)) == max_finite);
}

TEST_CASE("fp8 e4m3: all codes, ties to even, saturation to 448") {
  check_fp8_codes<fp8_e4m3>([](float f) { return to_fp8_e4m3(f); }, 448.0f);
  CHECK(to_float(to_fp8_e4m3(1e6f)) == 448.0f);
  CHECK(to_float(to_fp8_e4m3(-1e6f)) == -448.0f);
  CHECK(std::isnan(to_float(to_fp8_e4m3(NAN))));
  CHECK(to_float(to_fp8_e4m3(0x1p-9f)) == 0x1p-9f);  // the smallest subnormal
  CHECK(to_float(to_fp8_e4m3(0x1p-11f)) == 0.0f);    // a quarter of it rounds to zero
}

TEST_CASE("fp8 e5m2: all codes, ties to even, infinities kept") {
  check_fp8_codes<fp8_e5m2>([](float f) { return to_fp8_e5m2(f); }, 57344.0f);
  CHECK(std::isinf(to_float(to_fp8_e5m2(INFINITY))));
  CHECK(to_float(to_fp8_e5m2(1e9f)) == 57344.0f);
}
