// The softmax of one query row of attention scores, shared by the training
// and the generation kernels so that both round alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/simd_exp.h"

namespace loom::cpu {

// row holds `keys` scaled scores of which the first `visible` are seen
// (causal): turns those into probabilities in place, zeroes the rest, and
// returns the log-sum-exp of the visible scores.
inline float causal_softmax_row(float* row, int64_t visible, int64_t keys) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < visible; ++j) m = row[j] > m ? row[j] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < visible; ++j) {
    row[j] = simd_exp(row[j] - m);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < visible; ++j) row[j] *= inv;
  for (int64_t j = visible; j < keys; ++j) row[j] = 0.0f;
  return m + std::log(sum);
}

}  // namespace loom::cpu
