// RMSNorm backward in one launch (clusters of K blocks adding their partials through distributed
// shared memory, the last cluster to count itself on a zeroed ticket summing into grad_w) against
// the product's two launches, at the bandwidth report's shapes, in place (dx = dy), each timed
// over 20 back-to-back calls as a ratio to a 1 GiB device-to-device copy in the same run; with the
// most clusters of K blocks the device holds at once (cudaOccupancyMaxActiveClusters) against the
// grid's clusters.
//
// Measured (H200, 2026-12-02) and not kept: slower everywhere. 4096 x 2048: 26.9-29.0 us at
// K = 8 / 4 / 2 against 16.9 us for the two launches (the one-pass kernel alone 14.5). At K = 8 only
// 30 of the 32 clusters fit at once (a second wave); at K = 2 they fit, but two blocks summing 128
// runs of partials take ~12 us; 65536-row grids lost 12-18% in their rows (cluster scheduling).
// In the product for one session (094536b, reverted), test_norm_kernels, test_cuda_decoder_layer,
// test_lm_ends and test_cuda_causal_lm passed with it, grad_w the same bits as the two launches.
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src/kernels -I src scripts/diag/rmsnorm_one_launch.cu -o /tmp/ro && /tmp/ro
#include "../../src/kernels/rmsnorm.cu"

#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "rmsnorm_diag_buffers.cuh"

