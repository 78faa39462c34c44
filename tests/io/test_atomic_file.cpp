// AtomicFile and MappedFile: a file is either the old one or the whole new one; maps see its bytes.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include <sys/stat.h>
#include <unistd.h>

#include "oom/core/error.hpp"
#include "oom/io/atomic_file.hpp"
#include "resident.hpp"
#include "temp_dir.hpp"

using namespace oom;
using oom::test::resident_kib;
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
  CHECK_THROWS_WITH_AS(MappedFile(dir.path()), doctest::Contains("a directory, not a regular file"), Error);
  // A FIFO no one writes to is refused at once (its open had waited for a writer forever: a
  // `latest` or a --data that is a FIFO hung the trainer).
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(MappedFile{fifo}, doctest::Contains("fifo: a FIFO, not a regular file"), Error);
}


TEST_CASE("MappedFile::drop_pages takes read pages out of the resident set; the bytes stay readable") {
  TempDir dir("drop-pages");
  constexpr std::size_t size = std::size_t{32} << 20;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::string content(size, '\0');
  for (std::size_t i = 0; i < size; ++i) content[i] = static_cast<char>((i * 31) % 251);
  write_file_atomically(dir / "big.bin", content);
  MappedFile m(dir / "big.bin");
  const auto b = m.bytes();
  REQUIRE(b.size() == size);
  const auto touch = [&] {  // reads a byte of every page (volatile: the reads are not elided)
    const volatile std::byte* p = b.data();
    unsigned sum = 0;
    for (std::size_t i = 0; i < size; i += page) sum += static_cast<unsigned>(p[i]);
    return sum;
  };
  const long before = resident_kib();
  if (before < 0) {
    MESSAGE("no /proc/self/smaps_rollup here: the resident set is not checked");
    return;
  }
  (void)touch();
  const long read = resident_kib();
  CHECK(read - before >= 30 * 1024);  // the 32 MiB read are resident
  m.drop_pages(b);
  const long dropped = resident_kib();
  MESSAGE("Rss KiB: before " << before << ", after reading 32 MiB " << read << ", after drop_pages " << dropped);
  CHECK(read - dropped >= 30 * 1024);
  // The bytes are still the file's.
  CHECK(std::memcmp(b.data(), content.data(), size) == 0);
  // Part of the map: [1 MiB + 1, 5 MiB - 1) asks for 4 MiB less its two edge pages. The kernel may
  // take out more where it maps the file in huge pages (on this machine, the three 2 MiB blocks the
  // range touches; they fault back on the next read), but not the rest of the file.
  (void)touch();
  const long again = resident_kib();
  m.drop_pages(b.subspan((1 << 20) + 1, (4 << 20) - 2));
  const long part = again - resident_kib();
  MESSAGE("drop_pages of [1 MiB + 1, 5 MiB - 1): " << part << " KiB left the resident set");
  CHECK(part >= 3 * 1024);
  CHECK(part <= 8 * 1024);
  // Bytes outside the mapping, an empty range, an empty map: nothing happens.
  m.drop_pages(std::as_bytes(std::span<const char>(content.data(), content.size())));
  m.drop_pages({});
  MappedFile().drop_pages(b);
  CHECK(std::memcmp(b.data(), content.data(), size) == 0);
  CHECK(content[size - 1] == static_cast<char>(((size - 1) * 31) % 251));
}

TEST_CASE("AtomicFile refuses to replace a directory or a FIFO, naming it and leaving no temporary") {
  TempDir dir("atomic-special");
  const auto sub = dir / "sub";
  std::filesystem::create_directories(sub);
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  for (const auto& special : {std::pair{sub, "is a directory"}, std::pair{fifo, "not a regular file"}}) {
    CAPTURE(special.first.string());
    try {
      write_file_atomically(special.first, "{}");
      FAIL("replaced a special file");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::io);
      CHECK(e.message() == special.first.string() + ": cannot replace: " + special.second);
    }
  }
  CHECK(std::filesystem::is_directory(sub));
  CHECK(std::filesystem::is_fifo(std::filesystem::symlink_status(fifo)));
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) entries += e.path() != sub && e.path() != fifo;
  CHECK(entries == 0);
  // A symlink is replaced itself, as rename() does: its target is left alone.
  const auto target = dir / "target";
  write_file_atomically(target, "target");
  std::filesystem::create_symlink(target, dir / "link");
  write_file_atomically(dir / "link", "new");
  CHECK(test::read_text(target) == "target");
  CHECK(test::read_text(dir / "link") == "new");
  CHECK_FALSE(std::filesystem::is_symlink(dir / "link"));
}
