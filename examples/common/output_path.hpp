// Output files of the example programs, checked when the options are read: a run must not fail at
// its end (its work lost) over a path it could have refused at its start.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom::examples {

/// Throws invalid_argument naming `flag` and the path when `path` cannot take a file: empty, a
/// directory, something that is neither a regular file nor a link (a device, a FIFO: a rename over
/// it would replace it), or in a directory that does not exist or cannot be written.
inline void require_output_file(std::string_view flag, const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  if (path.empty()) OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a file name", flag));
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (fs::is_directory(st) || !path.has_filename())
    OOM_THROW(Errc::invalid_argument, fmt::format("{} {}: a directory, not a file name", flag, path.string()));
  if (fs::exists(st) && !fs::is_regular_file(st) && !fs::is_symlink(st))
    OOM_THROW(Errc::invalid_argument, fmt::format("{} {}: exists and is not a regular file (a device or a FIFO is never written over)",
                                                  flag, path.string()));
  fs::path dir = fs::absolute(path, ec).parent_path();
  if (ec) OOM_THROW(Errc::invalid_argument, fmt::format("{} {}: {}", flag, path.string(), ec.message()));
  if (!fs::is_directory(dir, ec))
    OOM_THROW(Errc::invalid_argument, fmt::format("{} {}: the directory {} does not exist", flag, path.string(), dir.string()));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("{} {}: the directory {} cannot be written", flag, path.string(), dir.string()));
}

}  // namespace oom::examples
