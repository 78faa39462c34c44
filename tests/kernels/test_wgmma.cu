// The wgmma wrappers (src/kernels/hopper/wgmma.cuh) against a CPU reference: one warpgroup loads
// A (64 x K) and B (N x K), both row-major bf16, into shared memory in one of three placements
// (below; or A straight into the register fragment of the RS form), runs K/16 wgmma.m64nNk16
// (scale-d 0 first, 1 after) and writes C = A B^T (64 x N fp32) from the accumulator fragment.
// Instruction forms: N = 64 with A and B from shared memory, both K-major; N = 128 in four forms,
// A from shared memory (SS) or registers (RS), B K-major or MN-major (imm-trans-b 1, B stored
// K x N). Placements: two of the no-swizzle core matrices that swap which of LBO and SBO is the
// small stride (so a swap of their meanings cannot pass both), and the 128-byte-swizzled layout
// (the one of the attention kernels' swizzled tiles), for K a multiple of 64 (one swizzle atom is 64 bf16 wide). Its facts: the PTX ISA's "Matrix
// Descriptor Format" (swizzle mode bits 62-63, 1 = 128-byte; base offset 0 for a pattern that
// starts on a 1024-byte boundary) and the canonical layouts of the PTX ISA and CUTLASS
// (cute/atom/mma_traits_sm90_gmma.hpp, make_gmma_desc), in elements:
// K-major SW128 Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T)), LBO unused;
// MN-major SW128 Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) (T = 8 bf16 = 16 bytes),
// i.e. LBO along M/N (between 64-wide atoms), SBO along K: the roles the no-swizzle layouts give
// the other way round. At N = 128 an MN-major B spans two atoms, so a swap fails there. That the
// test's own stores land where its descriptors point is checked at compile time
// (stores_match_descriptors), so a GPU failure is about the hardware. Checks, for each form,
// K = 16 to 256 and every placement that fits K:
//   - one-hot A against an exactly representable, position-coded B: every C entry is exactly one
//     B entry, and a wrong one is printed as the B[n][k] it came from (a transposed or misplaced
//     core matrix, a wrong K step, LBO/SBO swapped all show up as a readable pattern);
//   - the mirror image, one-hot B against a position-coded A: a wrong entry prints the A[m][k] it
//     came from (the RS register fragment, or A's shared-memory layout);
//   - random bf16 A and B against fp64 sums of the same bf16 values;
//   - C = C0 + A B^T with C0 loaded into the accumulators through the fragment layout and a
//     runtime scale-d of 1 on the first step (the fragment layout read in, not only written out).
// Otherwise the accumulators start as NaN and the first step's scale-d is a runtime 0 (it must
// ignore them), and C is poisoned with NaN before the launch (an element the fragment store misses
// fails). Needs compute capability 9.0 (sm_90a code only): on any other GPU the test prints why
// and exits 77 (skipped).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/sm90.hpp"
#include "kernels/hopper/wgmma.cuh"
#include "oom/core/cuda_check.hpp"
#include "oom/core/numeric.hpp"

namespace hw = oom::kernels::hopper;

// Descriptor bit packing (PTX ISA "Matrix Descriptor Format"), checked at compile time: start
// address >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45, base offset in 49-51, swizzle
// in 62-63, each address/offset masked to 18 bits before the shift.
static_assert(hw::encode_smem_desc(0, 0, 0) == 0);
static_assert(hw::encode_smem_desc(0x10, 0, 0) == 1);
static_assert(hw::encode_smem_desc(0x3FFF0, 0, 0) == 0x3FFF);
static_assert(hw::encode_smem_desc(0x40010, 0, 0) == 1);  // bit 18 and up dropped
static_assert(hw::encode_smem_desc(0x1F, 0, 0) == 1);     // low 4 bits dropped
static_assert(hw::encode_smem_desc(0, 16, 0) == (1ull << 16));
static_assert(hw::encode_smem_desc(0, 0x3FFF0, 0) == (0x3FFFull << 16));
static_assert(hw::encode_smem_desc(0, 0, 16) == (1ull << 32));
static_assert(hw::encode_smem_desc(0, 0, 0x3FFF0) == (0x3FFFull << 32));
static_assert(hw::encode_smem_desc(0, 0, 0, hw::Swizzle::none, 7) == (7ull << 49));
static_assert(hw::encode_smem_desc(0, 0, 0, hw::Swizzle::b128) == (1ull << 62));
static_assert(hw::encode_smem_desc(0, 0, 0, hw::Swizzle::b64) == (2ull << 62));
static_assert(hw::encode_smem_desc(0, 0, 0, hw::Swizzle::b32) == (3ull << 62));
static_assert(hw::encode_smem_desc(0x1230, 1024, 128) == (0x123ull | (64ull << 16) | (8ull << 32)));

