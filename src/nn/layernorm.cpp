#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

LayerNorm::LayerNorm(ParamLayout& layout, const std::string& name, int64_t C, int group, bool partial_grad) : C_(C) {
  ParamParallel parallel;
  parallel.partial_grad = partial_grad;
  weight_ = layout.add(name + ".weight", {C}, ParamInit::constant(1.0f), false, group, parallel);
  bias_ = layout.add(name + ".bias", {C}, ParamInit::constant(0.0f), false, group, parallel);
}

void LayerNorm::forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const {
  s.out = Tensor::empty({N, C_});
  s.mean = Tensor::empty({N});
  s.rstd = Tensor::empty({N});
  ops::layernorm_forward(s.out.data<float>(), s.mean.data<float>(), s.rstd.data<float>(), in,
                         ps.param(weight_).data<float>(), ps.param(bias_).data<float>(), N, C_);
}

void LayerNorm::backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s,
                         int64_t N, bool accumulate) const {
  ops::layernorm_backward(din, g.grads.grad(weight_).data<float>(), g.grads.grad(bias_).data<float>(), dout, in,
                          g.params.param(weight_).data<float>(), s.mean.data<float>(), s.rstd.data<float>(), N, C_,
                          accumulate ? ops::GradWrite::accumulate : ops::GradWrite::overwrite);
}

}  // namespace loom
