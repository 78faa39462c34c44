// The gated delta rule, recurrent: one block per (sequence, value head), its dk x dv fp32 state in
// shared memory. Contract in include/oom/kernels/gated_delta.hpp; the math, line by line, is
// oom::reference::gated_delta_rule_forward / _backward (src/reference/gated_delta.cpp).
//
// Forward: thread j owns column j of the state (dv threads, rounded up to a warp), so a token's
// S^T k, delta, rank-1 update and S^T q need no other thread: the block meets only to stage the
// next tile of tokens (their q and k l2-normalised, by warps).
// Backward, per chunk from the last: the chunk's states are recomputed from the one the forward
// kept and written to this block's scratch, then the tokens are walked backwards with the state's
// gradient dS in shared memory beside the state before the token: column passes (S^T k, dS^T k)
// and row passes (S do, dS d) alternate, each element computed by one thread in a fixed order.
// A last kernel sums dq and dk over the value heads of each key head, in head order, and takes
// them back through the l2norm.
#include <algorithm>

#include "bf16_device.cuh"
#include "oom/kernels/gated_delta.hpp"
#include "refuse.hpp"

namespace oom::kernels {
namespace {

using detail::bf16_to_float;
using detail::float_to_bf16;
using detail::warp_sum;

constexpr float l2_eps = 1e-6f;       // transformers' (FLA's) l2norm
constexpr int tile_tokens = 16;       // tokens the forward stages at once
constexpr int backward_threads = 256;
constexpr int norm_threads = 128;     // the l2norm backward: a warp per (token, key head) row

__host__ __device__ constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
// GatedDeltaDims' chunks() and tokens(), for device code (the header's are host functions).
__device__ std::int64_t chunks_of(const GatedDeltaDims& d) { return (d.seq_len + d.chunk - 1) / d.chunk; }
__device__ std::int64_t tokens_of(const GatedDeltaDims& d) { return d.sequences * d.seq_len; }

std::size_t forward_smem_bytes(const GatedDeltaDims& d) {
  return static_cast<std::size_t>(d.k_dim * d.v_dim + tile_tokens * (2 * d.k_dim + d.v_dim + 2)) * sizeof(float);
}

// Row stride of the backward's two (dk, dv) matrices: dv + 1 floats, so that a row pass (threads
// over rows, each walking its row) reads 32 different banks.
std::int64_t backward_ld(const GatedDeltaDims& d) { return d.v_dim + 1; }
std::size_t backward_smem_bytes(const GatedDeltaDims& d) {
  const std::int64_t vectors = 3 * d.k_dim + 5 * d.v_dim + 2;
  return static_cast<std::size_t>(2 * d.k_dim * backward_ld(d) + vectors) * sizeof(float);
}

// The recurrence's three steps, spelled out (explicit fma and uncontracted products) so that the
// forward and the backward's recomputation round alike whatever the compiler contracts: the
// backward starts from the states the forward kept and must walk to the same bits.
__device__ __forceinline__ float dot_step(float acc, float s, float k) { return __fmaf_rn(s, k, acc); }
__device__ __forceinline__ float delta_of(float beta, float v, float alpha, float u) {
  return __fmul_rn(beta, __fsub_rn(v, __fmul_rn(alpha, u)));
}
__device__ __forceinline__ float update(float s, float alpha, float k, float delta) { return __fmaf_rn(k, delta, __fmul_rn(alpha, s)); }

// ---- forward ------------------------------------------------------------------------------------

__global__ void forward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v,
                               const float* g, const float* beta, std::uint16_t* out, float* states) {
  extern __shared__ float smem[];
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads;
  const std::int64_t b = blockIdx.x / H, h = blockIdx.x % H, kh = h / (H / d.k_heads);
  const float scale = 1.0f / sqrtf(static_cast<float>(dk));
  float* state = smem;                        // (dk, dv): column j is thread j's
  float* qn = state + dk * dv;                // (tile, dk)
  float* kn = qn + tile_tokens * dk;          // (tile, dk)
  float* vt = kn + tile_tokens * dk;          // (tile, dv)
  float* alpha = vt + tile_tokens * dv;       // (tile)
  float* bt = alpha + tile_tokens;            // (tile)
  const int j = threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const bool owner = j < dv;
  if (owner)
    for (std::int64_t i = 0; i < dk; ++i) state[i * dv + j] = 0.0f;
  float* my_states = states + static_cast<std::size_t>(blockIdx.x) * (chunks_of(d) + 1) * dk * dv;
  auto save_state = [&](std::int64_t c) {
    if (owner)
      for (std::int64_t i = 0; i < dk; ++i) my_states[(c * dk + i) * dv + j] = state[i * dv + j];
  };
  for (std::int64_t t0 = 0; t0 < S; t0 += tile_tokens) {
    const int n = static_cast<int>(min(static_cast<std::int64_t>(tile_tokens), S - t0));
    __syncthreads();  // the previous tile's values are read
    // Stage: q and k rows normalised by a warp each, v by the block, the gates by thread 0.
    for (int r = warp; r < 2 * n; r += warps) {
      const int tt = r / 2;
      const std::int64_t row = ((b * S + t0 + tt) * d.k_heads + kh) * dk;
      const std::uint16_t* src = (r % 2 == 0 ? q : k) + row;
      float ss = 0;
      for (std::int64_t i = lane; i < dk; i += 32) {
        const float x = bf16_to_float(src[i]);
        ss += x * x;
      }
      const float inv = 1.0f / sqrtf(warp_sum(ss) + l2_eps) * (r % 2 == 0 ? scale : 1.0f);
      float* dst = (r % 2 == 0 ? qn : kn) + tt * dk;
      for (std::int64_t i = lane; i < dk; i += 32) dst[i] = bf16_to_float(src[i]) * inv;
    }
    for (std::int64_t e = threadIdx.x; e < n * dv; e += blockDim.x) {
      const std::int64_t tt = e / dv, c = e % dv;
      vt[e] = bf16_to_float(v[((b * S + t0 + tt) * H + h) * dv + c]);
    }
    if (threadIdx.x < n) {
      const std::int64_t gi = (b * S + t0 + threadIdx.x) * H + h;
      alpha[threadIdx.x] = expf(g[gi]);
      bt[threadIdx.x] = beta[gi];
    }
    __syncthreads();
    if (!owner) continue;
    for (int tt = 0; tt < n; ++tt) {
      const std::int64_t t = t0 + tt;
      if (t % d.chunk == 0) save_state(t / d.chunk);
      const float* kk = kn + tt * dk;
      const float* qq = qn + tt * dk;
      const float a = alpha[tt];
      float u = 0;
      for (std::int64_t i = 0; i < dk; ++i) u = dot_step(u, state[i * dv + j], kk[i]);
      const float delta = delta_of(bt[tt], vt[tt * dv + j], a, u);
      float o = 0;
      for (std::int64_t i = 0; i < dk; ++i) {
        const float s = update(state[i * dv + j], a, kk[i], delta);
        state[i * dv + j] = s;
        o += s * qq[i];
      }
      out[((b * S + t) * H + h) * dv + j] = float_to_bf16(o);
    }
  }
  save_state(chunks_of(d));
}

// ---- backward -----------------------------------------------------------------------------------

/// One token's vectors for the backward, staged by the block: q and k normalised (q scaled),
/// v, d_out, exp(g), beta. Ends synchronised.
struct TokenVectors {
  float *qn, *kn, *v, *dout, *scalars;  // scalars: [alpha, beta]
};

__device__ void stage_token(const GatedDeltaDims& d, std::int64_t b, std::int64_t h, std::int64_t kh, std::int64_t t,
                            const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, const float* g,
                            const float* beta, const std::uint16_t* d_out, const TokenVectors& tv) {
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads;
  const std::int64_t qrow = ((b * S + t) * d.k_heads + kh) * dk, vrow = ((b * S + t) * H + h) * dv;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp < 2) {  // warp 0: q, warp 1: k
    const std::uint16_t* src = (warp == 0 ? q : k) + qrow;
    float ss = 0;
    for (std::int64_t i = lane; i < dk; i += 32) {
      const float x = bf16_to_float(src[i]);
      ss += x * x;
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) + l2_eps) * (warp == 0 ? 1.0f / sqrtf(static_cast<float>(dk)) : 1.0f);
    float* dst = warp == 0 ? tv.qn : tv.kn;
    for (std::int64_t i = lane; i < dk; i += 32) dst[i] = bf16_to_float(src[i]) * inv;
  }
  for (std::int64_t c = threadIdx.x; c < dv; c += blockDim.x) {
    tv.v[c] = bf16_to_float(v[vrow + c]);
    if (d_out != nullptr) tv.dout[c] = bf16_to_float(d_out[vrow + c]);
  }
  if (threadIdx.x == 0) {
    tv.scalars[0] = expf(g[(b * S + t) * H + h]);
    tv.scalars[1] = beta[(b * S + t) * H + h];
  }
  __syncthreads();
}

