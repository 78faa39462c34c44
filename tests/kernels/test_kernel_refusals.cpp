// Kernel launchers refuse bad arguments with a reason (oom/kernels/refusal.hpp): the launcher, the
// argument, and for sizes what it got against what it needs. Every refusal happens before the
// launcher touches the device, so this runs without a GPU (in CI); the pointers below are never
// dereferenced.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

#include "oom/core/cuda_check.hpp"
#include "oom/core/error.hpp"
#include "oom/kernels/adamw_gpu.hpp"
#include "oom/kernels/attention.hpp"
#include "oom/kernels/cast.hpp"
#include "oom/kernels/embedding.hpp"
#include "oom/kernels/expert_gemm.hpp"
#include "oom/kernels/lm_head_loss.hpp"
#include "oom/kernels/permute.hpp"
#include "oom/kernels/refusal.hpp"
#include "oom/kernels/rmsnorm.hpp"
#include "oom/kernels/rope.hpp"
#include "oom/kernels/router.hpp"
#include "oom/kernels/deltanet.hpp"
#include "oom/kernels/output_gate.hpp"
#include "oom/kernels/gated_delta.hpp"
#include "oom/kernels/swiglu.hpp"
#include "oom/optim/adamw.hpp"

namespace k = oom::kernels;
using oom::bf16;

namespace {

/// A host buffer standing in for device arrays: aligned, never read by a refusing launcher.
alignas(256) std::array<unsigned char, 4096> scratch{};
template <class T = bf16>
T* fake(std::size_t byte_offset = 0) {
  return reinterpret_cast<T*>(scratch.data() + byte_offset);
}

/// The status is cudaErrorInvalidValue and the reason contains every one of `parts`.
void expect_refused(cudaError_t status, std::initializer_list<std::string> parts) {
  const std::string why = k::take_refusal();
  CHECK(status == cudaErrorInvalidValue);
  INFO("reason: \"" << why << "\"");
  for (const std::string& p : parts) CHECK(why.find(p) != std::string::npos);
}

}  // namespace

