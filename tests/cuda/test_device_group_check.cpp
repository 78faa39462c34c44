// Which GPUs can form one group is decided before any of them is touched: these run without a GPU.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/cuda/device.hpp"
#include "oom/cuda/device_group.hpp"

using namespace oom::literals;
using oom::Errc;
using oom::cuda::DeviceInfo;

namespace {

DeviceInfo gpu(int index, const char* name, oom::Bytes memory, int major = 9, int minor = 0) {
  DeviceInfo d;
  d.index = index;
  d.name = name;
  d.sm_major = major;
  d.sm_minor = minor;
  d.multiprocessors = 132;
  d.total_memory = memory;
  return d;
}

/// The refusal's category and text, or "" when the group is accepted.
std::string refusal(int gpus, const std::vector<DeviceInfo>& visible, Errc* code = nullptr) {
  try {
    oom::cuda::check_group(gpus, visible);
    return "";
  } catch (const oom::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.message();
  }
}

}  // namespace

TEST_CASE("a group of equal GPUs, up to the ones visible, is accepted") {
  const std::vector<DeviceInfo> two{gpu(0, "NVIDIA H200", 140_GiB), gpu(1, "NVIDIA H200", 140_GiB)};
  CHECK(refusal(1, two).empty());
  CHECK(refusal(2, two).empty());
  // Only the GPUs of the group are compared: a third, different one is not in a group of two.
  auto three = two;
  three.push_back(gpu(2, "NVIDIA H100 80GB HBM3", 80_GiB));
  CHECK(refusal(2, three).empty());
}

TEST_CASE("too few GPUs visible, or none asked for, is refused by name") {
  const std::vector<DeviceInfo> one{gpu(0, "NVIDIA H200", 140_GiB)};
  Errc code{};
  unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK(refusal(2, one, &code) == "2 GPUs asked for, but 1 is visible");
  CHECK(code == Errc::unsupported);
  CHECK(refusal(1, {}, &code) == "1 GPU asked for, but 0 are visible");
  setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  CHECK(refusal(2, one) == "2 GPUs asked for, but 1 is visible (CUDA_VISIBLE_DEVICES=3)");
  unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK(refusal(0, one, &code) == "a device group needs at least 1 GPU; 0 asked for");
  CHECK(code == Errc::invalid_argument);
  CHECK(refusal(-1, one, &code).find("-1 asked for") != std::string::npos);
}

TEST_CASE("GPUs of different memory or compute capability in one group are refused, naming both") {
  Errc code{};
  const std::vector<DeviceInfo> mixed{gpu(0, "NVIDIA H200", 140_GiB), gpu(1, "NVIDIA H100 80GB HBM3", 80_GiB)};
  const std::string why = refusal(2, mixed, &code);
  CHECK(code == Errc::unsupported);
  CHECK(why.find("GPU 1 (NVIDIA H100 80GB HBM3, 80.00 GiB)") != std::string::npos);
  CHECK(why.find("GPU 0 (NVIDIA H200, 140.00 GiB)") != std::string::npos);
  CHECK(why.find("differs in memory from GPU 0") != std::string::npos);
  CHECK(why.find("same memory on every GPU") != std::string::npos);

  const std::vector<DeviceInfo> arch{gpu(0, "A", 24_GiB, 8, 9), gpu(1, "B", 24_GiB, 9, 0)};
  const std::string arch_why = refusal(2, arch, &code);
  CHECK(code == Errc::unsupported);
  CHECK(arch_why.find("GPU 1 (B, compute capability 9.0)") != std::string::npos);
  CHECK(arch_why.find("differs in compute capability from GPU 0 (A, 8.9)") != std::string::npos);
}

// A missing GPU is refused with advice that fits its cause: a user told to "update the driver"
// when CUDA_VISIBLE_DEVICES hides the GPU would look in the wrong place.
TEST_CASE("a program asked for the GPU says what to do about its absence, by cause") {
  using oom::cuda::NoDevice;
  using Kind = NoDevice::Kind;
  CHECK(oom::cuda::backend_cuda_refusal({Kind::hidden, "no NVIDIA GPU is visible to this process (CUDA_VISIBLE_DEVICES is '-1')"}) ==
        "--backend cuda: no usable GPU (no NVIDIA GPU is visible to this process (CUDA_VISIBLE_DEVICES is '-1')); name the GPUs in "
        "CUDA_VISIBLE_DEVICES, or unset it, or run on the CPU with --backend host");
  CHECK(oom::cuda::backend_cuda_refusal({Kind::old_driver, "the NVIDIA driver supports CUDA 12.2"}) ==
        "--backend cuda: no usable GPU (the NVIDIA driver supports CUDA 12.2); update the NVIDIA driver, or run on the CPU with "
        "--backend host");
  // Where the host backend cannot run what was asked (a layer of GPU code alone), it is not offered.
  CHECK(oom::cuda::backend_cuda_refusal({Kind::no_gpu, "r"}, /*host_runs_it=*/false) ==
        "--backend cuda: no usable GPU (r); run it where an NVIDIA GPU is");
  CHECK(oom::cuda::backend_cuda_refusal({Kind::hidden, "r"}, /*host_runs_it=*/false) ==
        "--backend cuda: no usable GPU (r); name the GPUs in CUDA_VISIBLE_DEVICES, or unset it");
  for (const Kind kind : {Kind::no_driver, Kind::no_gpu, Kind::other}) {
    CHECK(oom::cuda::no_device_remedy(kind).empty());
    CHECK(oom::cuda::backend_cuda_refusal({kind, "r"}) == "--backend cuda: no usable GPU (r); run on the CPU with --backend host");
  }
  // This machine's own answer agrees with device_count(): a reason exactly when there is no GPU.
  const NoDevice here = oom::cuda::why_no_device();
  CHECK((here.kind == Kind::none) == (oom::cuda::device_count() > 0));
  CHECK(here.reason.empty() == (here.kind == Kind::none));
  CHECK(here.reason == oom::cuda::no_device_reason());
}
