// Where bytes live: a GPU's memory, pinned (page-locked) host memory or ordinary pageable host memory.
#pragma once

#include <compare>
#include <iosfwd>
#include <string>

namespace oom {

struct MemorySpace {
  enum class Kind : unsigned char { device, pinned_host, pageable_host };

  Kind kind = Kind::pageable_host;
  int device_index = -1;  ///< which GPU for Kind::device; -1 for host spaces

  static constexpr MemorySpace device(int index) { return {Kind::device, index}; }
  static constexpr MemorySpace pinned_host() { return {Kind::pinned_host, -1}; }
  static constexpr MemorySpace pageable_host() { return {Kind::pageable_host, -1}; }

  [[nodiscard]] constexpr bool is_device() const { return kind == Kind::device; }
  [[nodiscard]] constexpr bool is_host() const { return kind != Kind::device; }
  /// Whether a GPU's copy engine can read/write it asynchronously (device or pinned host).
  [[nodiscard]] constexpr bool is_dma_capable() const { return kind != Kind::pageable_host; }

  constexpr auto operator<=>(const MemorySpace&) const = default;
};

/// "cuda:0", "pinned", "pageable".
std::string to_string(MemorySpace s);
std::ostream& operator<<(std::ostream& os, MemorySpace s);

}  // namespace oom
