// Element-wise work on buffers stored in a working precision (f32, bf16 or
// f16), computing in fp32.
#include <algorithm>
#include <cmath>

#include "loom/kernels.h"

namespace loom::cpu {

namespace {
// Converted a block at a time so no buffer the size of a model is needed.
constexpr int64_t kBlock = 4096;

void* at(void* base, DType dt, int64_t i) { return static_cast<char*>(base) + static_cast<size_t>(i) * dtype_size(dt); }
const void* at(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + static_cast<size_t>(i) * dtype_size(dt);
}
}  // namespace

void add_rounded(void* dst, DType dt, const float* src, int64_t n) {
  if (dt == DType::f32) {
    accumulate(static_cast<float*>(dst), src, n);
    return;
  }
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    loom::convert(at(dst, dt, i), dt, tmp, DType::f32, m);
    accumulate(tmp, src + i, m);
    loom::convert(tmp, DType::f32, at(dst, dt, i), dt, m);
  }
}

void add_rounded(void* dst, const void* src, DType dt, int64_t n) {
  if (dt == DType::f32) {
    accumulate(static_cast<float*>(dst), static_cast<const float*>(src), n);
    return;
  }
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    loom::convert(at(src, dt, i), dt, tmp, DType::f32, m);
    add_rounded(at(dst, dt, i), dt, tmp, m);
  }
}

int64_t count_non_finite(const void* x, DType dt, int64_t n) {
  int64_t bad = 0;
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    const float* f = static_cast<const float*>(at(x, dt, i));
    if (dt != DType::f32) {
      loom::convert(at(x, dt, i), dt, tmp, DType::f32, m);
      f = tmp;
    }
    for (int64_t j = 0; j < m; ++j) bad += !std::isfinite(f[j]);
  }
  return bad;
}

double sum_squares(const void* x, DType dt, int64_t n) {
  if (dt == DType::f32) return sum_squares(static_cast<const float*>(x), n);
  double sum = 0.0;
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    loom::convert(at(x, dt, i), dt, tmp, DType::f32, m);
    sum += sum_squares(tmp, m);
  }
  return sum;
}

}  // namespace loom::cpu
