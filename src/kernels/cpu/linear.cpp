#include <cstddef>
#include <vector>

#include "kernels/cpu/partition.h"
#include "kernels/cpu/row_linear.h"
#include "loom/kernels.h"

namespace loom::cpu {

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC, RowBlocking rows) {
#if defined(LOOM_ROW_LINEAR_SIMD)
  // Generation: one dot product per element gives the row independence that
  // fixed row blocks buy from BLAS, without BLAS's copy of the weights per
  // call (the whole cost of a batch-1 decode is reading them once).
  if (rows == RowBlocking::fixed) {
    const int64_t vector_cols = C - C % row_linear::kBlock;
    row_linear::linear(out, OC, inp, bias, N, C, OC,
                       [=](int64_t o) { return row_linear::F32Row{weight + o * C, vector_cols, vector_cols,
                                                                    C * static_cast<int64_t>(sizeof(float))}; });
    return;
  }
#endif
  if (bias != nullptr) {
    // Seed every row with the bias and let the GEMM accumulate onto it
    // (beta = 1): one pass over out instead of a second one afterwards.
#pragma omp parallel for schedule(static) if (N * OC >= kMinParallelWork)
    for (int64_t i = 0; i < N; ++i) {
      float* o = out + i * OC;
#pragma omp simd
      for (int64_t j = 0; j < OC; ++j) o[j] = bias[j];
    }
  }
  gemm(false, true, N, OC, C, 1.0f, inp, C, weight, C, bias != nullptr ? 1.0f : 0.0f, out, OC, rows);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, GradWrite dinp_write) {
  if (dinp != nullptr)
    gemm(false, false, N, C, OC, 1.0f, dout, OC, weight, C, dinp_write == GradWrite::overwrite ? 0.0f : 1.0f, dinp, C);
  if (dweight != nullptr) gemm_split_k(true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias != nullptr) {
    const int64_t chunks = reduce_chunks(N);
    std::vector<float> partials(static_cast<size_t>(chunks * OC));
#pragma omp parallel for schedule(static) if (N * OC >= kMinParallelWork)
    for (int64_t k = 0; k < chunks; ++k) {
      float* p = partials.data() + k * OC;
      const int64_t i1 = (k + 1) * kReduceRows < N ? (k + 1) * kReduceRows : N;
      for (int64_t j = 0; j < OC; ++j) p[j] = 0.0f;
      for (int64_t i = k * kReduceRows; i < i1; ++i) {
        const float* g = dout + i * OC;
#pragma omp simd
        for (int64_t j = 0; j < OC; ++j) p[j] += g[j];
      }
    }
    add_chunk_partials(dbias, partials.data(), chunks, OC);
  }
}

void add_bias(float* out, const float* bias, int64_t N, int64_t OC) {
#pragma omp parallel for schedule(static) if (N * OC >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    float* o = out + i * OC;
#pragma omp simd
    for (int64_t j = 0; j < OC; ++j) o[j] += bias[j];
  }
}

}  // namespace loom::cpu
