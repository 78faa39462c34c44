// Log level, sink and serialised writes.
#include "oom/core/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "oom/core/error.hpp"

namespace oom {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("OOM_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return LogLevel::info;
  try {
    return parse_log_level(env);
  } catch (const Error&) {
    std::fprintf(stderr, "[oom warn] OOM_LOG_LEVEL='%s' is not one of trace, debug, info, warn, error, off; using info\n", env);
    return LogLevel::info;
  }
}

std::atomic<LogLevel>& level_slot() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}
LogSink& sink_slot() {
  static LogSink sink;
  return sink;
}

constexpr const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::trace: return "trace";
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warn: return "warn";
    case LogLevel::error: return "error";
    case LogLevel::off: return "off";
  }
  return "?";
}

}  // namespace

LogLevel log_level() noexcept { return level_slot().load(std::memory_order_relaxed); }
void set_log_level(LogLevel level) noexcept { level_slot().store(level, std::memory_order_relaxed); }

LogLevel parse_log_level(std::string_view text) {
  for (auto l : {LogLevel::trace, LogLevel::debug, LogLevel::info, LogLevel::warn, LogLevel::error, LogLevel::off})
    if (text == level_name(l)) return l;
  OOM_THROW(Errc::parse, fmt::format("unknown log level '{}' (trace, debug, info, warn, error, off)", text));
}

LogSink set_log_sink(LogSink sink) {
  std::lock_guard lock(sink_mutex());
  return std::exchange(sink_slot(), std::move(sink));
}

void log_write(LogLevel level, std::string_view message) {
  std::lock_guard lock(sink_mutex());
  if (sink_slot()) {
    sink_slot()(level, message);
    return;
  }
  std::fprintf(stderr, "[oom %s] %.*s\n", level_name(level), static_cast<int>(message.size()), message.data());
}

}  // namespace oom
