// Bytes: arithmetic, readable formatting and parsing of the sizes users type on command lines.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <utility>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"

using namespace oom;
using namespace oom::literals;

TEST_CASE("Bytes formats with binary units and two decimals") {
  CHECK(to_string(0_B) == "0 B");
  CHECK(to_string(1023_B) == "1023 B");
  CHECK(to_string(1_KiB) == "1.00 KiB");
  CHECK(to_string(Bytes{1536}) == "1.50 KiB");
  CHECK(to_string(80_GiB) == "80.00 GiB");
  CHECK(to_string(1_TiB) == "1.00 TiB");
  CHECK(to_string(3_TiB + 512_GiB) == "3.50 TiB");
  std::ostringstream os;
  os << 512_MiB;
  CHECK(os.str() == "512.00 MiB");
  CHECK(fmt::format("{}", 2_GiB) == "2.00 GiB");
  CHECK(fmt::format("[{:>10}]", 1_KiB) == "[  1.00 KiB]");
}

TEST_CASE("Bytes arithmetic and ordering") {
  CHECK(1_KiB + 1_KiB == 2_KiB);
  CHECK(3_GiB - 1_GiB == 2_GiB);
  CHECK(1_MiB * 3 == 3_MiB);
  CHECK(4 * 1_MiB == 4_MiB);
  CHECK(1_GiB / 4 == 256_MiB);
  CHECK(1_GiB / 1_MiB == 1024u);
  CHECK(1_MiB < 1_GiB);
  CHECK(max(1_MiB, 1_GiB) == 1_GiB);
  CHECK(min(1_MiB, 1_GiB) == 1_MiB);
  CHECK(Bytes{1000}.align_up(256) == Bytes{1024});
  CHECK(Bytes{1024}.align_up(256) == Bytes{1024});
  CHECK(Bytes{0}.align_up(256) == Bytes{0});
  CHECK((1_GiB).gib() == doctest::Approx(1.0));
}

TEST_CASE("Bytes::align_up refuses a multiple past 2^64 - 1 bytes instead of wrapping to a small size") {
  constexpr std::uint64_t top = ~std::uint64_t{0};
  CHECK(Bytes{top - 255}.align_up(256) == Bytes{top - 255});  // already a multiple: the largest there is
  CHECK(Bytes{top}.align_up(3) == Bytes{top});                 // 2^64 - 1 is a multiple of 3
  CHECK(Bytes{top - 300}.align_up(256) == Bytes{top - 255});
  // Each of these used to come back as 0 or a few KiB (the audit's HostBackend::allocate got 4 KiB).
  for (const auto& [count, alignment] : {std::pair{top - 10, std::uint64_t{4096}}, std::pair{top - 254, std::uint64_t{256}},
                                         std::pair{top, std::uint64_t{2}}}) {
    CAPTURE(count);
    try {
      (void)Bytes{count}.align_up(alignment);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::invalid_argument);
      CHECK(e.message() == fmt::format("{} B ({}) rounded up to a multiple of {} B is past 2^64 - 1 bytes", count,
                                       to_string(Bytes{count}), alignment));
    }
  }
  CHECK_THROWS_WITH_AS((void)Bytes{1}.align_up(0), doctest::Contains("multiple of 0 bytes"), Error);
  static_assert(Bytes{1000}.align_up(256) == Bytes{1024});  // still usable in constant expressions
}

TEST_CASE("parse_bytes accepts binary and decimal units") {
  CHECK(parse_bytes("80GiB") == 80_GiB);
  CHECK(parse_bytes("80 GiB") == 80_GiB);
  CHECK(parse_bytes("1TiB") == 1_TiB);
  CHECK(parse_bytes("1.5TiB") == 1_TiB + 512_GiB);
  CHECK(parse_bytes("4096") == 4_KiB);
  CHECK(parse_bytes("2GB") == Bytes{2'000'000'000});
  CHECK(parse_bytes("512m") == 512_MiB);
  CHECK(parse_bytes(" 24 gib ") == 24_GiB);
  CHECK(parse_bytes("1PiB") == 1024_TiB);
  CHECK(parse_bytes("2 pb") == Bytes{2'000'000'000'000'000});
  CHECK(parse_bytes("18446744073709551615") == Bytes{~std::uint64_t{0}});
  CHECK(parse_bytes("0") == 0_B);  // zero is the caller's to refuse
}

TEST_CASE("parse_bytes rounds a fraction of a byte down, exactly") {
  // The planner's advice prints "about 3.84 GiB": it reads back, as a budget no larger than written.
  CHECK(parse_bytes("3.84GiB") == Bytes{4'123'168'604});  // 4123168604.16
  CHECK(parse_bytes("0.5 GB") == Bytes{500'000'000});
  CHECK(parse_bytes("1.5") == 1_B);
  CHECK(parse_bytes("2.999") == 2_B);
  CHECK(parse_bytes("1.") == 1_B);
  CHECK(parse_bytes(".5KiB") == 512_B);
  CHECK(parse_bytes("0.0000001GiB") == Bytes{107});  // 107.37
  CHECK(parse_bytes("1.0000000000000000000000001 KiB") == 1_KiB);
  CHECK(parse_bytes("1.9999999999999999999999999 KiB") == Bytes{2047});
  CHECK(parse_bytes("16383.999 PiB") == Bytes{18'446'742'947'809'644'773});  // 2^64 - 2^50 / 1000, floored
  // Every thousandth of a decimal unit is whole: none may come out a byte short.
  for (std::uint64_t k = 0; k < 1000; ++k) {
    CAPTURE(k);
    CHECK(parse_bytes(fmt::format("0.{:03} GB", k)) == Bytes{k * 1'000'000});
    CHECK(parse_bytes(fmt::format("{}.{:03}TB", k, k)) == Bytes{k * 1'000'000'000'000 + k * 1'000'000'000});
  }
}

TEST_CASE("parse_bytes reads back every size to_string prints") {
  for (const Bytes b : {0_B, 1023_B, 1_KiB, Bytes{1536}, 80_GiB, 3_TiB + 512_GiB, 1024_TiB, 1024_TiB * 5 + 3_TiB,
                        Bytes{std::uint64_t{1} << 63}}) {
    CAPTURE(to_string(b));
    const Bytes back = parse_bytes(to_string(b));
    // Two decimals of the unit: within half a hundredth of it.
    const double unit = b.count() < 1024 ? 1.0 : std::pow(1024.0, std::floor(std::log2(static_cast<double>(b.count())) / 10));
    CHECK(std::abs(static_cast<double>(back.count()) - static_cast<double>(b.count())) <= 0.005 * unit);
  }
}

TEST_CASE("parse_bytes rejects what is not a size, naming the text") {
  for (const char* bad : {"", "GiB", "12 parsecs", "0.5", "0.0001 KiB", "-3GiB", "+3GiB", " -1", "1e99TiB", "8..1GiB", ".",
                          "18446744073709551616", "16384PiB", "99999999999999999999999 B", "1 EiB"}) {
    CAPTURE(bad);
    try {
      (void)parse_bytes(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::parse);
      CHECK(std::string(e.what()).find(std::string("'") + bad + "'") != std::string::npos);
    }
  }
}

TEST_CASE("parse_bytes names an exponent as one (it had been an unknown unit)") {
  for (const char* bad : {"1e3GiB", "2E+2 MiB", "1e-1GB"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS((void)parse_bytes(bad), doctest::Contains("(an exponent: write the number in full)"), Error);
  }
  CHECK_THROWS_WITH_AS((void)parse_bytes("12 parsecs"), doctest::Contains("(unknown unit)"), Error);
}
