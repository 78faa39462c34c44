// RMSNorm backward at T = 4096 (issue 5: 67-68% of the D2D copy, the partial sum ~3 us of it).
// Variants of where the weight-gradient partials are summed, each checked for the product's bits
// and timed over 20 back-to-back launches, as a ratio to a 1 GiB D2D copy in the same run:
// - fused: the one-pass kernel sums them itself after a grid-wide barrier (cooperative launch),
//   each block 8 columns over all partials in sum_partials' order;
// - light (256 threads) and small (128 threads, 32 registers) sum kernels, small ones fitting an
//   SM beside two one-pass blocks so they can wait there before the one-pass grid ends;
// - shared-memory carveouts on the product's two kernels.
// The fused kernel runs the product's one-pass body (backward_chunk), so it triggers the next
// launch after its rows, before the grid barrier; the measured version (commit d3970c8) carried a
// copy of the body that triggered after the barrier, and copies with the trigger right after the
// wait and the zeroing after the wait. Findings: src/kernels/rmsnorm.cu's header,
// docs/performance.md (2026-12-01).
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src/kernels -I src scripts/diag/rmsnorm_fused_sum.cu -o /tmp/rf && /tmp/rf
#include "../../src/kernels/rmsnorm.cu"

#include <cooperative_groups.h>

#include <algorithm>

#include <vector>

#include "rmsnorm_diag_buffers.cuh"

