#include <omp.h>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0) {
#pragma omp parallel for schedule(static) if (B * T * C >= kMinParallelWork)
  for (int64_t i = 0; i < B * T; ++i) {
    const float* w = wte + static_cast<int64_t>(tokens[i]) * C;
    const float* p = wpe + (pos0 + i % T) * C;
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = w[c] + p[c];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0) {
  // A token that occurs several times gets several rows added to the same
  // dwte row. Each thread therefore owns a slice of the columns and walks all
  // rows in order: no races, and each element sums its rows in row order
  // whatever the number of threads.
  const int64_t N = B * T;
  constexpr int64_t kAlign = 16;  // 64-byte slices, so threads never share a cache line of a row
#pragma omp parallel if (N * C >= kMinParallelWork)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t units = (C + kAlign - 1) / kAlign;
    const int64_t c0 = units * tid / nt * kAlign;
    const int64_t c1 = units * (tid + 1) / nt * kAlign < C ? units * (tid + 1) / nt * kAlign : C;
    for (int64_t i = 0; i < N && c0 < c1; ++i) {
      const float* g = dout + i * C;
      if (dwte != nullptr) {
        float* w = dwte + static_cast<int64_t>(tokens[i]) * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) w[c] += g[c];
      }
      if (dwpe != nullptr) {
        float* p = dwpe + (pos0 + i % T) * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) p[c] += g[c];
      }
    }
  }
}

}  // namespace loom::cpu
