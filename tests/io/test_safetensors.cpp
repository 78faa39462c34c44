// safetensors: byte-exact agreement with the reference writer, round trips, tensors named as
// transformers expects for the tiny config, and one clear parse error per kind of corrupt file.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/numeric.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/model/model_spec.hpp"
#include "temp_dir.hpp"

using namespace oom;
using oom::test::TempDir;

namespace {

std::vector<std::byte> bytes_of_text(std::string_view s) {
  const auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

/// A safetensors file from a header text and `data_bytes` bytes of data (no padding added).
std::vector<std::byte> file_with_header(std::string_view header, std::size_t data_bytes) {
  std::vector<std::byte> f(8);
  for (int i = 0; i < 8; ++i) f[static_cast<std::size_t>(i)] = static_cast<std::byte>((header.size() >> (8 * i)) & 0xff);
  const auto h = bytes_of_text(header);
  f.insert(f.end(), h.begin(), h.end());
  f.resize(f.size() + data_bytes, std::byte{0x5a});
  return f;
}

/// The message of the parse error the bytes raise (fails the test when they parse).
std::string parse_error(const std::vector<std::byte>& file) {
  try {
    (void)SafetensorsFile::parse(file, "t.safetensors");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::parse);
    return e.message();
  }
  FAIL("parsed without error");
  return {};
}
std::string parse_error(std::string_view header, std::size_t data_bytes) {
  return parse_error(file_with_header(header, data_bytes));
}

std::vector<std::byte> f32_bytes(std::initializer_list<float> v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), std::data(v), b.size());
  return b;
}

std::string text_of(std::span<const std::byte> b, std::size_t offset, std::size_t n) {
  return {reinterpret_cast<const char*>(b.data()) + offset, n};
}

}  // namespace

TEST_CASE("the writer reproduces the reference implementation's bytes") {
  // Expected bytes from huggingface/safetensors' own serialization tests (tensor.rs).
  const auto data = f32_bytes({0, 1, 2, 3, 4, 5});
  {
    const auto out = serialize_safetensors({SafetensorsEntry::view("attn.0", DType::fp32, {1, 2, 3}, data)});
    const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";  // 64: no padding
    REQUIRE(out.size() == 8 + 64 + 24);
    CHECK(std::to_integer<int>(out[0]) == 64);
    CHECK(text_of(out, 8, 64) == header);
    CHECK(std::memcmp(out.data() + 72, data.data(), 24) == 0);
  }
  {
    const auto out = serialize_safetensors({SafetensorsEntry::view("attn0", DType::fp32, {1, 1, 2, 3}, data)});
    CHECK(std::to_integer<int>(out[0]) == 72);
    CHECK(text_of(out, 8, 72) == R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + std::string(7, ' '));
  }
  CHECK(text_of(serialize_safetensors({}), 0, 16) == std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  const auto meta = serialize_safetensors({}, {{"framework", "pt"}});
  CHECK(std::to_integer<int>(meta[0]) == 40);
  CHECK(text_of(meta, 8, 40) == R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));
}

