// safetensors reader (strict validation over a read-only map) and writer (reference layout, atomic).
#include "oom/io/safetensors.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <future>
#include <optional>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/model/segment.hpp"

namespace oom {
namespace {

struct DtypeSpelling {
  std::string_view text;
  DType type;
};
// Descending in the reference writer's order: its Dtype enum lists dtypes by increasing alignment,
// and it writes tensors by decreasing enum order. rank = position here (0 first).
constexpr DtypeSpelling dtype_spellings[] = {
    {"I64", DType::int64},   {"F64", DType::fp64},         {"F32", DType::fp32},         {"U32", DType::uint32},
    {"I32", DType::int32},   {"BF16", DType::bf16},        {"F16", DType::fp16},         {"U16", DType::uint16},
    {"F8_E4M3", DType::fp8_e4m3}, {"F8_E5M2", DType::fp8_e5m2}, {"U8", DType::uint8},
};
constexpr std::string_view format_only_dtypes[] = {"BOOL", "I8", "I16", "U64"};

std::optional<DType> dtype_from_name(std::string_view text) {
  for (const auto& s : dtype_spellings)
    if (s.text == text) return s.type;
  return std::nullopt;
}

int write_rank(DType t) {
  for (std::size_t i = 0; i < std::size(dtype_spellings); ++i)
    if (dtype_spellings[i].type == t) return static_cast<int>(i);
  return static_cast<int>(std::size(dtype_spellings));
}

std::string shape_text(std::span<const std::uint64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

/// a * b, or nullopt on overflow.
std::optional<std::uint64_t> mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// "an array", "a string": JSON types in messages.
std::string a(Json::Type t) {
  const std::string name = to_string(t);
  return (name[0] == 'a' || name[0] == 'o' ? "an " : "a ") + name;
}

/// A JSON value usable as a size or offset.
bool is_count(const Json& j) { return j.is_integer() && j.as_double() >= 0; }

std::optional<std::uint64_t> elements_of(std::span<const std::uint64_t> shape) {
  std::uint64_t n = 1;
  for (auto d : shape) {
    const auto m = mul(n, d);
    if (!m) return std::nullopt;
    n = *m;
  }
  return n;
}

}  // namespace

std::string_view safetensors_dtype_name(DType t) {
  for (const auto& s : dtype_spellings)
    if (s.type == t) return s.text;
  return "?";
}

std::uint64_t SafetensorsTensor::elements() const {
  std::uint64_t n = 1;
  for (auto d : shape) n *= d;  // validated not to overflow when read
  return n;
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  SafetensorsFile f;
  f.source_ = path.string();
  f.map_ = MappedFile(path);
  f.validate(f.map_.bytes());
  return f;
}

SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes, std::string_view source) {
  SafetensorsFile f;
  f.source_ = std::string(source);
  f.validate(bytes);
  return f;
}

void SafetensorsFile::validate(std::span<const std::byte> bytes) {
  const auto fail = [&](const std::string& what) { OOM_THROW(Errc::parse, source_ + ": " + what); };
  const std::uint64_t file_bytes = bytes.size();
  if (file_bytes < 8)
    fail(fmt::format("file is {} bytes, too short for the 8-byte header length", file_bytes));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(bytes[static_cast<std::size_t>(i)]);
  if (n > safetensors_max_header_bytes)
    fail(fmt::format("header length {} exceeds the limit of {} bytes", n, safetensors_max_header_bytes));
  if (n > file_bytes - 8)
    fail(fmt::format("header length {} runs past the end of the file ({} bytes, {} after the length)", n,
                     file_bytes, file_bytes - 8));
  header_bytes_ = n;
  const std::uint64_t data_bytes = file_bytes - 8 - n;
  const std::byte* data = bytes.data() + 8 + n;

  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  // Json::parse names the source and the line:column of a syntax error.
  const Json header = Json::parse(text, source_ + " (header)");
  if (!header.is_object()) fail(fmt::format("header is {}, not a JSON object", a(header.type())));

  for (const auto& member : header.as_object()) {
    // Named references rather than a structured binding: lambdas below capture them (C++20 allows
    // capturing bindings, clang 14 does not).
    const std::string& name = member.first;
    const Json& value = member.second;
    if (name == "__metadata__") {
      if (value.is_null()) continue;  // the reference reads it as an Option
      if (!value.is_object()) fail(fmt::format("__metadata__ is {}, not an object of strings", a(value.type())));
      for (const auto& [key, v] : value.as_object()) {
        if (!v.is_string())
          fail(fmt::format("__metadata__ '{}' is {}, not a string", key, a(v.type())));
        metadata_.emplace_back(key, v.as_string());
      }
      continue;
    }
    const auto bad = [&](const std::string& what) { fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!value.is_object()) bad(fmt::format("is {}, not an object", a(value.type())));
    const Json* dtype_j = value.find("dtype");
    const Json* shape_j = value.find("shape");
    const Json* offsets_j = value.find("data_offsets");
    if (dtype_j == nullptr) bad("missing \"dtype\"");
    if (shape_j == nullptr) bad("missing \"shape\"");
    if (offsets_j == nullptr) bad("missing \"data_offsets\"");
    if (!dtype_j->is_string()) bad(fmt::format("dtype is {}, not a string", a(dtype_j->type())));
    const std::string& dtype_name = dtype_j->as_string();
    const auto dtype = dtype_from_name(dtype_name);
    if (!dtype) {
      if (std::find(std::begin(format_only_dtypes), std::end(format_only_dtypes), dtype_name) !=
          std::end(format_only_dtypes))
        bad(fmt::format("dtype {} is not supported by OOM", dtype_name));
      bad(fmt::format("unknown dtype \"{}\" (expected one of BF16, F16, F32, F64, F8_E4M3, F8_E5M2, I32, I64, "
                      "U8, U16, U32)",
                      dtype_name));
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = *dtype;
    if (!shape_j->is_array()) bad(fmt::format("shape is {}, not an array", a(shape_j->type())));
    for (const Json& d : shape_j->as_array()) {
      if (!is_count(d)) bad(fmt::format("shape {} holds {}, not a non-negative integer", shape_j->dump(), d.dump()));
      t.shape.push_back(d.as_uint64());
    }
    if (!offsets_j->is_array() || offsets_j->size() != 2 || !is_count(offsets_j->as_array()[0]) ||
        !is_count(offsets_j->as_array()[1]))
      bad(fmt::format("data_offsets {} is not [begin, end] of two non-negative integers", offsets_j->dump()));
    const std::uint64_t begin = offsets_j->as_array()[0].as_uint64();
    const std::uint64_t end = offsets_j->as_array()[1].as_uint64();
    if (end < begin) bad(fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    if (end > data_bytes)
      bad(fmt::format("data_offsets [{}, {}] run past the end of the data section ({} bytes)", begin, end,
                      data_bytes));
    const auto elements = elements_of(t.shape);
    const auto needed = elements ? mul(*elements, size_of(t.dtype)) : std::nullopt;
    if (!needed)
      bad(fmt::format("shape {} {} overflows 64-bit byte counts", shape_text(t.shape), safetensors_dtype_name(t.dtype)));
    if (*needed != end - begin)
      bad(fmt::format("shape {} {} needs {} bytes, data_offsets [{}, {}] give {}", shape_text(t.shape),
                      safetensors_dtype_name(t.dtype), *needed, begin, end, end - begin));
    t.data_begin = begin;
    t.data = std::span(data + begin, end - begin);
    tensors_.push_back(std::move(t));
  }

  // The tensors must tile the data section: sorted by offset, each begins where the previous ends.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data.size() < b.data.size();
  });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    const std::uint64_t end = t.data_begin + t.data.size();
    if (t.data_begin < covered)
      fail(fmt::format("tensor '{}' data_offsets [{}, {}] overlap tensor '{}' ending at {}", t.name, t.data_begin, end,
                       tensors_[i - 1].name, covered));
    if (t.data_begin > covered)
      fail(fmt::format("data bytes [{}, {}) belong to no tensor (before tensor '{}')", covered, t.data_begin, t.name));
    covered = end;
  }
  if (covered != data_bytes)
    fail(fmt::format("data bytes [{}, {}) at the end of the file belong to no tensor", covered, data_bytes));

