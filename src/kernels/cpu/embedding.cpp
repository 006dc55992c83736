#include <algorithm>
#include <omp.h>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {

// dst[row(i)] += src[i] for each of the N rows of src; a negative row(i)
// skips row i. A destination row may receive several source rows (a repeated
// token, a position in every sequence), so each thread owns a slice of the
// columns and walks every source row in order: no races, and each element
// sums its rows in row order whatever the number of threads.
template <typename Row>
void scatter_add_rows(float* dst, const float* src, int64_t N, int64_t C, Row row) {
  if (dst == nullptr) return;  // a frozen parameter's gradient
  constexpr int64_t kAlign = 16;  // 64-byte slices, so threads never share a cache line of a row
#pragma omp parallel if (N * C >= kMinParallelWork)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t units = (C + kAlign - 1) / kAlign;
    const int64_t c0 = units * tid / nt * kAlign;
    const int64_t c1 = std::min(units * (tid + 1) / nt * kAlign, C);
    for (int64_t i = 0; i < N && c0 < c1; ++i) {
      const int64_t r = row(i);
      if (r < 0) continue;
      const float* g = src + i * C;
      float* d = dst + r * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

}  // namespace

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
  const int64_t N = B * T;
  if (dwte != nullptr) scatter_add_rows(dwte, dout, N, C, [&](int64_t i) { return static_cast<int64_t>(tokens[i]); });
  if (dwpe != nullptr) scatter_add_rows(dwpe, dout, N, C, [&](int64_t i) { return pos0 + i % T; });
}

void embedding_lookup_range(float* out, const int32_t* tokens, const float* wte, int64_t first, int64_t rows,
                            int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = static_cast<int64_t>(tokens[i]) - first;
    float* o = out + i * C;
    if (row < 0 || row >= rows) {
      std::fill(o, o + C, 0.0f);
      continue;
    }
    const float* w = wte + row * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = w[c];
  }
}

void embedding_lookup_range_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t first,
                                     int64_t rows, int64_t N, int64_t C) {
  scatter_add_rows(dwte, dout, N, C, [&](int64_t i) {
    const int64_t row = static_cast<int64_t>(tokens[i]) - first;
    return row < rows ? row : -1;
  });
}

void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t N, int64_t T, int64_t C,
                            int64_t pos0) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* p = wpe + (pos0 + (row0 + i) % T) * C;
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] += p[c];
  }
}

void position_embedding_backward(float* dwpe, const float* dout, int64_t row0, int64_t N, int64_t T, int64_t C) {
  scatter_add_rows(dwpe, dout, N, C, [&](int64_t i) { return (row0 + i) % T; });
}

}  // namespace loom::cpu
