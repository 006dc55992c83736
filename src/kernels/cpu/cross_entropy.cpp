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

// One row's distillation sums over its `real` classes, in the order of
// kernels.h's shard_sums; t: the target's column here, or out of [0, real).
void distill_row_sums(float* s, const float* x, const float* z, float mx, float mz, float inv_t, int64_t t,
                      int64_t real) {
  float sx = 0.0f, sxt = 0.0f, sz = 0.0f, szx = 0.0f;
#pragma omp simd reduction(+ : sx, sxt, sz, szx)
  for (int64_t j = 0; j < real; ++j) {
    sx += simd_exp(x[j] - mx);
    sxt += simd_exp((x[j] - mx) * inv_t);
    const float e = simd_exp((z[j] - mz) * inv_t);
    sz += e;
    szx += e * (z[j] - x[j]);
  }
  s[0] = sx;
  s[1] = sxt;
  s[2] = sz;
  s[3] = szx;
  s[4] = t >= 0 && t < real ? x[t] : 0.0f;
}

// A row's losses and stats from its maxes and whole-vocabulary sums.
void distill_row_loss(float* loss, float* kl, float* ce, float* stats, float mx, float mz, const float* s,
                      bool has_target, Distillation d) {
  const float inv_t = 1.0f / d.temperature;
  const float log_sxt = std::log(s[1]), log_sz = std::log(s[2]);
  stats[0] = mx + std::log(s[0]);
  stats[1] = mx * inv_t + log_sxt;
  stats[2] = mz * inv_t + log_sz;
  if (!has_target) {
    *loss = *kl = *ce = 0.0f;
    return;
  }
  *ce = stats[0] - s[4];
  // lse(x/T) - lse(z/T) with the maxes and the logs apart, so that a student
  // equal to its teacher has a KL of exactly 0.
  *kl = s[3] * inv_t / s[2] + ((mx - mz) * inv_t + (log_sxt - log_sz));
  *loss = d.alpha * d.temperature * d.temperature * *kl + (1.0f - d.alpha) * *ce;
}

// dloss * (alpha T (softmax(x/T) - softmax(z/T)) + (1 - alpha)(softmax(x) -
// onehot)) over a row's `real` classes, zero for padding; d may alias x.
void distill_row_gradient(float* dx, const float* x, const float* z, const float* stats, float g, int64_t t,
                          int64_t real, int64_t V, Distillation d) {
  const float inv_t = 1.0f / d.temperature, a = g * d.alpha * d.temperature, b = g * (1.0f - d.alpha);
  const float lse = stats[0], lse_x = stats[1], lse_z = stats[2];
#pragma omp simd
  for (int64_t j = 0; j < real; ++j)
    dx[j] = a * (simd_exp(x[j] * inv_t - lse_x) - simd_exp(z[j] * inv_t - lse_z)) + b * simd_exp(x[j] - lse);
  std::fill(dx + real, dx + V, 0.0f);
  if (t >= 0 && t < real) dx[t] -= b;
}

// The whole-vocabulary forward of row i, the shard forms with one shard.
void distill_row_forward(float* losses, float* kl, float* ce, float* stats, const float* x, const float* z,
                         const int32_t* targets, Distillation d, int64_t i, int64_t V) {
  const float mx = max_of(x, V), mz = max_of(z, V);
  float s[5];
  distill_row_sums(s, x, z, mx, mz, 1.0f / d.temperature, targets[i], V);
  distill_row_loss(losses + i, kl + i, ce + i, stats + 3 * i, mx, mz, s, targets[i] >= 0, d);
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

void distill_forward(float* losses, float* kl, float* ce, float* stats, const float* logits, const float* teacher,
                     const int32_t* targets, Distillation d, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i)
    distill_row_forward(losses, kl, ce, stats, logits + i * V, teacher + i * V, targets, d, i, V);
}

void distill_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                      const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V) {
  distill_shard_backward(dlogits, logits, teacher, stats, targets, dloss, d, 0, N, V, V);
}

void distill_forward_backward(float* losses, float* kl, float* ce, float* stats, float* logits, const float* teacher,
                              const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    float* x = logits + i * V;
    const float* z = teacher + i * V;
    distill_row_forward(losses, kl, ce, stats, x, z, targets, d, i, V);
    if (targets[i] < 0)
      std::fill(x, x + V, 0.0f);
    else
      distill_row_gradient(x, x, z, stats + 3 * i, dloss[i], targets[i], V, V, d);
  }
}

void distill_shard_max(float* row_max, const float* logits, const float* teacher, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    row_max[2 * i] = max_of(logits + i * V, real);
    row_max[2 * i + 1] = max_of(teacher + i * V, real);
  }
}

void distill_shard_sums(float* sums, const float* logits, const float* teacher, const float* row_max,
                        const int32_t* targets, Distillation d, int64_t first, int64_t N, int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i)
    distill_row_sums(sums + 5 * i, logits + i * V, teacher + i * V, row_max[2 * i], row_max[2 * i + 1],
                     1.0f / d.temperature, targets[i] < 0 ? -1 : static_cast<int64_t>(targets[i]) - first, real);
}

void distill_shard_loss(float* losses, float* kl, float* ce, float* stats, const float* row_max, const float* sums,
                        const int32_t* targets, Distillation d, int64_t N) {
  for (int64_t i = 0; i < N; ++i)
    distill_row_loss(losses + i, kl + i, ce + i, stats + 3 * i, row_max[2 * i], row_max[2 * i + 1], sums + 5 * i,
                     targets[i] >= 0, d);
}

void distill_shard_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                            const int32_t* targets, const float* dloss, Distillation d, int64_t first, int64_t N,
                            int64_t V, int64_t real) {
#pragma omp parallel for schedule(static) if (N * V >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) {
    float* dx = dlogits + i * V;
    if (targets[i] < 0) {
      std::fill(dx, dx + V, 0.0f);
      continue;
    }
    distill_row_gradient(dx, logits + i * V, teacher + i * V, stats + 3 * i, dloss[i],
                         static_cast<int64_t>(targets[i]) - first, real, V, d);
  }
}

}  // namespace loom::cpu
