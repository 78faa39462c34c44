// Token files: the training data format of the example trainer, and the sampler that cuts them
// into (input, target) windows in a reproducible order.
//
// Layout (all little-endian), a 64-byte header then the tokens back to back:
//   0  char[8]  magic "OOMTOK01"
//   8  u32      version (1)
//   12 u32      bytes per token: 2 (u16) or 4 (u32)
//   16 u64      vocab size: every token is < this
//   24 u64      token count
//   32 u64      document count (0: not recorded)
//   40 u8[24]   reserved, zero
// 64 bytes keep the tokens aligned in a page-aligned map. Readers check the magic, version, width,
// reserved bytes and that the file is exactly 64 + count * width bytes; tokens are checked against
// the vocab either all on open or per read, each failure an oom::Error(Errc::parse) naming the file,
// the position and the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "oom/core/dtype.hpp"
#include "oom/io/atomic_file.hpp"

namespace oom {

class Json;

inline constexpr std::string_view token_file_magic = "OOMTOK01";
inline constexpr std::uint32_t token_file_version = 1;
inline constexpr std::size_t token_file_header_bytes = 64;

struct TokenFileHeader {
  DType dtype = DType::uint16;  ///< uint16 or uint32
  std::uint64_t vocab_size = 0;
  std::uint64_t token_count = 0;
  std::uint64_t document_count = 0;  ///< 0: not recorded
  friend bool operator==(const TokenFileHeader&, const TokenFileHeader&) = default;
};

/// Reads and checks the header of a whole token file held in `file` (its size included).
[[nodiscard]] TokenFileHeader parse_token_file_header(std::span<const std::byte> file, std::string_view source);

/// Whether the file at `path` begins with token_file_magic: false for another file (text, most
/// often), for one shorter than the magic and for one that cannot be read. Tells "not a token
/// file at all" from a token file that is damaged, where TokenFile::open's error alone does not.
[[nodiscard]] bool starts_as_token_file(const std::filesystem::path& path) noexcept;

class TokenFile {
 public:
  enum class Check : unsigned char {
    on_open,   ///< scan every token when opening (a few ms per 10M tokens)
    on_read,   ///< check only the tokens read(); for corpora too large to scan at start
  };

  /// Maps `path` read-only. Errc::io when it cannot be read, Errc::parse when malformed.
  [[nodiscard]] static TokenFile open(const std::filesystem::path& path, Check check = Check::on_open);
  /// A whole file in memory, not copied (`bytes` must outlive the result, 4-byte aligned).
  [[nodiscard]] static TokenFile parse(std::span<const std::byte> bytes, std::string_view source,
                                       Check check = Check::on_open);

  [[nodiscard]] const TokenFileHeader& header() const { return header_; }
  [[nodiscard]] std::uint64_t size() const { return header_.token_count; }
  [[nodiscard]] std::uint64_t vocab_size() const { return header_.vocab_size; }
  [[nodiscard]] const std::string& source() const { return source_; }

  /// The tokens, unconverted; Errc::invalid_argument when the file holds the other width.
  [[nodiscard]] std::span<const std::uint16_t> u16() const;
  [[nodiscard]] std::span<const std::uint32_t> u32() const;

  /// Copies tokens [begin, begin + out.size()) widened to u32, checking each against the vocab.
  /// An opened file is read with pread, not through the map: one cut short since it was opened (cp
  /// over it while training) is an Errc::io error naming it, where the map would raise SIGBUS.
  void read(std::uint64_t begin, std::span<std::uint32_t> out) const;
  /// Checks every token: "data/train.tok: token 51234 at position 1 283 117 is >= vocab 50304".
  /// A mapped file's pages leave the resident set as they are checked.
  void check_all() const;
  /// A fingerprint of the contents that reads at most ~1 MiB whatever the file's size: the header
  /// and up to 256 evenly spaced 4 KiB blocks of the tokens, the first and the last among them
  /// (every byte of a file of up to 1 MiB of tokens). Two files that differ in the header or in a
  /// sampled byte differ here; a change confined to bytes between the samples goes unseen. The
  /// trainer keeps it in its checkpoints to refuse resuming on a file rewritten in place.
  [[nodiscard]] std::uint64_t sample_fingerprint() const;

 private:
  TokenFile() = default;
  void init(std::span<const std::byte> bytes, Check check);
  void check_range(std::uint64_t begin, std::uint64_t count) const;
  void read_file(std::uint64_t begin, std::span<std::uint32_t> out) const;  ///< read() of an opened file
  void drop_pages(std::uint64_t begin, std::uint64_t count) const;  ///< of tokens [begin, begin + count)

