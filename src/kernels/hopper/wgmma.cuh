// Hopper warpgroup MMA (wgmma) building blocks: the shared-memory matrix descriptor, the
// fence/commit/wait instructions, and the MMA shapes m64n64k16 and m64n128k16 (bf16 x bf16 -> fp32),
// both operands from shared memory (K-major; for N = 128 also an MN-major B), and m64n128k16 with A
// from registers. Private to the kernels (not installed); docs/hopper.md says
// what is verified and what comes next.
//
// wgmma exists only on sm_90a (the arch-specific target, not plain sm_90). The PTX below is
// compiled only when nvcc targets sm_90a, which defines __CUDA_ARCH_FEAT_SM90_ALL (checked with
// `nvcc -arch=sm_90a --dryrun`: nvcc 13.0 passes -D__CUDA_ARCH__=900 -D__CUDA_ARCH_FEAT_SM90_ALL
// -D__CUDA_ARCH_SPECIFIC__=900; for -arch=sm_90 only -D__CUDA_ARCH__=900). For any other device
// target the functions compile to __trap(), so a kernel including this header builds everywhere and
// fails loudly if it ever runs the wgmma path on the wrong architecture.
//
// Facts relied on, with their source (PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions"; section numbers from a version where that chapter is 9.7.15 --
// others number it differently, e.g. 9.7.16):
//
// * Operands (9.7.15.5.2, wgmma.mma_async): D = A*B + D, A is MxK, B is KxN, D is MxN; D = A*B
//   when the predicate scale-d is false. With imm-trans-a = imm-trans-b = 0, A is "K-major" (row i
//   of A holds its K values contiguously) and B is K-major too (column n of B holds its K values
//   contiguously). So with B stored as an N x K row-major array Bt, the instruction computes
//   D = A * Bt^T. imm-scale-a/b = 1 (no negation).
//
// * Shared-memory layout, no swizzle ("interleave"), K-major (9.7.15.5.1.2: swizzle atom "None, K:
//   8x1" in 128-bit elements; 9.7.15.5.1.2.1.3 canonical layout ((8,m),(T,2k)):((1T,SBO),(1,LBO))
//   in elements, T = 128 / 16 = 8 for bf16). The unit is the "core matrix": 8 rows x 16 bytes
//   (8 rows x 8 bf16 along K), its 8 rows stored contiguously, 128 bytes in all. A 64x16 operand
//   tile of one instruction is 8 (along M or N) x 2 (along K) core matrices, placed by two strides:
//     LBO, leading dimension byte offset (9.7.15.5.1.2.1.1, K-major, no swizzle: "the offset from
//         the first column to the second column of the 8x2 tile in the 128-bit element type
//         normalized matrix"): the byte distance between core matrices adjacent along K;
//     SBO, stride dimension byte offset (9.7.15.5.1.2.1.2, K-major: "the offset from the first 8
//         rows to the next 8 rows"): the byte distance between core matrices adjacent along M
//         (for A) or N (for B).
//   The same meaning is stated in the older PTX ISA wording ("LBO ... between two adjacent core
//   matrices in the K dimension; SBO ... in the M or N dimension") and in CUTLASS's
//   make_gmma_desc (cute/atom/mma_traits_sm90_gmma.hpp: K-major INTERLEAVE is
//   ((8,m),2):((1,SBO),LBO) in 16-byte units). No source we read disagrees for this layout. (For
//   the swizzled K-major layouts LBO is unused and set to 1. The no-swizzle MN-major layout of a B
//   operand is described at `Major` below.) Start addresses and both offsets must be multiples of 16 bytes.
//
// * Descriptor (9.7.15.5.1.2.2, "Matrix Descriptor Format"), a 64-bit register value:
//     bits 0-13  encode(start address)      bits 16-29 encode(LBO)     bits 32-45 encode(SBO)
//     bits 49-51 base offset (only for swizzled modes; 0 when the swizzle pattern starts on its
//                1024/512/256-byte boundary)
//     bits 62-63 swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
//   where encode(x) = (x & 0x3FFFF) >> 4. The start address is a shared-state-space address
//   (__cvta_generic_to_shared).
//
// * Accumulator fragment of m64nNk16 with .f32 D (9.7.15.5.1.1.1: N/2 fp32 registers per thread,
//   layout given as Figure 149, an image; the per-element formula below is CUTLASS's
//   CLayout_64xN, cute/atom/mma_traits_sm90_gmma.hpp, which is the same figure in CuTe terms).
//   Thread t of the warpgroup, warp w = t / 32, lane l = t % 32: warp w owns rows 16w..16w+15;
//   for each 8-column block j (0 <= j < N/8):
//     d[4j+0], d[4j+1] -> row 16w + l/4,     columns 8j + 2*(l%4) + {0, 1}
//     d[4j+2], d[4j+3] -> row 16w + 8 + l/4, columns 8j + 2*(l%4) + {0, 1}
//   i.e. per warp and 8-column block, the mma.sync m16n8 C fragment.
//
// * Ordering (the wgmma.fence, wgmma.commit_group and wgmma.wait_group sections): all warps
//   of the warpgroup execute wgmma.fence before the first wgmma.mma_async and between a register
//   access and a wgmma that uses the same registers (back-to-back wgmmas of one shape on the same
//   accumulators need none); "an async proxy fence must be used to establish an ordering between
//   prior writes to shared memory matrices and subsequent reads of the same matrices in a
//   wgmma.mma_async instruction" (fence_proxy_async_shared below, by each writing thread, before
//   the barrier that publishes the tile); results may be read only after wgmma.commit_group and a
//   wgmma.wait_group that covers the group.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OOM_WGMMA_SM90A 1
#else
#define OOM_WGMMA_SM90A 0
#endif

