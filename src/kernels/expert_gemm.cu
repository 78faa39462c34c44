// Expert GEMMs (per-expert loop, cuBLAS grouped batched, multi-stream loop, row-chunked batched)
// and the shared expert gate; see oom/kernels/expert_gemm.hpp.
#include "oom/kernels/expert_gemm.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstring>
#include <functional>
#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "batch_parts.hpp"
#include "device_balance.hpp"
#include "bucketed_gemm.cuh"
#include "hopper/grouped_rows.hpp"
#include "hopper/grouped_wgrad.hpp"
#include "moe_blas.cuh"
#include "refuse.hpp"

namespace oom::kernels {

namespace {
/// Pinned host memory mapped into the device's address space: the device reads or writes it with
/// ordinary loads and stores over PCIe, so small transfers need neither a copy engine (where they
/// would queue behind a large copy on another stream) nor the driver's pageable staging.
struct MappedHostBuffer {
  void* host = nullptr;
  void* device = nullptr;
  std::size_t bytes = 0;
  cudaEvent_t done = nullptr;  ///< after the last device access (pointer stages)
  bool pending = false;

  cudaError_t reserve(std::size_t want) {
    if (bytes >= want) return cudaSuccess;
    if (host != nullptr) {
      if (pending) OOM_KERNEL_TRY(cudaEventSynchronize(done));
      void* old = std::exchange(host, nullptr);  // forgotten first: a failed free is not retried by release()
      device = nullptr;
      bytes = 0;
      OOM_KERNEL_TRY(cudaFreeHost(old));
    }
    const std::size_t size = std::max<std::size_t>(want + want / 2, std::size_t{4} << 10);
    OOM_KERNEL_TRY(cudaHostAlloc(&host, size, cudaHostAllocMapped | cudaHostAllocPortable));
    OOM_KERNEL_TRY(cudaHostGetDevicePointer(&device, host, 0));
    bytes = size;
    return cudaSuccess;
  }
  void release() {
    if (host != nullptr) cudaFreeHost(host);
    if (done != nullptr) cudaEventDestroy(done);
  }
};
}  // namespace

struct ExpertGemmStreams::State {
  int device = -1;
  /// The device's SMs and dense bf16 tensor FLOPs per byte of memory traffic.
  detail::DeviceBalance balance;
  /// The grouped wgmma kernels' tile counters: [0] the dW launch beside the row GEMMs
  /// (overlap_weight_gradients), [1] the grouped row GEMMs (wgmma_rows).
  int* tile_counter = nullptr;
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> joins;
  std::vector<cublasHandle_t> handles;
  /// The per-expert counts on their way to the host.
  MappedHostBuffer counts;
  /// The batched GEMMs' pointer arrays on their way to the device, in a ring: a stage is refilled
  /// only after the copy kernel that read it last has run (its event).
  std::array<MappedHostBuffer, 8> stages;
  std::size_t next_stage = 0;
  /// ExpertGemmStreamsOptions::bucketed_algorithms: one per side stream (index streams.size():
  /// the caller's stream), each used by one stream at a time.
  std::vector<std::unique_ptr<detail::BucketedGemm>> bucketed;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {  // destructors report nothing; pending work on the streams completes first (CUDA semantics)
    if (tile_counter != nullptr) cudaFree(tile_counter);
    for (auto h : handles) cublasDestroy(h);
    for (auto e : joins) cudaEventDestroy(e);
    for (auto st : streams) cudaStreamDestroy(st);
    if (fork) cudaEventDestroy(fork);
    for (auto& b : stages) {
      if (b.pending) cudaEventSynchronize(b.done);
      b.release();
    }
    counts.release();
  }
};

ExpertGemmStreams::ExpertGemmStreams(ExpertGemmStreamsOptions options) : options_(options) {}
ExpertGemmStreams::~ExpertGemmStreams() = default;

cudaError_t ExpertGemmStreams::state(State** out) {
  int device = 0;
  OOM_KERNEL_TRY(cudaGetDevice(&device));
  if (state_) {
    if (state_->device != device) return cudaErrorInvalidDevice;
    *out = state_.get();
    return cudaSuccess;
  }
  if (options_.streams < 1 || options_.streams > 64)
    return detail::refuse("ExpertGemmStreams: options.streams = ", options_.streams, " (must be 1 .. 64)");
  auto st = std::make_unique<State>();  // frees what was created if a later step fails
  st->device = device;
  OOM_KERNEL_TRY(detail::query_device_balance(device, &st->balance));
  OOM_KERNEL_TRY(cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming));
  for (int i = 0; i < options_.streams; ++i) {
    // Non-blocking: ordering with the caller's stream comes from the fork/join events only, so a
    // caller on the legacy default stream does not serialise the side streams.
    cudaStream_t stream = nullptr;
    OOM_KERNEL_TRY(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, options_.priority));
    st->streams.push_back(stream);
    cudaEvent_t join = nullptr;
    OOM_KERNEL_TRY(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    st->joins.push_back(join);
    cublasHandle_t h = nullptr;
    OOM_KERNEL_TRY(detail::to_cuda_error(cublasCreate(&h)));
    st->handles.push_back(h);
    // Bound once: cublasSetStream would reset the workspace set per launch.
    OOM_KERNEL_TRY(detail::to_cuda_error(cublasSetStream(h, stream)));
  }
  if (options_.bucketed_algorithms)
    for (int i = 0; i <= options_.streams; ++i) st->bucketed.push_back(std::make_unique<detail::BucketedGemm>());
  OOM_KERNEL_TRY(cudaMalloc(&st->tile_counter, 2 * sizeof(int)));
  state_ = std::move(st);
  *out = state_.get();
  return cudaSuccess;
}