namespace oom::kernels {
namespace {

/// sum_partials' order (ranges of `per` contiguous partials, each from 0.0f in order, then the 32
/// range sums in order) for 8 columns a tile: thread (range y = t / 8, column t % 8).
__device__ void sum_tiles(const float* partial, float* grad_w, std::int64_t partials, std::int64_t dim, int tile0,
                          int tile_step, float (*range_sum)[8]) {
  const int y = threadIdx.x / 8, k = threadIdx.x % 8;
  for (std::int64_t tile = tile0; tile * 8 < dim; tile += tile_step) {
    const std::int64_t c = tile * 8 + k;
    const float s = c < dim ? sum_partial_range<true>(partial, partials, dim, c, y) : 0.0f;
    range_sum[y][k] = s;
    __syncthreads();
    if (y == 0 && c < dim) {
      float total = range_sum[0][k];
      for (int q = 1; q < partial_ranges; ++q) total += range_sum[q][k];
      grad_w[c] += total;
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(256) sum_partials_light(const float* partial, float* grad_w, std::int64_t partials,
                                                          std::int64_t dim) {
  __shared__ float range_sum[partial_ranges][8];
  allow_dependent_launch();  // the next kernel waits for this grid itself
  wait_for_prerequisite_grid();
  sum_tiles(partial, grad_w, partials, dim, blockIdx.x, gridDim.x, range_sum);
}

/// sum_partials' order with 128 threads a block (8 columns x 16, each thread two ranges y and
/// y + 16, each summed from 0.0f in order) and at most 32 registers: two such blocks fit an SM
/// beside two one-pass blocks, so they can be resident (waiting) before the one-pass grid ends.
template <bool AllowFirst>
__global__ void __launch_bounds__(128, 16) sum_partials_small(const float* partial, float* grad_w,
                                                              std::int64_t partials, std::int64_t dim) {
  __shared__ float range_sum[partial_ranges][8];
  if (AllowFirst) allow_dependent_launch();
  wait_for_prerequisite_grid();
  if (!AllowFirst) allow_dependent_launch();
  const int k = threadIdx.x % 8;
  const int c = blockIdx.x * 8 + k;
  const int n = static_cast<int>(partials), d = static_cast<int>(dim);
  const int per = (n + partial_ranges - 1) / partial_ranges;
  const float* column = partial + c;
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
    const int y = threadIdx.x / 8 + 16 * h;
    const int begin = y * per, end = begin + per < n ? begin + per : n;
    float s = 0.0f;
    if (c < d) {
      constexpr int batch = 8;
      for (int p0 = begin; p0 < end; p0 += batch) {
        float v[batch];
#pragma unroll
        for (int i = 0; i < batch; ++i) v[i] = p0 + i < end ? __ldcg(column + (p0 + i) * d) : 0.0f;
#pragma unroll
        for (int i = 0; i < batch; ++i)
          if (p0 + i < end) s += v[i];
      }
    }
    range_sum[y][k] = s;
  }
  __syncthreads();
  if (threadIdx.x < 8 && c < dim) {
    float total = range_sum[0][k];
    for (int q = 1; q < partial_ranges; ++q) total += range_sum[q][k];
    grad_w[c] += total;
  }
}

/// The product's one-pass body, then a grid-wide barrier (cooperative launch) and the partial sum
/// in sum_partials' order by every block, 8 columns at a time.
template <int G, int V>
__global__ void __launch_bounds__(block_threads)
    backward_fused(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w, const float* rstd,
                   std::uint16_t* dx, float* partial, float* grad_w, std::int64_t rows, int dim,
                   std::int64_t rows_per_partial, std::int64_t partials) {
  extern __shared__ float4 acc_shared[];
  backward_chunk<G, V>(dy, x, w, rstd, dx, partial, rows, dim, rows_per_partial, acc_shared);
  cooperative_groups::this_grid().sync();
  __syncthreads();  // the accumulator's shared memory is reused for the range sums (32 x 8 floats)
  sum_tiles(partial, grad_w, partials, dim, blockIdx.x, gridDim.x, reinterpret_cast<float (*)[8]>(acc_shared));
}

template <int G, int V>
cudaError_t launch_fused(const std::uint16_t* dy, const std::uint16_t* x, const std::uint16_t* w, const float* rstd,
                         std::uint16_t* dx, float* partial, float* gw, std::int64_t rows, std::int64_t dim,
                         std::int64_t partials, std::int64_t per, bool pdl, cudaStream_t stream) {
  const auto kernel = backward_fused<G, V>;
  // sum_tiles reuses it for 32 x 8 range sums
  const std::size_t smem = std::max(backward_smem_bytes<G>(dim), sizeof(float) * 32 * 8);
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(partials));
  config.blockDim = dim3(block_threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attrs;
  config.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, dy, x, w, rstd, dx, partial, gw, rows, static_cast<int>(dim), per, partials);
}

}  // namespace
}  // namespace oom::kernels

int main() {
  using namespace oom::kernels;
  const double copy_bps = copy_bandwidth();
  struct Shape {
    long long rows, dim;
  };
  for (const Shape s : {Shape{4096, 2048}, Shape{4096 * 16, 128}, Shape{4096 * 4, 128}, Shape{2000, 2048}}) {
    const long long n = s.rows * s.dim;
    const RmsnormDiagBuffers buffers(s.rows, s.dim);
    std::uint16_t *const dy = buffers.dy, *const x = buffers.x, *const w = buffers.w, *const dx = buffers.dx;
    float *const rstd = buffers.rstd, *const partial = buffers.partial, *const gw = buffers.gw;
    // random-ish bf16 in [0.5, 2): exponent fixed, mantissa from an LCG
    std::vector<std::uint16_t> h(n);
    unsigned st = 12345;
    for (auto& v : h) {
      st = st * 1664525u + 1013904223u;
      v = static_cast<std::uint16_t>(0x3F00 | ((st >> 16) & 0xFF)) ^ ((st >> 31) << 15);
    }
    CK(cudaMemcpy(dy, h.data(), n * 2, cudaMemcpyHostToDevice));
    for (auto& v : h) v ^= 0x0055;
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, h.data(), s.dim * 2, cudaMemcpyHostToDevice));
    std::vector<float> hr(s.rows, 0.7f);
    CK(cudaMemcpy(rstd, hr.data(), s.rows * 4, cudaMemcpyHostToDevice));
    const double bytes = 6.0 * n;
    const long long per = rmsnorm_rows_per_partial(s.rows);
    const long long partials = (s.rows + per - 1) / per;
    const bool wide = s.dim == 2048;
    auto product = [&](std::uint16_t* out) {
      CK(launch_backward_for_width(dy, x, w, rstd, out, partial, s.rows, s.dim, partials, per, nullptr));
    };
    auto base = [&](std::uint16_t* out) {
      product(out);
      CK(launch_sum_partials(partial, gw, partials, s.dim, nullptr));
    };
    auto light = [&](std::uint16_t* out) {
      product(out);
      const unsigned tiles = static_cast<unsigned>((s.dim + 7) / 8);
      CK(launch_as_dependent(sum_partials_light, dim3(tiles < 132 ? tiles : 132), dim3(256), 0, nullptr, partial, gw,
                             static_cast<std::int64_t>(partials), static_cast<std::int64_t>(s.dim)));
    };
    auto fused = [&](std::uint16_t* out, bool pdl) {
      if (wide)
        CK(launch_fused<32, 8>(dy, x, w, rstd, out, partial, gw, s.rows, s.dim, partials, per, pdl, nullptr));
      else
        CK(launch_fused<8, 2>(dy, x, w, rstd, out, partial, gw, s.rows, s.dim, partials, per, pdl, nullptr));
    };
    int max_blocks = 0;
    if (wide) {
      const auto smem = backward_smem_bytes<32>(s.dim);
      CK(cudaFuncSetAttribute(backward_fused<32, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem)));
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&max_blocks, backward_fused<32, 8>, block_threads, smem));
    } else {
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&max_blocks, backward_fused<8, 2>, block_threads,
                                                       backward_smem_bytes<8>(s.dim)));
    }
    std::printf("%lld x %lld: %lld partials of %lld rows; fused kernel %d blocks an SM\n", s.rows, s.dim, partials, per,
                max_blocks);
    // Same bits: gw and dx from the product and from each variant, beside.
    std::vector<float> g_ref(s.dim), g_var(s.dim);
    std::vector<std::uint16_t> d_ref(n), d_var(n);
    auto run_check = [&](const char* name, auto&& f) {
      CK(cudaMemset(gw, 0, s.dim * 4));
      CK(cudaMemset(dx, 0xFF, n * 2));
      f();
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(g_var.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(d_var.data(), dx, n * 2, cudaMemcpyDeviceToHost));
      const bool same = g_var == g_ref && d_var == d_ref;
      std::printf("  %-28s bits %s\n", name, same ? "same" : "DIFFER");
    };
    CK(cudaMemset(gw, 0, s.dim * 4));
    CK(cudaMemset(dx, 0xFF, n * 2));
    base(dx);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(g_ref.data(), gw, s.dim * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(d_ref.data(), dx, n * 2, cudaMemcpyDeviceToHost));
    run_check("light sum", [&] { light(dx); });
    run_check("fused (cooperative)", [&] { fused(dx, false); });
    run_check("fused (cooperative + PDL)", [&] { fused(dx, true); });
    auto small = [&](bool allow_first) {
      const unsigned tiles = static_cast<unsigned>((s.dim + 7) / 8);
      if (allow_first)
        CK(launch_as_dependent(sum_partials_small<true>, dim3(tiles), dim3(128), 0, nullptr, partial, gw,
                               static_cast<std::int64_t>(partials), static_cast<std::int64_t>(s.dim)));
      else
        CK(launch_as_dependent(sum_partials_small<false>, dim3(tiles), dim3(128), 0, nullptr, partial, gw,
                               static_cast<std::int64_t>(partials), static_cast<std::int64_t>(s.dim)));
    };
    run_check("main + small sum", [&] { product(dx); small(false); });
    const float t_main = time_us([&] { product(dx); });
    const float t_copy = time_us([&] { CK(cudaMemcpyAsync(dx, dy, n * 2, cudaMemcpyDeviceToDevice)); });
    auto line = [&](const char* name, float t) {
      std::printf("  %-36s %7.2f us  %5.1f%% of copy\n", name, t, 100.0 * bytes / (t * 1e-6) / copy_bps);
    };
    line("copy of dy (size-matched, x 3/2)", t_copy * 1.5f);
    line("product main + sum, in place (first)", time_us([&] { base(dy); }));
    for (int carve : {100, 50, 0}) {
      if (wide) CK(cudaFuncSetAttribute(backward_rows_in_registers<32, 8>, cudaFuncAttributePreferredSharedMemoryCarveout, carve));
      else CK(cudaFuncSetAttribute(backward_rows_in_registers<8, 2>, cudaFuncAttributePreferredSharedMemoryCarveout, carve));
      CK(cudaFuncSetAttribute(sum_partials, cudaFuncAttributePreferredSharedMemoryCarveout, carve));
      char name[96];
      std::snprintf(name, sizeof name, "product, in place, carveout %d", carve);
      line(name, time_us([&] { base(dy); }));
      std::snprintf(name, sizeof name, "product main alone, in place, carveout %d", carve);
      line(name, time_us([&] { product(dy); }));
    }
    CK(cudaFuncSetAttribute(backward_rows_in_registers<32, 8>, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
    CK(cudaFuncSetAttribute(backward_rows_in_registers<8, 2>, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
    CK(cudaFuncSetAttribute(sum_partials, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
    if (s.dim != 2048 || s.rows != 4096) continue;
    line("product main alone", t_main);
    line("product main + sum", time_us([&] { base(dx); }));
    line("product main + sum, in place", time_us([&] { base(dy); }));
    line("main + light sum", time_us([&] { light(dx); }));
    line("main + light sum, in place", time_us([&] { light(dy); }));
    line("main + small sum", time_us([&] { product(dx); small(false); }));
    line("main + small sum, in place", time_us([&] { product(dy); small(false); }));
    line("main + small sum (allow first), in pl", time_us([&] { product(dy); small(true); }));
    line("fused cooperative", time_us([&] { fused(dx, false); }));
    line("fused cooperative, in place", time_us([&] { fused(dy, false); }));
    line("fused cooperative+PDL", time_us([&] { fused(dx, true); }));
    line("fused cooperative+PDL, in place", time_us([&] { fused(dy, true); }));
  }
  return 0;
}
