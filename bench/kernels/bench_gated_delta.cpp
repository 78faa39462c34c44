// The gated delta rule's throughput (oom/kernels/gated_delta.hpp) against the number of sequences
// side by side: the Qwen3-Next linear layer's heads (16 key, 32 value heads of 128) over B = 1, 2,
// 4 and 8 sequences of S tokens, in the chunked form (the default on Hopper) and in the recurrent
// one, its backward both as a cluster of blocks per head and as one block per head. Each row gives
// state updates a second (tokens x value heads x 128^2), the chunked form's ratio to the same pass
// at B = 1 (what MachineProfile's gated_delta_*_updates_per_s, measured at B = 1, understates at
// larger B), the chunked form's speed against the recurrent one's (its cluster backward), and what
// `automatic` runs, forward and backward together, against the fastest form of each pass.
//   bench_gated_delta [--seq S] [--repeats N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/timing_inputs.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/kernels/gated_delta.hpp"

namespace {

using oom::bf16;
using oom::test::DeviceBuffer;
namespace k = oom::kernels;

/// Median milliseconds of `fn` over `repeats` runs after one warm-up, timed by events on stream 0.
template <class Fn>
double median_ms(Fn&& fn, int repeats) {
  cudaEvent_t a, b;
  OOM_CUDA_CHECK(cudaEventCreate(&a));
  OOM_CUDA_CHECK(cudaEventCreate(&b));
  fn();
  std::vector<float> ms;
  for (int r = 0; r < repeats; ++r) {
    OOM_CUDA_CHECK(cudaEventRecord(a));
    fn();
    OOM_CUDA_CHECK(cudaEventRecord(b));
    OOM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    OOM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  OOM_CUDA_CHECK(cudaEventDestroy(a));
  OOM_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Times {
  double forward_ms = 0, backward_ms = 0;                // chunked
  double recurrent_forward_ms = 0, one_block_ms = 0, cluster_ms = 0;
  double automatic_ms = 0;  // forward + backward as `automatic` picks them (each its own median)
  bool same_bits = false;  // the two recurrent backward paths' dq, dk, dv, dg, dbeta
};

Times measure(k::GatedDeltaDims d, int repeats) {
  const std::size_t T = static_cast<std::size_t>(d.tokens());
  const std::size_t qk = T * static_cast<std::size_t>(d.k_heads * d.k_dim), vv = T * static_cast<std::size_t>(d.v_heads * d.v_dim);
  const std::size_t gates = T * static_cast<std::size_t>(d.v_heads);
  // The inputs scripts/bench_gated_delta_torch.py times PyTorch on (timing_inputs.hpp: never
  // constant data): q, k, v and dout N(0, 1) (the kernel normalises q and k), log decays g =
  // -(0.01 + 1.5 u) with u uniform in [0, 1), beta = sigmoid(N(0, 1)).
  DeviceBuffer<bf16> q(qk), kk(qk), v(vv), dout(vv);
  std::uint64_t seed = 1;
  for (auto* b : {&q, &kk, &v, &dout}) oom::test::fill_random_bf16(b->get(), b->size(), seed++);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> hg(gates), hbeta = oom::test::random_normal(gates, seed + 1);
  for (auto& x : hg) x = -(0.01f + 1.5f * u(rng));
  for (auto& x : hbeta) x = 1.0f / (1.0f + std::exp(-x));
  const DeviceBuffer<float> g(hg), beta(hbeta);
  DeviceBuffer<bf16> out(vv), dq(qk), dk(qk), dv(vv);
  DeviceBuffer<float> states(k::gated_delta_states_floats(d)), dg(gates), dbeta(gates);
  d.form = k::GatedDeltaDims::Form::automatic;  // sized for either form
  DeviceBuffer<std::byte> ws(k::gated_delta_backward_workspace_bytes(d));
  auto forward = [&](k::GatedDeltaDims::Form form) {
    d.form = form;
    return median_ms(
        [&] { OOM_CUDA_CHECK(k::gated_delta_forward(d, q.get(), kk.get(), v.get(), g.get(), beta.get(), out.get(), states.get(), nullptr)); },
        repeats);
  };
  auto backward = [&](k::GatedDeltaDims::Form form, k::GatedDeltaDims::Backward path) {
    d.form = form;
    d.backward = path;
    return median_ms(
        [&] {
          OOM_CUDA_CHECK(k::gated_delta_backward(d, q.get(), kk.get(), v.get(), g.get(), beta.get(), dout.get(), states.get(), dq.get(),
                                                 dk.get(), dv.get(), dg.get(), dbeta.get(), ws.get(), ws.size(), nullptr));
        },
        repeats);
  };
  using Form = k::GatedDeltaDims::Form;
  using Path = k::GatedDeltaDims::Backward;
  Times t;
  t.forward_ms = forward(Form::chunked);
  t.backward_ms = backward(Form::chunked, Path::automatic);
  t.recurrent_forward_ms = forward(Form::recurrent);
  t.one_block_ms = backward(Form::recurrent, Path::one_block);
  const auto one_dq = dq.download(), one_dk = dk.download(), one_dv = dv.download();
  const auto one_dg = dg.download(), one_dbeta = dbeta.download();
  t.cluster_ms = backward(Form::recurrent, Path::cluster);
  const auto same = [](const auto& a, const auto& b) { return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0; };
  t.same_bits = same(one_dq, dq.download()) && same(one_dk, dk.download()) && same(one_dv, dv.download()) &&
                same(one_dg, dg.download()) && same(one_dbeta, dbeta.download());
  t.automatic_ms = forward(Form::automatic) + backward(Form::automatic, Path::automatic);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t seq = 4096;
  int repeats = 5;
  for (int a = 1; a + 1 < argc; a += 2) {
    if (std::strcmp(argv[a], "--seq") == 0) seq = std::atoll(argv[a + 1]);
    if (std::strcmp(argv[a], "--repeats") == 0) repeats = std::atoi(argv[a + 1]);
  }
  if (seq < 1 || repeats < 1) {
    std::fprintf(stderr, "bench_gated_delta: --seq and --repeats must be >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gated_delta: no GPU: nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  OOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    std::printf("bench_gated_delta: %s (compute capability %d.%d) has no thread-block clusters: nothing to compare\n", prop.name,
                prop.major, prop.minor);
    return 0;
  }
  std::printf("gated delta rule, %lld tokens a sequence, 16/32 heads of 128, chunk 64, %s (%d SMs)\n", static_cast<long long>(seq),
              prop.name, prop.multiProcessorCount);
  std::printf("%3s %10s %10s %10s %10s %10s %10s | %12s %12s %12s %10s %10s %12s\n", "B", "fwd_ms", "fwd_G/s", "fwd_vs_B1", "bwd_ms",
              "bwd_G/s", "bwd_vs_B1", "rec_fwd_ms", "rec_bwdC_ms", "rec_bwd1_ms", "fwd_gain", "bwd_gain", "auto_vs_best");
  double f1 = 0, b1 = 0;
  bool all_same = true;
  for (const std::int64_t B : {1, 2, 4, 8}) {
    const k::GatedDeltaDims d{B, seq, 16, 32, 128, 128, 64};
    const Times t = measure(d, repeats);
    const double updates = static_cast<double>(d.tokens()) * d.v_heads * d.k_dim * d.v_dim;
    const double f = updates / t.forward_ms * 1e-6, b = updates / t.backward_ms * 1e-6;  // G updates/s
    if (B == 1) f1 = f, b1 = b;
    // The fastest form of each pass, and `automatic` (forward + backward) against their sum.
    const double best = std::min(t.forward_ms, t.recurrent_forward_ms) + std::min({t.backward_ms, t.cluster_ms, t.one_block_ms});
    std::printf("%3lld %10.3f %10.1f %10.2f %10.3f %10.1f %10.2f | %12.3f %12.3f %12.3f %10.2f %10.2f %12.2f%s\n", static_cast<long long>(B),
                t.forward_ms, f, f / f1, t.backward_ms, b, b / b1, t.recurrent_forward_ms, t.cluster_ms, t.one_block_ms,
                t.recurrent_forward_ms / t.forward_ms, std::min(t.cluster_ms, t.one_block_ms) / t.backward_ms, best / t.automatic_ms,
                t.same_bits ? "" : "  PATHS DIFFER");
    all_same = all_same && t.same_bits;
  }
  if (!all_same) {
    std::printf("bench_gated_delta: the cluster and one-block backwards gave different bits\n");
    return 1;
  }
  return 0;
}
