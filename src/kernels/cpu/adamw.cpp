#include <cmath>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

AdamWStep AdamWStep::at(int64_t t, float lr, float beta1, float beta2, float eps, float weight_decay) {
  AdamWStep s;
  s.lr = lr;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.weight_decay = weight_decay;
  // In double: 1 - 0.999^t in float loses most of its digits for small t.
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t)));
  s.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t)));
  return s;
}

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s) {
  // Per-step scalars as PyTorch forms them (in double, then used in float):
  // p *= 1 - lr wd; p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).
  const float decay = static_cast<float>(1.0 - static_cast<double>(s.lr) * s.weight_decay);
  const float step_size = static_cast<float>(static_cast<double>(s.lr) / s.bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(static_cast<double>(s.bias_correction2)));
  const float b1 = s.beta1, b2 = s.beta2, one_minus_b1 = 1.0f - s.beta1, one_minus_b2 = 1.0f - s.beta2;
  const float eps = s.eps, grad_scale = s.grad_scale;
  const bool keep_zeros = s.keep_zeros;
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i];
    const bool kept = keep_zeros && p == 0.0f;
    const float g = grad[i] * grad_scale;
    const float mi = b1 * m[i] + one_minus_b1 * g;
    const float vi = b2 * v[i] + one_minus_b2 * (g * g);
    m[i] = kept ? m[i] : mi;
    v[i] = kept ? v[i] : vi;
    param[i] = kept ? p : p * decay - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
  }
}

}  // namespace loom::cpu