namespace {

using oom::bf16;
using oom::test::DeviceBuffer;

constexpr int kRows = 64;  // M: rows of A and of C
constexpr int kThreads = 128;
constexpr int kShapesN[] = {64, 128};  // the N of each wrapper: wgmma_m64n64k16 and wgmma_m64n128k16

/// How an operand tile with R rows along M/N (R = 64 for A, N for B) and K columns is laid out
/// in shared memory. The no-swizzle placements put its core matrices (8 rows x 8 bf16 = 128 bytes,
/// rows contiguous) core (i, kk) = rows 8i..8i+7, K columns 8kk..8kk+7, at byte i * sbo + kk * lbo:
///   k_slabs: the R/8 core matrices of one 8-wide K slab side by side: sbo = 128, lbo = 16 * R;
///   mn_rows: the K/8 core matrices of one 8-row band side by side:    lbo = 128, sbo = 16 * K.
/// The two swap which stride is the small one, so only the right meaning of LBO and SBO passes both.
///   sw128: the 128-byte swizzle, in atoms 64 bf16 (128 bytes) wide along the contiguous dimension
///     (K for K-major, M/N for MN-major), each atom a region of 128-byte rows (R rows for K-major,
///     K rows for MN-major), regions side by side; within 1024-byte-aligned memory, byte x of that
///     plain layout is stored at x ^ (((x >> 7) & 7) << 4) (the 16-byte chunk index XOR the row
///     index mod 8: the hardware takes the row from address bits 7-9). K must be a multiple of 64.
enum class Placement : int { k_slabs = 0, mn_rows = 1, sw128 = 2 };

/// Whether placement p fits an operand with K columns (sw128: whole 64-wide atoms along K, for the
/// K-major A and B; MN-major B is held to the same list for simplicity).
bool fits(Placement p, int k) { return p != Placement::sw128 || k % 64 == 0; }

struct Strides {
  std::uint32_t lbo;  ///< bytes between core matrices adjacent along K
  std::uint32_t sbo;  ///< bytes between core matrices adjacent along M / N
};

/// The core-matrix strides of the no-swizzle placements.
__host__ __device__ constexpr Strides strides_of(Placement p, int k, int rows) {
  if (p == Placement::k_slabs) return {static_cast<std::uint32_t>(16 * rows), 128u};
  return {128u, static_cast<std::uint32_t>(16 * k)};
}

const char* name_of(Placement p) {
  if (p == Placement::sw128) return "sw128 (128-byte swizzle)";
  return p == Placement::k_slabs ? "k_slabs (LBO 16R, SBO 128)" : "mn_rows (LBO 128, SBO 16K)";
}

/// Byte offset of element (mn, kk) of an operand in core matrices placed by `st` (core (mn/8, kk/8)
/// at (mn/8) * SBO + (kk/8) * LBO). Inside a core matrix (128 contiguous bytes, 8 rows of 16 bytes):
///   K-major:  row = mn % 8, the 8 K values kk % 8 along the row;
///   MN-major: row = kk % 8, the 8 M/N values mn % 8 along the row.
__host__ __device__ constexpr std::uint32_t element_offset(hw::Major major, Strides st, int mn, int kk) {
  const std::uint32_t core = (mn / 8) * st.sbo + (kk / 8) * st.lbo;
  if (major == hw::Major::k) return core + (mn % 8) * 16 + (kk % 8) * 2;
  return core + (kk % 8) * 16 + (mn % 8) * 2;
}

/// The 128-byte swizzle of byte offset x from a 1024-byte boundary: 16-byte chunk ^= row % 8.
__host__ __device__ constexpr std::uint32_t swizzle128(std::uint32_t x) { return x ^ (((x >> 7) & 7u) << 4); }

/// Byte offset of element (mn, kk) of an operand with `rows` rows along M/N and K along K, in
/// `placement`.
///   sw128, K-major:  atom kk/64 = R rows x 128 bytes at (kk/64) R 128, row mn, bytes (kk%64) 2;
///   sw128, MN-major: atom mn/64 = K rows x 128 bytes at (mn/64) K 128, row kk, bytes (mn%64) 2.
__host__ __device__ constexpr std::uint32_t operand_offset(Placement placement, hw::Major major, int rows, int k, int mn,
                                                           int kk) {
  if (placement != Placement::sw128) return element_offset(major, strides_of(placement, k, rows), mn, kk);
  if (major == hw::Major::k) return swizzle128((kk / 64) * rows * 128 + mn * 128 + (kk % 64) * 2);
  return swizzle128((mn / 64) * k * 128 + kk * 128 + (mn % 64) * 2);
}

/// The descriptor fields of an operand tile (which starts 1024-byte aligned): LBO, SBO, the swizzle
/// mode, and where k-step s (K values 16s .. 16s+15) starts, (s / 4) step4 + (s % 4) step1 bytes
/// into the tile. One formula for every placement, its fields chosen once before the K loop:
/// choosing them per k-step (a branch on the placement between the wgmmas) made ptxas inject
/// warpgroup.arrives (C7519).
struct DescFields {
  std::uint32_t lbo, sbo, step1, step4;
  hw::Swizzle swizzle;
  __host__ __device__ constexpr std::uint32_t start(int s) const { return (s / 4) * step4 + (s % 4) * step1; }
};
__host__ __device__ constexpr DescFields desc_of(Placement placement, hw::Major major, int rows, int k) {
  if (placement != Placement::sw128) {
    // 16 K values = two core matrices along K (for either major-ness): 2 LBO further on.
    const Strides st = strides_of(placement, k, rows);
    return {st.lbo, st.sbo, 2 * st.lbo, 8 * st.lbo, hw::Swizzle::none};
  }
  // K-major: the k-step is 32 bytes of each 128-byte row of atom s/4 (the hardware swizzles the
  // address it forms, so the start moves by the plain offset); SBO = next 8 rows; LBO unused (16).
  if (major == hw::Major::k) return {16u, 1024u, 32u, static_cast<std::uint32_t>(rows * 128), hw::Swizzle::b128};
  // MN-major: the k-step is rows 16s .. 16s+15 of every atom (2048 bytes on); LBO = next 64 M/N
  // values (the next atom, K rows of 128 bytes further), SBO = next 8 K rows.
  return {static_cast<std::uint32_t>(k * 128), 1024u, 2048u, 4 * 2048u, hw::Swizzle::b128};
}

/// The byte a wgmma reads for element (mn, j) (j < 16 along K) of k-step s of a tile with
/// descriptor fields d, per the canonical layouts (see the top of the file; no-swizzle: wgmma.cuh),
/// the tile 1024-byte aligned so that swizzling the offset is swizzling the address.
constexpr std::uint32_t read_offset(DescFields d, int s, hw::Major major, int mn, int j) {
  const std::uint32_t start = d.start(s);
  if (d.swizzle == hw::Swizzle::none) return start + element_offset(major, {d.lbo, d.sbo}, mn, j);
  if (major == hw::Major::k) return swizzle128(start + (mn / 8) * d.sbo + (mn % 8) * 128 + j * 2);
  return swizzle128(start + (mn / 64) * d.lbo + (j / 8) * d.sbo + (j % 8) * 128 + (mn % 64) * 2);
}

/// The test's own consistency, at compile time: every element is stored inside its tile
/// (rows * K * 2 bytes, so the A and B tiles cannot overlap), no two in the same place, and where
/// its k-step's descriptor says the wgmma reads it. Then a GPU failure is the hardware disagreeing
/// with the layout facts, not the stores disagreeing with the descriptors or each other.
constexpr bool stores_match_descriptors(Placement placement, hw::Major major, int rows, int k) {
  bool used[128 * 256] = {};  // per 2-byte slot of the largest tile
  for (int mn = 0; mn < rows; ++mn)
    for (int kk = 0; kk < k; ++kk) {
      const std::uint32_t at = operand_offset(placement, major, rows, k, mn, kk);
      if (at % 2 != 0 || at >= static_cast<std::uint32_t>(rows * k * 2) || used[at / 2] ||
          at != read_offset(desc_of(placement, major, rows, k), kk / 16, major, mn, kk % 16))
        return false;
      used[at / 2] = true;
    }
  return true;
}
static_assert(stores_match_descriptors(Placement::k_slabs, hw::Major::k, 64, 128));
static_assert(stores_match_descriptors(Placement::mn_rows, hw::Major::mn, 128, 128));
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::k, 64, 64));    // A; B at N = 64
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::k, 64, 256));
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::k, 128, 128));  // B at N = 128
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::k, 128, 256));
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::mn, 128, 64));
static_assert(stores_match_descriptors(Placement::sw128, hw::Major::mn, 128, 256));
// The swizzle itself: row 1 of an atom has its 16-byte chunks 0 and 1 exchanged, row 7 chunk 0
// at chunk 7, and the bytes within a chunk stay in order.
static_assert(swizzle128(128) == 144 && swizzle128(144) == 128 && swizzle128(7 * 128 + 2) == 7 * 128 + 112 + 2);

