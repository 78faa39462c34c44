// Expert GEMMs of the MoE SwiGLU MLP, grouped over experts (bf16 in, fp32 accumulation, bf16 out;
// weight gradients accumulated in fp32), on rows already permuted into expert order
// (oom/kernels/permute.hpp). Weight layout per expert as HF Qwen3-MoE checkpoints, gate and up
// stacked: w_gate_up (E, 2I, H) = [gate_proj (I, H); up_proj (I, H)], w_down (E, H, I); so
// gate_up (N, 2I) = [gate | up] and the SwiGLU kernel (not here) makes h = silu(gate) * up.
// The shared expert (Qwen3-Next) is the same GEMMs with E = 1 and counts = {T}, plus the sigmoid
// gate below. CPU reference: oom/reference/moe.hpp.
//
// cuBLAS needs each expert's row count on the host (its m/k arguments): callers copy
// permute_plan's expert_counts down once per layer. Ways to issue the GEMMs, all exact to the same
// math (cuBLAS may pick different kernels, so results can differ by fp32 rounding):
//   per_expert_loop: one cublasGemmEx per non-empty expert on `stream` (the reference path);
//   grouped_batched: one cublasGemmGroupedBatchedEx (one group per non-empty expert); its
//     device pointer arrays are built on the host and copied into `workspace` with
//     cudaMemcpyAsync (so not capturable in a CUDA graph). cuBLAS 13.0 reports bf16 unsupported;
//   multi_stream: the per-expert loop spread over the side streams of an ExpertGemmStreams
//     (forked from and joined back into `stream` with events), so small GEMMs overlap and fill
//     the SMs one ~2048-row expert leaves idle; a backward issues its data and weight GEMMs in one
//     fork;
//   row_chunked: the row-producing GEMMs (forward, dx, dh) as one cublasGemmBatchedEx over the
//     first `depth` rows of every expert that has them (ExpertGemmStreamsOptions::deep_rows), one
//     over fixed-size row chunks of the rest (row_chunk rows each, all the same shape), then one
//     more over each expert's last row_chunk rows for the remainder (those rows are recomputed
//     from the same inputs and written again in stream order, so the result is deterministic;
//     the deep, chunk and remainder GEMMs may run different cuBLAS kernels, so rows can differ
//     in rounding from another depth's: <= row_chunk rows of waste per expert);
//     experts with fewer than row_chunk rows run alone. The weight gradients (one output per
//     expert, k = its rows) run as in multi_stream, concurrently with the data GEMM, or, on
//     Hopper where the widths allow (ExpertGemmStreamsOptions::wgmma_weight_gradients), as one
//     grouped wgmma launch beside it on a side stream (overlap_weight_gradients) or after it.
//     Pointer arrays are copied into `workspace` as for grouped_batched. On Hopper the row GEMMs
//     are instead one grouped wgmma launch (ExpertGemmStreamsOptions::wgmma_rows) where the
//     widths allow.
// Errors: cudaError_t, cuBLAS statuses mapped as in router.hpp; launchers set the handle's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "oom/core/numeric.hpp"

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;  // as cublas_api.h declares it

