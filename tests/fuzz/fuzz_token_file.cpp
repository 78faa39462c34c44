// libFuzzer target: arbitrary bytes as a token file, then a few sampler windows over it. The
// input is copied into a buffer of exactly its size (4-byte aligned, as a map would be), so ASan
// reports any read past the end.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/io/token_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::unique_ptr<std::byte[]> copy(new std::byte[size == 0 ? 1 : size]);
  if (size > 0) std::memcpy(copy.get(), data, size);
  const std::span<const std::byte> bytes(copy.get(), size);
  try {
    (void)oom::parse_token_file_header(bytes, "fuzz.tok");
    const auto f = oom::TokenFile::parse(bytes, "fuzz.tok", oom::TokenFile::Check::on_read);
    try {
      f.check_all();
    } catch (const oom::Error&) {
    }
    // A sequence length drawn from the input, so short files and single windows are reached.
    const std::uint64_t L = 1 + (size > 40 ? std::to_integer<std::uint64_t>(bytes[40]) % 32 : 0);
    oom::BatchSampler s(f, L, {size, 0});
    std::vector<std::uint32_t> in(2 * L), tg(2 * L);
    for (int step = 0; step < 3; ++step) {
      s.next(in, tg);
      for (std::uint64_t i = 0; i < in.size(); ++i)
        if (in[i] >= f.vocab_size() || tg[i] >= f.vocab_size()) __builtin_trap();
    }
    for (std::uint64_t p = 0; p < 2 * s.windows_per_epoch() && p < 64; ++p)
      if (s.window_start(p) + L + 1 > f.size()) __builtin_trap();
  } catch (const oom::Error&) {
  }
  return 0;
}