/// One block of 128 threads (one warpgroup). a: (64, K), b: (N, K) row-major bf16; c: (64, N)
/// fp32. c0: null (accumulators start as NaN) or (64, N) fp32 loaded into the accumulators through
/// the fragment layout. first_scale_d: scale-d of the first K step, a runtime value (the later
/// steps use 1): 0 computes A B^T, 1 computes c0 + A B^T.
/// REG_A: A goes from global memory straight into the register fragment of the RS form
/// (wgmma.cuh, wgmma_m64n128k16_f32_bf16_rs), else into shared memory K-major as B's placement.
/// B_MAJOR: B goes into shared memory K-major (stored N x K) or MN-major (stored K x N), laid out
/// as `placement` says; the wgmma's imm-trans-b says which.
/// Dynamic shared memory: (64 + N) * K * 2 + 1024 bytes (the tiles start at the first 1024-byte
/// boundary). K is a template parameter so that the K loop unrolls, as it will in real kernels (a
/// runtime trip count makes ptxas serialize the wgmmas).
template <int K, int N, bool REG_A = false, hw::Major B_MAJOR = hw::Major::k>
__global__ void __launch_bounds__(kThreads) wgmma_abt_kernel(const std::uint16_t* a, const std::uint16_t* b,
                                                             const float* c0, float* c, Placement placement,
                                                             int first_scale_d) {
  static_assert(K % 16 == 0 && K >= 16);
  static_assert(N == 64 || N == 128, "a wrapper exists for N = 64 and N = 128");
  static_assert(N == 128 || (!REG_A && B_MAJOR == hw::Major::k), "the RS and MN-major B forms exist for N = 128");
  constexpr int k = K;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // sw128 swizzles by address bits 7-9, so its tiles must start on 1024-byte boundaries (the
  // dynamic allocation promises less); A's tile is a multiple of 1 KiB long, so B's starts on one
  // too. The no-swizzle placements need 16 bytes and get the same start.
  const auto raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  unsigned char* sa = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  unsigned char* sb = sa + kRows * k * 2;
  const DescFields fields_a = desc_of(placement, hw::Major::k, kRows, k);
  const DescFields fields_b = desc_of(placement, B_MAJOR, N, k);

  // Global -> shared, one element at a time (a test: clarity over speed).
  if (!REG_A)
    for (int q = threadIdx.x; q < kRows * k; q += blockDim.x) {
      const int r = q / k, kk = q % k;
      *reinterpret_cast<std::uint16_t*>(sa + operand_offset(placement, hw::Major::k, kRows, k, r, kk)) = a[q];
    }
  for (int q = threadIdx.x; q < N * k; q += blockDim.x) {
    const int r = q / k, kk = q % k;
    *reinterpret_cast<std::uint16_t*>(sb + operand_offset(placement, B_MAJOR, N, k, r, kk)) = b[q];
  }
  hw::fence_proxy_async_shared();  // these generic-proxy writes before the wgmmas' async-proxy reads
  __syncthreads();

  // Accumulator fragment (wgmma.cuh): warp w owns rows 16w..16w+15; per 8-column block j, lane l
  // holds (16w + l/4, 8j + 2(l%4) + {0,1}) in d[4j], d[4j+1] and the same 8 rows lower in d[4j+2..3].
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  const int row = 16 * w + l / 4;
  float d[N / 2];
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int col = 8 * j + 2 * (l % 4);
    if (c0 != nullptr) {
      d[4 * j + 0] = c0[row * N + col];
      d[4 * j + 1] = c0[row * N + col + 1];
      d[4 * j + 2] = c0[(row + 8) * N + col];
      d[4 * j + 3] = c0[(row + 8) * N + col + 1];
    } else {
      // NaN: a first wgmma with scale-d 0 must overwrite, never read, the accumulators.
      for (int e = 0; e < 4; ++e) d[4 * j + e] = __int_as_float(0x7fc00000);
    }
  }
  // The A fragment of the RS form (wgmma.cuh): k-step s, a[s][0] = A[row][16s + 2(l%4) + {0,1}],
  // a[s][1] the same 8 rows lower, a[s][2], a[s][3] the same 8 columns further; the lower column
  // in the low 16 bits.
  std::uint32_t fa[k / 16][4];
  if constexpr (REG_A) {
    const auto pair = [&](int r, int kk) {
      return static_cast<std::uint32_t>(a[r * k + kk]) | (static_cast<std::uint32_t>(a[r * k + kk + 1]) << 16);
    };
#pragma unroll
    for (int s = 0; s < k / 16; ++s) {
      const int col = 16 * s + 2 * (l % 4);
      fa[s][0] = pair(row, col);
      fa[s][1] = pair(row + 8, col);
      fa[s][2] = pair(row, col + 8);
      fa[s][3] = pair(row + 8, col + 8);
      hw::wgmma_fence_operands(fa[s]);
    }
  }
  hw::wgmma_fence_operands(d);
  hw::wgmma_fence();