namespace {

using detail::align_up;

__global__ void copy_words_kernel(const std::uint64_t* __restrict__ src, std::uint64_t* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    dst[i] = src[i];
}

__global__ void copy_counts_kernel(const std::int32_t* __restrict__ src, std::int32_t* __restrict__ dst, std::int64_t n) {
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

thread_local std::vector<HostSpan>* host_span_sink = nullptr;  // record_host_spans

/// Appends [begin, now) to the recording thread's sink, if any, named by `what()` (built only then).
template <class F>
void record_host_span(std::chrono::steady_clock::time_point begin, F&& what) {
  if (host_span_sink != nullptr) host_span_sink->push_back({what(), begin, std::chrono::steady_clock::now()});
}

/// `bytes` (a multiple of 8, at most `capacity`) from the host's `src` to the device's `dst`, in
/// `stream`'s order: staged in a pinned mapped buffer of the ring and pulled by a kernel (no copy
/// engine, no pageable staging). `src` may be reused as soon as this returns. A stage is sized for
/// `capacity` (the launch's largest array) on first use, so it is not freed and pinned again
/// mid-step when a later chunk routes more rows (cudaFreeHost and cudaHostAlloc wait for the
/// device, the CPU AdamW's host function included).
cudaError_t stage_to_device(ExpertGemmStreams::State& st, cudaStream_t stream, const void* src, std::size_t bytes,
                            std::size_t capacity, void* dst) {
  MappedHostBuffer& b = st.stages[st.next_stage];
  st.next_stage = (st.next_stage + 1) % st.stages.size();
  if (b.done == nullptr) OOM_KERNEL_TRY(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  if (b.pending) OOM_KERNEL_TRY(cudaEventSynchronize(b.done));  // long done: a ring's length of launches ago
  b.pending = false;
  OOM_KERNEL_TRY(b.reserve(std::max(bytes, capacity)));
  std::memcpy(b.host, src, bytes);
  const std::size_t words = bytes / 8;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((words + 255) / 256, 132));
  copy_words_kernel<<<std::max(blocks, 1u), 256, 0, stream>>>(static_cast<const std::uint64_t*>(b.device),
                                                               static_cast<std::uint64_t*>(dst), words);
  OOM_KERNEL_TRY(cudaGetLastError());
  OOM_KERNEL_TRY(cudaEventRecord(b.done, stream));
  b.pending = true;
  return cudaSuccess;
}
using detail::block_sum;
using detail::to_cuda_error;

/// One row-major GEMM of one expert: C (m, n) = op(A) op(B) + beta C (see detail::gemm_rm).
struct Problem {
  bool trans_a, trans_b;
  std::int64_t m, n, k;
  const void* a;
  std::int64_t lda;
  const void* b;
  std::int64_t ldb;
  void* c;
  std::int64_t ldc;
  cudaDataType_t c_type;
  float beta;
};

cudaError_t gemm(cublasHandle_t blas, const Problem& p) {
  return detail::gemm_rm(blas, p.trans_a, p.trans_b, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.c, p.c_type, p.ldc, p.beta);
}

/// `p` on `blas`'s stream (`stream`): through the bucket's algorithm when `bucketed` is set, with
/// `workspace` (the handle's own, or none), else as gemm().
cudaError_t gemm(cublasHandle_t blas, cudaStream_t stream, detail::BucketedGemm* bucketed, const Problem& p, void* workspace,
                 std::size_t workspace_bytes) {
  if (bucketed == nullptr) return gemm(blas, p);
  return bucketed->run(blas, stream, p.trans_a, p.trans_b, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.c, p.c_type, p.ldc, p.beta,
                       workspace, workspace_bytes);
}

std::size_t pointer_array_bytes(std::int64_t experts) { return align_up(3 * static_cast<std::size_t>(experts) * sizeof(void*)); }

/// row_chunked: full chunks (<= rows / chunk), one remainder chunk per expert and one deep entry
/// per expert (<= 2 E), 3 pointers each.
std::size_t chunk_array_bytes(const ExpertGemmShape& s, std::int64_t chunk) {
  const auto entries = std::max<std::int64_t>(s.rows, 0) / std::max<std::int64_t>(chunk, 1) + 2 * s.experts;
  return align_up(3 * static_cast<std::size_t>(entries) * sizeof(void*));
}

std::size_t side_workspace_bytes(const ExpertGemmStreamsOptions& o) {
  return static_cast<std::size_t>(std::max(o.streams, 0)) * align_up(o.blas_workspace_bytes);
}

/// Per-expert loop on `stream`.
cudaError_t run_loop(cublasHandle_t blas, cudaStream_t stream, const std::vector<Problem>& ps) {
  if (ps.empty()) return cudaSuccess;
  OOM_KERNEL_TRY(to_cuda_error(cublasSetStream(blas, stream)));
  for (const auto& p : ps) OOM_KERNEL_TRY(gemm(blas, p));
  return cudaSuccess;
}

/// Grouped: one group of one problem per expert, all with the C type and beta of ps[0], in cuBLAS'
/// column-major terms (C^T = op(B)^T op(A)^T). `slot` picks a separate pointer-array region for
/// the second call of a launcher, so no copy overwrites arrays a queued GEMM still reads.
cudaError_t run_grouped(cublasHandle_t blas, cudaStream_t stream, const std::vector<Problem>& ps, void* workspace,
                        std::int64_t experts, int slot) {
  if (ps.empty()) return cudaSuccess;
  OOM_KERNEL_TRY(to_cuda_error(cublasSetStream(blas, stream)));
  const int g = static_cast<int>(ps.size());
  std::vector<cublasOperation_t> ta(g), tb(g);
  std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), size(g, 1);
  std::vector<float> alpha(g, 1.0f), betas(g, ps[0].beta);
  std::vector<const void*> ptrs(3 * static_cast<std::size_t>(g));
  for (int i = 0; i < g; ++i) {
    const auto& p = ps[i];
    ta[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    tb[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = static_cast<int>(p.n);
    n[i] = static_cast<int>(p.m);
    k[i] = static_cast<int>(p.k);
    lda[i] = static_cast<int>(p.ldb);
    ldb[i] = static_cast<int>(p.lda);
    ldc[i] = static_cast<int>(p.ldc);
    ptrs[i] = p.b;
    ptrs[g + i] = p.a;
    ptrs[2 * g + i] = p.c;
  }
  auto* arrays = reinterpret_cast<const void**>(static_cast<char*>(workspace) + slot * pointer_array_bytes(experts));
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `ptrs` may die after it.
  OOM_KERNEL_TRY(cudaMemcpyAsync(arrays, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
  return to_cuda_error(cublasGemmGroupedBatchedEx(
      blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), arrays, CUDA_R_16BF, lda.data(), arrays + g,
      CUDA_R_16BF, ldb.data(), betas.data(), const_cast<void* const*>(arrays + 2 * g), ps[0].c_type, ldc.data(), g, size.data(),
      CUBLAS_COMPUTE_32F));
}

std::size_t element_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

/// f(first, n) for the parts of a batch count (detail::for_each_batch_part), stopping at an error.
template <class F>
cudaError_t in_recurring_counts(std::size_t count, F&& f) {
  cudaError_t status = cudaSuccess;
  detail::for_each_batch_part(count, [&](std::size_t first, std::size_t n) {
    if (status == cudaSuccess) status = f(first, n);
  });
  return status;
}

/// Row-producing problems of one op (A not transposed, the same n, k, leading dimensions, C type
/// and beta = 0; only m, A, B and C differ) as batched GEMMs: with `deep`, the first
/// deep_row_depth() rows of every expert that has them in one cublasGemmBatchedEx of that many
/// rows per entry; the rest over `chunk`-row slices: every full chunk by cublasGemmBatchedEx (in
/// parts of recurring counts, for_each_batch_part), then each expert's last `chunk` rows the same
/// way (the remainder; rows it shares with the chunks or the deep rows before it are computed again
/// from the same inputs and overwritten in stream order, so no two writers race), then experts
/// with fewer rows alone.
cudaError_t run_row_chunked(ExpertGemmStreams::State& st, cublasHandle_t blas, cudaStream_t stream,
                            const std::vector<Problem>& ps, std::int64_t chunk, bool deep, void* arrays,
                            std::size_t array_bytes) {
  if (ps.empty()) return cudaSuccess;
  const auto began = std::chrono::steady_clock::now();
  OOM_KERNEL_TRY(to_cuda_error(cublasSetStream(blas, stream)));
  const Problem& p0 = ps[0];
  const std::size_t a_row = static_cast<std::size_t>(p0.lda) * sizeof(__nv_bfloat16);
  const std::size_t c_row = static_cast<std::size_t>(p0.ldc) * element_bytes(p0.c_type);
  std::int64_t depth = 0;
  if (deep) {
    std::vector<std::int64_t> ms;
    for (const auto& p : ps) ms.push_back(p.m);
    depth = detail::deep_row_depth(ms, chunk);
  }
  // (weights, rows, outputs) per entry: cuBLAS' A, B and C of C^T = op(B)^T A^T.
  std::vector<const void*> deep_w, deep_r, deep_c, full_w, full_r, full_c, rem_w, rem_r, rem_c;
  std::vector<const Problem*> alone;
  for (const auto& p : ps) {
    if (p.trans_a || p.beta != 0.0f)  // chunks must not share an output
      return detail::refuse("expert GEMMs: internal: a row-chunked GEMM with trans_a or beta != 0");
    if (p.m < chunk) {
      alone.push_back(&p);
      continue;
    }
    const auto* a = static_cast<const char*>(p.a);
    auto* c = static_cast<char*>(p.c);
    std::int64_t first = 0;  // the first row left to the chunks
    if (depth > 0 && p.m >= depth) {
      deep_w.push_back(p.b);
      deep_r.push_back(a);
      deep_c.push_back(c);
      first = depth;
    }
    for (std::int64_t r = first; r + chunk <= p.m; r += chunk) {
      full_w.push_back(p.b);
      full_r.push_back(a + r * a_row);
      full_c.push_back(c + r * c_row);
    }
    if ((p.m - first) % chunk != 0) {
      rem_w.push_back(p.b);
      rem_r.push_back(a + (p.m - chunk) * a_row);
      rem_c.push_back(c + (p.m - chunk) * c_row);
    }
  }
  std::vector<const void*> ptrs;
  for (const auto* v : {&full_w, &full_r, &full_c, &rem_w, &rem_r, &rem_c, &deep_w, &deep_r, &deep_c})
    ptrs.insert(ptrs.end(), v->begin(), v->end());
  if (ptrs.size() * sizeof(void*) > array_bytes)  // more rows than ExpertGemmShape::rows
    return detail::refuse("expert GEMMs (row_chunked): ", ptrs.size(), " row-chunk pointers exceed the workspace's ",
                          array_bytes / sizeof(void*), " (more rows than ExpertGemmShape::rows?)");
  auto* d = static_cast<const void**>(arrays);
  // Not a pageable cudaMemcpyAsync: see expert_counts_to_host (expert_gemm.hpp) for the stalls
  // that path cost the backward on the H200.
  if (!ptrs.empty()) OOM_KERNEL_TRY(stage_to_device(st, stream, ptrs.data(), ptrs.size() * sizeof(void*), array_bytes, d));
  const float alpha = 1.0f, beta = 0.0f;
  const auto call = [&](const void** w, const void** r, const void** c, std::size_t count, std::int64_t m) {
    if (count == 0) return cudaSuccess;
    return to_cuda_error(cublasGemmBatchedEx(blas, p0.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(p0.n),
                                             static_cast<int>(m), static_cast<int>(p0.k), &alpha, w, CUDA_R_16BF,
                                             static_cast<int>(p0.ldb), r, CUDA_R_16BF, static_cast<int>(p0.lda), &beta,
                                             const_cast<void* const*>(c), p0.c_type, static_cast<int>(p0.ldc),
                                             static_cast<int>(count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  const auto batched = [&](const void** w, const void** r, const void** c, std::size_t count, std::int64_t m) {
    return in_recurring_counts(count, [&](std::size_t first, std::size_t n) { return call(w + first, r + first, c + first, n, m); });
  };
  const std::size_t nf = full_w.size(), nr = rem_w.size(), nd = deep_w.size();
  const void** dd = d + 3 * (nf + nr);
  OOM_KERNEL_TRY(batched(dd, dd + nd, dd + 2 * nd, nd, depth));  // first: the remainders may overwrite its last rows
  OOM_KERNEL_TRY(batched(d, d + nf, d + 2 * nf, nf, chunk));
  OOM_KERNEL_TRY(batched(d + 3 * nf, d + 3 * nf + nr, d + 3 * nf + 2 * nr, nr, chunk));
  detail::BucketedGemm* bucketed = st.bucketed.empty() ? nullptr : st.bucketed.back().get();
  const std::uint64_t fallbacks = bucketed != nullptr ? bucketed->fallbacks() : 0;
  for (const auto* p : alone) OOM_KERNEL_TRY(gemm(blas, stream, bucketed, *p, nullptr, 0));  // the caller's handle: no workspace of ours
  record_host_span(began, [&] {
    const std::uint64_t ex = bucketed != nullptr ? bucketed->fallbacks() - fallbacks : alone.size();
    return "row GEMMs: " + (nd > 0 ? std::to_string(nd) + " experts' first " + std::to_string(depth) + " rows + " : std::string()) +
           std::to_string(nf) + " full chunks + " + std::to_string(nr) + " remainders batched, " +
           std::to_string(alone.size()) + " experts alone (" + std::to_string(ex) + " through cublasGemmEx)";
  });
  return cudaSuccess;
}

/// The depth of row_chunked's batched weight gradients (ExpertGemmStreamsOptions::
/// batched_weight_gradients): the largest power of two or 1.5 times one, at least two chunks,
/// that at least half of `ks` reach; 0 when there is none or fewer than two problems reach it.
std::int64_t batched_depth(std::vector<std::int64_t> ks, std::int64_t chunk) {
  if (ks.size() < 2) return 0;
  std::sort(ks.begin(), ks.end(), std::greater<>());
  const std::int64_t half = ks[(ks.size() - 1) / 2];  // at least half of ks are >= this
  if (half < 2 * chunk) return 0;
  const auto p = static_cast<std::int64_t>(std::bit_floor(static_cast<std::uint64_t>(half)));
  return p + p / 2 <= half ? p + p / 2 : p;
}

/// Weight-gradient problems of one op (A transposed, B not, fp32 C, one beta; the same m, n and
/// leading dimensions; k = the expert's rows): the first batched_depth() rows of every problem
/// that has them in cublasGemmBatchedEx calls on `stream`, in recurring counts; what is left (the
/// rows past the depth, and the problems that do not reach it) goes to *rest, to be issued after.
cudaError_t run_weights_batched(ExpertGemmStreams::State& st, cublasHandle_t blas, cudaStream_t stream,
                                const std::vector<Problem>& ps, std::int64_t chunk, void* arrays, std::size_t array_bytes,
                                std::vector<Problem>* rest) {
  *rest = ps;
  std::vector<std::int64_t> ks;
  for (const auto& p : ps) {
    if (!p.trans_a || p.trans_b || p.beta != ps[0].beta || p.c_type != CUDA_R_32F || p.m != ps[0].m || p.n != ps[0].n ||
        p.lda != ps[0].lda || p.ldb != ps[0].ldb || p.ldc != ps[0].ldc)
      return cudaSuccess;  // not of that form: all of them per problem
    ks.push_back(p.k);
  }
  const std::int64_t depth = batched_depth(ks, chunk);
  if (depth == 0) return cudaSuccess;
  const auto began = std::chrono::steady_clock::now();
  rest->clear();
  std::vector<const void*> cu_a, cu_b, cu_c;  // cuBLAS' A, B and C of C^T = B^T A (column-major)
  for (const auto& p : ps) {
    if (p.k < depth) {
      rest->push_back(p);
      continue;
    }
    cu_a.push_back(p.b);
    cu_b.push_back(p.a);
    cu_c.push_back(p.c);
    if (p.k > depth) {
      Problem r = p;
      r.a = static_cast<const __nv_bfloat16*>(p.a) + depth * p.lda;
      r.b = static_cast<const __nv_bfloat16*>(p.b) + depth * p.ldb;
      r.k = p.k - depth;
      r.beta = 1.0f;  // onto the batched call's result
      rest->push_back(r);
    }
  }
  const std::size_t n = cu_a.size();
  std::vector<const void*> ptrs(cu_a);
  ptrs.insert(ptrs.end(), cu_b.begin(), cu_b.end());
  ptrs.insert(ptrs.end(), cu_c.begin(), cu_c.end());
  if (ptrs.size() * sizeof(void*) > array_bytes)
    return detail::refuse("expert GEMMs (row_chunked): ", ptrs.size(), " weight-gradient pointers exceed the workspace's ",
                          array_bytes / sizeof(void*));
  auto* d = static_cast<const void**>(arrays);
  OOM_KERNEL_TRY(stage_to_device(st, stream, ptrs.data(), ptrs.size() * sizeof(void*), array_bytes, d));
  OOM_KERNEL_TRY(to_cuda_error(cublasSetStream(blas, stream)));
  const Problem& p0 = ps[0];
  const float alpha = 1.0f, beta = p0.beta;  // (the rest, after the depth, always adds: see rest below)
  OOM_KERNEL_TRY(in_recurring_counts(n, [&](std::size_t first, std::size_t count) {
    return to_cuda_error(cublasGemmBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(p0.n), static_cast<int>(p0.m),
                                             static_cast<int>(depth), &alpha, d + first, CUDA_R_16BF, static_cast<int>(p0.ldb),
                                             d + n + first, CUDA_R_16BF, static_cast<int>(p0.lda), &beta,
                                             const_cast<void* const*>(d + 2 * n + first), CUDA_R_32F, static_cast<int>(p0.ldc),
                                             static_cast<int>(count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }));
  record_host_span(began, [&] {
    return "weight GEMMs: " + std::to_string(n) + " experts' first " + std::to_string(depth) + " rows batched, " +
           std::to_string(rest->size()) + " GEMMs left";
  });
  return cudaSuccess;
}

/// Makes `stream` wait for what is queued on side stream i so far (its join event). Callers issue
/// it even after an error, so `stream` never runs ahead of what was launched.
cudaError_t join_side(ExpertGemmStreams::State& st, int i, cudaStream_t stream) {
  const cudaError_t e = cudaEventRecord(st.joins[i], st.streams[i]);
  return e == cudaSuccess ? cudaStreamWaitEvent(stream, st.joins[i], 0) : e;
}

/// Forks the side streams from `stream`, spreads `ps` over them (each to the least loaded by
/// FLOPs so far), runs `on_stream()` on `stream` meanwhile, and joins them back into `stream`.
/// The join is issued even after an error, so `stream` never runs ahead of what was launched.
template <class F>
cudaError_t run_spread(ExpertGemmStreams::State& st, const ExpertGemmStreamsOptions& o, cudaStream_t stream,
                       const std::vector<Problem>& ps, void* blas_workspace, F&& on_stream) {
  const int n = static_cast<int>(std::min<std::size_t>(st.streams.size(), ps.size()));
  if (n == 0) return on_stream();
  OOM_KERNEL_TRY(cudaEventRecord(st.fork, stream));
  cudaError_t status = cudaSuccess;
  int forked = 0;
  for (; forked < n && status == cudaSuccess; ++forked) {
    status = cudaStreamWaitEvent(st.streams[forked], st.fork, 0);
    if (status == cudaSuccess) {
      void* ws = o.blas_workspace_bytes == 0 ? nullptr : static_cast<char*>(blas_workspace) + forked * align_up(o.blas_workspace_bytes);
      status = to_cuda_error(cublasSetWorkspace(st.handles[forked], ws, o.blas_workspace_bytes));
    }
  }
  if (status == cudaSuccess) {
    std::vector<double> load(static_cast<std::size_t>(n), 0.0);
    for (const auto& p : ps) {
      const auto i = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[i] += static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
      void* ws = o.blas_workspace_bytes == 0 ? nullptr : static_cast<char*>(blas_workspace) + i * align_up(o.blas_workspace_bytes);
      detail::BucketedGemm* bucketed = st.bucketed.empty() ? nullptr : st.bucketed[i].get();
      if ((status = gemm(st.handles[i], st.streams[i], bucketed, p, ws, o.blas_workspace_bytes)) != cudaSuccess) break;
    }
  }
  if (status == cudaSuccess) status = on_stream();
  for (int i = 0; i < forked; ++i) {
    const cudaError_t w = join_side(st, i, stream);
    if (status == cudaSuccess) status = w;
  }
  return status;
}

/// How a launcher issues its GEMMs.
struct Launch {
  const char* op;  ///< for the host span: "gate_up", "down", ...
  const ExpertGemmShape& s;
  cublasHandle_t blas;
  cudaStream_t stream;
  ExpertGemmMethod method;
  void* workspace;
  ExpertGemmStreams* streams;
};

/// Runs the row-producing problems (bf16 out, beta 0) and the weight-gradient ones (fp32, beta 1;
/// may be empty) by the launch's method. The two sets write disjoint buffers, so the concurrent
/// methods overlap them.
#if OOM_HAS_SM90A_KERNELS
/// The weight-gradient problems (dW_e (+)= A_e^T B_e, fp32, beta 1 or 0 for all, one shape) as the grouped wgmma
/// kernel's; false when they are not all of that form and shape.
bool as_wgrad(const std::vector<Problem>& weights, hopper::WgradShape* shape, std::vector<hopper::WgradProblem>* out) {
  const Problem& f = weights.front();
  if (f.beta != 1.0f && f.beta != 0.0f) return false;
  *shape = {.m = f.m, .n = f.n, .lda = f.lda, .ldb = f.ldb, .ldc = f.ldc, .accumulate = f.beta != 0.0f};
  for (const Problem& p : weights) {
    if (!p.trans_a || p.trans_b || p.c_type != CUDA_R_32F || p.beta != f.beta || p.m != f.m || p.n != f.n || p.lda != f.lda ||
        p.ldb != f.ldb || p.ldc != f.ldc)
      return false;
    out->push_back({.a = static_cast<const bf16*>(p.a), .b = static_cast<const bf16*>(p.b), .c = static_cast<float*>(p.c), .rows = p.k});
  }
  return true;
}
#endif

#if OOM_HAS_SM90A_KERNELS
/// The row-producing problems as the grouped row kernel's (A and C one buffer each, every expert's
/// rows a whole number of rows past the first problem's; bf16 out, beta 0, one shape); false
/// when they are not all of that form.
bool as_rows(const std::vector<Problem>& ps, hopper::RowsShape* shape, const bf16** a, bf16** c,
             std::vector<hopper::RowsProblem>* out) {
  const Problem& f = ps.front();
  *shape = {.n = f.n, .k = f.k, .lda = f.lda, .ldb = f.ldb, .ldc = f.ldc, .b_k_by_n = !f.trans_b};
  *a = static_cast<const bf16*>(f.a);
  *c = static_cast<bf16*>(f.c);
  for (const Problem& p : ps) {
    if (p.trans_a || p.trans_b != f.trans_b || p.c_type != CUDA_R_16BF || p.beta != 0.0f || p.n != f.n || p.k != f.k ||
        p.lda != f.lda || p.ldb != f.ldb || p.ldc != f.ldc)
      return false;
    const std::ptrdiff_t da = static_cast<const bf16*>(p.a) - *a, dc = static_cast<bf16*>(p.c) - *c;
    if (da < 0 || da % f.lda != 0 || dc != da / f.lda * f.ldc) return false;
    out->push_back({.b = static_cast<const bf16*>(p.b), .first_row = da / f.lda, .rows = p.m});
  }
  return true;
}

/// detail::weight_gradient_intensity of the grouped kernel's problems.
double weight_gradient_intensity(const std::vector<hopper::WgradProblem>& problems, bool accumulate) {
  std::vector<std::int64_t> rows;
  rows.reserve(problems.size());
  for (const auto& q : problems) rows.push_back(q.rows);
  return detail::weight_gradient_intensity(rows, accumulate);
}
#endif

/// row_chunked's row-producing GEMMs on `stream`: one grouped wgmma launch where it applies
/// (ExpertGemmStreamsOptions::wgmma_rows), else the batched cuBLAS chunks of run_row_chunked.
cudaError_t run_rows(ExpertGemmStreams::State& st, const ExpertGemmStreamsOptions& o, cublasHandle_t blas, cudaStream_t stream,
                     const std::vector<Problem>& ps, void* arrays, std::size_t array_bytes) {
#if OOM_HAS_SM90A_KERNELS
  if (o.wgmma_rows && !ps.empty()) {
    const auto began = std::chrono::steady_clock::now();
    hopper::RowsShape shape;
    const bf16* a = nullptr;
    bf16* c = nullptr;
    std::vector<hopper::RowsProblem> problems;
    if (as_rows(ps, &shape, &a, &c, &problems) && hopper::grouped_rows_supported(shape, a, c, problems)) {
      const cudaError_t status =
          hopper::grouped_rows_wgmma(shape, a, c, problems, stream, st.tile_counter + 1, {.pairs = o.paired_rows});
      record_host_span(began, [&] {
        int pairs_fit = 0;  // (the launch ran unpaired where no pair fits; asked once per device)
        const bool paired = o.paired_rows && hopper::grouped_rows_pairs_fit(&pairs_fit) == cudaSuccess && pairs_fit > 0;
        return "row GEMMs: one grouped wgmma launch over " + std::to_string(problems.size()) + " experts" +
               (paired ? ", in 2-CTA pairs" : "");
      });
      return status;
    }
  }
#endif
  return run_row_chunked(st, blas, stream, ps, o.row_chunk, o.deep_rows, arrays, array_bytes);
}

cudaError_t issue_by_method(const Launch& l, const std::vector<Problem>& rows, const std::vector<Problem>& weights) {
  switch (l.method) {
    case ExpertGemmMethod::per_expert_loop:
      OOM_KERNEL_TRY(run_loop(l.blas, l.stream, rows));
      return run_loop(l.blas, l.stream, weights);
    case ExpertGemmMethod::grouped_batched:
      OOM_KERNEL_TRY(run_grouped(l.blas, l.stream, rows, l.workspace, l.s.experts, 0));
      return run_grouped(l.blas, l.stream, weights, l.workspace, l.s.experts, 1);
    case ExpertGemmMethod::multi_stream: {
      ExpertGemmStreams::State* st = nullptr;
      OOM_KERNEL_TRY(l.streams->state(&st));
      std::vector<Problem> all(rows);
      all.insert(all.end(), weights.begin(), weights.end());
      return run_spread(*st, l.streams->options(), l.stream, all, l.workspace, [] { return cudaSuccess; });
    }
    case ExpertGemmMethod::row_chunked: {
      ExpertGemmStreams::State* st = nullptr;
      OOM_KERNEL_TRY(l.streams->state(&st));
      const auto& o = l.streams->options();
      const std::size_t arrays = chunk_array_bytes(l.s, o.row_chunk), weight_arrays = pointer_array_bytes(l.s.experts);
#if OOM_HAS_SM90A_KERNELS
      if (o.wgmma_weight_gradients && !weights.empty()) {
        hopper::WgradShape shape;
        std::vector<hopper::WgradProblem> problems;
        if (as_wgrad(weights, &shape, &problems) && hopper::grouped_wgrad_supported(shape, problems)) {
          if (!o.overlap_weight_gradients) {
            OOM_KERNEL_TRY(run_rows(*st, o, l.blas, l.stream, rows, l.workspace, arrays));
            return hopper::grouped_wgrad_wgmma(shape, problems, l.stream);
          }
          // The row GEMMs on the caller's stream, the weight gradients beside them on the first
          // side stream, tiles handed out dynamically; joined back before returning.
          // Where dW is bound by memory (row_sm_share), the row GEMMs' grouped launch split: its
          // first blocks on the caller's stream beside dW, the rest of its grid queued after dW
          // on the side stream, one tile counter (zeroed here, before the fork) shared by both.
          hopper::RowsShape rshape;
          const bf16* ra = nullptr;
          bf16* rc = nullptr;
          std::vector<hopper::RowsProblem> rps;
          int first_blocks = 0;
          if (o.row_sm_share > 0 && o.row_sm_share < 1 && o.wgmma_rows && !rows.empty() &&
              weight_gradient_intensity(problems, shape.accumulate) < st->balance.flops_per_byte && as_rows(rows, &rshape, &ra, &rc, &rps) &&
              hopper::grouped_rows_supported(rshape, ra, rc, rps) && hopper::grouped_rows_one_launch(rshape, rps)) {
            first_blocks = std::max(1, static_cast<int>(o.row_sm_share * st->balance.sms));
            OOM_KERNEL_TRY(cudaMemsetAsync(st->tile_counter + 1, 0, sizeof(int), l.stream));
          }
          const cudaStream_t side = st->streams[0];
          OOM_KERNEL_TRY(cudaEventRecord(st->fork, l.stream));
          OOM_KERNEL_TRY(cudaStreamWaitEvent(side, st->fork, 0));
          const hopper::RowsGrid split{.max_blocks = first_blocks, .counter_zeroed = true};
          cudaError_t status = cudaSuccess;
          if (first_blocks > 0) {
            const auto began = std::chrono::steady_clock::now();
            status = hopper::grouped_rows_wgmma(rshape, ra, rc, rps, l.stream, st->tile_counter + 1, split);
            record_host_span(began, [&] {
              return "row GEMMs: one grouped wgmma launch over " + std::to_string(rps.size()) + " experts, its first " +
                     std::to_string(first_blocks) + " blocks beside the weight gradients";
            });
          } else {
            status = run_rows(*st, o, l.blas, l.stream, rows, l.workspace, arrays);
          }
          // dW is changed only when the call can succeed (as after the row GEMMs, below).
          if (status == cudaSuccess) status = hopper::grouped_wgrad_wgmma(shape, problems, side, st->tile_counter);
          if (status == cudaSuccess && first_blocks > 0)
            status = hopper::grouped_rows_wgmma(rshape, ra, rc, rps, side, st->tile_counter + 1, {.counter_zeroed = true});
          const cudaError_t w = join_side(*st, 0, l.stream);  // joined even after an error
          return status != cudaSuccess ? status : w;
        }
      }
#endif
      auto* ws = static_cast<char*>(l.workspace);
      std::vector<Problem> rest;
      if (o.batched_weight_gradients && !weights.empty())
        OOM_KERNEL_TRY(run_weights_batched(*st, l.blas, l.stream, weights, o.row_chunk, ws + arrays, weight_arrays, &rest));
      else
        rest = weights;
      return run_spread(*st, o, l.stream, rest, ws + arrays + weight_arrays,
                        [&] { return run_rows(*st, o, l.blas, l.stream, rows, l.workspace, arrays); });
    }
  }
  return detail::refuse("expert GEMMs: unknown ExpertGemmMethod ", static_cast<int>(l.method));
}

cudaError_t issue(const Launch& l, const std::vector<Problem>& rows, const std::vector<Problem>& weights) {
  const auto began = std::chrono::steady_clock::now();
  const cudaError_t status = issue_by_method(l, rows, weights);
  record_host_span(began, [&] {
    return std::string("issue expert ") + l.op + " GEMMs: " + std::to_string(rows.size()) + " row-producing, " +
           std::to_string(weights.size()) + " weight-gradient";
  });
  return status;
}

/// cudaSuccess when the expert launchers can take these arguments, else a refusal naming the first
/// that they cannot.
cudaError_t check_args(const char* name, const ExpertGemmShape& s, const std::int32_t* counts_host, ExpertGemmMethod method,
                       void* workspace, std::size_t workspace_bytes, const ExpertGemmStreams* streams) {
  if (s.hidden < 1 || s.hidden > INT_MAX) return detail::refuse(name, ": hidden = ", s.hidden, " (must be 1 .. 2^31 - 1)");
  if (s.intermediate < 1 || 2 * s.intermediate > INT_MAX)
    return detail::refuse(name, ": intermediate = ", s.intermediate, " (must be 1 .. 2^30 - 1)");
  if (s.experts < 1) return detail::refuse(name, ": experts = ", s.experts, " (must be >= 1)");
  if (counts_host == nullptr) return detail::refuse(name, ": counts_host is null");
  const bool side = method == ExpertGemmMethod::multi_stream || method == ExpertGemmMethod::row_chunked;
  if (side && streams == nullptr) return detail::refuse(name, ": this method needs an ExpertGemmStreams (streams is null)");
  if (side && (streams->options().streams < 1 || streams->options().streams > 64))  // state() refuses > 64 too
    return detail::refuse(name, ": streams->options().streams = ", streams->options().streams, " (must be 1 .. 64)");
  if (side && streams->options().row_chunk < 1)
    return detail::refuse(name, ": streams->options().row_chunk = ", streams->options().row_chunk, " (must be >= 1)");
  if (method != ExpertGemmMethod::per_expert_loop)
    if (const std::size_t need = expert_gemm_workspace_bytes(s, method, streams); workspace == nullptr || workspace_bytes < need)
      return detail::refuse_workspace(name, workspace, workspace_bytes, need, "expert_gemm_workspace_bytes");
  std::int64_t rows = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    if (counts_host[e] < 0) return detail::refuse(name, ": counts_host[", e, "] = ", counts_host[e], " (must be >= 0)");
    rows += counts_host[e];
  }
  if (method == ExpertGemmMethod::row_chunked && rows > s.rows)
    return detail::refuse(name, ": the counts add up to ", rows, " rows, more than ExpertGemmShape::rows = ", s.rows);
  if (rows > INT_MAX) return detail::refuse(name, ": the counts add up to ", rows, " rows (at most 2^31 - 1)");
  return cudaSuccess;
}

/// Calls f(e, first_row, rows) for each expert with rows.
template <class F>
void for_each_expert(const ExpertGemmShape& s, const std::int32_t* counts_host, F&& f) {
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < s.experts; ++e) {
    if (counts_host[e] > 0) f(e, r, static_cast<std::int64_t>(counts_host[e]));
    r += counts_host[e];
  }
}

// One block per token: z = x . w_gate (fp32), out = routed + sigmoid(z) y.
__global__ void shared_gate_forward_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate,
                                           const __nv_bfloat16* y, const __nv_bfloat16* routed, float* __restrict__ gate_logit,
                                           __nv_bfloat16* out, std::int64_t hidden) {
  __shared__ float scratch[32];
  const std::int64_t t = blockIdx.x;
  float z = 0.0f;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    z += __bfloat162float(x[t * hidden + i]) * __bfloat162float(w_gate[i]);
  z = block_sum(z, scratch);
  if (threadIdx.x == 0) gate_logit[t] = z;
  const float g = 1.0f / (1.0f + expf(-z));
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float base = routed ? __bfloat162float(routed[t * hidden + i]) : 0.0f;  // read before the in-place write
    out[t * hidden + i] = __float2bfloat16(base + g * __bfloat162float(y[t * hidden + i]));
  }
}

// One block per token: dy, ds and the dx contribution.
__global__ void shared_gate_backward_kernel(const __nv_bfloat16* __restrict__ w_gate, const __nv_bfloat16* __restrict__ y,
                                            const float* __restrict__ gate_logit, const __nv_bfloat16* __restrict__ d_out,
                                            __nv_bfloat16* __restrict__ dy, __nv_bfloat16* __restrict__ dx,
                                            float* __restrict__ ds_out, std::int64_t hidden) {
  __shared__ float scratch[32];
  const std::int64_t t = blockIdx.x;
  const float g = 1.0f / (1.0f + expf(-gate_logit[t]));
  float dot = 0.0f;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float d = __bfloat162float(d_out[t * hidden + i]);
    dy[t * hidden + i] = __float2bfloat16(g * d);
    dot += d * __bfloat162float(y[t * hidden + i]);
  }
  const float ds = block_sum(dot, scratch) * g * (1.0f - g);
  if (threadIdx.x == 0) ds_out[t] = ds;
  for (std::int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    dx[t * hidden + i] = __float2bfloat16(__bfloat162float(dx[t * hidden + i]) + ds * __bfloat162float(w_gate[i]));
}

constexpr int gate_chunks = 64;  // partial sums of dw_gate over token chunks, reduced in fixed order

__global__ void shared_gate_dw_partial_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ ds,
                                              float* __restrict__ partial, std::int64_t tokens, std::int64_t hidden) {
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  const std::int64_t per = (tokens + gate_chunks - 1) / gate_chunks;
  const std::int64_t t0 = blockIdx.y * per, t1 = std::min(tokens, t0 + per);
  float acc = 0.0f;
  for (std::int64_t t = t0; t < t1; ++t) acc += ds[t] * __bfloat162float(x[t * hidden + c]);
  partial[blockIdx.y * hidden + c] = acc;
}

__global__ void shared_gate_dw_final_kernel(const float* __restrict__ partial, float* __restrict__ dw_gate, std::int64_t hidden) {
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  float acc = 0.0f;
  for (int j = 0; j < gate_chunks; ++j) acc += partial[j * hidden + c];
  dw_gate[c] += acc;
}

}  // namespace

std::size_t expert_gemm_workspace_bytes(const ExpertGemmShape& s, ExpertGemmMethod method, const ExpertGemmStreams* streams) {
  switch (method) {
    case ExpertGemmMethod::per_expert_loop: return 0;
    case ExpertGemmMethod::grouped_batched: return 2 * pointer_array_bytes(s.experts);
    case ExpertGemmMethod::multi_stream: return streams ? side_workspace_bytes(streams->options()) : 0;
    case ExpertGemmMethod::row_chunked:
      return streams ? chunk_array_bytes(s, streams->options().row_chunk) + pointer_array_bytes(s.experts) +
                           side_workspace_bytes(streams->options())
                     : 0;
  }
  return 0;
}

namespace {

/// The host array {base, base + stride, ...} of E pointers, for the contiguous (E, ...) entry points.
template <class T>
std::vector<T*> strided(T* base, const ExpertGemmShape& s, std::int64_t stride) {
  std::vector<T*> out(static_cast<std::size_t>(std::max<std::int64_t>(s.experts, 0)));
  for (std::size_t e = 0; e < out.size(); ++e) out[e] = base + static_cast<std::int64_t>(e) * stride;
  return out;
}

/// The row arrays (name, pointer) of a launch, refused by name when one is null and some expert
/// has rows (with none, nothing is read or written).
cudaError_t check_rows(const char* name, const ExpertGemmShape& s, const std::int32_t* counts_host,
                       std::initializer_list<std::pair<const char*, const void*>> arrays) {
  for (std::int64_t e = 0; e < s.experts; ++e)
    if (counts_host[e] > 0) return detail::refuse_null(name, arrays);
  return cudaSuccess;
}

/// Every expert that receives rows has its matrix in `array` (called `what`), else a refusal naming
/// the first that has none.
template <class P>
cudaError_t check_pointers(const char* name, const char* what, const ExpertGemmShape& s, const std::int32_t* counts_host,
                           P array) {
  for (std::int64_t e = 0; e < s.experts; ++e)
    if (counts_host[e] > 0 && (array == nullptr || array[e] == nullptr))
      return array == nullptr ? detail::refuse(name, ": ", what, " is null")
                              : detail::refuse(name, ": ", what, "[", e, "] is null and expert ", e, " has ",
                                               counts_host[e], " rows");
  return cudaSuccess;
}

/// The gradients the launch writes are present: those of the experts with rows, and overwriting
/// every expert's (an expert without rows gets zeros; overwrite_routed leaves it alone).
cudaError_t check_grads(const char* name, const char* what, const ExpertGemmShape& s, const std::int32_t* counts_host,
                        float* const* dw, GradWrite write) {
  if (write == GradWrite::accumulate || write == GradWrite::overwrite_routed)
    return check_pointers(name, what, s, counts_host, dw);
  if (write != GradWrite::overwrite) return detail::refuse(name, ": unknown GradWrite ", static_cast<int>(write));
  if (dw == nullptr) return detail::refuse(name, ": ", what, " is null");
  for (std::int64_t e = 0; e < s.experts; ++e)
    if (dw[e] == nullptr)
      return detail::refuse(name, ": ", what, "[", e, "] is null, and GradWrite::overwrite writes every expert's");
  return cudaSuccess;
}

/// The weight-gradient GEMMs' beta for `write`.
constexpr float dw_beta(GradWrite write) { return write == GradWrite::accumulate ? 1.0f : 0.0f; }

/// Overwriting: the dW (`elements` floats each) of the experts without rows set to zero on `stream`,
/// before the launch's GEMMs (which write the others).
cudaError_t zero_idle_grads(const ExpertGemmShape& s, const std::int32_t* counts_host, float* const* dw, std::int64_t elements,
                            GradWrite write, cudaStream_t stream) {
  if (write != GradWrite::overwrite) return cudaSuccess;
  for (std::int64_t e = 0; e < s.experts; ++e)
    if (counts_host[e] == 0) OOM_KERNEL_TRY(cudaMemsetAsync(dw[e], 0, static_cast<std::size_t>(elements) * sizeof(float), stream));
  return cudaSuccess;
}

}  // namespace

cudaError_t expert_gate_up_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                   const std::int32_t* counts_host, const bf16* x_perm, const bf16* const* w_gate_up,
                                   bf16* gate_up, ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                   ExpertGemmStreams* streams) {
  OOM_KERNEL_TRY(check_args("expert_gate_up_forward", s, counts_host, method, workspace, workspace_bytes, streams));
  OOM_KERNEL_TRY(check_pointers("expert_gate_up_forward", "w_gate_up", s, counts_host, w_gate_up));
  OOM_KERNEL_TRY(check_rows("expert_gate_up_forward", s, counts_host, {{"x_perm", x_perm}, {"gate_up", gate_up}}));
  const auto H = s.hidden, I2 = 2 * s.intermediate;
  std::vector<Problem> ps;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    ps.push_back({false, true, rows, I2, H, x_perm + r * H, H, w_gate_up[e], H, gate_up + r * I2, I2, CUDA_R_16BF, 0.0f});
  });
  return issue({"gate_up", s, blas, stream, method, workspace, streams}, ps, {});
}

cudaError_t expert_gate_up_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                   const std::int32_t* counts_host, const bf16* x_perm, const bf16* w_gate_up, bf16* gate_up,
                                   ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                   ExpertGemmStreams* streams) {
  if (w_gate_up == nullptr) return detail::refuse("expert_gate_up_forward: w_gate_up is null");
  const auto w = strided(w_gate_up, s, 2 * s.intermediate * s.hidden);
  return expert_gate_up_forward(blas, stream, s, counts_host, x_perm, w.data(), gate_up, method, workspace, workspace_bytes,
                                streams);
}

