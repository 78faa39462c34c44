// The experts' row GEMMs in one launch on Hopper: for every expert e, C rows [f_e, f_e + rows_e)
// (bf16) = A rows [f_e, f_e + rows_e) (bf16) . B_e, fp32 accumulation, with A and C the permuted
// activations (row-major, experts' rows consecutive) and B_e the expert's weight (K x N; stored
// N x K, "K-major", as the forward's w^T, or K x N, "N-major", as the backward's w). cuBLAS takes
// one m per call, so the product issued these as batched GEMMs over row chunks of equal size (and
// a deep batch, a remainder batch, experts alone): three or more launches, each with its ramp and
// tail; at T <= 8192 tokens (5.13B widths: 512-1024 rows per expert, a forward GEMM of ~0.2 ms)
// those ran at 0.39-0.74x of one dense GEMM of the same FLOPs (H200, 2026-12-01). Here every
// expert's 128 x 256 output tiles are one list that one persistent grid walks.
// Kernel: src/kernels/hopper/grouped_rows_wgmma.cu (sm_90a only). Private to the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "oom/core/numeric.hpp"

namespace oom::kernels::hopper {

/// What every problem of one launch shares (elements; row-major strides).
struct RowsShape {
  std::int64_t n = 0;  ///< C's width (the output features)
  std::int64_t k = 0;  ///< A's width (the reduction)
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  bool b_k_by_n = false;  ///< B_e stored K x N (row stride ldb >= n); false: N x K (ldb >= k)
};

/// One expert: its rows of A and C start at row `first_row` (0: nothing to do).
struct RowsProblem {
  const bf16* b = nullptr;
  std::int64_t first_row = 0;
  std::int64_t rows = 0;
};

/// The block tile: one block computes 128 rows x 256 columns of one expert's C at a time.
inline constexpr int kRowsTileM = 128, kRowsTileN = 256;

/// Whether grouped_rows_wgmma computes these: n a multiple of 256 and k of 64 (its tiles), strides
/// multiples of 8 elements and at least the widths, A, C and every B 16-byte aligned, rows and
/// first rows in [0, 2^31), and the current device of compute capability 9.0 (the only code built
/// is sm_90a). Callers fall back to another path when it is false.
bool grouped_rows_supported(const RowsShape& s, const bf16* a, const bf16* c, std::span<const RowsProblem> problems);

/// How one grouped_rows_wgmma call takes the SMs. The default: one block per SM (or per tile,
/// where fewer; with pairs two blocks per pair that fits), the counter zeroed on the stream before
/// each launch.
struct RowsGrid {
  /// > 0: at most this many blocks (the SMs left to a kernel that runs beside it).
  int max_blocks = 0;
  /// The caller zeroed `tile_counter` before this call in stream order (needs a counter; the
  /// problems must fit one launch: grouped_rows_one_launch). Two calls with the same arguments on
  /// two streams then share the tiles: a launch of a few blocks beside another kernel, and the
  /// same launch queued after that kernel on the other stream, whose blocks take the tiles left
  /// on the SMs that kernel frees. Each tile is still computed by one block, with the same bits.
  bool counter_zeroed = false;
  /// 2-CTA clusters: the two blocks of a cluster take two M tiles of one (expert, N tile) and share
  /// its B tile, each loading half and multicasting it into both (TMA), so B crosses from L2 once
  /// per pair; an expert's last M tile where its count is odd goes to pairs of its N tiles, which
  /// share its A tile the same way (else one CTA of each such pair would idle); tiles in a fixed
  /// order (a tile counter is not used; counter_zeroed refused);
  /// max_blocks counts both blocks of a pair (max_blocks / 2 pairs; 1 refused). Where no 2-CTA
  /// cluster of the kernel fits the device, one block per tile as without. The same bits as
  /// without. Why: cuBLAS's dense and strided batched kernels share their 256-wide operand this
  /// way, and on the H100 those ran the 5.13B gate_up forward at 0.91-1.00x of the dense GEMM where
  /// this kernel ran at 0.75-0.78x (2026-12-07); on the H200, on an older pipeline of this kernel,
  /// sharing was slower (2026-12-01).
  bool pairs = false;
  /// With a tile counter (not counter_zeroed, not pairs): block b's first tile is tile b, as
  /// without a counter, and only the later ones come from the counter. For measuring what the
  /// counter costs (a 14-19% slower gate_up forward on the H100 than fixed tiles, sixty-fourth
  /// session; not the atomic's latency): whether it is the first wave's order.
  bool first_tiles_fixed = false;
};

/// Whether grouped_rows_wgmma takes these problems in one launch (at most 128 with rows, and
/// their tiles indexed by int); RowsGrid::counter_zeroed needs it.
bool grouped_rows_one_launch(const RowsShape& s, std::span<const RowsProblem> problems);

/// How many 2-CTA clusters of the kernel (RowsGrid::pairs) the current device holds at once
/// (cudaOccupancyMaxActiveClusters): a pairs launch's grid is twice that, or fewer.
cudaError_t grouped_rows_pairs_fit(int* pairs);

/// C rows of every problem = A rows . B_e, each element one thread's fp32 sum over k in a fixed
/// order (independent of the other rows and of the schedule: the same bits run to run, for any
/// split of the rows into problems that keeps a row's expert), rounded to bf16 once. Rows of C that
/// no problem covers are not written. One persistent launch per 128 non-empty problems on `stream`;
/// no allocation, no synchronisation. cudaErrorInvalidValue when grouped_rows_supported would say
/// false for the shape or the problems, or for a RowsGrid it cannot honour (see there);
/// cudaErrorNotSupported off compute capability 9.0; else the launches' status. `tile_counter` (4
/// bytes of device memory, or nullptr): blocks take their tiles from it one at a time (zeroed on
/// `stream` before each launch, so one counter serves one launch at a time) instead of every
/// grid-th tile, so blocks that start late, on SMs another stream's kernels held, do not finish
/// late; the same bits either way (not used with RowsGrid::pairs). `grid`: see RowsGrid.
cudaError_t grouped_rows_wgmma(const RowsShape& s, const bf16* a, bf16* c, std::span<const RowsProblem> problems,
                               cudaStream_t stream, int* tile_counter = nullptr, const RowsGrid& grid = {});

}  // namespace oom::kernels::hopper
