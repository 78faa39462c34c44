// CPU AdamW over host spans: fp32 master in place, fp32 or bf16 moments, fp32 gradients, and
// optionally the updated weights written as bf16 straight into the caller's (pinned streaming)
// buffer. The instruction set is chosen at run time (AVX-512 -> AVX2+FMA -> scalar); every choice,
// and every thread count, gives the same bits. Also the gradients' sum of squares for global-norm
// clipping, deterministic in the same way.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"
#include "oom/optim/thread_pool.hpp"

namespace oom::optim {

/// Instruction sets with a kernel. Each lives in its own translation unit built with its own flags.
enum class CpuIsa : unsigned char {
  scalar,  ///< portable C++ (std::fma, std::sqrt)
  avx2,    ///< AVX2 + FMA, 8 floats per vector
  avx512,  ///< AVX-512F (+ AVX2/FMA for the narrower steps), 16 floats per vector
};

/// "scalar", "avx2", "avx512".
const char* to_string(CpuIsa isa) noexcept;
/// Inverse of to_string(); throws oom::Error (invalid_argument) naming the text otherwise.
CpuIsa parse_cpu_isa(std::string_view text);

/// Whether this CPU (and OS: the vector state is enabled) runs `isa`, by __builtin_cpu_supports.
bool cpu_supports(CpuIsa isa) noexcept;
/// Every ISA this CPU runs, scalar first.
std::vector<CpuIsa> supported_cpu_isas();
/// The widest ISA this CPU runs.
CpuIsa best_cpu_isa() noexcept;

/// The ISA used when none is passed explicitly: the one forced by force_cpu_isa(), else the one
/// named by the environment variable OOM_CPU_ISA (scalar|avx2|avx512, read at each call), else
/// best_cpu_isa(). Throws oom::Error when OOM_CPU_ISA is not a known name (invalid_argument) or
/// names an ISA this CPU cannot run (unsupported): a silently ignored override is worse than none.
CpuIsa active_cpu_isa();
/// Forces the default ISA for the whole process (tests, benchmarks); std::nullopt clears it.
/// Throws oom::Error (unsupported) when this CPU cannot run `isa`.
void force_cpu_isa(std::optional<CpuIsa> isa);

/// One span of parameters and its state. All spans have the same length, except `weights_out`,
/// which is empty (no bf16 copy wanted) or that length too. Pointers need only their element's
/// natural alignment; the kernels use unaligned loads. Spans must not overlap one another.
template <class Moment>
struct AdamWSpan {
  static_assert(std::is_same_v<Moment, float> || std::is_same_v<Moment, bf16>,
                "AdamW moments are stored as float (fp32) or oom::bf16");
  std::span<float> master;        // (n) fp32 master weights, updated in place
  std::span<Moment> exp_avg;      // (n) first moment m
  std::span<Moment> exp_avg_sq;   // (n) second moment v
  std::span<const float> grads;   // (n) gradients, read only
  std::span<bf16> weights_out{};  // (n) or empty: receives to_bf16(updated master)
};

/// Elements per task handed to the pool. A multiple of every vector width, so a tile's vector loop
/// never starts mid-vector; large enough that handing out a tile (a lock) costs < 1% of its
/// ~0.5 MB of traffic, small enough that 16 threads get ~20 tiles each from a 5M-parameter expert.
/// Not yet tuned on the GPU machine.
inline constexpr std::size_t adamw_tile_elements = 16384;

/// Applies one AdamW step (see adamw_element) to every element of `span`. Throws oom::Error
/// (invalid_argument) naming the lengths when they differ, or the address when a pointer is not
/// aligned to its element. `isa` defaults to active_cpu_isa().
void adamw_update(const AdamWSpan<float>& span, const AdamWStepScalars& step, ThreadPool& pool,
                  std::optional<CpuIsa> isa = std::nullopt);
void adamw_update(const AdamWSpan<bf16>& span, const AdamWStepScalars& step, ThreadPool& pool,
                  std::optional<CpuIsa> isa = std::nullopt);

/// require_finite_gradients (adamw.hpp) over `pool`, in tiles of sum_of_squares_tile_elements:
/// the same verdict and, on a NaN or infinity, the same error naming the first.
void require_finite_gradients(std::span<const float> grads, std::string_view what, ThreadPool& pool);

/// dst[i] += src[i] for every i, over `pool` (each element one rounding under IEEE defaults, so the
/// same bits on any thread count and whatever the caller's flush-to-zero): a later micro-batch's
/// gradient into the running one. Throws oom::Error
/// (invalid_argument) naming both lengths when they differ.
void add_gradients(std::span<float> dst, std::span<const float> src, ThreadPool& pool);

/// Elements per partial sum of grad_sum_of_squares. Fixed, so the reduction tree (and the result)
/// never depends on the thread count.
inline constexpr std::size_t sum_of_squares_tile_elements = 65536;

/// Sum of grads[i]^2 in double. Each square is exact in double (24-bit mantissas); additions run
/// in 16 interleaved lanes per tile (element i of a tile goes to lane i % 16), lanes are combined
/// pairwise, tiles are added in order. Every ISA follows that order, so the result is bit-identical
/// across ISAs and thread counts. To clip several spans, add their sums in a fixed order, then
/// clip_grad_scale().
double grad_sum_of_squares(std::span<const float> grads, ThreadPool& pool,
                           std::optional<CpuIsa> isa = std::nullopt);

}  // namespace oom::optim
