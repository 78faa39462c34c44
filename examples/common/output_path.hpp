// Path arguments of the example programs, checked when the options are read: a run must not fail
// at its end (its work lost) over a path it could have refused at its start, nor write one of its
// files over another it reads or writes.
#pragma once

#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom::examples {

/// A write past the file-size limit (`ulimit -f`) fails with EFBIG, which the program reports
/// naming the file and what is as it was, instead of raising SIGXFSZ, whose default action killed
/// the program with no word (and a temporary file left behind). Call first in main.
inline void fail_oversized_writes_with_errors() { std::signal(SIGXFSZ, SIG_IGN); }

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

/// `text`, the path a flag names; an empty one throws invalid_argument naming `flag`. Each
/// optional path flag had taken "" as "not given" and used its default (the built-in profile, the
/// planner instead of --plan, the built-in model), with no word that the path was lost.
inline std::string path_argument(std::string_view flag, std::string_view text) {
  if (text.empty()) OOM_THROW(Errc::invalid_argument, fmt::format("{} needs a path, got ''", flag));
  return std::string(text);
}

/// Whether `a` and `b` name one file: where both exist, the same file (through a link, a hard
/// link or another spelling); else the same path once absolute, with `.` and `..` folded and the
/// links of the part that exists resolved (std::filesystem::weakly_canonical).
inline bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) {
    const bool same = fs::equivalent(a, b, ec);
    if (!ec) return same;
  }
  const auto resolved = [](const fs::path& p) {
    std::error_code e;
    const fs::path absolute = fs::absolute(p, e);  // first: a relative path none of which exists would stay relative
    fs::path r = fs::weakly_canonical(absolute, e);
    return e ? absolute.lexically_normal() : r;
  };
  return resolved(a) == resolved(b);
}

/// A path named by a flag; `flag` may say which of its files it is ("--trace (its prediction)").
struct PathArgument {
  std::string flag;
  std::filesystem::path path;
};

/// Throws invalid_argument naming both flags and paths where an output is the same file as an input
/// (it would be written over what the run read: --json onto --model replaced the config with the
/// plan) or as another output (the later write would leave only one of them, though both are said
/// to be written). Empty paths (flags not given) are skipped.
inline void refuse_overlapping_paths(const std::vector<PathArgument>& outputs, const std::vector<PathArgument>& inputs) {
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    const PathArgument& out = outputs[o];
    if (out.path.empty()) continue;
    for (const PathArgument& in : inputs)
      if (!in.path.empty() && same_file(out.path, in.path))
        OOM_THROW(Errc::invalid_argument, fmt::format("{} {} is the same file as {} {}: writing it would destroy that input",
                                                      out.flag, out.path.string(), in.flag, in.path.string()));
    for (std::size_t e = 0; e < o; ++e)
      if (!outputs[e].path.empty() && same_file(out.path, outputs[e].path))
        OOM_THROW(Errc::invalid_argument, fmt::format("{} {} is the same file as {} {}: one would be written over the other",
                                                      out.flag, out.path.string(), outputs[e].flag, outputs[e].path.string()));
  }
}

}  // namespace oom::examples
