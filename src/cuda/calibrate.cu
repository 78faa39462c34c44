// GPU microbenchmarks for oom-calibrate (see oom/cuda/calibrate.hpp). Kernels and thin launchers
// only; results are plain structs, formatted by the host program.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "oom/core/cuda_check.hpp"
#include "oom/core/nccl_check.hpp"
#include "oom/cuda/calibrate.hpp"
#include "oom/kernels/attention.hpp"
#include "oom/kernels/gated_delta.hpp"

namespace oom::cuda {

namespace {

// ----- small RAII owners, so an exception midway frees what was taken -----

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : count(n) { OOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T))); }
  ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  DeviceBuffer(const DeviceBuffer&) = delete;
};

template <class T>
struct PinnedBuffer {
  T* ptr = nullptr;
  explicit PinnedBuffer(std::size_t n) { OOM_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ptr), n * sizeof(T), cudaHostAllocDefault)); }
  ~PinnedBuffer() { if (ptr) cudaFreeHost(ptr); }
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  PinnedBuffer(const PinnedBuffer&) = delete;
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { OOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { if (s) cudaStreamDestroy(s); }
  Stream(Stream&& o) noexcept : s(o.s) { o.s = nullptr; }
  Stream(const Stream&) = delete;
};

struct Event {
  cudaEvent_t e = nullptr;
  Event() { OOM_CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() { if (e) cudaEventDestroy(e); }
  Event(Event&& o) noexcept : e(o.e) { o.e = nullptr; }
  Event(const Event&) = delete;
};

struct Cublas {
  cublasHandle_t h = nullptr;
  explicit Cublas(cudaStream_t stream) {
    OOM_CUBLAS_CHECK(cublasCreate(&h));
    OOM_CUBLAS_CHECK(cublasSetStream(h, stream));
  }
  ~Cublas() { if (h) cublasDestroy(h); }
  Cublas(const Cublas&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

float elapsed_s(const Event& a, const Event& b) {
  float ms = 0;
  OOM_CUDA_CHECK(cudaEventElapsedTime(&ms, a.e, b.e));
  return ms * 1e-3f;
}

/// Median seconds of one call of `work` (which enqueues on `stream`). After one warm-up call, calls
/// are timed in batches long enough (~2 ms) that event resolution and launch gaps do not count.
double time_median(cudaStream_t stream, const std::function<void()>& work, int repeats) {
  Event a, b;
  work();  // warm-up: cuBLAS heuristics, lazy module loading, clocks
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  OOM_CUDA_CHECK(cudaEventRecord(a.e, stream));
  work();
  OOM_CUDA_CHECK(cudaEventRecord(b.e, stream));
  OOM_CUDA_CHECK(cudaEventSynchronize(b.e));
  const double once = std::max(1e-7, static_cast<double>(elapsed_s(a, b)));
  const int batch = static_cast<int>(std::clamp(std::ceil(2e-3 / once), 1.0, 2000.0));
  std::vector<double> per_call;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    OOM_CUDA_CHECK(cudaEventRecord(a.e, stream));
    for (int i = 0; i < batch; ++i) work();
    OOM_CUDA_CHECK(cudaEventRecord(b.e, stream));
    OOM_CUDA_CHECK(cudaEventSynchronize(b.e));
    per_call.push_back(elapsed_s(a, b) / batch);
  }
  return median(per_call);
}

// ----- kernels -----

__host__ __device__ inline float pseudo_random(std::uint64_t i, std::uint32_t seed) {
  std::uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(x & 0xFFFF) / 32768.0f - 1.0f;  // [-1, 1)
}

__global__ void fill_bf16(__nv_bfloat16* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(pseudo_random(i, seed));
}

__global__ void fill_float(float* p, std::size_t n, float value) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void empty_kernel() {}

void launch_fill(__nv_bfloat16* p, std::size_t n, std::uint32_t seed, cudaStream_t s) {
  fill_bf16<<<1024, 256, 0, s>>>(p, n, seed);
  OOM_CUDA_CHECK_LAUNCH();
}

/// Row-major C(M x N) = op(A) * op(B), batched with strides, bf16 in/out, fp32 accumulate.
/// A is M x K (lda) or, with trans_a, stored K x M; B is K x N (ldb) or, with trans_b, stored N x K.
/// cuBLAS is column-major, so this computes C^T = op(B)^T op(A)^T.
void gemm_rm(cublasHandle_t h, bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
             const __nv_bfloat16* A, std::int64_t lda, std::int64_t stride_a, const __nv_bfloat16* B, std::int64_t ldb,
             std::int64_t stride_b, __nv_bfloat16* C, std::int64_t ldc, std::int64_t stride_c, int batch, float beta) {
  const float alpha = 1.0f;
  OOM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
      static_cast<int>(M), static_cast<int>(K), &alpha, B, CUDA_R_16BF, static_cast<int>(ldb), stride_b, A, CUDA_R_16BF,
      static_cast<int>(lda), stride_a, &beta, C, CUDA_R_16BF, static_cast<int>(ldc), stride_c, batch,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

// ---------------------------------------------------------------------------------------------

HbmBandwidth measure_hbm_bandwidth(int device, Bytes size, int repeats) {
  if (size.count() == 0 || repeats < 1) OOM_THROW(Errc::invalid_argument, "measure_hbm_bandwidth needs a size and repeats");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  const std::size_t n = size.count();
  DeviceBuffer<unsigned char> src(n), dst(n);
  Stream stream;
  OOM_CUDA_CHECK(cudaMemsetAsync(src.ptr, 0x5A, n, stream.s));
  OOM_CUDA_CHECK(cudaMemsetAsync(dst.ptr, 0, n, stream.s));
  HbmBandwidth r;
  r.size = size;
  r.repeats = repeats;
  const double t = time_median(
      stream.s, [&] { OOM_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, n, cudaMemcpyDeviceToDevice, stream.s)); }, repeats);
  r.bytes_per_s = 2.0 * static_cast<double>(n) / t;
  // Check the two ends of the copy (a truncated or misdirected copy shows there).
  std::vector<unsigned char> head(4096), tail(4096);
  const std::size_t probe = std::min<std::size_t>(4096, n);
  OOM_CUDA_CHECK(cudaMemcpy(head.data(), dst.ptr, probe, cudaMemcpyDeviceToHost));
  OOM_CUDA_CHECK(cudaMemcpy(tail.data(), dst.ptr + n - probe, probe, cudaMemcpyDeviceToHost));
  r.verified = std::all_of(head.begin(), head.begin() + probe, [](unsigned char c) { return c == 0x5A; }) &&
               std::all_of(tail.begin(), tail.begin() + probe, [](unsigned char c) { return c == 0x5A; });
  return r;
}

GemmRate measure_gemm_bf16(int device, std::int64_t m, std::int64_t n, std::int64_t k, int repeats) {
  if (m < 1 || n < 1 || k < 1 || repeats < 1) OOM_THROW(Errc::invalid_argument, "measure_gemm_bf16 needs positive m, n, k, repeats");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  Stream stream;
  Cublas blas(stream.s);
  DeviceBuffer<__nv_bfloat16> a(static_cast<std::size_t>(m * k)), w(static_cast<std::size_t>(n * k)),
      c(static_cast<std::size_t>(m * n));
  launch_fill(a.ptr, a.count, 1, stream.s);
  launch_fill(w.ptr, w.count, 2, stream.s);
  // C = A W^T: row-major A (m x k), W (n x k) stored, so B = W^T with trans_b.
  auto product = [&] { gemm_rm(blas.h, false, true, m, n, k, a.ptr, k, 0, w.ptr, k, 0, c.ptr, n, 0, 1, 0.0f); };
  GemmRate r;
  r.m = m;
  r.n = n;
  r.k = k;
  r.repeats = repeats;
  r.seconds = time_median(stream.s, product, repeats);
  r.flops_per_s = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / r.seconds;

  // Check a few outputs against a host fp32 dot product of the same bf16 inputs. The bound is
  // relative to sum |a_i w_i|: fp32 accumulation error is far below it, the bf16 output rounding
  // (2^-8 relative) is what it allows for.
  OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  std::vector<__nv_bfloat16> arow(static_cast<std::size_t>(k)), wrow(static_cast<std::size_t>(k));
  bool ok = true;
  const std::int64_t rows[] = {0, m / 2, m - 1};
  const std::int64_t cols[] = {0, n / 3, n - 1};
  for (std::int64_t i : rows) {
    OOM_CUDA_CHECK(cudaMemcpy(arow.data(), a.ptr + i * k, k * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    for (std::int64_t j : cols) {
      OOM_CUDA_CHECK(cudaMemcpy(wrow.data(), w.ptr + j * k, k * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
      __nv_bfloat16 got_bf16;
      OOM_CUDA_CHECK(cudaMemcpy(&got_bf16, c.ptr + i * n + j, sizeof(got_bf16), cudaMemcpyDeviceToHost));
      double ref = 0, mag = 0;
      for (std::int64_t t = 0; t < k; ++t) {
        const double p = static_cast<double>(__bfloat162float(arow[t])) * __bfloat162float(wrow[t]);
        ref += p;
        mag += std::fabs(p);
      }
      const double got = __bfloat162float(got_bf16);
      if (!(std::fabs(got - ref) <= 1e-2 * mag + 1e-3)) ok = false;
    }
  }
  r.verified = ok;
  return r;
}

AttentionRate measure_flash_attention(int device, std::int64_t seq, int q_heads, int kv_heads, int head_dim, int repeats) {
  if (seq < 1 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads != 0 || head_dim < 1 || repeats < 1)
    OOM_THROW(Errc::invalid_argument, "measure_flash_attention: bad shape (q_heads must be a multiple of kv_heads)");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  kernels::AttentionProblem problem;
  problem.batch = 1;
  problem.seq = static_cast<int>(seq);
  problem.heads_q = q_heads;
  problem.heads_kv = kv_heads;
  problem.head_dim = head_dim;
  problem.softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (!kernels::attention_can_implement(problem))
    OOM_THROW(Errc::unsupported, "measure_flash_attention: OOM's attention kernel does not take this shape");
  Stream stream;
  const std::int64_t q_row = static_cast<std::int64_t>(q_heads) * head_dim;
  const std::int64_t kv_row = static_cast<std::int64_t>(kv_heads) * head_dim;
  DeviceBuffer<__nv_bfloat16> q(seq * q_row), o(seq * q_row), dout(seq * q_row), dq(seq * q_row), k(seq * kv_row),
      v(seq * kv_row), dk(seq * kv_row), dv(seq * kv_row);
  DeviceBuffer<float> lse(static_cast<std::size_t>(q_heads) * seq);
  const std::size_t ws_bytes = kernels::attention_backward_workspace_bytes(problem);
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(ws_bytes, 1));
  launch_fill(q.ptr, q.count, 3, stream.s);
  launch_fill(k.ptr, k.count, 4, stream.s);
  launch_fill(v.ptr, v.count, 5, stream.s);
  launch_fill(dout.ptr, dout.count, 6, stream.s);
  // __nv_bfloat16 and oom::bf16 hold the same bits; one sequence, so the batch stride is unused.
  auto rows = [](__nv_bfloat16* p, std::int64_t row) {
    return kernels::TokenRows<bf16>{reinterpret_cast<bf16*>(p), 0, row};
  };
  auto crows = [](const __nv_bfloat16* p, std::int64_t row) {
    return kernels::TokenRows<const bf16>{reinterpret_cast<const bf16*>(p), 0, row};
  };
  auto forward = [&] {
    OOM_CUDA_CHECK(kernels::attention_forward(problem, crows(q.ptr, q_row), crows(k.ptr, kv_row), crows(v.ptr, kv_row),
                                              rows(o.ptr, q_row), lse.ptr, stream.s));
  };
  auto backward = [&] {
    OOM_CUDA_CHECK(kernels::attention_backward(problem, crows(q.ptr, q_row), crows(k.ptr, kv_row), crows(v.ptr, kv_row),
                                               crows(o.ptr, q_row), crows(dout.ptr, q_row), lse.ptr, rows(dq.ptr, q_row),
                                               rows(dk.ptr, kv_row), rows(dv.ptr, kv_row), false, ws.ptr, ws_bytes,
                                               stream.s));
  };
  auto forward_backward = [&] {
    forward();
    backward();
  };
  AttentionRate r;
  r.seq = seq;
  r.q_heads = q_heads;
  r.kv_heads = kv_heads;
  r.head_dim = head_dim;
  r.repeats = repeats;
  // The forward first: the backward reads its O and LSE (the same bits every repeat).
  r.forward_seconds = time_median(stream.s, forward, repeats);
  r.backward_seconds = time_median(stream.s, backward, repeats);
  r.seconds = time_median(stream.s, forward_backward, repeats);
  const double s = static_cast<double>(seq);
  const double causal_forward = 2.0 * s * s * q_heads * head_dim;  // QK^T and PV, 2 FLOP each, half the square
  r.flops_per_s = 3.5 * causal_forward / r.seconds;
  r.forward_flops_per_s = causal_forward / r.forward_seconds;
  r.backward_flops_per_s = 2.5 * causal_forward / r.backward_seconds;
  return r;
}

GatedDeltaRate measure_gated_delta(int device, std::int64_t tokens, int k_heads, int v_heads, int head_dim, int repeats,
                                   std::int64_t sequences) {
  if (tokens < 1 || sequences < 1 || k_heads < 1 || v_heads < 1 || v_heads % k_heads != 0 || head_dim < 1 || repeats < 1)
    OOM_THROW(Errc::invalid_argument, "measure_gated_delta: bad shape (v_heads must be a multiple of k_heads)");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  kernels::GatedDeltaDims d;
  d.sequences = sequences;
  d.seq_len = tokens;
  d.k_heads = k_heads;
  d.v_heads = v_heads;
  d.k_dim = d.v_dim = head_dim;
  Stream stream;
  const std::int64_t rows = sequences * tokens;
  const std::int64_t qk = rows * k_heads * head_dim, vv = rows * v_heads * head_dim, gates = rows * v_heads;
  DeviceBuffer<__nv_bfloat16> q(qk), k(qk), v(vv), out(vv), dout(vv), dq(qk), dk(qk), dv(vv);
  DeviceBuffer<float> g(gates), beta(gates), dg(gates), dbeta(gates), states(kernels::gated_delta_states_floats(d));
  const std::size_t ws_bytes = kernels::gated_delta_backward_workspace_bytes(d);
  DeviceBuffer<unsigned char> ws(std::max<std::size_t>(ws_bytes, 1));
  launch_fill(q.ptr, q.count, 7, stream.s);
  launch_fill(k.ptr, k.count, 8, stream.s);
  launch_fill(v.ptr, v.count, 9, stream.s);
  launch_fill(dout.ptr, dout.count, 10, stream.s);
  fill_float<<<1024, 256, 0, stream.s>>>(g.ptr, g.count, -0.05f);  // a decay of 0.95 a token
  OOM_CUDA_CHECK_LAUNCH();
  fill_float<<<1024, 256, 0, stream.s>>>(beta.ptr, beta.count, 0.5f);
  OOM_CUDA_CHECK_LAUNCH();
  auto b = [](const __nv_bfloat16* p) { return reinterpret_cast<const bf16*>(p); };
  auto forward = [&] {
    OOM_CUDA_CHECK(kernels::gated_delta_forward(d, b(q.ptr), b(k.ptr), b(v.ptr), g.ptr, beta.ptr, reinterpret_cast<bf16*>(out.ptr),
                                                states.ptr, stream.s));
  };
  auto backward = [&] {
    OOM_CUDA_CHECK(kernels::gated_delta_backward(d, b(q.ptr), b(k.ptr), b(v.ptr), g.ptr, beta.ptr, b(dout.ptr), states.ptr,
                                                 reinterpret_cast<bf16*>(dq.ptr), reinterpret_cast<bf16*>(dk.ptr),
                                                 reinterpret_cast<bf16*>(dv.ptr), dg.ptr, dbeta.ptr, ws.ptr, ws_bytes, stream.s));
  };
  GatedDeltaRate r;
  r.tokens = tokens;
  r.sequences = sequences;
  r.k_heads = k_heads;
  r.v_heads = v_heads;
  r.head_dim = head_dim;
  r.repeats = repeats;
  r.forward_seconds = time_median(stream.s, forward, repeats);  // first: the backward reads its states
  r.backward_seconds = time_median(stream.s, backward, repeats);
  // Finite outputs and gradients: the timed launches did the work (their values are checked
  // against the reference in test_gated_delta_kernels).
  r.verified = true;
  for (const DeviceBuffer<__nv_bfloat16>* b : {&out, &dq, &dk, &dv}) {
    std::vector<__nv_bfloat16> host(b->count);
    OOM_CUDA_CHECK(cudaMemcpy(host.data(), b->ptr, b->count * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    for (const auto& x : host) r.verified = r.verified && std::isfinite(__bfloat162float(x));
  }
  const double updates = static_cast<double>(rows) * v_heads * head_dim * head_dim;
  r.forward_updates_per_s = updates / r.forward_seconds;
  r.backward_updates_per_s = updates / r.backward_seconds;
  return r;
}

LaunchOverhead measure_launch_overhead(int device, int launches, int repeats) {
  if (launches < 1 || repeats < 1) OOM_THROW(Errc::invalid_argument, "measure_launch_overhead needs launches and repeats");
  OOM_CUDA_CHECK(cudaSetDevice(device));
  Stream stream;
  PinnedBuffer<unsigned char> host(4096);
  DeviceBuffer<unsigned char> dev(4096);
  std::memset(host.ptr, 1, 4096);
  Event a, b;
  auto per_op = [&](const std::function<void()>& op) {
    for (int i = 0; i < launches; ++i) op();  // warm-up
    OOM_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
      OOM_CUDA_CHECK(cudaEventRecord(a.e, stream.s));
      for (int i = 0; i < launches; ++i) op();
      OOM_CUDA_CHECK(cudaEventRecord(b.e, stream.s));
      OOM_CUDA_CHECK(cudaEventSynchronize(b.e));
      t.push_back(elapsed_s(a, b) / launches);
    }
    return median(t);
  };
  LaunchOverhead r;
  r.launches = launches;
  r.kernel_s = per_op([&] {
    empty_kernel<<<1, 32, 0, stream.s>>>();
    OOM_CUDA_CHECK_LAUNCH();
  });
  r.small_copy_s = per_op([&] { OOM_CUDA_CHECK(cudaMemcpyAsync(dev.ptr, host.ptr, 4096, cudaMemcpyHostToDevice, stream.s)); });
  return r;
}

HostLinkTotal measure_host_link_total(int gpus, Bytes size, int repeats) {
  if (gpus < 1 || size.count() == 0 || repeats < 1) OOM_THROW(Errc::invalid_argument, "measure_host_link_total: bad arguments");
  const std::size_t n = size.count();
  struct Rig {
    int device;
    PinnedBuffer<unsigned char> up_host, down_host;
    DeviceBuffer<unsigned char> up_dev, down_dev;
    Stream up, down;
    Event start, stop_up, stop_down;
  };
  std::vector<Rig> rigs;
  rigs.reserve(gpus);
  for (int d = 0; d < gpus; ++d) {
    OOM_CUDA_CHECK(cudaSetDevice(d));
    rigs.push_back(Rig{d, PinnedBuffer<unsigned char>(n), PinnedBuffer<unsigned char>(n), DeviceBuffer<unsigned char>(n),
                       DeviceBuffer<unsigned char>(n), Stream(), Stream(), Event(), Event(), Event()});
    std::memset(rigs.back().up_host.ptr, 1, n);
  }
  auto round = [&](int copies) {
    for (auto& r : rigs) {
      OOM_CUDA_CHECK(cudaSetDevice(r.device));
      OOM_CUDA_CHECK(cudaEventRecord(r.start.e, r.up.s));
      OOM_CUDA_CHECK(cudaStreamWaitEvent(r.down.s, r.start.e));
    }
    for (int i = 0; i < copies; ++i)
      for (auto& r : rigs) {
        OOM_CUDA_CHECK(cudaSetDevice(r.device));
        OOM_CUDA_CHECK(cudaMemcpyAsync(r.up_dev.ptr, r.up_host.ptr, n, cudaMemcpyHostToDevice, r.up.s));
        OOM_CUDA_CHECK(cudaMemcpyAsync(r.down_host.ptr, r.down_dev.ptr, n, cudaMemcpyDeviceToHost, r.down.s));
      }
    double longest = 0;
    for (auto& r : rigs) {
      OOM_CUDA_CHECK(cudaSetDevice(r.device));
      OOM_CUDA_CHECK(cudaEventRecord(r.stop_up.e, r.up.s));
      OOM_CUDA_CHECK(cudaEventRecord(r.stop_down.e, r.down.s));
      OOM_CUDA_CHECK(cudaEventSynchronize(r.stop_up.e));
      OOM_CUDA_CHECK(cudaEventSynchronize(r.stop_down.e));
      longest = std::max({longest, static_cast<double>(elapsed_s(r.start, r.stop_up)),
                          static_cast<double>(elapsed_s(r.start, r.stop_down))});
    }
    // The GPUs' clocks of "start" differ by the host's issue time of the first copies, a few
    // microseconds against the ~100 ms measured.
    return 2.0 * gpus * copies * static_cast<double>(n) / longest;
  };
  (void)round(1);  // warm-up
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) rates.push_back(round(4));
  HostLinkTotal out;
  out.bytes_per_s = median(rates);
  out.gpus = gpus;
  out.size = size;
  out.repeats = repeats;
  return out;
}

CollectiveRates measure_collectives(int gpus, Bytes size, int repeats) {
  if (gpus < 2) OOM_THROW(Errc::invalid_argument, "measure_collectives needs at least 2 GPUs");
  if (repeats < 1 || size.count() < static_cast<std::uint64_t>(gpus) * 4 * 64)
    OOM_THROW(Errc::invalid_argument, "measure_collectives: size too small or no repeats");
  // Never NVLink multicast (NVLS): on shared machines it can take the host's GPUs out of service.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  const std::size_t chunk = size.count() / gpus / 64 * 64;  // all-to-all: per peer, aligned
  const std::size_t bytes = chunk * gpus;                   // per GPU, all collectives
  const std::size_t floats = bytes / sizeof(float);
  std::vector<int> devs(gpus);
  for (int i = 0; i < gpus; ++i) devs[i] = i;
  std::vector<ncclComm_t> comms(gpus, nullptr);
  OOM_NCCL_CHECK(ncclCommInitAll(comms.data(), gpus, devs.data()));
  struct CommsGuard {
    std::vector<ncclComm_t>& c;
    ~CommsGuard() { for (auto x : c) if (x) ncclCommDestroy(x); }
  } guard{comms};

  struct Rank {
    DeviceBuffer<float> send, recv;
    Stream stream;
    Event start, stop;
  };
  std::vector<Rank> ranks;
  ranks.reserve(gpus);
  for (int r = 0; r < gpus; ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    ranks.push_back(Rank{DeviceBuffer<float>(floats), DeviceBuffer<float>(floats), Stream(), Event(), Event()});
  }

  auto timed = [&](const std::function<void(int)>& enqueue) {
    std::vector<double> t;
    for (int rep = -1; rep < repeats; ++rep) {  // rep -1: warm-up (connection setup)
      for (int r = 0; r < gpus; ++r) {
        OOM_CUDA_CHECK(cudaSetDevice(r));
        OOM_CUDA_CHECK(cudaEventRecord(ranks[r].start.e, ranks[r].stream.s));
      }
      OOM_NCCL_CHECK(ncclGroupStart());
      for (int r = 0; r < gpus; ++r) enqueue(r);
      OOM_NCCL_CHECK(ncclGroupEnd());
      double longest = 0;
      for (int r = 0; r < gpus; ++r) {
        OOM_CUDA_CHECK(cudaSetDevice(r));
        OOM_CUDA_CHECK(cudaEventRecord(ranks[r].stop.e, ranks[r].stream.s));
        OOM_CUDA_CHECK(cudaEventSynchronize(ranks[r].stop.e));
        longest = std::max(longest, static_cast<double>(elapsed_s(ranks[r].start, ranks[r].stop)));
      }
      if (rep >= 0) t.push_back(longest);
    }
    return median(t);
  };

  CollectiveRates out;
  out.gpus = gpus;
  out.size = Bytes{bytes};
  out.repeats = repeats;
  bool ok = true;

  // All-reduce: rank r contributes r + 1 everywhere; every element must come back as n(n+1)/2.
  for (int r = 0; r < gpus; ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    fill_float<<<1024, 256, 0, ranks[r].stream.s>>>(ranks[r].send.ptr, floats, static_cast<float>(r + 1));
    OOM_CUDA_CHECK_LAUNCH();
  }
  const double t_ar = timed([&](int r) {
    OOM_NCCL_CHECK(ncclAllReduce(ranks[r].send.ptr, ranks[r].recv.ptr, floats, ncclFloat, ncclSum, comms[r], ranks[r].stream.s));
  });
  out.all_reduce_bus_bytes_per_s = static_cast<double>(bytes) / t_ar * 2.0 * (gpus - 1) / gpus;
  const float expect = static_cast<float>(gpus * (gpus + 1) / 2);
  for (int r = 0; r < gpus; ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    float first = 0, last = 0;
    OOM_CUDA_CHECK(cudaMemcpy(&first, ranks[r].recv.ptr, sizeof(float), cudaMemcpyDeviceToHost));
    OOM_CUDA_CHECK(cudaMemcpy(&last, ranks[r].recv.ptr + floats - 1, sizeof(float), cudaMemcpyDeviceToHost));
    ok = ok && first == expect && last == expect;
  }

  // All-to-all: rank r's chunk for peer p holds the byte (r * 16 + p); p must receive it in slot r.
  for (int r = 0; r < gpus; ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    auto* send = reinterpret_cast<unsigned char*>(ranks[r].send.ptr);
    for (int p = 0; p < gpus; ++p)
      OOM_CUDA_CHECK(cudaMemsetAsync(send + p * chunk, (r * 16 + p) & 0xFF, chunk, ranks[r].stream.s));
  }
  const double t_a2a = timed([&](int r) {
    auto* send = reinterpret_cast<unsigned char*>(ranks[r].send.ptr);
    auto* recv = reinterpret_cast<unsigned char*>(ranks[r].recv.ptr);
    for (int p = 0; p < gpus; ++p) {
      OOM_NCCL_CHECK(ncclSend(send + p * chunk, chunk, ncclUint8, p, comms[r], ranks[r].stream.s));
      OOM_NCCL_CHECK(ncclRecv(recv + p * chunk, chunk, ncclUint8, p, comms[r], ranks[r].stream.s));
    }
  });
  // The chunk a rank keeps for itself does not leave it.
  out.all_to_all_bytes_per_s = static_cast<double>(chunk) * (gpus - 1) / t_a2a;
  for (int r = 0; r < gpus; ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    auto* recv = reinterpret_cast<unsigned char*>(ranks[r].recv.ptr);
    for (int p = 0; p < gpus; ++p) {
      unsigned char first = 0, last = 0;
      OOM_CUDA_CHECK(cudaMemcpy(&first, recv + p * chunk, 1, cudaMemcpyDeviceToHost));
      OOM_CUDA_CHECK(cudaMemcpy(&last, recv + (p + 1) * chunk - 1, 1, cudaMemcpyDeviceToHost));
      const unsigned char want = static_cast<unsigned char>((p * 16 + r) & 0xFF);
      ok = ok && first == want && last == want;
    }
  }
  out.verified = ok;
  return out;
}

}  // namespace oom::cuda
