// POSIX file descriptors with errors that name the path and say what to do.
// Every byte loom writes to disk goes through here, so a full disk is reported
// the same way wherever it strikes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string_view>

namespace loom::io_detail {

// Throws Error "<what> '<path>': <strerror>"; ENOSPC and EDQUOT say the disk is full.
[[noreturn]] void throw_io_error(std::string_view what, const std::filesystem::path& path, int err);

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release() { int fd = fd_; fd_ = -1; return fd; }

 private:
  int fd_ = -1;
};

// open(2); `what` ("read", "create") goes into the error message.
Fd open_file(const std::filesystem::path& path, int flags, std::string_view what, int mode = 0644);
void write_all(int fd, const std::filesystem::path& path, const void* data, size_t bytes);
// Exactly `bytes` bytes at `offset`; a short read means the file is truncated.
void pread_all(int fd, const std::filesystem::path& path, void* data, size_t bytes, uint64_t offset);
void fsync_fd(int fd, const std::filesystem::path& path);
// fsync of a path: a regular file or a directory.
void fsync_path(const std::filesystem::path& path);
// close(2) checked: on some filesystems a deferred write error appears only here.
void close_fd(Fd& fd, const std::filesystem::path& path);

}  // namespace loom::io_detail
