#include "kernels/cpu/partition.h"
#include "kernels/cpu/simd_exp.h"
#include "loom/kernels.h"

namespace loom::cpu {

void swiglu_forward(float* h, const float* g, const float* u, int64_t N, int64_t I, int64_t ld) {
#pragma omp parallel for schedule(static) if (N * I >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* gr = g + i * ld;
    const float* ur = u + i * ld;
    float* hr = h + i * I;
    // silu(x) = x / (1 + exp(-x)), as torch computes it.
#pragma omp simd
    for (int64_t j = 0; j < I; ++j) {
      const float x = gr[j];
      hr[j] = x / (1.0f + simd_exp(-x)) * ur[j];
    }
  }
}

void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t N, int64_t I,
                     int64_t ld, GradWrite dgu_write) {
  const bool overwrite = dgu_write == GradWrite::overwrite;
#pragma omp parallel for schedule(static) if (N * I >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* gr = g + i * ld;
    const float* ur = u + i * ld;
    const float* dhr = dh + i * I;
    float* dgr = dg + i * ld;
    float* dur = du + i * ld;
#pragma omp simd
    for (int64_t j = 0; j < I; ++j) {
      const float x = gr[j];
      const float den = 1.0f + simd_exp(-x);
      const float s = 1.0f / den;
      // silu'(x) = s + x s (1 - s); 1 - s is formed directly so that exp
      // overflowing to inf (s = 0) gives 0, not inf * 0.
      const float dgate = dhr[j] * ur[j] * (s + x * s * (1.0f - s));
      const float dup = dhr[j] * (x / den);  // silu(x) as forward rounds it
      dgr[j] = overwrite ? dgate : dgr[j] + dgate;
      dur[j] = overwrite ? dup : dur[j] + dup;
    }
  }
}

}  // namespace loom::cpu
