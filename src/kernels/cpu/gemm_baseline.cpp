#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

// cblas_sgemm itself, not cpu::gemm: the baseline is what the BLAS library
// reaches with its own threading (the OpenMP build follows the caller's
// budget), which gemm's deterministic tiling gives up a few percent of.
double measure_sgemm_gflops(int64_t n, int reps) {
  LOOM_CHECK(n > 0 && n <= INT_MAX, "sgemm baseline size out of range: ", n);
  std::vector<float> a(static_cast<size_t>(n * n)), b(a.size()), c(a.size());
  fill_normal(a.data(), n * n, 1, 0, 0.0f, 1.0f);
  fill_normal(b.data(), n * n, 2, 0, 0.0f, 1.0f);
  const int dim = static_cast<int>(n);
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, dim, dim, dim, 1.0f, a.data(), dim, b.data(), dim, 0.0f,
                c.data(), dim);
  };
  run();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double dn = static_cast<double>(n);
  return 2.0 * dn * dn * dn / best / 1e9;
}

}  // namespace loom::cpu
