#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

Norm::Norm(ParamLayout& layout, const std::string& name, const GPTConfig& cfg, int group, bool partial_grad)
    : kind_(cfg.norm), eps_(cfg.norm_eps), C_(cfg.n_embd) {
  ParamParallel parallel;
  parallel.partial_grad = partial_grad;
  weight_ = layout.add(name + ".weight", {C_}, ParamInit::constant(1.0f), false, group, parallel);
  if (kind_ == NormKind::layernorm)
    bias_ = layout.add(name + ".bias", {C_}, ParamInit::constant(0.0f), false, group, parallel);
}

void Norm::forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const {
  s.out = Tensor::empty({N, C_});
  s.rstd = Tensor::empty({N});
  const float* w = ps.param(weight_).data<float>();
  if (kind_ == NormKind::rmsnorm) {
    ops::rmsnorm_forward(s.out.data<float>(), s.rstd.data<float>(), in, w, N, C_, eps_);
    return;
  }
  s.mean = Tensor::empty({N});
  ops::layernorm_forward(s.out.data<float>(), s.mean.data<float>(), s.rstd.data<float>(), in, w,
                         ps.param(bias_).data<float>(), N, C_);
}

void Norm::backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N,
                    bool accumulate) const {
  const ops::GradWrite write = accumulate ? ops::GradWrite::accumulate : ops::GradWrite::overwrite;
  const float* w = g.params.param(weight_).data<float>();
  float* dw = g.grads.grad(weight_).data<float>();
  if (kind_ == NormKind::rmsnorm) {
    ops::rmsnorm_backward(din, dw, dout, in, w, s.rstd.data<float>(), N, C_, write);
    return;
  }
  ops::layernorm_backward(din, dw, g.grads.grad(bias_).data<float>(), dout, in, w, s.mean.data<float>(),
                          s.rstd.data<float>(), N, C_, write);
}

}  // namespace loom
