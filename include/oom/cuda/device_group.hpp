// Several GPUs of one node driven by one process: the checks that they can form one group, their
// NCCL communicators, one communication stream each, and the collectives a data-parallel step
// needs (docs/multi-gpu.md, slice 1). Declarations parse without CUDA or NCCL headers; link
// oom::cuda.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "oom/cuda/device.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct ncclComm;     // ncclComm_t is ncclComm*

namespace oom::cuda {

/// Refuses, by name, `gpus` GPUs that cannot form one group out of `visible` (the node's GPUs as
/// the CUDA runtime numbers them, `device_properties` of each): fewer than 1 asked for
/// (Errc::invalid_argument); more than are visible (Errc::unsupported, naming CUDA_VISIBLE_DEVICES
/// where it is set); and, among the first `gpus`, a GPU whose memory or compute capability is not
/// GPU 0's (Errc::unsupported): the planner budgets one memory size for every GPU, and every GPU
/// must run the same kernels. Needs no GPU.
void check_group(int gpus, std::span<const DeviceInfo> visible);

/// The first `gpus` GPUs (0 .. gpus-1), checked by check_group, each with an NCCL communicator
/// (`ncclCommInitAll`) and a non-blocking communication stream. Rank r is device r.
///
/// Determinism: before the communicators are made it sets, where the environment does not,
/// NCCL_ALGO=Ring and NCCL_PROTO=Simple, so one reduction order holds for the whole run and a
/// collective gives the same bits every time on the same inputs; and NCCL_NVLS_ENABLE=0 (no NVLink
/// multicast on shared machines). They are process-wide: every NCCL user in the process sees them;
/// and NCCL reads some of them once, at its first use in the process, so a process that ran NCCL
/// before its first DeviceGroup keeps the settings it had then.
///
/// A moved-from group has size() 0 and refuses everything else (Errc::invalid_argument), as does
/// a rank outside the group. Destroying a group, like every call, leaves the calling thread's
/// current device as it was.
///
/// The collectives take one buffer per rank, on that rank's GPU, enqueue on the ranks'
/// communication streams in one NCCL group and return without waiting: order them after the
/// work that fills the buffers (an event waited on by `stream(r)`) and wait for them with
/// `synchronize()` or an event on `stream(r)`.
class DeviceGroup {
 public:
  explicit DeviceGroup(int gpus);
  ~DeviceGroup();
  DeviceGroup(DeviceGroup&&) noexcept;
  DeviceGroup& operator=(DeviceGroup&&) noexcept;
  DeviceGroup(const DeviceGroup&) = delete;
  DeviceGroup& operator=(const DeviceGroup&) = delete;

  [[nodiscard]] int size() const noexcept;
  [[nodiscard]] const DeviceInfo& info(int rank) const;
  [[nodiscard]] CUstream_st* stream(int rank) const;
  [[nodiscard]] ncclComm* comm(int rank) const;

  /// Floats of rank r's shard of a `count`-float buffer: count / size(); the shard starts at
  /// r * shard(count). The last count % size() floats (the tail) belong to no shard.
  [[nodiscard]] std::size_t shard(std::size_t count) const;

  /// Sums `send[r]` (`count` floats, a multiple of size()) over the ranks; rank r receives its
  /// shard of the sum in `recv[r]` (shard(count) floats). In place when recv[r] == send[r] + r *
  /// shard(count).
  void reduce_scatter_sum(std::span<const float* const> send, std::span<float* const> recv,
                          std::size_t count) const;

  /// Rank r's shard `send[r]` (shard(count) floats) to floats [r * shard, (r + 1) * shard) of
  /// every rank's `recv` (`count` floats, a multiple of size()). In place when send[r] == recv[r]
  /// + r * shard(count).
  void all_gather(std::span<const float* const> send, std::span<float* const> recv, std::size_t count) const;

  /// Sums `data[r]` (`count` floats) over the ranks into every rank's, in place: a reduce-scatter,
  /// then an all-gather of the shards, so every element of a shard holds the bits
  /// reduce_scatter_sum gives that shard's owner (NCCL's all-reduce may add in another order);
  /// the tail (count % size() floats) is summed by one all-reduce.
  void all_reduce_sum(std::span<float* const> data, std::size_t count) const;

  /// Waits for every rank's communication stream.
  void synchronize() const;

 private:
  struct Impl;
  /// The group's state, checked: Errc::invalid_argument for a moved-from group or a rank outside
  /// it (-1: no rank asked about).
  const Impl& live(int rank = -1) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oom::cuda