cudaError_t expert_down_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                const std::int32_t* counts_host, const bf16* h, const bf16* const* w_down, bf16* y,
                                ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                ExpertGemmStreams* streams) {
  OOM_KERNEL_TRY(check_args("expert_down_forward", s, counts_host, method, workspace, workspace_bytes, streams));
  OOM_KERNEL_TRY(check_pointers("expert_down_forward", "w_down", s, counts_host, w_down));
  OOM_KERNEL_TRY(check_rows("expert_down_forward", s, counts_host, {{"h", h}, {"y", y}}));
  const auto H = s.hidden, I = s.intermediate;
  std::vector<Problem> ps;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    ps.push_back({false, true, rows, H, I, h + r * I, I, w_down[e], I, y + r * H, H, CUDA_R_16BF, 0.0f});
  });
  return issue({"down", s, blas, stream, method, workspace, streams}, ps, {});
}

cudaError_t expert_down_forward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                const std::int32_t* counts_host, const bf16* h, const bf16* w_down, bf16* y,
                                ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                ExpertGemmStreams* streams) {
  if (w_down == nullptr) return detail::refuse("expert_down_forward: w_down is null");
  const auto w = strided(w_down, s, s.hidden * s.intermediate);
  return expert_down_forward(blas, stream, s, counts_host, h, w.data(), y, method, workspace, workspace_bytes, streams);
}