namespace oom::kernels {

struct ExpertGemmShape {
  std::int64_t hidden = 0;        ///< H
  std::int64_t intermediate = 0;  ///< I per expert
  std::int64_t experts = 0;       ///< E
  std::int64_t rows = 0;          ///< upper bound of N = sum(counts); sizes row_chunked's pointer arrays
};

enum class ExpertGemmMethod : unsigned char { per_expert_loop, grouped_batched, multi_stream, row_chunked };

/// Tuning of the multi_stream and row_chunked methods.
struct ExpertGemmStreamsOptions {
  int streams = 4;  ///< side streams (and cuBLAS handles), 1..64
  /// The side streams' priority (cudaStreamCreateWithPriority: 0 the default and lowest, lower
  /// numbers run first): the caller's stream's, so that work it puts beside the GEMMs at a lower
  /// priority (CudaCausalLmOptions::overlap_updates) yields to the side streams as to the caller's.
  int priority = 0;
  /// cuBLAS workspace of each side handle, carved from the launcher's workspace (cublasSetWorkspace);
  /// cuBLAS recommends 32 MiB on Hopper, where its split-K kernels for the weight gradients use it.
  std::size_t blas_workspace_bytes = std::size_t{32} << 20;
  std::int64_t row_chunk = 128;  ///< rows per batched GEMM of row_chunked
  /// row_chunked's row GEMMs: the first `depth` rows of every expert that has them in one batched
  /// GEMM of `depth` rows per expert, the rest in chunks. `depth` minimises a cost of rows
  /// computed (chunked rows 1.4x a deep row; remainders rounded up to whole chunks) over values
  /// q 2^p, q in 4..7, of at least 4 chunks; none when chunking every row is cheaper. Why: the
  /// 128-row chunks ran the 5.13B dh at 0.71x of a dense GEMM, one strided batched GEMM over
  /// 2048-row experts at 1.00x (H200, 2026-12-01).
  bool deep_rows = true;
  /// row_chunked's row GEMMs (forward, dx, dh) as one launch of OOM's own grouped wgmma kernel
  /// (src/kernels/hopper/grouped_rows_wgmma.cu: 128 x 256 tiles of every expert in one list, one
  /// persistent grid, each element one fp32 sum in a fixed order: the same bits run to run and for
  /// any routing that keeps a row's expert), where it applies: a compute capability 9.0 device in
  /// a build with sm_90 code, output widths multiples of 256 and reduction widths of 64, strides
  /// multiples of 8 elements, 16-byte aligned operands; elsewhere the batched cuBLAS chunks above
  /// (row_chunk, deep_rows). Why: those are three or more launches, each with its ramp and tail.
  /// On the H200 (5.13B widths, random routing, 2026-12-01), ratio to one dense GEMM of the same
  /// FLOPs, forward gate_up / down: 0.72 / 0.77 with it against 0.61 / 0.56 at T = 4096, 0.91 /
  /// 0.94 against 0.86 / 0.85 at 16384; the backward (with dW) 0.85 / 0.87 against 0.80 / 0.85.
  bool wgmma_rows = true;
  /// That grouped launch's row GEMMs (except one split around a memory-bound dW) in 2-CTA clusters
  /// whose two blocks share the weights' tile, each loading half of it by TMA multicast, as
  /// cuBLAS's own kernels do (src/kernels/hopper/grouped_rows.hpp, RowsGrid::pairs): half the L2
  /// reads of the weights; tiles in a fixed order. On the H100 (5.13B widths, random routing,
  /// 2026-12-07), ratio to one dense GEMM of the same FLOPs, forward gate_up: 0.99 against 0.79 at
  /// T = 16384, 0.79 against 0.73 at 4096; the backward with dW 0.85-0.89 against 0.81-0.83 at
  /// 16384. Not yet measured on the H200 in this form (an older one was 2-5% slower there).
  bool paired_rows = true;
  /// The per-expert GEMMs of varying size (row_chunked's experts with fewer rows than a chunk and
  /// its weight gradients; multi_stream's all) through cuBLASLt with one algorithm per power-of-two
  /// size bucket, chosen once, instead of cublasGemmEx, whose algorithm choice runs on the host for
  /// every shape it has not seen. On the H200 (2026-11-30, 5.13B widths, skewed routing, 32 of 64
  /// experts below the chunk): the host issue of a layer's expert backward took 9.2 ms with row
  /// counts cublasGemmEx had not seen and 1.8 ms once seen; bucketed 2.0 and 1.5 ms, the GPU
  /// throughput the same (docs/performance.md, fifth session).
  bool bucketed_algorithms = true;
  /// row_chunked's weight gradients (dW[e] += A_e^T B_e, k = the expert's rows): the first
  /// `depth` rows of every expert that has them in one batched GEMM on the caller's stream, the
  /// rest per expert on the side streams. `depth` is a power of two or 1.5 times one (so the
  /// shapes recur) that at least half of the experts with rows reach. Off (the default): every
  /// expert's weight gradient is its own GEMM on the side streams. Measured on the H200 (5.13B
  /// widths, T = 16384, 2026-11-30): batching made the backward slower, down-projection 0.66x
  /// dense vs 0.69x, gate_up 0.72x vs 0.85x (the batched call runs alone on the caller's stream
  /// before the row GEMMs and the side streams start), so it stays off.
  bool batched_weight_gradients = false;
  /// row_chunked's weight gradients as one launch of OOM's own grouped wgmma kernel
  /// (src/kernels/hopper/grouped_wgrad_wgmma.cu: every expert's dW (+)= A^T B, k = its rows, fp32,
  /// a fixed summation order, subnormals flushed when adding) beside or after the row GEMMs
  /// (overlap_weight_gradients), where it applies: a compute capability 9.0 device in a build with
  /// sm_90 code, dW widths multiples of 128 x 256, aligned operands; elsewhere the per-expert GEMMs
  /// on the side streams. Why: per-expert GEMMs that small leave most SMs idle, and issuing 64 of
  /// them costs the host 0.5-1.1 ms (the grouped launch: 25-50 us). On the H200 (5.13B widths,
  /// 2026-12-01, ratio to one dense GEMM of the same FLOPs, with / without): gate_up backward
  /// 0.87 / 0.85-0.86 at T = 16384 adding, 0.93 / 0.89 overwriting (GradWrite), 0.86 / 0.79-0.80 at
  /// T = 8192 overwriting, 0.67-0.69 / 0.59-0.62 at 4096; down-projection backward 0.77 / 0.73 at
  /// T = 16384 (the ninth session; the gate_up's dW ran wgmma only since the eleventh).
  bool wgmma_weight_gradients = true;
  /// With wgmma_weight_gradients: run that launch on the first side stream beside the row GEMMs
  /// (forked from and joined back into the caller's stream; the same bits), its tiles handed out
  /// by an atomic counter (4 bytes of device memory, allocated with the streams), so its blocks
  /// fill the SMs the row GEMMs' tails leave idle. Off: after the row GEMMs on the caller's stream.
  /// On the H200 (5.13B widths, 2026-12-01) the down-projection backward took 1.215-1.248 ms
  /// beside against 1.271-1.287 ms after (five runs each, T = 16384: 0.79-0.81x of a dense GEMM
  /// against 0.76-0.77x), 2.234 against 2.289 ms at T = 32768.
  bool overlap_weight_gradients = true;
  /// With overlap_weight_gradients, where the weight gradients are bound by memory (their FLOPs
  /// per byte of fp32 dW traffic, 2 rows_e per 8 bytes adding or 4 overwriting, below the device's
  /// dense bf16 FLOPs per byte of memory: 222 on the H200) and the row GEMMs are one grouped
  /// wgmma launch (wgmma_rows): that launch starts on this share of the SMs beside dW, and the
  /// rest of its grid waits on the side stream behind dW, both taking tiles from one counter. So
  /// dW's memory traffic runs beside the row GEMMs' products from the start, and whichever ends
  /// first leaves its SMs to the other. Outside (0, 1): never. The same bits either way. On the
  /// H200 (5.13B widths, 2026-12-02, ratio to one dense GEMM of the same FLOPs, four runs) the
  /// backward at T = 4096 adding to dW: 0.61-0.65 against 0.53-0.54 (down and gate_up); shares of
  /// 0.7 / 0.5 / 0.3 / 0.2 gave 0.57 / 0.60 / 0.59 / 0.56. Where dW is not bound by memory
  /// (overwriting at 4096, anything from 8192) splitting measured the same or up to 0.03 lower.
  double row_sm_share = 0.4;
};

/// Side streams, fork/join events and one cuBLAS handle per side stream, for the multi_stream and
/// row_chunked methods. The caller owns it: one per device and per caller stream that launches
/// concurrently (a launch forks from its `stream` and joins back before returning to the caller's
/// order, but the side streams are shared). The CUDA objects are created on first use on the then
/// current device, so constructing one needs no GPU; using it from another device fails with
/// cudaErrorInvalidDevice.
class ExpertGemmStreams {
 public:
  explicit ExpertGemmStreams(ExpertGemmStreamsOptions options = {});
  ~ExpertGemmStreams();
  ExpertGemmStreams(const ExpertGemmStreams&) = delete;
  ExpertGemmStreams& operator=(const ExpertGemmStreams&) = delete;

