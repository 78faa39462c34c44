// Building blocks of the flash-attention kernels (attention_forward.cu, attention_backward.cu):
// cp.async tile loads into XOR-swizzled shared memory, ldmatrix, mma.sync m16n8k16 bf16 with fp32
// accumulators, and the two warp-level GEMM shapes every pass of FlashAttention-2 is made of.
//
// Register fragments follow the PTX ISA's mma.m16n8k16 layout; lane = 4 * g + t
// (g = groupID = lane / 4, t = lane % 4):
//   A 16x16 (row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C 16x8  fp32:        c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// so a C tile pair (n-tiles 2s, 2s+1) converts to bf16 straight into the A operand of the next
// product (P V, dS K, ...) without touching shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "oom/kernels/attention.hpp"
#include "refuse.hpp"

namespace oom::kernels::attention_detail {

constexpr float log2e = 1.4426950408889634f;
constexpr float ln2 = 0.6931471805599453f;

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte global->shared copy; when !valid the destination is zero-filled (src-size 0) and
/// nothing is read, so rows past the sequence end read as zeros (never garbage that 0 * NaN
/// would turn into NaN).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
/// 4-byte variant (cp.async.ca) for per-row statistics, zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/// `addr`: a shared-memory address (32-bit, as smem_addr gives): keeping tile addresses 32-bit
/// instead of generic 64-bit pointers saves registers in the unrolled GEMM loops.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// c += a * b, one m16n8k16 bf16 tensor-core product with fp32 accumulation.
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Two floats as bf16x2 (round to nearest even), `lo` in the low half (the lower column).
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

/// A wgmma accumulator fragment of a 64 x N tile (N / 2 floats per thread, hopper/wgmma.cuh)
/// rounded to bf16 as the register (RS) A operand of the next product, one k-step of 16 columns per
/// row of `a`: k-step ks covers 8-column blocks 2ks, 2ks+1; [0] = (row g, block 2ks), [1] = (row
/// g+8, block 2ks), [2] = (row g, block 2ks+1), [3] = (row g+8, block 2ks+1), the lower column in
/// the low half. The Hopper attention kernels' P (forward), P^T and dS^T / dS (backward).
template <int N>
__device__ __forceinline__ void pack_rs_fragments(std::uint32_t (&a)[N / 16][4], const float (&acc)[N / 2]) {
#pragma unroll
  for (int ks = 0; ks < N / 16; ++ks) {
    a[ks][0] = pack_bf16(acc[8 * ks + 0], acc[8 * ks + 1]);
    a[ks][1] = pack_bf16(acc[8 * ks + 2], acc[8 * ks + 3]);
    a[ks][2] = pack_bf16(acc[8 * ks + 4], acc[8 * ks + 5]);
    a[ks][3] = pack_bf16(acc[8 * ks + 6], acc[8 * ks + 7]);
  }
}

/// A shared-memory tile of ROWS x D bf16, rows of D contiguous, 16-byte chunks XOR-swizzled by the
/// row's low 3 bits: the 8 rows an ldmatrix phase reads at one column land in 8 different
/// 16-byte bank groups, so there are no bank conflicts (D/8 >= 16 chunks per row).
template <int D>
__device__ __forceinline__ int swizzle(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

/// Copies rows [row0, row0 + ROWS) of a strided (token_stride elements) global matrix into a
/// swizzled tile; rows >= row_end are zero-filled. All THREADS threads take part.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(__nv_bfloat16* tile, const __nv_bfloat16* base, std::int64_t token_stride,
                                          int row0, int row_end) {
  constexpr int chunks_per_row = D / 8;
  static_assert((ROWS * chunks_per_row) % THREADS == 0, "tile chunks must split evenly over the block");
#pragma unroll
  for (int i = 0; i < ROWS * chunks_per_row / THREADS; ++i) {
    const int c = i * THREADS + static_cast<int>(threadIdx.x);
    const int r = c / chunks_per_row;
    const int ch = c % chunks_per_row;
    const bool valid = row0 + r < row_end;
    const __nv_bfloat16* src = valid ? base + static_cast<std::int64_t>(row0 + r) * token_stride + ch * 8 : base;
    cp_async_16(tile + swizzle<D>(r, ch * 8), src, valid);
  }
}

/// Tiles are passed as shared-memory addresses (smem_addr of the tile's first element).
/// acc[mt][nt] += A[a_row0 + 16 mt .., 0..K) * B[b_row0 + 8 nt .., 0..K)^T with A and B swizzled
/// tiles of row length D (both operands "row-major over the contracted dimension"): Q K^T, dO V^T,
/// K Q^T, V dO^T.
template <int M_TILES, int N_TILES, int D>
__device__ __forceinline__ void gemm_smem_nt(float (&acc)[M_TILES][N_TILES][4], std::uint32_t a_tile, int a_row0,
                                             std::uint32_t b_tile, int b_row0) {
  static_assert(N_TILES % 2 == 0, "B is loaded two n-tiles at a time");
  const int lane = threadIdx.x & 31;
  // Unrolled by 2 only: fully unrolled, ptxas hoists every k-step's loads and runs out of registers.
#pragma unroll 2
  for (int ks = 0; ks < D / 16; ++ks) {
    std::uint32_t a[M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
      ldmatrix_x4(a[mt], a_tile + 2 * swizzle<D>(a_row0 + mt * 16 + (lane & 15), ks * 16 + (lane >> 4) * 8));
#pragma unroll
    for (int np = 0; np < N_TILES / 2; ++np) {
      std::uint32_t b[4];  // b[0], b[1]: n-tile 2np; b[2], b[3]: n-tile 2np+1
      ldmatrix_x4(b, b_tile + 2 * swizzle<D>(b_row0 + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                         ks * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

/// Converts fp32 accumulators (16 M_TILES x 16 K_STEPS) to bf16 A fragments: C tiles 2s and
/// 2s+1 are exactly A's k-step s (see the layout above).
template <int M_TILES, int K_STEPS>
__device__ __forceinline__ void pack_a(std::uint32_t (&a)[M_TILES][K_STEPS][4], const float (&p)[M_TILES][2 * K_STEPS][4]) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
      a[mt][ks][0] = pack_bf16(p[mt][2 * ks][0], p[mt][2 * ks][1]);
      a[mt][ks][1] = pack_bf16(p[mt][2 * ks][2], p[mt][2 * ks][3]);
      a[mt][ks][2] = pack_bf16(p[mt][2 * ks + 1][0], p[mt][2 * ks + 1][1]);
      a[mt][ks][3] = pack_bf16(p[mt][2 * ks + 1][2], p[mt][2 * ks + 1][3]);
    }
}

/// acc[mt][nt] += A * B[b_row0 + k, col0 + 8 nt ..] where A (16 M_TILES x 16 K_STEPS, bf16
/// fragments from pack_a) is in registers and B is a swizzled tile read transposed
/// (ldmatrix.trans): P V, dS K, P^T dO, dS^T Q.
template <int M_TILES, int K_STEPS, int N_TILES, int D>
__device__ __forceinline__ void gemm_regs_nn(float (&acc)[M_TILES][N_TILES][4], const std::uint32_t (&a)[M_TILES][K_STEPS][4],
                                             std::uint32_t b_tile, int b_row0, int col0) {
  static_assert(N_TILES % 2 == 0, "B is loaded two n-tiles at a time");
  const int lane = threadIdx.x & 31;
#pragma unroll  // fully: `a` must be indexed by constants to stay in registers
  for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
    for (int np = 0; np < N_TILES / 2; ++np) {
      std::uint32_t b[4];  // b[0], b[1]: n-tile 2np; b[2], b[3]: n-tile 2np+1
      ldmatrix_x4_trans(b, b_tile + 2 * swizzle<D>(b_row0 + ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                               col0 + np * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma_16816(acc[mt][2 * np], a[mt][ks], b[0], b[1]);
        mma_16816(acc[mt][2 * np + 1], a[mt][ks], b[2], b[3]);
      }
    }
  }
}

template <int M, int N>
__device__ __forceinline__ void zero(float (&acc)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
}

/// Writes a warp's fp32 accumulator tile (16 M_TILES rows x 8 N_TILES columns) times `scale` into
/// rows row0 + .. of a strided global matrix; rows >= row_end are skipped. bf16 rows are stored,
/// or with `accumulate` added to (bf16(acc scale + old)); fp32 rows are always added to
/// (attention_backward_dkv_sum's dK/dV sums).
template <int M_TILES, int N_TILES, class Out>
__device__ __forceinline__ void store_rows(const float (&acc)[M_TILES][N_TILES][4], Out* base, std::int64_t token_stride,
                                           int row0, int row_end, float scale, bool accumulate = false) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + g + 8 * half;
      if (row >= row_end) continue;
      Out* dst = base + static_cast<std::int64_t>(row) * token_stride + 2 * t;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt) {
        float x0 = acc[mt][nt][2 * half] * scale, x1 = acc[mt][nt][2 * half + 1] * scale;
        if constexpr (std::is_same_v<Out, float>) {
          auto* d2 = reinterpret_cast<float2*>(dst + nt * 8);
          const float2 old = *d2;
          *d2 = make_float2(old.x + x0, old.y + x1);
        } else {
          auto* d2 = reinterpret_cast<__nv_bfloat162*>(dst + nt * 8);
          if (accumulate) {
            const float2 old = __bfloat1622float2(*d2);
            x0 += old.x;
            x1 += old.y;
          }
          *d2 = __floats2bfloat162_rn(x0, x1);
        }
      }
    }
}

// ---- host side, shared by the launchers ----

/// What a forward kernel (attention_forward.cu, hopper/attention_forward_wgmma.cu) reads of its
/// problem: pointers, strides in elements, sizes, the query range and the scale.
struct ForwardParams {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  __nv_bfloat16* o;
  float* lse;
  std::int64_t q_batch, q_token, k_batch, k_token, v_batch, v_token, o_batch, o_token;
  int seq, heads_q, group, q_begin, q_end;
  float scale_log2;  // softmax_scale * log2(e): exponentials are exp2
};

inline ForwardParams forward_params(const AttentionProblem& p, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                    TokenRows<const bf16> v, TokenRows<bf16> o, float* lse) {
  ForwardParams params{};
  params.q = reinterpret_cast<const __nv_bfloat16*>(q.data);
  params.k = reinterpret_cast<const __nv_bfloat16*>(k.data);
  params.v = reinterpret_cast<const __nv_bfloat16*>(v.data);
  params.o = reinterpret_cast<__nv_bfloat16*>(o.data);
  params.lse = lse;
  params.q_batch = q.batch_stride;
  params.q_token = q.token_stride;
  params.k_batch = k.batch_stride;
  params.k_token = k.token_stride;
  params.v_batch = v.batch_stride;
  params.v_token = v.token_stride;
  params.o_batch = o.batch_stride;
  params.o_token = o.token_stride;
  params.seq = p.seq;
  params.heads_q = p.heads_q;
  params.group = p.heads_q / p.heads_kv;
  params.q_begin = p.q_begin;
  params.q_end = p.query_end();
  params.scale_log2 = p.softmax_scale * log2e;
  return params;
}

inline bool aligned_rows(const void* data, std::int64_t batch_stride, std::int64_t token_stride) {
  return data != nullptr && reinterpret_cast<std::uintptr_t>(data) % 16 == 0 && batch_stride % 8 == 0 &&
         token_stride % 8 == 0;
}
template <class T>
inline bool aligned_rows(const TokenRows<T>& r) {
  return aligned_rows(r.data, r.batch_stride, r.token_stride);
}

/// What the kernels reject in p, the first field first, or "" when they take it: the one statement
/// of their limits (attention_can_implement is problem_issue(p).empty()).
inline std::string problem_issue(const AttentionProblem& p) {
  using ::oom::kernels::detail::concat;
  const int q_end = p.query_end();
  if (p.batch < 1 || p.batch > 65535) return concat("batch = ", p.batch, " (must be 1 .. 65535)");
  if (p.seq < 0) return concat("seq = ", p.seq, " (must be >= 0)");
  if (p.heads_kv < 1) return concat("heads_kv = ", p.heads_kv, " (must be >= 1)");
  if (p.heads_q < 1 || p.heads_q > 65535 || p.heads_q % p.heads_kv != 0)
    return concat("heads_q = ", p.heads_q, " (must be 1 .. 65535 and a multiple of heads_kv = ", p.heads_kv, ")");
  if (p.head_dim != 128 && p.head_dim != 256) return concat("head_dim = ", p.head_dim, " (must be 128 or 256)");
  if (!std::isfinite(p.softmax_scale) || !(p.softmax_scale > 0.0f))
    return concat("softmax_scale = ", p.softmax_scale, " (must be finite and > 0)");
  if (p.q_begin < 0 || p.q_begin > q_end || q_end > p.seq)
    return concat("query rows [", p.q_begin, ", ", q_end, ") (must lie in [0, seq = ", p.seq, "])");
  return {};
}

/// cudaSuccess when the kernels take p, else a refusal (refuse.hpp) naming the first field they
/// reject; `name` is the launcher the caller called.
inline cudaError_t check_problem(const char* name, const AttentionProblem& p) {
  if (std::string why = problem_issue(p); !why.empty()) return ::oom::kernels::detail::refuse(name, ": ", why);
  return cudaSuccess;
}

/// cudaSuccess when `rows` can be read or written by the kernels (aligned_rows), else a refusal
/// naming the tensor and what is wrong with it.
template <class T>
inline cudaError_t check_rows(const char* name, const char* tensor, const TokenRows<T>& rows) {
  using ::oom::kernels::detail::refuse;
  if (rows.data == nullptr) return refuse(name, ": ", tensor, " is null");
  if (reinterpret_cast<std::uintptr_t>(rows.data) % 16 != 0) return refuse(name, ": ", tensor, " is not 16-byte aligned");
  if (rows.batch_stride % 8 != 0 || rows.token_stride % 8 != 0)
    return refuse(name, ": ", tensor, "'s strides (batch ", rows.batch_stride, ", token ", rows.token_stride,
                  " elements) must be multiples of 8");
  return cudaSuccess;
}

/// The forward's tensors: q, k, v, o as check_rows, lse not null.
inline cudaError_t check_forward_args(const char* name, TokenRows<const bf16> q, TokenRows<const bf16> k,
                                      TokenRows<const bf16> v, TokenRows<bf16> o, const float* lse) {
  for (const auto& [tensor, rows] : {std::pair{"q", q}, std::pair{"k", k}, std::pair{"v", v}})
    if (const cudaError_t e = check_rows(name, tensor, rows); e != cudaSuccess) return e;
  if (const cudaError_t e = check_rows(name, "o", o); e != cudaSuccess) return e;
  if (lse == nullptr) return ::oom::kernels::detail::refuse(name, ": lse is null");
  return cudaSuccess;
}

}  // namespace oom::kernels::attention_detail
