#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

Linear::Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std)
    : in_(in), out_(out) {
  weight_ = layout.add(name + ".weight", {out, in}, ParamInit::normal_(init_std), true, group);
  bias_ = layout.add(name + ".bias", {out}, ParamInit::constant(0.0f), false, group);
}

void Linear::forward(const ParamStore& ps, float* out, const float* in, int64_t N) const {
  cpu::linear_forward(out, in, ps.param(weight_).data<float>(), ps.param(bias_).data<float>(), N, in_, out_);
}

void Linear::backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N) const {
  cpu::linear_backward(din, g.grads.grad(weight_).data<float>(), g.grads.grad(bias_).data<float>(), dout, in,
                       g.params.param(weight_).data<float>(), N, in_, out_);
}

}  // namespace loom