TEST_CASE("refusals name the launcher, the argument and the sizes") {
  k::clear_refusal();
  const std::size_t need = k::rmsnorm_backward_workspace_bytes(4096, 2048);
  REQUIRE(need > 1024);
  expect_refused(k::rmsnorm_backward(fake(), fake(), fake(), fake<float>(), fake(), fake<float>(), 4096, 2048, fake<void>(),
                                     1024, nullptr),
                 {"rmsnorm_backward: workspace of 1024 bytes, needs " + std::to_string(need),
                  "rmsnorm_backward_workspace_bytes(4096, 2048)"});
  expect_refused(k::rmsnorm_forward(fake(), fake(), fake(), nullptr, 8, 0, 1e-6f, nullptr), {"rmsnorm_forward: dim = 0"});
  expect_refused(k::rmsnorm_forward(fake(), fake(), fake(), nullptr, 8, 64, -1.0f, nullptr), {"rmsnorm_forward: eps = -1"});
  expect_refused(k::swiglu_forward(fake(), fake(), -3, 64, nullptr), {"swiglu_forward: tokens = -3"});
  expect_refused(k::swiglu_backward(fake(), fake(), fake(), 4, 0, nullptr), {"swiglu_backward: intermediate = 0"});
  expect_refused(k::rope_forward(fake(), fake<std::int32_t>(), fake(), 4, 2, 128, 3, 1e6f, nullptr),
                 {"rope_forward: rotary_dim = 3", "head_dim = 128"});
  expect_refused(k::rope_backward(fake(), fake<std::int32_t>(), fake(), 4, 2, 128, 64, 0.0f, nullptr),
                 {"rope_backward: theta = 0"});
  expect_refused(k::cast_fp32_to_bf16(fake<float>(), fake(), -1, nullptr), {"cast_fp32_to_bf16: n = -1"});
  expect_refused(k::add_bf16(fake(), nullptr, fake(), 16, nullptr), {"add_bf16: b is null"});
  expect_refused(k::repeat_row_bf16(fake(), -1, fake(), 4, nullptr), {"repeat_row_bf16: width = -1, rows = 4"});
  expect_refused(k::repeat_row_bf16(nullptr, 8, fake(), 4, nullptr), {"repeat_row_bf16: row is null"});
  expect_refused(k::repeat_row_bf16(fake(), 8, fake() + 4, 4, nullptr), {"repeat_row_bf16: out overlaps row"});
  expect_refused(k::fill_bf16(nullptr, 16, 1.0f, nullptr), {"fill_bf16: out is null"});
  expect_refused(k::fill_bf16(fake(), -2, 1.0f, nullptr), {"fill_bf16: n = -2"});
  expect_refused(k::embedding_forward(fake<std::int32_t>(), fake(), fake(), fake<std::int32_t>(), 4, 0, 64, nullptr),
                 {"embedding_forward: vocab = 0"});
  expect_refused(k::embedding_forward(fake<std::int32_t>(), fake(), fake(), nullptr, 4, 100, 64, nullptr),
                 {"embedding_forward: invalid_count is null"});
  expect_refused(k::permute_rows(nullptr, k::PermuteShape{8, 0, 4}, 64, fake<std::int32_t>(), fake(), fake()),
                 {"permute_rows: top_k = 0"});
  expect_refused(k::router_forward(nullptr, nullptr, k::RouterShape{4, 64, 2000, 2}, fake(), fake(), fake<float>(),
                                   fake<float>(), fake<std::int32_t>(), fake<float>()),
                 {"router_forward: experts = 2000", std::to_string(k::router_max_experts)});
  expect_refused(k::lm_head_loss(nullptr, nullptr, k::LmHeadShape{4, 64, 100, 0}, fake(), fake(), fake<std::int32_t>(), 1.0f,
                                 fake<float>(), fake<std::int32_t>(), nullptr, nullptr, fake<void>(), 0),
                 {"lm_head_loss: chunk_rows = 0"});
  const auto step = oom::optim::adamw_step_scalars(oom::optim::AdamWConfig{}, 1);
  expect_refused(k::adamw_update(step, fake<float>(), static_cast<float*>(nullptr), fake<float>(), fake<float>(), nullptr, 16, nullptr),
                 {"adamw_update: exp_avg is null"});
  // adamw_update_many checks every segment before it launches any, for either moment type.
  const std::array<k::AdamWSegmentBf16, 2> bf16_moments{
      k::AdamWSegmentBf16{fake<float>(), fake(), fake(), nullptr, nullptr, 16},
      k::AdamWSegmentBf16{fake<float>(), fake(), static_cast<bf16*>(nullptr), nullptr, nullptr, 5}};
  expect_refused(k::adamw_update_many(step, bf16_moments, nullptr), {"adamw_update_many: segment 1: exp_avg_sq is null (n = 5)"});
  const std::array<k::AdamWSegmentBf16, 1> negative{k::AdamWSegmentBf16{fake<float>(), fake(), fake(), nullptr, nullptr, -3}};
  expect_refused(k::adamw_update_many(step, negative, nullptr), {"adamw_update_many: segment 0: n = -3"});
  const std::array<k::AdamWSegment, 1> fp32_moments{k::AdamWSegment{fake<float>(), nullptr, fake<float>(), nullptr, nullptr, 7}};
  expect_refused(k::adamw_update_many(step, fp32_moments, nullptr), {"adamw_update_many: segment 0: exp_avg is null (n = 7)"});
  expect_refused(k::grad_sum_of_squares(fake<float>(), 16, nullptr, fake<void>(), 64, nullptr),
                 {"grad_sum_of_squares: result is null"});
  const std::array<std::int32_t, 3> counts{4, -1, 2};
  expect_refused(k::expert_gate_up_forward(nullptr, nullptr, k::ExpertGemmShape{64, 32, 3, 5}, counts.data(), fake(), fake(),
                                           fake(), k::ExpertGemmMethod::per_expert_loop, nullptr, 0),
                 {"expert_gate_up_forward: counts_host[1] = -1"});
  k::ExpertGemmStreamsOptions many;
  many.streams = 100;
  k::ExpertGemmStreams streams(many);  // creates nothing until first used
  const std::array<std::int32_t, 3> fine{4, 0, 1};
  expect_refused(k::expert_down_forward(nullptr, nullptr, k::ExpertGemmShape{64, 32, 3, 5}, fine.data(), fake(), fake(), fake(),
                                        k::ExpertGemmMethod::multi_stream, fake<void>(), 4096, &streams),
                 {"expert_down_forward: streams->options().streams = 100 (must be 1 .. 64)"});
  // A null array the launch would use: refused, instead of a fault that ends the CUDA context.
  expect_refused(k::rmsnorm_forward(fake(), fake(), nullptr, nullptr, 8, 64, 1e-6f, nullptr), {"rmsnorm_forward: y is null"});
  expect_refused(k::rmsnorm_backward(fake(), fake(), fake(), nullptr, fake(), fake<float>(), 8, 64, fake<void>(), 4096, nullptr),
                 {"rmsnorm_backward: rstd is null"});
  expect_refused(k::rope_backward(fake(), nullptr, fake(), 4, 2, 128, 64, 1e6f, nullptr), {"rope_backward: positions is null"});
  expect_refused(k::accumulate_scaled(nullptr, fake(), 0.5f, 16, nullptr), {"accumulate_scaled: acc is null"});
  expect_refused(k::swiglu_backward(fake(), fake(), nullptr, 4, 64, nullptr), {"swiglu_backward: grad_gate_up is null"});
  expect_refused(k::embedding_backward(fake<std::int32_t>(), fake(), nullptr, fake<std::int32_t>(), 4, 100, 64, fake<void>(),
                                       4096, nullptr),
                 {"embedding_backward: grad_table is null"});
  expect_refused(k::router_forward(nullptr, nullptr, k::RouterShape{4, 64, 8, 2}, fake(), fake(), fake<float>(), fake<float>(),
                                   fake<std::int32_t>(), fake<float>()),
                 {"router_forward: blas is null"});
  expect_refused(k::permute_plan(nullptr, k::PermuteShape{0, 2, 4}, nullptr, nullptr, nullptr, fake<std::int32_t>(), nullptr,
                                 fake<void>(), 4096),
                 {"permute_plan: expert_offsets is null"});  // written even for no tokens
  CHECK(k::permute_plan_workspace_bytes(k::PermuteShape{0, 2, 4}) == 0);  // and no scratch asked for them
  expect_refused(k::unpermute_combine_backward(nullptr, k::PermuteShape{4, 2, 4}, 64, fake<std::int32_t>(), fake(), fake(),
                                               fake<float>(), fake(), nullptr),
                 {"unpermute_combine_backward: d_weights is null"});
  expect_refused(k::shared_expert_gate_forward(nullptr, 4, 64, fake(), nullptr, fake(), nullptr, fake<float>(), fake()),
                 {"shared_expert_gate_forward: w_gate is null"});
  expect_refused(k::expert_down_backward(nullptr, nullptr, k::ExpertGemmShape{64, 32, 3, 5}, fine.data(), fake(), fake(), fake(),
                                         nullptr, fake<float>(), k::ExpertGemmMethod::per_expert_loop, nullptr, 0),
                 {"expert_down_backward: dh is null"});
  expect_refused(k::grad_sum_of_squares(nullptr, 16, fake<double>(), fake<void>(), 64, nullptr),
                 {"grad_sum_of_squares: grads is null"});
  expect_refused(k::grad_sum_of_squares(fake<float>(), 1 << 20, fake<double>(), nullptr, 0, nullptr),
                 {"grad_sum_of_squares: workspace is null, needs " +
                  std::to_string(k::grad_sum_of_squares_workspace_bytes(1 << 20)) + " bytes"});
}

