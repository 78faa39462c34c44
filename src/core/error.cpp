// oom::Error rendering.
#include "oom/core/error.hpp"

#include <string>

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

void Error::render() {
  what_ = to_string(code_);
  what_ += ": ";
  what_ += message_;
  if (file_ != nullptr) {
    std::string_view path = file_;
    // Keep the path from the project's top folders on, not the build machine's absolute prefix.
    for (std::string_view top : {"/include/oom/", "/src/", "/examples/", "/tests/", "/bench/"}) {
      if (auto at = path.rfind(top); at != std::string_view::npos) {
        path = path.substr(at + 1);
        break;
      }
    }
    what_ += " [";
    what_ += path;
    what_ += ':';
    what_ += std::to_string(line_);
    what_ += ']';
  }
  for (const auto& c : context_) {
    what_ += "\n  while ";
    what_ += c;
  }
}

}  // namespace oom
