// The consumer warpgroups' walk through the pipeline stages of the warp-specialised grouped GEMM
// kernels (grouped_rows_wgmma.cu, grouped_wgrad_wgmma.cu): wait for a stage's "full" phase, issue
// that K step's wgmmas, then retire the previous step's (wait_group 1) and release its stage, so
// one step's products stay in flight while the next stage is awaited. Private to the kernels.
#pragma once

#include <cstdint>

#include "warp_specialized.cuh"
#include "wgmma.cuh"

namespace oom::kernels::hopper {

struct ConsumerRing {
  StageBarriers bar;
  int stage = 0;          ///< the stage of the next K step
  std::uint32_t phase = 0;  ///< that use's phase parity (flips each time the ring wraps)
  int held = -1;          ///< the stage whose wgmmas may still be reading it
  /// -1: every consumer thread arrives on its own CTA's "empty" barrier (count kWsConsumerThreads).
  /// Else the cluster rank of a peer CTA whose producer also writes into this CTA's stages (TMA
  /// multicast): each consumer warp's lane 0 arrives once on this CTA's barrier and once on the
  /// peer's (count: both CTAs' consumer warps), so a stage is refilled only after both released it.
  int peer = -1;

  /// Until the next K step's stage is full.
  __device__ __forceinline__ void wait_full() const { mbar_wait(bar.full(stage), phase); }

  /// After this K step's wgmmas are committed (or none were): waits for the previous step's to
  /// complete, releases that stage to the producer and moves on.
  template <int N>
  __device__ __forceinline__ void step(float (&acc)[N]) {
    wgmma_wait_group<1>();
    wgmma_fence_operands(acc);
    if (held >= 0) release(held);
    held = stage;
    if (++stage == bar.stages) {
      stage = 0;
      phase ^= 1u;
    }
  }

  /// After a tile's last K step: waits for every wgmma and releases the last stage.
  template <int N>
  __device__ __forceinline__ void drain(float (&acc)[N]) {
    wgmma_wait_group<0>();
    wgmma_fence_operands(acc);
    if (held >= 0) release(held);
    held = -1;
  }

  /// This thread's (or warp's) reads of stage `s` are done (its wgmmas completed).
  __device__ __forceinline__ void release(int s) const {
    if (peer < 0) {
      mbar_arrive(bar.empty(s));
      return;
    }
    __syncwarp();
    if ((threadIdx.x & 31u) == 0) {
      mbar_arrive(bar.empty(s));
      mbar_arrive_remote(bar.empty(s), static_cast<std::uint32_t>(peer));
    }
  }
};

}  // namespace oom::kernels::hopper