__global__ void backward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v,
                                const float* g, const float* beta, const std::uint16_t* d_out, const float* states,
                                std::uint16_t* dv_out, float* dg, float* dbeta, float* scratch, float* dq_part,
                                float* dk_part) {
  extern __shared__ float smem[];
  const std::int64_t dk = d.k_dim, dv = d.v_dim, S = d.seq_len, H = d.v_heads, ld = d.v_dim + 1;
  const std::int64_t b = blockIdx.x / H, h = blockIdx.x % H, kh = h / (H / d.k_heads);
  float* sp = smem;              // (dk, ld): the state before the token
  float* ds = sp + dk * ld;      // (dk, ld): the gradient of the state after the token
  TokenVectors tv;
  tv.qn = ds + dk * ld;
  tv.kn = tv.qn + dk;
  tv.v = tv.kn + dk;
  tv.dout = tv.v + dv;
  float* delta = tv.dout + dv;   // (dv)
  float* du = delta + dv;        // (dv)
  float* dbeta_part = du + dv;   // (dv)
  float* dalpha_part = dbeta_part + dv;  // (dk)
  tv.scalars = dalpha_part + dk;  // 2
  const std::int64_t chunks = chunks_of(d);
  const float* my_states = states + static_cast<std::size_t>(blockIdx.x) * (chunks + 1) * dk * dv;
  float* my_scratch = scratch + static_cast<std::size_t>(blockIdx.x) * min(d.chunk, S) * dk * dv;
  const std::int64_t elems = dk * dv;

  for (std::int64_t e = threadIdx.x; e < elems; e += blockDim.x) ds[(e / dv) * ld + e % dv] = 0.0f;
  for (std::int64_t c = chunks - 1; c >= 0; --c) {
    const std::int64_t c0 = c * d.chunk, c1 = min(S, c0 + d.chunk);
    // Recompute the chunk's states: sp walks from the kept one, each written to scratch first.
    for (std::int64_t e = threadIdx.x; e < elems; e += blockDim.x) sp[(e / dv) * ld + e % dv] = my_states[c * elems + e];
    __syncthreads();
    for (std::int64_t t = c0; t < c1; ++t) {
      float* dst = my_scratch + (t - c0) * elems;
      for (std::int64_t e = threadIdx.x; e < elems; e += blockDim.x) dst[e] = sp[(e / dv) * ld + e % dv];
      stage_token(d, b, h, kh, t, q, k, v, g, beta, nullptr, tv);
      const float a = tv.scalars[0], bb = tv.scalars[1];
      for (std::int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
        float u = 0;
        for (std::int64_t i = 0; i < dk; ++i) u = dot_step(u, sp[i * ld + j], tv.kn[i]);
        delta[j] = delta_of(bb, tv.v[j], a, u);
      }
      __syncthreads();
      for (std::int64_t e = threadIdx.x; e < elems; e += blockDim.x) {
        const std::int64_t i = e / dv, j = e % dv;
        sp[i * ld + j] = update(sp[i * ld + j], a, tv.kn[i], delta[j]);
      }
      __syncthreads();
    }
    // Backwards over the chunk's tokens.
    for (std::int64_t t = c1 - 1; t >= c0; --t) {
      const float* src = my_scratch + (t - c0) * elems;
      for (std::int64_t e = threadIdx.x; e < elems; e += blockDim.x) sp[(e / dv) * ld + e % dv] = src[e];
      stage_token(d, b, h, kh, t, q, k, v, g, beta, d_out, tv);
      const float a = tv.scalars[0], bb = tv.scalars[1];
      const std::int64_t vrow = ((b * S + t) * H + h) * dv;
      // Columns: u = a S^T k, the delta; dS += q do^T; dd = dS^T k; dv, du and dbeta's terms.
      for (std::int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
        float u = 0;
        for (std::int64_t i = 0; i < dk; ++i) u += sp[i * ld + j] * tv.kn[i];
        u *= a;
        const float dl = bb * (tv.v[j] - u);
        float dd = 0;
        for (std::int64_t i = 0; i < dk; ++i) {
          const float x = ds[i * ld + j] + tv.qn[i] * tv.dout[j];
          ds[i * ld + j] = x;
          dd += x * tv.kn[i];
        }
        delta[j] = dl;
        du[j] = -bb * dd;
        dbeta_part[j] = dd * (tv.v[j] - u);
        dv_out[vrow + j] = float_to_bf16(bb * dd);
      }
      __syncthreads();
      // Rows: dq = S_t do with S_t = a S + k delta^T; dk = dS delta + a S du.
      const std::int64_t prow = ((b * S + t) * H + h) * dk;
      for (std::int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
        float gq = 0, gk = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          const float s = sp[i * ld + j];
          gq += (a * s + tv.kn[i] * delta[j]) * tv.dout[j];
          gk += ds[i * ld + j] * delta[j] + a * s * du[j];
        }
        dq_part[prow + i] = gq;
        dk_part[prow + i] = gk;
      }
      __syncthreads();
      // dS' = dS + k du^T; d alpha = <dS', S>; the gradient entering the previous token is a dS'.
      // Each thread sums its rows' terms in order, then the rows in order.
      for (std::int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
        float acc = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          const float x = ds[i * ld + j] + tv.kn[i] * du[j];
          acc += x * sp[i * ld + j];
          ds[i * ld + j] = a * x;
        }
        dalpha_part[i] = acc;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float dalpha = 0, db = 0;
        for (std::int64_t i = 0; i < dk; ++i) dalpha += dalpha_part[i];
        for (std::int64_t j = 0; j < dv; ++j) db += dbeta_part[j];
        dg[(b * S + t) * H + h] = dalpha * a;
        dbeta[(b * S + t) * H + h] = db;
      }
      __syncthreads();
    }
  }
}

