#include <cstring>

#include "loom/core.h"

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

Storage::Storage(Allocator& alloc, size_t bytes) : alloc_(alloc), bytes_(bytes), data_(alloc.allocate(bytes)) {}
Storage::~Storage() { alloc_.deallocate(data_, bytes_); }

Tensor Tensor::empty(const Shape& shape, DType dt, Tier tier) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dt;
  t.tier_ = tier;
  t.storage_ = std::make_shared<Storage>(MemoryContext::current().tier(tier), t.nbytes());
  t.data_ = t.storage_->data();
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Tier tier) {
  Tensor t = empty(shape, dt, tier);
  t.zero_();
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dt, Tier tier) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dt;
  t.tier_ = tier;
  t.data_ = data;
  return t;
}

int64_t Tensor::dim(int i) const {
  LOOM_CHECK(i >= 0 && i < ndim(), "dimension ", i, " out of range for shape ", shape_str(shape_));
  return shape_[i];
}

void Tensor::check_element_type(size_t size, int tag) const {
  static const int tag_of[] = {0, 1, 1, 2, 3, 4};  // indexed by DType
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

void Tensor::zero_() {
  if (nbytes()) std::memset(data_, 0, nbytes());
}

void Tensor::fill_(float value) {
  int64_t n = numel();
  if (dtype_ == DType::f32) {
    float* p = data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = value;
    return;
  }
  LOOM_CHECK(dtype_ == DType::bf16 || dtype_ == DType::f16, "fill_ on non-floating dtype ", dtype_name(dtype_));
  uint16_t bits = dtype_ == DType::bf16 ? f32_to_bf16(value) : f32_to_f16(value);
  uint16_t* p = data<uint16_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = bits;
}

void Tensor::copy_from(const Tensor& src) {
  LOOM_CHECK(src.numel() == numel(), "copy_from: ", src.numel(), " elements into ", numel());
  if (numel() == 0) return;
  if (src.dtype_ == dtype_) {
    std::memcpy(data_, src.data_, nbytes());
    return;
  }
  convert(src.data_, src.dtype_, data_, dtype_, numel());
}

Tensor Tensor::clone(Tier tier) const {
  Tensor t = empty(shape_, dtype_, tier);
  t.copy_from(*this);
  return t;
}

}  // namespace loom