cudaError_t expert_down_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                 const std::int32_t* counts_host, const bf16* dy, const bf16* h, const bf16* const* w_down,
                                 bf16* dh, float* const* dw_down, ExpertGemmMethod method, void* workspace,
                                 std::size_t workspace_bytes, ExpertGemmStreams* streams, GradWrite dw_write) {
  OOM_KERNEL_TRY(check_args("expert_down_backward", s, counts_host, method, workspace, workspace_bytes, streams));
  OOM_KERNEL_TRY(check_pointers("expert_down_backward", "w_down", s, counts_host, w_down));
  OOM_KERNEL_TRY(check_grads("expert_down_backward", "dw_down", s, counts_host, dw_down, dw_write));
  OOM_KERNEL_TRY(check_rows("expert_down_backward", s, counts_host, {{"dy", dy}, {"h", h}, {"dh", dh}}));
  const auto H = s.hidden, I = s.intermediate;
  const float beta = dw_beta(dw_write);
  std::vector<Problem> data, weight;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    // dh (rows, I) = dy (rows, H) . w_down[e] (H, I)
    data.push_back({false, false, rows, I, H, dy + r * H, H, w_down[e], I, dh + r * I, I, CUDA_R_16BF, 0.0f});
    // dw_down[e] (H, I) (+)= dy^T (H, rows) . h (rows, I)
    weight.push_back({true, false, H, I, rows, dy + r * H, H, h + r * I, I, dw_down[e], I, CUDA_R_32F, beta});
  });
  OOM_KERNEL_TRY(zero_idle_grads(s, counts_host, dw_down, H * I, dw_write, stream));
  return issue({"down backward", s, blas, stream, method, workspace, streams}, data, weight);
}

