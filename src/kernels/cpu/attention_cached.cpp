// Attention for sampling with a KV cache: new positions attend to every
// cached position up to their own.
#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/kernels.h"

namespace loom::cpu {

void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv, int64_t B, int64_t n, int64_t pos0,
                      int64_t block_size, int64_t C, int64_t NH, int64_t NKV) {
  const int64_t hs = C / NH, group = NH / NKV, row = C + 2 * NKV * hs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // The new keys and values first (once per kv head), then the query heads
  // that share them read the cache.
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < NKV; ++g) {
      for (int64_t t = 0; t < n; ++t) {
        const float* r = qkv + (b * n + t) * row;
        const int64_t at = ((b * NKV + g) * block_size + pos0 + t) * hs;
        std::copy_n(r + C + g * hs, hs, k_cache + at);
        std::copy_n(r + C + (NKV + g) * hs, hs, v_cache + at);
      }
    }
  }
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const float* kc = k_cache + ((b * NKV + h / group) * block_size) * hs;
      const float* vc = v_cache + ((b * NKV + h / group) * block_size) * hs;
      std::vector<float> scores(static_cast<size_t>(pos0 + n));
      for (int64_t t = 0; t < n; ++t) {
        const float* q = qkv + (b * n + t) * row + h * hs;
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
