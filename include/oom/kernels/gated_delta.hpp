// The gated delta rule on the GPU: the core of the hybrid models' Gated DeltaNet (linear
// attention), forward and backward, as oom::reference::gated_delta_rule_forward / _backward compute
// it (include/oom/reference/gated_delta.hpp): per value head h of key head kh = h / (v_heads /
// k_heads), from a zero state at the start of each sequence,
//   q_t, k_t = l2norm(q[t, kh]), l2norm(k[t, kh])  (x / sqrt(sum x^2 + 1e-6)); q_t /= sqrt(dk)
//   S = exp(g[t, h]) S;  d = beta[t, h] (v[t, h] - S^T k_t);  S += k_t d^T;  out[t, h] = S^T q_t
// with S a dk x dv fp32 state. Kernels in src/kernels/gated_delta.cu (the recurrent form, and the
// launchers) and src/kernels/gated_delta_chunked.cu (the chunked form).
//
// Two forms (GatedDeltaDims::Form), both keeping the state entering every `chunk` tokens (and the
// final one) for the backward, so the memory is O(T):
// - chunked (on Hopper the default backward, and the default forward up to two waves of its
//   blocks; src/kernels/gated_delta_chunked.cu):
//   a chunk's tokens as small matrix products in shared memory, at fp32 accuracy on the tensor
//   cores (each fp32 operand a pair of tf32 values, three tf32 products for each fp32 one), the
//   state carried from chunk to chunk by a block per (sequence, value head, 32 columns); the backward carries the state's gradient back
//   the same way, then a block per chunk computes the chunk's gradients. Its workspace holds the
//   gradient of the state leaving every chunk (at 4K tokens x 32 heads of 128, 128 MiB at chunk
//   64: as much as the kept states), beside 128 MiB of per-head dq and dk.
// - recurrent (docs/hybrid.md, slice 3; src/kernels/gated_delta.cu): the forward's blocks (a
//   sequence, a value head, 32 columns of the state) walk the tokens in order, the backward's (the
//   same, as a cluster of blocks on Hopper; else a sequence and value head a block) walk them from
//   the last, with the state in registers, so the time grows with the sequence length rather than
//   with the FLOPs. The backward recomputes each chunk's states from the kept ones, in the same
//   arithmetic: the same bits whatever the chunk. Its workspace holds one chunk's states per
//   (sequence, head) as the threads hold them (dk padded to 8, 16 or 32 rows a thread, dv to a
//   multiple of 8 columns, or of 32 for the cluster path: the larger, whichever path runs): it
//   grows with `chunk` (at 4K tokens x 32 heads of 128, 128 MiB at chunk 64, 8 GiB at chunk
//   4096, beside 128 MiB of per-head dq and dk), the states the forward keeps shrink with it.
//
// Precision: q, k, v, out and their gradients bf16; g, beta and their gradients fp32; every state,
// product and sum fp32. Deterministic: every value is computed by one thread in a fixed order, and
// the gradients of q and k, summed over the value heads that share a key head, are added in head
// order (no atomics).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "oom/core/numeric.hpp"