  index_.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensor& SafetensorsFile::at(std::string_view name) const {
  if (const auto* t = find(name)) return *t;
  OOM_THROW(Errc::parse, fmt::format("{}: no tensor '{}'", source_, name));
}

std::span<const std::byte> SafetensorsFile::tensor_bytes(const TensorSpec& spec, DType* dtype) const {
  const SafetensorsTensor& t = at(spec.name);
  if (dtype != nullptr) *dtype = t.dtype;
  std::vector<std::uint64_t> expected;
  if (spec.stacked_index >= 0) expected.push_back(spec.stacked_count);
  expected.insert(expected.end(), spec.shape.begin(), spec.shape.end());
  if (t.shape != expected)
    OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' has shape {}, the model expects {}", source_, spec.name,
                                       shape_text(t.shape), shape_text(expected)));
  if (spec.stacked_index < 0) return t.data;
  if (static_cast<std::uint64_t>(spec.stacked_index) >= spec.stacked_count)
    OOM_THROW(Errc::invalid_argument, fmt::format("tensor '{}': stacked index {} out of {}", spec.name,
                                                  spec.stacked_index, spec.stacked_count));
  const std::uint64_t slice = t.data.size() / spec.stacked_count;
  return t.data.subspan(static_cast<std::uint64_t>(spec.stacked_index) * slice, slice);
}

