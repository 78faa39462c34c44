// GPU discovery and pinned copy bandwidth measurement (see oom/cuda/device.hpp).
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/cuda/device.hpp"

namespace oom::cuda {

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later queries start clean
    return 0;
  }
  return n;
}

NoDevice why_no_device() {
  using Kind = NoDevice::Kind;
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (status == cudaSuccess) {
    if (n > 0) return {};
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
      return {Kind::hidden, std::string("the CUDA runtime reports 0 devices (CUDA_VISIBLE_DEVICES is '") + visible + "')"};
    return {Kind::no_gpu, "the CUDA runtime reports 0 devices"};
  }
  const std::string error = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
  if (status == cudaErrorInsufficientDriver) {
    // Without any driver the runtime says the driver is "insufficient", as if an update would do;
    // the driver's version tells the two apart.
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);  // 0 where no driver is loaded
    (void)cudaRuntimeGetVersion(&runtime);
    const auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    if (driver == 0) return {Kind::no_driver, "no NVIDIA driver was found on this machine (" + error + ")"};
    return {Kind::old_driver, "the NVIDIA driver supports CUDA " + version(driver) + ", older than this build's CUDA runtime " +
                                  version(runtime) + " (" + error + ")"};
  }
  if (status == cudaErrorNoDevice) {
    // The GPUs may be there but hidden from this process (a scheduler's or a user's setting).
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
      return {Kind::hidden,
              std::string("no NVIDIA GPU is visible to this process (CUDA_VISIBLE_DEVICES is '") + visible + "', " + error + ")"};
    return {Kind::no_gpu, "no NVIDIA GPU was found on this machine (" + error + ")"};
  }
  return {Kind::other, error};
}

std::string no_device_reason() { return why_no_device().reason; }

std::string_view no_device_remedy(NoDevice::Kind kind) noexcept {
  switch (kind) {
    case NoDevice::Kind::hidden: return "name the GPUs in CUDA_VISIBLE_DEVICES, or unset it";
    case NoDevice::Kind::old_driver: return "update the NVIDIA driver";
    default: return {};
  }
}

std::string backend_cuda_refusal(const NoDevice& why, bool host_runs_it) {
  const std::string_view remedy = no_device_remedy(why.kind);
  const std::string head = "--backend cuda: no usable GPU (" + why.reason + "); ";
  if (!host_runs_it) return head + (remedy.empty() ? std::string("run it where an NVIDIA GPU is") : std::string(remedy));
  return head + (remedy.empty() ? std::string() : std::string(remedy) + ", or ") + "run on the CPU with --backend host";
}

DeviceInfo device_properties(int device) {
  cudaDeviceProp prop{};
  OOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo info;
  info.index = device;
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.total_memory = Bytes{prop.totalGlobalMem};
  return info;
}

DeviceInfo device_info(int device) {
  DeviceInfo info = device_properties(device);
  OOM_CUDA_CHECK(cudaSetDevice(device));
  std::size_t free_b = 0, total_b = 0;
  OOM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  info.total_memory = Bytes{total_b};
  info.free_memory = Bytes{free_b};
  return info;
}

namespace {

// Owns the buffers and streams of one measurement so an exception midway frees them.
struct CopyRig {
  std::size_t n = 0;
  unsigned char* host_a = nullptr;  // pinned, sent up
  unsigned char* host_b = nullptr;  // pinned, received down
  unsigned char* dev_a = nullptr;
  unsigned char* dev_b = nullptr;
  cudaStream_t up = nullptr, down = nullptr;
  cudaEvent_t start_up = nullptr, stop_up = nullptr, start_down = nullptr, stop_down = nullptr;

