#include <cstddef>
#include <algorithm>
#include <chrono>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

double measure_sgemm_gflops(int64_t n, int reps) {
  std::vector<float> a(static_cast<size_t>(n * n)), b(a.size()), c(a.size());
  fill_normal(a.data(), n * n, 1, 0, 0.0f, 1.0f);
  fill_normal(b.data(), n * n, 2, 0, 0.0f, 1.0f);
  gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double dn = static_cast<double>(n);
  return 2.0 * dn * dn * dn / best / 1e9;
}

}  // namespace loom::cpu
