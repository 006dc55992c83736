// Helpers shared by loom's tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "loom/core.h"

namespace loom::testing {

// Deterministic token ids in [0, vocab).
inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[static_cast<size_t>(i)] = static_cast<int32_t>(Philox::block(seed, 0, static_cast<uint64_t>(i))[0] %
                                                     static_cast<uint32_t>(vocab));
  return t;
}

inline bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// max |a - b| / max(|b|, floor) over the elements.
inline double max_rel_diff(const float* a, const float* b, int64_t n, double floor = 1e-30) {
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double d = std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(std::fabs(static_cast<double>(b[i])), floor);
    worst = std::max(worst, d);
  }
  return worst;
}

}  // namespace loom::testing
