// Statistics (loss sums, sums of squares, non-finite counts) summed over a
// group in f64: an f32 reduction would drop their low digits (a count above
// 2^24 or a loss sum over many tokens). Internal to src/zero, src/memory and
// src/train.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/comm.h"

namespace loom::zero_detail {

// Sums x[0, n) over `group`. The communicator reduces no f64, so the values
// travel as raw 8-byte words and every rank adds them in rank order: the same
// bits on every rank, as a reduction gives.
inline void all_reduce_f64(Communicator& group, double* x, int64_t n) {
  std::vector<double> all(static_cast<size_t>(n * group.size()));
  group.all_gather(x, all.data(), n, DType::i64);
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (int r = 0; r < group.size(); ++r) sum += all[static_cast<size_t>(r * n + i)];
    x[i] = sum;
  }
}

}  // namespace loom::zero_detail