#pragma unroll
  for (int s = 0; s < k / 16; ++s) {
    const std::uint64_t db =
        hw::make_smem_desc(sb + fields_b.start(s), fields_b.lbo, fields_b.sbo, fields_b.swizzle);
    const int scale_d = s > 0 ? 1 : first_scale_d;
    if constexpr (REG_A) {
      hw::wgmma_m64n128k16_f32_bf16_rs<B_MAJOR>(d, fa[s], db, scale_d);
    } else {
      const std::uint64_t da =
          hw::make_smem_desc(sa + fields_a.start(s), fields_a.lbo, fields_a.sbo, fields_a.swizzle);
      if constexpr (N == 64)
        hw::wgmma_m64n64k16_f32_bf16_ss(d, da, db, scale_d);
      else
        hw::wgmma_m64n128k16_f32_bf16_ss<B_MAJOR>(d, da, db, scale_d);
    }
  }
  hw::wgmma_commit_group();
  hw::wgmma_wait_group<0>();
  hw::wgmma_fence_operands(d);
  if constexpr (REG_A) {
    // The RS wgmmas read fa asynchronously: keep its registers from being reused before the wait.
#pragma unroll
    for (int s = 0; s < k / 16; ++s) hw::wgmma_fence_operands(fa[s]);
  }

