// Causal GQA flash attention throughput: forward, backward and forward+backward TFLOP/s for
// B=1, Hq=16, Hkv=4 (D=128 by default) at S = 4K, 16K, 32K, 128K. FLOPs are counted as PyTorch
// and FlashAttention do: causal forward = 2 * B*Hq*S*S*D (half of the 4 B Hq S^2 D of the full
// square), backward = 2.5x forward, forward+backward = 3.5x forward. The physical reference for
// these numbers is PyTorch SDPA on the same shapes: scripts/bench_attention_sdpa.py prints the same
// table (same metric) so the ratio comes from one run.
//   bench_attention [--head-dim 128|256] [--repeats N] [--seq S]   (--seq: that one length instead of
//   the four, e.g. to profile one size: scripts/profile-attention.sh)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "kernels/timing_inputs.hpp"
#include "oom/core/cuda_check.hpp"
#include "oom/kernels/attention.hpp"

int main(int argc, char** argv) {
  int head_dim = 128, repeats = 10, only_seq = 0;
  for (int a = 1; a + 1 < argc; a += 2) {
    if (std::strcmp(argv[a], "--head-dim") == 0) head_dim = std::atoi(argv[a + 1]);
    if (std::strcmp(argv[a], "--repeats") == 0) repeats = std::atoi(argv[a + 1]);
    if (std::strcmp(argv[a], "--seq") == 0) only_seq = std::atoi(argv[a + 1]);
  }
  if (only_seq < 0 || repeats < 1 || (head_dim != 128 && head_dim != 256)) {
    std::fprintf(stderr, "bench_attention: --head-dim must be 128 or 256, --repeats >= 1, --seq >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_attention: no GPU: nothing to measure\n");
    return 0;
  }
  using oom::bf16;
  using oom::kernels::TokenRows;
  const int batch = 1, heads_q = 16, heads_kv = 4;
  std::printf("oom flash attention, causal, B=%d Hq=%d Hkv=%d D=%d, packed QKV input\n", batch, heads_q, heads_kv,
              head_dim);
  std::printf("%8s %10s %10s %10s %10s %12s\n", "S", "fwd_ms", "bwd_ms", "fwd_TF/s", "bwd_TF/s", "fwdbwd_TF/s");
  const std::vector<int> seqs = only_seq > 0 ? std::vector<int>{only_seq} : std::vector<int>{4096, 16384, 32768, 131072};
  for (const int seq : seqs) {
    const std::int64_t row = static_cast<std::int64_t>(heads_q + 2 * heads_kv) * head_dim;
    const std::int64_t q_row = static_cast<std::int64_t>(heads_q) * head_dim;
    const std::size_t tokens = static_cast<std::size_t>(batch) * seq;
    oom::test::DeviceBuffer<bf16> qkv(tokens * row), dqkv(tokens * row), o(tokens * q_row), d_o(tokens * q_row);
    oom::test::DeviceBuffer<float> lse(tokens * heads_q);
    // N(0, 1) inputs, as the SDPA script's randn (timing_inputs.hpp: products on zeros run faster
    // than on real data, so zeros here would flatter the ratio to SDPA).
    oom::test::fill_random_bf16(qkv.get(), qkv.size(), 11);
    oom::test::fill_random_bf16(d_o.get(), d_o.size(), 12);
    const oom::kernels::AttentionProblem p{.batch = batch, .seq = seq, .heads_q = heads_q, .heads_kv = heads_kv,
                                           .head_dim = head_dim,
                                           .softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim))};
    const TokenRows<const bf16> q{qkv.get(), seq * row, row}, k{qkv.get() + q_row, seq * row, row},
        v{qkv.get() + q_row + heads_kv * head_dim, seq * row, row};
    const TokenRows<bf16> dq{dqkv.get(), seq * row, row}, dk{dqkv.get() + q_row, seq * row, row},
        dv{dqkv.get() + q_row + heads_kv * head_dim, seq * row, row};
    const TokenRows<bf16> out{o.get(), seq * q_row, q_row};
    const TokenRows<const bf16> out_c{o.get(), seq * q_row, q_row}, dout{d_o.get(), seq * q_row, q_row};
    oom::test::DeviceBuffer<unsigned char> ws(oom::kernels::attention_backward_workspace_bytes(p));
    cudaStream_t stream = nullptr;
    const auto forward = [&](cudaStream_t s) {
      OOM_CUDA_CHECK(oom::kernels::attention_forward(p, q, k, v, out, lse.get(), s));
    };
    const auto backward = [&](cudaStream_t s) {
      OOM_CUDA_CHECK(oom::kernels::attention_backward(p, q, k, v, out_c, dout, lse.get(), dq, dk, dv, false, ws.get(),
                                                      ws.bytes(), s));
    };
    const int reps = seq >= 131072 ? std::max(2, repeats / 3) : repeats;
    const double fwd_ms = oom::test::time_ms(forward, stream, reps, 1);
    const double bwd_ms = oom::test::time_ms(backward, stream, reps, 1);
    const double fwd_flops = 2.0 * batch * heads_q * static_cast<double>(seq) * seq * head_dim;
    std::printf("%8d %10.3f %10.3f %10.1f %10.1f %12.1f\n", seq, fwd_ms, bwd_ms, fwd_flops / fwd_ms / 1e9,
                2.5 * fwd_flops / bwd_ms / 1e9, 3.5 * fwd_flops / (fwd_ms + bwd_ms) / 1e9);
  }
  return 0;
}
