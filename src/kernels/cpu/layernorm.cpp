#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {
constexpr float kEps = 1e-5f;
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    const float m = sum * inv_c;
    // Two passes (mean, then squared deviations) rather than E[x^2] - m^2,
    // which cancels catastrophically when |mean| >> std.
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; ++c) {
      const float d = x[c] - m;
      sq += d * d;
    }
    const float r = 1.0f / std::sqrt(sq * inv_c + kEps);
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * weight[c] + bias[c];
    mean[i] = m;
    rstd[i] = r;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        GradWrite dinp_write) {
  const bool overwrite = dinp_write == GradWrite::overwrite;
  // dweight and dbias are sums over rows: each fixed chunk of rows sums into
  // its own partial row, and the partials are added in chunk order.
  const int64_t chunks = reduce_chunks(N);
  std::vector<float> dw_partials(static_cast<size_t>(chunks * C));
  std::vector<float> db_partials(static_cast<size_t>(chunks * C));
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t k = 0; k < chunks; ++k) {
    float* dw = dw_partials.data() + k * C;
    float* db = db_partials.data() + k * C;
    for (int64_t c = 0; c < C; ++c) dw[c] = db[c] = 0.0f;
    const int64_t i1 = (k + 1) * kReduceRows < N ? (k + 1) * kReduceRows : N;
    for (int64_t i = k * kReduceRows; i < i1; ++i) {
      const float* x = inp + i * C;
      const float* g = dout + i * C;
      const float m = mean[i], r = rstd[i];
      // With xhat = (x - m) r and h = g * weight:
      // dx = r (h - mean(h) - xhat mean(h xhat)).
      float sum_h = 0.0f, sum_h_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_h, sum_h_xhat)
      for (int64_t c = 0; c < C; ++c) {
        const float h = g[c] * weight[c];
        sum_h += h;
        sum_h_xhat += h * ((x[c] - m) * r);
      }
      const float mean_h = sum_h * inv_c, mean_h_xhat = sum_h_xhat * inv_c;
      float* dx = dinp + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (x[c] - m) * r;
        const float d = r * (g[c] * weight[c] - mean_h - xhat * mean_h_xhat);
        dx[c] = overwrite ? d : dx[c] + d;
        dw[c] += g[c] * xhat;
        db[c] += g[c];
      }
    }
  }
  add_chunk_partials(dweight, dw_partials.data(), chunks, C);
  add_chunk_partials(dbias, db_partials.data(), chunks, C);
}

}  // namespace loom::cpu