namespace oom::kernels {
namespace {

/// The one-launch backward (sm_90+): blocks in clusters of K, one chunk of rows each as
/// backward_rows_in_registers. A cluster adds its blocks' partials (read from their shared memory,
/// block rank 0, 1, ... in order; block r sums the r-th of K contiguous column slices) into
/// `run_sums` (row = the cluster), then counts itself done on `ticket`; the cluster that counts
/// last adds the runs' sums into grad_w, so no second launch waits for this grid to end. At K = 8
/// with 8 partials a range of sum_partials (4096 rows) this is sum_partials' order: the same bits.
/// Blocks past the last chunk (the grid is whole clusters) hold no rows and are not read.
///
/// The ticket counts clusters with `atom.inc`, which wraps to 0 at the last one: it must be 0
/// when the grid starts and is 0 again when it ends. It is touched only after the wait, so calls
/// queued on one stream share it; calls that may run at once need their own.
template <int G, int V, int K>
__global__ void __launch_bounds__(block_threads)
    backward_rows_one_launch(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w, const float* rstd,
                             std::uint16_t* dx, float* run_sums, float* grad_w, unsigned* ticket, std::int64_t rows,
                             int dim, std::int64_t rows_per_partial, int partials) {
  extern __shared__ float4 acc_shared[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ unsigned last_cluster;
  backward_chunk_rows<G, V>(dy, x, w, rstd, dx, rows, dim, rows_per_partial, acc_shared);
  // The block's partial into its group 0 columns (each column read and written by one thread).
  float* mine = reinterpret_cast<float*>(acc_shared);
  sum_group_columns<G>(acc_shared, dim, [mine](int c, float s) { mine[c] = s; });
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's partial is in its shared memory
  const int rank = static_cast<int>(cluster.block_rank());
  const int run = static_cast<int>(blockIdx.x) / K;
  const int held = partials - run * K < K ? partials - run * K : K;
  // Block r's columns: the r-th of K contiguous slices, for the run's sum and the last sum alike.
  const int slice = (dim + K - 1) / K;
  const int c_end = (rank + 1) * slice < dim ? (rank + 1) * slice : dim;
  for (int c = rank * slice + static_cast<int>(threadIdx.x); c < c_end; c += block_threads) {
    float v[K];  // every block's value in flight, then added in rank order
#pragma unroll
    for (int b = 0; b < K; ++b) v[b] = b < held ? *cluster.map_shared_rank(mine + c, b) : 0.0f;
    float s = v[0];
#pragma unroll
    for (int b = 1; b < K; ++b)
      if (b < held) s += v[b];
    run_sums[static_cast<std::int64_t>(run) * dim + c] = s;
  }
  __threadfence();  // the run's sums visible device-wide before the cluster counts itself done
  cluster.sync();   // and every block of the cluster is past its reads of the others' shared memory
  const unsigned runs = gridDim.x / K;
  if (rank == 0 && threadIdx.x == 0) {
    unsigned before = 0;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(before) : "l"(ticket), "r"(runs - 1) : "memory");
    const unsigned last = before == runs - 1 ? 1u : 0u;
    for (int b = 0; b < K; ++b) *cluster.map_shared_rank(&last_cluster, b) = last;
  }
  cluster.sync();  // last_cluster set in every block; no shared memory of another block is read after
  if (last_cluster == 0) return;
  __threadfence();
  for (int c = rank * slice + static_cast<int>(threadIdx.x); c < c_end; c += block_threads) {
    const float before = __ldcg(grad_w + c);
    // 32 loads in flight, then their additions in order (at most 512 / K runs).
    constexpr int batch = 32;
    float total = 0.0f;
    for (unsigned r0 = 0; r0 < runs; r0 += batch) {
      float v[batch];
#pragma unroll
      for (int i = 0; i < batch; ++i)
        v[i] = r0 + i < runs ? __ldcg(run_sums + static_cast<std::int64_t>(r0 + i) * dim + c) : 0.0f;
#pragma unroll
      for (int i = 0; i < batch; ++i)
        if (r0 + i < runs) total = r0 + i == 0 ? v[i] : total + v[i];
    }
    grad_w[c] = before + total;
  }
#endif
}

/// backward_rows_one_launch for rows `dim` wide, in clusters of K blocks, a programmatic
/// dependent of the stream's previous kernel; cudaErrorNotSupported where the code loaded for
/// this device was not compiled for sm_90+.
template <int K>
cudaError_t launch_backward_one_for_width(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w,
                                          const float* rstd, std::uint16_t* dx, float* run_sums, float* grad_w,
                                          unsigned* ticket, std::int64_t rows, std::int64_t dim, std::int64_t partials,
                                          std::int64_t rows_per_partial, cudaStream_t stream) {
  return with_backward_width(dim, [&](auto g, auto v) -> cudaError_t {
    constexpr int G = decltype(g)::value, V = decltype(v)::value;
    const auto kernel = backward_rows_one_launch<G, V, K>;
    cudaFuncAttributes compiled{};
    if (const cudaError_t e = cudaFuncGetAttributes(&compiled, kernel); e != cudaSuccess) return e;
    if (compiled.ptxVersion < 90) return cudaErrorNotSupported;
    const std::size_t smem = backward_smem_bytes<G>(dim);
    if (const cudaError_t e = allow_dynamic_smem(kernel, smem); e != cudaSuccess) return e;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>((partials + K - 1) / K * K));
    config.blockDim = dim3(block_threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attributes[2]{};
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = K;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[1].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attributes;
    config.numAttrs = 2;
    return cudaLaunchKernelEx(&config, kernel, dy, x, w, rstd, dx, run_sums, grad_w, ticket, rows, static_cast<int>(dim),
                              rows_per_partial, static_cast<int>(partials));
  });
}

}  // namespace
}  // namespace oom::kernels

namespace {

/// The most clusters of K blocks of the one-launch kernel for `dim` that run at once.
template <int K>
int max_active_clusters(long long dim) {
  int result = -1;
  CK(oom::kernels::with_backward_width(dim, [&](auto g, auto v) -> cudaError_t {
    constexpr int G = decltype(g)::value, V = decltype(v)::value;
    const auto kernel = oom::kernels::backward_rows_one_launch<G, V, K>;
    const std::size_t smem = oom::kernels::backward_smem_bytes<G>(dim);
    CK(oom::kernels::allow_dynamic_smem(kernel, smem));
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(K * 64);
    config.blockDim = dim3(oom::kernels::block_threads);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = K;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaOccupancyMaxActiveClusters(&result, kernel, &config);
  }));
  return result;
}

}  // namespace

