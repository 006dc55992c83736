// Shared by the benchmarks: a wall clock and the median of timings. The GEMM baseline every ratio is
// quoted against is cpu::measure_sgemm_gflops (loom/kernels.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::bench {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace loom::bench
