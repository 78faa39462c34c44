// Atomic file writes and read-only file maps: the two ways OOM touches checkpoint, token and state
// files. A reader (or a crash) sees either the old file or the complete new one, never a prefix:
// content goes to `<path>.tmp-<pid>`, is fsync'ed, renamed over `<path>`, and the directory is
// fsync'ed so the rename itself survives a power loss.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "oom/core/bytes.hpp"

namespace oom {

/// A file being written atomically. Nothing is visible at `path()` until commit(); destroying an
/// uncommitted AtomicFile (an exception while producing the content) removes the temporary.
/// Errors are oom::Error(Errc::io) naming the file and the system error.
class AtomicFile {
 public:
  /// Creates (truncates) `<path>.tmp-<pid>`. The directory must exist; `path`, when it exists, must
  /// be a regular file or a symlink (a directory, device or FIFO is refused, naming the path).
  explicit AtomicFile(std::filesystem::path path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(std::span<const std::byte> bytes);
  void write(std::string_view text);
  /// Bytes written so far.
  [[nodiscard]] Bytes size() const { return Bytes{written_}; }

  /// Flushes, fsyncs, renames over path() and fsyncs the directory. Writing after commit() is an error.
  void commit();

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] const std::filesystem::path& temp_path() const { return temp_; }

 private:
  void flush();

  std::filesystem::path path_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::uint64_t written_ = 0;
  std::vector<std::byte> buffer_;  ///< batches small writes into few syscalls
};

/// fsyncs the directory holding `path`, so that a rename into it (a file's or a directory's) is
/// durable before anything that names it is written. Errc::io naming the directory.
void sync_parent_directory(const std::filesystem::path& path);

/// Removes the temporaries other processes left beside `path` (`<path>.tmp-<pid>`, regular files,
/// not this process's): an AtomicFile's writer killed before commit() leaves one as large as what
/// it had written, and none is ever read. Only for a path one process writes at a time (a run
/// directory's files, under its lock). Returns how many were removed; errors are ignored.
std::size_t remove_stale_temporaries(const std::filesystem::path& path) noexcept;

/// Replaces `path` with `content` atomically (JSON state, configs, plans).
void write_file_atomically(const std::filesystem::path& path, std::string_view content);

/// A whole file mapped read-only. The bytes stay valid, at the same address, while the MappedFile
/// (or what it was moved into) lives. An empty file maps to an empty span. The file must not be
/// truncated by someone else while mapped (the kernel would raise SIGBUS); OOM only ever replaces
/// files by rename, which leaves existing maps intact.
class MappedFile {
 public:
  MappedFile() = default;
  /// Errc::io naming the path when it cannot be opened, is not a regular file, or cannot be mapped.
  explicit MappedFile(const std::filesystem::path& path);
  /// Maps the file open on `fd` (left open: the caller's); `path` names it in errors.
  MappedFile(int fd, const std::filesystem::path& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  [[nodiscard]] std::span<const std::byte> bytes() const { return {data_, size_}; }

  /// Takes the mapping's pages that lie wholly inside `range` out of the process's resident set
  /// (madvise MADV_DONTNEED; bytes of `range` outside the mapping are ignored). The mapping is
  /// private and read-only, so those pages are clean copies of the file: the bytes stay valid, and
  /// a later read faults them in again from the page cache or the file. For readers that go through
  /// a large file once (a checkpoint, initial weights), so its pages do not pile up in the RSS
  /// beside what was read into. Advice: a failure is ignored, and where the kernel maps the file in
  /// huge pages it may take out the whole huge pages the range touches (they fault back in too).
  void drop_pages(std::span<const std::byte> range) const noexcept;

 private:
  void release() noexcept;

  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace oom
