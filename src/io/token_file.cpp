// Token file reader/writer and the deterministic window sampler.
#include "oom/io/token_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/core/hash.hpp"
#include "oom/io/json.hpp"

namespace oom {
namespace {

std::uint64_t load_u64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | std::to_integer<std::uint64_t>(p[i]);
  return v;
}
std::uint32_t load_u32(const std::byte* p) { return static_cast<std::uint32_t>(load_u64(p) & 0xffffffffu); }
void store_le(std::byte* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

/// "1 283 117": positions in large files are easier to read grouped.
std::string grouped(std::uint64_t v) {
  std::string digits = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ' ';
    out += digits[i];
  }
  return out;
}

// Errc::parse naming the first of `tokens` (the file's from position `begin`) that is >= vocab.
// The common case (all valid) is one branch-free pass; only a failure looks for the position.
template <class T>
void refuse_out_of_vocab(std::span<const T> tokens, std::uint64_t begin, std::uint64_t vocab, const std::string& source) {
  const auto max = std::max_element(tokens.begin(), tokens.end());
  if (max == tokens.end() || *max < vocab) return;
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [&](T t) { return t >= vocab; });
  OOM_THROW(Errc::parse, fmt::format("{}: token {} at position {} is >= vocab {}", source, *bad,
                                     grouped(begin + static_cast<std::uint64_t>(bad - tokens.begin())), vocab));
}

static_assert(std::endian::native == std::endian::little, "token files are read in place as little-endian");

}  // namespace

bool starts_as_token_file(const std::filesystem::path& path) noexcept {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // (a FIFO: no wait for a writer)
  if (fd < 0) return false;
  char magic[token_file_magic.size()];
  std::size_t got = 0;
  while (got < sizeof(magic)) {
    const ssize_t n = ::read(fd, magic + got, sizeof(magic) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return got == sizeof(magic) && std::memcmp(magic, token_file_magic.data(), sizeof(magic)) == 0;
}

TokenFileHeader parse_token_file_header(std::span<const std::byte> file, std::string_view source) {
  const auto fail = [&](const std::string& what) { OOM_THROW(Errc::parse, fmt::format("{}: {}", source, what)); };
  if (file.size() < token_file_header_bytes)
    fail(fmt::format("file is {} bytes, shorter than the {}-byte token file header", file.size(),
                     token_file_header_bytes));
  const std::byte* h = file.data();
  if (std::memcmp(h, token_file_magic.data(), token_file_magic.size()) != 0)
    fail(fmt::format("not a token file (the first 8 bytes are not \"{}\")", token_file_magic));
  const std::uint32_t version = load_u32(h + 8);
  if (version != token_file_version)
    fail(fmt::format("token file version {}, this build reads version {}", version, token_file_version));
  TokenFileHeader header;
  const std::uint32_t width = load_u32(h + 12);
  if (width == 2) header.dtype = DType::uint16;
  else if (width == 4) header.dtype = DType::uint32;
  else fail(fmt::format("{} bytes per token; expected 2 (u16) or 4 (u32)", width));
  header.vocab_size = load_u64(h + 16);
  header.token_count = load_u64(h + 24);
  header.document_count = load_u64(h + 32);
  for (std::size_t i = 40; i < token_file_header_bytes; ++i)
    if (h[i] != std::byte{0}) fail(fmt::format("reserved header byte {} is not zero", i));
  if (header.vocab_size == 0) fail("vocab size 0");
  if (header.vocab_size > (std::uint64_t{1} << (8 * width)))
    fail(fmt::format("vocab size {} does not fit {}-byte tokens", header.vocab_size, width));
  const std::uint64_t data_bytes = file.size() - token_file_header_bytes;
  // Compare by division: count * width may overflow for a corrupt count.
  if (data_bytes % width != 0 || data_bytes / width != header.token_count)
    fail(fmt::format("header says {} tokens ({} bytes), the file holds {} bytes of tokens", header.token_count,
                     header.token_count <= UINT64_MAX / width ? fmt::to_string(header.token_count * width) : "2^64+",
                     data_bytes));
  return header;
}

TokenFile::Fd& TokenFile::Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd >= 0) ::close(fd);
    fd = std::exchange(o.fd, -1);
  }
  return *this;
}

TokenFile::Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

