#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

MLP::MLP(ParamLayout& layout, const std::string& prefix, int64_t C, int group, float proj_std) : C_(C) {
  c_fc_ = Linear(layout, prefix + ".c_fc", C, 4 * C, group, 0.02f);
  c_proj_ = Linear(layout, prefix + ".c_proj", 4 * C, C, group, proj_std);
}

void MLP::forward(const ParamStore& ps, Saved& s, float* out, const float* in, int64_t N) const {
  s.fc = Tensor::empty({N, 4 * C_});
  s.act = Tensor::empty({N, 4 * C_});
  c_fc_.forward(ps, s.fc.data<float>(), in, N);
  cpu::gelu_forward(s.act.data<float>(), s.fc.data<float>(), N * 4 * C_);
  c_proj_.forward(ps, out, s.act.data<float>(), N);
}

void MLP::backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N) const {
  // dact is freed as soon as GELU's backward has consumed it, so at most two
  // [N, 4C] gradient buffers exist at once.
  Tensor dact = Tensor::zeros({N, 4 * C_});
  c_proj_.backward(g, dact.data<float>(), dout, s.act.data<float>(), N);
  Tensor dfc = Tensor::zeros({N, 4 * C_});
  cpu::gelu_backward(dfc.data<float>(), s.fc.data<float>(), dact.data<float>(), N * 4 * C_);
  dact = Tensor();
  c_fc_.backward(g, din, dfc.data<float>(), in, N);
}

}  // namespace loom
