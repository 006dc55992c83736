#include "io/posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "loom/core.h"

namespace loom::io_detail {

void throw_io_error(std::string_view what, const std::filesystem::path& path, int err) {
  if (err == ENOSPC || err == EDQUOT)
    throw Error(str("disk full: cannot ", what, " '", path.string(), "': ", std::strerror(err),
                    "; free space on that filesystem (or write elsewhere) and retry"));
  throw Error(str("cannot ", what, " '", path.string(), "': ", std::strerror(err)));
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd open_file(const std::filesystem::path& path, int flags, std::string_view what, int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw_io_error(what, path, errno);
  return Fd(fd);
}

void write_all(int fd, const std::filesystem::path& path, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io_error("write", path, errno);
    // A zero-length write of a non-empty buffer only happens when no space is left.
    if (n == 0) throw_io_error("write", path, ENOSPC);
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void pread_all(int fd, const std::filesystem::path& path, void* data, size_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io_error("read", path, errno);
    if (n == 0)
      throw Error(str("cannot read '", path.string(), "': the file ends at byte ", offset, " but ", bytes,
                      " more bytes were expected (truncated?)"));
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void fsync_fd(int fd, const std::filesystem::path& path) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) throw_io_error("fsync", path, errno);
}

void fsync_path(const std::filesystem::path& path) {
  Fd fd = open_file(path, O_RDONLY, "open for fsync");
  fsync_fd(fd.get(), path);
}

void close_fd(Fd& fd, const std::filesystem::path& path) {
  int raw = fd.release();
  if (raw >= 0 && ::close(raw) < 0 && errno != EINTR) throw_io_error("close", path, errno);
}

}  // namespace loom::io_detail
