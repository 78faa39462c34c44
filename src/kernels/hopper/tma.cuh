// Tensor Memory Accelerator (TMA) loads for the Hopper kernels: the host-side encoding of a tensor
// map that views a (B, S, H, 128) bf16 tensor of rows "chunk-major" (no swizzle) or 128-byte
// swizzled (swizzle128_view, below), and the PTX wrappers a producer thread needs to load one tile
// of it with one instruction (mbarrier expect-tx and cp.async.bulk.tensor). Private to the kernels
// (not installed); used by attention_forward_wgmma_2wg.cu (Wgmma2wgSchedule::producer_tma: the
// chunk-major view; producer_sw128_tma: the swizzled one) and written so the backward kernels can
// stream their Q/dO and K/V tiles the same way.
//
// The chunk-major view. A (rows, 128) bf16 tile of one head is seen as a 5-D tensor, dimensions
// innermost first:
//   d0 = 8 elements (16 contiguous bytes: the TMA dimension 0, stride implicit),
//   d1 = token (stride token_stride * 2 bytes),
//   d2 = 16-byte column chunk, 16 of them (stride 16 bytes),
//   d3 = head (stride 128 * 2 = 256 bytes),
//   d4 = batch (stride batch_stride * 2 bytes),
// and a box {8, R, 16, 1, 1} lands in shared memory in box order, d0 fastest: element (row r,
// column c) of the tile at byte (c/8) (R 16) + r 16 + (c%8) 2, i.e. [chunk][row][8 elements].
// Every 8 consecutive rows of one chunk form a contiguous 128-byte block with rows 16 bytes apart:
// exactly a wgmma no-swizzle core matrix (wgmma.cuh), so the tile is a valid no-swizzle operand,
// with core matrices R 16 bytes apart along the columns and 128 bytes apart along the rows.
//
// Facts relied on (CUDA driver API, cuTensorMapEncodeTiled, as documented in cuda.h of CUDA 13.0):
// rank <= 5; globalAddress 16-byte aligned; globalDim non-zero and <= 2^32; globalStrides (the
// rank - 1 outer ones, bytes) multiples of 16 and < 2^40; boxDim non-zero and <= 256, boxDim[0] x
// element size a multiple of 16 bytes without interleave; CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE fills
// out-of-bound elements with zeros. The documented pseudo-code showing each stride "including" the
// previous dimension is an example of the packed case, not a listed requirement: the strides here
// are not monotonic (d2's 16 bytes is below d1's), as in FlashAttention-3's (S, H)-ordered TMA view
// of a (B, S, H, D) tensor (stride of S above that of H). If a driver refused it, encoding returns
// its error (cudaErrorInvalidValue through the runtime's mapping below) and the launcher reports it.
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

/// The 5-D chunk-major view of a (batch, seq, heads, 128) bf16 tensor described above, for boxes
/// of `box_rows` tokens: the numbers cuTensorMapEncodeTiled is given.
struct ChunkMajorView {
  static constexpr int kRank = 5;
  static constexpr int kHeadDim = 128;
  cuuint64_t dims[kRank];
  cuuint64_t strides[kRank - 1];  // bytes, dims 1 .. 4
  cuuint32_t box[kRank];
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
};

/// Fills `view` for the tensor at `base` (elements, strides in elements as TokenRows has them).
/// Returns false when TMA cannot express it: a base not 16-byte aligned, a stride that is not a
/// positive multiple of 8 elements below 2^39 elements (2^40 bytes) where it is used, an extent
/// over 2^32, or box_rows outside 1 .. 256. A stride whose dimension has extent 1 (batch_stride
/// for batch 1, token_stride for seq 1) is never used for an address and is replaced by a valid
/// one, so such a view (stride 0 there, say) is still expressed.
inline bool chunk_major_view(ChunkMajorView* view, const void* base, int batch, int seq, int heads,
                             std::int64_t batch_stride, std::int64_t token_stride, int box_rows) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 39;  // elements: 2^40 bytes of bf16
  const auto ok_stride = [&](std::int64_t s) { return s > 0 && s % 8 == 0 && s < kLimit; };
  if (base == nullptr || reinterpret_cast<std::uintptr_t>(base) % 16 != 0) return false;
  if (batch < 1 || seq < 1 || heads < 1 || box_rows < 1 || box_rows > 256) return false;
  const std::int64_t head_bytes = 2 * ChunkMajorView::kHeadDim;  // 256
  if (seq > 1 && !ok_stride(token_stride)) return false;
  if (batch > 1 && !ok_stride(batch_stride)) return false;
  view->dims[0] = 8;
  view->dims[1] = static_cast<cuuint64_t>(seq);
  view->dims[2] = ChunkMajorView::kHeadDim / 8;
  view->dims[3] = static_cast<cuuint64_t>(heads);
  view->dims[4] = static_cast<cuuint64_t>(batch);
  view->strides[0] = static_cast<cuuint64_t>(seq > 1 ? 2 * token_stride : head_bytes * heads);
  view->strides[1] = 16;
  view->strides[2] = static_cast<cuuint64_t>(head_bytes);
  view->strides[3] = static_cast<cuuint64_t>(batch > 1 ? 2 * batch_stride : head_bytes * heads);
  view->box[0] = 8;
  view->box[1] = static_cast<cuuint32_t>(box_rows);
  view->box[2] = ChunkMajorView::kHeadDim / 8;
  view->box[3] = 1;
  view->box[4] = 1;
  return true;
}

