// oom::Error carries its category, the raise site and the context added on the way up.
#include <doctest/doctest.h>

#include <string>

#include "oom/core/error.hpp"

using namespace oom;

namespace {
void read_layer(int layer) {
  try {
    OOM_THROW(Errc::out_of_budget, "expert workset needs 3.00 GiB, budget 2.00 GiB");
  } catch (Error& e) {
    throw e.add_context("planning layer " + std::to_string(layer));
  }
}
}  // namespace

TEST_CASE("context accumulates and the message names the site") {
  try {
    try {
      read_layer(7);
    } catch (Error& e) {
      throw e.add_context("planning qwen3-30b-a3b");
    }
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::out_of_budget);
    CHECK(e.message() == "expert workset needs 3.00 GiB, budget 2.00 GiB");
    REQUIRE(e.context().size() == 2);
    const std::string what = e.what();
    CHECK(what.find("out of budget: expert workset needs 3.00 GiB") == 0);
    CHECK(what.find("tests/core/test_error.cpp:") != std::string::npos);
    CHECK(what.find("\n  while planning layer 7\n  while planning qwen3-30b-a3b") != std::string::npos);
  }
}

TEST_CASE("OOM_ASSERT reports the failed condition as an internal error") {
  const int budget = 1;
  try {
    OOM_ASSERT(budget > 2);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::internal);
    CHECK(std::string(e.what()).find("budget > 2") != std::string::npos);
  }
  CHECK_NOTHROW(OOM_ASSERT(budget == 1));
}

TEST_CASE("user_message: the site only where the fault is OOM's or a GPU library's") {
  try {
    read_layer(3);
    FAIL("no throw");
  } catch (const Error& e) {
    // Bad input or a budget: the message names the problem; a source line would be noise.
    CHECK(user_message(e) == "out of budget: expert workset needs 3.00 GiB, budget 2.00 GiB\n  while planning layer 3");
  }
  for (const Errc code : {Errc::internal, Errc::cuda, Errc::cublas, Errc::nccl}) {
    const Error e(code, "it broke", "/build/x/src/runtime/executor.cpp", 42);
    CAPTURE(to_string(code));
    CHECK(user_message(e) == std::string(to_string(code)) + ": it broke [src/runtime/executor.cpp:42]");
    CHECK(user_message(e) == e.what());
  }
  for (const Errc code : {Errc::invalid_argument, Errc::parse, Errc::io, Errc::out_of_budget, Errc::unsupported}) {
    const Error e(code, "bad", "/build/x/examples/common/cli_numbers.hpp", 64);
    CHECK(user_message(e) == std::string(to_string(code)) + ": bad");
  }
}