TEST_CASE("round trip through a file: dtypes, shapes, metadata, alignment") {
  TempDir dir("safetensors-roundtrip");
  const auto p = dir / "model.safetensors";
  std::vector<std::byte> u8(3), bf(2 * 5 * 2), f64(8 * 2), i64(8), empty;
  for (std::size_t i = 0; i < u8.size(); ++i) u8[i] = std::byte(i + 1);
  for (std::size_t i = 0; i < bf.size(); ++i) bf[i] = std::byte(0x40 + i);
  for (std::size_t i = 0; i < f64.size(); ++i) f64[i] = std::byte(0x80 + i);
  for (std::size_t i = 0; i < i64.size(); ++i) i64[i] = std::byte(0xc0 + i);
  // Given in an order that would misalign the 8-byte tensors if kept.
  write_safetensors(p,
                    {SafetensorsEntry::view("bytes", DType::uint8, {3}, u8),
                     SafetensorsEntry::view("w.bf16", DType::bf16, {2, 5}, bf),
                     SafetensorsEntry::view("a.f64", DType::fp64, {2}, f64),
                     SafetensorsEntry::view("scalar", DType::int64, {}, i64),
                     SafetensorsEntry::view("nothing", DType::fp32, {0, 7}, empty)},
                    {{"format", "pt"}, {"step", "12"}});
  const auto f = SafetensorsFile::open(p);
  REQUIRE(f.tensors().size() == 5);
  // Reference order: decreasing alignment (I64 before F64 before F32 before BF16 before U8), then name.
  CHECK(f.tensors()[0].name == "scalar");
  CHECK(f.tensors()[1].name == "a.f64");
  CHECK(f.tensors()[2].name == "nothing");
  CHECK(f.tensors()[3].name == "w.bf16");
  CHECK(f.tensors()[4].name == "bytes");
  CHECK(f.header_bytes().count() % 8 == 0);
  for (const auto& t : f.tensors())
    CHECK_MESSAGE(reinterpret_cast<std::uintptr_t>(t.data.data()) % size_of(t.dtype) == 0, t.name);
  const auto& w = f.at("w.bf16");
  CHECK(w.dtype == DType::bf16);
  CHECK(w.shape == std::vector<std::uint64_t>{2, 5});
  CHECK(w.elements() == 10);
  CHECK(std::equal(w.data.begin(), w.data.end(), bf.begin(), bf.end()));
  CHECK(std::equal(f.at("bytes").data.begin(), f.at("bytes").data.end(), u8.begin(), u8.end()));
  CHECK(std::equal(f.at("a.f64").data.begin(), f.at("a.f64").data.end(), f64.begin(), f64.end()));
  CHECK(f.at("scalar").shape.empty());
  CHECK(f.at("scalar").elements() == 1);
  CHECK(f.at("nothing").data.empty());
  CHECK(f.metadata() == SafetensorsFile::Metadata{{"format", "pt"}, {"step", "12"}});
  CHECK(f.find("absent") == nullptr);
  try {
    (void)f.at("absent");
    FAIL("found an absent tensor");
  } catch (const Error& e) {
    CHECK(e.message() == p.string() + ": no tensor 'absent'");
  }
}

TEST_CASE("a fill callback streams a tensor larger than the writer's chunk") {
  TempDir dir("safetensors-fill");
  const std::uint64_t n = (9u << 20) / 4 + 3;  // > 8 MiB of f32: several chunks, an odd tail
  SafetensorsEntry e{"big", DType::fp32, {n}, [](std::uint64_t offset, std::span<std::byte> out) {
                       for (std::size_t i = 0; i < out.size(); ++i) out[i] = std::byte((offset + i) * 7 % 251);
                     }};
  write_safetensors(dir / "big.safetensors", {std::move(e)});
  const auto f = SafetensorsFile::open(dir / "big.safetensors");
  const auto d = f.at("big").data;
  REQUIRE(d.size() == n * 4);
  bool same = true;
  for (std::size_t i = 0; i < d.size(); ++i) same = same && d[i] == std::byte(i * 7 % 251);
  CHECK(same);
}

