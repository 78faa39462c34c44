#include "oom/io/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define OOM_CRC32C_X86 1
#else
#define OOM_CRC32C_X86 0
#endif

namespace oom {
namespace {

constexpr std::uint32_t polynomial = 0x82F63B78u;  // Castagnoli, bit-reversed

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? (c >> 1) ^ polynomial : c >> 1;
    t[i] = c;
  }
  return t;
}

constexpr std::array<std::uint32_t, 256> table = make_table();

// The running value (pre- and post-inverted by the caller).
std::uint32_t by_table(const unsigned char* p, std::size_t n, std::uint32_t c) noexcept {
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
  return c;
}

#if OOM_CRC32C_X86
__attribute__((target("sse4.2"))) std::uint32_t by_instruction(const unsigned char* p, std::size_t n, std::uint32_t c) noexcept {
  std::uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = static_cast<std::uint32_t>(c64);
  for (; n > 0; ++p, --n) c = _mm_crc32_u8(c, *p);
  return c;
}

const bool has_instruction = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
#if OOM_CRC32C_X86
  if (has_instruction) return ~by_instruction(p, bytes.size(), ~crc);
#endif
  return ~by_table(p, bytes.size(), ~crc);
}

std::uint32_t detail::crc32c_by_table(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  return ~by_table(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), ~crc);
}

}  // namespace oom
