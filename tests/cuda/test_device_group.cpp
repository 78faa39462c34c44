// A group of the node's GPUs: NCCL collectives move and sum the right floats, give the same bits
// every time, and an all-reduce gives each shard the bits its owner's reduce-scatter gives
// (docs/multi-gpu.md, contract 2). Over every visible GPU; the sums across GPUs need two of them
// (device kind nvidia-h200-x2): with one, the collectives run over a group of one and say so.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/device_buffer.hpp"
#include "oom/core/error.hpp"
#include "oom/cuda/device.hpp"
#include "oom/cuda/device_group.hpp"

using oom::Errc;
using oom::cuda::DeviceGroup;
using oom::test::DeviceBuffer;

namespace {

/// One poisoned buffer of `n` floats on each GPU of the group.
std::vector<DeviceBuffer<float>> buffers(const DeviceGroup& g, std::size_t n) {
  std::vector<DeviceBuffer<float>> out;
  for (int r = 0; r < g.size(); ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(r));
    out.emplace_back(n);
    OOM_CUDA_CHECK(cudaDeviceSynchronize());  // the poison is on the legacy stream; the group's are non-blocking
  }
  return out;
}

void upload(std::vector<DeviceBuffer<float>>& b, const std::vector<std::vector<float>>& host) {
  for (std::size_t r = 0; r < b.size(); ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(static_cast<int>(r)));
    b[r].upload(host[r]);
    OOM_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable copy may return early; the group's streams do not wait for it
  }
}

std::vector<std::vector<float>> download(const std::vector<DeviceBuffer<float>>& b) {
  std::vector<std::vector<float>> out;
  for (std::size_t r = 0; r < b.size(); ++r) {
    OOM_CUDA_CHECK(cudaSetDevice(static_cast<int>(r)));
    out.push_back(b[r].download());
  }
  return out;
}

template <class T>
std::vector<T> pointers(const std::vector<DeviceBuffer<float>>& b) {
  std::vector<T> out;
  for (const auto& buffer : b) out.push_back(buffer.get());
  return out;
}

bool same_bits(const std::vector<float>& a, const float* b, std::size_t n) {
  return a.size() >= n && std::memcmp(a.data(), b, n * sizeof(float)) == 0;
}

void say_group(const DeviceGroup& g) {
  if (g.size() < 2)
    std::printf("NOTE: 1 GPU visible: the collectives run over a group of one here; the sums across GPUs need "
                "two (device kind nvidia-h200-x2)\n");
  else
    std::printf("group of %d GPUs: %s ...\n", g.size(), g.info(0).name.c_str());
}

}  // namespace

TEST_CASE("a group larger than the GPUs visible, or of none, is refused by name") {
  const int n = oom::cuda::device_count();
  try {
    DeviceGroup g(n + 1);
    FAIL("a group of more GPUs than are visible was made");
  } catch (const oom::Error& e) {
    CHECK(e.code() == Errc::unsupported);
    CHECK(e.message().find(std::to_string(n + 1) + " GPUs asked for, but " + std::to_string(n)) != std::string::npos);
  }
  CHECK_THROWS_AS(DeviceGroup(0), oom::Error);
}

TEST_CASE("reduce-scatter and all-gather move and sum the right floats, exactly") {
  DeviceGroup g(oom::cuda::device_count());
  say_group(g);
  const auto G = static_cast<std::size_t>(g.size());
  const std::size_t shard = 100'003;  // odd: no multiple of any vector width
  const std::size_t count = shard * G;
  // Integers below 2^24 sum exactly in any order: every element has one right answer.
  std::vector<std::vector<float>> in(G, std::vector<float>(count));
  for (std::size_t r = 0; r < G; ++r)
    for (std::size_t i = 0; i < count; ++i) in[r][i] = static_cast<float>((r + 1) * 1000 + i % 977);
  auto send = buffers(g, count);
  auto recv = buffers(g, shard);
  upload(send, in);
  g.reduce_scatter_sum(pointers<const float*>(send), pointers<float*>(recv), count);
  g.synchronize();
  const auto got = download(recv);
  for (std::size_t r = 0; r < G; ++r) {
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < shard; ++j) {
      float want = 0;
      for (std::size_t q = 0; q < G; ++q) want += in[q][r * shard + j];
      wrong += got[r][j] != want;
    }
    CAPTURE(r);
    CHECK(wrong == 0);
  }

  // All-gather: rank r's shard lands at r * shard in every rank's buffer.
  auto whole = buffers(g, count);
  g.all_gather(pointers<const float*>(recv), pointers<float*>(whole), count);
  g.synchronize();
  for (const auto& w : download(whole))
    for (std::size_t r = 0; r < G; ++r) CHECK(same_bits(got[r], w.data() + r * shard, shard));
}

