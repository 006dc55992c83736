// Attention for sampling with a KV cache: new positions attend to every
// cached position up to their own.
#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/kernels.h"

namespace loom::cpu {

void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv, int64_t B, int64_t n, int64_t pos0,
                      int64_t block_size, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      float* kc = k_cache + ((b * NH + h) * block_size) * hs;
      float* vc = v_cache + ((b * NH + h) * block_size) * hs;
      for (int64_t t = 0; t < n; ++t) {
        const float* row = qkv + (b * n + t) * 3 * C;
        std::copy_n(row + C + h * hs, hs, kc + (pos0 + t) * hs);
        std::copy_n(row + 2 * C + h * hs, hs, vc + (pos0 + t) * hs);
      }
      std::vector<float> scores(static_cast<size_t>(pos0 + n));
      for (int64_t t = 0; t < n; ++t) {
        const float* q = qkv + (b * n + t) * 3 * C + h * hs;
        const int64_t len = pos0 + t + 1;
        float maxv = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          float dot = 0.0f;
          for (int64_t d = 0; d < hs; ++d) dot += q[d] * kc[j * hs + d];
          scores[j] = dot * scale;
          maxv = std::max(maxv, scores[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
          scores[j] = std::exp(scores[j] - maxv);
          sum += scores[j];
        }
        float* o = out + (b * n + t) * C + h * hs;
        std::fill_n(o, hs, 0.0f);
        for (int64_t j = 0; j < len; ++j) {
          const float p = scores[j] / sum;
          for (int64_t d = 0; d < hs; ++d) o[d] += p * vc[j * hs + d];
        }
      }
    }
  }
}

}  // namespace loom::cpu
