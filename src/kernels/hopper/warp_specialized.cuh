// Building blocks of the warp-specialised (producer warpgroup) Hopper kernels: mbarrier
// initialisation, arrival, cp.async-tracked arrival and parity wait, setmaxnreg, with the
// register split of a 384-thread block (two consumer warpgroups and one producer), and the
// producer's tile loader. Private to the kernels (not installed); used by the wgmma attention
// kernels (attention_forward_wgmma.cu, attention_backward_wgmma.cu) and the grouped expert GEMMs.
// The PTX is emitted only where a kernel using it is compiled for sm_90a (the kernels guard their
// bodies with OOM_WGMMA_SM90A, wgmma.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace oom::kernels::hopper {

// setmaxnreg: the producer warpgroup gives back (168 - 24) x 128 registers, exactly what the two
// consumer warpgroups take ((240 - 168) x 256); 168 = the 65536 / 384 every thread starts with
// (multiple of 8 below 170).
constexpr int kWsConsumerThreads = 256;  // warpgroups 0 and 1
constexpr int kWsProducerThreads = 128;  // warpgroup 2
constexpr int kWsThreads = kWsConsumerThreads + kWsProducerThreads;
constexpr int kProducerRegs = 24, kConsumerRegs = 240, kStartRegs = 168;
static_assert((kStartRegs - kProducerRegs) * kWsProducerThreads == (kConsumerRegs - kStartRegs) * kWsConsumerThreads);
static_assert(kStartRegs * kWsThreads <= 65536 && (kStartRegs + 8) * kWsThreads > 65536);

__device__ __forceinline__ void mbar_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// Makes the initialisations visible (to the async proxy, too) before the barrier that follows.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
/// One arrival (release semantics, CTA scope).
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}
/// An arrival once all of this thread's earlier cp.async have landed; .noinc: the arrival is one of
/// the count given at init (the producer's 128 threads each do one per tile).
__device__ __forceinline__ void cp_async_mbar_arrive(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/// Waits (acquire, CTA scope) until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

/// This CTA's rank in its cluster.
__device__ __forceinline__ std::uint32_t cluster_ctarank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// Every thread of every CTA of the cluster arrives (release) and waits (acquire); not .aligned, so
/// diverged threads may call it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
/// One arrival on the mbarrier at this CTA's shared address `bar` as mapped into the cluster's CTA
/// `rank`, with the default semantics (release at CTA scope, as CUTLASS's cluster barriers arrive):
/// it signals reads of this CTA's shared memory that have completed (wgmma.wait_group), which no
/// later write can disturb, so no cluster-scope fence is needed (one on every stage's release would
/// sit on the consumers' path).
__device__ __forceinline__ void mbar_arrive_remote(std::uint32_t bar, std::uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

/// sm_90's opt-in dynamic shared memory per block (227 KiB): every kernel here checks its layout
/// against it at compile time.
constexpr int kMaxDynamicSmem = 227 * 1024;

/// The offset from the dynamic shared memory's start (`raw`, a shared address) to its first
/// 1024-byte boundary, where the 128-byte-swizzled tiles start (the swizzle pattern is taken from
/// address bits 7-9); callers reserve 1 KiB for it.
__device__ __forceinline__ std::uint32_t pad_to_1024(std::uint32_t raw) { return (1024u - (raw & 1023u)) & 1023u; }

/// A block's pipeline barriers at shared address `at`: `stages` "full" mbarriers, then `stages`
/// "empty" ones (8 bytes each).
struct StageBarriers {
  std::uint32_t at;
  int stages;
  [[nodiscard]] __device__ __forceinline__ std::uint32_t full(int s) const { return at + 8u * static_cast<std::uint32_t>(s); }
  [[nodiscard]] __device__ __forceinline__ std::uint32_t empty(int s) const {
    return at + 8u * static_cast<std::uint32_t>(stages + s);
  }
  /// Thread 0 initialises them, "full" to `full_count` arrivals and "empty" to `empty_count` (the
  /// consumers' kWsConsumerThreads unless they release by warp), and makes that visible (to the
  /// cluster, too); then the whole block synchronises (the last block-wide barrier of the
  /// warp-specialised kernels; those in clusters add cluster barriers).
  __device__ __forceinline__ void init(std::uint32_t full_count, std::uint32_t empty_count = kWsConsumerThreads) const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages; ++s) {
        mbar_init(full(s), full_count);
        mbar_init(empty(s), empty_count);
      }
      mbar_fence_init();
    }
    __syncthreads();
  }
};

/// Rows [row0, row0 + ROWS) of a strided (token_stride elements) global (rows, COLS) bf16 matrix,
/// COLS 128 or 256, into the 128-byte-swizzled layout at shared address `tile` (wgmma
/// Swizzle::b128; 1024-byte aligned), by cp.async from the producer's 128 threads (thread `tid`).
/// The tile's 64-column panels are ROWS x 128-byte regions, panel h at h ROWS 128, row r at r 128
/// in it, its 16-byte chunk c at position c ^ (r % 8), which is what the hardware's swizzle reads
/// (address bits 4-6 XOR bits 7-9). Thread `tid` copies chunk tid % 8 of every panel of rows
/// 16 i + tid / 8: a warp covers 4 rows x 128 contiguous bytes of global memory per panel (4
/// lines, no sector split) into 512 contiguous bytes of shared memory (4 wavefronts); the
/// no-swizzle core-matrix layout this replaced split every global sector across two shared-memory
/// lines. Since r % 8 = (tid / 8) % 8 for every i, each thread's swizzled chunk is fixed and the
/// addresses step by constants. Rows >= row_end are zero-filled (nothing read for them).
template <int ROWS, int COLS = 128>
__device__ __forceinline__ void load_rows_sw128_producer(std::uint32_t tile, const __nv_bfloat16* base,
                                                         std::int64_t token_stride, int row0, int row_end, int tid) {
  static_assert(ROWS % 16 == 0 && kWsProducerThreads == 128 && COLS % 64 == 0);
  constexpr std::uint32_t kHalf = ROWS * 128;  // one 64-column panel
  const int chunk = tid & 7, row = tid >> 3;    // row 0 .. 15 of each 16-row step
  int r = row0 + row;
  // Stepped through the rows, past row_end too: a copy with src-size 0 reads nothing (PTX ISA,
  // cp.async: the bytes past src-size are zero-filled), so its address is never dereferenced, and
  // not keeping `base` for a substitute address is what lets the backward's producer fit in its 24
  // registers without spilling.
  const __nv_bfloat16* src = base + static_cast<std::int64_t>(r) * token_stride + chunk * 8;
  const std::int64_t step = 16 * token_stride;
  std::uint32_t dst = tile + static_cast<std::uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
#pragma unroll 4
  for (int i = 0; i < ROWS / 16; ++i) {  // every panel of rows r per step: one live address set
    const std::uint32_t bytes = r < row_end ? 16 : 0;
#pragma unroll
    for (int h = 0; h < COLS / 64; ++h)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + h * kHalf), "l"(src + 64 * h),
                   "r"(bytes)
                   : "memory");
    r += 16;
    src += step;
    dst += 16 * 128;
  }
}

}  // namespace oom::kernels::hopper
