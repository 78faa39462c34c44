// CPU reference of causal grouped-query attention (what the flash kernels in
// include/oom/kernels/attention.hpp compute): fp32 storage (or fp64, for finite differences, or bf16
// inputs read exactly) with fp64 accumulation. Naive O(S^2) work but O(S) memory: every query row
// is computed on its own, so single rows of a 1M-token sequence can be checked.
//
// Layout (contiguous): Q, O, dO, dQ (B, S, Hq, D); K, V, dK, dV (B, S, Hkv, D); LSE (B, Hq, S),
// natural log. Query head h reads K/V head h / (Hq / Hkv); query i attends keys j <= i.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>

#include "oom/core/numeric.hpp"

namespace oom::reference {

struct AttentionDims {
  int batch = 1;
  int seq = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
};

/// Output type for an input type: double for double inputs, float otherwise (float or bf16).
template <class In>
using AttentionReal = std::conditional_t<std::is_same_v<In, double>, double, float>;

/// O row (D values) of query i, head h, batch b; returns its LSE.
template <class In>
AttentionReal<In> attention_forward_row(const AttentionDims& dims, double scale,
                                        std::span<const In> q,  // (B, S, Hq, D)
                                        std::span<const In> k,  // (B, S, Hkv, D)
                                        std::span<const In> v,  // (B, S, Hkv, D)
                                        int b, int h, int i,
                                        std::span<AttentionReal<In>> o_row);  // (D)

/// Every O row and LSE entry; rows in parallel over (b, h) on all hardware threads.
template <class In>
void attention_forward(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                       std::span<const In> v,
                       std::span<AttentionReal<In>> o,     // (B, S, Hq, D)
                       std::span<AttentionReal<In>> lse);  // (B, Hq, S)

/// dQ, dK, dV from dO and the forward's O and LSE (FA2 Algorithm 2 row by row: D_i = dO_i . O_i,
/// P_ij = exp(scale q_i.k_j - LSE_i), dS_ij = P_ij (dO_i.v_j - D_i), dQ_i = scale sum_j dS_ij k_j,
/// dK_j = scale sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i, dK/dV summed over a group's heads).
template <class In>
void attention_backward(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                        std::span<const In> v,
                        std::span<const AttentionReal<In>> o,    // (B, S, Hq, D)
                        std::span<const AttentionReal<In>> lse,  // (B, Hq, S)
                        std::span<const In> d_o,                 // (B, S, Hq, D)
                        std::span<AttentionReal<In>> dq,         // (B, S, Hq, D)
                        std::span<AttentionReal<In>> dk,         // (B, S, Hkv, D)
                        std::span<AttentionReal<In>> dv);        // (B, S, Hkv, D)

/// One dQ row (b, h, i), recomputing that row's O and LSE: O(i * D) work.
template <class In>
void attention_backward_dq_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                               std::span<const In> v, std::span<const In> d_o, int b, int h, int i,
                               std::span<AttentionReal<In>> dq_row);  // (D)

/// One dK row and dV row (b, KV head hk, key j), summed over the group's query heads and the
/// queries i >= j, each recomputed: O((S - j) * S * D) work, cheap for keys near the end.
template <class In>
void attention_backward_dkv_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                                std::span<const In> v, std::span<const In> d_o, int b, int hk, int j,
                                std::span<AttentionReal<In>> dk_row,   // (D)
                                std::span<AttentionReal<In>> dv_row);  // (D)

/// Per-element error scales for checking a bf16 kernel: the sums of magnitudes whose rounding an
/// implementation that feeds P and dS to bf16 tensor cores (FA2) carries. For u = 2^-8 (bf16's unit
/// roundoff) such a kernel's error is at most about u times these, plus the rounding of its output:
///   o_mag  = sum_j P_ij |v_j|                          (P rounded before P·V)
///   dq_mag = scale sum_j (|dS_ij| + P_ij Dabs_i) |k_j| (dS rounded; D_i from bf16 O: Dabs_i = sum |dO_i||O_i|)
///   dk_mag = scale sum_i (|dS_ij| + P_ij Dabs_i) |q_i| (over the group's heads)
///   dv_mag = sum_i P_ij |dO_i|                          (over the group's heads)
/// Elementwise bounds follow the data: a query with two keys has P ~ 1/2 and errors ~ u/2 |v|,
/// far above u times the tensor's rms, which a tolerance from the rms alone would flag.
template <class In>
void attention_error_scales(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                            std::span<const In> v,
                            std::span<const AttentionReal<In>> o,  // (B, S, Hq, D)
                            std::span<const In> d_o,               // (B, S, Hq, D)
                            std::span<double> o_mag,               // (B, S, Hq, D)
                            std::span<double> dq_mag,              // (B, S, Hq, D)
                            std::span<double> dk_mag,              // (B, S, Hkv, D)
                            std::span<double> dv_mag);             // (B, S, Hkv, D)

/// o_mag and dq_mag of one query row (b, h, i), recomputing its O: O(i * D) work.
template <class In>
void attention_error_scales_row(const AttentionDims& dims, double scale, std::span<const In> q, std::span<const In> k,
                                std::span<const In> v, std::span<const In> d_o, int b, int h, int i,
                                std::span<double> o_mag_row, std::span<double> dq_mag_row);  // (D) each

}  // namespace oom::reference
