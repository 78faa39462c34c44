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