int main() {
  const double copy_bps = copy_bandwidth();
  struct Shape {
    long long rows, dim;
  };
  unsigned* ticket = nullptr;
  CK(cudaMalloc(&ticket, sizeof(unsigned)));
  CK(cudaMemset(ticket, 0, sizeof(unsigned)));
  for (const Shape s : {Shape{4096, 2048}, Shape{4096 * 16, 128}, Shape{65536, 2048}, Shape{65536, 4096}}) {
    const long long n = s.rows * s.dim;
    const RmsnormDiagBuffers buffers(s.rows, s.dim);
    std::uint16_t *const dy = buffers.dy, *const x = buffers.x, *const w = buffers.w;
    float *const rstd = buffers.rstd, *const partial = buffers.partial, *const gw = buffers.gw;
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(x, 0x3C, n * 2));
    CK(cudaMemset(w, 0x3C, s.dim * 2));
    CK(cudaMemset(rstd, 0x3F, s.rows * 4));  // 0.747 a row: grad_w not all zero
    const double bytes = 6.0 * n;
    const long long per = oom::kernels::rmsnorm_rows_per_partial(s.rows);
    const long long partials = (s.rows + per - 1) / per;
    const auto pct = [&](float us) { return 100.0 * bytes / (us * 1e-6) / copy_bps; };
    const auto one_pass = [&] {
      CK(oom::kernels::launch_backward_for_width(dy, x, w, rstd, dy, partial, s.rows, s.dim, partials, per, nullptr));
    };
    const float t_main = time_us(one_pass);
    const float t_two = time_us([&] {
      one_pass();
      CK(oom::kernels::launch_sum_partials(partial, gw, partials, s.dim, nullptr));
    });
    std::printf("%6lld x %5lld (%lld blocks): one-pass kernel alone %6.2f us (%5.1f%%), two launches %6.2f us (%5.1f%%)\n",
                s.rows, s.dim, partials, t_main, pct(t_main), t_two, pct(t_two));
    const auto one = [&](auto k) {
      constexpr int K = decltype(k)::value;
      const float t = time_us([&] {
        CK(oom::kernels::launch_backward_one_for_width<K>(dy, x, w, rstd, dy, partial, gw, ticket, s.rows, s.dim, partials,
                                                          per, nullptr));
      });
      std::printf("    one launch, clusters of %d: %6.2f us (%5.1f%%); %lld clusters, at most %d at once\n", K, t, pct(t),
                  (partials + K - 1) / K, max_active_clusters<K>(s.dim));
    };
    one(std::integral_constant<int, 8>{});
    one(std::integral_constant<int, 4>{});
    one(std::integral_constant<int, 2>{});
    one(std::integral_constant<int, 1>{});
    // K = 8 against the two launches from the same start: the same grad_w bits where the orders
    // agree (4096 rows), else within fp32 rounding.
    std::vector<float> a(s.dim), b(s.dim);
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(gw, 0, s.dim * 4));
    one_pass();
    CK(oom::kernels::launch_sum_partials(partial, gw, partials, s.dim, nullptr));
    CK(cudaMemcpy(a.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(gw, 0, s.dim * 4));
    CK(oom::kernels::launch_backward_one_for_width<8>(dy, x, w, rstd, dy, partial, gw, ticket, s.rows, s.dim, partials, per,
                                                      nullptr));
    CK(cudaMemcpy(b.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
    unsigned left = 1;
    CK(cudaMemcpy(&left, ticket, sizeof(unsigned), cudaMemcpyDeviceToHost));
    // The same order as the two launches only where sum_partials' ranges are 8 partials (256).
    double worst = 0;
    for (long long c = 0; c < s.dim; ++c)
      worst = std::max(worst, std::fabs(static_cast<double>(a[c]) - b[c]) / std::max(1e-30, std::fabs(static_cast<double>(a[c]))));
    std::printf("    clusters of 8 against two launches: grad_w %s (largest relative difference %.2g), ticket left at %u\n",
                std::memcmp(a.data(), b.data(), s.dim * 4) == 0 ? "the same bits" : "in another order", worst, left);
  }
  return 0;
}