namespace oom::kernels::hopper {

/// Swizzle mode field of the descriptor (bits 62-63).
enum class Swizzle : std::uint32_t { none = 0, b128 = 1, b64 = 2, b32 = 3 };

/// The descriptor's 14-bit encoding of a byte address or offset: (x & 0x3FFFF) >> 4.
__host__ __device__ constexpr std::uint64_t desc_encode(std::uint32_t bytes) {
  return static_cast<std::uint64_t>((bytes & 0x3FFFFu) >> 4);
}

/// The 64-bit matrix descriptor from a shared-state-space byte address (as __cvta_generic_to_shared
/// gives), the two byte offsets, the base offset (3 bits) and the swizzle mode. Pure bit packing,
/// so it is checked at compile time (tests/kernels/test_wgmma.cu).
__host__ __device__ constexpr std::uint64_t encode_smem_desc(std::uint32_t smem_addr, std::uint32_t lbo_bytes,
                                                             std::uint32_t sbo_bytes, Swizzle swizzle = Swizzle::none,
                                                             std::uint32_t base_offset = 0) {
  return desc_encode(smem_addr) | (desc_encode(lbo_bytes) << 16) | (desc_encode(sbo_bytes) << 32) |
         (static_cast<std::uint64_t>(base_offset & 0x7u) << 49) |
         (static_cast<std::uint64_t>(static_cast<std::uint32_t>(swizzle) & 0x3u) << 62);
}

/// Descriptor of a tile at `smem` (a generic pointer into shared memory, 16-byte aligned).
/// For the no-swizzle K-major layout: lbo_bytes = distance between core matrices adjacent along K,
/// sbo_bytes = distance between core matrices adjacent along M/N.
__device__ __forceinline__ std::uint64_t make_smem_desc(const void* smem, std::uint32_t lbo_bytes,
                                                        std::uint32_t sbo_bytes, Swizzle swizzle = Swizzle::none,
                                                        std::uint32_t base_offset = 0) {
  const auto addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  return encode_smem_desc(addr, lbo_bytes, sbo_bytes, swizzle, base_offset);
}

/// Descriptors of the 128-byte-swizzled bf16 tiles of the attention kernels and the grouped expert
/// GEMMs (filled by load_rows_sw128_producer, warp_specialized.cuh, or by TMA with the 128-byte
/// swizzle; 1024-byte aligned): a tile of R rows x C columns is C / 64 panels of R rows x 128
/// bytes, panel h at byte h R 128, row r at r 128 in it, its 16-byte chunk c at position c ^ (r % 8).
/// An operand one wgmma reads may also be a product's MN-major B: "rows" are then its K.
namespace sw128 {
constexpr std::uint32_t kAtom = 1024;  // 8 rows x 128 bytes: the SBO of both forms
/// K-major operand (tile rows = the product's M or N, columns = its K): k-step ks (columns 16ks ..
/// 16ks + 15) starts in panel ks / 4 at byte 32 (ks % 4) of each row; LBO unused (16).
template <int R>
__device__ __forceinline__ std::uint64_t kmajor_desc(std::uint32_t tile, int ks) {
  return encode_smem_desc(tile + static_cast<std::uint32_t>((ks / 4) * R * 128 + (ks % 4) * 32), 16, kAtom,
                          Swizzle::b128);
}
/// MN-major B (tile rows = the product's K, columns = its N): k-step ks (rows 16ks ..) is two 8-row
/// atoms at 2048 ks; LBO one panel (the next 64 columns along N). The swizzled MN-major layouts give
/// LBO the MN stride and SBO the K stride, the opposite of no-swizzle.
template <int R>
__device__ __forceinline__ std::uint64_t mnmajor_desc(std::uint32_t tile, int ks) {
  return encode_smem_desc(tile + static_cast<std::uint32_t>(ks) * 2 * kAtom, R * 128, kAtom, Swizzle::b128);
}
}  // namespace sw128

/// Orders this thread's prior generic-proxy writes to shared memory before later async-proxy
/// reads (wgmma operands). Each thread that wrote a tile runs it, then the block barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if OOM_WGMMA_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();
#endif
}