  explicit CopyRig(std::size_t bytes) : n(bytes) {
    OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_a), n, cudaHostAllocDefault));
    OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_b), n, cudaHostAllocDefault));
    OOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_a), n));
    OOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_b), n));
    OOM_CUDA_CHECK(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
    OOM_CUDA_CHECK(cudaStreamCreateWithFlags(&down, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&start_up, &stop_up, &start_down, &stop_down}) OOM_CUDA_CHECK(cudaEventCreate(e));
  }
  ~CopyRig() {
    for (cudaEvent_t e : {start_up, stop_up, start_down, stop_down})
      if (e) cudaEventDestroy(e);
    if (up) cudaStreamDestroy(up);
    if (down) cudaStreamDestroy(down);
    cudaFree(dev_a);
    cudaFree(dev_b);
    cudaFreeHost(host_a);
    cudaFreeHost(host_b);
  }
  CopyRig(const CopyRig&) = delete;
  CopyRig& operator=(const CopyRig&) = delete;

  // Seconds for `repeats` copies on `stream`, timed by events on that stream.
  double time_copies(void* dst, const void* src, cudaMemcpyKind kind, cudaStream_t stream, cudaEvent_t start,
                     cudaEvent_t stop, int repeats) {
    OOM_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < repeats; ++i) OOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, kind, stream));
    OOM_CUDA_CHECK(cudaEventRecord(stop, stream));
    OOM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    OOM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
};

}  // namespace

CopyBandwidth measure_copy_bandwidth(int device, Bytes size, int repeats) {
  if (repeats < 1 || size.count() == 0)
    OOM_THROW(Errc::invalid_argument, "measure_copy_bandwidth needs a positive size and repeat count");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  CopyRig rig(size.count());
  for (std::size_t i = 0; i < rig.n; ++i) rig.host_a[i] = static_cast<unsigned char>(i * 2654435761u >> 24);
  std::memset(rig.host_b, 0, rig.n);

  const double total = static_cast<double>(rig.n) * repeats;
  // Warm up both directions (first-touch mappings, clocks), then time each alone.
  OOM_CUDA_CHECK(cudaMemcpyAsync(rig.dev_a, rig.host_a, rig.n, cudaMemcpyHostToDevice, rig.up));
  OOM_CUDA_CHECK(cudaMemcpyAsync(rig.dev_b, rig.dev_a, rig.n, cudaMemcpyDeviceToDevice, rig.up));
  OOM_CUDA_CHECK(cudaStreamSynchronize(rig.up));
  OOM_CUDA_CHECK(cudaMemcpyAsync(rig.host_b, rig.dev_b, rig.n, cudaMemcpyDeviceToHost, rig.down));
  OOM_CUDA_CHECK(cudaStreamSynchronize(rig.down));

  CopyBandwidth r;
  r.transfer = size;
  r.repeats = repeats;
  r.verified = std::memcmp(rig.host_a, rig.host_b, rig.n) == 0;

  r.h2d_bytes_per_s = total / rig.time_copies(rig.dev_a, rig.host_a, cudaMemcpyHostToDevice, rig.up,
                                              rig.start_up, rig.stop_up, repeats);
  r.d2h_bytes_per_s = total / rig.time_copies(rig.host_b, rig.dev_b, cudaMemcpyDeviceToHost, rig.down,
                                              rig.start_down, rig.stop_down, repeats);

  // Both directions at once: start both streams from one host-side event so neither leads.
  OOM_CUDA_CHECK(cudaDeviceSynchronize());
  OOM_CUDA_CHECK(cudaEventRecord(rig.start_up, rig.up));
  OOM_CUDA_CHECK(cudaStreamWaitEvent(rig.down, rig.start_up));
  for (int i = 0; i < repeats; ++i) {
    OOM_CUDA_CHECK(cudaMemcpyAsync(rig.dev_a, rig.host_a, rig.n, cudaMemcpyHostToDevice, rig.up));
    OOM_CUDA_CHECK(cudaMemcpyAsync(rig.host_b, rig.dev_b, rig.n, cudaMemcpyDeviceToHost, rig.down));
  }
  OOM_CUDA_CHECK(cudaEventRecord(rig.stop_down, rig.down));
  OOM_CUDA_CHECK(cudaStreamWaitEvent(rig.up, rig.stop_down));
  OOM_CUDA_CHECK(cudaEventRecord(rig.stop_up, rig.up));
  OOM_CUDA_CHECK(cudaEventSynchronize(rig.stop_up));
  float both_ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&both_ms, rig.start_up, rig.stop_up));
  r.bidir_bytes_per_s = 2.0 * total / (both_ms * 1e-3);

  // Pageable source, for contrast: what per-tensor unpinned transfers cost.
  std::vector<unsigned char> pageable(rig.n, 1);
  r.pageable_h2d_bytes_per_s =
      total / rig.time_copies(rig.dev_a, pageable.data(), cudaMemcpyHostToDevice, rig.up, rig.start_up,
                              rig.stop_up, repeats);
  return r;
}

}  // namespace oom::cuda
