#include <omp.h>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu {

int num_threads() { return omp_get_max_threads(); }

// BLAS needs no budget of its own: gemm runs it single-threaded inside
// OpenMP regions (see gemm.cpp).
void set_num_threads(int n) {
  LOOM_CHECK(n >= 1, "a thread budget must be at least 1, got ", n);
  omp_set_num_threads(n);
}

}  // namespace loom::cpu
