// GPU test support for code built only for sm_90a (wgmma), which loads on compute capability 9.0
// alone: whether the current device is one, and a skip (exit 77, ctest's SKIP_RETURN_CODE) that
// says why when it is not.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "oom/core/cuda_check.hpp"

namespace oom::test {

inline cudaDeviceProp current_device(int* dev) {
  OOM_CUDA_CHECK(cudaGetDevice(dev));
  cudaDeviceProp prop{};
  OOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, *dev));
  return prop;
}

inline bool device_is_sm90() {
  int dev = 0;
  const cudaDeviceProp prop = current_device(&dev);
  return prop.major == 9 && prop.minor == 0;
}

/// Exits 77 with the reason unless the current device is compute capability 9.0; names the device
/// once per process when it is.
inline void require_sm90(const char* test) {
  int dev = 0;
  const cudaDeviceProp prop = current_device(&dev);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("SKIPPED: %s needs a compute capability 9.0 GPU (H100/H200: wgmma is sm_90a only); "
                "device %d is %s, compute capability %d.%d\n",
                test, dev, prop.name, prop.major, prop.minor);
    std::fflush(stdout);
    std::exit(77);
  }
  static bool printed = false;
  if (!printed) {
    std::printf("%s on device %d: %s, compute capability %d.%d\n", test, dev, prop.name, prop.major, prop.minor);
    printed = true;
  }
}

}  // namespace oom::test
