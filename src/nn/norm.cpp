#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

Norm::Norm(ParamLayout& layout, const std::string& name, const GPTConfig& cfg, int group, const TensorParallel& tp)
    : kind_(cfg.norm), eps_(cfg.norm_eps), C_total_(cfg.n_embd), C_(tp.local_width(cfg.n_embd)) {
  ParamParallel parallel;
  // Under sequence parallelism each rank normalizes its own tokens, so its
  // gradients are partial sums. On a grid each rank normalizes its columns
  // of its tokens: the weights are split like the columns, and each copy
  // along the token axes holds a partial sum.
  if (tp.splits_tokens()) parallel.partial_grad = kTpAll;
  if (tp.grid) {
    parallel = tp.grid->column_cut(0);
    hidden_group_ = tp.grid->hidden_group;
  }
  weight_ = layout.add(name + ".weight", {C_total_}, ParamInit::constant(1.0f), false, group, parallel);
  if (kind_ == NormKind::layernorm)
    bias_ = layout.add(name + ".bias", {C_total_}, ParamInit::constant(0.0f), false, group, parallel);
}

void Norm::forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const {
  s.out = Tensor::empty({N, C_});
  s.rstd = Tensor::empty({N});
  const float* w = ps.param(weight_).data<float>();
  if (hidden_group_) {
    split_forward(ps, s, in, N);
    return;
  }
  if (kind_ == NormKind::rmsnorm) {
    ops::rmsnorm_forward(s.out.data<float>(), s.rstd.data<float>(), in, w, N, C_, eps_);
    return;
  }
  s.mean = Tensor::empty({N});
  ops::layernorm_forward(s.out.data<float>(), s.mean.data<float>(), s.rstd.data<float>(), in, w,
                         ps.param(bias_).data<float>(), N, C_);
}

void Norm::split_forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const {
  // The row statistics over the whole width: partial sums of this rank's
  // columns, all-reduced over the ranks that hold the other columns.
  const bool layernorm = kind_ == NormKind::layernorm;
  if (layernorm) {
    s.mean = Tensor::empty({N});
    ops::norm_row_sums(s.mean.data<float>(), in, N, C_);
    hidden_group_->all_reduce(s.mean);
    ops::scale(s.mean.data<float>(), N, 1.0f / static_cast<float>(C_total_));
  }
  const float* mean = layernorm ? s.mean.data<float>() : nullptr;
  ops::norm_row_square_sums(s.rstd.data<float>(), in, mean, N, C_);
  hidden_group_->all_reduce(s.rstd);
  ops::norm_rstd(s.rstd.data<float>(), s.rstd.data<float>(), N, C_total_, eps_);
  ops::norm_apply(s.out.data<float>(), in, mean, s.rstd.data<float>(), ps.param(weight_).data<float>(),
                  layernorm ? ps.param(bias_).data<float>() : nullptr, N, C_);
}

void Norm::backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N,
                    bool accumulate) const {
  const ops::GradWrite write = accumulate ? ops::GradWrite::accumulate : ops::GradWrite::overwrite;
  const float* w = g.params.param(weight_).data<float>();
  float* dw = g.grads.grad(weight_).data<float>();
  float* db = bias_ >= 0 ? g.grads.grad(bias_).data<float>() : nullptr;
  if (hidden_group_) {
    const float* mean = s.mean.defined() ? s.mean.data<float>() : nullptr;
    Tensor sums = Tensor::empty({N, 2});
    ops::norm_backward_sums(sums.data<float>(), dout, in, w, mean, s.rstd.data<float>(), N, C_);
    hidden_group_->all_reduce(sums);
    ops::norm_backward_apply(din, dw, db, dout, in, w, mean, s.rstd.data<float>(), sums.data<float>(), N, C_,
                             C_total_, write);
    return;
  }
  if (kind_ == NormKind::rmsnorm) {
    ops::rmsnorm_backward(din, dw, dout, in, w, s.rstd.data<float>(), N, C_, write);
    return;
  }
  ops::layernorm_backward(din, dw, db, dout, in, w, s.mean.data<float>(), s.rstd.data<float>(), N, C_, write);
}

}  // namespace loom
