// DType sizes and names, including the spellings of safetensors headers and config.json.
#include <doctest/doctest.h>

#include "oom/core/dtype.hpp"
#include "oom/core/error.hpp"

using namespace oom;

TEST_CASE("element sizes") {
  CHECK(size_of(DType::bf16) == 2);
  CHECK(size_of(DType::fp16) == 2);
  CHECK(size_of(DType::fp32) == 4);
  CHECK(size_of(DType::fp8_e4m3) == 1);
  CHECK(size_of(DType::fp8_e5m2) == 1);
  CHECK(size_of(DType::int64) == 8);
  CHECK(bytes_of(DType::bf16, 1000) == Bytes{2000});
  static_assert(size_of(DType::fp32) == 4, "usable in constant expressions");
  CHECK(is_floating(DType::fp8_e4m3));
  CHECK_FALSE(is_floating(DType::uint16));
}

TEST_CASE("names round-trip and foreign spellings parse") {
  for (auto t : {DType::bf16, DType::fp16, DType::fp32, DType::fp64, DType::fp8_e4m3, DType::fp8_e5m2, DType::int32,
                 DType::int64, DType::uint8, DType::uint16, DType::uint32})
    CHECK(parse_dtype(name(t)) == t);
  CHECK(parse_dtype("BF16") == DType::bf16);
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK(parse_dtype("F8_E4M3") == DType::fp8_e4m3);
  CHECK(parse_dtype("float32") == DType::fp32);
  CHECK_THROWS_AS((void)parse_dtype("complex64"), Error);
}
