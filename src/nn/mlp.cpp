#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

MLP::MLP(ParamLayout& layout, const std::string& prefix, int64_t C, int group, float proj_std,
         const TensorParallel& tp, const LoRAConfig& lora)
    : C_(C) {
  c_fc_ = ColumnParallelLinear(layout, prefix + ".c_fc", C, 4 * C, group, 0.02f, tp, 1, lora);
  c_proj_ = RowParallelLinear(layout, prefix + ".c_proj", 4 * C, C, group, proj_std, tp, lora);
}

Tensor MLP::forward(const ParamStore& ps, Saved& s, const Tensor& in) const {
  forward_activation(ps, s, in);
  return c_proj_.forward(ps, s.act);
}

void MLP::forward_activation(const ParamStore& ps, Saved& s, const Tensor& in) const {
  s.fc = c_fc_.forward(ps, in);
  s.act = Tensor::empty(s.fc.shape());
  ops::gelu_forward(s.act.data<float>(), s.fc.data<float>(), s.fc.numel());
}

Tensor MLP::backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s) const {
  // dact is freed as soon as GELU's backward has consumed it, so at most two
  // [N, 4C/tp] gradient buffers exist at once.
  Tensor dact = c_proj_.backward(g, dout, s.act);
  Tensor dfc = Tensor::empty(s.fc.shape());
  ops::gelu_backward(dfc.data<float>(), s.fc.data<float>(), dact.data<float>(), s.fc.numel(), ops::GradWrite::overwrite);
  dact = Tensor();
  return c_fc_.backward(g, dfc, in);
}

}  // namespace loom
