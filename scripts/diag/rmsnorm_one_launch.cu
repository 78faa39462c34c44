// RMSNorm backward in one launch (a ticket, clusters of K blocks adding their partials through
// distributed shared memory, the last cluster summing into grad_w) against the two launches, at
// the bandwidth report's shapes, in place (dx = dy), each timed over 20 back-to-back calls as a
// ratio to a 1 GiB device-to-device copy in the same run; with the most clusters of K blocks the
// device holds at once (cudaOccupancyMaxActiveClusters) against the grid's clusters. K = 8 is the
// product's (its bits are checked against the two launches'); K = 4, 2, 1 sum in other orders.
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src/kernels -I src scripts/diag/rmsnorm_one_launch.cu -o /tmp/ro && /tmp/ro
#include "../../src/kernels/rmsnorm.cu"

#include <cstring>
#include <vector>

#include "rmsnorm_diag_buffers.cuh"

namespace {

/// The most clusters of K blocks of the one-launch kernel for `dim` that run at once.
template <int K>
int max_active_clusters(long long dim) {
  int result = -1;
  CK(oom::kernels::with_backward_width(dim, [&](auto g, auto v) -> cudaError_t {
    constexpr int G = decltype(g)::value, V = decltype(v)::value;
    const auto kernel = oom::kernels::backward_rows_one_launch<G, V, K>;
    const std::size_t smem = oom::kernels::backward_smem_bytes<G>(dim);
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
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
        bool taken = false;
        CK(oom::kernels::launch_backward_one_for_width<K>(dy, x, w, rstd, dy, partial, gw, ticket, s.rows, s.dim, partials,
                                                          per, nullptr, &taken));
        if (!taken) std::exit(2);
      });
      std::printf("    one launch, clusters of %d: %6.2f us (%5.1f%%); %lld clusters, at most %d at once\n", K, t, pct(t),
                  (partials + K - 1) / K, max_active_clusters<K>(s.dim));
    };
    one(std::integral_constant<int, 8>{});
    one(std::integral_constant<int, 4>{});
    one(std::integral_constant<int, 2>{});
    one(std::integral_constant<int, 1>{});
    // The product's K = 8 against the two launches: the same grad_w bits from the same start.
    std::vector<float> a(s.dim), b(s.dim);
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(gw, 0, s.dim * 4));
    one_pass();
    CK(oom::kernels::launch_sum_partials(partial, gw, partials, s.dim, nullptr));
    CK(cudaMemcpy(a.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(gw, 0, s.dim * 4));
    bool taken = false;
    CK(oom::kernels::launch_backward_one_for_width(dy, x, w, rstd, dy, partial, gw, ticket, s.rows, s.dim, partials, per,
                                                   nullptr, &taken));
    CK(cudaMemcpy(b.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
    unsigned left = 1;
    CK(cudaMemcpy(&left, ticket, sizeof(unsigned), cudaMemcpyDeviceToHost));
    std::printf("    clusters of 8 against two launches: grad_w %s, ticket left at %u\n",
                std::memcmp(a.data(), b.data(), s.dim * 4) == 0 ? "the same bits" : "DIFFERS", left);
  }
  return 0;
}