  [[nodiscard]] const ExpertGemmStreamsOptions& options() const { return options_; }

  struct State;  ///< the CUDA objects (expert_gemm.cu)
  /// Creates the CUDA objects on first use; for the launchers.
  cudaError_t state(State** out);

 private:
  ExpertGemmStreamsOptions options_;
  std::unique_ptr<State> state_;
};

/// Scratch of the expert GEMM launchers for `method`: pointer arrays (grouped_batched,
/// row_chunked; the latter sized by s.rows) and the side handles' cuBLAS workspaces (multi_stream,
/// row_chunked; `streams` required for those). 0 for per_expert_loop.
std::size_t expert_gemm_workspace_bytes(const ExpertGemmShape& s, ExpertGemmMethod method,
                                        const ExpertGemmStreams* streams = nullptr);

/// The E per-expert row counts (device) into `out` (E int32, host), for the launchers' counts_host:
/// a kernel on `stream` stores them into pinned mapped memory owned by `streams`, then `stream` is
/// synchronized. No copy engine and no pageable staging: with a pageable cudaMemcpyAsync here (and
/// for the pointer arrays) the H200's backward at 32K lost ~21 ms per layer while a layer's 1.3 GB
/// of gradients went down on another stream (96 ms per layer against 75 without), most likely the
/// small copy queued behind the large one; with this path 14 of 16 layers ran at 75 ms.
/// A stretch of the calling thread's time (steady clock) in these launchers: a wait in
/// expert_counts_to_host ("wait for expert counts") or the host issue of one launcher's GEMMs
/// ("issue expert <op> GEMMs: ...", with how they were issued: batched chunks, experts issued
/// alone, weight-gradient GEMMs, algorithm fallbacks).
struct HostSpan {
  std::string what;
  std::chrono::steady_clock::time_point begin, end;
};
/// While set (per thread), the launchers append their HostSpans to `*sink`: a traced step shows
/// where the issuing thread waited for the GPU and where it was slow issuing. nullptr stops
/// recording. The caller owns the vector and must reset this before it goes away.
void record_host_spans(std::vector<HostSpan>* sink) noexcept;

cudaError_t expert_counts_to_host(cudaStream_t stream, const std::int32_t* counts, std::int64_t experts,
                                  ExpertGemmStreams& streams, std::int32_t* out);

/// gate_up (N, 2I) = x_perm (N, H) . w_gate_up[e]^T per expert, N = sum(counts_host).
cudaError_t expert_gate_up_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                   const std::int32_t* counts_host,  // (E) HOST memory
                                   const bf16* x_perm,               // (N, H)
                                   const bf16* w_gate_up,            // (E, 2I, H)
                                   bf16* gate_up,                    // (N, 2I) out
                                   ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                   ExpertGemmStreams* streams = nullptr);  // multi_stream, row_chunked

