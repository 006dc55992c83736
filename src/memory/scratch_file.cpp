#include "memory/scratch_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "loom/memory.h"

namespace loom {

const char* io_kind_name(IoKind kind) { return kind == IoKind::read ? "read" : "write"; }

uint64_t round_up_io(uint64_t bytes) { return (bytes + kIoAlign - 1) / kIoAlign * kIoAlign; }

std::string io_failure(const std::filesystem::path& dir, IoKind kind, uint64_t bytes, uint64_t offset,
                       const std::string& reason) {
  return str("NVMe ", io_kind_name(kind), " of ", bytes, " bytes at offset ", offset, " in the scratch file under '",
             dir.string(), "' failed: ", reason, "; check the device behind memory.nvme_dir");
}

namespace {

// pid and a process-wide counter keep this process's names apart; the random
// part keeps them apart from another process that reuses the pid in a
// directory shared across containers.
std::filesystem::path scratch_name(const std::filesystem::path& dir) {
  static std::atomic<uint64_t> counter{0};
  static thread_local std::mt19937_64 random{std::random_device{}()};
  return dir / str("loom-nvme-", ::getpid(), "-", counter++, "-", std::hex, random(), ".scratch");
}

}  // namespace

ScratchFile::ScratchFile(const std::filesystem::path& dir) : dir_(dir) {
  constexpr int kBaseFlags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  std::filesystem::path path;
  int error = 0;
  for (int attempt = 0; attempt < 8 && fd_ < 0; ++attempt) {
    path = scratch_name(dir);
    fd_ = ::open(path.c_str(), kBaseFlags | O_DIRECT, 0600);
    direct_ = fd_ >= 0;
    if (fd_ < 0 && errno == EINVAL) {
      // The filesystem refuses O_DIRECT; some create the file before saying so.
      ::unlink(path.c_str());
      fd_ = ::open(path.c_str(), kBaseFlags, 0600);
    }
    error = errno;
    if (fd_ < 0 && error != EEXIST) break;
  }
  if (fd_ < 0)
    throw Error(str("cannot create an NVMe scratch file in '", dir.string(), "': ", std::strerror(error),
                    "; set memory.nvme_dir to an existing directory this process may write"));
  // Unlinked at once: the space goes back to the filesystem when the file is
  // closed, however the process ends, and no later run can open it.
  if (::unlink(path.c_str()) != 0) {
    error = errno;
    ::close(fd_);
    throw Error(str("cannot unlink the NVMe scratch file '", path.string(), "': ", std::strerror(error),
                    "; remove it by hand and check the permissions of memory.nvme_dir"));
  }
}

ScratchFile::~ScratchFile() { ::close(fd_); }

void ScratchFile::resize(uint64_t bytes) {
  if (bytes == 0) return;
  // fallocate claims the blocks now, so a full disk is an error here rather
  // than in the middle of a training step.
  int rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(bytes));
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) rc = ::ftruncate(fd_, static_cast<off_t>(bytes));
  if (rc != 0)
    throw Error(str("cannot give the NVMe scratch file in '", dir_.string(), "' ", format_bytes(double(bytes)), ": ",
                    std::strerror(errno), "; free space there or point memory.nvme_dir at a larger disk"));
}

std::string ScratchFile::transfer(IoKind kind, char* buf, uint64_t bytes, uint64_t offset) const {
  uint64_t done = 0;
  while (done < bytes) {
    auto at = static_cast<off_t>(offset + done);
    ssize_t n = kind == IoKind::read ? ::pread(fd_, buf + done, bytes - done, at)
                                     : ::pwrite(fd_, buf + done, bytes - done, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::strerror(errno);
    if (n == 0) return str("the file ended after ", done, " bytes");
    done += static_cast<uint64_t>(n);
  }
  return {};
}

}  // namespace loom