/// Per (token, key head) row: the value heads' gradients of the normalised q and k summed in head
/// order, then through q / sqrt(dk) and the l2norm: dx = r dy - x r^3 (x . dy).
__global__ void l2norm_backward_kernel(GatedDeltaDims d, const std::uint16_t* q, const std::uint16_t* k,
                                       const float* dq_part, const float* dk_part, std::uint16_t* dq, std::uint16_t* dk_out) {
  const std::int64_t rows = tokens_of(d) * d.k_heads, dk = d.k_dim, group = d.v_heads / d.k_heads;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (norm_threads / 32) + threadIdx.x / 32;
  if (row >= 2 * rows) return;
  const bool is_q = row < rows;
  const std::int64_t r = is_q ? row : row - rows, t = r / d.k_heads, kh = r % d.k_heads;
  const int lane = threadIdx.x % 32;
  const std::uint16_t* x = (is_q ? q : k) + r * dk;
  const float* part = is_q ? dq_part : dk_part;
  const float scale = is_q ? 1.0f / sqrtf(static_cast<float>(dk)) : 1.0f;
  float ss = 0, xdy = 0;
  for (std::int64_t i = lane; i < dk; i += 32) {
    float dy = 0;
    for (std::int64_t gh = 0; gh < group; ++gh) dy += part[((t * d.v_heads) + kh * group + gh) * dk + i];
    const float xi = bf16_to_float(x[i]);
    ss += xi * xi;
    xdy += xi * dy * scale;
  }
  const float inv = 1.0f / sqrtf(warp_sum(ss) + l2_eps);
  xdy = warp_sum(xdy);
  std::uint16_t* out = (is_q ? dq : dk_out) + r * dk;
  for (std::int64_t i = lane; i < dk; i += 32) {
    float dy = 0;
    for (std::int64_t gh = 0; gh < group; ++gh) dy += part[((t * d.v_heads) + kh * group + gh) * dk + i];
    const float xi = bf16_to_float(x[i]);
    out[i] = float_to_bf16(inv * dy * scale - xi * inv * inv * inv * xdy);
  }
}

