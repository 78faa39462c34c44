// The Gated DeltaNet block on the GPU; contract in include/oom/model/cuda_deltanet.hpp.
#include "oom/model/cuda_deltanet.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cuda_layer_util.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/deltanet.hpp"
#include "oom/kernels/gated_delta.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/reference/gated_delta.hpp"

namespace oom::model {
namespace {

constexpr std::string_view owner = "Gated DeltaNet block";

[[noreturn]] void invalid(const std::string& what) { throw Error(Errc::invalid_argument, fmt::format("{}: {}", owner, what)); }
void check(cudaError_t status, std::string_view step) { ::oom::detail::check_launch(status, owner, step); }
void check(cublasStatus_t status, std::string_view step) { detail::check_cublas(status, owner, step); }
void gemm(cublasHandle_t blas, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
          std::int64_t lda, const void* b, std::int64_t ldb, void* c, cudaDataType_t c_type, std::int64_t ldc, float beta,
          std::string_view step) {
  detail::gemm_bf16(blas, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, c_type, ldc, beta, owner, step);
}

void check_shape(const DeltaNetShape& s) {
  if (s.tokens < 1 || s.sequences < 1 || s.tokens % s.sequences != 0)
    invalid(fmt::format("{} tokens are not a whole number of sequences = {}", s.tokens, s.sequences));
  if (s.hidden < 1 || s.k_heads < 1 || s.v_heads < 1 || s.v_heads % s.k_heads != 0 || s.k_dim < 1 || s.v_dim < 1 || s.conv_kernel < 1)
    invalid(fmt::format("shape hidden {}, k_heads {}, v_heads {}, k_dim {}, v_dim {}, conv_kernel {} (all >= 1, v_heads a multiple "
                        "of k_heads)",
                        s.hidden, s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel));
  // What the kernels take (gated_delta.hpp, deltanet.hpp), refused here before any sizing.
  if (s.part_tokens < 0 || (s.part_tokens > 0 && s.chunk > 0 && s.part_tokens % s.chunk != 0))
    invalid(fmt::format("part_tokens = {} (0: whole sequences, else a multiple of chunk = {})", s.part_tokens, s.chunk));
  // A part's conv reaches K - 1 rows into the part after, which the block carries from that part
  // alone: parts must be at least that long.
  if (s.part_tokens > 0 && s.part_tokens < s.conv_kernel - 1)
    invalid(fmt::format("part_tokens = {} is shorter than the conv's reach, conv_kernel - 1 = {}", s.part_tokens, s.conv_kernel - 1));
  if (s.k_dim > 128 || s.v_dim > 128 || s.conv_kernel > 8 || s.chunk < 1 || !(s.eps > 0.0f))
    invalid(fmt::format("k_dim {}, v_dim {} (at most 128 each), conv_kernel {} (at most 8), chunk {} (at least 1), eps {} (above 0)",
                        s.k_dim, s.v_dim, s.conv_kernel, s.chunk, s.eps));
}

/// Every tensor of a binding set, or an error naming the first that is not.
template <class T>
void check_bound(const DeltaNetTensors<T>& t, std::string_view what) {
  const std::pair<const char*, const void*> all[] = {{"in_proj_qkvz", t.in_proj_qkvz}, {"in_proj_ba", t.in_proj_ba}, {"conv", t.conv},
                                                     {"dt_bias", t.dt_bias},           {"A_log", t.a_log},           {"norm", t.norm},
                                                     {"out_proj", t.out_proj}};
  for (const auto& [name, p] : all)
    if (p == nullptr) invalid(fmt::format("{}: {} is null", what, name));
}

kernels::GatedDeltaDims rule_dims(const DeltaNetShape& s) {
  kernels::GatedDeltaDims d;
  d.sequences = s.sequences;
  d.seq_len = s.tokens / s.sequences;
  d.k_heads = s.k_heads;
  d.v_heads = s.v_heads;
  d.k_dim = s.k_dim;
  d.v_dim = s.v_dim;
  d.chunk = s.chunk;
  d.qk_stride = d.v_stride = s.conv_channels();  // q, k, v: column ranges of the conv's output
  return d;
}
kernels::ConvDims conv_dims(const DeltaNetShape& s) {
  return {s.sequences, s.tokens / s.sequences, s.conv_channels(), s.conv_kernel, s.projection_width()};
}
kernels::GateDims gate_dims(const DeltaNetShape& s) { return {s.tokens, s.v_heads, 2 * s.v_heads}; }
kernels::GatedNormDims norm_dims(const DeltaNetShape& s) { return {s.tokens, s.v_heads, s.v_dim, s.projection_width(), s.eps}; }
kernels::FusedProjectionDims fused_dims(const DeltaNetShape& s) { return {s.tokens, s.k_heads, s.v_heads, s.k_dim, s.v_dim}; }

/// One pass of the block over rows [r0, r0 + shape.tokens): whole sequences (one pass, `shape` the
/// block's), or part [c0, c0 + shape.tokens) of sequence b (`shape` one sequence of the part).
struct Pass {
  DeltaNetShape shape;
  std::int64_t r0 = 0, b = 0, c0 = 0;
};
/// The shape of one part: the largest pass, what the workspace is sized for.
DeltaNetShape part_shape(const DeltaNetShape& s, std::int64_t tokens) {
  DeltaNetShape p = s;
  p.sequences = 1;
  p.tokens = tokens;
  p.part_tokens = 0;
  return p;
}
DeltaNetShape pass_shape(const DeltaNetShape& s) { return s.in_parts() ? part_shape(s, s.part_tokens) : s; }
/// The passes in order (the forward's; the backward runs them in reverse).
std::vector<Pass> passes(const DeltaNetShape& s) {
  if (!s.in_parts()) return {Pass{s, 0, 0, 0}};
  std::vector<Pass> all;
  const std::int64_t S = s.seq_len();
  for (std::int64_t b = 0; b < s.sequences; ++b)
    for (std::int64_t c0 = 0; c0 < S; c0 += s.part_tokens)
      all.push_back(Pass{part_shape(s, std::min(s.part_tokens, S - c0)), b * S + c0, b, c0});
  return all;
}
/// The rule's dims for a pass: a part reads and writes its slots of the whole sequence's kept
/// states (states_stride), from the state the part before kept.
kernels::GatedDeltaDims pass_rule_dims(const DeltaNetShape& s, const Pass& ps) {
  kernels::GatedDeltaDims d = rule_dims(ps.shape);
  if (s.in_parts()) {
    d.states_stride = ((s.seq_len() + s.chunk - 1) / s.chunk + 1) * s.k_dim * s.v_dim;
    d.from_kept_state = ps.c0 > 0;
  }
  return d;
}
/// Where a pass's kept states start in the block's: slot c0 / chunk of sequence b's first head.
float* pass_states(const DeltaNetShape& s, const Pass& ps, float* states) {
  if (!s.in_parts()) return states;
  return states + ps.b * s.v_heads * pass_rule_dims(s, ps).states_stride + ps.c0 / s.chunk * s.k_dim * s.v_dim;
}
/// The conv's dims for a pass: a part reaches K - 1 rows into the part before (history) and, in
/// the backward, into the part after (future).
kernels::ConvDims pass_conv_dims(const DeltaNetShape& s, const Pass& ps, bool backward) {
  kernels::ConvDims d = conv_dims(ps.shape);
  if (s.in_parts()) {
    d.history = std::min(s.conv_kernel - 1, ps.c0);
    if (backward) d.future = std::min(s.conv_kernel - 1, s.seq_len() - ps.c0 - ps.shape.tokens);
  }
  return d;
}

/// What the forward keeps for the backward. Not the conv's output (the rule's q, k, v) nor the
/// gated norm's (out_proj's input): the backward makes them again from qkvz and core with the
/// forward's launches (the same bits), in the workspace, which one device shares among all layers
/// where `saved` is one per layer kept: (T, C + vw) bf16 a layer less (6.4 GB at 256K tokens of
/// the Qwen3-Next-80B layer) for two memory-bound passes.
struct Saved {
  bf16* qkvz;   // (T, [q k v z]) the projections, unfused
  bf16* ba;     // (T, [b a])
  float *g, *beta;  // (T, v_heads)
  bf16* core;   // (T, vw) the rule's output
  float* rstd;  // (T v_heads)
  float* states;
};

Saved carve_saved(const DeltaNetShape& s, detail::Carver& c) {
  const std::int64_t T = s.tokens;
  Saved v{};
  v.qkvz = c.take<bf16>(T * s.projection_width());
  v.ba = c.take<bf16>(T * 2 * s.v_heads);
  v.g = c.take<float>(T * s.v_heads);
  v.beta = c.take<float>(T * s.v_heads);
  v.core = c.take<bf16>(T * s.value_width());
  v.rstd = c.take<float>(T * s.v_heads);
  v.states = c.take<float>(static_cast<std::int64_t>(kernels::gated_delta_states_floats(rule_dims(s))));
  return v;
}

struct Backward {
  bf16 *dy, *dcore, *dqkvz, *dba, *dmixed, *dp, *dpba;  // dp, dpba: the fused layout's gradients (else dqkvz, dba)
  bf16* mixed;        // (T, C) the conv's output again
  bf16* y;            // (T, vw) the gated norm's output again, in dcore's storage (read before dcore is written)
  float* rstd_again;  // (T v_heads) its rstd, written by the recompute and not read
  float *dg, *dbeta, *dconv, *da_log, *ddt_bias, *dnorm;
  float* d_state;  // in parts: the rule's state gradient between them (v_heads, dk, dv)
  bf16* carry;     // in parts: the first K - 1 rows of the later part's dmixed, the earlier part's future
  void *rule_ws, *conv_ws, *gate_ws, *norm_ws;
  std::size_t rule_bytes, conv_bytes, gate_bytes, norm_bytes;
};

Backward carve_backward(const DeltaNetShape& s, detail::Carver& c) {
  const std::int64_t T = s.tokens;
  Backward b{};
  b.dy = c.take<bf16>(T * s.value_width());
  b.dcore = c.take<bf16>(T * s.value_width());
  b.y = b.dcore;
  b.mixed = c.take<bf16>(T * s.conv_channels());
  b.rstd_again = c.take<float>(T * s.v_heads);
  b.dqkvz = c.take<bf16>(T * s.projection_width());
  b.dba = c.take<bf16>(T * 2 * s.v_heads);
  b.dmixed = c.take<bf16>((T + s.conv_kernel - 1) * s.conv_channels());  // and the part after's first K - 1 rows
  b.dp = s.fused ? c.take<bf16>(T * s.projection_width()) : b.dqkvz;
  b.dpba = s.fused ? c.take<bf16>(T * 2 * s.v_heads) : b.dba;
  b.dg = c.take<float>(T * s.v_heads);
  b.dbeta = c.take<float>(T * s.v_heads);
  b.dconv = c.take<float>(s.conv_channels() * s.conv_kernel);
  b.da_log = c.take<float>(s.v_heads);
  b.ddt_bias = c.take<float>(s.v_heads);
  b.dnorm = c.take<float>(s.v_dim);
  b.d_state = c.take<float>(s.v_heads * s.k_dim * s.v_dim);
  b.carry = c.take<bf16>((s.conv_kernel - 1) * s.conv_channels());
  b.rule_bytes = kernels::gated_delta_backward_workspace_bytes(rule_dims(s));
  b.conv_bytes = kernels::causal_conv1d_silu_backward_workspace_bytes(conv_dims(s));
  b.gate_bytes = kernels::delta_gates_backward_workspace_bytes(gate_dims(s));
  b.norm_bytes = kernels::gated_rmsnorm_backward_workspace_bytes(norm_dims(s));
  b.rule_ws = c.take_bytes(b.rule_bytes);
  b.conv_ws = c.take_bytes(b.conv_bytes);
  b.gate_ws = c.take_bytes(b.gate_bytes);
  b.norm_ws = c.take_bytes(b.norm_bytes);
  return b;
}

/// The forward's scratch: the projection outputs before the fused layout's unfusing, the conv's
/// output and the gated norm's.
struct Forward {
  bf16 *p, *pba, *mixed, *y;
};
Forward carve_forward(const DeltaNetShape& s, detail::Carver& c) {
  Forward f{};
  if (s.fused) {
    f.p = c.take<bf16>(s.tokens * s.projection_width());
    f.pba = c.take<bf16>(s.tokens * 2 * s.v_heads);
  }
  f.mixed = c.take<bf16>(s.tokens * s.conv_channels());
  f.y = c.take<bf16>(s.tokens * s.value_width());
  return f;
}

/// The block's segment layout, as the reference states it (the host layer reads the same).
reference::GatedDeltaNetOffsets segment_offsets(const DeltaNetShape& s) {
  return reference::gated_deltanet_offsets({.hidden = s.hidden, .k_heads = s.k_heads, .v_heads = s.v_heads, .k_dim = s.k_dim,
                                            .v_dim = s.v_dim, .conv_kernel = s.conv_kernel});
}

template <class T>
DeltaNetTensors<T> bind(const DeltaNetShape& s, T* base) {
  if (base == nullptr) invalid("the segment's base pointer is null");
  const reference::GatedDeltaNetOffsets o = segment_offsets(s);
  return {base + o.in_proj_qkvz, base + o.in_proj_ba, base + o.conv, base + o.dt_bias, base + o.a_log, base + o.norm, base + o.out_proj};
}

/// dst += src (n floats) on the handle's stream.
void add(cublasHandle_t blas, const float* src, float* dst, std::int64_t n, std::string_view step) {
  const float one = 1.0f;
  check(cublasSaxpy(blas, static_cast<int>(n), &one, src, 1, dst, 1), step);
}

}  // namespace

DeltaNetShape DeltaNetShape::from_spec(const ModelSpec& spec, int layer, std::int64_t tokens, std::int64_t sequences) {
  const LayerSpec& ls = spec.layer(layer);
  if (ls.attention != AttentionKind::linear)
    invalid(fmt::format("layer {} of the {} model is not a linear-attention layer", layer, to_string(spec.family())));
  if (spec.family() != ModelFamily::qwen3_next && spec.family() != ModelFamily::qwen3_5_moe)
    invalid(fmt::format("layer {}: model family {} has no Gated DeltaNet", layer, to_string(spec.family())));
  const auto& l = spec.linear_attention();
  DeltaNetShape s;
  s.tokens = tokens;
  s.sequences = sequences;
  s.hidden = static_cast<std::int64_t>(spec.hidden_size());
  s.k_heads = static_cast<std::int64_t>(l.key_heads);
  s.v_heads = static_cast<std::int64_t>(l.value_heads);
  s.k_dim = static_cast<std::int64_t>(l.key_head_dim);
  s.v_dim = static_cast<std::int64_t>(l.value_head_dim);
  s.conv_kernel = static_cast<std::int64_t>(l.conv_kernel);
  s.eps = static_cast<float>(spec.rms_norm_eps());
  s.fused = spec.family() == ModelFamily::qwen3_next;
  check_shape(s);
  return s;
}

DeltaNetParams bind_deltanet_params(const DeltaNetShape& s, const bf16* base) { return bind(s, base); }
DeltaNetGrads bind_deltanet_grads(const DeltaNetShape& s, float* base) { return bind(s, base); }

std::int64_t deltanet_parameters(const DeltaNetShape& s) { return segment_offsets(s).end; }

std::size_t deltanet_saved_bytes(const DeltaNetShape& s) {
  check_shape(s);
  detail::Carver c(nullptr);
  (void)carve_saved(s, c);
  return c.size();
}

std::size_t deltanet_workspace_bytes(const DeltaNetShape& s) {
  check_shape(s);
  detail::Carver f(nullptr), b(nullptr);
  (void)carve_forward(pass_shape(s), f);
  (void)carve_backward(pass_shape(s), b);
  return std::max(f.size(), b.size());
}

void deltanet_forward(cublasHandle_t blas, cudaStream_t stream, const DeltaNetShape& s, const DeltaNetParams& w, const bf16* x,
                      bf16* out, void* saved, void* workspace) {
  check_shape(s);
  if (x == nullptr || out == nullptr || saved == nullptr || workspace == nullptr)
    invalid("forward: x, out, saved and workspace must be set");
  check_bound(w, "forward: weight");
  detail::Carver cs(saved), cw(workspace);
  const Saved v = carve_saved(s, cs);
  const Forward f = carve_forward(pass_shape(s), cw);
  const std::int64_t H = s.hidden, PW = s.projection_width(), C = s.conv_channels(), vw = s.value_width(), vh = s.v_heads;
  check(cublasSetStream(blas, stream), "cublasSetStream");
  for (const Pass& ps : passes(s)) {
    const DeltaNetShape& p = ps.shape;
    const std::int64_t n = p.tokens, r0 = ps.r0;
    bf16* qkvz = v.qkvz + r0 * PW;
    bf16* ba = v.ba + r0 * 2 * vh;
    bf16* proj = s.fused ? f.p : qkvz;
    bf16* pba = s.fused ? f.pba : ba;
    gemm(blas, false, true, n, PW, H, x + r0 * H, H, w.in_proj_qkvz, H, proj, CUDA_R_16BF, PW, 0.0f, "in_proj_qkvz forward GEMM");
    gemm(blas, false, true, n, 2 * vh, H, x + r0 * H, H, w.in_proj_ba, H, pba, CUDA_R_16BF, 2 * vh, 0.0f, "in_proj_ba forward GEMM");
    if (s.fused) check(kernels::deltanet_unfuse_projections(fused_dims(p), proj, pba, qkvz, ba, false, stream), "unfusing the projections");
    check(kernels::causal_conv1d_silu_forward(pass_conv_dims(s, ps, false), qkvz, w.conv, f.mixed, stream), "conv1d forward");
    float *g = v.g + r0 * vh, *beta = v.beta + r0 * vh;
    check(kernels::delta_gates_forward(gate_dims(p), ba + vh, ba, w.a_log, w.dt_bias, g, beta, stream), "gates forward");
    check(kernels::gated_delta_forward(pass_rule_dims(s, ps), f.mixed, f.mixed + s.key_width(), f.mixed + 2 * s.key_width(), g, beta,
                                       v.core + r0 * vw, pass_states(s, ps, v.states), stream),
          "gated delta rule forward");
    check(kernels::gated_rmsnorm_forward(norm_dims(p), v.core + r0 * vw, qkvz + C, w.norm, f.y, v.rstd + r0 * vh, stream),
          "gated norm forward");
    gemm(blas, false, true, n, H, vw, f.y, vw, w.out_proj, vw, out + r0 * H, CUDA_R_16BF, H, 0.0f, "out_proj forward GEMM");
  }
}

void deltanet_backward(cublasHandle_t blas, cudaStream_t stream, const DeltaNetShape& s, const DeltaNetParams& w, const bf16* x,
                       const bf16* d_out, float* dx, const DeltaNetGrads& grads, const void* saved, void* workspace) {
  check_shape(s);
  if (x == nullptr || d_out == nullptr || dx == nullptr || saved == nullptr || workspace == nullptr)
    invalid("backward: x, d_out, dx, saved and workspace must be set");
  check_bound(w, "backward: weight");
  check_bound(grads, "backward: gradient");
  detail::Carver cs(const_cast<void*>(saved)), cw(workspace);
  const Saved v = carve_saved(s, cs);
  const Backward b = carve_backward(pass_shape(s), cw);
  const std::int64_t H = s.hidden, PW = s.projection_width(), C = s.conv_channels(), vw = s.value_width();
  const std::int64_t kw = s.key_width(), vh = s.v_heads, S = s.seq_len();
  check(cublasSetStream(blas, stream), "cublasSetStream");
  const std::vector<Pass> all = passes(s);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {  // a sequence's parts from its last
    const Pass& ps = *it;
    const DeltaNetShape& p = ps.shape;
    const std::int64_t n = p.tokens, r0 = ps.r0;
    const bf16* qkvz = v.qkvz + r0 * PW;
    const bf16* ba = v.ba + r0 * 2 * vh;
    const bf16* core = v.core + r0 * vw;
    const bf16* dout = d_out + r0 * H;
    const float *g = v.g + r0 * vh, *beta = v.beta + r0 * vh;
    const kernels::ConvDims cd = pass_conv_dims(s, ps, true);
    // The gated norm's output and the conv's, as the forward made them (the same launches on the
    // same inputs: the same bits); y lives in dcore's storage until the norm's backward.
    check(kernels::gated_rmsnorm_forward(norm_dims(p), core, qkvz + C, w.norm, b.y, b.rstd_again, stream), "gated norm forward (again)");
    check(kernels::causal_conv1d_silu_forward(pass_conv_dims(s, ps, false), qkvz, w.conv, b.mixed, stream), "conv1d forward (again)");
    // out_proj.
    gemm(blas, true, false, H, vw, n, dout, H, b.y, vw, grads.out_proj, CUDA_R_32F, vw, 1.0f, "out_proj dW GEMM");
    gemm(blas, false, false, n, vw, H, dout, H, w.out_proj, vw, b.dy, CUDA_R_16BF, vw, 0.0f, "out_proj dx GEMM");
    // The gated norm: d core, dz (into dqkvz's z columns), d norm_w.
    check(kernels::gated_rmsnorm_backward(norm_dims(p), core, qkvz + C, w.norm, v.rstd + r0 * vh, b.dy, b.dcore, b.dqkvz + C, b.dnorm,
                                          b.norm_ws, b.norm_bytes, stream),
          "gated norm backward");
    add(blas, b.dnorm, grads.norm, s.v_dim, "norm weight gradient");
    // The rule: dq, dk, dv into d mixed's columns; dg, dbeta; in parts, the state's gradient from
    // the part after (zeros at a sequence's end) to the part before.
    float* d_state = nullptr;
    if (s.in_parts()) {
      d_state = b.d_state;
      if (ps.c0 + n == S)
        check(cudaMemsetAsync(d_state, 0, static_cast<std::size_t>(vh * s.k_dim * s.v_dim) * sizeof(float), stream),
              "zeroing the state's gradient");
    }
    check(kernels::gated_delta_backward(pass_rule_dims(s, ps), b.mixed, b.mixed + kw, b.mixed + 2 * kw, g, beta, b.dcore,
                                        pass_states(s, ps, v.states), b.dmixed, b.dmixed + kw, b.dmixed + 2 * kw, b.dg, b.dbeta, d_state,
                                        b.rule_ws, b.rule_bytes, stream),
          "gated delta rule backward");
    // The gates: da, db into dba's columns.
    check(kernels::delta_gates_backward(gate_dims(p), ba + vh, ba, w.a_log, w.dt_bias, b.dg, b.dbeta, b.dba + vh, b.dba, b.da_log,
                                        b.ddt_bias, b.gate_ws, b.gate_bytes, stream),
          "gates backward");
    add(blas, b.da_log, grads.a_log, vh, "A_log gradient");
    add(blas, b.ddt_bias, grads.dt_bias, vh, "dt_bias gradient");
    // The conv: d [q k v] into dqkvz's first C columns, its taps reaching the part after's first
    // rows (carried below d mixed's own); then this part's first rows carried to the part before.
    if (cd.future > 0)
      check(cudaMemcpyAsync(b.dmixed + n * C, b.carry, static_cast<std::size_t>(cd.future * C) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                            stream),
            "the part after's conv gradient rows");
    check(kernels::causal_conv1d_silu_backward(cd, qkvz, w.conv, b.dmixed, b.dqkvz, b.dconv, b.conv_ws, b.conv_bytes, stream),
          "conv1d backward");
    if (s.in_parts() && ps.c0 > 0)
      check(cudaMemcpyAsync(b.carry, b.dmixed, static_cast<std::size_t>(std::min(s.conv_kernel - 1, n) * C) * sizeof(bf16),
                            cudaMemcpyDeviceToDevice, stream),
            "carrying the conv gradient rows");
    add(blas, b.dconv, grads.conv, C * s.conv_kernel, "conv1d weight gradient");
    // The projections (their gradients back in the fused rows first).
    if (s.fused) check(kernels::deltanet_unfuse_projections(fused_dims(p), b.dqkvz, b.dba, b.dp, b.dpba, true, stream), "refusing the gradients");
    const bf16* xr = x + r0 * H;
    gemm(blas, true, false, PW, H, n, b.dp, PW, xr, H, grads.in_proj_qkvz, CUDA_R_32F, H, 1.0f, "in_proj_qkvz dW GEMM");
    gemm(blas, true, false, 2 * vh, H, n, b.dpba, 2 * vh, xr, H, grads.in_proj_ba, CUDA_R_32F, H, 1.0f, "in_proj_ba dW GEMM");
    gemm(blas, false, false, n, H, PW, b.dp, PW, w.in_proj_qkvz, H, dx + r0 * H, CUDA_R_32F, H, 0.0f, "in_proj_qkvz dx GEMM");
    gemm(blas, false, false, n, H, 2 * vh, b.dpba, 2 * vh, w.in_proj_ba, H, dx + r0 * H, CUDA_R_32F, H, 1.0f, "in_proj_ba dx GEMM");
  }
}

}  // namespace oom::model
