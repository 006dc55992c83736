#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

MLP::MLP(ParamLayout& layout, const std::string& prefix, const GPTConfig& cfg, int group, float proj_std,
         const TensorParallel& tp)
    : kind_(cfg.mlp), local_I_(cfg.intermediate() / tp.feature_parts()) {
  const int64_t C = cfg.n_embd, I = cfg.intermediate();
  LOOM_CHECK(I % tp.feature_parts() == 0, "intermediate size ", I, " over ", tp.feature_parts(),
             " tensor-parallel parts");
  // SwiGLU's gate | up: one GEMM writes the [N, 2I] buffer its kernel reads.
  const std::vector<std::string> names =
      kind_ == MlpKind::gelu ? std::vector<std::string>{"c_fc"} : std::vector<std::string>{"gate", "up"};
  if (tp.grid) {
    std::vector<GridLinearPart> parts;
    for (const std::string& name : names) parts.push_back({prefix + "." + name, I, 1});
    c_fc_ = GridLinear(layout, parts, C, group, 0.02f, tp, cfg.mlp_bias, GridSide::entering);
    c_proj_ = GridLinear(layout, {{prefix + ".c_proj", C, 1}}, I, group, proj_std, tp, cfg.mlp_bias,
                         GridSide::leaving);
    return;
  }
  const ParamParallel split = tp.cut(0);
  std::vector<LinearPart> parts;
  for (const std::string& name : names)
    parts.push_back({prefix + "." + name, I, split, split, 0, 0, cfg.adapter("mlp." + name)});
  c_fc_ = ColumnParallelLinear(layout, parts, C, group, 0.02f, tp, cfg.mlp_bias);
  c_proj_ = RowParallelLinear(layout, prefix + ".c_proj", I, C, group, proj_std, tp, cfg.mlp_bias,
                              cfg.adapter("mlp.c_proj"));
}

Tensor MLP::forward(const ParamStore& ps, Saved& s, const Tensor& in, const AdapterDropout& drop) const {
  forward_activation(ps, s, in, drop);
  return parallel_forward(c_proj_, ps, s.act, drop);
}

void MLP::forward_activation(const ParamStore& ps, Saved& s, const Tensor& in, const AdapterDropout& drop) const {
  s.fc = parallel_forward(c_fc_, ps, in, drop);
  const int64_t N = s.fc.numel() / (kind_ == MlpKind::swiglu ? 2 * local_I_ : local_I_);
  s.act = Tensor::empty({N, local_I_});
  const float* fc = s.fc.data<float>();
  if (kind_ == MlpKind::swiglu)
    ops::swiglu_forward(s.act.data<float>(), fc, fc + local_I_, N, local_I_, 2 * local_I_);
  else
    ops::gelu_forward(s.act.data<float>(), fc, s.fc.numel());
}

Tensor MLP::backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s,
                     const AdapterDropout& drop) const {
  // dact is freed as soon as the activation's backward has consumed it, so
  // at most two intermediate-sized gradient buffers exist at once.
  Tensor dact = parallel_backward(c_proj_, g, dout, s.act, drop);
  Tensor dfc = Tensor::empty(s.fc.shape());
  const float* fc = s.fc.data<float>();
  if (kind_ == MlpKind::swiglu)
    ops::swiglu_backward(dfc.data<float>(), dfc.data<float>() + local_I_, dact.data<float>(), fc, fc + local_I_,
                         s.act.numel() / local_I_, local_I_, 2 * local_I_, ops::GradWrite::overwrite);
  else
    ops::gelu_backward(dfc.data<float>(), fc, dact.data<float>(), s.fc.numel(), ops::GradWrite::overwrite);
  dact = Tensor();
  return parallel_backward(c_fc_, g, dfc, in, drop);
}

}  // namespace loom