#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int col = 8 * j + 2 * (l % 4);
    c[row * N + col] = d[4 * j + 0];
    c[row * N + col + 1] = d[4 * j + 1];
    c[(row + 8) * N + col] = d[4 * j + 2];
    c[(row + 8) * N + col + 1] = d[4 * j + 3];
  }
}

void require_sm90() { oom::test::require_sm90("test_wgmma"); }

/// Which instruction form a run uses: A from shared memory (SS) or registers (RS), B K-major or
/// MN-major. The first is the only one for N = 64.
struct Form {
  bool reg_a = false;
  hw::Major b_major = hw::Major::k;
};
const char* name_of(Form f) {
  if (f.reg_a) return f.b_major == hw::Major::k ? "RS, B K-major" : "RS, B MN-major";
  return f.b_major == hw::Major::k ? "SS, B K-major" : "SS, B MN-major";
}
constexpr Form kFormsN128[] = {Form{false, hw::Major::k}, Form{true, hw::Major::k}, Form{false, hw::Major::mn},
                               Form{true, hw::Major::mn}};

/// C = A B^T on the GPU (c0 empty), or C = c0 + A B^T (c0 64 x N, scale-d 1 from the first step);
/// a: (64, K), b: (N, K) row-major.
std::vector<float> run_gpu(const std::vector<bf16>& a, const std::vector<bf16>& b, int k, int n, Placement placement,
                           Form form, const std::vector<float>& c0 = {}) {
  require_sm90();
  DeviceBuffer<bf16> da(a), db(b);
  DeviceBuffer<float> dc0(c0);
  DeviceBuffer<float> dc(static_cast<std::size_t>(kRows) * n);  // poisoned: NaN
  const int smem = (kRows + n) * k * static_cast<int>(sizeof(bf16)) + 1024;  // + room to align to 1 KiB
  oom::test::Stream stream;
  const auto* pa = reinterpret_cast<const std::uint16_t*>(da.get());
  const auto* pb = reinterpret_cast<const std::uint16_t*>(db.get());
  const auto launch = [&](auto kernel) {
    OOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<1, kThreads, smem, stream.s>>>(pa, pb, c0.empty() ? nullptr : dc0.get(), dc.get(), placement,
                                             c0.empty() ? 0 : 1);
  };
  const auto for_k = [&]<int N, bool RA, hw::Major BM>() {
    switch (k) {
      case 16: launch(wgmma_abt_kernel<16, N, RA, BM>); break;
      case 64: launch(wgmma_abt_kernel<64, N, RA, BM>); break;
      case 128: launch(wgmma_abt_kernel<128, N, RA, BM>); break;
      case 256: launch(wgmma_abt_kernel<256, N, RA, BM>); break;
      default: FAIL("no kernel instance for K = " << k);
    }
  };
  if (n == 64 && !form.reg_a && form.b_major == hw::Major::k)
    for_k.template operator()<64, false, hw::Major::k>();
  else if (n == 128 && !form.reg_a && form.b_major == hw::Major::k)
    for_k.template operator()<128, false, hw::Major::k>();
  else if (n == 128 && form.reg_a && form.b_major == hw::Major::k)
    for_k.template operator()<128, true, hw::Major::k>();
  else if (n == 128 && !form.reg_a && form.b_major == hw::Major::mn)
    for_k.template operator()<128, false, hw::Major::mn>();
  else if (n == 128 && form.reg_a && form.b_major == hw::Major::mn)
    for_k.template operator()<128, true, hw::Major::mn>();
  else
    FAIL("no kernel instance for N = " << n << ", " << name_of(form));
  OOM_CUDA_CHECK_LAUNCH();
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  return dc.download();
}