// ---- launchers ----------------------------------------------------------------------------------

cudaError_t check_dims(const char* name, const GatedDeltaDims& d) {
  if (d.sequences < 0 || d.seq_len < 0)
    return detail::refuse(name, ": sequences = ", d.sequences, ", seq_len = ", d.seq_len, " (must be >= 0)");
  if (d.k_heads < 1 || d.v_heads < 1 || d.v_heads % d.k_heads != 0)
    return detail::refuse(name, ": k_heads = ", d.k_heads, ", v_heads = ", d.v_heads,
                          " (need >= 1 each, v_heads a multiple of k_heads)");
  if (d.k_dim < 1 || d.k_dim > 256 || d.v_dim < 1 || d.v_dim > 1024)
    return detail::refuse(name, ": k_dim = ", d.k_dim, ", v_dim = ", d.v_dim, " (need 1..256 and 1..1024)");
  if (d.chunk < 1) return detail::refuse(name, ": chunk = ", d.chunk, " (must be >= 1)");
  if (d.sequences * d.v_heads > 0x7fffffff)
    return detail::refuse(name, ": ", d.sequences, " sequences x ", d.v_heads, " value heads need more than 2^31 - 1 blocks");
  return cudaSuccess;
}

/// The opt-in for `smem` bytes of dynamic shared memory, or a refusal naming the dims when the
/// device has less.
template <class Kernel>
cudaError_t reserve_smem(const char* name, Kernel kernel, std::size_t smem, const GatedDeltaDims& d) {
  int device = 0, limit = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device); e != cudaSuccess)
    return e;
  if (smem > static_cast<std::size_t>(limit))
    return detail::refuse(name, ": k_dim ", d.k_dim, " x v_dim ", d.v_dim, " needs ", smem, " bytes of shared memory a block, the device has ",
                          limit);
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

}  // namespace

