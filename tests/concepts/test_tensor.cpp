// tensor_like conformance: a framework-like tensor adapted through tensor_traits and OOM's own
// TensorView satisfy it; near misses do not.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "oom/concepts/tensor.hpp"
#include "oom/core/error.hpp"

namespace framework {
// Looks like a tensor of some other framework: its own dtype enum, its own shape type, a device id.
enum class ScalarType { Half, BFloat16, Float };
struct Tensor {
  void* storage = nullptr;
  ScalarType scalar = ScalarType::Float;
  std::vector<long> sizes;
  int device = -1;  // -1: CPU
  bool pinned = false;
};
// Members that look right, but no opt-in and no traits: must not be taken for a tensor.
struct Lookalike {
  void* data() const { return nullptr; }
  oom::DType dtype() const { return oom::DType::fp32; }
  std::vector<long> shape() const { return {}; }
  oom::MemorySpace space() const { return {}; }
};
struct WrongDtype {};
struct NoSpace {};
}  // namespace framework

template <>
struct oom::tensor_traits<framework::Tensor> {
  static void* data(const framework::Tensor& t) { return t.storage; }
  static oom::DType dtype(const framework::Tensor& t) {
    switch (t.scalar) {
      case framework::ScalarType::Half: return oom::DType::fp16;
      case framework::ScalarType::BFloat16: return oom::DType::bf16;
      case framework::ScalarType::Float: return oom::DType::fp32;
    }
    return oom::DType::fp32;
  }
  static const std::vector<long>& shape(const framework::Tensor& t) { return t.sizes; }
  static oom::MemorySpace space(const framework::Tensor& t) {
    if (t.device >= 0) return oom::MemorySpace::device(t.device);
    return t.pinned ? oom::MemorySpace::pinned_host() : oom::MemorySpace::pageable_host();
  }
};
template <>
struct oom::tensor_traits<framework::WrongDtype> {  // dtype as an int: requirement 2 broken
  static void* data(const framework::WrongDtype&) { return nullptr; }
  static int dtype(const framework::WrongDtype&) { return 0; }
  static std::vector<long> shape(const framework::WrongDtype&) { return {}; }
  static oom::MemorySpace space(const framework::WrongDtype&) { return {}; }
};
template <>
struct oom::tensor_traits<framework::NoSpace> {  // requirement 4 missing
  static void* data(const framework::NoSpace&) { return nullptr; }
  static oom::DType dtype(const framework::NoSpace&) { return oom::DType::fp32; }
  static std::vector<long> shape(const framework::NoSpace&) { return {}; }
};

static_assert(oom::tensor_like<framework::Tensor>);
static_assert(oom::tensor_like<const framework::Tensor&>);
static_assert(oom::tensor_like<oom::TensorView>);
static_assert(!oom::tensor_like<framework::Lookalike>, "members alone must not opt a type in");
static_assert(!oom::tensor_like<framework::WrongDtype>);
static_assert(!oom::tensor_like<framework::NoSpace>);
static_assert(!oom::tensor_like<float*>);
static_assert(!oom::tensor_like<std::vector<float>>);

TEST_CASE("a framework tensor is read through its traits") {
  std::vector<std::uint16_t> storage(2 * 3 * 5);
  framework::Tensor t{storage.data(), framework::ScalarType::BFloat16, {2, 3, 5}, 1, false};
  CHECK(oom::data_of(t) == storage.data());
  CHECK(oom::dtype_of(t) == oom::DType::bf16);
  CHECK(oom::space_of(t) == oom::MemorySpace::device(1));
  CHECK(oom::numel(t) == 30);
  CHECK(oom::nbytes(t) == oom::Bytes{60});
  t.device = -1;
  t.pinned = true;
  CHECK(oom::space_of(t) == oom::MemorySpace::pinned_host());
}

TEST_CASE("TensorView describes caller-owned memory") {
  std::vector<float> buf(4 * 7);
  oom::TensorView v(buf.data(), oom::DType::fp32, {4, 7}, oom::MemorySpace::pageable_host());
  CHECK(v.shape().size() == 2);
  CHECK(oom::numel(v) == 28);
  CHECK(oom::nbytes(v) == oom::Bytes{112});
  oom::TensorView scalar(buf.data(), oom::DType::fp32, {}, oom::MemorySpace::pageable_host());
  CHECK(oom::numel(scalar) == 1);
  CHECK_THROWS_AS(oom::TensorView(buf.data(), oom::DType::fp32, {1, 1, 1, 1, 1, 1, 1}, oom::MemorySpace{}), oom::Error);
}
