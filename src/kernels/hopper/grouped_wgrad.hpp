// The experts' weight gradients in one launch on Hopper: for every expert e, C_e (M x N, fp32)
// += A_e^T B_e, with A_e (rows_e x M) and B_e (rows_e x N) the expert's rows of the permuted
// activations (bf16, row-major). cuBLAS has no batched call with a per-problem K, so the product
// ran these as one GEMM per expert; each is below one wave of SMs at the 5.13B widths (2048 x 768
// outputs) and the 64 of them ran at 0.60x a dense GEMM of the same FLOPs on 4 streams, against
// 0.82x for one strided batched call over equal counts (scripts/diag/expert_dw_split.cu, H200).
// Kernel: src/kernels/hopper/grouped_wgrad_wgmma.cu (sm_90a only). Private to the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "oom/core/numeric.hpp"

namespace oom::kernels::hopper {

/// The shape every problem of one launch shares (elements; row-major strides).
struct WgradShape {
  std::int64_t m = 0, n = 0;  ///< C is m x n
  std::int64_t lda = 0;       ///< A's row stride (>= m)
  std::int64_t ldb = 0;       ///< B's row stride (>= n)
  std::int64_t ldc = 0;       ///< C's row stride (>= n)
  /// true: C_e += A_e^T B_e (the old C read, by L2's reductions); false: C_e = A_e^T B_e, C's old
  /// contents never read (plain stores: half the memory traffic of the sum), an empty problem's C
  /// set to zero.
  bool accumulate = true;
};

/// One expert's problem: C (+)= A^T B over its `rows` rows (0: C untouched when accumulating,
/// zeroed when not).
struct WgradProblem {
  const bf16* a = nullptr;  ///< rows x m, stride lda
  const bf16* b = nullptr;  ///< rows x n, stride ldb
  float* c = nullptr;       ///< m x n, stride ldc
  std::int64_t rows = 0;
};

/// The block tile of C: one block computes 128 x 256 of one problem at a time.
inline constexpr int kWgradTileM = 128, kWgradTileN = 256;

/// Whether grouped_wgrad_wgmma computes these: m a multiple of 128 and n of 256 (its tile), lda and
/// ldb multiples of 8 elements and A/B 16-byte aligned (its 16-byte copies), ldc even and C
/// 8-byte aligned (its two-float reductions), strides at least the widths, rows in [0, 2^31),
/// and the current device of compute capability 9.0 (the only code built is sm_90a). Callers fall
/// back to another path when it is false.
bool grouped_wgrad_supported(const WgradShape& s, std::span<const WgradProblem> problems);

/// C_e += A_e^T B_e (or C_e = A_e^T B_e: WgradShape::accumulate) for every problem, in fp32 with a
/// fixed summation order (each element's sum over the rows, in order, is one thread's; L2 then adds
/// it to the old value, once: red.v4.f32 (red.v2.f32 where ldc is not a multiple of 4), which
/// flushes subnormal values below 2^-126 to zero; or it is stored as it is), so the result is the
/// same bits run to run. Overwriting, the empty problems' C are zeroed on `stream` first
/// (cudaMemset2DAsync).
/// One persistent launch per 128 non-empty problems on `stream`. cudaErrorInvalidValue when
/// grouped_wgrad_supported would say false for the shape or the problems, cudaErrorNotSupported off compute capability 9.0; else the launches' status.
/// `tile_counter` (4 bytes of device memory, or nullptr): blocks take their tiles from it one at a
/// time (it is zeroed on `stream` before each launch, so one counter serves one launch at a time)
/// instead of every grid-th tile, so blocks that start late, on SMs another stream's kernels held,
/// do not finish late; the results are the same bits either way.
/// No allocation, no synchronisation.
cudaError_t grouped_wgrad_wgmma(const WgradShape& s, std::span<const WgradProblem> problems, cudaStream_t stream,
                                int* tile_counter = nullptr);

}  // namespace oom::kernels::hopper
