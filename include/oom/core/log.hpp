// Logging through fmt, to stderr by default, with a level from OOM_LOG_LEVEL (trace, debug, info,
// warn, error, off) and a replaceable sink. Host-only (fmt does not compile inside nvcc C++20 units).
#pragma once

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <functional>
#include <string_view>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/core/memory_space.hpp"

namespace oom {

enum class LogLevel : unsigned char { trace, debug, info, warn, error, off };

/// The current threshold; read once from OOM_LOG_LEVEL (default info), then set_log_level's.
LogLevel log_level() noexcept;
void set_log_level(LogLevel level) noexcept;
/// Parses "trace" … "off"; throws oom::Error naming the text otherwise.
LogLevel parse_log_level(std::string_view text);

using LogSink = std::function<void(LogLevel, std::string_view)>;
/// Replaces where messages go (nullptr restores stderr). Returns the previous sink.
LogSink set_log_sink(LogSink sink);

/// Writes one message at `level`, whole, even when threads log at once.
void log_write(LogLevel level, std::string_view message);

template <class... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level < log_level()) return;
  log_write(level, fmt::format(format, std::forward<Args>(args)...));
}
template <class... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... a) { log(LogLevel::debug, f, std::forward<Args>(a)...); }
template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... a) { log(LogLevel::info, f, std::forward<Args>(a)...); }
template <class... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... a) { log(LogLevel::warn, f, std::forward<Args>(a)...); }
template <class... Args>
void log_error(fmt::format_string<Args...> f, Args&&... a) { log(LogLevel::error, f, std::forward<Args>(a)...); }

}  // namespace oom

template <>
struct fmt::formatter<oom::Bytes> : fmt::formatter<std::string_view> {
  auto format(oom::Bytes b, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oom::to_string(b), ctx);
  }
};
template <>
struct fmt::formatter<oom::DType> : fmt::formatter<std::string_view> {
  auto format(oom::DType t, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oom::name(t), ctx);
  }
};
template <>
struct fmt::formatter<oom::MemorySpace> : fmt::formatter<std::string_view> {
  auto format(oom::MemorySpace s, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oom::to_string(s), ctx);
  }
};
