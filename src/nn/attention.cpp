#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

CausalSelfAttention::CausalSelfAttention(ParamLayout& layout, const std::string& prefix, int64_t C, int64_t n_head,
                                         int group, float proj_std)
    : C_(C), n_head_(n_head) {
  c_attn_ = Linear(layout, prefix + ".c_attn", C, 3 * C, group, 0.02f);
  c_proj_ = Linear(layout, prefix + ".c_proj", C, C, group, proj_std);
}

void CausalSelfAttention::forward(const ParamStore& ps, Saved& s, float* out, const float* in,
                                  const BatchShape& bs) const {
  const int64_t N = bs.N();
  s.qkv = Tensor::empty({bs.B, bs.T, 3 * C_});
  s.att = Tensor::empty({bs.B, bs.T, C_});
  s.lse = Tensor::empty({bs.B, n_head_, bs.T});
  c_attn_.forward(ps, s.qkv.data<float>(), in, N);
  cpu::attention_forward(s.att.data<float>(), s.lse.data<float>(), s.qkv.data<float>(), bs.B, bs.T, C_, n_head_);
  c_proj_.forward(ps, out, s.att.data<float>(), N);
}

void CausalSelfAttention::backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s,
                                   const BatchShape& bs) const {
  const int64_t N = bs.N();
  Tensor datt = Tensor::zeros({N, C_});
  c_proj_.backward(g, datt.data<float>(), dout, s.att.data<float>(), N);
  Tensor dqkv = Tensor::zeros({N, 3 * C_});
  cpu::attention_backward(dqkv.data<float>(), datt.data<float>(), s.att.data<float>(), s.lse.data<float>(),
                          s.qkv.data<float>(), bs.B, bs.T, C_, n_head_);
  datt = Tensor();
  c_attn_.backward(g, din, dqkv.data<float>(), in, N);
}

}  // namespace loom
