#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/partition.h"
#include "kernels/cpu/simd_exp.h"
#include "loom/kernels.h"

namespace loom::cpu {

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; ++j) m = x[j] > m ? x[j] : m;
    // Subtracting the max keeps every exp in (0, 1]; NaN logits propagate
    // through the sum into the loss.
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < V; ++j) sum += simd_exp(x[j] - m);
    const float l = m + std::log(sum);
    lse[i] = l;
    losses[i] = targets[i] < 0 ? 0.0f : l - x[targets[i]];
  }
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    // dlogits may be logits itself: every element is read before it is
    // written, at the same index.
    const float* x = logits + i * V;
    float* d = dlogits + i * V;
    const int32_t t = targets[i];
    if (t < 0) {
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) d[j] = 0.0f;
      continue;
    }
    const float g = dloss[i], l = lse[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) d[j] = g * simd_exp(x[j] - l);
    d[t] -= g;
  }
}

void cross_entropy_shard_max(float* row_max, const float* logits, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < real; ++j) m = x[j] > m ? x[j] : m;
    row_max[i] = m;
  }
}

void cross_entropy_shard_sums(float* sums, const float* logits, const float* row_max, const int32_t* targets,
                              int64_t first, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    const float m = row_max[i];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < real; ++j) sum += simd_exp(x[j] - m);
    sums[2 * i] = sum;
    const int64_t t = static_cast<int64_t>(targets[i]) - first;
    sums[2 * i + 1] = targets[i] >= 0 && t >= 0 && t < real ? x[t] : 0.0f;
  }
}

void cross_entropy_shard_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  const float* dloss, int64_t first, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    float* d = dlogits + i * V;
    if (targets[i] < 0) {
      std::fill(d, d + V, 0.0f);
      continue;
    }
    const float g = dloss[i], l = lse[i];
#pragma omp simd
    for (int64_t j = 0; j < real; ++j) d[j] = g * simd_exp(x[j] - l);
    std::fill(d + real, d + V, 0.0f);
    const int64_t t = static_cast<int64_t>(targets[i]) - first;
    if (t >= 0 && t < real) d[t] -= g;
  }
}

}  // namespace loom::cpu
