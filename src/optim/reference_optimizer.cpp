#include <cmath>

#include "loom/optim.h"

namespace loom {

ReferenceOptimizer::ReferenceOptimizer(ParamStore& params, GradStore& grads, const AdamWConfig& cfg)
    : params_(params), grads_(grads), adamw_(params.layout(), cfg) {}

GradientCheck ReferenceOptimizer::check_gradients() {
  const Tensor g = grads_.flat();
  GradientCheck check;
  check.sum_squares = ops::sum_squares(g.data<float>(), g.numel());
  // A finite sum has no Inf/NaN behind it: the count costs a pass only when
  // the step has diverged.
  if (!std::isfinite(check.sum_squares)) check.non_finite = ops::count_non_finite(g.raw(), DType::f32, g.numel());
  return check;
}

void ReferenceOptimizer::step(float lr, float grad_scale) {
  adamw_.step(params_.flat().data<float>(), grads_.flat().data<float>(), lr, grad_scale);
}

// The reference's buffers are its whole state: the host reads and writes
// them in place.
void ReferenceOptimizer::visit_state(const StateVisitor& visit) {
  const HostSection host;
  visit({0, params_.flat().numel()}, params_.flat().data<float>(), adamw_.exp_avg().data<float>(),
        adamw_.exp_avg_sq().data<float>());
}

std::vector<FlatRange> ReferenceOptimizer::owned_ranges() const {
  return std::vector<FlatRange>{{0, params_.flat().numel()}};
}

void ReferenceOptimizer::load_state(const StateFiller& fill) {
  const HostSection host;
  fill({0, params_.flat().numel()}, params_.flat().data<float>(), adamw_.exp_avg().data<float>(),
       adamw_.exp_avg_sq().data<float>());
}

void ReferenceOptimizer::visit_gradients(const GradientVisitor& visit) {
  const HostSection host;
  visit({0, grads_.flat().numel()}, grads_.flat().data<float>());
}

}  // namespace loom