TEST_CASE("attention refusals say which field or tensor") {
  k::AttentionProblem p;
  p.seq = 64;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.softmax_scale = 0.125f;
  const k::TokenRows<const bf16> in{fake(), 64 * 4 * 128, 4 * 128};
  const k::TokenRows<bf16> out{fake(), 64 * 4 * 128, 4 * 128};
  SUBCASE("a head_dim the kernels have no code for") {
    p.head_dim = 64;
    expect_refused(k::attention_forward(p, in, in, in, out, fake<float>(), nullptr), {"attention_forward: head_dim = 64"});
  }
  SUBCASE("query heads not a multiple of the key/value heads") {
    p.heads_q = 3;
    expect_refused(k::attention_forward(p, in, in, in, out, fake<float>(), nullptr),
                   {"attention_forward: heads_q = 3", "heads_kv = 2"});
  }
  SUBCASE("a misaligned tensor, named") {
    const k::TokenRows<const bf16> odd{fake(2), 64 * 4 * 128, 4 * 128};
    expect_refused(k::attention_forward(p, in, odd, in, out, fake<float>(), nullptr),
                   {"attention_forward: k is not 16-byte aligned"});
  }
  SUBCASE("a stride that is no multiple of 8 elements") {
    const k::TokenRows<const bf16> bad{fake(), 64 * 4 * 128, 4 * 128 + 4};
    expect_refused(k::attention_forward(p, in, in, bad, out, fake<float>(), nullptr),
                   {"attention_forward: v's strides", "must be multiples of 8"});
  }
  SUBCASE("the backward's workspace, with the bytes it needs") {
    const std::size_t need = k::attention_backward_workspace_bytes(p);
    expect_refused(k::attention_backward(p, in, in, in, in, in, fake<float>(), out, out, out, false, fake<void>(), 16, nullptr),
                   {"attention_backward: workspace of 16 bytes, needs " + std::to_string(need)});
  }
  SUBCASE("the backward with fp32 dK/dV sums: the sums named, and the problem as for attention_backward") {
    const k::TokenRows<float> sum{fake<float>(), 64 * 2 * 128, 2 * 128};
    const k::TokenRows<float> odd_sum{fake<float>(8), 64 * 2 * 128, 2 * 128};
    const std::size_t need = k::attention_backward_workspace_bytes(p);
    expect_refused(k::attention_backward_dkv_sum(p, in, in, in, in, in, fake<float>(), out, {sum, odd_sum}, fake<void>(), need, nullptr),
                   {"attention_backward_dkv_sum: dv is not 16-byte aligned"});
    expect_refused(k::attention_backward_dkv_sum(p, in, in, in, in, in, fake<float>(), out, {{nullptr, 0, 0}, sum}, fake<void>(), need,
                                                 nullptr),
                   {"attention_backward_dkv_sum: dk is null"});
    expect_refused(k::attention_backward_dkv_sum(p, in, in, in, in, in, fake<float>(), out, {sum, sum}, fake<void>(), 16, nullptr),
                   {"attention_backward_dkv_sum: workspace of 16 bytes, needs " + std::to_string(need)});
    p.head_dim = 64;
    expect_refused(k::attention_backward_dkv_sum(p, in, in, in, in, in, fake<float>(), out, {sum, sum}, fake<void>(), need, nullptr),
                   {"attention_backward_dkv_sum: head_dim = 64"});
  }
}