TokenFile TokenFile::open(const std::filesystem::path& path, Check check) {
  TokenFile f;
  f.source_ = path.string();
  f.fd_ = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));  // a FIFO is refused, not waited on
  if (f.fd_.fd < 0) OOM_THROW(Errc::io, fmt::format("{}: cannot open: {}", f.source_, std::strerror(errno)));
  f.map_ = MappedFile(f.fd_.fd, path);  // the same file read() reads, whatever is renamed onto the path
  // A regular file now (MappedFile refuses others): its reads block as usual (a FUSE file system
  // may honour O_NONBLOCK on one).
  if (const int flags = ::fcntl(f.fd_.fd, F_GETFL); flags >= 0) (void)::fcntl(f.fd_.fd, F_SETFL, flags & ~O_NONBLOCK);
  f.init(f.map_.bytes(), check);
  return f;
}

TokenFile TokenFile::parse(std::span<const std::byte> bytes, std::string_view source, Check check) {
  TokenFile f;
  f.source_ = std::string(source);
  if (reinterpret_cast<std::uintptr_t>(bytes.data()) % alignof(std::uint32_t) != 0)
    OOM_THROW(Errc::invalid_argument, f.source_ + ": token buffer is not 4-byte aligned");
  f.init(bytes, check);
  return f;
}

void TokenFile::init(std::span<const std::byte> bytes, Check check) {
  header_ = parse_token_file_header(bytes, source_);
  tokens_ = bytes.data() + token_file_header_bytes;
  if (check == Check::on_open) check_all();
}

std::span<const std::uint16_t> TokenFile::u16() const {
  if (header_.dtype != DType::uint16)
    OOM_THROW(Errc::invalid_argument, source_ + ": holds u32 tokens, asked for u16");
  return {reinterpret_cast<const std::uint16_t*>(tokens_), header_.token_count};
}

std::span<const std::uint32_t> TokenFile::u32() const {
  if (header_.dtype != DType::uint32)
    OOM_THROW(Errc::invalid_argument, source_ + ": holds u16 tokens, asked for u32");
  return {reinterpret_cast<const std::uint32_t*>(tokens_), header_.token_count};
}

void TokenFile::check_range(std::uint64_t begin, std::uint64_t count) const {
  if (header_.dtype == DType::uint16) refuse_out_of_vocab(u16().subspan(begin, count), begin, header_.vocab_size, source_);
  else refuse_out_of_vocab(u32().subspan(begin, count), begin, header_.vocab_size, source_);
}

void TokenFile::check_all() const {
  // In pieces of 16M tokens, each piece's pages let go once checked: a corpus larger than the
  // host's memory can be scanned, and a smaller one does not sit in the RSS for the whole run.
  constexpr std::uint64_t piece = std::uint64_t{1} << 24;
  for (std::uint64_t begin = 0; begin < header_.token_count; begin += piece) {
    const std::uint64_t count = std::min(piece, header_.token_count - begin);
    check_range(begin, count);
    drop_pages(begin, count);
  }
}

std::uint64_t TokenFile::sample_fingerprint() const {
  constexpr std::uint64_t block = 4096, most_blocks = 256;
  const std::uint64_t width = header_.dtype == DType::uint16 ? 2 : 4;
  const std::uint64_t bytes = header_.token_count * width;
  std::uint64_t h = splitmix64(width ^ splitmix64(header_.vocab_size ^ splitmix64(header_.token_count ^ splitmix64(header_.document_count))));
  const auto fold = [&](std::uint64_t begin, std::uint64_t n) {  // bytes [begin, begin + n) of the tokens
    const std::byte* p = tokens_ + begin;
    std::uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t w = 0;
      std::memcpy(&w, p + i, 8);
      h = splitmix64(h ^ w);
    }
    std::uint64_t tail = 0;
    for (std::uint64_t j = i; j < n; ++j) tail = (tail << 8) | std::to_integer<std::uint64_t>(p[j]);
    h = splitmix64(h ^ tail ^ (n - i) << 56);
  };
  const std::uint64_t blocks = (bytes + block - 1) / block;
  if (blocks <= most_blocks) {
    fold(0, bytes);
  } else {  // block i of most_blocks starts at i * (bytes - block) / (most_blocks - 1): the first at 0, the last ending at the end
    for (std::uint64_t i = 0; i < most_blocks; ++i) {
      __extension__ using u128 = unsigned __int128;  // i * (bytes - block) may pass 2^64 for files past 2^56 bytes
      const auto begin = static_cast<std::uint64_t>((static_cast<u128>(i) * (bytes - block)) / (most_blocks - 1));
      fold(begin, block);
    }
  }
  return h;
}