/// wgmma.fence: all 128 threads of the warpgroup, before the first wgmma and after any other
/// access to the accumulator registers.
__device__ __forceinline__ void wgmma_fence() {
#if OOM_WGMMA_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// Closes the group of wgmmas issued since the previous commit.
__device__ __forceinline__ void wgmma_commit_group() {
#if OOM_WGMMA_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// Waits until at most N committed groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(N >= 0, "wgmma.wait_group takes a non-negative immediate");
#if OOM_WGMMA_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

/// Keeps the compiler from moving reads or writes of accumulator registers across the asm
/// statements around an in-flight wgmma (the asm above names no registers, so without this a
/// register copy could be scheduled before wgmma_wait_group). Costs no instruction.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// D(64x64, fp32) = A(64x16, bf16) * B^T + (scale_d ? D : 0), A and B (B stored as 64(N) x 16(K))
/// both K-major in shared memory as described by `desc_a` / `desc_b`. Issued by all 128 threads of
/// a warpgroup; asynchronous: commit and wait before reading `d`. `d` is the fragment described at
/// the top of this file (32 floats per thread).
__device__ __forceinline__ void wgmma_m64n64k16_f32_bf16_ss(float (&d)[32], std::uint64_t desc_a,
                                                            std::uint64_t desc_b, int scale_d) {
#if OOM_WGMMA_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  (void)scale_d;
  __trap();
#endif
}

// The 64 accumulator operands of an N = 128 wgmma, %0 .. %63.
#define OOM_WGMMA_D64_OPERANDS(d)                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
      "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),            \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),            \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),            \
      "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),            \
      "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define OOM_WGMMA_D64_LIST                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                 \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/// How the B operand (K x N) is stored in shared memory: the wgmma's imm-trans-b.
///   k:  K-major (imm-trans-b 0), stored as N x K: a core matrix is 8 values of N (its 8 rows of
///       16 bytes) x 8 consecutive K values; see the top of the file.
///   mn: MN-major (imm-trans-b 1, "transposed"; only for 16-bit types), stored as K x N: a core
///       matrix is 8 values of K (its 8 rows of 16 bytes, 128 contiguous bytes) x 8 consecutive N
///       values. No swizzle: LBO = the byte distance between core matrices adjacent along K, SBO
///       = along N -- the same roles as for K-major. Source: PTX ISA "Canonical Layouts", MN-major
///       no-swizzle row ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) (T = 8 bf16: the 8 N values of a
///       core row contiguous, core matrices along N at SBO; the 8 K rows 16 bytes apart, groups of
///       8 K at LBO), its worked example "MN-major, no-swizzling and bf16" (exact layout
///       ((8,1,2),(8,2)):((1,8,64),(8,128)) with LBO = 128 and SBO = 64 elements), and CUTLASS
///       make_gmma_desc<Major::MN> for INTERLEAVE (cute/atom/mma_traits_sm90_gmma.hpp: SBO is the
///       stride of the N mode in 16-byte units, LBO that of the second group of 8 along K).
///       The PTX ISA's prose table for LBO/SBO of MN-major ("offset from the first 8 columns to
///       the next 8 columns" / "from the first row to the next row", in its 128-bit normalized
///       matrix) reads ambiguously; the canonical layout and CUTLASS agree, and test_wgmma checks
///       it with two placements that swap which stride is small. (The swizzled MN-major layouts
///       swap the roles: LBO along MN, SBO along K. Not used here.)
enum class Major : int { k = 0, mn = 1 };

/// D(64x128, fp32) = A(64x16, bf16) * B + (scale_d ? D : 0): the N = 128 shape of the same
/// instruction, for a 128-wide accumulator such as the O tile of attention with head_dim 128 (one
/// instruction reads the A tile once for all 128 columns, where two m64n64k16 would read it twice).
/// A K-major in shared memory as for wgmma_m64n64k16_f32_bf16_ss. B (16 x 128) as `BMajor` says:
/// K-major (the default) = stored 128(N) x 16(K), 16 core matrices along N at SBO apart and 2 along
/// K at LBO apart, so D = A * Bt^T for that N x K array Bt; MN-major = stored 16(K) x 128(N), 2
/// core matrices along K at LBO, 16 along N at SBO (see Major).
/// `d` is the accumulator fragment at the top of this file with N = 128: 64 floats per thread,
/// d[4j..4j+3] for the 8-column block j = 0..15. Facts relied on beyond those of the N = 64 shape,
/// from the PTX ISA wgmma.mma_async section: .m64n128k16 is a valid shape for .bf16 inputs with
/// .f32 accumulators (the shape list runs m64n8k16 .. m64n256k16 in steps of 8 for .f16/.bf16),
/// the D operand is N/2 = 64 .f32 registers, and the accumulator layout figure is the one for all
/// N (CUTLASS's CLayout_64xN is one formula in N).
/// AMajor: A K-major (the default; stored as 64(M) x 16(K)) or MN-major (imm-trans-a 1, stored as
/// 16(K) x 64(M), as B's MN-major form with M for N; bf16 allows either for A in shared memory).
template <Major BMajor = Major::k, Major AMajor = Major::k>
__device__ __forceinline__ void wgmma_m64n128k16_f32_bf16_ss(float (&d)[64], std::uint64_t desc_a,
                                                             std::uint64_t desc_b, int scale_d) {
#if OOM_WGMMA_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " OOM_WGMMA_D64_LIST
      ", %64, %65, p, 1, 1, %68, %67;\n"
      "}\n"
      : OOM_WGMMA_D64_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(static_cast<int>(BMajor)), "n"(static_cast<int>(AMajor))
      : "memory");
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  (void)scale_d;
  __trap();
#endif
}