TEST_CASE("OOM_CUDA_CHECK reports a refusal as a bad argument, with its reason") {
  k::clear_refusal();
  try {
    OOM_CUDA_CHECK(k::swiglu_forward(fake(), fake(), 4, -2, nullptr));
    FAIL("no exception");
  } catch (const oom::Error& e) {
    CHECK(e.code() == oom::Errc::invalid_argument);
    const std::string m = e.message();
    CHECK(m.find("swiglu_forward(fake(), fake(), 4, -2, nullptr)") != std::string::npos);  // the call's text
    CHECK(m.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(m.find("swiglu_forward: intermediate = -2") != std::string::npos);
  }
  CHECK(std::string(k::last_refusal()).empty());  // reported once
}

TEST_CASE("a reason is reported only with the call that gave it") {
  // A refusal nobody checked, then an unrelated invalid-value error: not blamed on the old reason.
  (void)k::swiglu_forward(fake(), fake(), -1, 8, nullptr);
  REQUIRE(std::string(k::last_refusal()).find("swiglu_forward") != std::string::npos);
  const auto unrelated = [] { return cudaErrorInvalidValue; };
  try {
    OOM_CUDA_CHECK(unrelated());
    FAIL("no exception");
  } catch (const oom::Error& e) {
    CHECK(e.code() == oom::Errc::cuda);
    CHECK(e.message().find("swiglu_forward") == std::string::npos);
  }
  // A call that succeeds leaves no reason behind (rows = 0 is a no-op, before any device work).
  k::clear_refusal();
  CHECK(k::rmsnorm_forward(fake(), fake(), fake(), nullptr, 0, 64, 1e-6f, nullptr) == cudaSuccess);
  CHECK(std::string(k::last_refusal()).empty());
}

TEST_CASE("reasons are per thread") {
  k::clear_refusal();
  std::string seen_there;
  std::thread([&] {
    (void)k::swiglu_forward(fake(), fake(), -1, 8, nullptr);
    seen_there = k::last_refusal();
  }).join();
  CHECK(seen_there.find("swiglu_forward: tokens = -1") != std::string::npos);
  CHECK(std::string(k::last_refusal()).empty());
}

TEST_CASE("attention: the launchers accept exactly what attention_can_implement accepts") {
  // With an empty query range no dispatch path (the wgmma kernels' or the portable ones') touches
  // the device, so the launcher's status says whether its checks accept the problem. It must agree
  // with the public predicate on edge values of every field, forward and backward alike. (Both
  // read one list of limits, attention_common.cuh's problem_issue; this checks the launchers' use
  // of it: each path checks, refuses with cudaErrorInvalidValue, and returns early only after.)
  const std::array<int, 7> ints{-2, -1, 0, 1, 64, 65535, 65536};
  const std::array<int, 5> dims{0, 64, 128, 256, 512};
  const std::array<float, 5> scales{0.125f, 0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                                    std::numeric_limits<float>::quiet_NaN()};
  const k::TokenRows<const bf16> in{fake(), 0, 0};
  const k::TokenRows<bf16> out{fake(), 0, 0};
  int accepted = 0, checked = 0;
  for (int batch : ints)
    for (int seq : {-1, 0, 64})
      for (int heads_q : ints)
        for (int heads_kv : {-1, 0, 1, 2, 3})
          for (int head_dim : dims)
            for (float scale : scales)
              for (int q : {-1, 0, 32, 64, 65}) {
                k::AttentionProblem p;
                p.batch = batch, p.seq = seq, p.heads_q = heads_q, p.heads_kv = heads_kv, p.head_dim = head_dim;
                p.softmax_scale = scale, p.q_begin = q, p.q_end = q;
                const bool can = k::attention_can_implement(p);
                const cudaError_t fwd = k::attention_forward(p, in, in, in, out, fake<float>(), nullptr);
                const cudaError_t bwd =
                    k::attention_backward(p, in, in, in, in, in, fake<float>(), out, out, out, false, nullptr, 0, nullptr);
                if (fwd != (can ? cudaSuccess : cudaErrorInvalidValue) || bwd != fwd) {
                  FAIL_CHECK("batch " << batch << " seq " << seq << " heads " << heads_q << "/" << heads_kv << " D "
                                      << head_dim << " scale " << scale << " q " << q << ": can " << can << ", forward "
                                      << fwd << ", backward " << bwd);
                }
                accepted += can;
                ++checked;
              }
  k::clear_refusal();
  CHECK(accepted > 0);
  CHECK(accepted < checked);
}

TEST_CASE("throw_launch_error: the layers' checks carry the reason too") {
  (void)k::rope_forward(fake(), fake<std::int32_t>(), fake(), 4, 0, 128, 64, 1e6f, nullptr);
  try {
    oom::detail::throw_launch_error(cudaErrorInvalidValue, "decoder layer: q rope");
  } catch (const oom::Error& e) {
    CHECK(e.code() == oom::Errc::invalid_argument);
    CHECK(e.message() == "decoder layer: q rope refused: rope_forward: heads = 0 (must be >= 1)");
  }
  try {
    oom::detail::throw_launch_error(cudaErrorInvalidValue, "decoder layer: q rope");
  } catch (const oom::Error& e) {  // the reason was taken: now a plain CUDA error
    CHECK(e.code() == oom::Errc::cuda);
    CHECK(e.message().find("decoder layer: q rope failed: cudaErrorInvalidValue") == 0);
  }
}

TEST_CASE("check_launch: a success forgets a reason left behind, a refusal reports its own") {
  (void)k::rope_forward(fake(), fake<std::int32_t>(), fake(), 4, 0, 128, 64, 1e6f, nullptr);  // unchecked refusal
  oom::detail::check_launch(cudaSuccess, "lm ends", "embed");
  CHECK(std::string(k::last_refusal()).empty());
  CHECK_THROWS_WITH_AS(oom::detail::check_launch(
                           k::rope_forward(fake(), fake<std::int32_t>(), fake(), 4, 2, 128, 63, 1e6f, nullptr), "lm ends", "rope"),
                       doctest::Contains("lm ends: rope refused: rope_forward: rotary_dim = 63"), oom::Error);
  CHECK(std::string(k::last_refusal()).empty());  // taken with the throw
}

TEST_CASE("optional arrays stay optional") {
  // Only where no device can run the launch: past its checks the launcher fails to launch (no
  // driver, no device) with no reason recorded. With a GPU the fake host arrays would be launched
  // on; the gpu tests cover these with real buffers there.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    MESSAGE("a GPU is present: skipped (test_norm_kernels and test_moe_kernels pass these nulls with real buffers)");
    return;
  }
  const auto accepted = [](cudaError_t status, const char* what) {
    const std::string why = k::take_refusal();
    INFO(what << ": status " << cudaGetErrorName(status) << ", reason \"" << why << "\"");
    CHECK(why.empty());
    CHECK(status != cudaErrorInvalidValue);
  };
  k::clear_refusal();
  accepted(k::rmsnorm_forward(fake(), fake(), fake(), nullptr, 8, 64, 1e-6f, nullptr), "rmsnorm_forward, rstd null");
  const auto step = oom::optim::adamw_step_scalars(oom::optim::AdamWConfig{}, 1);
  accepted(k::adamw_update(step, fake<float>(), fake<float>(), fake<float>(), nullptr, nullptr, 16, nullptr),
           "adamw_update, grads and weights_out null");
  accepted(k::shared_expert_gate_forward(nullptr, 4, 64, fake(), fake(), fake(), nullptr, fake<float>(), fake()),
           "shared_expert_gate_forward, routed null");
  accepted(k::permute_plan(nullptr, k::PermuteShape{0, 2, 4}, nullptr, nullptr, nullptr, fake<std::int32_t>(),
                           fake<std::int32_t>(), nullptr, 0),
           "permute_plan, no tokens and no workspace");
}

