#include <cblas.h>
#include <omp.h>

#include <climits>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

// OpenBLAS splits a threaded GEMM differently for different thread counts,
// and the split changes the rounding of some elements. So BLAS never threads
// here: C is cut into tiles fixed by the shape alone, each tile is one
// single-threaded BLAS call, and OpenMP runs the tiles in parallel under the
// caller's budget. The OpenMP build of OpenBLAS threads by the calling
// thread's OpenMP budget unless it is already inside a parallel region, so
// each tile is called with that budget set to 1, which also leaves OpenBLAS's
// process-wide thread count alone (rank threads would fight over it).
namespace {

// Rows (or columns) of C per tile. Each tile repacks the operand it shares
// with the other tiles, about 1/(2 kTile) of its flops in copies.
constexpr int64_t kTile = 256;

// Below this many flops a GEMM is not worth a parallel region.
constexpr double kMinParallelFlops = 4e6;

void blas_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B,
              static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  // CBLAS takes 32-bit sizes (LP64 builds); a larger matrix is a caller bug.
  LOOM_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX,
             "gemm sizes exceed the 32-bit BLAS interface: M=", M, " N=", N, " K=", K, " lda=", lda, " ldb=", ldb,
             " ldc=", ldc);
  // Tiles run along the longer side of C.
  const bool by_rows = M >= N;
  const int64_t tiles = ((by_rows ? M : N) + kTile - 1) / kTile;
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
#pragma omp parallel if (tiles > 1 && flops >= kMinParallelFlops)
  {
    // Only this region's copy of the budget: the caller's is restored after it.
    omp_set_num_threads(1);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t start = t * kTile;
      if (by_rows) {
        const int64_t rows = M - start < kTile ? M - start : kTile;
        blas_sgemm(trans_a, trans_b, rows, N, K, alpha, trans_a ? A + start : A + start * lda, lda, B, ldb, beta,
                   C + start * ldc, ldc);
      } else {
        const int64_t cols = N - start < kTile ? N - start : kTile;
        blas_sgemm(trans_a, trans_b, M, cols, K, alpha, A, lda, trans_b ? B + start * ldb : B + start, ldb, beta,
                   C + start, ldc);
      }
    }
  }
}

}  // namespace loom::cpu
