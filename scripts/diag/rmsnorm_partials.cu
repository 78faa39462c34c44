// RMSNorm backward at the 5.13B layer's T = 4096 shapes (issue 5: 57-60% of the D2D copy): how the
// rows per weight-gradient partial move the one-pass kernel and the partial sum, each timed over 20
// back-to-back launches, as a ratio to a device-to-device copy of 1 GiB in the same run. Includes
// the product's kernels (src/kernels/rmsnorm.cu) to call launch_backward with other chunkings.
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I include \
//     -I src/kernels -I src scripts/diag/rmsnorm_partials.cu -o /tmp/rp && /tmp/rp
#ifdef RMSNORM_SOURCE  // a variant of the product's file, e.g. -DRMSNORM_SOURCE='"/tmp/variant.cu"'
#include RMSNORM_SOURCE
#else
#include "../../src/kernels/rmsnorm.cu"
#endif

#include "diag_timing.cuh"

int main() {
  const size_t big = size_t{1} << 30;
  void *ca, *cb;
  CK(cudaMalloc(&ca, big));
  CK(cudaMalloc(&cb, big));
  const float copy_us = time_us([&] { CK(cudaMemcpyAsync(cb, ca, big, cudaMemcpyDeviceToDevice)); }, 3);
  const double copy_bps = 2.0 * big / (copy_us * 1e-6);
  std::printf("D2D copy %.0f GB/s\n", copy_bps / 1e9);
  struct Shape {
    long long rows, dim;
  };
  for (const Shape s : {Shape{4096, 2048}, Shape{4096 * 16, 128}, Shape{65536, 2048}, Shape{65536, 4096}}) {
    const long long n = s.rows * s.dim;
    std::uint16_t *dy, *x, *w, *dx;
    float *rstd, *partial, *gw;
    CK(cudaMalloc(&dy, n * 2));
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMalloc(&dx, n * 2));
    CK(cudaMalloc(&w, s.dim * 2));
    CK(cudaMalloc(&rstd, s.rows * 4));
    CK(cudaMalloc(&gw, s.dim * 4));
    CK(cudaMalloc(&partial, 4096 * s.dim * 4));
    CK(cudaMemset(dy, 0x3C, n * 2));
    CK(cudaMemset(x, 0x3C, n * 2));
    CK(cudaMemset(w, 0x3C, s.dim * 2));
    CK(cudaMemset(rstd, 0, s.rows * 4));
    const double bytes = 6.0 * n;
    // The product's one-pass kernel for this width (as rmsnorm_backward picks it), dx given.
    const auto one_pass = [&](std::uint16_t* out, long long partials, long long per) {
      CK(oom::kernels::launch_backward_for_width(dy, x, w, rstd, out, partial, s.rows, s.dim, partials, per, nullptr));
    };
    for (long long per : {8LL, 16LL, 32LL, 64LL, 128LL}) {
      const long long partials = (s.rows + per - 1) / per;
      if (partials > 4096) continue;
      auto main_only = [&] { one_pass(dx, partials, per); };
      const float t_main = time_us(main_only);
      const float t_both = time_us([&] {
        main_only();
        CK(oom::kernels::launch_sum_partials(partial, gw, partials, s.dim, nullptr));
      });
      std::printf("%6lld x %5lld  rows/partial %4lld (%5lld blocks): main %7.2f us (%5.1f%%), main + sum %7.2f us (%5.1f%%)\n",
                  s.rows, s.dim, per, partials, t_main, 100.0 * bytes / (t_main * 1e-6) / copy_bps, t_both,
                  100.0 * bytes / (t_both * 1e-6) / copy_bps);
    }
    // In place (dx == dy, as the trainer's post-attention norm runs) at the product's chunking.
    {
      const long long per = oom::kernels::rmsnorm_rows_per_partial(s.rows);
      const long long partials = (s.rows + per - 1) / per;
      const float t = time_us([&] {
        one_pass(dy, partials, per);
        CK(oom::kernels::launch_sum_partials(partial, gw, partials, s.dim, nullptr));
      });
      std::printf("%6lld x %5lld  rows/partial %4lld, dx in place: main + sum %7.2f us (%5.1f%%)\n", s.rows, s.dim, per, t,
                  100.0 * bytes / (t * 1e-6) / copy_bps);
    }
    CK(cudaFree(dy));
    CK(cudaFree(x));
    CK(cudaFree(dx));
    CK(cudaFree(w));
    CK(cudaFree(rstd));
    CK(cudaFree(gw));
    CK(cudaFree(partial));
  }
  return 0;
}