void TokenFile::drop_pages(std::uint64_t begin, std::uint64_t count) const {
  const std::uint64_t width = header_.dtype == DType::uint16 ? 2 : 4;
  map_.drop_pages({tokens_ + begin * width, count * width});
}

void TokenFile::read(std::uint64_t begin, std::span<std::uint32_t> out) const {
  if (begin > header_.token_count || out.size() > header_.token_count - begin)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: {} tokens from {} are outside the file's {} tokens", source_,
                                                  out.size(), begin, header_.token_count));  // (begin + size may wrap)
  if (fd_.fd >= 0) {
    read_file(begin, out);
    return;
  }
  check_range(begin, out.size());
  if (header_.dtype == DType::uint16) {
    const auto src = u16().subspan(begin, out.size());
    std::copy(src.begin(), src.end(), out.begin());
  } else {
    const auto src = u32().subspan(begin, out.size());
    std::copy(src.begin(), src.end(), out.begin());
  }
  drop_pages(begin, out.size());  // a window is read once an epoch: its pages need not stay resident
}

void TokenFile::read_file(std::uint64_t begin, std::span<std::uint32_t> out) const {
  const std::uint64_t width = header_.dtype == DType::uint16 ? 2 : 4, n = out.size();
  auto* dst = reinterpret_cast<std::byte*>(out.data());
  const std::uint64_t want = n * width, offset = token_file_header_bytes + begin * width;
  for (std::uint64_t got = 0; got < want;) {
    const ssize_t r = ::pread(fd_.fd, dst + got, want - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      OOM_THROW(Errc::io, fmt::format("{}: cannot read tokens [{}, {}): {}", source_, begin, begin + n, std::strerror(errno)));
    if (r == 0)
      OOM_THROW(Errc::io, fmt::format("{}: tokens [{}, {}) are past its end now (it held {} tokens when opened): the file "
                                      "changed while in use (cut short or rewritten in place)",
                                      source_, begin, begin + n, header_.token_count));
    got += static_cast<std::uint64_t>(r);
  }
  if (width == 2)  // widen in place from the back: token i's 2 bytes lie at or before its 4
    for (std::uint64_t i = n; i-- > 0;) {
      std::uint16_t t = 0;
      std::memcpy(&t, dst + 2 * i, 2);
      out[i] = t;
    }
  refuse_out_of_vocab(std::span<const std::uint32_t>(out), begin, header_.vocab_size, source_);
}

void write_token_file(const std::filesystem::path& path, std::span<const std::uint32_t> tokens,
                      std::uint64_t vocab_size, std::uint64_t document_count) {
  if (vocab_size == 0 || vocab_size > (std::uint64_t{1} << 32))
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: vocab size {} is not in [1, 2^32]", path.string(), vocab_size));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab_size)
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: token {} at position {} is >= vocab {}", path.string(),
                                                    tokens[i], grouped(i), vocab_size));
  const std::uint32_t width = vocab_size <= 65536 ? 2 : 4;
  std::byte header[token_file_header_bytes] = {};
  std::memcpy(header, token_file_magic.data(), token_file_magic.size());
  store_le(header + 8, token_file_version, 4);
  store_le(header + 12, width, 4);
  store_le(header + 16, vocab_size, 8);
  store_le(header + 24, tokens.size(), 8);
  store_le(header + 32, document_count, 8);

  AtomicFile f(path);
  f.write(header);
  if (width == 4) {
    f.write(std::as_bytes(tokens));
  } else {
    std::vector<std::uint16_t> chunk;
    constexpr std::size_t chunk_tokens = std::size_t{1} << 20;
    for (std::size_t i = 0; i < tokens.size(); i += chunk_tokens) {
      const auto part = tokens.subspan(i, std::min(chunk_tokens, tokens.size() - i));
      chunk.assign(part.begin(), part.end());
      f.write(std::as_bytes(std::span(chunk)));
    }
  }
  f.commit();
}