TEST_CASE("the gated delta rule's refusals name the dims, the array and the workspace") {
  k::clear_refusal();
  k::GatedDeltaDims d{2, 100, 2, 4, 128, 128, 64};
  auto forward = [&](const k::GatedDeltaDims& dims, bf16* out) {
    return k::gated_delta_forward(dims, fake(), fake(), fake(), fake<float>(), fake<float>(), out, fake<float>(), nullptr);
  };
  auto bad = d;
  bad.v_heads = 3;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: k_heads = 2, v_heads = 3", "a multiple of k_heads"});
  bad = d;
  bad.k_dim = 512;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: k_dim = 512, v_dim = 128 (need 1..128 each"});
  bad = d;
  bad.v_dim = 129;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: k_dim = 128, v_dim = 129 (need 1..128 each"});
  bad = d;
  bad.chunk = 0;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: chunk = 0"});
  bad = d;
  bad.seq_len = -1;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: sequences = 2, seq_len = -1"});
  expect_refused(forward(d, nullptr), {"gated_delta_forward: out is null"});
  bad = d;
  bad.states_stride = 2 * 128 * 128;  // 2 chunks + the final state need 3
  expect_refused(forward(bad, fake()), {"gated_delta_forward: states_stride = 32768 is less than (chunks + 1) x k_dim x v_dim = 49152"});
  bad = d;
  bad.qk_stride = 255;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: qk_stride = 255 is less than k_heads x k_dim = 256"});
  // No tokens: nothing to do, nothing refused (null arrays included).
  bad = d;
  bad.seq_len = 0;
  CHECK(k::gated_delta_forward(bad, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr) == cudaSuccess);
  CHECK(k::gated_delta_backward_workspace_bytes(bad) == 0);
  CHECK(k::gated_delta_states_floats(bad) == 0);
  // States: 2 sequences x 4 heads x (2 chunks + the final state) x 128 x 128.
  CHECK(k::gated_delta_states_floats(d) == std::size_t{2} * 4 * 3 * 128 * 128);
  const std::size_t need = k::gated_delta_backward_workspace_bytes(d);
  // Each block's states of one chunk (dk x dv at these dims: 32 rows x 512 threads), then dq and dk per value head.
  CHECK(need == (std::size_t{2} * 4 * 64 * 128 * 128 + std::size_t{2} * 200 * 4 * 128) * sizeof(float));
  expect_refused(k::gated_delta_backward(d, fake(), fake(), fake(), fake<float>(), fake<float>(), fake(), fake<float>(), fake(),
                                         fake(), fake(), fake<float>(), fake<float>(), fake<void>(), 1000, nullptr),
                 {"gated_delta_backward: workspace of 1000 bytes, needs " + std::to_string(need),
                  "gated_delta_backward_workspace_bytes(dims)"});
  expect_refused(k::gated_delta_backward(d, fake(), fake(), fake(), fake<float>(), fake<float>(), fake(), fake<float>(), fake(),
                                         fake(), fake(), nullptr, fake<float>(), fake<void>(), need, nullptr),
                 {"gated_delta_backward: dg is null"});
  bad = d;
  bad.backward = static_cast<k::GatedDeltaDims::Backward>(7);
  expect_refused(k::gated_delta_backward(bad, fake(), fake(), fake(), fake<float>(), fake<float>(), fake(), fake<float>(), fake(),
                                         fake(), fake(), fake<float>(), fake<float>(), fake<void>(), need, nullptr),
                 {"gated_delta_backward: backward = 7 is none of automatic (0), cluster (1), one_block (2)"});
  bad = d;
  bad.form = static_cast<k::GatedDeltaDims::Form>(9);
  expect_refused(forward(bad, fake()), {"gated_delta_forward: form = 9 is none of automatic (0), chunked (1), recurrent (2)"});
  bad = d;
  bad.form = k::GatedDeltaDims::Form::chunked;
  bad.chunk = 128;
  expect_refused(forward(bad, fake()), {"gated_delta_forward: form = chunked takes chunk <= 64, not 128"});
  // The chunked form's scratch: the gradient of every chunk's leaving state (2 sequences x 4 heads
  // x 2 chunks of 128 x 128), then dq and dk per value head.
  bad.chunk = 64;
  CHECK(k::gated_delta_backward_workspace_bytes(bad) == (std::size_t{2} * 4 * 2 * 128 * 128 + std::size_t{2} * 200 * 4 * 128) * sizeof(float));
  // Under `automatic` either form may run: the larger scratch (here the recurrent's, at 100 tokens;
  // the chunked one's from 4,096 tokens a sequence).
  CHECK(need > k::gated_delta_backward_workspace_bytes(bad));
  bad.seq_len = 8192;
  const std::size_t chunked_long = k::gated_delta_backward_workspace_bytes(bad);
  bad.form = k::GatedDeltaDims::Form::automatic;
  CHECK(k::gated_delta_backward_workspace_bytes(bad) == chunked_long);
  // The workspace does not depend on the path (the larger of the two layouts' scratch): at dv = 40
  // one block holds 40 columns (160 threads), a cluster two blocks of 32 (256 threads).
  bad = d;
  bad.v_dim = 40;
  CHECK(k::gated_delta_backward_workspace_bytes(bad) ==
        (std::size_t{2} * 4 * 64 * 32 * 256 + std::size_t{2} * 200 * 4 * 128) * sizeof(float));
}

TEST_CASE("the Gated DeltaNet pieces' refusals name the argument") {
  k::clear_refusal();
  expect_refused(k::causal_conv1d_silu_forward({1, 10, 64, 9, 64}, fake(), fake(), fake(), nullptr),
                 {"causal_conv1d_silu_forward: kernel = 9 (need 1..8)"});
  expect_refused(k::causal_conv1d_silu_forward({1, 10, 64, 4, 32}, fake(), fake(), fake(), nullptr),
                 {"causal_conv1d_silu_forward: x_stride = 32 is less than channels = 64"});
  expect_refused(k::causal_conv1d_silu_forward({1, 10, 64, 4, 64}, fake(), nullptr, fake(), nullptr),
                 {"causal_conv1d_silu_forward: w is null"});
  k::ConvDims part{1, 10, 64, 4, 64};
  part.future = 4;
  expect_refused(k::causal_conv1d_silu_forward(part, fake(), fake(), fake(), nullptr),
                 {"causal_conv1d_silu_forward: history = 0, future = 4 (need 0..kernel - 1 = 3)"});
  part = {1, 10, 64, 4, 64};
  part.future = 1;
  expect_refused(k::causal_conv1d_silu_forward(part, fake(), fake(), fake(), nullptr),
                 {"causal_conv1d_silu_forward: future = 1 (the rows after a part are the backward's; 0 here)"});
  part = {2, 10, 64, 4, 64};
  part.history = 3;
  expect_refused(k::causal_conv1d_silu_forward(part, fake(), fake(), fake(), nullptr),
                 {"history and future rows need one sequence (a part of it), got sequences = 2"});
  const k::ConvDims conv{2, 10, 64, 4, 64};
  const std::size_t need = k::causal_conv1d_silu_backward_workspace_bytes(conv);
  CHECK(need == std::size_t{64} * 4 * sizeof(float));  // one block of 256 tokens
  expect_refused(k::causal_conv1d_silu_backward(conv, fake(), fake(), fake(), fake(), fake<float>(), fake<void>(), need - 4, nullptr),
                 {"causal_conv1d_silu_backward: workspace of " + std::to_string(need - 4) + " bytes, needs " + std::to_string(need)});
  expect_refused(k::delta_gates_forward({10, 4, 3}, fake(), fake(), fake(), fake(), fake<float>(), fake<float>(), nullptr),
                 {"delta_gates_forward: ab_stride = 3 is less than heads = 4"});
  expect_refused(k::delta_gates_backward({10, 4, 8}, fake(), fake(), fake(), fake(), fake<float>(), fake<float>(), fake(), fake(),
                                         nullptr, fake<float>(), fake<void>(), 4096, nullptr),
                 {"delta_gates_backward: dA_log is null"});
  expect_refused(k::gated_rmsnorm_forward({10, 2, 2048, 4096, 1e-6f}, fake(), fake(), fake(), fake(), fake<float>(), nullptr),
                 {"gated_rmsnorm_forward: heads = 2, dim = 2048 (need heads >= 1, dim 1..1024)"});
  expect_refused(k::gated_rmsnorm_forward({10, 2, 64, 100, 1e-6f}, fake(), fake(), fake(), fake(), fake<float>(), nullptr),
                 {"gated_rmsnorm_forward: z_stride = 100 is less than heads x dim = 128"});
  expect_refused(k::gated_rmsnorm_forward({10, 2, 64, 128, 0.0f}, fake(), fake(), fake(), fake(), fake<float>(), nullptr),
                 {"gated_rmsnorm_forward: eps = 0 (must be > 0)"});
}

TEST_CASE("the output gate's refusals name the strides") {
  k::clear_refusal();
  expect_refused(k::output_gate_forward({4, 2, 8, 24, 16}, fake(), fake(), fake(), nullptr),
                 {"output_gate_forward: head_stride = 16, row_stride = 24 (need head_stride >= head_dim and row_stride >= heads x head_stride)"});
  expect_refused(k::output_gate_backward({4, 2, 8, 32, 16}, fake(), fake(), fake(), fake(), nullptr, nullptr),
                 {"output_gate_backward: d_gate is null"});
  CHECK(k::output_gate_forward({0, 2, 8, 32, 16}, nullptr, nullptr, nullptr, nullptr) == cudaSuccess);
}

TEST_CASE("the fused projections' refusals") {
  k::clear_refusal();
  expect_refused(k::deltanet_unfuse_projections({4, 2, 3, 8, 8}, fake(), fake(), fake(1024), fake(2048), false, nullptr),
                 {"deltanet_unfuse_projections: tokens = 4, k_heads = 2, v_heads = 3", "v_heads a multiple of k_heads"});
  expect_refused(k::deltanet_unfuse_projections({4, 2, 4, 8, 8}, fake(), fake(512), fake(), fake(2048), false, nullptr),
                 {"deltanet_unfuse_projections: the source and destination are the same array"});
  expect_refused(k::deltanet_unfuse_projections({4, 2, 4, 8, 8}, fake(), nullptr, fake(1024), fake(2048), true, nullptr),
                 {"deltanet_unfuse_projections: ba_src is null"});
}
