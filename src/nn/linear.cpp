#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

Linear::Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std,
               const ParamParallel& weight, const ParamParallel& bias) {
  weight_ = layout.add(name + ".weight", {out, in}, ParamInit::normal_(init_std), true, group, weight);
  bias_ = layout.add(name + ".bias", {out}, ParamInit::constant(0.0f), false, group, bias);
  out_ = layout.param(weight_).shape[0];
  in_ = layout.param(weight_).shape[1];
}

void Linear::forward(const ParamStore& ps, float* out, const float* in, int64_t N, bool bias) const {
  ops::linear_forward(out, in, ps.param(weight_).data<float>(), bias ? ps.param(bias_).data<float>() : nullptr, N,
                      in_, out_);
}

void Linear::backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N, bool bias) const {
  ops::linear_backward(din, g.grads.grad(weight_).data<float>(), bias ? g.grads.grad(bias_).data<float>() : nullptr,
                       dout, in, g.params.param(weight_).data<float>(), N, in_, out_, ops::GradWrite::overwrite);
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                           int group, float init_std, const TensorParallel& tp, int64_t blocks)
    : tp_(tp) {
  ParamParallel split;
  split.split = TensorSplit{0, tp.size(), tp.rank(), blocks};
  linear_ = Linear(layout, name, in, out, group, init_std, split, split);
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
                                     int group, float init_std, const TensorParallel& tp)
    : tp_(tp) {
  ParamParallel weight, bias;
  weight.split = TensorSplit{1, tp.size(), tp.rank(), 1};
  bias.partial_grad = tp.splits_tokens();
  linear_ = Linear(layout, name, in, out, group, init_std, weight, bias);
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
