// GPU microbenchmarks behind oom-calibrate: device memory bandwidth, cuBLAS bf16 GEMM throughput,
// OOM's flash attention, launch overhead, concurrent host links and NCCL collectives.
// Each returns a plain struct (median over timed repetitions, CUDA events, after warm-up) and, where
// a result can be checked, whether it was right. Declarations parse without CUDA headers; link
// oom::cuda. Formatting is the caller's: these are called from host code that owns the output.
#pragma once

#include <cstdint>
#include <vector>

#include "oom/core/bytes.hpp"

namespace oom::cuda {

struct HbmBandwidth {
  double bytes_per_s = 0;  ///< device-to-device copy, bytes read + written
  Bytes size;              ///< bytes per copy
  int repeats = 0;
  bool verified = false;   ///< the destination holds the source's bytes
};
/// cudaMemcpyAsync device-to-device of `size` bytes on `device`.
HbmBandwidth measure_hbm_bandwidth(int device, Bytes size, int repeats);

struct GemmRate {
  std::int64_t m = 0, n = 0, k = 0;
  double flops_per_s = 0;  ///< 2mnk per product
  double seconds = 0;      ///< median time of one product
  int repeats = 0;
  bool verified = false;   ///< sampled outputs match a host fp32 reference within bf16 rounding
};
/// C(m x n) = A(m x k) * W(n x k)^T in bf16 with fp32 accumulate (cublasGemmEx, CUBLAS_COMPUTE_32F),
/// the layout of a linear layer's forward. Inputs are pseudo-random in [-1, 1] (zeros run faster
/// and would flatter the rate). Products are timed back to back in batches so launch gaps are hidden.
GemmRate measure_gemm_bf16(int device, std::int64_t m, std::int64_t n, std::int64_t k, int repeats);

struct AttentionRate {
  std::int64_t seq = 0;
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  double flops_per_s = 0;           ///< 3.5 x causal forward FLOPs (2 * seq^2 * q_heads * head_dim) per second
  double seconds = 0;               ///< median time of one forward + backward
  double forward_flops_per_s = 0;   ///< the forward alone: 1 x causal forward FLOPs per second
  double forward_seconds = 0;       ///< median time of one forward
  double backward_flops_per_s = 0;  ///< the backward alone: 2.5 x causal forward FLOPs per second
  double backward_seconds = 0;      ///< median time of one backward
  int repeats = 0;
};
/// OOM's flash attention kernel (include/oom/kernels/attention.hpp), causal GQA forward + backward
/// over one sequence of `seq` tokens (batch 1), each pass timed alone and the pair together: the
/// rates the planner should predict our own steps with (the two passes run at different rates). Needs about 2 B * 4 * (q_heads + kv_heads) * head_dim * seq of device memory.
AttentionRate measure_flash_attention(int device, std::int64_t seq, int q_heads, int kv_heads, int head_dim, int repeats);

struct GatedDeltaRate {
  std::int64_t tokens = 0;     ///< per sequence
  std::int64_t sequences = 1;
  int k_heads = 0, v_heads = 0, head_dim = 0;
  double forward_updates_per_s = 0;   ///< sequences x tokens x v_heads x head_dim^2 state updates over the forward's median seconds
  double backward_updates_per_s = 0;  ///< the same count over the backward's
  double forward_seconds = 0, backward_seconds = 0;
  int repeats = 0;
  bool verified = false;  ///< every output and input gradient came back finite (the rule itself: test_gated_delta_kernels)
};
/// OOM's recurrent gated delta rule (include/oom/kernels/gated_delta.hpp) over `sequences`
/// sequences of `tokens`, k_heads/v_heads heads of head_dim (key and value alike), states kept
/// every 64 tokens, the backward on its automatic path; forward and backward each timed alone:
/// MachineProfile's gated_delta_*_updates_per_s (one sequence) and, by sequences x v_heads
/// recurrences side by side, gated_delta_*_parallel.
GatedDeltaRate measure_gated_delta(int device, std::int64_t tokens, int k_heads, int v_heads, int head_dim, int repeats,
                                   std::int64_t sequences = 1);

struct LaunchOverhead {
  double kernel_s = 0;      ///< per empty kernel launched back to back
  double small_copy_s = 0;  ///< per 4 KiB pinned host-to-device copy issued back to back
  int launches = 0;
};
LaunchOverhead measure_launch_overhead(int device, int launches, int repeats);

struct HostLinkTotal {
  double bytes_per_s = 0;  ///< all GPUs copying both directions at once, every byte counted
  int gpus = 0;
  Bytes size;
  int repeats = 0;
};
/// Pinned host<->device copies in both directions on `gpus` GPUs (0 .. gpus-1) at once: what the
/// host's memory system and PCIe root complexes give all links together.
HostLinkTotal measure_host_link_total(int gpus, Bytes size, int repeats);

struct CollectiveRates {
  int gpus = 0;
  Bytes size;                          ///< bytes per GPU per collective
  double all_reduce_bus_bytes_per_s = 0;  ///< ncclAllReduce (float sum), algbw x 2(n-1)/n
  double all_to_all_bytes_per_s = 0;      ///< grouped ncclSend/ncclRecv, bytes each GPU sends to others per second
  int repeats = 0;
  bool verified = false;               ///< all-reduce sums and all-to-all chunks arrived as expected
};
/// NCCL across GPUs 0 .. gpus-1 in this process (ncclCommInitAll), gpus >= 2. Sets NCCL_NVLS_ENABLE=0
/// in the environment first when it is unset: NVLink multicast is never used.
CollectiveRates measure_collectives(int gpus, Bytes size, int repeats);

}  // namespace oom::cuda
