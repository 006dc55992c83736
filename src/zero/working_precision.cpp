#include "working_precision.h"

#include <cmath>

#include "loom/kernels.h"

namespace loom::zero_detail {

namespace {
// Converted a block at a time so no buffer the size of a model is needed.
constexpr int64_t kBlock = 4096;
}  // namespace

void add_rounded(void* dst, DType dt, const float* src, int64_t n) {
  if (dt == DType::f32) {
    cpu::accumulate(static_cast<float*>(dst), src, n);
    return;
  }
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    convert(at(dst, dt, i), dt, tmp, DType::f32, m);
    cpu::accumulate(tmp, src + i, m);
    convert(tmp, DType::f32, at(dst, dt, i), dt, m);
  }
}

void add_rounded(void* dst, const void* src, DType dt, int64_t n) {
  if (dt == DType::f32) {
    cpu::accumulate(static_cast<float*>(dst), static_cast<const float*>(src), n);
    return;
  }
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    convert(at(src, dt, i), dt, tmp, DType::f32, m);
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
      convert(at(x, dt, i), dt, tmp, DType::f32, m);
      f = tmp;
    }
    for (int64_t j = 0; j < m; ++j) bad += !std::isfinite(f[j]);
  }
  return bad;
}

double sum_squares(const void* x, DType dt, int64_t n) {
  if (dt == DType::f32) return cpu::sum_squares(static_cast<const float*>(x), n);
  double sum = 0.0;
  float tmp[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    convert(at(x, dt, i), dt, tmp, DType::f32, m);
    sum += cpu::sum_squares(tmp, m);
  }
  return sum;
}

}  // namespace loom::zero_detail
