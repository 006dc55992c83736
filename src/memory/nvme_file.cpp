#include <algorithm>
#include <cstdint>

#include "loom/memory.h"
#include "memory/nvme_engine.h"
#include "memory/scratch_file.h"

namespace loom {
namespace {

// The file's bytes on the calling thread's nvme allocator while it exists.
class NvmeReservation {
 public:
  NvmeReservation(const std::filesystem::path& dir, uint64_t bytes)
      : alloc_(MemoryContext::current().tier(Tier::nvme)), bytes_(bytes) {
    try {
      alloc_.reserve(bytes_);
    } catch (const Error& e) {
      throw Error(str("cannot place an NVMe scratch file in '", dir.string(), "': ", e.what()));
    }
  }
  ~NvmeReservation() { alloc_.release(bytes_); }
  NvmeReservation(const NvmeReservation&) = delete;
  NvmeReservation& operator=(const NvmeReservation&) = delete;

 private:
  Allocator& alloc_;
  uint64_t bytes_;
};

}  // namespace

// Members are destroyed bottom up: the engine (its workers joined) before the
// file it reads, the reservation once the file is closed.
struct NvmeFile::Impl {
  Impl(const std::filesystem::path& dir, uint64_t bytes, Engine wanted, int queue_depth)
      : size(round_up_io(bytes)), reservation(dir, size), file(dir), tracker(dir) {
    LOOM_CHECK(queue_depth >= 1, "NVMe queue depth ", queue_depth, " must be at least 1");
    file.resize(size);
    if (wanted == Engine::io_uring) io = make_uring_engine(file, tracker, queue_depth);
    if (io)
      engine = Engine::io_uring;
    else
      io = make_thread_engine(file, tracker, std::min(queue_depth, 4));
  }

  uint64_t start(IoKind kind, char* buf, uint64_t bytes, uint64_t offset) {
    LOOM_CHECK(reinterpret_cast<uintptr_t>(buf) % kIoAlign == 0, "NVMe ", io_kind_name(kind), " buffer ",
               static_cast<void*>(buf), " is not aligned to ", kIoAlign, " bytes (use an IoBuffer)");
    LOOM_CHECK(bytes % kIoAlign == 0 && offset % kIoAlign == 0, "NVMe ", io_kind_name(kind), " of ", bytes,
               " bytes at offset ", offset, ": both must be multiples of ", kIoAlign);
    LOOM_CHECK(offset <= size && bytes <= size - offset, "NVMe ", io_kind_name(kind), " of ", bytes,
               " bytes at offset ", offset, " runs past the end of the ", size, "-byte file");
    uint64_t ticket = tracker.begin(kind, bytes, offset);
    if (bytes == 0)
      tracker.complete(ticket, {});
    else
      io->start(ticket, kind, buf, bytes, offset);
    return ticket;
  }

  uint64_t size;
  NvmeReservation reservation;
  ScratchFile file;
  IoTracker tracker;
  std::unique_ptr<IoEngine> io;
  Engine engine = Engine::threads;
};

NvmeFile::NvmeFile(const std::filesystem::path& dir, uint64_t bytes, Engine engine, int queue_depth)
    : impl_(std::make_unique<Impl>(dir, bytes, engine, queue_depth)) {}

NvmeFile::~NvmeFile() {
  try {
    wait_all();
  } catch (const Error&) {
    // Requests nobody waited for: their data was not wanted, only the
    // buffers must outlive them.
  }
}

uint64_t NvmeFile::read(void* buf, uint64_t bytes, uint64_t offset) {
  return impl_->start(IoKind::read, static_cast<char*>(buf), bytes, offset);
}

uint64_t NvmeFile::write(const void* buf, uint64_t bytes, uint64_t offset) {
  // The engines take one pointer type for both directions; a write only reads it.
  return impl_->start(IoKind::write, const_cast<char*>(static_cast<const char*>(buf)), bytes, offset);
}

void NvmeFile::wait(uint64_t ticket) {
  // Both engines report completions to the tracker from their own threads.
  impl_->tracker.await(ticket);
  impl_->tracker.retire(ticket);
}

void NvmeFile::wait_all() {
  std::string first_failure;
  for (uint64_t ticket : impl_->tracker.outstanding()) {
    try {
      wait(ticket);
    } catch (const Error& e) {
      if (first_failure.empty()) first_failure = e.what();
    }
  }
  if (!first_failure.empty()) throw Error(first_failure);
}

NvmeFile::Engine NvmeFile::engine() const { return impl_->engine; }
bool NvmeFile::direct() const { return impl_->file.direct(); }
uint64_t NvmeFile::size() const { return impl_->size; }
const std::filesystem::path& NvmeFile::dir() const { return impl_->file.dir(); }
NvmeStats NvmeFile::stats() const { return impl_->tracker.stats(); }

}  // namespace loom