// ---- sampler --------------------------------------------------------------------------------------

namespace {


/// A bijection of [0, n) keyed by `key`: a 4-round Feistel network on the smallest even-width
/// power-of-two domain >= n, with cycle walking back into [0, n) (at most 4n / n steps expected).
std::uint64_t permute(std::uint64_t index, std::uint64_t n, std::uint64_t key) {
  if (n <= 1) return 0;
  int bits = std::bit_width(n - 1);
  bits += bits & 1;
  const int half = bits / 2;
  const std::uint64_t mask = (std::uint64_t{1} << half) - 1;
  std::uint64_t x = index;
  do {
    std::uint64_t left = x >> half, right = x & mask;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = splitmix64(right ^ splitmix64(key + round)) & mask;
      const std::uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

}  // namespace

Json SamplerState::to_json() const {
  Json j = Json::object();
  j.set("seed", seed);
  j.set("position", position);
  j.set("step_windows", step_windows);
  return j;
}

SamplerState SamplerState::from_json(const Json& j, std::string_view source) {
  const JsonCursor c(j, std::string(source));
  const std::uint64_t step_windows = c["step_windows"].present() ? c["step_windows"].as_uint64() : 1;
  return SamplerState{c["seed"].as_uint64(), c["position"].as_uint64(), step_windows};
}

BatchSampler::BatchSampler(const TokenFile& tokens, std::uint64_t sequence_length, SamplerState state)
    : tokens_(&tokens), sequence_length_(sequence_length), state_(state) {
  if (sequence_length == 0 || tokens.size() < sequence_length + 1 || sequence_length + 1 == 0)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{}: {} tokens cannot make a window of sequence length {} (+1 for the target)",
                          tokens.source(), tokens.size(), sequence_length));
  windows_ = windows_in(tokens.size(), sequence_length);
  slack_ = tokens.size() - 1 - windows_ * sequence_length;
  // A step of more windows than the file holds must hold some twice, whatever the order.
  const std::uint64_t k = state.step_windows;
  if (k == 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: sampler step_windows is 0; a step draws at least 1 window", tokens.source()));
  if (k > windows_)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("{}: {} tokens hold {} windows of sequence length {}, fewer than the {} a step draws (step_windows): a step "
                          "would hold a window twice", tokens.source(), tokens.size(), windows_, sequence_length, k));
  if (state.position % k != 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: sampler position {} is not at the start of a step of {} windows",
                                                  tokens.source(), state.position, k));
  epoch_windows_ = windows_ - windows_ % k;
}

std::uint64_t BatchSampler::window_start(std::uint64_t position) const {
  // An epoch is the first epoch_windows_ of a permutation of all the windows: whole steps, within
  // one grid. With steps of one window it is the whole permutation (a state saved before steps).
  const std::uint64_t epoch = position / epoch_windows_;
  const std::uint64_t key = splitmix64(state_.seed ^ splitmix64(epoch));
  const std::uint64_t shift = slack_ == 0 ? 0 : splitmix64(key ^ 0x5851f42d4c957f2dull) % (slack_ + 1);
  return shift + permute(position % epoch_windows_, windows_, key) * sequence_length_;
}

void BatchSampler::next(std::span<std::uint32_t> inputs, std::span<std::uint32_t> targets) {
  const std::uint64_t L = sequence_length_;
  if (inputs.size() % L != 0 || targets.size() != inputs.size())
    OOM_THROW(Errc::invalid_argument,
              fmt::format("sampler: inputs ({}) and targets ({}) must be the same whole number of rows of {} tokens",
                          inputs.size(), targets.size(), L));
  const std::uint64_t rows = inputs.size() / L;
  if (rows % state_.step_windows != 0)
    OOM_THROW(Errc::invalid_argument, fmt::format("sampler: {} rows are not whole steps of {} windows", rows, state_.step_windows));
  std::vector<std::uint32_t> window(L + 1);
  for (std::uint64_t r = 0; r < rows; ++r) {
    tokens_->read(window_start(state_.position), window);
    std::copy(window.begin(), window.end() - 1, inputs.begin() + static_cast<std::ptrdiff_t>(r * L));
    std::copy(window.begin() + 1, window.end(), targets.begin() + static_cast<std::ptrdiff_t>(r * L));
    ++state_.position;
  }
}

}  // namespace oom
