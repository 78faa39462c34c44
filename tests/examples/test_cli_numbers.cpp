// The example programs' number arguments (examples/common/cli_numbers.hpp): only what a number
// needs is read, and a value the flag's type cannot hold is refused by name, never wrapped or
// rounded to 0.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "common/cli_numbers.hpp"
#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"

using namespace oom;
using namespace oom::literals;
using oom::examples::parse_count;
using oom::examples::parse_int_count;
using oom::examples::parse_real;
using oom::examples::parse_size;

namespace {
// The message of the invalid_argument `f` throws ("" where it throws none).
template <class F>
std::string refusal(F&& f) {
  try {
    (void)f();
  } catch (const Error& e) {
    CHECK(e.code() == Errc::invalid_argument);
    return e.message();
  }
  return "";
}
}  // namespace

TEST_CASE("parse_count takes decimal digits alone") {
  CHECK(parse_count("--steps", "18") == 18u);
  CHECK(parse_count("--seed", "0", /*allow_zero=*/true) == 0u);
  CHECK(parse_count("--seed", "007", true) == 7u);
  CHECK(parse_count("--seed", "18446744073709551615", true) == ~std::uint64_t{0});
  CHECK(parse_int_count("--gpus", "2147483647") == std::numeric_limits<int>::max());
}

TEST_CASE("parse_count refuses a sign or a space, which strtoull had taken (' -1' read as 2^64 - 1)") {
  for (const char* bad : {" -1", "-1", " 5", "5 ", "+5", "\t3", "0x10", "1e3", "1.0", "", "five", "3-"}) {
    CAPTURE(bad);
    const std::string why = refusal([&] { return parse_count("--steps", bad); });
    CHECK(why == fmt::format("--steps needs a positive integer, got '{}' (decimal digits only: no sign, no spaces)", bad));
    CHECK(refusal([&] { return parse_count("--seed", bad, true); }).find("--seed needs a non-negative integer, got '") == 0);
    CHECK(refusal([&] { return parse_int_count("--gpus", bad); }).find("--gpus needs a positive integer, got '") == 0);
  }
  CHECK(refusal([] { return parse_count("--steps", "0"); }).find("--steps needs a positive integer, got '0'") == 0);
  CHECK(refusal([] { return parse_count("--seq", "18446744073709551616"); }) ==
        "--seq: '18446744073709551616' is out of range (at most 18446744073709551615)");
  CHECK(refusal([] { return parse_int_count("--gpus", "2147483648"); }) == "--gpus: '2147483648' is out of range (at most 2147483647)");
}

TEST_CASE("parse_real takes what a non-negative number needs") {
  CHECK(parse_real("--lr", "3e-3") == 3e-3f);
  CHECK(parse_real("--lr", "0.5") == 0.5f);
  CHECK(parse_real("--lr", ".5") == 0.5f);
  CHECK(parse_real("--lr", "5.") == 5.0f);
  CHECK(parse_real("--lr", "1.5E+2") == 150.0f);
  CHECK(parse_real("--weight-decay", "0") == 0.0f);
  CHECK(parse_real("--weight-decay", "0.000e-99") == 0.0f);  // 0 written any way is 0, not an underflow
  CHECK(parse_real("--max-grad-norm", "1.17549435e-38") == std::numeric_limits<float>::min());
  CHECK(parse_real("--max-grad-norm", "3.40282347e38") == std::numeric_limits<float>::max());
}

TEST_CASE("parse_real refuses a sign, a space and what is not a decimal number") {
  for (const char* bad : {" -1", "-1", " 1", "1 ", "+1", "-0", "inf", "nan", "0x1p3", "1e", "1e+", "e5", ".", "", "1..2", "1,5", "3e-4x"}) {
    CAPTURE(bad);
    CHECK(refusal([&] { return parse_real("--lr", bad); }) ==
          fmt::format("--lr needs a non-negative number (digits, a '.', an exponent as in 3e-4: no sign, no spaces), got '{}'", bad));
  }
}

TEST_CASE("parse_real refuses a nonzero value fp32 cannot hold as a normal number (it had become 0 or been misreported)") {
  // 1e-50 had saved max_grad_norm 0.0 (no clipping); 1e39 had read as 'needs a non-negative number'.
  for (const char* bad : {"1e-50", "1e-39", "1.4e-45", "0.00000000000000000000000000000000000000001", "1e39", "3.5e38", "1e400",
                          "1e-400", "99999999999999999999999999999999999999999"}) {
    CAPTURE(bad);
    CHECK(refusal([&] { return parse_real("--max-grad-norm", bad); }) ==
          fmt::format("--max-grad-norm: '{}' is outside fp32's range (a nonzero value must lie between 1.1754944e-38 and 3.4028235e+38)",
                      bad));
  }
}

