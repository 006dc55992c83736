#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/partition.h"
#include "kernels/cpu/simd_exp.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {

// The two passes over a row of logits, shared by the whole-vocabulary and the
// vocabulary-parallel forms so both compute the same bits.
float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// Subtracting the max keeps every exp in (0, 1]; NaN logits propagate
// through the sum into the loss.
float sum_exp_of(const float* x, float m, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += simd_exp(x[j] - m);
  return sum;
}

// dloss * (softmax - onehot) over a row's `real` classes, zero for padding;
// d may alias x. t: the target's column in this row, or out of [0, real).
void gradient_row(float* d, const float* x, float l, float g, int64_t t, int64_t real, int64_t V) {
#pragma omp simd
  for (int64_t j = 0; j < real; ++j) d[j] = g * simd_exp(x[j] - l);
  std::fill(d + real, d + V, 0.0f);
  if (t >= 0 && t < real) d[t] -= g;
}

}  // namespace

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    const float m = max_of(x, V);
    const float l = m + std::log(sum_exp_of(x, m, V));
    lse[i] = l;
    losses[i] = targets[i] < 0 ? 0.0f : l - x[targets[i]];
  }
}

void cross_entropy_forward_backward(float* losses, float* lse, float* logits, const int32_t* targets,
                                    const float* dloss, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    float* x = logits + i * V;
    const float m = max_of(x, V);
    const float l = m + std::log(sum_exp_of(x, m, V));
    lse[i] = l;
    if (targets[i] < 0) {
      losses[i] = 0.0f;
      std::fill(x, x + V, 0.0f);
      continue;
    }
    losses[i] = l - x[targets[i]];
    gradient_row(x, x, l, dloss[i], targets[i], V, V);
  }
}

void add_sum_f64(double* sum, const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  *sum += s;
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V) {
  // The whole vocabulary is the one shard that starts at class 0.
  cross_entropy_shard_backward(dlogits, logits, lse, targets, dloss, 0, N, V, V);
}

void cross_entropy_shard_max(float* row_max, const float* logits, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) row_max[i] = max_of(logits + i * V, real);
}

void cross_entropy_shard_sums(float* sums, const float* logits, const float* row_max, const int32_t* targets,
                              int64_t first, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    sums[2 * i] = sum_exp_of(x, row_max[i], real);
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
    gradient_row(d, x, lse[i], dloss[i], static_cast<int64_t>(targets[i]) - first, real, V);
  }
}

void cross_entropy_shard_loss(float* losses, float* lse, const float* row_max, const float* sums,
                              const int32_t* targets, int64_t N) {
  for (int64_t i = 0; i < N; ++i) {
    lse[i] = row_max[i] + std::log(sums[2 * i]);
    losses[i] = targets[i] < 0 ? 0.0f : lse[i] - sums[2 * i + 1];
  }
}

}  // namespace loom::cpu