cudaError_t expert_down_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                 const std::int32_t* counts_host, const bf16* dy, const bf16* h, const bf16* w_down, bf16* dh,
                                 float* dw_down, ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                 ExpertGemmStreams* streams, GradWrite dw_write) {
  OOM_KERNEL_TRY(detail::refuse_null("expert_down_backward", {{"w_down", w_down}, {"dw_down", dw_down}}));
  const auto w = strided(w_down, s, s.hidden * s.intermediate);
  const auto dw = strided(dw_down, s, s.hidden * s.intermediate);
  return expert_down_backward(blas, stream, s, counts_host, dy, h, w.data(), dh, dw.data(), method, workspace, workspace_bytes,
                              streams, dw_write);
}

cudaError_t expert_gate_up_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                    const std::int32_t* counts_host, const bf16* d_gate_up, const bf16* x_perm,
                                    const bf16* const* w_gate_up, bf16* dx_perm, float* const* dw_gate_up,
                                    ExpertGemmMethod method, void* workspace, std::size_t workspace_bytes,
                                    ExpertGemmStreams* streams, GradWrite dw_write) {
  OOM_KERNEL_TRY(check_args("expert_gate_up_backward", s, counts_host, method, workspace, workspace_bytes, streams));
  OOM_KERNEL_TRY(check_pointers("expert_gate_up_backward", "w_gate_up", s, counts_host, w_gate_up));
  OOM_KERNEL_TRY(check_grads("expert_gate_up_backward", "dw_gate_up", s, counts_host, dw_gate_up, dw_write));
  OOM_KERNEL_TRY(check_rows("expert_gate_up_backward", s, counts_host,
                            {{"d_gate_up", d_gate_up}, {"x_perm", x_perm}, {"dx_perm", dx_perm}}));
  const auto H = s.hidden, I2 = 2 * s.intermediate;
  const float beta = dw_beta(dw_write);
  std::vector<Problem> data, weight;
  for_each_expert(s, counts_host, [&](std::int64_t e, std::int64_t r, std::int64_t rows) {
    // dx (rows, H) = d_gate_up (rows, 2I) . w_gate_up[e] (2I, H)
    data.push_back({false, false, rows, H, I2, d_gate_up + r * I2, I2, w_gate_up[e], H, dx_perm + r * H, H, CUDA_R_16BF, 0.0f});
    // dw_gate_up[e] (2I, H) (+)= d_gate_up^T (2I, rows) . x_perm (rows, H)
    weight.push_back({true, false, I2, H, rows, d_gate_up + r * I2, I2, x_perm + r * H, H, dw_gate_up[e], H, CUDA_R_32F, beta});
  });
  OOM_KERNEL_TRY(zero_idle_grads(s, counts_host, dw_gate_up, I2 * H, dw_write, stream));
  return issue({"gate_up backward", s, blas, stream, method, workspace, streams}, data, weight);
}