TEST_CASE("fills run one at a time, in order, off the caller's thread, each piece 16-byte aligned; a later piece's error ends the write") {
  TempDir dir("safetensors-fills");
  // Small tensors between large ones: the small share a batch, the large take several pieces.
  struct Call {
    std::string tensor;
    std::uint64_t offset, bytes;
    std::thread::id thread;
    bool aligned;
  };
  std::vector<Call> calls;
  std::atomic<int> running{0};
  bool overlapped = false;
  std::vector<SafetensorsEntry> entries;
  const auto pattern = [](const std::string& name, std::uint64_t i) { return std::byte((i * 13 + name.size()) % 253); };
  const auto add = [&](std::string name, DType dtype, std::uint64_t elements) {
    entries.push_back({name, dtype, {elements}, [&, name](std::uint64_t offset, std::span<std::byte> out) {
                         overlapped = overlapped || running.fetch_add(1) != 0;
                         calls.push_back({name, offset, out.size(), std::this_thread::get_id(), reinterpret_cast<std::uintptr_t>(out.data()) % 16 == 0});
                         for (std::size_t i = 0; i < out.size(); ++i) out[i] = pattern(name, offset + i);
                         running.fetch_sub(1);
                       }});
  };
  for (int i = 0; i < 40; ++i) add(fmt::format("small.{:02}", i), DType::uint8, 1 + static_cast<std::uint64_t>(i) * 5);
  add("large.a", DType::fp32, (17u << 20) / 4 + 1);  // three pieces
  add("large.b", DType::bf16, (5u << 20) / 2);       // shares no batch with large.a's tail (over 8 MiB)
  write_safetensors(dir / "f.safetensors", std::move(entries));
  CHECK_FALSE(overlapped);
  std::set<std::string> seen;
  for (std::size_t k = 0; k < calls.size(); ++k) {
    CAPTURE(calls[k].tensor);
    CHECK(calls[k].thread != std::this_thread::get_id());
    CHECK(calls[k].aligned);
    // A tensor's pieces back to back, in order, and each tensor filled once through.
    if (k > 0 && calls[k - 1].tensor == calls[k].tensor) CHECK(calls[k].offset == calls[k - 1].offset + calls[k - 1].bytes);
    else CHECK((calls[k].offset == 0 && seen.insert(calls[k].tensor).second));
  }
  CHECK(seen.size() == 42);
  const auto f = SafetensorsFile::open(dir / "f.safetensors");
  bool same = true;
  for (const auto& t : f.tensors())
    for (std::size_t i = 0; i < t.data.size(); ++i) same = same && t.data[i] == pattern(t.name, i);
  CHECK(same);

  // The second large piece throws: the write fails with its error, and leaves no file.
  std::vector<SafetensorsEntry> failing;
  failing.push_back({"x", DType::fp32, {(20u << 20) / 4}, [](std::uint64_t offset, std::span<std::byte> out) {
                       if (offset > 0) OOM_THROW(Errc::io, "device download failed at a later piece");
                       std::fill(out.begin(), out.end(), std::byte{0});
                     }});
  try {
    write_safetensors(dir / "g.safetensors", std::move(failing));
    FAIL("the write did not fail");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(std::string(e.what()).find("device download failed at a later piece") != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists(dir / "g.safetensors"));
}

TEST_CASE("a write that fails mid-way waits for the fill in flight: the write's error ends it, no fill runs after it returns") {
  TempDir dir("safetensors-sink-fails");
  // Shared with the fills by value: were one left running, it would be seen to run after the return.
  struct Seen {
    std::atomic<int> fills{0};
    std::atomic<bool> returned{false}, after{false};
  };
  const auto seen = std::make_shared<Seen>();
  std::vector<SafetensorsEntry> entries;
  entries.push_back({"x", DType::fp32, {(40u << 20) / 4}, [seen](std::uint64_t, std::span<std::byte> out) {
                       std::this_thread::sleep_for(std::chrono::milliseconds(50));  // still filling when the write before it fails
                       std::fill(out.begin(), out.end(), std::byte{1});
                       ++seen->fills;
                       if (seen->returned) seen->after = true;
                     }});
  // Writes past 12 MiB fail (EFBIG; SIGXFSZ ignored, as oom-train does): the second 8 MiB piece's.
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 12u << 20;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool failed = false;
  try {
    write_safetensors(dir / "x.safetensors", std::move(entries));
  } catch (const Error&) {
    seen->returned = true;
    failed = true;
  }
  (void)setrlimit(RLIMIT_FSIZE, &old);
  (void)std::signal(SIGXFSZ, old_handler);
  CHECK(failed);
  const int at_return = seen->fills;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(seen->fills == at_return);
  CHECK_FALSE(seen->after);
  CHECK(at_return == 3);  // the two written, and the one filled while the second was written
  CHECK_FALSE(std::filesystem::exists(dir / "x.safetensors"));
}

TEST_CASE("the tiny config's tensors are written and read back under their transformers names") {
  const auto spec = ModelSpec::from_file(std::string(OOM_SOURCE_DIR) + "/examples/configs/tiny-moe.json");
  std::vector<SafetensorsEntry> entries;
  std::uint64_t seed = 1;
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) {
      REQUIRE(t.stacked_index < 0);  // Qwen3-MoE stores each expert's matrices on their own
      // Deterministic small values, as bf16: the lead loads this file into transformers.
      const std::uint64_t s = seed++;
      entries.push_back({t.name, DType::bf16, t.shape, [s](std::uint64_t offset, std::span<std::byte> out) {
                           for (std::size_t i = 0; i < out.size(); i += 2) {
                             const std::uint64_t k = (offset + i) / 2 * 2654435761u + s * 40503u;
                             const float v = (static_cast<float>(k % 2001) - 1000.0f) * 2e-5f;
                             const bf16 b = to_bf16(v);
                             out[i] = std::byte(b.bits & 0xff);
                             out[i + 1] = std::byte(b.bits >> 8);
                           }
                         }});
    }
  // Kept in the build tree for scripts/check_safetensors.py (transformers on the GPU machine).
  const std::filesystem::path p = std::filesystem::path(OOM_TEST_OUTPUT_DIR) / "tiny-moe.safetensors";
  write_safetensors(p, std::move(entries), {{"format", "pt"}});
  const auto f = SafetensorsFile::open(p);
  std::size_t count = 0;
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) {
      ++count;
      const auto* r = f.find(t.name);
      REQUIRE_MESSAGE(r != nullptr, t.name);
      CHECK_MESSAGE(r->shape == t.shape, t.name);
      CHECK(r->dtype == DType::bf16);
      DType dt{};
      CHECK(f.tensor_bytes(t, &dt).size() == t.elements() * 2);
      CHECK(dt == DType::bf16);
    }
  CHECK(f.tensors().size() == count);
  // A few names transformers' Qwen3MoeForCausalLM uses, spelled out so a renaming shows here.
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight",
                           "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.1.input_layernorm.weight",
                           "model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"})
    CHECK_MESSAGE(f.find(name) != nullptr, name);
  CHECK(f.at("model.layers.0.mlp.gate.weight").shape == std::vector<std::uint64_t>{8, 256});
  CHECK(f.at("model.layers.0.mlp.experts.0.gate_proj.weight").shape == std::vector<std::uint64_t>{128, 256});
  CHECK(f.at("model.layers.0.self_attn.k_proj.weight").shape == std::vector<std::uint64_t>{64, 256});
}

