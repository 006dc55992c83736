#include <cmath>

#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

Linear::Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std,
               const ParamParallel& weight, const ParamParallel& bias, const LoRAConfig& lora) {
  weight_ = layout.add(name + ".weight", {out, in}, ParamInit::normal_(init_std), true, group, weight);
  bias_ = layout.add(name + ".bias", {out}, ParamInit::constant(0.0f), false, group, bias);
  out_ = layout.param(weight_).shape[0];
  in_ = layout.param(weight_).shape[1];
  if (!lora.enabled() || !lora.targets_module(name)) return;
  // Under tensor parallelism the factor on the split side of W is split
  // with it and the other is replicated, its gradient a partial sum over the
  // ranks. Column-parallel (W split by output rows): B by rows like W, A
  // whole, dA = dh^T x summed over the ranks' dh. Row-parallel (W split by
  // input columns): A by columns, B whole; each rank's x_r A_r^T B^T is added
  // into its partial output, which the layer already sums, and dB = dy^T h_r
  // is summed likewise.
  const bool split = weight.split.parts > 1;
  ParamParallel a, b;
  if (weight.split.dim == 0) {
    b.split = weight.split;
    a.partial_grad = split;
  } else {
    a.split = weight.split;
    b.partial_grad = split;
  }
  layout.set_trainable(weight_, false);
  layout.set_trainable(bias_, false);
  rank_ = lora.r;
  scale_ = lora.alpha / static_cast<float>(lora.r);
  // PEFT's kaiming_uniform_(a = sqrt(5)) over fan_in = in: a bound of
  // sqrt(6 / ((1 + a^2) in)) = 1 / sqrt(in). B starts at zero.
  lora_a_ = layout.add(name + ".lora_A.weight", {lora.r, in}, ParamInit::uniform(1.0f / std::sqrt(float(in))), true,
                       group, a);
  lora_b_ = layout.add(name + ".lora_B.weight", {out, lora.r}, ParamInit::constant(0.0f), true, group, b);
  layout.set_trainable(lora_a_, true);
  layout.set_trainable(lora_b_, true);
}

void Linear::forward(const ParamStore& ps, float* out, const float* in, int64_t N, bool bias) const {
  ops::linear_forward(out, in, ps.param(weight_).data<float>(), bias ? ps.param(bias_).data<float>() : nullptr, N,
                      in_, out_);
  if (lora_a_ >= 0) lora_forward(ps, out, in, N);
}

void Linear::backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N, bool bias) const {
  ops::linear_backward(din, g.grads.grad(weight_).data<float>(), bias ? g.grads.grad(bias_).data<float>() : nullptr,
                       dout, in, g.params.param(weight_).data<float>(), N, in_, out_, ops::GradWrite::overwrite);
  if (lora_a_ >= 0) lora_backward(g, din, dout, in, N);
}

void Linear::lora_forward(const ParamStore& ps, float* out, const float* in, int64_t N) const {
  // h = scale * in A^T (r columns, small), then out += h B^T.
  Tensor h = Tensor::empty({N, rank_});
  ops::linear_forward(h.data<float>(), in, ps.param(lora_a_).data<float>(), nullptr, N, in_, rank_);
  ops::scale(h.data<float>(), h.numel(), scale_);
  Tensor delta = Tensor::empty({N, out_});
  ops::linear_forward(delta.data<float>(), h.data<float>(), ps.param(lora_b_).data<float>(), nullptr, N, rank_, out_);
  ops::accumulate(out, delta.data<float>(), delta.numel());
}

