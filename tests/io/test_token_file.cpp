// Token files and the batch sampler: round trips, strict header checks, out-of-vocab tokens found
// with their position, and a data order that is a pure function of (seed, position).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/io/token_file.hpp"
#include "resident.hpp"
#include "temp_dir.hpp"

using namespace oom;
using oom::test::resident_kib;
using oom::test::TempDir;

namespace {

/// A token file image in 4-byte-aligned memory, as TokenFile::parse requires.
struct Image {
  std::vector<std::uint32_t> words;
  std::size_t size = 0;
  [[nodiscard]] std::span<const std::byte> bytes() const { return std::as_bytes(std::span(words)).first(size); }
  [[nodiscard]] std::byte* data() { return reinterpret_cast<std::byte*>(words.data()); }
};

Image image_of(const std::filesystem::path& p) {
  const std::string s = test::read_text(p);
  Image im;
  im.words.resize((s.size() + 3) / 4);
  std::memcpy(im.words.data(), s.data(), s.size());
  im.size = s.size();
  return im;
}

std::string parse_error(const Image& im, TokenFile::Check check = TokenFile::Check::on_open) {
  try {
    (void)TokenFile::parse(im.bytes(), "t.tok", check);
  } catch (const Error& e) {
    CHECK(e.code() == Errc::parse);
    return e.message();
  }
  FAIL("parsed without error");
  return {};
}

void put_u32(Image& im, std::size_t offset, std::uint32_t v) { std::memcpy(im.data() + offset, &v, 4); }
void put_u64(Image& im, std::size_t offset, std::uint64_t v) { std::memcpy(im.data() + offset, &v, 8); }

}  // namespace