TEST_CASE("tensor_bytes slices packed experts and checks the shape") {
  std::vector<std::byte> data(3 * 2 * 2 * 2);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i);
  const auto bytes = serialize_safetensors({SafetensorsEntry::view("experts.w", DType::bf16, {3, 2, 2}, data)});
  const auto f = SafetensorsFile::parse(bytes, "packed.safetensors");
  TensorSpec expert1{"experts.w", {2, 2}, 1, 3};
  const auto s = f.tensor_bytes(expert1);
  REQUIRE(s.size() == 8);
  CHECK(s[0] == std::byte(8));
  CHECK(s[7] == std::byte(15));
  TensorSpec wrong{"experts.w", {4}, 1, 3};
  try {
    (void)f.tensor_bytes(wrong);
    FAIL("accepted a wrong shape");
  } catch (const Error& e) {
    CHECK(e.message() == "packed.safetensors: tensor 'experts.w' has shape [3, 2, 2], the model expects [3, 4]");
  }
}

TEST_CASE("each kind of corrupt file is one parse error naming the file, tensor and numbers") {
  const std::string gate = R"("model.layers.0.mlp.gate.weight")";
  CHECK(parse_error(std::vector<std::byte>(5)) == "t.safetensors: file is 5 bytes, too short for the 8-byte header length");
  {
    auto f = file_with_header("{}", 0);
    f[3] = std::byte{0x10};  // N = 2^24 * 16 + 2
    CHECK(parse_error(f) == "t.safetensors: header length 268435458 exceeds the limit of 100000000 bytes");
    f[3] = std::byte{0};
    f[1] = std::byte{0x01};  // N = 258, file has 2 bytes after the length
    CHECK(parse_error(f) == "t.safetensors: header length 258 runs past the end of the file (10 bytes, 2 after the length)");
  }
  CHECK(parse_error("{\"a\": ", 0).starts_with("t.safetensors (header):1:7"));
  CHECK(parse_error("[1, 2]", 0) == "t.safetensors: header is an array, not a JSON object");
  CHECK(parse_error(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {}})", 4)
            .find("duplicate \"x\"") != std::string::npos);
  CHECK(parse_error("{" + gate + R"(: {"dtype": "BF16", "shape": [64, 2048], "data_offsets": [0, 262000]}})", 262000) ==
        "t.safetensors: tensor 'model.layers.0.mlp.gate.weight': shape [64, 2048] BF16 needs 262144 bytes, "
        "data_offsets [0, 262000] give 262000");
  CHECK(parse_error(R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})", 1) ==
        "t.safetensors: tensor 'w': unknown dtype \"Q4\" (expected one of BF16, F16, F32, F64, F8_E4M3, F8_E5M2, "
        "I32, I64, U8, U16, U32)");
  CHECK(parse_error(R"({"w": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}})", 1) ==
        "t.safetensors: tensor 'w': dtype BOOL is not supported by OOM");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 3) ==
        "t.safetensors: tensor 'w': data_offsets [0, 4] run past the end of the data section (3 bytes)");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4) ==
        "t.safetensors: tensor 'w': shape [-1] holds -1, not a non-negative integer");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4).find("not a non-negative") !=
        std::string::npos);
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", 4) ==
        "t.safetensors: tensor 'w': shape [4294967296, 4294967296] F32 overflows 64-bit byte counts");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4) ==
        "t.safetensors: tensor 'w': data_offsets [4, 0] end before they begin");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4) ==
        "t.safetensors: tensor 'w': data_offsets [0] is not [begin, end] of two non-negative integers");
  CHECK(parse_error(R"({"w": {"dtype": "F32", "shape": [1]}})", 4) == "t.safetensors: tensor 'w': missing \"data_offsets\"");
  CHECK(parse_error(R"({"w": [1]})", 0) == "t.safetensors: tensor 'w': is an array, not an object");
  CHECK(parse_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                    12) == "t.safetensors: tensor 'b' data_offsets [4, 12] overlap tensor 'a' ending at 8");
  CHECK(parse_error(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8) ==
        "t.safetensors: data bytes [0, 4) belong to no tensor (before tensor 'a')");
  CHECK(parse_error(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6) ==
        "t.safetensors: data bytes [4, 6) at the end of the file belong to no tensor");
  CHECK(parse_error(R"({"__metadata__": {"step": 3}})", 0) ==
        "t.safetensors: __metadata__ 'step' is a number, not a string");
  CHECK(parse_error(std::string("{\"\xff\": 1}"), 0).find("t.safetensors (header)") == 0);
}