/// The 128-byte-swizzled view of the same tensor (the layout wgmma reads with Swizzle::b128): d0 =
/// 64 elements (one 128-byte half of a head row), d1 = token, d2 = the two halves (128 bytes
/// apart), d3 = head, d4 = batch; box {64, R, 2, 1, 1} lands as [half][row][128 bytes] with each
/// 128-byte row's 16-byte chunks permuted by the hardware swizzle (chunk c of a row at position
/// c ^ (row % 8), given a 1024-byte-aligned destination): element (r, c) of the tile at byte
/// (c/64) (R 128) + r 128 + (((c%64)/8) ^ (r%8)) 16 + (c%8) 2. Same preconditions and stand-in
/// strides as chunk_major_view; false where it returns false.
inline bool swizzle128_view(ChunkMajorView* view, const void* base, int batch, int seq, int heads,
                            std::int64_t batch_stride, std::int64_t token_stride, int box_rows) {
  if (!chunk_major_view(view, base, batch, seq, heads, batch_stride, token_stride, box_rows)) return false;
  view->dims[0] = 64;
  view->dims[2] = ChunkMajorView::kHeadDim / 64;
  view->strides[1] = 128;
  view->box[0] = 64;
  view->box[2] = ChunkMajorView::kHeadDim / 64;
  view->swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  return true;
}

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

/// Encodes `view` of the bf16 tensor at `base` into `map` (the view's swizzle, no interleave, zero
/// fill out of bounds, 256-byte L2 promotion). cudaErrorNotSupported when the driver offers no encoder,
/// cudaErrorInvalidValue when it refuses the view, else cudaSuccess.
inline cudaError_t encode_view(CUtensorMap* map, const ChunkMajorView& view, const void* base) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t element_strides[ChunkMajorView::kRank] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, ChunkMajorView::kRank, const_cast<void*>(base),
                            view.dims, view.strides, view.box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            view.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;  // internal: no reason (refusal.hpp)
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

/// The box of `map` at coordinates (c0 .. c4, innermost first, in elements) into shared memory at
/// `dst` (shared-state-space address, 128-byte aligned), one instruction issued by one thread;
/// completes `bar` by the box's byte count (out-of-bound elements, zero-filled, count too). The
/// destination is written by the async proxy: a wgmma (also async proxy) reading it after waiting
/// on `bar` needs no proxy fence.
__device__ __forceinline__ void tma_load_5d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c0,
                                            int c1, int c2, int c3, int c4) {
#if OOM_TMA_SM90
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
#else
  (void)dst;
  (void)map;
  (void)bar;
  (void)c0;
  (void)c1;
  (void)c2;
  (void)c3;
  (void)c4;
  __trap();
#endif
}

/// The box of a 2-D `map` at (c0 = column, c1 = row, in elements) into shared memory at `dst`, as
/// tma_load_5d (the caller arms `bar` with the bytes first).
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

/// Rows [row0, row0 + R) of head `head`, batch `batch` of a tensor viewed by chunk_major_view or
/// swizzle128_view (boxes of R rows: the box covers all 128 columns either way, so the coordinates
/// are the same) into the tile at `dst`, laid out as that view says; rows at or past the tensor's
/// seq are zeros. Arms `bar` for the tile's R x 256 bytes first (the one arrival of the phase) and
/// issues the copy. A swizzled view needs `dst` 1024-byte aligned (the swizzle pattern repeats
/// every 8 rows of 128 bytes and is taken from the address bits).
template <int R>
__device__ __forceinline__ void tma_load_rows(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int row0,
                                              int head, int batch) {
  static_assert(R >= 1 && R <= 256);
  mbar_arrive_expect_tx(bar, static_cast<std::uint32_t>(R * 2 * ChunkMajorView::kHeadDim));
  tma_load_5d(dst, map, bar, 0, row0, 0, head, batch);
}

}  // namespace oom::kernels::hopper
