// The process's resident set, for tests that check what a reader leaves resident.
#pragma once

#include <fstream>
#include <string>

namespace oom::test {

/// The process's resident set, KiB: smaps_rollup's Rss (exact; /proc/self/status's VmRSS lags by
/// per-CPU counts on many kernels); -1 where /proc does not say.
inline long resident_kib() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  for (std::string line; std::getline(rollup, line);)
    if (line.rfind("Rss:", 0) == 0) return std::stol(line.substr(4));
  return -1;
}

}  // namespace oom::test
