// libFuzzer target: arbitrary bytes as a whole safetensors file. Every accepted file must keep its
// tensors inside the buffer with consistent sizes, and must round-trip through the writer.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  try {
    const auto f = oom::SafetensorsFile::parse(bytes, "fuzz.safetensors");
    std::vector<oom::SafetensorsEntry> entries;
    unsigned sum = 0;
    for (const auto& t : f.tensors()) {
      if (t.data.size() != t.elements() * oom::size_of(t.dtype)) __builtin_trap();
      if (t.data.data() < bytes.data() || t.data.data() + t.data.size() > bytes.data() + bytes.size()) __builtin_trap();
      for (std::byte b : t.data) sum += std::to_integer<unsigned>(b);  // ASan sees any read past the input
      if (f.find(t.name) != &t) __builtin_trap();
      entries.push_back(oom::SafetensorsEntry::view(t.name, t.dtype, t.shape, t.data));
    }
    const auto out = oom::serialize_safetensors(std::move(entries), f.metadata());
    const auto g = oom::SafetensorsFile::parse(out, "fuzz.safetensors (rewritten)");
    if (g.tensors().size() != f.tensors().size() || g.metadata() != f.metadata()) __builtin_trap();
    for (const auto& t : f.tensors()) {
      const auto* u = g.find(t.name);
      if (u == nullptr || u->dtype != t.dtype || u->shape != t.shape ||
          !std::equal(u->data.begin(), u->data.end(), t.data.begin(), t.data.end()))
        __builtin_trap();
    }
    (void)sum;
  } catch (const oom::Error&) {
  }
  return 0;
}
