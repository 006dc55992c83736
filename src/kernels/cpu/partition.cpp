#include "kernels/cpu/partition.h"

namespace loom::cpu {

void add_chunk_partials(float* dst, const float* partials, int64_t chunks, int64_t C) {
  if (dst == nullptr) return;  // a frozen parameter's gradient
  // Parallel over columns: each column's sum runs over the chunks in order on
  // one thread, whichever thread that is.
  constexpr int64_t kColumns = 256;
  const int64_t blocks = (C + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (chunks * C >= kMinParallelWork)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumns;
    const int64_t c1 = c0 + kColumns < C ? c0 + kColumns : C;
    float sum[kColumns];
    for (int64_t c = c0; c < c1; ++c) sum[c - c0] = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) {
      const float* p = partials + k * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) sum[c - c0] += p[c];
    }
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) dst[c] += sum[c - c0];
  }
}

}  // namespace loom::cpu
