// The built-in training corpus: English-like text generated procedurally, so the example trainer
// and the tests need nothing downloaded. Byte-level tokens (vocab 256).
//
// The text has structure a tiny model learns within a minute of CPU training: a small vocabulary
// of words, subject-verb agreement, recurring sentence templates, question/answer pairs that
// repeat their subject, and sums of small numbers. An order-2 byte model already predicts it far
// better than uniform (see the corpus tests), so the loss falls visibly from ln 256 = 5.55.
//
// Same (bytes, seed) -> the same text, on every platform and build: the generator uses its own
// integer PRNG, never the standard library's distributions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "oom/io/token_file.hpp"

namespace oom {

inline constexpr std::uint64_t builtin_corpus_bytes = std::uint64_t{2} << 20;
inline constexpr std::uint64_t builtin_corpus_vocab = 256;

struct CorpusText {
  std::string text;  ///< printable ASCII and '\n'; documents end with a blank line
  std::uint64_t documents = 0;
};

/// Exactly `bytes` bytes of generated text (the last document is cut where the size is reached).
[[nodiscard]] CorpusText generate_corpus(std::uint64_t bytes = builtin_corpus_bytes, std::uint64_t seed = 0);

/// Writes the generated corpus as a token file (one token per byte, vocab 256), atomically.
TokenFileHeader write_builtin_corpus(const std::filesystem::path& path, std::uint64_t bytes = builtin_corpus_bytes,
                                     std::uint64_t seed = 0);

}  // namespace oom
