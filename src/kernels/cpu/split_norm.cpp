// LayerNorm and RMSNorm whose hidden dimension is split across ranks: the
// per-row sums the whole-row kernels (layernorm.cpp, rmsnorm.cpp) compute
// inline are computed here over this rank's columns, summed across the
// ranks by the caller, and the rest of the arithmetic is theirs, in the same
// order.
#include <cmath>
#include <vector>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

void norm_row_sums(float* sums, const float* x, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = x + i * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) sum += row[c];
    sums[i] = sum;
  }
}

void norm_row_square_sums(float* sums, const float* x, const float* center, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = x + i * C;
    const float m = center ? center[i] : 0.0f;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; ++c) {
      const float d = row[c] - m;
      sq += d * d;
    }
    sums[i] = sq;
  }
}

void norm_rstd(float* rstd, const float* square_sums, int64_t N, int64_t C_total, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C_total);
  for (int64_t i = 0; i < N; ++i) rstd[i] = 1.0f / std::sqrt(square_sums[i] * inv_c + eps);
}

void norm_apply(float* out, const float* x, const float* mean, const float* rstd, const float* weight,
                const float* bias, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = x + i * C;
    float* o = out + i * C;
    const float r = rstd[i];
    if (mean) {
      const float m = mean[i];
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = (row[c] - m) * r * weight[c] + (bias ? bias[c] : 0.0f);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = row[c] * r * weight[c];
    }
  }
}

void norm_backward_sums(float* sums, const float* dout, const float* x, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* row = x + i * C;
    const float* g = dout + i * C;
    const float m = mean ? mean[i] : 0.0f, r = rstd[i];
    float sum_h = 0.0f, sum_h_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_h, sum_h_xhat)
    for (int64_t c = 0; c < C; ++c) {
      const float h = g[c] * weight[c];
      sum_h += h;
      sum_h_xhat += h * ((row[c] - m) * r);
    }
    sums[2 * i] = sum_h;
    sums[2 * i + 1] = sum_h_xhat;
  }
}

void norm_backward_apply(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                         const float* weight, const float* mean, const float* rstd, const float* sums, int64_t N,
                         int64_t C, int64_t C_total, GradWrite dinp_write) {
  const bool overwrite = dinp_write == GradWrite::overwrite;
  const int64_t chunks = reduce_chunks(N);
  std::vector<float> dw_partials(dweight ? static_cast<size_t>(chunks * C) : 0);
  std::vector<float> db_partials(dbias ? static_cast<size_t>(chunks * C) : 0);
  const float inv_c = 1.0f / static_cast<float>(C_total);
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t k = 0; k < chunks; ++k) {
    float* dw = dweight ? dw_partials.data() + k * C : nullptr;
    float* db = dbias ? db_partials.data() + k * C : nullptr;
    for (int64_t c = 0; c < C; ++c) {
      if (dw) dw[c] = 0.0f;
      if (db) db[c] = 0.0f;
    }
    const int64_t i1 = (k + 1) * kReduceRows < N ? (k + 1) * kReduceRows : N;
    for (int64_t i = k * kReduceRows; i < i1; ++i) {
      const float* row = x + i * C;
      const float* g = dout + i * C;
      const float m = mean ? mean[i] : 0.0f, r = rstd[i];
      const float mean_h = mean ? sums[2 * i] * inv_c : 0.0f, mean_h_xhat = sums[2 * i + 1] * inv_c;
      float* dx = dinp + i * C;
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (row[c] - m) * r;
        const float d = mean ? r * (g[c] * weight[c] - mean_h - xhat * mean_h_xhat)
                             : r * (g[c] * weight[c] - xhat * mean_h_xhat);
        dx[c] = overwrite ? d : dx[c] + d;
        if (dw) dw[c] += g[c] * xhat;
        if (db) db[c] += g[c];
      }
    }
  }
  if (dweight) add_chunk_partials(dweight, dw_partials.data(), chunks, C);
  if (dbias) add_chunk_partials(dbias, db_partials.data(), chunks, C);
}

}  // namespace loom::cpu