cudaError_t expert_gate_up_backward(cublasHandle_t blas, cudaStream_t stream, const ExpertGemmShape& s,
                                    const std::int32_t* counts_host, const bf16* d_gate_up, const bf16* x_perm,
                                    const bf16* w_gate_up, bf16* dx_perm, float* dw_gate_up, ExpertGemmMethod method,
                                    void* workspace, std::size_t workspace_bytes, ExpertGemmStreams* streams,
                                    GradWrite dw_write) {
  OOM_KERNEL_TRY(detail::refuse_null("expert_gate_up_backward", {{"w_gate_up", w_gate_up}, {"dw_gate_up", dw_gate_up}}));
  const auto w = strided(w_gate_up, s, 2 * s.intermediate * s.hidden);
  const auto dw = strided(dw_gate_up, s, 2 * s.intermediate * s.hidden);
  return expert_gate_up_backward(blas, stream, s, counts_host, d_gate_up, x_perm, w.data(), dx_perm, dw.data(), method,
                                 workspace, workspace_bytes, streams, dw_write);
}

cudaError_t shared_expert_gate_forward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden, const bf16* x,
                                       const bf16* w_gate, const bf16* y, const bf16* routed, float* gate_logit, bf16* out) {
  if (tokens < 0 || tokens > INT_MAX)
    return detail::refuse("shared_expert_gate_forward: tokens = ", tokens, " (must be 0 .. 2^31 - 1)");
  if (hidden < 1) return detail::refuse("shared_expert_gate_forward: hidden = ", hidden, " (must be >= 1)");
  if (tokens == 0) return cudaSuccess;
  // routed may be null
  OOM_KERNEL_TRY(detail::refuse_null("shared_expert_gate_forward",
                                     {{"x", x}, {"w_gate", w_gate}, {"y", y}, {"gate_logit", gate_logit}, {"out", out}}));
  shared_gate_forward_kernel<<<static_cast<unsigned>(tokens), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<const __nv_bfloat16*>(w_gate),
      reinterpret_cast<const __nv_bfloat16*>(y), reinterpret_cast<const __nv_bfloat16*>(routed), gate_logit,
      reinterpret_cast<__nv_bfloat16*>(out), hidden);
  return cudaGetLastError();
}

