#include <cstddef>
#include <cstring>

#include "kernels/cpu/partition.h"
#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {

// Philox is ~10 rounds of integer multiplies per element, so unlike the other
// elementwise kernels dropout is compute-bound; it parallelizes from a
// smaller size.
constexpr int64_t kMinParallelDraws = 4096;

// Calls f(i, global index) for each element i of a [rows, cols] block whose
// rows are `stride` apart in the global index. A contiguous block is one flat
// loop (no division per element); a strided one is split by rows.
template <typename F>
void for_each_draw(int64_t rows, int64_t cols, int64_t stride, uint64_t first, F f) {
  const int64_t n = rows * cols;
  if (rows == 1 || stride == cols) {
#pragma omp parallel for schedule(static) if (n >= kMinParallelDraws)
    for (int64_t i = 0; i < n; ++i) f(i, first + static_cast<uint64_t>(i));
    return;
  }
#pragma omp parallel for schedule(static) if (n >= kMinParallelDraws)
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t row_first = first + static_cast<uint64_t>(r * stride);
    for (int64_t c = 0; c < cols; ++c) f(r * cols + c, row_first + static_cast<uint64_t>(c));
  }
}

}  // namespace

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first) {
  const int64_t n = rows * cols;
  if (p == 0.0f) {
    // Every element is kept (u >= 0 always) and scaled by 1: a copy.
    if (out != inp) std::memmove(out, inp, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const float keep_scale = 1.0f / (1.0f - p);
  for_each_draw(rows, cols, stride, first, [=](int64_t i, uint64_t index) {
    out[i] = philox_uniform(key, index) >= p ? inp[i] * keep_scale : 0.0f;
  });
}

void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, GradWrite dinp_write) {
  const int64_t n = rows * cols;
  const bool overwrite = dinp_write == GradWrite::overwrite;
  if (p == 0.0f) {
    if (overwrite)
      copy_bytes(dinp, dout, static_cast<size_t>(n) * sizeof(float));
    else
      accumulate(dinp, dout, n);
    return;
  }
  const float keep_scale = 1.0f / (1.0f - p);
  if (overwrite) {
    for_each_draw(rows, cols, stride, first, [=](int64_t i, uint64_t index) {
      dinp[i] = philox_uniform(key, index) >= p ? dout[i] * keep_scale : 0.0f;
    });
  } else {
    for_each_draw(rows, cols, stride, first, [=](int64_t i, uint64_t index) {
      if (philox_uniform(key, index) >= p) dinp[i] += dout[i] * keep_scale;
    });
  }
}

}  // namespace loom::cpu