/// The register-sourced form ("RS"): D(64x128, fp32) = A(64x16, bf16, registers) * B + (scale_d ?
/// D : 0), B by descriptor as in wgmma_m64n128k16_f32_bf16_ss (K-major or MN-major).
/// A is 4 x 32-bit registers per thread, two bf16 each (the lower column in the low half), in the
/// layout of the PTX ISA's figure "WGMMA .m64nNk16 register fragment layout for matrix A" (an
/// image; the formula is CUTLASS's ALayout_64x16, cute/atom/mma_traits_sm90_gmma.hpp, whose
/// shape and strides are those of CLayout_64x16, the accumulator layout of an m64n16 tile):
/// thread t, warp w = t / 32, lane l, g = l / 4, c = 2 (l % 4):
///   a[0] = A[16w + g    ][c, c+1]        a[1] = A[16w + g + 8][c, c+1]
///   a[2] = A[16w + g    ][c+8, c+9]      a[3] = A[16w + g + 8][c+8, c+9]
/// i.e. per warp the mma.sync m16n8k16 A fragment, and exactly the accumulator fragment of two
/// adjacent 8-column blocks (d[4j..4j+3], d[4j+4..4j+7] with j even) packed to bf16 pairs: an S
/// accumulator converts to the A operand of the next product in registers (P V of attention).
/// The registers of `a` must not change until the wgmma has completed (wait_group), and a
/// wgmma_fence must separate their last write from the wgmma (PTX ISA, wgmma.fence: "accessing
/// the registers" covers the A fragment as well as the accumulators).
template <Major BMajor = Major::k>
__device__ __forceinline__ void wgmma_m64n128k16_f32_bf16_rs(float (&d)[64], const std::uint32_t (&a)[4],
                                                             std::uint64_t desc_b, int scale_d) {
#if OOM_WGMMA_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " OOM_WGMMA_D64_LIST
      ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
      "}\n"
      : OOM_WGMMA_D64_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(static_cast<int>(BMajor))
      : "memory");