std::size_t shared_expert_gate_backward_workspace_bytes(std::int64_t tokens, std::int64_t hidden) {
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(tokens, 0)) * sizeof(float)) +
         align_up(static_cast<std::size_t>(gate_chunks * std::max<std::int64_t>(hidden, 0)) * sizeof(float));
}

cudaError_t shared_expert_gate_backward(cudaStream_t stream, std::int64_t tokens, std::int64_t hidden, const bf16* x,
                                        const bf16* w_gate, const bf16* y, const float* gate_logit, const bf16* d_out,
                                        bf16* dy, bf16* dx, float* dw_gate, void* workspace, std::size_t workspace_bytes) {
  if (tokens < 0 || tokens > INT_MAX)
    return detail::refuse("shared_expert_gate_backward: tokens = ", tokens, " (must be 0 .. 2^31 - 1)");
  if (hidden < 1) return detail::refuse("shared_expert_gate_backward: hidden = ", hidden, " (must be >= 1)");
  if (const std::size_t need = shared_expert_gate_backward_workspace_bytes(tokens, hidden); workspace_bytes < need)
    return detail::refuse_workspace("shared_expert_gate_backward", workspace, workspace_bytes, need,
                                    "shared_expert_gate_backward_workspace_bytes(", tokens, ", ", hidden, ")");
  if (tokens == 0) return cudaSuccess;
  OOM_KERNEL_TRY(detail::refuse_null("shared_expert_gate_backward",
                                     {{"x", x}, {"w_gate", w_gate}, {"y", y}, {"gate_logit", gate_logit}, {"d_out", d_out},
                                      {"dy", dy}, {"dx", dx}, {"dw_gate", dw_gate}, {"workspace", workspace}}));
  auto* ds = static_cast<float*>(workspace);
  auto* partial = reinterpret_cast<float*>(static_cast<char*>(workspace) + align_up(tokens * sizeof(float)));
  shared_gate_backward_kernel<<<static_cast<unsigned>(tokens), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(w_gate), reinterpret_cast<const __nv_bfloat16*>(y), gate_logit,
      reinterpret_cast<const __nv_bfloat16*>(d_out), reinterpret_cast<__nv_bfloat16*>(dy), reinterpret_cast<__nv_bfloat16*>(dx),
      ds, hidden);
  OOM_KERNEL_TRY(cudaGetLastError());
  const unsigned col_blocks = static_cast<unsigned>((hidden + 255) / 256);
  shared_gate_dw_partial_kernel<<<dim3(col_blocks, gate_chunks), 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(x), ds,
                                                                                   partial, tokens, hidden);
  shared_gate_dw_final_kernel<<<col_blocks, 256, 0, stream>>>(partial, dw_gate, hidden);
  return cudaGetLastError();
}