TEST_CASE("u16 and u32 token files round trip with their header") {
  TempDir dir("tokens");
  const std::vector<std::uint32_t> small{0, 1, 255, 7, 42};
  write_token_file(dir / "a.tok", small, 256, 2);
  const auto a = TokenFile::open(dir / "a.tok");
  CHECK(a.header() == TokenFileHeader{DType::uint16, 256, 5, 2});
  CHECK(std::filesystem::file_size(dir / "a.tok") == 64 + 5 * 2);
  CHECK(std::vector<std::uint32_t>(a.u16().begin(), a.u16().end()) == small);
  CHECK_THROWS_AS((void)a.u32(), Error);

  const std::vector<std::uint32_t> big{0, 65536, 151935, 3};
  write_token_file(dir / "b.tok", big, 151936);
  const auto b = TokenFile::open(dir / "b.tok");
  CHECK(b.header() == TokenFileHeader{DType::uint32, 151936, 4, 0});
  CHECK(std::vector<std::uint32_t>(b.u32().begin(), b.u32().end()) == big);
  std::vector<std::uint32_t> out(2);
  b.read(1, out);
  CHECK(out == std::vector<std::uint32_t>{65536, 151935});
  CHECK_THROWS_WITH_AS(b.read(3, out), doctest::Contains("2 tokens from 3 are outside the file's 4 tokens"), Error);
  // A range whose end would wrap past 2^64 is named by its start and count (it had read "[2^64 - 3, 7)").
  std::vector<std::uint32_t> ten(10);
  CHECK_THROWS_WITH_AS(b.read(~std::uint64_t{0} - 2, ten),
                       doctest::Contains("10 tokens from 18446744073709551613 are outside the file's 4 tokens"), Error);
  // A FIFO is refused at once, not waited on for a writer.
  REQUIRE(::mkfifo((dir / "fifo.tok").c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS((void)TokenFile::open(dir / "fifo.tok"), doctest::Contains("a FIFO, not a regular file"), Error);
}

TEST_CASE("the writer refuses a token outside the vocab, naming its position") {
  TempDir dir("tokens-writer");
  std::vector<std::uint32_t> t(1'300'000, 5);
  t[1'283'117] = 51234;
  try {
    write_token_file(dir / "train.tok", t, 50304);
    FAIL("wrote an out-of-vocab token");
  } catch (const Error& e) {
    CHECK(e.message() == (dir / "train.tok").string() + ": token 51234 at position 1 283 117 is >= vocab 50304");
  }
  CHECK_FALSE(std::filesystem::exists(dir / "train.tok"));
}

TEST_CASE("out-of-vocab tokens: found on open, or per read when checking lazily") {
  TempDir dir("tokens-vocab");
  std::vector<std::uint32_t> t(1'300'000, 5);
  t[1'283'117] = 51234;
  write_token_file(dir / "train.tok", t, 65536);
  Image im = image_of(dir / "train.tok");
  put_u64(im, 16, 50304);  // shrink the vocab under the token
  CHECK(parse_error(im) == "t.tok: token 51234 at position 1 283 117 is >= vocab 50304");
  const auto lazy = TokenFile::parse(im.bytes(), "t.tok", TokenFile::Check::on_read);
  std::vector<std::uint32_t> window(1000);
  CHECK_NOTHROW(lazy.read(0, window));
  try {
    lazy.read(1'283'000, window);
    FAIL("read an out-of-vocab token");
  } catch (const Error& e) {
    CHECK(e.message() == "t.tok: token 51234 at position 1 283 117 is >= vocab 50304");
  }
  // The same from the file (read with pread, not through the map).
  std::ofstream(dir / "shrunk.tok", std::ios::binary).write(reinterpret_cast<const char*>(im.bytes().data()), static_cast<std::streamsize>(im.size));
  const auto opened = TokenFile::open(dir / "shrunk.tok", TokenFile::Check::on_read);
  CHECK_NOTHROW(opened.read(0, window));
  try {
    opened.read(1'283'000, window);
    FAIL("read an out-of-vocab token");
  } catch (const Error& e) {
    CHECK(e.message() == (dir / "shrunk.tok").string() + ": token 51234 at position 1 283 117 is >= vocab 50304");
  }
}

TEST_CASE("malformed headers are parse errors naming the file and the field") {
  TempDir dir("tokens-header");
  write_token_file(dir / "a.tok", std::vector<std::uint32_t>{1, 2, 3}, 300);
  const Image good = image_of(dir / "a.tok");
  CHECK_NOTHROW((void)TokenFile::parse(good.bytes(), "t.tok"));
  {
    Image im = good;
    im.data()[0] = std::byte{'X'};
    CHECK(parse_error(im) == "t.tok: not a token file (the first 8 bytes are not \"OOMTOK01\")");
  }
  {
    Image im = good;
    put_u32(im, 8, 2);
    CHECK(parse_error(im) == "t.tok: token file version 2, this build reads version 1");
  }
  {
    Image im = good;
    put_u32(im, 12, 3);
    CHECK(parse_error(im) == "t.tok: 3 bytes per token; expected 2 (u16) or 4 (u32)");
  }
  {
    Image im = good;
    put_u64(im, 16, 0);
    CHECK(parse_error(im) == "t.tok: vocab size 0");
    put_u64(im, 16, 70000);
    CHECK(parse_error(im) == "t.tok: vocab size 70000 does not fit 2-byte tokens");
  }
  {
    Image im = good;
    put_u64(im, 24, 4);
    CHECK(parse_error(im) == "t.tok: header says 4 tokens (8 bytes), the file holds 6 bytes of tokens");
    put_u64(im, 24, ~std::uint64_t{0});
    CHECK(parse_error(im).find("2^64+") != std::string::npos);
  }
  {
    Image im = good;
    im.data()[50] = std::byte{1};
    CHECK(parse_error(im) == "t.tok: reserved header byte 50 is not zero");
  }
  for (std::size_t n = 0; n < good.size; ++n) {
    Image cut = good;
    cut.size = n;
    CHECK_THROWS_AS((void)TokenFile::parse(cut.bytes(), "cut"), Error);
  }
}

TEST_CASE("starts_as_token_file tells a token file, damaged or not, from text and from nothing") {
  TempDir dir("tokens-magic");
  write_token_file(dir / "a.tok", std::vector<std::uint32_t>{1, 2, 3}, 300);
  CHECK(starts_as_token_file(dir / "a.tok"));
  const std::string good = test::read_text(dir / "a.tok");
  const auto write = [&](const char* name, const std::string& bytes) {
    std::ofstream(dir / name, std::ios::binary) << bytes;
    return dir / name;
  };
  // Damaged past the magic (a later version, cut after the magic): still a token file, whose own
  // error TokenFile::open gives.
  std::string later = good;
  later[8] = 2;
  CHECK(starts_as_token_file(write("later.tok", later)));
  CHECK(starts_as_token_file(write("cut.tok", good.substr(0, 8))));
  CHECK_THROWS_AS((void)TokenFile::open(dir / "cut.tok"), Error);
  // Not one: text, a file shorter than the magic, an empty one, a directory, no file.
  CHECK_FALSE(starts_as_token_file(write("text.txt", "It was a bright cold day in April, and the clocks were striking thirteen.")));
  CHECK_FALSE(starts_as_token_file(write("short.tok", good.substr(0, 7))));
  CHECK_FALSE(starts_as_token_file(write("empty.tok", "")));
  CHECK_FALSE(starts_as_token_file(dir.path()));
  CHECK_FALSE(starts_as_token_file(dir / "absent.tok"));
}

TEST_CASE("a token file cut short while open is an error naming it, not a SIGBUS") {
  // cp onto the training file (or rsync --inplace) truncates it under the trainer's map: reading a
  // window past the new end had killed the run with a bus error, nothing said.
  TempDir dir("tokens-truncated");
  std::vector<std::uint32_t> t(200'000, 7);
  write_token_file(dir / "train.tok", t, 256);
  const auto f = TokenFile::open(dir / "train.tok");
  std::vector<std::uint32_t> window(1000);
  CHECK_NOTHROW(f.read(150'000, window));
  std::filesystem::resize_file(dir / "train.tok", 64 + 2 * 1000);
  CHECK_NOTHROW(f.read(0, window));  // what is still there reads as before
  CHECK(window == std::vector<std::uint32_t>(1000, 7));
  try {
    f.read(150'000, window);
    FAIL("read past the end of a truncated file");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(e.message().starts_with((dir / "train.tok").string() + ": "));
    CHECK(e.message().find("changed while in use") != std::string::npos);
  }
}

TEST_CASE("the sampler's windows: targets are inputs shifted by one, every window once per epoch") {
  TempDir dir("sampler");
  std::vector<std::uint32_t> t(1003);
  std::iota(t.begin(), t.end(), 0u);  // token == its position, so windows are easy to check
  write_token_file(dir / "s.tok", t, 2000);
  const auto f = TokenFile::open(dir / "s.tok");
  const std::uint64_t L = 10;
  BatchSampler s(f, L, {7, 0});
  CHECK(s.windows_per_epoch() == 100);  // (1003 - 1) / 10
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<std::uint64_t> starts;
    std::set<std::uint64_t> shifts;
    for (std::uint64_t i = 0; i < 100; ++i) {
      const std::uint64_t start = s.window_start(epoch * 100 + i);
      CHECK(start + L + 1 <= t.size());
      starts.insert(start);
      shifts.insert(start % L);
    }
    CHECK(starts.size() == 100);  // a permutation: no window twice
    CHECK(shifts.size() == 1);    // one grid per epoch
  }
  std::vector<std::uint32_t> in(4 * L), tg(4 * L);
  s.next(in, tg);
  CHECK(s.state().position == 4);
  for (std::uint64_t r = 0; r < 4; ++r) {
    CHECK(in[r * L] == s.window_start(r));
    for (std::uint64_t j = 0; j < L; ++j) CHECK(tg[r * L + j] == in[r * L + j] + 1);
  }
  std::vector<std::uint32_t> odd(L + 1);
  CHECK_THROWS_AS(s.next(odd, odd), Error);
}

TEST_CASE("the permutation is a bijection for awkward window counts") {
  TempDir dir("sampler-sizes");
  for (std::uint64_t windows : {1u, 2u, 3u, 5u, 17u, 64u, 65u, 1000u}) {
    std::vector<std::uint32_t> t(windows * 4 + 1, 1);
    write_token_file(dir / "s.tok", t, 2);
    const auto f = TokenFile::open(dir / "s.tok");
    BatchSampler s(f, 4, {windows * 31, 0});
    REQUIRE(s.windows_per_epoch() == windows);
    std::set<std::uint64_t> starts;
    for (std::uint64_t i = 0; i < windows; ++i) starts.insert(s.window_start(i));
    CHECK_MESSAGE(starts.size() == windows, windows);
    CHECK(*starts.rbegin() == (windows - 1) * 4);
  }
}

TEST_CASE("a resumed sampler continues with the same data; another seed gives another order") {
  TempDir dir("sampler-resume");
  std::vector<std::uint32_t> t(50'001);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint32_t>(i * 2654435761u % 50257);
  write_token_file(dir / "s.tok", t, 50257);
  const auto f = TokenFile::open(dir / "s.tok");
  const std::uint64_t L = 64, rows = 3;
  std::vector<std::uint32_t> in(rows * L), tg(rows * L), in2(rows * L), tg2(rows * L);

  BatchSampler straight(f, L, {1234, 0});
  BatchSampler interrupted(f, L, {1234, 0});
  for (int step = 0; step < 5; ++step) interrupted.next(in, tg);
  const Json saved = Json::parse(interrupted.state().to_json().dump());
  BatchSampler resumed(f, L, SamplerState::from_json(saved, "state.json:sampler"));
  CHECK(resumed.state() == SamplerState{1234, 15});
  for (int step = 0; step < 5; ++step) straight.next(in, tg);
  for (int step = 0; step < 300; ++step) {  // past the end of the first epoch (781 windows)
    straight.next(in, tg);
    resumed.next(in2, tg2);
    REQUIRE(in == in2);
    REQUIRE(tg == tg2);
  }
  BatchSampler other(f, L, {1235, 0});
  BatchSampler first(f, L, {1234, 0});
  int same = 0;
  for (std::uint64_t i = 0; i < 100; ++i) same += other.window_start(i) == first.window_start(i);
  CHECK(same < 5);
  try {
    (void)SamplerState::from_json(Json::parse(R"({"seed": 1})"), "state.json:sampler");
    FAIL("accepted a state without position");
  } catch (const Error& e) {
    CHECK(e.message() == "state.json:sampler.position: missing required field");
  }
}

TEST_CASE("an epoch hands out whole steps: no step holds a window twice or straddles two epochs") {
  TempDir dir("sampler-steps");
  std::vector<std::uint32_t> t(1003);
  std::iota(t.begin(), t.end(), 0u);  // token == its position
  write_token_file(dir / "s.tok", t, 2000);
  const auto f = TokenFile::open(dir / "s.tok");
  const std::uint64_t L = 10, k = 30;  // 100 windows: 3 steps an epoch and 10 left over
  BatchSampler s(f, L, {7, 0, k});
  CHECK(s.windows_per_epoch() == 100);
  CHECK(s.steps_per_epoch() == 3);
  std::vector<std::uint32_t> in(k * L), tg(k * L);
  std::set<std::uint64_t> trained;  // windows by index on their epoch's grid
  // 10 epochs. Drawn 30 at a time from epochs of every window, 5 of these steps had held a window
  // twice or windows of two grids.
  for (int step = 0; step < 30; ++step) {
    s.next(in, tg);
    std::set<std::uint64_t> starts, shifts;
    for (std::uint64_t r = 0; r < k; ++r) {
      starts.insert(in[r * L]);
      shifts.insert(in[r * L] % L);
      trained.insert(in[r * L] / L);
    }
    CAPTURE(step);
    CHECK(starts.size() == k);   // no window twice
    CHECK(shifts.size() == 1);   // one grid: windows share at most a boundary token
  }
  CHECK(s.state() == SamplerState{7, 900, k});
  CHECK(trained.size() == 100);  // the windows left over are other ones each epoch
  // A state saved before step_windows draws the windows it drew then (every window an epoch).
  const SamplerState old = SamplerState::from_json(Json::parse(R"({"seed": 7, "position": 0})"), "state.json:sampler");
  CHECK(old == SamplerState{7, 0, 1});
  BatchSampler before(f, L, old);
  std::vector<std::uint64_t> starts;
  for (const std::uint64_t p : {0, 1, 2, 99, 100, 101, 250, 999}) starts.push_back(before.window_start(p));
  CHECK(starts == std::vector<std::uint64_t>{342, 2, 12, 482, 681, 921, 830, 141});
  CHECK(SamplerState::from_json(Json::parse(s.state().to_json().dump()), "state.json:sampler") == s.state());
}

TEST_CASE("a step of more windows than the file holds, of none, or begun mid-step is refused") {
  TempDir dir("sampler-step-refusals");
  write_token_file(dir / "s.tok", std::vector<std::uint32_t>(1003, 1), 2);
  const auto f = TokenFile::open(dir / "s.tok");
  const std::string name = (dir / "s.tok").string();
  const std::string past = name + ": 1003 tokens hold 100 windows of sequence length 10, fewer than the 101 a step draws "
                                  "(step_windows): a step would hold a window twice";
  CHECK_THROWS_WITH_AS(BatchSampler(f, 10, {7, 0, 101}), doctest::Contains(past.c_str()), Error);
  CHECK_NOTHROW(BatchSampler(f, 10, {7, 0, 100}));  // every window, one step an epoch
  CHECK_THROWS_WITH_AS(BatchSampler(f, 10, {7, 0, 0}), doctest::Contains("step_windows is 0"), Error);
  CHECK_THROWS_WITH_AS(BatchSampler(f, 10, {7, 15, 30}), doctest::Contains("position 15 is not at the start of a step of 30 windows"),
                       Error);
  BatchSampler s(f, 10, {7, 30, 30});
  std::vector<std::uint32_t> part(20 * 10);
  CHECK_THROWS_WITH_AS(s.next(part, part), doctest::Contains("20 rows are not whole steps of 30 windows"), Error);
}

TEST_CASE("a file too short for one window is refused") {
  TempDir dir("sampler-short");
  write_token_file(dir / "s.tok", std::vector<std::uint32_t>(8, 0), 2);
  const auto f = TokenFile::open(dir / "s.tok");
  CHECK_THROWS_AS(BatchSampler(f, 8), Error);
  CHECK_NOTHROW(BatchSampler(f, 7));
  CHECK_THROWS_AS(BatchSampler(f, 0), Error);
}

TEST_CASE("the fuzzers' seed files are valid token files") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(OOM_SOURCE_DIR) + "/tests/fuzz/corpus/token_file")) {
    CHECK_NOTHROW((void)TokenFile::open(e.path()));
    ++n;
  }
  CHECK(n >= 3);
}


TEST_CASE("a token file's pages leave the resident set once checked or read") {
  TempDir dir("token-resident");
  // 24M u16 tokens: 48 MiB of file.
  std::vector<std::uint32_t> tokens(std::size_t{24} << 20);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7919) % 50304);
  write_token_file(dir / "big.tok", tokens, 50304);
  std::vector<std::uint32_t> window(std::size_t{1} << 20, 0);
  const long before = resident_kib();
  if (before < 0) {
    MESSAGE("no /proc/self/smaps_rollup here: the resident set is not checked");
    return;
  }
  const TokenFile f = TokenFile::open(dir / "big.tok");  // checks every token
  const long opened = resident_kib() - before;
  for (std::uint64_t begin = 0; begin + window.size() <= f.size(); begin += window.size()) {
    f.read(begin, window);
    REQUIRE(window.front() == tokens[begin]);
    REQUIRE(window.back() == tokens[begin + window.size() - 1]);
  }
  const long read_all = resident_kib() - before;
  MESSAGE("48 MiB token file: the RSS grew " << opened << " KiB on open (every token checked), " << read_all
                                             << " KiB after reading every window");
  CHECK(opened < 8 * 1024);
  CHECK(read_all < 8 * 1024);
  f.check_all();  // the tokens come back from the file when read again
  CHECK(resident_kib() - before < 8 * 1024);
}

TEST_CASE("the sample fingerprint: the same contents agree, a rewritten file does not") {
  TempDir dir("tokens-fingerprint");
  const auto fingerprint = [](const Image& im) { return TokenFile::parse(im.bytes(), "t.tok").sample_fingerprint(); };

  // Up to 1 MiB of tokens every byte counts: one token changed anywhere is seen.
  std::vector<std::uint32_t> small(100'001);
  for (std::size_t i = 0; i < small.size(); ++i) small[i] = static_cast<std::uint32_t>((i * 7919) % 50'000);
  write_token_file(dir / "small.tok", small, 50'304);
  const Image base = image_of(dir / "small.tok");
  const std::uint64_t f = fingerprint(base);
  // Pinned: checkpoints keep it, so it may not change between versions or machines.
  CHECK(fmt::format("{:016x}", f) == "b7f3266a70746119");
  CHECK(TokenFile::open(dir / "small.tok").sample_fingerprint() == f);  // mapped or in memory, the same
  for (const std::size_t at : {std::size_t{0}, std::size_t{4'097}, std::size_t{100'000}}) {
    Image changed = base;
    const std::uint16_t other = small[at] == 1 ? 2 : 1;
    std::memcpy(changed.data() + 64 + 2 * at, &other, 2);
    CHECK_MESSAGE(fingerprint(changed) != f, "token " << at);
  }
  Image docs = base;  // the header counts too
  put_u64(docs, 32, 5);
  CHECK(fingerprint(docs) != f);
  std::vector<std::uint32_t> shorter(small.begin(), small.end() - 1);
  write_token_file(dir / "shorter.tok", shorter, 50'304);
  CHECK(TokenFile::open(dir / "shorter.tok").sample_fingerprint() != f);

  // Larger files are sampled: the first and the last 4 KiB always, the reading bounded.
  std::vector<std::uint32_t> big(3'000'000);  // 6 MB of u16 tokens
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::uint32_t>((i * 104'729) % 50'000);
  write_token_file(dir / "big.tok", big, 50'304);
  const Image large = image_of(dir / "big.tok");
  const std::uint64_t g = fingerprint(large);
  CHECK(fmt::format("{:016x}", g) == "2c8246a985767870");
  // Block i of 256 starts at i x (6,000,000 - 4,096) / 255 bytes into the tokens: 128 at 3,009,708;
  // the 9,708 bytes between 127's end (2,990,331) and it are not read.
  for (const std::size_t byte : {std::size_t{0}, std::size_t{3'009'708 + 100}, large.size - 64 - 4}) {
    Image changed = large;
    put_u32(changed, 64 + byte, 2);
    CHECK_MESSAGE(fingerprint(changed) != g, "byte " << byte);
  }
  Image between = large;
  put_u32(between, 64 + 3'000'000, 2);
  CHECK(fingerprint(between) == g);  // the sampling's documented blind spot
  std::vector<std::uint32_t> shuffled = big;  // another order of the same tokens: a re-tokenised corpus
  std::rotate(shuffled.begin(), shuffled.begin() + 12'345, shuffled.end());
  write_token_file(dir / "rotated.tok", shuffled, 50'304);
  CHECK(TokenFile::open(dir / "rotated.tok").sample_fingerprint() != g);
}