#else
  (void)d;
  (void)a;
  (void)desc_b;
  (void)scale_d;
  __trap();
#endif
}

// The 128 accumulator operands of an N = 256 wgmma, %0 .. %127.
#define OOM_WGMMA_D128_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define OOM_WGMMA_D128_LIST \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

/// D(64x256, fp32) = A(64x16, bf16) * B + (scale_d ? D : 0): the widest N of the instruction, one
/// read of the A tile for all 256 columns where two m64n128k16 read it twice (shared-memory
/// bandwidth: the grouped weight-gradient kernel's consumers stalled on it). Operands as for
/// wgmma_m64n128k16_f32_bf16_ss with N = 256 (an MN-major swizzled B spans four 64-wide N halves
/// at LBO apart); `d` is the accumulator fragment with N = 256: 128 floats per thread, d[4j..4j+3]
/// for the 8-column block j = 0..31, so d[0..63] is the fragment of columns 0..127 and d[64..127]
/// that of columns 128..255 in the m64n128 layout.
template <Major BMajor = Major::k, Major AMajor = Major::k>
__device__ __forceinline__ void wgmma_m64n256k16_f32_bf16_ss(float (&d)[128], std::uint64_t desc_a,
                                                             std::uint64_t desc_b, int scale_d) {
#if OOM_WGMMA_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " OOM_WGMMA_D128_LIST
      ", %128, %129, p, 1, 1, %132, %131;\n"
      "}\n"
      : OOM_WGMMA_D128_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(static_cast<int>(BMajor)), "n"(static_cast<int>(AMajor))
      : "memory");
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  (void)scale_d;
  __trap();
#endif
}

/// wgmma_fence_operands for the 32-bit registers of register-sourced A fragments: their values are
/// computed before this point (an asm statement the wgmma_fence after it cannot be reordered with).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(std::uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#undef OOM_WGMMA_D64_LIST
#undef OOM_WGMMA_D64_OPERANDS
#undef OOM_WGMMA_D128_LIST
#undef OOM_WGMMA_D128_OPERANDS

}  // namespace oom::kernels::hopper
