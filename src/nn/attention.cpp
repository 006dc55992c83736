#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

CausalSelfAttention::CausalSelfAttention(ParamLayout& layout, const std::string& prefix, int64_t C, int64_t n_head,
                                         int group, float proj_std, const TensorParallel& tp, const LoRAConfig& lora)
    : C_(C), n_head_(n_head), local_heads_(n_head / tp.size()) {
  LOOM_CHECK(n_head % tp.size() == 0, n_head, " heads do not split over ", tp.size(), " tensor-parallel ranks");
  // q, k and v are three blocks of c_attn's rows: splitting each block keeps
  // whole heads on every rank, so attention itself needs no communication.
  c_attn_ = ColumnParallelLinear(layout, prefix + ".c_attn", C, 3 * C, group, 0.02f, tp, 3, lora);
  c_proj_ = RowParallelLinear(layout, prefix + ".c_proj", C, C, group, proj_std, tp, lora);
}

Tensor CausalSelfAttention::forward(const ParamStore& ps, Saved& s, const Tensor& in, const BatchShape& bs) const {
  const int64_t local_C = C_ / n_head_ * local_heads_;
  s.qkv = c_attn_.forward(ps, in);
  s.att = Tensor::empty({bs.N(), local_C});
  s.lse = Tensor::empty({bs.B, local_heads_, bs.T});
  ops::attention_forward(s.att.data<float>(), s.lse.data<float>(), s.qkv.data<float>(), bs.B, bs.T, local_C,
                         local_heads_, local_heads_);
  return c_proj_.forward(ps, s.att);
}

Tensor CausalSelfAttention::backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s,
                                     const BatchShape& bs) const {
  const int64_t local_C = C_ / n_head_ * local_heads_;
  Tensor datt = c_proj_.backward(g, dout, s.att);
  Tensor dqkv = Tensor::empty({bs.N(), 3 * local_C});
  ops::attention_backward(dqkv.data<float>(), datt.data<float>(), s.att.data<float>(), s.lse.data<float>(),
                          s.qkv.data<float>(), bs.B, bs.T, local_C, local_heads_, local_heads_,
                          ops::GradWrite::overwrite);
  datt = Tensor();
  return c_attn_.backward(g, dqkv, in);
}

}  // namespace loom
