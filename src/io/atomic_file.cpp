// AtomicFile (temp + fsync + rename + directory fsync) and MappedFile (read-only mmap), POSIX.
#include "oom/io/atomic_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom {
namespace {

constexpr std::size_t buffer_bytes = std::size_t{4} << 20;

// An AtomicFile's temporary is its path and this, then the writer's pid (remove_stale_temporaries
// finds killed writers' by it).
constexpr std::string_view temp_infix = ".tmp-";

[[noreturn]] void fail_errno(std::string_view what, const std::filesystem::path& path, int err) {
  OOM_THROW(Errc::io, fmt::format("{}: {}: {}", path.string(), what, std::strerror(err)));
}

}  // namespace

// Some file systems refuse fsync on directories (EINVAL, and EROFS read-only); the rename is then
// as durable as they can make it.
void sync_parent_directory(const std::filesystem::path& path) {
  std::filesystem::path dir = path.parent_path();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_errno("cannot open directory to sync the rename", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL && err != EROFS) fail_errno("cannot fsync directory", dir, err);
}

AtomicFile::AtomicFile(std::filesystem::path path) : path_(std::move(path)) {
  // rename() would replace a device or FIFO (run as root, /dev/full was replaced by a regular
  // file) and fails on a directory only at commit(); refuse both before creating the temporary.
  // A symlink is replaced itself, not its target, as for any file.
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
    OOM_THROW(Errc::io, fmt::format("{}: cannot replace: {}", path_.string(),
                                    S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file"));
  temp_ = path_;
  temp_ += std::string(temp_infix) + std::to_string(::getpid());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail_errno("cannot create", temp_, errno);
  buffer_.reserve(buffer_bytes);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(std::span<const std::byte> bytes) {
  if (committed_) OOM_THROW(Errc::invalid_argument, path_.string() + ": write after commit");
  written_ += bytes.size();
  if (buffer_.size() + bytes.size() > buffer_bytes) flush();
  if (bytes.size() >= buffer_bytes) {
    // Large blocks (tensors) go straight to the kernel rather than through a copy.
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_errno("cannot write", temp_, errno);
      }
      done += static_cast<std::size_t>(n);
    }
    return;
  }
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

void AtomicFile::write(std::string_view text) { write(std::as_bytes(std::span(text.data(), text.size()))); }

void AtomicFile::flush() {
  std::size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno("cannot write", temp_, errno);
    }
    done += static_cast<std::size_t>(n);
  }
  buffer_.clear();
}

void AtomicFile::commit() {
  if (committed_) OOM_THROW(Errc::invalid_argument, path_.string() + ": committed twice");
  flush();
  if (::fsync(fd_) != 0) fail_errno("cannot fsync", temp_, errno);
  // close() can report a deferred write error (NFS); it must be checked before the rename.
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail_errno("cannot close", temp_, errno);
  if (::rename(temp_.c_str(), path_.c_str()) != 0) fail_errno("cannot rename " + temp_.string() + " to", path_, errno);
  committed_ = true;
  sync_parent_directory(path_);
}

void write_file_atomically(const std::filesystem::path& path, std::string_view content) {
  AtomicFile f(path);
  f.write(content);
  f.commit();
}

std::size_t remove_stale_temporaries(const std::filesystem::path& path) noexcept {
  const std::string prefix = path.filename().string() + std::string(temp_infix);
  const std::string own = std::to_string(::getpid());
  std::size_t removed = 0;
  std::error_code ec;
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
    const std::string_view pid = std::string_view(name).substr(prefix.size());
    if (pid == own || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    std::error_code file_ec;
    if (it->is_regular_file(file_ec) && std::filesystem::remove(it->path(), file_ec)) ++removed;
  }
  return removed;
}

MappedFile::MappedFile(const std::filesystem::path& path) {
  // O_NONBLOCK: a FIFO opens at once (and is refused below as not a regular file) instead of
  // waiting for a writer that may never come; a regular file reads the same either way.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail_errno("cannot open", path, errno);
  try {
    *this = MappedFile(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);  // the mapping keeps the file alive
}

MappedFile::MappedFile(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode))
    OOM_THROW(Errc::io, path.string() + (S_ISDIR(st.st_mode)    ? ": a directory, not a regular file"
                                         : S_ISFIFO(st.st_mode) ? ": a FIFO, not a regular file (it is mapped, not streamed)"
                                                                : ": not a regular file (a device or a socket?)"));
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      size_ = 0;
      fail_errno("cannot map", path, err);
    }
    data_ = static_cast<const std::byte*>(p);
  }
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::drop_pages(std::span<const std::byte> range) const noexcept {
  if (data_ == nullptr || range.empty()) return;
  const auto base = reinterpret_cast<std::uintptr_t>(data_);
  const auto lo = std::max(reinterpret_cast<std::uintptr_t>(range.data()), base);
  const auto hi = std::min(reinterpret_cast<std::uintptr_t>(range.data()) + range.size(), base + size_);
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t first = (lo + page - 1) / page * page, end = hi / page * page;  // whole pages only
  if (first < end) (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

void MappedFile::release() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace oom
