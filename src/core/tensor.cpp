#include <cstring>

#include "device/stream_impl.h"
#include "loom/device.h"

namespace loom {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Storage::Storage(Allocator& alloc, size_t bytes) : alloc_(alloc), bytes_(bytes), data_(alloc.allocate(bytes)) {
  // The rank's compute stream, not the current one: memory allocated in a
  // HostSection is still used by the compute stream's later work.
  if (cpu_stream_mode() == CpuStreamMode::async)
    stream_ = MemoryContext::current().stream(MemoryContext::StreamRole::compute);
}

Storage::~Storage() {
  if (!stream_ || stream_->mode() == CpuStreamMode::sync) {
    alloc_.deallocate(data_, bytes_);
    return;
  }
  alloc_.release(bytes_);
  stream_->enqueue([&alloc = alloc_, p = data_, n = bytes_] { alloc.free_memory(p, n); });
}

Tensor Tensor::empty(const Shape& shape, DType dt, Tier tier) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dt;
  t.tier_ = tier;
  MemoryContext& ctx = MemoryContext::current();
  t.device_ = tier == Tier::device ? ctx.device() : Device::cpu();
  t.storage_ = std::make_shared<Storage>(ctx.tier(tier), t.nbytes());
  t.data_ = t.storage_->data();
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Tier tier) {
  Tensor t = empty(shape, dt, tier);
  t.zero_();
  return t;
}

Tensor Tensor::from_host(const void* data, const Shape& shape, DType dt, Tier tier) {
  Tensor t = empty(shape, dt, tier);
  t.copy_from(borrow(const_cast<void*>(data), shape, dt, Tier::host));
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dt, Tier tier) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dt;
  t.tier_ = tier;
  t.device_ = tier == Tier::device ? MemoryContext::current().device() : Device::cpu();
  t.data_ = data;
  return t;
}

int64_t Tensor::dim(int i) const {
  LOOM_CHECK(i >= 0 && i < ndim(), "dimension ", i, " out of range for shape ", shape_str(shape_));
  return shape_[i];
}

void Tensor::check_element_type(size_t size, int tag) const {
  static const int tag_of[] = {0, 1, 1, 2, 3, 4, 5, 6};  // indexed by DType
  LOOM_CHECK(dtype_size(dtype_) == size && tag_of[static_cast<int>(dtype_)] == tag,
             "tensor of dtype ", dtype_name(dtype_), " accessed with a mismatched element type");
}

Tensor Tensor::view(const Shape& shape) const {
  LOOM_CHECK(shape_numel(shape) == numel(), "cannot view ", shape_str(shape_), " as ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::rows(int64_t start, int64_t len) const {
  LOOM_CHECK(ndim() >= 1 && start >= 0 && len >= 0 && start + len <= shape_[0], "rows [", start, ", ",
             start + len, ") out of range for shape ", shape_str(shape_));
  Tensor t = *this;
  int64_t row = numel() / (shape_[0] == 0 ? 1 : shape_[0]);
  t.shape_[0] = len;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(start * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::flat(int64_t offset, int64_t n) const {
  LOOM_CHECK(offset >= 0 && n >= 0 && offset + n <= numel(), "flat range [", offset, ", ", offset + n,
             ") out of range for ", numel(), " elements");
  Tensor t = *this;
  t.shape_ = {n};
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(offset) * dtype_size(dtype_);
  return t;
}

// Device memory is written in stream order (the device layer); host and NVMe
// staging memory belongs to the host, which writes it at once.
void Tensor::zero_() {
  if (nbytes() == 0) return;
  if (tier_ == Tier::device)
    ops::zero(data_, nbytes());
  else
    std::memset(data_, 0, nbytes());
}

void Tensor::fill_(float value) {
  LOOM_CHECK(dtype_ == DType::f32 || dtype_ == DType::bf16 || dtype_ == DType::f16, "fill_ on non-floating dtype ",
             dtype_name(dtype_));
  if (tier_ == Tier::device)
    ops::fill(data_, dtype_, numel(), value);
  else
    loom::fill(data_, dtype_, numel(), value);
}

void Tensor::copy_from(const Tensor& src) {
  LOOM_CHECK(src.numel() == numel(), "copy_from: ", src.numel(), " elements into ", numel());
  if (numel() == 0) return;
  const bool on_device = tier_ == Tier::device && src.tier_ == Tier::device;
  // A copy that the host takes part in is blocking, as cudaMemcpy is: the
  // device's earlier writes land first, and the host may use either side
  // when it returns.
  if (!on_device) ops::synchronize();
  if (src.dtype_ == dtype_)
    ops::copy(data_, src.data_, nbytes());
  else
    ops::convert(src.data_, src.dtype_, data_, dtype_, numel());
  if (!on_device) ops::synchronize();
}

Tensor Tensor::clone(Tier tier) const {
  Tensor t = empty(shape_, dtype_, tier);
  t.copy_from(*this);
  return t;
}

}  // namespace loom
