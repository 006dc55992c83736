#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "loom/memory.h"
#include "memory/scratch_file.h"

namespace loom {

// Like `dd oflag=direct` / `iflag=direct`: one request at a time, so the
// figure is what the disk gives without any queueing. The scratch file is the
// NvmeFile's kind (preallocated, O_DIRECT unless refused), so the two are
// held against each other on equal terms. Its bytes are not accounted on the
// nvme allocator: they are a measurement, not model state, and would
// otherwise stand in the tier's high-water mark.
DiskThroughput measure_sequential_throughput(const std::filesystem::path& dir, uint64_t bytes, uint64_t block) {
  LOOM_CHECK(block > 0 && block % kIoAlign == 0, "throughput block of ", block, " bytes is not a positive multiple of ",
             kIoAlign);
  LOOM_CHECK(bytes > 0, "throughput measured over no bytes");
  bytes = round_up_io(bytes);
  ScratchFile file(dir);
  file.resize(bytes);
  IoBuffer buf(static_cast<size_t>(std::min(block, bytes)));
  auto* data = static_cast<char*>(buf.data());
  // Not zeros, which some filesystems and devices store without writing.
  for (size_t i = 0; i < buf.bytes(); ++i) data[i] = static_cast<char>(i * 131 + 7);

  using Clock = std::chrono::steady_clock;
  auto pass = [&](IoKind kind) {
    auto t0 = Clock::now();
    for (uint64_t offset = 0; offset < bytes; offset += block) {
      uint64_t n = std::min(block, bytes - offset);
      std::string failure = file.transfer(kind, data, n, offset);
      if (!failure.empty()) throw Error(io_failure(dir, kind, n, offset, failure));
    }
    if (kind == IoKind::write && ::fdatasync(file.fd()) != 0)
      throw Error(io_failure(dir, kind, bytes, 0, str("fdatasync: ", std::strerror(errno))));
    return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  DiskThroughput t;
  t.write_bytes_per_s = pass(IoKind::write);
  t.read_bytes_per_s = pass(IoKind::read);
  return t;
}

}  // namespace loom