TEST_CASE("every truncation of a valid file is rejected, and no byte flip crashes the reader") {
  std::vector<std::byte> a(12), b(6);
  const auto file = serialize_safetensors({SafetensorsEntry::view("a", DType::fp32, {3}, a),
                                           SafetensorsEntry::view("b", DType::bf16, {3}, b)},
                                          {{"k", "v"}});
  CHECK_NOTHROW((void)SafetensorsFile::parse(file, "ok"));
  for (std::size_t n = 0; n < file.size(); ++n) {
    const std::vector<std::byte> cut(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK_THROWS_AS((void)SafetensorsFile::parse(cut, "cut"), Error);
  }
  int rejected = 0;
  for (std::size_t i = 0; i < file.size(); ++i)
    for (unsigned bit : {0x01u, 0x10u, 0x80u}) {
      auto flipped = file;
      flipped[i] ^= std::byte(bit);
      try {
        (void)SafetensorsFile::parse(flipped, "flip");
      } catch (const Error& e) {
        CHECK(e.code() == Errc::parse);
        ++rejected;
      }
    }
  CHECK(rejected > 0);
}

TEST_CASE("the writer refuses duplicate, empty or reserved names and mis-sized views") {
  std::vector<std::byte> four(4);
  CHECK_THROWS_AS(serialize_safetensors({SafetensorsEntry::view("x", DType::fp32, {1}, four),
                                         SafetensorsEntry::view("x", DType::fp32, {1}, four)}),
                  Error);
  CHECK_THROWS_AS(serialize_safetensors({SafetensorsEntry::view("x", DType::fp32, {1}, four),
                                         SafetensorsEntry::view("x", DType::bf16, {2}, four)}),
                  Error);
  CHECK_THROWS_AS(serialize_safetensors({SafetensorsEntry::view("", DType::fp32, {1}, four)}), Error);
  CHECK_THROWS_AS(serialize_safetensors({SafetensorsEntry::view("__metadata__", DType::fp32, {1}, four)}), Error);
  try {
    (void)SafetensorsEntry::view("w", DType::bf16, {3}, four);
    FAIL("accepted a mis-sized view");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::invalid_argument);
    CHECK(e.message() == "tensor 'w': shape [3] BF16 needs 6 bytes, the view holds 4");
  }
}

