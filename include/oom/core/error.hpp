// oom::Error: the one exception type of the library, carrying a category, where it was raised and
// a chain of context ("while planning layer 7", "while reading config.json"). No fmt here, so the
// header is usable from .cu translation units.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace oom {

enum class Errc : unsigned char {
  invalid_argument,  ///< a caller passed something malformed or inconsistent
  parse,             ///< a file or text could not be parsed (config.json, safetensors, JSON, sizes)
  io,                ///< a file could not be opened, read or written
  out_of_budget,     ///< a plan or allocation does not fit the memory budget it was given
  cuda,              ///< a CUDA runtime call failed
  cublas,            ///< a cuBLAS call failed
  nccl,              ///< an NCCL call failed
  unsupported,       ///< valid, but not something this build or device can do
  internal,          ///< a broken invariant of OOM itself (a bug)
};

/// Short name of a category: "invalid argument", "parse error", ...
const char* to_string(Errc c) noexcept;

class Error : public std::exception {
 public:
  Error(Errc code, std::string message, const char* file = nullptr, int line = 0);

  [[nodiscard]] Errc code() const noexcept { return code_; }
  /// The message as raised, without context or location.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  /// Outermost context last, as they were added while the exception travelled up.
  [[nodiscard]] const std::vector<std::string>& context() const noexcept { return context_; }
  [[nodiscard]] const char* file() const noexcept { return file_; }
  [[nodiscard]] int line() const noexcept { return line_; }

  /// Adds "while <what>" to the message; returns *this so `catch (Error& e) { throw e.add_context(..); }`
  /// rethrows the same object with more to say.
  Error& add_context(std::string what);

  /// "<category>: <message> [file:line]" then one "  while <context>" line per context, outermost last.
  [[nodiscard]] const char* what() const noexcept override { return what_.c_str(); }

 private:
  void render();

  Errc code_;
  std::string message_;
  std::vector<std::string> context_;
  const char* file_;
  int line_;
  std::string what_;
};

/// What a program shows its user: "<category>: <message>" and the context lines, as what(), with
/// the source location only where the fault is OOM's or a GPU library's (Errc::internal, cuda,
/// cublas, nccl: the line a bug report needs); for bad input, a budget or an unsupported request
/// the message names the problem and the location is noise.
std::string user_message(const Error& e);

}  // namespace oom

/// Throws oom::Error with the caller's file and line.
#define OOM_THROW(code, message) throw ::oom::Error((code), (message), __FILE__, __LINE__)

/// Checks an invariant of OOM itself; on failure throws Errc::internal naming the condition.
#define OOM_ASSERT(cond)                                                                        \
  do {                                                                                          \
    if (!(cond)) OOM_THROW(::oom::Errc::internal, std::string("assertion failed: ") + #cond); \
  } while (0)