/// Uniform on [-1, 1) by a counter hash (splitmix64), rounded to bf16.
std::vector<bf16> random_bf16(std::size_t n, std::uint64_t seed) {
  std::vector<bf16> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53;
    out[i] = oom::to_bf16(static_cast<float>(2 * u - 1));
  }
  return out;
}

/// Position code of B[n][k] (n < 128, k < 256), exact in bf16: (k < 128 ? 1 : -1) *
/// (1 + (k % 128) / 128) * 2^(n - 64). 7 mantissa bits hold k % 128, the exponent holds n, the sign
/// the top bit of k (2^-64 .. 2^64 are normal numbers in bf16 and fp32).
float code_of(int n, int k) {
  const float mant = 1.0f + static_cast<float>(k % 128) / 128.0f;
  return (k < 128 ? 1.0f : -1.0f) * std::ldexp(mant, n - 64);
}
/// Inverse of code_of; false when v is no code (NaN, zero, a sum of several entries, ...).
bool decode(float v, int& n, int& k) {
  if (!std::isfinite(v) || v == 0.0f) return false;
  int e = 0;
  const float f = std::frexp(std::fabs(v), &e);  // |v| = f * 2^e, f in [0.5, 1)
  const float m = (2.0f * f - 1.0f) * 128.0f;    // |v| = (1 + m / 128) * 2^(e - 1)
  n = e - 1 + 64;
  k = static_cast<int>(m) + (v < 0 ? 128 : 0);
  return n >= 0 && n < 128 && k >= 0 && k < 256 && code_of(n, k) == v;
}

/// The operand entry a coded value is ("B[n][k]" for operand 'B', "A[m][k]" for 'A').
std::string describe(float v, char operand) {
  int n = 0, k = 0;
  char buf[64];
  if (decode(v, n, k))
    std::snprintf(buf, sizeof buf, "%c[%d][%d]", operand, n, k);
  else
    std::snprintf(buf, sizeof buf, "%.9g (no %c entry)", static_cast<double>(v), operand);
  return buf;
}

