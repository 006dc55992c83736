// Addressing buffers stored in a working precision (f32, bf16 or f16).
// Internal to src/zero and src/memory; the arithmetic on them is in the
// device layer (ops::add_rounded, count_non_finite, sum_squares).
#pragma once

#include <cstdint>

#include "loom/core.h"

namespace loom::zero_detail {

// Pointer to element i of a buffer of dt.
inline void* at(void* base, DType dt, int64_t i) {
  return static_cast<char*>(base) + static_cast<size_t>(i) * dtype_size(dt);
}
inline const void* at(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + static_cast<size_t>(i) * dtype_size(dt);
}

}  // namespace loom::zero_detail
