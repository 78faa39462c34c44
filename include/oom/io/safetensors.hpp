// safetensors: the checkpoint format Hugging Face models ship in, read by memory map and written
// atomically. Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {string: string}, "<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ...}
// then the data section; offsets are relative to the data section.
//
// The reader validates as the reference implementation (huggingface/safetensors, tensor.rs) does,
// and names the file, the tensor and the numbers in every error (all Errc::parse):
//   - N <= 100 000 000 and 8 + N <= file size; the header is one JSON object (UTF-8, no duplicate keys);
//   - each tensor has a known dtype, a shape of non-negative integers and data_offsets [b, e], b <= e;
//   - elements(shape) * size(dtype) == e - b, computed without overflow;
//   - sorted by offset, the tensors tile the data section exactly: no overlap, no gap, ending at
//     the end of the file.
// Alignment is not part of the format (files written by other tools may not be aligned), so it is
// not checked; the reference writer (and ours) produce aligned data by padding the header to 8
// bytes and ordering tensors by decreasing dtype alignment.
//
// Dtypes: BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I32 I64 U8 U16 U32 (those oom::DType has). The format's
// BOOL, I8, I16 and U64 are refused as unsupported, by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oom/core/bytes.hpp"
#include "oom/core/dtype.hpp"
#include "oom/io/atomic_file.hpp"

namespace oom {

struct TensorSpec;

/// The largest header the reader accepts, as the reference implementation.
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

/// The safetensors spelling of a dtype: "BF16", "F32", "F8_E4M3", "I64", "U8", ...
std::string_view safetensors_dtype_name(DType t);

/// One tensor of a safetensors file: a view into the file's bytes.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::fp32;
  std::vector<std::uint64_t> shape;
  std::uint64_t data_begin = 0;  ///< data_offsets[0], relative to the data section
  std::span<const std::byte> data;

  [[nodiscard]] std::uint64_t elements() const;
};

/// A validated safetensors file (or buffer). Tensor views stay valid while this object lives
/// (moving it keeps them valid).
class SafetensorsFile {
 public:
  using Metadata = std::vector<std::pair<std::string, std::string>>;

  /// Maps `path` read-only and validates it. Errc::io when it cannot be read, Errc::parse when it
  /// is not a valid safetensors file.
  [[nodiscard]] static SafetensorsFile open(const std::filesystem::path& path);
  /// Validates a whole file held in memory, without copying: `bytes` must outlive the result.
  /// `source` names it in errors. The fuzzers and tests enter here.
  [[nodiscard]] static SafetensorsFile parse(std::span<const std::byte> bytes, std::string_view source);

  /// In data order (increasing data_offsets).
  [[nodiscard]] const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  /// nullptr when absent.
  [[nodiscard]] const SafetensorsTensor* find(std::string_view name) const;
  /// Errc::parse "<file>: no tensor '<name>'" when absent.
  [[nodiscard]] const SafetensorsTensor& at(std::string_view name) const;
  /// The bytes of a model tensor as ModelSpec names it: the tensor `spec.name` of shape `spec.shape`
  /// or, for a packed expert (spec.stacked_index >= 0), slice stacked_index of the tensor `spec.name`
  /// of shape [stacked_count, spec.shape...]. Errc::parse naming file, tensor and both shapes when
  /// it is absent or shaped otherwise.
  [[nodiscard]] std::span<const std::byte> tensor_bytes(const TensorSpec& spec, DType* dtype = nullptr) const;

  /// Takes the file's pages wholly inside `bytes` (e.g. a tensor's, once read) out of the resident
  /// set (MappedFile::drop_pages); the views stay valid. Nothing for a parsed buffer.
  void drop_pages(std::span<const std::byte> bytes) const noexcept { map_.drop_pages(bytes); }

  /// `__metadata__` in file order; empty when absent.
  [[nodiscard]] const Metadata& metadata() const { return metadata_; }
  /// N, the JSON header's length (with its padding).
  [[nodiscard]] Bytes header_bytes() const { return Bytes{header_bytes_}; }
  [[nodiscard]] const std::string& source() const { return source_; }

 private:
  SafetensorsFile() = default;
  void validate(std::span<const std::byte> bytes);

  std::string source_;
  MappedFile map_;
  std::uint64_t header_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string_view, std::size_t> index_;  ///< keys view tensors_[i].name
  Metadata metadata_;
};

/// A tensor to write. Its bytes come from `fill(offset, out)`, which must write bytes
/// [offset, offset + out.size()) of the tensor (little-endian, row-major) into `out`; the writer
/// calls it in increasing offset order with chunks of a few MiB (8 MiB), so a tensor never has to
/// exist whole in memory (a stack of experts gathered from their segments, a device download).
/// `offset` and out.size() are whole elements of `dtype`, and `out` is aligned for it (at least 16
/// bytes): a fill may view it as the element type. Each call runs on a thread of the writer's (the
/// next piece is filled while the last is written), one call at a time, each after the one before
/// has returned; an exception it throws ends the write with it.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::fp32;
  std::vector<std::uint64_t> shape;
  std::function<void(std::uint64_t offset, std::span<std::byte> out)> fill;

  /// An entry whose bytes are `data` (which must outlive the write and hold exactly the tensor).
  [[nodiscard]] static SafetensorsEntry view(std::string name, DType dtype, std::vector<std::uint64_t> shape,
                                             std::span<const std::byte> data);
};

/// Writes a safetensors file atomically (see AtomicFile). Tensors are laid out as the reference
/// writer does: by decreasing dtype alignment, then by name; the header is padded with spaces to a
/// multiple of 8 bytes, so every tensor is aligned to its element size. Errc::invalid_argument
/// for an empty, duplicate or reserved name, or a view whose size does not match its shape.
void write_safetensors(const std::filesystem::path& path, std::vector<SafetensorsEntry> tensors,
                       const SafetensorsFile::Metadata& metadata = {});
/// As write_safetensors, into memory (tests, fuzz seeds, small files).
[[nodiscard]] std::vector<std::byte> serialize_safetensors(std::vector<SafetensorsEntry> tensors,
                                                           const SafetensorsFile::Metadata& metadata = {});

}  // namespace oom
