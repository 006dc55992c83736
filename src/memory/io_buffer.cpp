#include <cstdlib>
#include <utility>

#include "loom/memory.h"
#include "memory/scratch_file.h"

namespace loom {

IoBuffer::IoBuffer(size_t bytes) : bytes_(round_up_io(bytes)) {
  if (bytes_ == 0) return;
  Allocator& host = MemoryContext::current().tier(Tier::host);
  host.reserve(bytes_);
  data_ = std::aligned_alloc(kIoAlign, bytes_);
  if (data_ == nullptr) {
    host.release(bytes_);
    throw Error(str("the system refused ", format_bytes(double(bytes_)), " of host memory for an NVMe I/O buffer"));
  }
  alloc_ = &host;
}

IoBuffer::~IoBuffer() {
  if (data_ == nullptr) return;
  std::free(data_);
  alloc_->release(bytes_);
}

IoBuffer::IoBuffer(IoBuffer&& other) noexcept
    : alloc_(std::exchange(other.alloc_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

IoBuffer& IoBuffer::operator=(IoBuffer&& other) noexcept {
  if (this != &other) {
    IoBuffer old(std::move(*this));
    alloc_ = std::exchange(other.alloc_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

}  // namespace loom
