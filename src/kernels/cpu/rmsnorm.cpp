#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; ++c) sq += x[c] * x[c];
    const float r = 1.0f / std::sqrt(sq * inv_c + eps);
    float* o = out + i * C;
    // (x * rstd) * weight, the order Hugging Face rounds in.
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = x[c] * r * weight[c];
    rstd[i] = r;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradWrite dinp_write) {
  const bool overwrite = dinp_write == GradWrite::overwrite;
  // dweight sums over rows: each fixed chunk of rows sums into its own
  // partial row, and the partials are added in chunk order.
  const int64_t chunks = reduce_chunks(N);
  std::vector<float> dw_partials(static_cast<size_t>(chunks * C));
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t k = 0; k < chunks; ++k) {
    float* dw = dw_partials.data() + k * C;
    for (int64_t c = 0; c < C; ++c) dw[c] = 0.0f;
    const int64_t i1 = (k + 1) * kReduceRows < N ? (k + 1) * kReduceRows : N;
    for (int64_t i = k * kReduceRows; i < i1; ++i) {
      const float* x = inp + i * C;
      const float* g = dout + i * C;
      const float r = rstd[i];
      // With xhat = x r and h = g * weight: dx = r (h - xhat mean(h xhat)).
      float sum_h_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_h_xhat)
      for (int64_t c = 0; c < C; ++c) sum_h_xhat += g[c] * weight[c] * (x[c] * r);
      const float mean_h_xhat = sum_h_xhat * inv_c;
      float* dx = dinp + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = x[c] * r;
        const float d = r * (g[c] * weight[c] - xhat * mean_h_xhat);
        dx[c] = overwrite ? d : dx[c] + d;
        dw[c] += g[c] * xhat;
      }
    }
  }
  add_chunk_partials(dweight, dw_partials.data(), chunks, C);
}

}  // namespace loom::cpu
