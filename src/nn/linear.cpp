#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

Linear::Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std,
               const ParamParallel& weight, const ParamParallel& bias, bool has_bias)
    : Linear(layout, {LinearPart{name, out, weight, bias}}, in, group, init_std, has_bias) {}

Linear::Linear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in, int group, float init_std,
               bool has_bias)
    : has_bias_(has_bias) {
  for (const LinearPart& p : parts) {
    Part part;
    part.weight = layout.add(p.name + ".weight", {p.out, in}, ParamInit::normal_(init_std), true, group, p.weight);
    if (has_bias)
      part.bias = layout.add(p.name + ".bias", {p.out}, ParamInit::constant(0.0f), false, group, p.bias);
    const int64_t local_rows = layout.param(part.weight).shape[0];
    part.first_row = p.first_row;
    part.rows = p.rows > 0 ? p.rows : local_rows;
    LOOM_CHECK(part.first_row >= 0 && part.first_row + part.rows <= local_rows, "rows [", part.first_row, ", ",
               part.first_row + part.rows, ") of ", p.name, "'s ", local_rows);
    out_ += part.rows;
    in_ = layout.param(part.weight).shape[1];
    parts_.push_back(part);
  }
}

int Linear::weight_id() const {
  LOOM_CHECK(parts_.size() == 1, "a linear layer of ", parts_.size(), " parts has no single weight");
  return parts_[0].weight;
}

int Linear::bias_id() const {
  LOOM_CHECK(parts_.size() == 1 && has_bias_, "a linear layer of ", parts_.size(), " parts has no single bias");
  return parts_[0].bias;
}

namespace {

// Rows [first, first + rows) of a [*, cols] tensor, in place.
Tensor row_slice(const Tensor& t, int64_t first, int64_t rows, int64_t cols) {
  if (first == 0 && rows * cols == t.numel()) return t;
  return Tensor::borrow(t.data<float>() + first * cols, {rows, cols}, DType::f32, Tier::device);
}

// Pieces stacked by rows into one [rows, cols] tensor, and back.
Tensor stack(const std::vector<Tensor>& pieces, int64_t rows, int64_t cols) {
  if (pieces.size() == 1) return pieces[0];
  Tensor out = Tensor::empty({rows, cols});
  size_t at = 0;
  for (const Tensor& p : pieces) {
    ops::copy(static_cast<char*>(out.raw()) + at, p.raw(), p.nbytes());
    at += p.nbytes();
  }
  return out;
}

void unstack(const Tensor& stacked, const std::vector<Tensor>& pieces) {
  if (pieces.size() == 1) return;
  size_t at = 0;
  for (const Tensor& p : pieces) {
    ops::copy(p.raw(), static_cast<const char*>(stacked.raw()) + at, p.nbytes());
    at += p.nbytes();
  }
}

}  // namespace

std::vector<Tensor> Linear::pieces(const ParamStore& ps, bool bias) const {
  std::vector<Tensor> out;
  for (const Part& p : parts_)
    out.push_back(row_slice(ps.param(bias ? p.bias : p.weight), p.first_row, p.rows, bias ? 1 : in_));
  return out;
}

std::vector<Tensor> Linear::grad_pieces(const GradStore& gs, bool bias) const {
  std::vector<Tensor> out;
  for (const Part& p : parts_)
    out.push_back(row_slice(gs.grad(bias ? p.bias : p.weight), p.first_row, p.rows, bias ? 1 : in_));
  return out;
}

void Linear::forward(const ParamStore& ps, float* out, const float* in, int64_t N, bool bias) const {
  const Tensor w = stack(pieces(ps, false), out_, in_);
  const Tensor b = bias && has_bias_ ? stack(pieces(ps, true), out_, 1) : Tensor();
  ops::linear_forward(out, in, w.data<float>(), b.defined() ? b.data<float>() : nullptr, N, in_, out_);
}

void Linear::backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N, bool bias) const {
  const Tensor w = stack(pieces(g.params, false), out_, in_);
  const bool with_bias = bias && has_bias_;
  // Several parts' gradients are stacked, accumulated into by one GEMM and
  // copied back: the same sums as accumulating into each part in place.
  const std::vector<Tensor> dws = grad_pieces(g.grads, false);
  const std::vector<Tensor> dbs = with_bias ? grad_pieces(g.grads, true) : std::vector<Tensor>{};
  Tensor dw = stack(dws, out_, in_);
  Tensor db = with_bias ? stack(dbs, out_, 1) : Tensor();
  ops::linear_backward(din, dw.data<float>(), with_bias ? db.data<float>() : nullptr, dout, in, w.data<float>(), N,
                       in_, out_, ops::GradWrite::overwrite);
  unstack(dw, dws);
  if (with_bias) unstack(db, dbs);
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                           int group, float init_std, const TensorParallel& tp, int64_t blocks)
    : tp_(tp) {
  ParamParallel split;
  split.split = TensorSplit{0, tp.size(), tp.rank(), blocks};
  linear_ = Linear(layout, name, in, out, group, init_std, split, split);
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in,
                                           int group, float init_std, const TensorParallel& tp, bool has_bias)
    : tp_(tp), linear_(layout, parts, in, group, init_std, has_bias) {}

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
                                     int group, float init_std, const TensorParallel& tp, bool has_bias)
    : tp_(tp) {
  ParamParallel weight, bias;
  weight.split = TensorSplit{1, tp.size(), tp.rank(), 1};
  bias.partial_grad = tp.splits_tokens();
  linear_ = Linear(layout, name, in, out, group, init_std, weight, bias, has_bias);
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
  if (linear_.has_bias())
    ops::add_bias(y.data<float>(), ps.param(linear_.bias_id()).data<float>(), y.numel() / linear_.out_features(),
                  linear_.out_features());
  return y;
}

Tensor RowParallelLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x) const {
  const int64_t N = x.numel() / linear_.in_features();
  const bool split = tp_.size() > 1;
  if (split && linear_.has_bias())
    ops::linear_backward(nullptr, nullptr, g.grads.grad(linear_.bias_id()).data<float>(), dy.data<float>(), nullptr,
                         nullptr, dy.numel() / linear_.out_features(), linear_.in_features(), linear_.out_features());
  const Tensor full = TensorParallelRegion::leave_backward(tp_, dy);
  Tensor dx = Tensor::empty({N, linear_.in_features()});
  linear_.backward(g, dx.data<float>(), full.data<float>(), x.data<float>(), N, !split);
  return dx;
}

}  // namespace loom
