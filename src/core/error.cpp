// oom::Error rendering.
#include "oom/core/error.hpp"

#include <string>
#include <string_view>

namespace oom {

const char* to_string(Errc c) noexcept {
  switch (c) {
    case Errc::invalid_argument: return "invalid argument";
    case Errc::parse: return "parse error";
    case Errc::io: return "I/O error";
    case Errc::out_of_budget: return "out of budget";
    case Errc::cuda: return "CUDA error";
    case Errc::cublas: return "cuBLAS error";
    case Errc::nccl: return "NCCL error";
    case Errc::unsupported: return "unsupported";
    case Errc::internal: return "internal error";
  }
  return "error";
}

Error::Error(Errc code, std::string message, const char* file, int line)
    : code_(code), message_(std::move(message)), file_(file), line_(line) {
  render();
}

Error& Error::add_context(std::string what) {
  context_.push_back(std::move(what));
  render();
  return *this;
}

namespace {

/// "<category>: <message>", " [file:line]" where `located`, then the context lines.
std::string rendered(const Error& e, bool located) {
  std::string out = to_string(e.code());
  out += ": ";
  out += e.message();
  if (located && e.file() != nullptr) {
    std::string_view path = e.file();
    // Keep the path from the project's top folders on, not the build machine's absolute prefix.
    for (std::string_view top : {"/include/oom/", "/src/", "/examples/", "/tests/", "/bench/"}) {
      if (auto at = path.rfind(top); at != std::string_view::npos) {
        path = path.substr(at + 1);
        break;
      }
    }
    out += " [";
    out += path;
    out += ':';
    out += std::to_string(e.line());
    out += ']';
  }
  for (const auto& c : e.context()) {
    out += "\n  while ";
    out += c;
  }
  return out;
}

}  // namespace

void Error::render() { what_ = rendered(*this, true); }

std::string user_message(const Error& e) {
  const Errc c = e.code();
  return rendered(e, c == Errc::internal || c == Errc::cuda || c == Errc::cublas || c == Errc::nccl);
}

}  // namespace oom
