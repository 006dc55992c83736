// A scratch file of the NVMe tier: created in a directory and unlinked at
// once, opened with O_DIRECT unless the filesystem refuses it. Shared by
// NvmeFile and the sequential throughput baseline, so both go through the
// same page-cache bypass (or lack of it) on the same directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace loom {

enum class IoKind : uint8_t { read, write };
const char* io_kind_name(IoKind kind);

// Rounded up to a multiple of kIoAlign.
uint64_t round_up_io(uint64_t bytes);

class ScratchFile {
 public:
  // Throws Error naming the directory when no file can be created in it.
  explicit ScratchFile(const std::filesystem::path& dir);
  ~ScratchFile();
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  const std::filesystem::path& dir() const { return dir_; }

  // Gives the file `bytes` of disk space; throws Error naming the directory
  // when the filesystem cannot hold them.
  void resize(uint64_t bytes);

  // Moves all `bytes` with pread/pwrite, continuing short transfers and
  // retrying interrupted ones. Returns why it failed, empty on success.
  std::string transfer(IoKind kind, char* buf, uint64_t bytes, uint64_t offset) const;

 private:
  std::filesystem::path dir_;
  int fd_ = -1;
  bool direct_ = false;
};

// The message of a failed NVMe request: the directory, the operation, the
// byte count, the offset and the reason.
std::string io_failure(const std::filesystem::path& dir, IoKind kind, uint64_t bytes, uint64_t offset,
                       const std::string& reason);

}  // namespace loom