  /// The file open() opened (and mapped), for read()'s pread; -1 after parse().
  struct Fd {
    int fd = -1;
    Fd() = default;
    explicit Fd(int f) : fd(f) {}
    Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
    Fd& operator=(Fd&& o) noexcept;
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd();
  };

  std::string source_;
  Fd fd_;
  MappedFile map_;
  TokenFileHeader header_;
  const std::byte* tokens_ = nullptr;
};

/// Writes `tokens` atomically as u16 when vocab_size <= 65536, else u32. Errc::invalid_argument
/// naming the position when a token is >= vocab_size.
void write_token_file(const std::filesystem::path& path, std::span<const std::uint32_t> tokens,
                      std::uint64_t vocab_size, std::uint64_t document_count = 0);

/// Where a BatchSampler is: enough to continue a run with the same data order.
struct SamplerState {
  std::uint64_t seed = 0;
  std::uint64_t position = 0;  ///< windows handed out since the start of the run, over all epochs
  /// Windows a step draws (a trainer's batch x micro-batches): an epoch hands out whole steps, so
  /// no step holds a window twice or straddles two epochs (the next may repeat the last windows,
  /// or overlap them on its shifted grid). 1 (the default) makes every window part of every
  /// epoch: the order of checkpoints from before it was saved.
  std::uint64_t step_windows = 1;

  /// {"seed": s, "position": p, "step_windows": k}
  [[nodiscard]] Json to_json() const;
  /// Errc::invalid_argument naming `source` and the field when a field is missing or not a count;
  /// step_windows may be absent (a state saved before it): 1.
  [[nodiscard]] static SamplerState from_json(const Json& j, std::string_view source = "sampler");
  friend bool operator==(const SamplerState&, const SamplerState&) = default;
};

/// Cuts a token file into windows of sequence_length + 1 tokens: inputs are the first
/// sequence_length, targets the last sequence_length (inputs shifted by one). The file holds
/// windows_per_epoch() non-overlapping windows; an epoch hands out steps_per_epoch() steps of
/// state.step_windows of them, in an order drawn from (seed, epoch) by a keyed bijection of all of
/// them (the windows a whole step leaves over are other ones each epoch), so window `position` is a
/// pure function of the state and the position: a run resumed from a saved SamplerState sees
/// exactly the windows it would have seen. Each epoch also shifts the window grid by a
/// (seed, epoch)-chosen offset within the slack at the end of the file.
class BatchSampler {
 public:
  /// `tokens` must outlive the sampler. Errc::invalid_argument when the file has fewer than
  /// sequence_length + 1 tokens, fewer windows than a step draws (a step would hold one twice), a
  /// step of no windows, or a position that is not at a step's start.
  BatchSampler(const TokenFile& tokens, std::uint64_t sequence_length, SamplerState state = {});

  [[nodiscard]] std::uint64_t sequence_length() const { return sequence_length_; }
  [[nodiscard]] std::uint64_t windows_per_epoch() const { return windows_; }
  /// The non-overlapping windows of sequence_length + 1 tokens that `tokens` tokens hold: a window
  /// overlaps its successor by one token (its last target is the next one's first input), so W
  /// windows need W * sequence_length + 1 tokens. 0 where not one fits.
  [[nodiscard]] static constexpr std::uint64_t windows_in(std::uint64_t tokens, std::uint64_t sequence_length) {
    return sequence_length == 0 || tokens == 0 ? 0 : (tokens - 1) / sequence_length;
  }
  [[nodiscard]] std::uint64_t steps_per_epoch() const { return windows_ / state_.step_windows; }
  [[nodiscard]] const SamplerState& state() const { return state_; }

  /// The token offset where window `position` (counted over all epochs) starts.
  [[nodiscard]] std::uint64_t window_start(std::uint64_t position) const;

  /// Fills `inputs` and `targets`, both [rows, sequence_length] row-major with
  /// rows = inputs.size() / sequence_length, from the next `rows` windows (whole steps: a multiple
  /// of state().step_windows); advances the position.
  void next(std::span<std::uint32_t> inputs, std::span<std::uint32_t> targets);

 private:
  const TokenFile* tokens_;
  std::uint64_t sequence_length_;
  std::uint64_t windows_;
  std::uint64_t slack_;  ///< tokens left over after windows_ windows: room to shift the grid
  std::uint64_t epoch_windows_;  ///< windows an epoch hands out: its whole steps'
  SamplerState state_;
};

}  // namespace oom
