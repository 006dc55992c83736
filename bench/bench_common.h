// Shared by the benchmarks: a wall clock. The GEMM baseline every ratio is
// quoted against is cpu::measure_sgemm_gflops (loom/kernels.h).
#pragma once

#include <chrono>
#include <cstdint>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::bench {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace loom::bench
