// Tensor Memory Accelerator (TMA) loads and stores for the Hopper kernels: the host-side encoding
// of a tensor map that views a row-major bf16 matrix in the 128-byte-swizzled layout
// (encode_matrix_sw128), and the PTX wrappers a producer thread needs to move one box of it with
// one instruction (mbarrier expect-tx, cp.async.bulk.tensor in both directions). Private to the
// kernels (not installed); used by grouped_rows_wgmma.cu and scripts/diag/store_interference.cu.
//
// Facts relied on (CUDA driver API, cuTensorMapEncodeTiled, as documented in cuda.h of CUDA 13.0):
// rank <= 5; globalAddress 16-byte aligned; globalDim non-zero and <= 2^32; globalStrides (the
// rank - 1 outer ones, bytes) multiples of 16 and < 2^40; boxDim non-zero and <= 256, boxDim[0] x
// element size a multiple of 16 bytes without interleave (and at most 128 bytes with the 128-byte
// swizzle); CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE fills out-of-bound elements with zeros. If a driver
// refused a map, encoding returns its error (cudaErrorInvalidValue through the runtime's mapping
// below) and the launcher reports it.
// PTX ISA (cp.async.bulk.tensor): the shared destination 128-byte aligned, the mbarrier's tx-count
// completes by the box's full byte count, out-of-bound elements included.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: nothing here links against libcuda
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../refuse.hpp"

namespace oom::kernels::hopper {

// ------------------------------------------------------------------------------------------------
// Host side.

/// cuTensorMapEncodeTiled from the driver, through the runtime (the library links cudart only):
/// looked up once per process; null if the driver has none (then every encode fails).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &found);
#endif
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  return fn;
}

/// A row-major bf16 matrix (rows x cols, row stride `row_stride` elements) in the 128-byte-swizzled
/// layout, boxes of 64 columns (128 bytes: the widest a 128-byte swizzle takes) x `box_rows` rows:
/// a box lands as box_rows rows of 128 bytes, each row's 16-byte chunk c at position c ^ (row % 8)
/// (given a 1024-byte-aligned destination), i.e. a K-major wgmma operand with K = the columns or an
/// MN-major one with MN = the columns. cudaErrorInvalidValue where TMA cannot express it (base not
/// 16-byte aligned, stride not a multiple of 8 elements or not below 2^39, an extent of 0 or over
/// 2^32, cols < 64, box_rows outside 1 .. 256), or the driver refuses it; cudaErrorNotSupported
/// without an encoder.
inline cudaError_t encode_matrix_sw128(CUtensorMap* map, const void* base, std::int64_t rows, std::int64_t cols,
                                       std::int64_t row_stride, int box_rows) {
  constexpr std::int64_t kExtent = std::int64_t{1} << 32, kStride = std::int64_t{1} << 39;
  using ::oom::kernels::detail::refuse;
  if (base == nullptr || reinterpret_cast<std::uintptr_t>(base) % 16 != 0)
    return refuse("encode_matrix_sw128: the base is null or not 16-byte aligned");
  if (rows < 1 || rows > kExtent || cols < 64 || cols > kExtent || box_rows < 1 || box_rows > 256)
    return refuse("encode_matrix_sw128: ", rows, " x ", cols, " with boxes of ", box_rows,
                  " rows (rows 1 .. 2^32, cols 64 .. 2^32, box rows 1 .. 256)");
  if (row_stride < cols || row_stride % 8 != 0 || row_stride >= kStride)
    return refuse("encode_matrix_sw128: row stride ", row_stride, " (a multiple of 8, >= cols = ", cols, ", < 2^39)");
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(2 * row_stride)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;  // internal: no reason (refusal.hpp)
}

// ------------------------------------------------------------------------------------------------
// Device side (sm_90 PTX; the kernels using it guard their bodies for sm_90a, wgmma.cuh).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define OOM_TMA_SM90 1
#else
#define OOM_TMA_SM90 0
#endif

/// Fetches the tensor map (a __grid_constant__ kernel parameter) into the TMA unit's descriptor
/// cache ahead of its first use; a hint only.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if OOM_TMA_SM90
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
#else
  (void)map;
  __trap();
#endif
}

/// One arrival on the mbarrier at shared address `bar` that also raises its expected transaction
/// count by `bytes`: the phase completes once the pending arrivals reach zero and the bytes of the
/// bulk copies signalling it (complete_tx) have all landed. Release semantics, CTA scope.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
#if OOM_TMA_SM90
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n"
      "}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
#else
  (void)bar;
  (void)bytes;
  __trap();
#endif
}

/// The box of a 2-D `map` at (c0 = column, c1 = row, in elements) into shared memory at `dst`
/// (shared-state-space address, 128-byte aligned; 1024-byte aligned for a swizzled map), one
/// instruction issued by one thread; completes `bar` by the box's byte count (out-of-bound
/// elements, zero-filled, count too), so the caller arms `bar` with those bytes first
/// (mbar_arrive_expect_tx). The destination is written by the async proxy: a wgmma (also async
/// proxy) reading it after waiting on `bar` needs no proxy fence.
__device__ __forceinline__ void tma_load_2d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c0, int c1) {
#if OOM_TMA_SM90
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#else
  (void)dst;
  (void)map;
  (void)bar;
  (void)c0;
  (void)c1;
  __trap();
#endif
}

/// tma_load_2d's box into shared address `dst` of every CTA of the cluster named in `mask` (bit r:
/// cluster rank r), at the same offset in each; each destination CTA's mbarrier at the same offset
/// as `bar` is completed by the box's bytes, so every receiver arms its own barrier for them.
__device__ __forceinline__ void tma_load_2d_multicast(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c0, int c1,
                                                      std::uint16_t mask) {
#if OOM_TMA_SM90
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
#else
  (void)dst;
  (void)map;
  (void)bar;
  (void)c0;
  (void)c1;
  (void)mask;
  __trap();
#endif
}

/// The box of a 2-D `map` at (c0 = column, c1 = row, in elements) from shared memory at `src`
/// (laid out as the map's load would land it: 128-byte aligned, 1024-byte aligned for a swizzled
/// map) to global memory, by the TMA unit, in this thread's current bulk group. Elements of the box
/// outside the map's extent are not written. The writing threads make `src` visible to the async
/// proxy first (fence.proxy.async.shared::cta, then a barrier before this thread issues it); the
/// issuing thread tracks it with cp.async.bulk.commit_group / wait_group(.read).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, std::uint32_t src, int c0, int c1) {
#if OOM_TMA_SM90
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
#else
  (void)map;
  (void)src;
  (void)c0;
  (void)c1;
  __trap();
#endif
}

}  // namespace oom::kernels::hopper
