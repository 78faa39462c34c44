// Several GPUs of one node: checks, NCCL communicators, collectives (see oom/cuda/device_group.hpp).
#include "oom/cuda/device_group.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/core/nccl_check.hpp"

namespace oom::cuda {

void check_group(int gpus, std::span<const DeviceInfo> visible) {
  if (gpus < 1) OOM_THROW(Errc::invalid_argument, fmt::format("a device group needs at least 1 GPU; {} asked for", gpus));
  if (static_cast<std::size_t>(gpus) > visible.size()) {
    const char* mask = std::getenv("CUDA_VISIBLE_DEVICES");
    OOM_THROW(Errc::unsupported,
              fmt::format("{} GPU{} asked for, but {} {} visible{}", gpus, gpus == 1 ? "" : "s", visible.size(), visible.size() == 1 ? "is" : "are",
                          mask != nullptr ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", mask) : std::string{}));
  }
  const DeviceInfo& first = visible[0];
  for (std::size_t r = 1; r < static_cast<std::size_t>(gpus); ++r) {
    const DeviceInfo& d = visible[r];
    if (d.total_memory != first.total_memory)
      OOM_THROW(Errc::unsupported,
                fmt::format("GPU {} ({}, {}) differs in memory from GPU 0 ({}, {}): a plan budgets the same memory "
                            "on every GPU of a group",
                            r, d.name, to_string(d.total_memory), first.name, to_string(first.total_memory)));
    if (d.sm_major != first.sm_major || d.sm_minor != first.sm_minor)
      OOM_THROW(Errc::unsupported,
                fmt::format("GPU {} ({}, compute capability {}.{}) differs in compute capability from GPU 0 ({}, {}.{}): "
                            "every GPU of a group runs the same kernels",
                            r, d.name, d.sm_major, d.sm_minor, first.name, first.sm_major, first.sm_minor));
  }
}

namespace {

/// Restores the calling thread's current device on the way out, so the group's per-GPU work does
/// not leave a caller on another GPU than it chose.
struct CurrentDevice {
  int saved = 0;
  CurrentDevice() { OOM_CUDA_CHECK(cudaGetDevice(&saved)); }
  ~CurrentDevice() { (void)cudaSetDevice(saved); }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
};

/// ncclGroupStart .. ncclGroupEnd, ended even when a call between them throws (NCCL's group state
/// is per thread: one left open would swallow the thread's next collectives).
class NcclGroup {
 public:
  NcclGroup() { OOM_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    OOM_NCCL_CHECK(ncclGroupEnd());
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

/// The properties of every visible GPU, without making a context on any of them.
std::vector<DeviceInfo> visible_devices() {
  std::vector<DeviceInfo> out;
  for (int d = 0, n = device_count(); d < n; ++d) out.push_back(device_properties(d));
  return out;
}

}  // namespace

struct DeviceGroup::Impl {
  std::vector<DeviceInfo> info;
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;

  ~Impl() {
    int saved = 0;
    const bool restore = cudaGetDevice(&saved) == cudaSuccess;
    for (ncclComm_t c : comms)
      if (c != nullptr) (void)ncclCommDestroy(c);
    for (std::size_t r = 0; r < streams.size(); ++r)
      if (streams[r] != nullptr && cudaSetDevice(static_cast<int>(r)) == cudaSuccess) (void)cudaStreamDestroy(streams[r]);
    if (restore) (void)cudaSetDevice(saved);
  }

  [[nodiscard]] int size() const noexcept { return static_cast<int>(info.size()); }

  void check_buffers(std::size_t buffers, const char* which, const char* op) const {
    if (buffers != info.size())
      OOM_THROW(Errc::invalid_argument,
                fmt::format("DeviceGroup::{}: {} {} buffers for a group of {} GPUs", op, buffers, which, info.size()));
  }
  /// `call(r, comm, stream)` for every rank, in one NCCL group, the caller's device kept.
  template <class Call>
  void each_rank(Call&& call) const {
    CurrentDevice keep;
    NcclGroup group;
    for (std::size_t r = 0; r < info.size(); ++r) OOM_NCCL_CHECK(call(r, comms[r], streams[r]));
    group.end();
  }

  void check_count(std::size_t count, const char* op) const {
    if (count % info.size() != 0)
      OOM_THROW(Errc::invalid_argument,
                fmt::format("DeviceGroup::{}: {} floats do not split into {} equal shards", op, count, info.size()));
  }
};

DeviceGroup::DeviceGroup(int gpus) : impl_(std::make_unique<Impl>()) {
  const std::vector<DeviceInfo> visible = visible_devices();
  check_group(gpus, visible);
  CurrentDevice keep;
  // One reduction order for the run (see the header); never NVLink multicast on shared machines.
  setenv("NCCL_ALGO", "Ring", /*overwrite=*/0);
  setenv("NCCL_PROTO", "Simple", /*overwrite=*/0);
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<int> devices(gpus);
  for (int r = 0; r < gpus; ++r) {
    devices[r] = r;
    impl_->info.push_back(device_info(r));
    impl_->streams.push_back(nullptr);
    OOM_CUDA_CHECK(cudaSetDevice(r));
    OOM_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->streams.back(), cudaStreamNonBlocking));
  }
  impl_->comms.assign(gpus, nullptr);
  OOM_NCCL_CHECK(ncclCommInitAll(impl_->comms.data(), gpus, devices.data()));
}

DeviceGroup::~DeviceGroup() = default;
DeviceGroup::DeviceGroup(DeviceGroup&&) noexcept = default;
DeviceGroup& DeviceGroup::operator=(DeviceGroup&&) noexcept = default;

int DeviceGroup::size() const noexcept { return impl_ ? impl_->size() : 0; }

const DeviceGroup::Impl& DeviceGroup::live(int rank) const {
  if (!impl_) OOM_THROW(Errc::invalid_argument, "DeviceGroup: used after it was moved from");
  if (rank < -1 || rank >= impl_->size())
    OOM_THROW(Errc::invalid_argument, fmt::format("DeviceGroup: rank {} of a group of {} GPUs", rank, impl_->size()));
  return *impl_;
}

const DeviceInfo& DeviceGroup::info(int rank) const { return live(rank).info[static_cast<std::size_t>(rank)]; }
CUstream_st* DeviceGroup::stream(int rank) const { return live(rank).streams[static_cast<std::size_t>(rank)]; }
ncclComm* DeviceGroup::comm(int rank) const { return live(rank).comms[static_cast<std::size_t>(rank)]; }

std::size_t DeviceGroup::shard(std::size_t count) const { return count / live().info.size(); }

void DeviceGroup::reduce_scatter_sum(std::span<const float* const> send, std::span<float* const> recv,
                                     std::size_t count) const {
  live().check_buffers(send.size(), "send", "reduce_scatter_sum");
  impl_->check_buffers(recv.size(), "receive", "reduce_scatter_sum");
  impl_->check_count(count, "reduce_scatter_sum");
  if (count == 0) return;
  const std::size_t s = shard(count);
  impl_->each_rank([&](std::size_t r, ncclComm_t comm, cudaStream_t stream) {
    return ncclReduceScatter(send[r], recv[r], s, ncclFloat, ncclSum, comm, stream);
  });
}

void DeviceGroup::all_gather(std::span<const float* const> send, std::span<float* const> recv, std::size_t count) const {
  live().check_buffers(send.size(), "send", "all_gather");
  impl_->check_buffers(recv.size(), "receive", "all_gather");
  impl_->check_count(count, "all_gather");
  if (count == 0) return;
  const std::size_t s = shard(count);
  impl_->each_rank([&](std::size_t r, ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(send[r], recv[r], s, ncclFloat, comm, stream);
  });
}

void DeviceGroup::all_reduce_sum(std::span<float* const> data, std::size_t count) const {
  live().check_buffers(data.size(), "data", "all_reduce_sum");
  const std::size_t s = shard(count);
  const std::size_t body = s * static_cast<std::size_t>(size());
  std::vector<const float*> whole(data.begin(), data.end());
  std::vector<float*> own(data.size());  // rank r's shard of its own buffer: reduced there in place
  for (int r = 0; r < size(); ++r) own[r] = data[r] + static_cast<std::size_t>(r) * s;
  const std::vector<const float*> own_in(own.begin(), own.end());
  // Stream order runs the all-gather after the reduce-scatter has written each rank's shard.
  reduce_scatter_sum(whole, own, body);
  all_gather(own_in, data, body);
  if (body == count) return;
  impl_->each_rank([&](std::size_t r, ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(data[r] + body, data[r] + body, count - body, ncclFloat, ncclSum, comm, stream);
  });
}

void DeviceGroup::synchronize() const {
  (void)live();
  CurrentDevice keep;
  for (int r = 0; r < size(); ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    OOM_CUDA_CHECK(cudaStreamSynchronize(impl_->streams[r]));
  }
}

}  // namespace oom::cuda