void record_host_spans(std::vector<HostSpan>* sink) noexcept { host_span_sink = sink; }

cudaError_t expert_counts_to_host(cudaStream_t stream, const std::int32_t* counts, std::int64_t experts,
                                  ExpertGemmStreams& streams, std::int32_t* out) {
  OOM_KERNEL_TRY(detail::refuse_null("expert_counts_to_host", {{"counts", counts}, {"out", out}}));
  if (experts < 1) return detail::refuse("expert_counts_to_host: experts = ", experts, " (must be >= 1)");
  ExpertGemmStreams::State* st = nullptr;
  OOM_KERNEL_TRY(streams.state(&st));
  const std::size_t bytes = static_cast<std::size_t>(experts) * sizeof(std::int32_t);
  OOM_KERNEL_TRY(st->counts.reserve(bytes));  // the previous read-back was synchronized: free to refill
  copy_counts_kernel<<<1, 256, 0, stream>>>(counts, static_cast<std::int32_t*>(st->counts.device), experts);
  OOM_KERNEL_TRY(cudaGetLastError());
  const auto waited = std::chrono::steady_clock::now();
  OOM_KERNEL_TRY(cudaStreamSynchronize(stream));
  if (host_span_sink != nullptr) host_span_sink->push_back({"wait for expert counts", waited, std::chrono::steady_clock::now()});
  std::memcpy(out, st->counts.host, bytes);
  return cudaSuccess;
}

}  // namespace oom::kernels
