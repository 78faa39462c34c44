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

#include "rmsnorm_diag_buffers.cuh"

int main() {
  const double copy_bps = copy_bandwidth();
  struct Shape {
    long long rows, dim;
  };
  for (const Shape s : {Shape{4096, 2048}, Shape{4096 * 16, 128}, Shape{65536, 2048}, Shape{65536, 4096}}) {
    const long long n = s.rows * s.dim;
    const RmsnormDiagBuffers buffers(s.rows, s.dim);
    std::uint16_t *const dy = buffers.dy, *const x = buffers.x, *const w = buffers.w, *const dx = buffers.dx;
    float *const rstd = buffers.rstd, *const partial = buffers.partial, *const gw = buffers.gw;
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
  }
  return 0;
}
