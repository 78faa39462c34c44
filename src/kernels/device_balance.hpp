// A device's balance between its tensor cores and its memory, from the attributes CUDA reports:
// what decides whether the grouped dW is bound by memory (ExpertGemmStreamsOptions::row_sm_share).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "batch_parts.hpp"

namespace oom::kernels::detail {

/// Dense bf16 tensor FLOPs per clock and SM on compute capability 9.0, where the wgmma kernels run.
inline constexpr double sm90_bf16_flops_per_clock_per_sm = 4096;

struct DeviceBalance {
  int sms = 0, clock_khz = 0, memory_clock_khz = 0, bus_bits = 0;
  double flops_per_byte = 0;  ///< device_balance of the above (0 when an attribute is missing)
};

/// Reads `device`'s attributes into *out.
inline cudaError_t query_device_balance(int device, DeviceBalance* out) {
  DeviceBalance b;
  for (const auto& [attr, value] : {std::pair{cudaDevAttrMultiProcessorCount, &b.sms}, std::pair{cudaDevAttrClockRate, &b.clock_khz},
                                    std::pair{cudaDevAttrMemoryClockRate, &b.memory_clock_khz},
                                    std::pair{cudaDevAttrGlobalMemoryBusWidth, &b.bus_bits}})
    if (const cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess) return e;
  b.flops_per_byte = device_balance(b.sms, b.clock_khz, b.memory_clock_khz, b.bus_bits, sm90_bf16_flops_per_clock_per_sm);
  *out = b;
  return cudaSuccess;
}

}  // namespace oom::kernels::detail