// ---- writer -------------------------------------------------------------------------------------

SafetensorsEntry SafetensorsEntry::view(std::string name, DType dtype, std::vector<std::uint64_t> shape,
                                        std::span<const std::byte> data) {
  const auto elements = elements_of(shape);
  const auto needed = elements ? mul(*elements, size_of(dtype)) : std::nullopt;
  if (!needed || *needed != data.size())
    OOM_THROW(Errc::invalid_argument,
              fmt::format("tensor '{}': shape {} {} needs {} bytes, the view holds {}", name, shape_text(shape),
                          safetensors_dtype_name(dtype), needed ? fmt::to_string(*needed) : "2^64+", data.size()));
  SafetensorsEntry e{std::move(name), dtype, std::move(shape), {}};
  e.fill = [data](std::uint64_t offset, std::span<std::byte> out) {
    std::memcpy(out.data(), data.data() + offset, out.size());
  };
  return e;
}

namespace {

struct Layout {
  std::string header;  ///< padded JSON
  std::vector<std::uint64_t> bytes;  ///< per (sorted) tensor
};

Layout lay_out(std::vector<SafetensorsEntry>& tensors, const SafetensorsFile::Metadata& metadata) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    const int ra = write_rank(a.dtype), rb = write_rank(b.dtype);
    return ra != rb ? ra < rb : a.name < b.name;
  });
  // Members are collected and checked for duplicates by hash, not Json::set/find (a scan per
  // key): an optimizer file of a large model has 100k+ tensors.
  Json::Object members;
  members.reserve(tensors.size() + 1);
  if (!metadata.empty()) {
    Json::Object m;
    std::unordered_set<std::string_view> keys;
    for (const auto& [k, v] : metadata) {
      if (!keys.insert(k).second) OOM_THROW(Errc::invalid_argument, fmt::format("__metadata__: duplicate key '{}'", k));
      m.emplace_back(k, v);
    }
    members.emplace_back("__metadata__", Json(std::move(m)));
  }
  Layout layout;
  std::uint64_t offset = 0;
  std::unordered_set<std::string_view> names;  // views of tensors[i].name, which stay put from here
  names.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name.empty()) OOM_THROW(Errc::invalid_argument, "safetensors: a tensor has an empty name");
    if (t.name == "__metadata__") OOM_THROW(Errc::invalid_argument, "safetensors: '__metadata__' is not a tensor name");
    if (!names.insert(t.name).second)  // also the same name with another dtype, not adjacent after sorting
      OOM_THROW(Errc::invalid_argument, fmt::format("safetensors: tensor '{}' given twice", t.name));
    if (!t.fill) OOM_THROW(Errc::invalid_argument, fmt::format("safetensors: tensor '{}' has no data", t.name));
    const auto elements = elements_of(t.shape);
    const auto n = elements ? mul(*elements, size_of(t.dtype)) : std::nullopt;
    if (!n) OOM_THROW(Errc::invalid_argument, fmt::format("tensor '{}': shape {} overflows", t.name, shape_text(t.shape)));
    Json shape = Json::array();
    for (auto d : t.shape) shape.push_back(Json(d));
    Json info = Json::object();
    info.set("dtype", std::string(safetensors_dtype_name(t.dtype)));
    info.set("shape", std::move(shape));
    info.set("data_offsets", Json(Json::Array{Json(offset), Json(offset + *n)}));
    members.emplace_back(t.name, std::move(info));
    layout.bytes.push_back(*n);
    offset += *n;
  }
  layout.header = Json(std::move(members)).dump();
  // Pad with spaces (valid JSON whitespace) so the data section, and so every tensor, is aligned.
  layout.header.append((8 - layout.header.size() % 8) % 8, ' ');
  return layout;
}

