// AdamW on the GPU for segments whose optimizer state is resident in HBM. Each element follows
// oom::optim::adamw_element operation by operation (IEEE __fmul_rn/__fmaf_rn/__fdiv_rn/__fsqrt_rn,
// no contraction, no fast math), with the same AdamWStepScalars, so the GPU and the CPU optimizer
// (oom::optim::adamw_update) give bit-identical master weights, moments and bf16 copies.
// Also the gradients' sum of squares in fp64, in exactly the order of the CPU's
// oom::optim::grad_sum_of_squares (tiles of sum_of_squares_tile_elements, 16 interleaved lanes,
// pairwise lane combination, tiles added in order), so it too is bit-identical to the CPU's.
// Kernels in src/kernels/adamw_gpu.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "oom/core/numeric.hpp"
#include "oom/optim/adamw.hpp"

namespace oom::kernels {

/// One AdamW step over n elements, in place. weights_out may be null (no bf16 copy wanted).
/// grads may be null: every gradient zero (an expert no token reached this step, whose gradient
/// buffer was never written: DecoderLayerGrads::unrouted_experts), the same bits as a zeroed
/// buffer, without reading one. Arrays must not overlap; any element alignment works (16-byte
/// aligned arrays take the vector path, which gives the same bits).
cudaError_t adamw_update(const optim::AdamWStepScalars& step,
                         float* master,           // (n) fp32, updated in place
                         float* exp_avg,          // (n) fp32 m
                         float* exp_avg_sq,       // (n) fp32 v
                         const float* grads,      // (n) fp32, or null: zeros
                         bf16* weights_out,       // (n) bf16 = to_bf16(updated master), or null
                         std::int64_t n, cudaStream_t stream);
/// bf16 moments: widened exactly, updated, used unrounded for this step's weight, stored RNE.
cudaError_t adamw_update(const optim::AdamWStepScalars& step,
                         float* master,           // (n) fp32, updated in place
                         bf16* exp_avg,           // (n) bf16 m
                         bf16* exp_avg_sq,        // (n) bf16 v
                         const float* grads,      // (n) fp32, or null: zeros
                         bf16* weights_out,       // (n) bf16, or null
                         std::int64_t n, cudaStream_t stream);

/// One segment of adamw_update_many: the arguments of one adamw_update, moments of type `Moment`
/// (float: fp32, AdamWSegment; oom::bf16: AdamWSegmentBf16).
template <class Moment>
struct AdamWSegmentOf {
  static_assert(std::is_same_v<Moment, float> || std::is_same_v<Moment, bf16>,
                "adamw_update_many keeps AdamW moments as float (fp32) or oom::bf16");
  float* master = nullptr;
  Moment* exp_avg = nullptr;
  Moment* exp_avg_sq = nullptr;
  const float* grads = nullptr;  ///< or null: zeros
  bf16* weights_out = nullptr;   ///< or null
  std::int64_t n = 0;
  /// Or null. Set to 1 (device int) when a gradient read is NaN or infinite; never cleared. The
  /// update runs all the same: the caller learns after the launch that this step's state is
  /// unusable, at no cost beyond the reads the update makes anyway.
  int* nonfinite = nullptr;
};
using AdamWSegment = AdamWSegmentOf<float>;
/// bf16 moments (Plan::precision.moments == DType::bf16): 4 bytes of m and v a parameter instead
/// of 8. Each element's m and v are widened exactly to fp32, updated in fp32 as with fp32
/// moments, used unrounded for this step's weight, and stored rounded to nearest even: the bits of
/// adamw_update's bf16-moment overload and of the CPU's optim::AdamWSpan<bf16>.
using AdamWSegmentBf16 = AdamWSegmentOf<bf16>;

/// adamw_update on every segment, in as few launches as fit (one per 256 segments): the same bits
/// as one launch each. Why: a layer of the 5.13B model is 67 segments (64 experts), and its 67
/// launches, each draining before the next starts, left the GPU idle between them. One overload
/// per moment type (a launch holds segments of one type; the executor keeps one for all).
/// cudaErrorInvalidValue for a negative n or a missing state array.
cudaError_t adamw_update_many(const optim::AdamWStepScalars& step, std::span<const AdamWSegment> segments, cudaStream_t stream);
cudaError_t adamw_update_many(const optim::AdamWStepScalars& step, std::span<const AdamWSegmentBf16> segments,
                              cudaStream_t stream);

/// *flag = 1 (a device int, never cleared) when any of grads[0, n) is NaN or infinite; else
/// *flag is left as it is. One read of the gradients. cudaErrorInvalidValue for a negative n or
/// a null flag (or null grads with n > 0).
cudaError_t flag_nonfinite(const float* grads, std::int64_t n, int* flag, cudaStream_t stream);

/// Scratch bytes grad_sum_of_squares needs (one fp64 partial per tile).
std::size_t grad_sum_of_squares_workspace_bytes(std::int64_t n);

/// *result = sum of grads[i]^2 in fp64, bit-identical to oom::optim::grad_sum_of_squares on the
/// same n floats. *result is written on the stream (0 for n == 0); read it after synchronising.
cudaError_t grad_sum_of_squares(const float* grads,  // (n) fp32
                                std::int64_t n,
                                double* result,      // (1) fp64, device
                                void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace oom::kernels
