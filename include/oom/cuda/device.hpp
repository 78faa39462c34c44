// GPU discovery and the pinned host<->device copy measurement (the first physical limit every
// other figure is a ratio against). Declarations parse without CUDA headers; link oom::cuda.
#pragma once

#include <string>
#include <string_view>

#include "oom/core/bytes.hpp"

namespace oom::cuda {

/// Number of usable GPUs; 0 (never an exception) when there is no driver or no device, so tests
/// and programs can skip with a message instead of failing.
int device_count() noexcept;

/// Why device_count() is 0: which case it is, for a program to choose its advice by, and the
/// words to print, with the CUDA error in parentheses ("no NVIDIA driver was found on this machine
/// (cudaErrorInsufficientDriver: ...)", "no NVIDIA GPU was found ...").
struct NoDevice {
  enum class Kind : unsigned char {
    none,        ///< device_count() > 0; reason is empty
    no_driver,   ///< no NVIDIA driver loaded
    old_driver,  ///< a driver older than this build's CUDA runtime
    hidden,      ///< no GPU visible, CUDA_VISIBLE_DEVICES set (it may hide the GPUs there are)
    no_gpu,      ///< a driver, and no GPU (or the runtime counts 0)
    other,       ///< any other CUDA error; reason names it
  };
  Kind kind = Kind::none;
  std::string reason;
};
NoDevice why_no_device();
/// why_no_device().reason: empty when device_count() > 0.
std::string no_device_reason();
/// What a user can do about `kind` whatever the program ("name the GPUs in CUDA_VISIBLE_DEVICES, or
/// unset it", "update the NVIDIA driver"); empty where only the program knows (no GPU on the machine:
/// run elsewhere, or on the CPU).
std::string_view no_device_remedy(NoDevice::Kind kind) noexcept;
/// The refusal of a program whose `--backend` picks cuda or host, asked for cuda without a GPU:
/// "--backend cuda: no usable GPU (<reason>); <remedy>, or run on the CPU with --backend host";
/// where the host backend cannot run what was asked (host_runs_it false), no mention of it.
std::string backend_cuda_refusal(const NoDevice& why, bool host_runs_it = true);

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0;
  int sm_minor = 0;
  int multiprocessors = 0;
  Bytes total_memory;
  Bytes free_memory;
};
/// `device`'s properties and memory (it makes the device current, and a context on it).
DeviceInfo device_info(int device);
/// The same without touching the device (no context made): free_memory is left 0, total_memory
/// is the device's global memory as its properties give it.
DeviceInfo device_properties(int device);

struct CopyBandwidth {
  double h2d_bytes_per_s = 0;     ///< pinned host -> device, alone
  double d2h_bytes_per_s = 0;     ///< device -> pinned host, alone
  double bidir_bytes_per_s = 0;   ///< both directions at once, bytes of both counted
  double pageable_h2d_bytes_per_s = 0;
  Bytes transfer;                 ///< bytes per copy
  int repeats = 0;
  bool verified = false;          ///< the bytes that came back equal the bytes sent
};

/// Copies `size` bytes between a pinned host buffer and `device` `repeats` times per direction on
/// separate streams, timed with CUDA events after one warm-up, and checks the round trip.
CopyBandwidth measure_copy_bandwidth(int device, Bytes size, int repeats);

}  // namespace oom::cuda