TEST_CASE("all-reduce: the same bits on every GPU, every time, and each shard as its owner's reduce-scatter") {
  DeviceGroup g(oom::cuda::device_count());
  say_group(g);
  const auto G = static_cast<std::size_t>(g.size());
  const std::size_t count = 65'537 * G + (G - 1);  // a tail of G - 1 floats outside the shards
  const std::size_t shard = g.shard(count);
  REQUIRE(shard == 65'537);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> in(G, std::vector<float>(count));
  for (auto& v : in)
    for (auto& x : v) x = normal(rng) * 1e-3f;

  auto data = buffers(g, count);
  upload(data, in);
  g.all_reduce_sum(pointers<float*>(data), count);
  g.synchronize();
  const auto first = download(data);
  for (std::size_t r = 1; r < G; ++r) CHECK(same_bits(first[0], first[r].data(), count));
  // Against the CPU: two addends sum to the same bits in either order; more, within fp32 rounding.
  std::size_t off = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double sum = 0;
    for (std::size_t r = 0; r < G; ++r) sum += in[r][i];
    if (G <= 2) {
      float f = 0;
      for (std::size_t r = 0; r < G; ++r) f += in[r][i];
      off += first[0][i] != f;
    } else {
      off += std::abs(first[0][i] - sum) > 1e-6 * (1.0 + std::abs(sum)) * static_cast<double>(G);
    }
  }
  CHECK(off == 0);

  // Again from the same inputs: the same bits (one reduction order for the run).
  upload(data, in);
  g.all_reduce_sum(pointers<float*>(data), count);
  g.synchronize();
  const auto again = download(data);
  CHECK(same_bits(first[0], again[0].data(), count));

  // Each shard as the reduce-scatter gives its owner (what a streamed segment's gradient gets).
  const std::size_t body = shard * G;
  auto send = buffers(g, body);
  auto recv = buffers(g, shard);
  std::vector<std::vector<float>> body_in;
  for (const auto& v : in) body_in.emplace_back(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(body));
  upload(send, body_in);
  g.reduce_scatter_sum(pointers<const float*>(send), pointers<float*>(recv), body);
  g.synchronize();
  const auto owned = download(recv);
  for (std::size_t r = 0; r < G; ++r) {
    CAPTURE(r);
    CHECK(same_bits(owned[r], first[0].data() + r * shard, shard));
  }
}

TEST_CASE("collectives refuse buffers that do not match the group, and leave the caller's device current") {
  DeviceGroup g(oom::cuda::device_count());
  const auto G = static_cast<std::size_t>(g.size());
  auto data = buffers(g, 4 * G);
  auto ptrs = pointers<float*>(data);
  ptrs.push_back(ptrs.back());
  try {
    g.all_reduce_sum(ptrs, 4 * G);
    FAIL("one buffer too many was taken");
  } catch (const oom::Error& e) {
    CHECK(e.code() == Errc::invalid_argument);
    CHECK(e.message().find(std::to_string(G + 1) + " data buffers for a group of " + std::to_string(G)) !=
          std::string::npos);
  }
  if (G > 1) {
    try {
      g.reduce_scatter_sum(pointers<const float*>(data), pointers<float*>(data), 4 * G + 1);
      FAIL("a count that does not split into equal shards was taken");
    } catch (const oom::Error& e) {
      CHECK(e.code() == Errc::invalid_argument);
      CHECK(e.message().find("do not split into") != std::string::npos);
    }
  }
  // The collectives and synchronize() end on the group's last GPU: the caller's, GPU 0, is restored.
  OOM_CUDA_CHECK(cudaSetDevice(0));
  g.all_reduce_sum(pointers<float*>(data), 4 * G);
  g.synchronize();
  int current = -1;
  OOM_CUDA_CHECK(cudaGetDevice(&current));
  CHECK(current == 0);
  // A rank outside the group, and a moved-from group, are refused by name.
  const std::string outside = "rank " + std::to_string(G) + " of a group of";
  CHECK_THROWS_WITH_AS((void)g.stream(g.size()), doctest::Contains(outside.c_str()), oom::Error);
  DeviceGroup moved = std::move(g);
  CHECK(g.size() == 0);  // NOLINT(bugprone-use-after-move): what a moved-from group answers
  CHECK_THROWS_WITH_AS(g.synchronize(), doctest::Contains("moved from"), oom::Error);  // NOLINT(bugprone-use-after-move)
  CHECK(moved.size() == static_cast<int>(G));
}

TEST_CASE("a group made and destroyed leaves the caller's device current") {
  const int n = oom::cuda::device_count();
  OOM_CUDA_CHECK(cudaSetDevice(0));
  { DeviceGroup g(n); }
  int current = -1;
  OOM_CUDA_CHECK(cudaGetDevice(&current));
  CHECK(current == 0);
}