std::size_t gated_delta_states_floats(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1) return 0;
  return static_cast<std::size_t>(d.sequences * d.v_heads * (d.chunks() + 1) * d.k_dim * d.v_dim);
}

std::size_t gated_delta_backward_workspace_bytes(const GatedDeltaDims& d) {
  if (d.sequences < 1 || d.seq_len < 1 || d.chunk < 1) return 0;
  const std::int64_t scratch = d.sequences * d.v_heads * std::min(d.chunk, d.seq_len) * d.k_dim * d.v_dim;
  const std::int64_t parts = 2 * d.tokens() * d.v_heads * d.k_dim;
  return static_cast<std::size_t>(round_up(scratch, 64) + parts) * sizeof(float);
}

cudaError_t gated_delta_forward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                const float* beta, bf16* out, float* states, cudaStream_t stream) {
  constexpr const char* name = "gated_delta_forward";
  if (const cudaError_t e = check_dims(name, d); e != cudaSuccess) return e;
  if (d.tokens() == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"out", out},
                                                       {"states", states}});
      e != cudaSuccess)
    return e;
  const std::size_t smem = forward_smem_bytes(d);
  if (const cudaError_t e = reserve_smem(name, forward_kernel, smem, d); e != cudaSuccess) return e;
  const auto threads = static_cast<unsigned>(round_up(d.v_dim, 32));
  forward_kernel<<<static_cast<unsigned>(d.sequences * d.v_heads), threads, smem, stream>>>(
      d, reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
      reinterpret_cast<const std::uint16_t*>(v), g, beta, reinterpret_cast<std::uint16_t*>(out), states);
  return cudaGetLastError();
}

cudaError_t gated_delta_backward(const GatedDeltaDims& d, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                 const float* beta, const bf16* d_out, const float* states, bf16* dq, bf16* dk, bf16* dv,
                                 float* dg, float* dbeta, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream) {
  constexpr const char* name = "gated_delta_backward";
  if (const cudaError_t e = check_dims(name, d); e != cudaSuccess) return e;
  if (d.tokens() == 0) return cudaSuccess;
  if (const cudaError_t e = detail::refuse_null(name, {{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"d_out", d_out},
                                                       {"states", states}, {"dq", dq}, {"dk", dk}, {"dv", dv}, {"dg", dg},
                                                       {"dbeta", dbeta}});
      e != cudaSuccess)
    return e;
  const std::size_t need = gated_delta_backward_workspace_bytes(d);
  if (workspace == nullptr || workspace_bytes < need)
    return detail::refuse_workspace(name, workspace, workspace_bytes, need, "gated_delta_backward_workspace_bytes(dims)");
  const std::size_t smem = backward_smem_bytes(d);
  if (const cudaError_t e = reserve_smem(name, backward_kernel, smem, d); e != cudaSuccess) return e;
  auto* scratch = static_cast<float*>(workspace);
  float* dq_part = scratch + round_up(d.sequences * d.v_heads * std::min(d.chunk, d.seq_len) * d.k_dim * d.v_dim, 64);
  float* dk_part = dq_part + d.tokens() * d.v_heads * d.k_dim;
  const auto* qb = reinterpret_cast<const std::uint16_t*>(q);
  const auto* kb = reinterpret_cast<const std::uint16_t*>(k);
  backward_kernel<<<static_cast<unsigned>(d.sequences * d.v_heads), backward_threads, smem, stream>>>(
      d, qb, kb, reinterpret_cast<const std::uint16_t*>(v), g, beta, reinterpret_cast<const std::uint16_t*>(d_out), states,
      reinterpret_cast<std::uint16_t*>(dv), dg, dbeta, scratch, dq_part, dk_part);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const std::int64_t rows = 2 * d.tokens() * d.k_heads, per_block = norm_threads / 32;
  const std::int64_t blocks = (rows + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return detail::refuse(name, ": ", rows, " rows of q and k need more than 2^31 - 1 blocks");
  l2norm_backward_kernel<<<static_cast<unsigned>(blocks), norm_threads, 0, stream>>>(
      d, qb, kb, dq_part, dk_part, reinterpret_cast<std::uint16_t*>(dq), reinterpret_cast<std::uint16_t*>(dk));
  return cudaGetLastError();
}

}  // namespace oom::kernels
