// What one grouped row launch costs the host and the GPU before any tile is computed (sixty-fifth
// session; docs/hopper.md). The 4K forward gate_up's single timed call takes ~12 us longer than the
// same call back to back (H100, 2026-12-07), time in which the GPU waits for the host's issue. The
// candidates named then: the ~18 KiB parameter block (131 tensor maps), the 2-CTA cluster launch,
// the per-launch attribute calls. Each is measured alone here on empty kernels of the grouped
// kernel's launch shape (132 blocks or 66 pairs of 384 threads, 200 KiB of dynamic shared memory):
//   host   the launch call's own time (median of 200, the GPU idle between them);
//   gpu1   event before the launch to event after it, one launch (median of 200): what a timed
//          single call pays beyond its kernel's work;
//   gpu20  the same over 20 launches back to back, per launch (the host's issue hidden where it
//          is shorter than the GPU's part).
// And the host calls a launch makes before it: cudaGetDevice, cudaDeviceGetAttribute,
// cudaFuncSetAttribute, cuTensorMapEncodeTiled (one 2-D map), cudaOccupancyMaxActiveClusters.
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -I include -I src -I src/kernels \
//     scripts/diag/launch_cost.cu -o /tmp/launch_cost && /tmp/launch_cost
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "diag_timing.cuh"
#include "hopper/tma.cuh"

namespace {

constexpr int kThreads = 384, kSmem = 200 * 1024;

template <int Bytes>
struct Blob {
  alignas(64) unsigned char data[Bytes];
};

/// Reads one byte of its parameter so the block is not compiled away.
template <int Bytes>
__global__ void __launch_bounds__(kThreads) empty_kernel(const __grid_constant__ Blob<Bytes> p, int* sink) {
  if (threadIdx.x == 0 && p.data[blockIdx.x % Bytes] == 0xEE) *sink = blockIdx.x;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double host_us(F&& f, int n = 200) {
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  return median(t);
}

/// Launch-to-end on the GPU: `launches` launches between two events, per launch (median of 200).
template <class F>
double gpu_us(F&& launch, int launches) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int s = 0; s < 200; ++s) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < launches; ++i) launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3 / launches);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

/// The grouped row kernel's launch shape: `grid` blocks of kThreads with kSmem, in 2-CTA clusters
/// where `cluster`.
struct Launch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t config{};
  Launch(unsigned grid, bool cluster) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmem;
    config.attrs = &attr;
    config.numAttrs = cluster ? 1 : 0;
  }
  Launch(const Launch&) = delete;  // (config points at attr)
  Launch& operator=(const Launch&) = delete;
};

template <int Bytes>
void row(const char* name, bool cluster, int* sink) {
  const auto kernel = empty_kernel<Bytes>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  Blob<Bytes> p{};
  const Launch l(132, cluster);
  const auto launch = [&] { CK(cudaLaunchKernelEx(&l.config, kernel, p, sink)); };
  for (int i = 0; i < 10; ++i) launch();
  CK(cudaDeviceSynchronize());
  const double host = host_us([&] {
    launch();
    CK(cudaDeviceSynchronize());  // (outside the timed part below: host_us times f whole)
  });
  // The launch alone: time it, then wait outside the clock.
  std::vector<double> issue;
  for (int i = 0; i < 200; ++i) {
    const auto a = std::chrono::steady_clock::now();
    launch();
    issue.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
    CK(cudaDeviceSynchronize());
  }
  std::printf("%-44s %8.2f %8.2f %8.2f %8.2f\n", name, median(issue), gpu_us(launch, 1), gpu_us(launch, 20), host);
}

}  // namespace

int main() {
  int* sink = nullptr;
  CK(cudaMalloc(&sink, sizeof(int)));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("%-44s %8s %8s %8s %8s\n", "empty launch, 132 blocks x 384, 200 KiB smem", "host_us", "gpu1_us", "gpu20_us",
              "launch+sync");
  row<64>("params 64 B", false, sink);
  row<64>("params 64 B, 2-CTA clusters", true, sink);
  row<9 * 1024>("params 9 KiB (64 maps)", false, sink);
  row<9 * 1024>("params 9 KiB, 2-CTA clusters", true, sink);
  row<18 * 1024>("params 18 KiB (the kernel's block)", false, sink);
  row<18 * 1024>("params 18 KiB, 2-CTA clusters (the launch)", true, sink);

  int dev = 0, v = 0;
  std::printf("%-44s %8.3f\n", "cudaGetDevice", host_us([&] { CK(cudaGetDevice(&dev)); }));
  std::printf("%-44s %8.3f\n", "cudaDeviceGetAttribute",
              host_us([&] { CK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev)); }));
  std::printf("%-44s %8.3f\n", "cudaFuncSetAttribute (max dynamic smem)", host_us([&] {
                CK(cudaFuncSetAttribute(empty_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
              }));
  void* base = nullptr;
  CK(cudaMalloc(&base, std::size_t{64} << 20));
  CUtensorMap map;
  std::printf("%-44s %8.3f\n", "cuTensorMapEncodeTiled (8192 x 2048, sw128)", host_us([&] {
                CK(oom::kernels::hopper::encode_matrix_sw128(&map, base, 8192, 2048, 2048, 128));
              }));
  {
    const Launch l(2, true);
    int clusters = 0;
    std::printf("%-44s %8.3f\n", "cudaOccupancyMaxActiveClusters", host_us([&] {
                  CK(cudaOccupancyMaxActiveClusters(&clusters, empty_kernel<64>, &l.config));
                }));
  }
  cudaFree(base);
  cudaFree(sink);
  return 0;
}
