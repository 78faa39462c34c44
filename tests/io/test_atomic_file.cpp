// AtomicFile and MappedFile: a file is either the old one or the whole new one; maps see its bytes.
#include <doctest/doctest.h>

#include <stdexcept>

#include "oom/core/error.hpp"
#include "oom/io/atomic_file.hpp"
#include "temp_dir.hpp"

using namespace oom;
using oom::test::TempDir;

namespace {
/// Files in `dir` other than `keep`: temporaries left behind.
int stray_files(const TempDir& dir, const std::string& keep) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    if (e.path().filename() != keep) ++n;
  return n;
}
}  // namespace

TEST_CASE("write_file_atomically creates and replaces, leaving no temporary") {
  TempDir dir("atomic");
  const auto p = dir / "state.json";
  write_file_atomically(p, "{\"step\": 1}");
  CHECK(test::read_text(p) == "{\"step\": 1}");
  write_file_atomically(p, "{\"step\": 2, \"longer\": true}");
  CHECK(test::read_text(p) == "{\"step\": 2, \"longer\": true}");
  CHECK(stray_files(dir, "state.json") == 0);
}

TEST_CASE("an AtomicFile abandoned by an exception leaves the old file and removes its temporary") {
  TempDir dir("atomic-abandon");
  const auto p = dir / "ckpt.bin";
  write_file_atomically(p, "old");
  try {
    AtomicFile f(p);
    f.write("new content, half written");
    CHECK(std::filesystem::exists(f.temp_path()));
    CHECK(test::read_text(p) == "old");  // nothing visible before commit
    throw std::runtime_error("producer failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(test::read_text(p) == "old");
  CHECK(stray_files(dir, "ckpt.bin") == 0);
}

TEST_CASE("AtomicFile writes large and small pieces in order") {
  TempDir dir("atomic-large");
  const auto p = dir / "big.bin";
  std::string big(9u << 20, 'x');  // larger than the write buffer: goes straight to the kernel
  for (std::size_t i = 0; i < big.size(); i += 4097) big[i] = static_cast<char>('a' + i % 26);
  {
    AtomicFile f(p);
    f.write("head");
    f.write(big);
    f.write("tail");
    CHECK(f.size() == Bytes{big.size() + 8});
    f.commit();
    CHECK_THROWS_AS(f.write("after"), Error);
  }
  CHECK(test::read_text(p) == "head" + big + "tail");
}

TEST_CASE("AtomicFile in a missing directory is an io error naming the path") {
  TempDir dir("atomic-missing");
  try {
    AtomicFile f(dir / "no" / "such" / "dir.bin");
    FAIL("created a file in a missing directory");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(e.message().find("dir.bin.tmp-") != std::string::npos);
  }
}

TEST_CASE("MappedFile maps the bytes, empty files and moves") {
  TempDir dir("mapped");
  write_file_atomically(dir / "a.txt", "hello map");
  write_file_atomically(dir / "empty", "");
  MappedFile m(dir / "a.txt");
  const auto b = m.bytes();
  CHECK(std::string(reinterpret_cast<const char*>(b.data()), b.size()) == "hello map");
  MappedFile moved = std::move(m);
  CHECK(moved.bytes().data() == b.data());  // views taken before the move stay valid
  CHECK(m.bytes().empty());
  CHECK(MappedFile(dir / "empty").bytes().empty());
  try {
    MappedFile missing(dir / "missing.bin");
    FAIL("mapped a missing file");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(e.message().find("missing.bin") != std::string::npos);
  }
  CHECK_THROWS_AS(MappedFile(dir.path()), Error);  // a directory is not a regular file
}
