// Element-wise helpers over buffers stored in a working precision (f32, bf16
// or f16), computing in fp32. Internal to src/zero.
#pragma once

#include <cstdint>

#include "loom/core.h"

namespace loom::zero_detail {

// dst = round(dst + src): one rounding to dt per call, as a micro-batch's fp32
// gradient is added into a working-precision accumulator.
void add_rounded(void* dst, DType dt, const float* src, int64_t n);
// dst = round(dst + src) with src in dt too (shards of reduced gradients).
void add_rounded(void* dst, const void* src, DType dt, int64_t n);
int64_t count_non_finite(const void* x, DType dt, int64_t n);
double sum_squares(const void* x, DType dt, int64_t n);

// Pointer to element i of a buffer of dt.
inline void* at(void* base, DType dt, int64_t i) {
  return static_cast<char*>(base) + static_cast<size_t>(i) * dtype_size(dt);
}
inline const void* at(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + static_cast<size_t>(i) * dtype_size(dt);
}

}  // namespace loom::zero_detail