TEST_CASE("a file of 150k tensors (Qwen3-Next-80B's optimizer state) is written and read in linear time") {
  // The writer once checked each name against the header built so far: quadratic in the tensors.
  constexpr int tensors = 150'000;
  const std::vector<std::byte> one(1, std::byte{7});
  std::vector<SafetensorsEntry> entries;
  for (int i = 0; i < tensors; ++i)
    entries.push_back(SafetensorsEntry::view(fmt::format("exp_avg.model.layers.{}.weight", i), DType::uint8, {1}, one));
  const auto start = std::chrono::steady_clock::now();
  const auto bytes = serialize_safetensors(std::move(entries), {{"format", "pt"}});
  const auto file = SafetensorsFile::parse(bytes, "many.safetensors");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(file.tensors().size() == tensors);
  CHECK(file.find("exp_avg.model.layers.149999.weight") != nullptr);
  MESSAGE(tensors << " tensors written and read in " << seconds << " s");
  CHECK(seconds < 30.0);  // 30x margin for a loaded or Debug build; the old writer had not finished in 120 s
}

TEST_CASE("a failed write leaves the previous file in place") {
  TempDir dir("safetensors-atomic");
  const auto p = dir / "m.safetensors";
  std::vector<std::byte> four(4, std::byte{1});
  write_safetensors(p, {SafetensorsEntry::view("old", DType::fp32, {1}, four)});
  SafetensorsEntry failing{"new", DType::fp32, {1}, [](std::uint64_t, std::span<std::byte>) {
                             OOM_THROW(Errc::io, "device download failed");
                           }};
  CHECK_THROWS_AS(write_safetensors(p, {std::move(failing)}), Error);
  const auto f = SafetensorsFile::open(p);
  CHECK(f.find("old") != nullptr);
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator{}) == 1);
}

TEST_CASE("the fuzzers' seed files are valid safetensors files") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(OOM_SOURCE_DIR) + "/tests/fuzz/corpus/safetensors")) {
    CHECK_NOTHROW((void)SafetensorsFile::open(e.path()));
    ++n;
  }
  CHECK(n >= 3);
}
