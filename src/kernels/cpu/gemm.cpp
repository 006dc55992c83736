#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cpu/partition.h"
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

// Tasks to aim for, enough to load a many-core machine evenly: below that
// many tiles along C's longer side, C is cut along both sides (and
// gemm_split_k cuts K too).
constexpr int64_t kTargetTasks = 48;

// The shortest K chunk of gemm_split_k worth a BLAS call of its own.
constexpr int64_t kMinChunkK = 256;

// Below this many flops a GEMM is not worth a parallel region.
constexpr double kMinParallelFlops = 4e6;

void blas_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B,
              static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }

// How C is tiled, from its shape alone: strips along the longer side when
// they are enough tasks (each BLAS call then sees a whole row or column of
// tiles), square tiles otherwise.
struct Tiling {
  int64_t tile_m, tile_n, tm, tn;
  Tiling(int64_t M, int64_t N) {
    const bool strips = tiles_of(M >= N ? M : N) >= kTargetTasks;
    tile_m = strips && M < N ? M : kTile;
    tile_n = strips && M >= N ? N : kTile;
    tm = (M + tile_m - 1) / tile_m;
    tn = (N + tile_n - 1) / tile_n;
  }
  int64_t tiles() const { return tm * tn; }
};

// C = alpha op(A) op(B) + beta C. With split_k, K is cut into chunks too, as
// many as bring the tasks up to kTargetTasks, none shorter than kMinChunkK.
// Chunk 0 of each tile goes straight into C (with beta), chunk c > 0 into
// partial c - 1; a second pass adds the partials into C in chunk order. Every
// element is one fixed sequence of BLAS calls and additions, so the result is
// the same whichever thread runs which task.
void tiled_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc, bool split_k) {
  if (M == 0 || N == 0) return;
  // CBLAS takes 32-bit sizes (LP64 builds); a larger matrix is a caller bug.
  LOOM_CHECK(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX,
             "gemm sizes exceed the 32-bit BLAS interface: M=", M, " N=", N, " K=", K, " lda=", lda, " ldb=", ldb,
             " ldc=", ldc);
  const Tiling t(M, N);
  const int64_t tiles = t.tiles();
  int64_t k_chunks = split_k ? (kTargetTasks + tiles - 1) / tiles : 1;
  if (k_chunks > K / kMinChunkK) k_chunks = K / kMinChunkK;
  if (k_chunks < 1) k_chunks = 1;
  const int64_t kc = (K + k_chunks - 1) / k_chunks;  // K per chunk; the last may be shorter
  const int64_t MN = M * N;
  // The partials live in a buffer kept by the calling thread (a rank) and
  // reused: weight gradients come every layer of every step, and fresh pages
  // each time would cost more than the reduction. kTargetTasks bounds it to
  // about kTargetTasks tiles of floats (12 MiB).
  thread_local std::vector<float> scratch;
  if (k_chunks > 1 && scratch.size() < static_cast<size_t>((k_chunks - 1) * MN))
    scratch.resize(static_cast<size_t>((k_chunks - 1) * MN));
  float* const partials = scratch.data();
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
#pragma omp parallel if (tiles * k_chunks > 1 && flops >= kMinParallelFlops)
  {
    // Only this region's copy of the budget: the caller's is restored after it.
    omp_set_num_threads(1);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tiles * k_chunks; ++task) {
      const int64_t chunk = task / tiles, tile = task % tiles;
      const int64_t i0 = tile / t.tn * t.tile_m, j0 = tile % t.tn * t.tile_n;
      const int64_t rows = M - i0 < t.tile_m ? M - i0 : t.tile_m, cols = N - j0 < t.tile_n ? N - j0 : t.tile_n;
      const int64_t k0 = chunk * kc, depth = K - k0 < kc ? K - k0 : kc;
      const float* a = trans_a ? A + k0 * lda + i0 : A + i0 * lda + k0;
      const float* b = trans_b ? B + j0 * ldb + k0 : B + k0 * ldb + j0;
      if (chunk == 0)
        blas_sgemm(trans_a, trans_b, rows, cols, depth, alpha, a, lda, b, ldb, beta, C + i0 * ldc + j0, ldc);
      else
        blas_sgemm(trans_a, trans_b, rows, cols, depth, alpha, a, lda, b, ldb, 0.0f,
                   partials + (chunk - 1) * MN + i0 * N + j0, N);
    }
    if (k_chunks > 1) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < M; ++i) {
        float* c = C + i * ldc;
        for (int64_t chunk = 1; chunk < k_chunks; ++chunk) {
          const float* p = partials + (chunk - 1) * MN + i * N;
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) c[j] += p[j];
        }
      }
    }
  }
}

// RowBlocking::fixed: each block of op(A)'s rows is copied into a [block, K]
// buffer and its rows of C into a [block, N] one, so every call has one form
// (no transposition, the same leading dimensions) as well as one shape.
void fixed_row_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  constexpr int64_t R = kFixedRowBlock;
  thread_local std::vector<float> a, c;
  a.assign(static_cast<size_t>(R * K), 0.0f);
  c.assign(static_cast<size_t>(R * N), 0.0f);
  for (int64_t i0 = 0; i0 < M; i0 += R) {
    const int64_t rows = M - i0 < R ? M - i0 : R;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k)
        a[static_cast<size_t>(r * K + k)] = trans_a ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
    if (beta != 0.0f)
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(C + (i0 + r) * ldc, N, c.data() + r * N);
    tiled_gemm(false, trans_b, R, N, K, alpha, a.data(), K, B, ldb, beta, c.data(), N, false);
    for (int64_t r = 0; r < rows; ++r) std::copy_n(c.data() + r * N, N, C + (i0 + r) * ldc);
  }
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, RowBlocking rows) {
  if (rows == RowBlocking::fixed)
    fixed_row_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    tiled_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, false);
}

void gemm_split_k(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  tiled_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, true);
}

}  // namespace loom::cpu