TEST_CASE("parse_size names the flag, and takes a fraction of a byte rounded down") {
  CHECK(parse_size("--gpu-mem", "3.84GiB") == Bytes{4'123'168'604});
  CHECK(parse_size("--gpu-mem", "80GiB") == 80_GiB);
  const std::string why = refusal([] { return parse_size("--gpu-mem", " -1"); });
  CHECK(why.find("--gpu-mem: ' -1' is not a byte size (a sign: a size has none)") == 0);
}

TEST_CASE("option_value: an unknown option is named as one, a missing or forgotten value is refused") {
  using oom::examples::option_value;
  std::string words[] = {"prog", "--out", "--overwrite", "--steps", "5", "--save-intial", "--out", "./--odd"};
  char* argv[8];
  for (int k = 0; k < 8; ++k) argv[k] = words[k].data();
  const auto valued = {std::string_view("--out"), std::string_view("--steps")};
  int i = 3;
  CHECK(std::string(option_value(8, argv, i, "--steps", valued)) == "5");
  CHECK(i == 4);
  // "--out --overwrite": the next word is an option, not the value (it had named a directory).
  i = 1;
  CHECK(refusal([&] { return option_value(8, argv, i, "--out", valued); }) ==
        "--out needs a value, got the option '--overwrite' (a value that starts with '--' is refused: write a path so named as "
        "./--overwrite)");
  CHECK(i == 1);
  // An unknown option is unknown, also where nothing follows it (it had "needed a value").
  i = 5;
  CHECK(refusal([&] { return option_value(6, argv, i, "--save-intial", valued); }) == "unknown option '--save-intial' (see --help)");
  i = 5;
  CHECK(refusal([&] { return option_value(8, argv, i, "--save-intial", valued); }) == "unknown option '--save-intial' (see --help)");
  // A known one at the end, and a path written past the refusal.
  i = 3;
  CHECK(refusal([&] { return option_value(4, argv, i, "--steps", valued); }) == "--steps needs a value (see --help)");
  i = 6;
  CHECK(std::string(option_value(8, argv, i, "--out", valued)) == "./--odd");
}

TEST_CASE("count_label: three significant digits at the count's scale") {
  using oom::examples::count_label;
  CHECK(count_label(0) == "0");
  CHECK(count_label(999) == "999");
  CHECK(count_label(3'938'304) == "3.94M");
  CHECK(count_label(812'400) == "812K");
  CHECK(count_label(5'126'000'000) == "5.13B");
  CHECK(count_label(21'390'000'000) == "21.4B");
  CHECK(count_label(122'100'000'000) == "122B");
  CHECK(count_label(903'000'000) == "903M");
  // At a unit's edge, the next unit (rounded to 1000 of the smaller one it would read "1000K").
  CHECK(count_label(1'000) == "1.00K");
  CHECK(count_label(9'999) == "10.0K");
  CHECK(count_label(99'999) == "100K");
  CHECK(count_label(999'499) == "999K");
  CHECK(count_label(999'999) == "1.00M");
  CHECK(count_label(999'600'000) == "1.00B");
  CHECK(count_label(~std::uint64_t{0}) == "18446744T");
}

TEST_CASE("seconds_label: three decimals, three significant digits below 0.1 s, never an exponent") {
  using oom::seconds_label;
  CHECK(seconds_label(983.045) == "983.045");
  CHECK(seconds_label(2.9) == "2.900");
  CHECK(seconds_label(0.5) == "0.500");
  CHECK(seconds_label(0.1) == "0.100");
  CHECK(seconds_label(0.0999) == "0.0999");
  CHECK(seconds_label(0.0999999) == "0.100");     // rounded into the next decade: still three digits
  CHECK(seconds_label(0.00099995) == "0.00100");
  CHECK(seconds_label(0.0123) == "0.0123");
  CHECK(seconds_label(0.000614518) == "0.000615");  // a tiny model's step, which read "0.000"
  CHECK(seconds_label(1.5e-12) == "0.000000000");   // at most nine decimals
  CHECK(seconds_label(0) == "0.000");
  CHECK(seconds_label(-0.25) == "-0.250");
  CHECK(seconds_label(std::numeric_limits<double>::infinity()) == "inf");
}

TEST_CASE("counted: a count with its noun in the singular for one and in the plural otherwise") {
  CHECK(oom::examples::counted(1, "window") == "1 window");
  CHECK(oom::examples::counted(0, "window") == "0 windows");
  CHECK(oom::examples::counted(2, "step") == "2 steps");
  CHECK(oom::examples::counted(std::numeric_limits<std::uint64_t>::max(), "window") == "18446744073709551615 windows");
}