/// y (N, H) = h (N, I) . w_down[e]^T per expert.
cudaError_t expert_down_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                const std::int32_t* counts_host,  // (E) HOST memory
                                const bf16* h,                    // (N, I)
                                const bf16* w_down,               // (E, H, I)
                                bf16* y,                          // (N, H) out
                                ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                ExpertGemmStreams* streams = nullptr);  // multi_stream, row_chunked

/// How the backward launchers write the experts' weight gradients (fp32).
enum class GradWrite : unsigned char {
  /// dW[e] += the gradient; an expert without rows keeps its dW. For a step's later chunks (the
  /// caller zeroes dW once per step, or passes `overwrite` for the first).
  accumulate,
  /// dW[e] = the gradient, its old contents never read (an expert without rows gets zeros): half
  /// the memory traffic of `accumulate` and no zeroing beforehand. The gradient's bits equal
  /// `accumulate` onto zeros except for signed zeros and, on the grouped wgmma path (whose
  /// reductions flush them), subnormals.
  overwrite,
  /// As `overwrite` for the experts with rows; an expert without rows keeps its dW untouched,
  /// neither read nor written (its dW pointer may be null). For a caller that knows from the
  /// counts that such an expert's gradient is zero and applies it without reading a buffer
  /// (kernels::adamw_update with null grads): `overwrite` zeroes each one with a memset, which
  /// took 10.3 ms of the 5.13B model's 4K step, 26-54 of 64 experts per layer receiving no rows
  /// in its early steps (H200, 2026-12-01).
  overwrite_routed,
};

/// dh (N, I) = dy . w_down[e]; dw_down[e] (H, I) += dy^T . h (fp32; or = with GradWrite::overwrite).
cudaError_t expert_down_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                 const std::int32_t* counts_host,  // (E) HOST memory
                                 const bf16* dy,                   // (N, H)
                                 const bf16* h,                    // (N, I)
                                 const bf16* w_down,               // (E, H, I)
                                 bf16* dh,                         // (N, I) out
                                 float* dw_down,                   // (E, H, I) fp32, accumulated (or overwritten)
                                 ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                 ExpertGemmStreams* streams = nullptr,   // multi_stream, row_chunked
                                 GradWrite dw_write = GradWrite::accumulate);

