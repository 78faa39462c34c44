// splitmix64: a fixed, well-mixed 64-bit function. OOM's reproducible randomness (the built-in
// corpus, the sampler's window order, the trainer's initial weights) is built on it rather than on
// the standard library's engines and distributions, which differ between implementations.
#pragma once

#include <cstdint>

namespace oom {

/// One splitmix64 step from state `x`: x + 0x9e3779b97f4a7c15, then the finaliser.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace oom
