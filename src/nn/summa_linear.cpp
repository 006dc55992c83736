// SUMMA linear layers of a 2D/2.5D tensor-parallel grid (nn.h).
#include "loom/device.h"
#include "loom/nn.h"
#include "nn/stacked_rows.h"

namespace loom {

SummaLinear::SummaLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group,
                         float init_std, const TensorParallel& tp, bool has_bias)
    : grid_(tp.grid), has_bias_(has_bias) {
  LOOM_CHECK(grid_ && in % grid_->q == 0, "a SUMMA layer of ", in, " inputs needs a grid that splits them");
  in_ = in / grid_->q;
  for (const GridLinearPart& part : parts) {
    Piece piece;
    piece.weight = layout.add(part.name + ".weight", {part.out, in}, ParamInit::normal_(init_std), true, group,
                              grid_->linear_cut(GridSide::entering, part.blocks));
    layout.set_linear_weight(piece.weight);
    if (has_bias)
      piece.bias = layout.add(part.name + ".bias", {part.out}, ParamInit::constant(0.0f), false, group,
                              grid_->linear_bias_cut(GridSide::entering, part.blocks));
    piece.rows = layout.param(piece.weight).shape[0];
    out_ += piece.rows;
    pieces_.push_back(piece);
  }
}

SummaLinear::SummaLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp)
    : grid_(tp.grid), out_(layout.param(weight).shape[0]), pieces_{{weight, -1, out_}} {
  LOOM_CHECK(grid_ && in % grid_->q == 0, "a SUMMA layer of ", in, " inputs needs a grid that splits them");
  in_ = in / grid_->q;
}

std::vector<Tensor> SummaLinear::params(const ParamStore& ps, bool bias) const {
  return nn_detail::piece_tensors(pieces_, bias, [&](int id) { return ps.param(id); });
}

Tensor SummaLinear::gather_panels(const ParamStore& ps) const {
  const Tensor stack = nn_detail::stack_rows(params(ps, false), out_, in_);
  Tensor panels = Tensor::empty({grid_->q, out_, in_});
  grid_->weight_group->all_gather(stack, panels);
  return panels;
}

Tensor SummaLinear::forward(const ParamStore& ps, const Tensor& x) const {
  const int64_t q = grid_->q, rows = x.numel() / in_;
  const Tensor panels = gather_panels(ps);
  // partial[k] = x W_k^T: this rank's share of output columns k.
  Tensor partial = Tensor::empty({q, rows, out_});
  for (int64_t k = 0; k < q; ++k)
    ops::linear_forward(partial.data<float>() + k * rows * out_, x.data<float>(),
                        panels.data<float>() + k * out_ * in_, nullptr, rows, in_, out_);
  Tensor y = Tensor::empty({rows, out_});
  grid_->hidden_group->reduce_scatter(partial, y);
  if (!has_bias_) return y;
  const Tensor bias = nn_detail::stack_rows(params(ps, true), out_, 1);
  ops::add_bias(y.data<float>(), bias.data<float>(), rows, out_);
  return y;
}

Tensor SummaLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x) const {
  const int64_t q = grid_->q, rows = x.numel() / in_;
  if (has_bias_ && nn_detail::any_grad(pieces_, true, g)) {
    // The bias's gradient: dy's column sums, into each part's columns.
    Tensor db = Tensor::zeros({out_});
    ops::linear_backward(nullptr, nullptr, db.data<float>(), dy.data<float>(), nullptr, nullptr, rows, in_, out_);
    nn_detail::accumulate_grads(db, pieces_, true, g);
  }
  Tensor dys = Tensor::empty({q, rows, out_});
  grid_->hidden_group->all_gather(dy, dys);
  Tensor dx = Tensor::zeros({rows, in_});
  {
    // The panels are gathered again rather than kept from forward, as
    // SUMMA broadcasts them again: weights-sized memory only while in use.
    const Tensor panels = gather_panels(g.params);
    for (int64_t k = 0; k < q; ++k)
      ops::gemm(false, false, rows, in_, out_, 1.0f, dys.data<float>() + k * rows * out_, out_,
                panels.data<float>() + k * out_ * in_, in_, 1.0f, dx.data<float>(), in_);
  }
  if (!nn_detail::any_grad(pieces_, false, g)) return dx;
  Tensor dws = Tensor::empty({q, out_, in_});
  for (int64_t k = 0; k < q; ++k)
    ops::gemm(true, false, out_, in_, rows, 1.0f, dys.data<float>() + k * rows * out_, out_, x.data<float>(), in_,
              0.0f, dws.data<float>() + k * out_ * in_, in_);
  dys = Tensor();
  Tensor dw = Tensor::empty({out_, in_});
  grid_->weight_group->reduce_scatter(dws, dw);
  dws = Tensor();
  nn_detail::accumulate_grads(dw, pieces_, false, g);
  return dx;
}

}  // namespace loom