void Linear::lora_backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N) const {
  // h is recomputed rather than kept: N x r, a small fraction of the layer.
  Tensor h = Tensor::empty({N, rank_});
  ops::linear_forward(h.data<float>(), in, g.params.param(lora_a_).data<float>(), nullptr, N, in_, rank_);
  ops::scale(h.data<float>(), h.numel(), scale_);
  // dB += dout^T h; dh = scale * dout B; dA += dh^T in; din += dh A.
  Tensor dh = Tensor::empty({N, rank_});
  ops::linear_backward(dh.data<float>(), g.grads.grad(lora_b_).data<float>(), nullptr, dout, h.data<float>(),
                       g.params.param(lora_b_).data<float>(), N, rank_, out_, ops::GradWrite::overwrite);
  h = Tensor();
  ops::scale(dh.data<float>(), dh.numel(), scale_);
  ops::linear_backward(din, g.grads.grad(lora_a_).data<float>(), nullptr, dh.data<float>(), in,
                       g.params.param(lora_a_).data<float>(), N, in_, rank_, ops::GradWrite::accumulate);
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                           int group, float init_std, const TensorParallel& tp, int64_t blocks,
                                           const LoRAConfig& lora)
    : tp_(tp) {
  ParamParallel split;
  split.split = TensorSplit{0, tp.size(), tp.rank(), blocks};
  linear_ = Linear(layout, name, in, out, group, init_std, split, split, lora);
}

Tensor ColumnParallelLinear::forward(const ParamStore& ps, const Tensor& x) const {
  const Tensor full = TensorParallelRegion::enter_forward(tp_, x);
  const int64_t N = full.numel() / linear_.in_features();
  Tensor y = Tensor::empty({N, linear_.out_features()});
  linear_.forward(ps, y.data<float>(), full.data<float>(), N);
  return y;
}

Tensor ColumnParallelLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x) const {
  // Under sequence parallelism the gathered input was not kept: gather it
  // again (Korthikanti et al.), trading an all-gather for [N, in] of memory.
  const Tensor full = TensorParallelRegion::enter_forward(tp_, x);
  const int64_t N = full.numel() / linear_.in_features();
  Tensor dx = Tensor::empty({N, linear_.in_features()});
  linear_.backward(g, dx.data<float>(), dy.data<float>(), full.data<float>(), N);
  return TensorParallelRegion::enter_backward(tp_, dx);
}

RowParallelLinear::RowParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                     int group, float init_std, const TensorParallel& tp, const LoRAConfig& lora)
    : tp_(tp) {
  ParamParallel weight, bias;
  weight.split = TensorSplit{1, tp.size(), tp.rank(), 1};
  bias.partial_grad = tp.splits_tokens();
  linear_ = Linear(layout, name, in, out, group, init_std, weight, bias, lora);
}

Tensor RowParallelLinear::forward(const ParamStore& ps, const Tensor& x) const {
  const int64_t N = x.numel() / linear_.in_features();
  const bool split = tp_.size() > 1;
  Tensor partial = Tensor::empty({N, linear_.out_features()});
  // Without tensor parallelism this is a plain linear layer, bias included,
  // which keeps the single-rank path the reference's exact arithmetic.
  linear_.forward(ps, partial.data<float>(), x.data<float>(), N, !split);
  if (!split) return partial;
  Tensor y = TensorParallelRegion::leave_forward(tp_, partial);
  partial = Tensor();
  ops::add_bias(y.data<float>(), ps.param(linear_.bias_id()).data<float>(), y.numel() / linear_.out_features(),
                linear_.out_features());
  return y;
}

Tensor RowParallelLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x) const {
  const int64_t N = x.numel() / linear_.in_features();
  const bool split = tp_.size() > 1;
  if (split)
    ops::linear_backward(nullptr, nullptr, g.grads.grad(linear_.bias_id()).data<float>(), dy.data<float>(), nullptr,
                         nullptr, dy.numel() / linear_.out_features(), linear_.in_features(), linear_.out_features());
  const Tensor full = TensorParallelRegion::leave_backward(tp_, dy);
  Tensor dx = Tensor::empty({N, linear_.in_features()});
  linear_.backward(g, dx.data<float>(), full.data<float>(), x.data<float>(), N, !split);
  return dx;
}

}  // namespace loom
