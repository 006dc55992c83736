#include "comm/buffer_ops.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "loom/kernels.h"

namespace loom::detail {

namespace {

// Elements reduced at a time: the accumulator and one converted input stay in
// L1 while every input streams through once.
constexpr int64_t kBlock = 2048;
// Below this many elements a reduction or copy runs on one thread.
constexpr int64_t kParallelElements = int64_t{1} << 18;
constexpr size_t kParallelBytes = size_t{1} << 20;

// Loads len elements starting at `begin` into the accumulator type.
template <typename T, typename Acc>
void load(Acc* dst, const void* src, int64_t begin, int64_t len, DType dtype) {
  const T* s = static_cast<const T*>(src) + begin;
  if constexpr (std::is_same_v<T, uint16_t>) {
    convert(s, dtype, dst, DType::f32, len);
  } else if constexpr (std::is_same_v<T, Acc>) {
    std::memcpy(dst, s, static_cast<size_t>(len) * sizeof(T));
  } else {
    for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<Acc>(s[i]);
  }
}

template <typename T, typename Acc>
void store(void* dst, int64_t begin, const Acc* src, int64_t len, DType dtype) {
  T* d = static_cast<T*>(dst) + begin;
  if constexpr (std::is_same_v<T, uint16_t>) {
    convert(src, DType::f32, d, dtype, len);
  } else if constexpr (std::is_same_v<T, Acc>) {
    std::memcpy(d, src, static_cast<size_t>(len) * sizeof(T));
  } else {
    // Narrowing integer conversion is modular (C++20): sums wrap.
    for (int64_t i = 0; i < len; ++i) d[i] = static_cast<T>(src[i]);
  }
}

template <typename Acc>
void fold(Acc* acc, const Acc* x, int64_t len, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      if constexpr (std::is_floating_point_v<Acc>) {
        for (int64_t i = 0; i < len; ++i) acc[i] += x[i];
      } else {
        // Unsigned arithmetic wraps instead of overflowing.
        for (int64_t i = 0; i < len; ++i)
          acc[i] = static_cast<Acc>(static_cast<uint64_t>(acc[i]) + static_cast<uint64_t>(x[i]));
      }
      return;
    case ReduceOp::max:
      // x != x is true only for NaN, so a NaN anywhere wins.
      for (int64_t i = 0; i < len; ++i) acc[i] = (x[i] > acc[i] || x[i] != x[i]) ? x[i] : acc[i];
      return;
    case ReduceOp::min:
      for (int64_t i = 0; i < len; ++i) acc[i] = (x[i] < acc[i] || x[i] != x[i]) ? x[i] : acc[i];
      return;
  }
}

template <typename T, typename Acc>
void reduce_typed(const void* const* inputs, int num_inputs, void* const* outputs, int num_outputs, int64_t count,
                  DType dtype, ReduceOp op) {
  const int64_t blocks = (count + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (count >= kParallelElements)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t len = std::min(kBlock, count - begin);
    alignas(64) Acc acc[kBlock];
    alignas(64) Acc x[kBlock];
    load<T>(acc, inputs[0], begin, len, dtype);
    for (int k = 1; k < num_inputs; ++k) {
      load<T>(x, inputs[k], begin, len, dtype);
      fold(acc, x, len, op);
    }
    if (op == ReduceOp::avg) {
      const Acc n = static_cast<Acc>(num_inputs);
      for (int64_t i = 0; i < len; ++i) acc[i] /= n;
    }
    for (int j = 0; j < num_outputs; ++j) store<T>(outputs[j], begin, acc, len, dtype);
  }
}

}  // namespace

void reduce_into(const void* const* inputs, int num_inputs, void* const* outputs, int num_outputs, int64_t count,
                 DType dtype, ReduceOp op) {
  LOOM_CHECK(num_inputs >= 1 && count >= 0, "reduce_into: ", num_inputs, " inputs, ", count, " elements");
  switch (dtype) {
    case DType::f32: return reduce_typed<float, float>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::bf16:
    case DType::f16: return reduce_typed<uint16_t, float>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::i32: return reduce_typed<int32_t, int64_t>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::i64: return reduce_typed<int64_t, int64_t>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::u8: return reduce_typed<uint8_t, int64_t>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::i8: return reduce_typed<int8_t, int64_t>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
    case DType::f64: return reduce_typed<double, double>(inputs, num_inputs, outputs, num_outputs, count, dtype, op);
  }
  LOOM_CHECK(false, "reduce_into: unknown dtype");
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) return;
  const int threads = cpu::num_threads();
  if (bytes < kParallelBytes || threads == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t chunk = (bytes + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const size_t begin = std::min(bytes, chunk * t);
    const size_t len = std::min(bytes - begin, chunk);
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
  }
}

}  // namespace loom::detail
