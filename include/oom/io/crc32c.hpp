// CRC-32C (Castagnoli; iSCSI, ext4, Btrfs): the checksum a checkpoint keeps of each tensor's bytes,
// so a resumed run refuses a file that changed after its save (a flipped bit, a file copied in from
// another save) instead of training on from other values. SSE4.2's crc32 instruction where the CPU
// has it (several GB/s a core: a 5.13B model's 61 GB checkpoint in seconds beside its reads), a
// table otherwise; both give the same values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace oom {

/// The CRC-32C of `bytes` continued from `crc` (0 to start: crc32c(b, crc32c(a)) is the CRC of a
/// then b). crc32c of "123456789" is 0xE3069283.
[[nodiscard]] std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;

namespace detail {
/// crc32c by the table alone, whatever the CPU has (for tests: the two paths must agree).
[[nodiscard]] std::uint32_t crc32c_by_table(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace oom
