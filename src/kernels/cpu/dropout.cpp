#include <cstddef>
#include <cstring>

#include "kernels/cpu/partition.h"
#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

// Philox is ~10 rounds of integer multiplies per element, so unlike the other
// elementwise kernels dropout is compute-bound; it parallelizes from a
// smaller size.
namespace {
constexpr int64_t kMinParallelDraws = 4096;
}

void dropout_forward(float* out, const float* inp, int64_t n, float p, uint64_t key, uint64_t first) {
  if (p == 0.0f) {
    // Every element is kept (u >= 0 always) and scaled by 1: a copy.
    if (out != inp) std::memmove(out, inp, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const float keep_scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n >= kMinParallelDraws)
  for (int64_t i = 0; i < n; ++i)
    out[i] = philox_uniform(key, first + static_cast<uint64_t>(i)) >= p ? inp[i] * keep_scale : 0.0f;
}

void dropout_backward(float* dinp, const float* dout, int64_t n, float p, uint64_t key, uint64_t first,
                      GradWrite dinp_write) {
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
#pragma omp parallel for schedule(static) if (n >= kMinParallelDraws)
    for (int64_t i = 0; i < n; ++i)
      dinp[i] = philox_uniform(key, first + static_cast<uint64_t>(i)) >= p ? dout[i] * keep_scale : 0.0f;
  } else {
#pragma omp parallel for schedule(static) if (n >= kMinParallelDraws)
    for (int64_t i = 0; i < n; ++i)
      if (philox_uniform(key, first + static_cast<uint64_t>(i)) >= p) dinp[i] += dout[i] * keep_scale;
  }
}

}  // namespace loom::cpu