/// Compares C = c0 + A B^T (got, 64 x N; c0 empty: 0) with the fp64 sum of the same values. Per entry
///   |got - want| <= tol_rel * (|c0_ij| + sum_k |a_ik b_jk|) + tol_abs.
/// Prints the first mismatches as (row, col, got, want); `coded` ('A' or 'B'; 0: none) also names
/// the entry of that position-coded operand each value is. Returns the number of mismatches.
int compare(const std::vector<float>& got, const std::vector<bf16>& a, const std::vector<bf16>& b, int k, int n,
            double tol_rel, double tol_abs, char coded, const char* what, const std::vector<float>& c0 = {}) {
  int bad = 0;
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < n; ++j) {
      const double init = c0.empty() ? 0.0 : static_cast<double>(c0[static_cast<std::size_t>(i) * n + j]);
      double want = init, mag = std::fabs(init);
      for (int t = 0; t < k; ++t) {
        const double p = static_cast<double>(oom::to_float(a[static_cast<std::size_t>(i) * k + t])) *
                         static_cast<double>(oom::to_float(b[static_cast<std::size_t>(j) * k + t]));
        want += p;
        mag += std::fabs(p);
      }
      const float g = got[static_cast<std::size_t>(i) * n + j];
      const double err = std::fabs(static_cast<double>(g) - want);
      if (!(err <= tol_rel * mag + tol_abs)) {  // NaN fails
        if (bad < 8) {
          if (coded != 0)
            std::printf("  %s: C[%d][%d] = %s, want %s\n", what, i, j, describe(g, coded).c_str(),
                        describe(static_cast<float>(want), coded).c_str());
          else
            std::printf("  %s: C[%d][%d] = %.9g, want %.9g (|err| %.3g > tol %.3g)\n", what, i, j,
                        static_cast<double>(g), want, err, tol_rel * mag + tol_abs);
        }
        ++bad;
      }
    }
  if (bad > 0) std::printf("  %s: %d of %d entries wrong\n", what, bad, kRows * n);
  return bad;
}

constexpr Placement kPlacements[] = {Placement::k_slabs, Placement::mn_rows, Placement::sw128};

/// The instruction forms tested at each N: all four at N = 128, SS with B K-major at N = 64.
std::vector<Form> forms_for(int n) {
  if (n == 128) return {std::begin(kFormsN128), std::end(kFormsN128)};
  return {Form{}};
}

}  // namespace

/// One exact case (one-hot x position-coded) in every form of N and every placement that fits K:
/// a wrong entry is printed as the `coded` operand's entry it came from ('A' or 'B').
static void check_exact_in_every_form(const std::vector<bf16>& a, const std::vector<bf16>& b, int k, int n, int shift,
                               const char* inputs, char coded) {
  for (const Form f : forms_for(n))
    for (const Placement p : kPlacements) {
      if (!fits(p, k)) continue;
      char what[160];
      std::snprintf(what, sizeof what, "%s, N=%d K=%d shift=%d %s, %s", inputs, n, k, shift, name_of(f), name_of(p));
      CAPTURE(what);
      const auto c = run_gpu(a, b, k, n, p, f);
      CHECK(compare(c, a, b, k, n, 0.0, 0.0, coded, what) == 0);
    }
}

TEST_CASE("wgmma m64nNk16 bf16 (N = 64, 128; SS/RS, B K-/MN-major): one-hot A picks one position-coded B entry per C entry, exactly") {
  // A[i][t] = 1 where t = (i + shift) % K, else 0, so C[i][j] = B[j][(i + shift) % K] with no
  // rounding at all (one exact product, the rest exact zeros): compared exactly (tol 0). A wrong
  // B layout (LBO/SBO swapped, a core matrix transposed, K-major read as MN-major) shows as the
  // B[n][k] each wrong entry came from.
  struct Case {
    int k, shift;
  };
  for (const int n : kShapesN)
    for (const Case cs : {Case{16, 0}, Case{64, 0}, Case{64, 37}, Case{128, 5}, Case{256, 100}}) {
      std::vector<bf16> a(static_cast<std::size_t>(kRows) * cs.k, oom::to_bf16(0.0f));
      std::vector<bf16> b(static_cast<std::size_t>(n) * cs.k);
      for (int i = 0; i < kRows; ++i) a[static_cast<std::size_t>(i) * cs.k + (i + cs.shift) % cs.k] = oom::to_bf16(1.0f);
      for (int j = 0; j < n; ++j)
        for (int t = 0; t < cs.k; ++t) {
          const float v = code_of(j, t);
          REQUIRE(oom::to_float(oom::to_bf16(v)) == v);  // the code is exact in bf16
          b[static_cast<std::size_t>(j) * cs.k + t] = oom::to_bf16(v);
        }
      check_exact_in_every_form(a, b, cs.k, n, cs.shift, "one-hot A, coded B", 'B');
    }
}

