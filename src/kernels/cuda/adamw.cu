#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

struct AdamWScalars {
  float decay, step_size, bc2_sqrt, b1, b2, one_minus_b1, one_minus_b2, eps, grad_scale;
  bool keep_zeros;
};

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n, AdamWScalars s) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) {
    const float p = param[i];
    if (s.keep_zeros && p == 0.0f) continue;
    const float g = grad[i] * s.grad_scale;
    const float mi = s.b1 * m[i] + s.one_minus_b1 * g;
    const float vi = s.b2 * v[i] + s.one_minus_b2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    param[i] = p * s.decay - s.step_size * mi / (sqrtf(vi) / s.bc2_sqrt + s.eps);
  }
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s,
                  cudaStream_t stream) {
  // The per-step scalars formed exactly as the CPU kernel forms them.
  const AdamWScalars k{
      .decay = static_cast<float>(1.0 - static_cast<double>(s.lr) * s.weight_decay),
      .step_size = static_cast<float>(static_cast<double>(s.lr) / s.bias_correction1),
      .bc2_sqrt = static_cast<float>(std::sqrt(static_cast<double>(s.bias_correction2))),
      .b1 = s.beta1,
      .b2 = s.beta2,
      .one_minus_b1 = 1.0f - s.beta1,
      .one_minus_b2 = 1.0f - s.beta2,
      .eps = s.eps,
      .grad_scale = s.grad_scale,
      .keep_zeros = s.keep_zeros,
  };
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(param, grad, m, v, n, k);
  check_launch();
}

}  // namespace loom::cuda
