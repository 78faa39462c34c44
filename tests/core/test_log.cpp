// Logging: level threshold, replaceable sink, fmt formatting of OOM's vocabulary types.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"

using namespace oom;
using namespace oom::literals;

TEST_CASE("messages below the level are dropped, others reach the sink whole") {
  std::vector<std::pair<LogLevel, std::string>> seen;
  auto previous = set_log_sink([&](LogLevel l, std::string_view m) { seen.emplace_back(l, std::string(m)); });
  const LogLevel old_level = log_level();
  set_log_level(LogLevel::info);
  log_debug("hidden {}", 1);
  log_info("budget {} on {} in {}", 80_GiB, MemorySpace::device(1), DType::bf16);
  log_warn("slab {}", MemorySpace::pinned_host());
  set_log_level(LogLevel::off);
  log_error("also hidden");
  set_log_level(old_level);
  set_log_sink(previous);
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].first == LogLevel::info);
  CHECK(seen[0].second == "budget 80.00 GiB on cuda:1 in bf16");
  CHECK(seen[1].second == "slab pinned");
}

TEST_CASE("concurrent writers never interleave within a message") {
  std::vector<std::string> seen;
  auto previous = set_log_sink([&](LogLevel, std::string_view m) { seen.emplace_back(m); });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) log_info("thread {} message {}", t, i);
    });
  for (auto& th : threads) th.join();
  set_log_sink(previous);
  CHECK(seen.size() == 800);
  for (const auto& m : seen) CHECK(m.rfind("thread ", 0) == 0);
}

TEST_CASE("log levels parse by name") {
  CHECK(parse_log_level("debug") == LogLevel::debug);
  CHECK(parse_log_level("off") == LogLevel::off);
  CHECK_THROWS_AS((void)parse_log_level("loud"), Error);
}