namespace oom::kernels {

struct GatedDeltaDims {
  std::int64_t sequences = 1;  ///< B: independent sequences, each from a zero state
  std::int64_t seq_len = 0;    ///< S: tokens per sequence (T = B S rows, sequence-major)
  std::int64_t k_heads = 0, v_heads = 0;  ///< v_heads a multiple of k_heads
  std::int64_t k_dim = 0, v_dim = 0;      ///< 1..128 each
  std::int64_t chunk = 64;     ///< tokens between the states the forward keeps for the backward
  /// Elements between tokens of q and k (and of dq and dk), and of v (and of dv): 0 for packed
  /// (k_heads k_dim, v_heads v_dim); more to read them as column ranges of one [q | k | v] array.
  /// out and d_out are always packed.
  std::int64_t qk_stride = 0, v_stride = 0;
  /// Which form of the rule runs (each form computes the reference's rule, in other fp32 orders,
  /// so their bits differ; a backward takes the states either form's forward kept).
  enum class Form : std::uint8_t {
    /// `chunked` where chunk <= 64 on a device that can run it (gated_delta_chunked_supported: up
    /// to 227 KiB of shared memory a block): for the backward always, for the forward where the
    /// SMs take its carrying blocks, sequences x v_heads x ceil(v_dim / 32), one an SM, in at most
    /// two waves; else `recurrent` (bench_gated_delta on the H200, the Qwen3-Next layer: the
    /// chunked backward 2.6x, 2.1x, 1.21x and 1.20x the recurrent one at 1, 2, 4 and 8 sequences,
    /// its forward 1.9x and 1.05x at one and two, 0.64x from four). A forward and a backward of
    /// the same dims may so run different forms. The workspace is sized for either
    /// (gated_delta_backward_workspace_bytes: the larger scratch).
    automatic,
    /// A chunk of up to 64 tokens at a time as small matrix products (oom::reference::
    /// gated_delta_rule_chunked_forward / _chunked_backward): the state still passes chunk to chunk,
    /// but a chunk's tokens are worked together, not one after another. The chunk of the products
    /// is `chunk`, so its bits depend on it. Refused for chunk > 64, and on a device without the
    /// shared memory its kernels take (gated_delta_chunked_supported).
    chunked,
    /// Token by token (below): the bits do not depend on `chunk`.
    recurrent,
  };
  Form form = Form::automatic;
  /// How the recurrent backward spreads over the GPU (the same bits every way: the same sums in the same order).
  enum class Backward : std::uint8_t {
    /// `cluster` where the device has clusters and the clusters' blocks all fit its SMs at once
    /// (sequences x v_heads x ceil(v_dim / 32) <= SMs: one sequence of the Qwen3-Next layer's 32
    /// value heads of 128 on an H100/H200), else `one_block` (more threads an SM, measured the
    /// faster once there are more blocks than SMs: bench_gated_delta, docs/performance.md).
    automatic,
    /// A thread-block cluster per (sequence, value head), a block per 32 columns of the state as
    /// in the forward, the column sums (dq, dk, d alpha, d beta) added a tile of tokens at a time
    /// through distributed shared memory. Compute capability 9.0 and later, in a build with sm_90
    /// code; refused otherwise (`automatic` then takes one_block).
    cluster,
    /// One block per (sequence, value head) holding every column, the sums added a token at a time.
    one_block,
  };
  Backward backward = Backward::automatic;
  /// A part of longer sequences (docs/hybrid.md, slice 6): each sequence here is tokens [c0, c0 +
  /// seq_len) of one whose kept states the caller holds in one array, c0 a multiple of `chunk`.
  /// states_stride: floats between the (sequence, head) runs of `states` (0: this call's own,
  /// (chunks() + 1) dk dv); `states` then points at slot c0 / chunk of the first run, and the
  /// forward writes slots c0 / chunk .. of each run, the last the state after the part.
  std::int64_t states_stride = 0;
  /// The forward starts from the state in its first slot (what the part before wrote as its last)
  /// instead of zeros.
  bool from_kept_state = false;

  [[nodiscard]] std::int64_t tokens() const { return sequences * seq_len; }
  [[nodiscard]] std::int64_t chunks() const { return chunk > 0 ? (seq_len + chunk - 1) / chunk : 0; }
};

/// Whether the current device can run the chunked form: compute capability 9.0 or later with the
/// shared memory its kernels take a block (up to 227 KiB: the H100 and H200 have it). False where
/// the device cannot be queried.
[[nodiscard]] bool gated_delta_chunked_supported();

/// Floats of the states the forward writes: (B, v_heads, chunks + 1, dk, dv), the state entering
/// chunk c of each sequence and, last, its final state (what oom::reference::
/// gated_delta_rule_chunked_forward returns per sequence as `states`).
[[nodiscard]] std::size_t gated_delta_states_floats(const GatedDeltaDims& d);

/// q, k: (T, k_heads, dk) bf16 (rows qk_stride apart); v: (T, v_heads, dv) bf16 (rows v_stride
/// apart); g (log decay), beta: (T, v_heads) fp32.
/// Writes out: (T, v_heads, dv) bf16 and `states` (gated_delta_states_floats floats, fp32).
cudaError_t gated_delta_forward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                const float* beta, bf16* out, float* states, cudaStream_t stream);

/// Bytes of the backward's workspace for the form the dims name: the chunked form's gradient of
/// every chunk's leaving state, or the recurrent's recomputed states of one chunk a block, or
/// under `automatic` the larger of the two (whichever runs, from the dims alone); and the q and k
/// gradients per value head before they are summed per key head.
[[nodiscard]] std::size_t gated_delta_backward_workspace_bytes(const GatedDeltaDims& d);

/// The gradients of the forward's inputs from d_out (T, v_heads, dv) bf16 and the forward's
/// `states`: dq, dk (T, k_heads, dk) bf16 (through the l2norm, summed over the value heads of each
/// key head); dv (T, v_heads, dv) bf16; dg, dbeta (T, v_heads) fp32. Every output is overwritten.
cudaError_t gated_delta_backward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream);

/// The same with the state's gradient carried across parts of a sequence: `d_state` (B, v_heads,
/// dk, dv) fp32 holds on entry the gradient of each sequence's state after its last token (the
/// part after's; zeros for a sequence's last part) and on return that of the state before its
/// first token (for the part before). nullptr: zeros in, nothing out (the call above).
cudaError_t gated_delta_backward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, float* d_state, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace oom::kernels
