#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

void add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void accumulate(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  // Blocks of 256 KiB: below a few of them the threads cost more than they save.
  constexpr size_t kBlock = size_t(1) << 18;
  const int64_t blocks = static_cast<int64_t>((bytes + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static) if (blocks >= 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t begin = static_cast<size_t>(b) * kBlock;
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin,
                std::min(kBlock, bytes - begin));
  }
}

void scale(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

double sum_squares(const float* x, int64_t n) {
  // Fixed chunks summed in chunk order: the same bits for any thread count.
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partials(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t i1 = (k + 1) * kChunk < n ? (k + 1) * kChunk : n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = k * kChunk; i < i1; ++i) s += static_cast<double>(x[i]) * x[i];
    partials[static_cast<size_t>(k)] = s;
  }
  double total = 0.0;
  for (double p : partials) total += p;
  return total;
}

}  // namespace loom::cpu
