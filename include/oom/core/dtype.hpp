// Element types OOM stores and moves. Host-parsable; no CUDA headers.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string_view>

#include "oom/core/bytes.hpp"

namespace oom {

enum class DType : std::uint8_t {
  bf16,
  fp16,
  fp32,
  fp64,
  fp8_e4m3,  ///< storage only: OCP FP8, 4 exponent bits, 3 mantissa bits, no infinities
  fp8_e5m2,  ///< storage only: OCP FP8, 5 exponent bits, 2 mantissa bits
  int32,
  int64,
  uint8,
  uint16,
  uint32,
};

/// Bytes of one element.
constexpr std::uint64_t size_of(DType t) {
  switch (t) {
    case DType::fp8_e4m3:
    case DType::fp8_e5m2:
    case DType::uint8: return 1;
    case DType::bf16:
    case DType::fp16:
    case DType::uint16: return 2;
    case DType::fp32:
    case DType::int32:
    case DType::uint32: return 4;
    case DType::fp64:
    case DType::int64: return 8;
  }
  return 0;
}

/// Bytes of `elements` elements of type `t`.
constexpr Bytes bytes_of(DType t, std::uint64_t elements) { return Bytes{size_of(t) * elements}; }

constexpr bool is_floating(DType t) {
  return t != DType::int32 && t != DType::int64 && t != DType::uint8 && t != DType::uint16 &&
         t != DType::uint32;
}

/// Short lowercase name: "bf16", "fp32", "fp8_e4m3", ...
std::string_view name(DType t);
/// Inverse of name(); also accepts the safetensors spellings ("BF16", "F32", "F8_E4M3", "I64", ...)
/// and "bfloat16"/"float32"/"float16" as in config.json's torch_dtype. Throws oom::Error otherwise.
DType parse_dtype(std::string_view text);
std::ostream& operator<<(std::ostream& os, DType t);

}  // namespace oom