/// dx_perm (N, H) = d_gate_up . w_gate_up[e]; dw_gate_up[e] (2I, H) += d_gate_up^T . x_perm (fp32;
/// or = with GradWrite::overwrite).
cudaError_t expert_gate_up_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                    const std::int32_t* counts_host,  // (E) HOST memory
                                    const bf16* d_gate_up,            // (N, 2I)
                                    const bf16* x_perm,               // (N, H)
                                    const bf16* w_gate_up,            // (E, 2I, H)
                                    bf16* dx_perm,                    // (N, H) out
                                    float* dw_gate_up,                // (E, 2I, H) fp32, accumulated (or overwritten)
                                    ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                    ExpertGemmStreams* streams = nullptr,  // multi_stream, row_chunked
                                    GradWrite dw_write = GradWrite::accumulate);

/// The same four launchers with each expert's matrices anywhere in device memory (each expert its
/// own state segment, streamed into whatever slot it got): w_*[e] and dw_*[e] are HOST arrays of E
/// device pointers, each to one expert's matrix of the shape above, e.g. w_gate_up[e] -> (2I, H) =
/// [gate_proj; up_proj] of expert e. The launchers above call these with base + e * stride.
/// A null pointer of an expert that receives rows is cudaErrorInvalidValue.
cudaError_t expert_gate_up_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                   const std::int32_t* counts_host,    // (E) HOST memory
                                   const bf16* x_perm,                 // (N, H)
                                   const bf16* const* w_gate_up,       // (E) host array -> (2I, H) each
                                   bf16* gate_up,                      // (N, 2I) out
                                   ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                   ExpertGemmStreams* streams = nullptr);
cudaError_t expert_down_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                const std::int32_t* counts_host,  // (E) HOST memory
                                const bf16* h,                    // (N, I)
                                const bf16* const* w_down,        // (E) host array -> (H, I) each
                                bf16* y,                          // (N, H) out
                                ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                ExpertGemmStreams* streams = nullptr);
cudaError_t expert_down_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                 const std::int32_t* counts_host,  // (E) HOST memory
                                 const bf16* dy,                   // (N, H)
                                 const bf16* h,                    // (N, I)
                                 const bf16* const* w_down,        // (E) host array -> (H, I) each
                                 bf16* dh,                         // (N, I) out
                                 float* const* dw_down,            // (E) host array -> (H, I) fp32 each, accumulated
                                 ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                 ExpertGemmStreams* streams = nullptr, GradWrite dw_write = GradWrite::accumulate);
cudaError_t expert_gate_up_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                    const std::int32_t* counts_host,  // (E) HOST memory
                                    const bf16* d_gate_up,            // (N, 2I)
                                    const bf16* x_perm,               // (N, H)
                                    const bf16* const* w_gate_up,     // (E) host array -> (2I, H) each
                                    bf16* dx_perm,                    // (N, H) out
                                    float* const* dw_gate_up,         // (E) host array -> (2I, H) fp32 each, accumulated
                                    ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                    ExpertGemmStreams* streams = nullptr, GradWrite dw_write = GradWrite::accumulate);

/// Shared expert gate (Qwen3-Next): out = routed + sigmoid(x . w_gate) * y; the gate logit is saved.
/// `routed` may be null (zero) or equal to `out` (in place).
cudaError_t shared_expert_gate_forward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden,
                                       const bf16* x,       // (T, H)
                                       const bf16* w_gate,  // (H) = shared_expert_gate.weight (1, H)
                                       const bf16* y,       // (T, H) the shared expert MLP output
                                       const bf16* routed,  // (T, H) or null
                                       float* gate_logit,   // (T) out
                                       bf16* out);          // (T, H) out

/// Scratch of shared_expert_gate_backward: per-token d logit and per-chunk partial sums of dw_gate.
std::size_t shared_expert_gate_backward_workspace_bytes(std::int64_t tokens, std::int64_t hidden);

/// dy = sigmoid(s) d_out; ds = <d_out, y> sigmoid'(s); dx += ds w_gate (bf16, accumulated onto the
/// MLP's dx); dw_gate += sum_t ds_t x_t (fp32, deterministic order).
cudaError_t shared_expert_gate_backward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden,
                                        const bf16* x,             // (T, H)
                                        const bf16* w_gate,        // (H)
                                        const bf16* y,             // (T, H)
                                        const float* gate_logit,   // (T)
                                        const bf16* d_out,         // (T, H)
                                        bf16* dy,                  // (T, H) out
                                        bf16* dx,                  // (T, H) accumulated
                                        float* dw_gate,            // (H) fp32, accumulated
                                        void* workspace, std::size_t workspace_bytes);

}  // namespace oom::kernels
