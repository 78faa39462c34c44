// The GPU is reachable and pinned host<->device copies move the right bytes at a plausible rate.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>

#include "oom/core/bytes.hpp"
#include "oom/cuda/device.hpp"

using namespace oom::literals;

TEST_CASE("device_info describes every visible GPU") {
  const int n = oom::cuda::device_count();
  REQUIRE(n > 0);
  for (int d = 0; d < n; ++d) {
    const auto info = oom::cuda::device_info(d);
    std::printf("GPU %d: %s sm_%d%d, %d SMs, %s total, %s free\n", d, info.name.c_str(), info.sm_major,
                info.sm_minor, info.multiprocessors, oom::to_string(info.total_memory).c_str(),
                oom::to_string(info.free_memory).c_str());
    CHECK(info.multiprocessors > 0);
    CHECK(info.free_memory <= info.total_memory);
    CHECK(info.total_memory > 1_GiB);
  }
}

TEST_CASE("pinned copies round-trip and report bandwidth per direction") {
  const auto r = oom::cuda::measure_copy_bandwidth(0, 256_MiB, 8);
  std::printf("pinned H2D %.1f GB/s, D2H %.1f GB/s, both at once %.1f GB/s, pageable H2D %.1f GB/s (%s x %d)\n",
              r.h2d_bytes_per_s / 1e9, r.d2h_bytes_per_s / 1e9, r.bidir_bytes_per_s / 1e9,
              r.pageable_h2d_bytes_per_s / 1e9, oom::to_string(r.transfer).c_str(), r.repeats);
  CHECK(r.verified);
  // Any PCIe 3 x16 link or better moves >= 5 GB/s pinned; below that something is misconfigured.
  CHECK(r.h2d_bytes_per_s > 5e9);
  CHECK(r.d2h_bytes_per_s > 5e9);
  // Two directions at once never move fewer total bytes than the slower one alone (duplex link).
  CHECK(r.bidir_bytes_per_s > 0.9 * std::min(r.h2d_bytes_per_s, r.d2h_bytes_per_s));
}