TEST_CASE("wgmma m64nNk16 bf16 (N = 64, 128; SS/RS, B K-/MN-major): one-hot B picks one position-coded A entry per C entry, exactly") {
  // The mirror image: B[j][t] = 1 where t = (j + shift) % K, else 0, and A[i][t] coded, so
  // C[i][j] = A[i][(j + shift) % K]; a wrong A layout (register fragment or shared memory) shows as
  // the A[m][k] each wrong entry came from.
  struct Case {
    int k, shift;
  };
  for (const int n : kShapesN)
    for (const Case cs : {Case{16, 0}, Case{64, 3}, Case{128, 0}, Case{256, 77}}) {
      std::vector<bf16> a(static_cast<std::size_t>(kRows) * cs.k);
      std::vector<bf16> b(static_cast<std::size_t>(n) * cs.k, oom::to_bf16(0.0f));
      for (int i = 0; i < kRows; ++i)
        for (int t = 0; t < cs.k; ++t) {
          const float v = code_of(i, t);
          REQUIRE(oom::to_float(oom::to_bf16(v)) == v);
          a[static_cast<std::size_t>(i) * cs.k + t] = oom::to_bf16(v);
        }
      for (int j = 0; j < n; ++j) b[static_cast<std::size_t>(j) * cs.k + (j + cs.shift) % cs.k] = oom::to_bf16(1.0f);
      check_exact_in_every_form(a, b, cs.k, n, cs.shift, "coded A, one-hot B", 'A');
    }
}

TEST_CASE("wgmma m64nNk16 bf16 (N = 64, 128; SS/RS, B K-/MN-major): C = A B^T on random inputs, K = 16, 64, 128, 256") {
  // Tolerance: every product of two bf16 values is exact in fp32 (8 + 8 significant bits), so the
  // only error is in the fp32 additions. However the tensor core orders and rounds them, each sum
  // along any path to the result passes through at most K additions, each off by at most one ulp
  // (2^-23 relative, allowing truncation instead of round-to-nearest) of a partial sum bounded by
  // sum |a b|: |err| <= K * 2^-23 * sum_k |a_ik b_jk|, plus 1e-6 for the fp64 reference's own
  // rounding near zero. For K = 256 that is 3e-5 of sum |a b| (~ K / 4 here), while a layout error
  // moves entries by O(1).
  std::uint64_t seed = 1;
  for (const int n : kShapesN)
    for (const int k : {16, 64, 128, 256}) {
      const auto a = random_bf16(static_cast<std::size_t>(kRows) * k, seed++);
      const auto b = random_bf16(static_cast<std::size_t>(n) * k, seed++);
      for (const Form f : forms_for(n))
        for (const Placement p : kPlacements) {
          if (!fits(p, k)) continue;
          char what[160];
          std::snprintf(what, sizeof what, "random N=%d K=%d %s, %s", n, k, name_of(f), name_of(p));
          CAPTURE(what);
          const auto c = run_gpu(a, b, k, n, p, f);
          CHECK(compare(c, a, b, k, n, k * 0x1.0p-23, 1e-6, 0, what) == 0);
        }
    }
}

TEST_CASE("wgmma m64nNk16 bf16 (N = 64, 128; SS/RS, B K-/MN-major): scale-d 1 on the first step accumulates onto C0 given in the fragment layout") {
  // C0 goes into the accumulators through the same fragment layout the result comes out of, and
  // the first wgmma's scale-d is a runtime 1: C = C0 + A B^T. Same error bound as above, with |C0|
  // counted in the magnitude (K + 1 additions). C0[i][j] = i + j/N (exact): any two entries differ
  // by at least 1/N >= 1/128, far above that bound (~6e-4 here), so a C0 entry in the wrong place
  // fails.
  const int k = 64;
  for (const int n : kShapesN) {
    const auto a = random_bf16(static_cast<std::size_t>(kRows) * k, 101);
    const auto b = random_bf16(static_cast<std::size_t>(n) * k, 102);
    std::vector<float> c0(static_cast<std::size_t>(kRows) * n);
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < n; ++j)
        c0[static_cast<std::size_t>(i) * n + j] = static_cast<float>(i) + static_cast<float>(j) / static_cast<float>(n);
    for (const Form f : forms_for(n))
      for (const Placement p : kPlacements) {
        char what[160];
        std::snprintf(what, sizeof what, "C0 + A B^T N=%d K=%d %s, %s", n, k, name_of(f), name_of(p));
        CAPTURE(what);
        const auto c = run_gpu(a, b, k, n, p, f, c0);
        CHECK(compare(c, a, b, k, n, (k + 1) * 0x1.0p-23, 1e-6, 0, what, c0) == 0);
      }
  }
}