template <class Sink>
void emit(std::vector<SafetensorsEntry>& tensors, const SafetensorsFile::Metadata& metadata, Sink&& sink) {
  const Layout layout = lay_out(tensors, metadata);
  std::byte length[8];
  const std::uint64_t n = layout.header.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  sink(std::span<const std::byte>(length, 8));
  sink(std::as_bytes(std::span(layout.header.data(), layout.header.size())));
  // The data in pieces of at most 8 MiB, gathered in batches of at most 8 MiB (many small tensors
  // make one batch; each piece 16-byte aligned in it, as the fills are promised). Each batch is
  // filled on a thread of its own while the one before it is written: a checkpoint's gather
  // (copying the state, its checksums, its finite check, a GPU's download) no longer waits for the
  // disk, nor the disk for it. One fill at a time, in order.
  constexpr std::uint64_t chunk_bytes = std::uint64_t{8} << 20;
  struct Piece {
    std::size_t tensor;
    std::uint64_t offset, bytes, at;  ///< `at`: where in its batch's buffer
  };
  std::vector<Piece> pieces;
  std::vector<std::size_t> batch_ends;  // one past each batch's last piece
  std::uint64_t used = 0;               // of the open batch's buffer
  for (std::size_t i = 0; i < tensors.size(); ++i)
    for (std::uint64_t off = 0; off < layout.bytes[i]; off += chunk_bytes) {
      const std::uint64_t n = std::min(chunk_bytes, layout.bytes[i] - off);
      if (used > 0 && used + n > chunk_bytes) {
        batch_ends.push_back(pieces.size());
        used = 0;
      }
      pieces.push_back({i, off, n, used});
      used += (n + 15) / 16 * 16;
    }
  if (used > 0) batch_ends.push_back(pieces.size());
  std::array<std::vector<std::byte>, 2> buffers;  // outlive the futures, whose destructors wait for their fill
  const auto fill = [&](std::size_t b) {
    const std::size_t first = b == 0 ? 0 : batch_ends[b - 1], last = batch_ends[b];
    auto& buffer = buffers[b % 2];
    buffer.resize(pieces[last - 1].at + pieces[last - 1].bytes);
    return std::async(std::launch::async, [&tensors, &pieces, &buffer, first, last] {
      for (std::size_t k = first; k < last; ++k)
        tensors[pieces[k].tensor].fill(pieces[k].offset, std::span(buffer).subspan(pieces[k].at, pieces[k].bytes));
    });
  };
  std::future<void> filling;
  if (!batch_ends.empty()) filling = fill(0);
  for (std::size_t b = 0; b < batch_ends.size(); ++b) {
    filling.get();  // its error, if a fill threw
    std::future<void> next;
    if (b + 1 < batch_ends.size()) next = fill(b + 1);
    for (std::size_t k = b == 0 ? 0 : batch_ends[b - 1]; k < batch_ends[b]; ++k)
      sink(std::span<const std::byte>(buffers[b % 2]).subspan(pieces[k].at, pieces[k].bytes));
    filling = std::move(next);
  }
}

}  // namespace

void write_safetensors(const std::filesystem::path& path, std::vector<SafetensorsEntry> tensors,
                       const SafetensorsFile::Metadata& metadata) {
  AtomicFile f(path);
  try {
    emit(tensors, metadata, [&](std::span<const std::byte> b) { f.write(b); });
  } catch (Error& e) {
    throw e.add_context("writing " + path.string());
  } catch (const std::exception& e) {  // a thread that could not start, memory: named as the others
    OOM_THROW(Errc::io, fmt::format("writing {}: {}", path.string(), e.what()));
  }
  f.commit();
}

std::vector<std::byte> serialize_safetensors(std::vector<SafetensorsEntry> tensors,
                                             const SafetensorsFile::Metadata& metadata) {
  std::vector<std::byte> out;
  emit(tensors, metadata, [&](std::span<const std::byte> b) { out.insert(out.end(), b.begin(), b.end()); });
  return out;
}

}  // namespace oom
