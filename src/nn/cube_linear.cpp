// Linear layers of a 3D tensor-parallel cube (nn.h).
#include "loom/device.h"
#include "loom/nn.h"
#include "nn/stacked_rows.h"

namespace loom {

CubeLinear::CubeLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group,
                       float init_std, const TensorParallel& tp, bool has_bias, GridSide side)
    : grid_(tp.grid), has_bias_(has_bias) {
  LOOM_CHECK(grid_ && grid_->cube && in % grid_->q == 0, "a cube layer of ", in,
             " inputs needs a cube that splits them");
  in_ = in / grid_->q;
  // An entering layer gathers its input along the rows and scatters its
  // output along the columns; a leaving layer the other way round.
  const bool entering = side == GridSide::entering;
  input_group_ = &grid_->group_over(entering ? kTpRows : kTpCols);
  output_group_ = &grid_->group_over(entering ? kTpCols : kTpRows);
  for (const GridLinearPart& part : parts) {
    Piece piece;
    piece.weight = layout.add(part.name + ".weight", {part.out, in}, ParamInit::normal_(init_std), true, group,
                              grid_->linear_cut(side, part.blocks));
    layout.set_linear_weight(piece.weight);
    if (has_bias)
      piece.bias = layout.add(part.name + ".bias", {part.out}, ParamInit::constant(0.0f), false, group,
                              grid_->linear_bias_cut(side, part.blocks));
    piece.rows = layout.param(piece.weight).shape[0];
    piece.blocks = part.blocks;
    out_ += piece.rows * grid_->q;
    pieces_.push_back(piece);
  }
}

CubeLinear::CubeLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp)
    : grid_(tp.grid) {
  LOOM_CHECK(grid_ && grid_->cube && in % grid_->q == 0, "a cube layer of ", in,
             " inputs needs a cube that splits them");
  in_ = in / grid_->q;
  input_group_ = &grid_->group_over(kTpRows);
  output_group_ = &grid_->group_over(kTpCols);
  const int64_t rows = layout.param(weight).shape[0];
  pieces_.push_back({weight, -1, rows, 1});
  out_ = rows * grid_->q;
}

template <typename F>
void CubeLinear::for_each_run(F&& f) const {
  // A piece's block b holds, on the layer's rank l, the q^2 cut's part
  // (feature part) * q + l: the rank's output features of block b are the
  // layers' parts in layer order.
  int64_t stacked = 0, feature = 0;
  for (const Piece& p : pieces_) {
    const int64_t run = p.rows / p.blocks;
    for (int64_t b = 0; b < p.blocks; ++b)
      for (int layer = 0; layer < grid_->q; ++layer) {
        f(layer, stacked + b * run, feature, run);
        feature += run;
      }
    stacked += p.rows;
  }
}

std::vector<Tensor> CubeLinear::params(const ParamStore& ps, bool bias) const {
  return nn_detail::piece_tensors(pieces_, bias, [&](int id) { return ps.param(id); });
}

Tensor CubeLinear::gather_weight(const ParamStore& ps) const {
  const int64_t q = grid_->q, stacked_rows = out_ / q;
  const Tensor stack = nn_detail::stack_rows(params(ps, false), stacked_rows, in_);
  Tensor layers = Tensor::empty({q, stacked_rows, in_});
  grid_->depth_group->all_gather(stack, layers);
  Tensor w = Tensor::empty({out_, in_});
  const int64_t row_bytes = in_ * static_cast<int64_t>(sizeof(float));
  for_each_run([&](int layer, int64_t stacked, int64_t feature, int64_t rows) {
    ops::copy(static_cast<char*>(w.raw()) + feature * row_bytes,
              static_cast<const char*>(layers.raw()) + (layer * stacked_rows + stacked) * row_bytes,
              static_cast<size_t>(rows * row_bytes));
  });
  return w;
}

Tensor CubeLinear::forward(const ParamStore& ps, const Tensor& x) const {
  const int64_t q = grid_->q, rows = x.numel() / in_;
  Tensor xs = Tensor::empty({q * rows, in_});
  input_group_->all_gather(x, xs);
  Tensor partial = Tensor::empty({q * rows, out_});
  {
    const Tensor w = gather_weight(ps);
    ops::linear_forward(partial.data<float>(), xs.data<float>(), w.data<float>(), nullptr, q * rows, in_, out_);
  }
  xs = Tensor();
  Tensor y = Tensor::empty({rows, out_});
  output_group_->reduce_scatter(partial, y);
  if (!has_bias_) return y;
  const Tensor bias = nn_detail::stack_rows(params(ps, true), out_, 1);
  ops::add_bias(y.data<float>(), bias.data<float>(), rows, out_);
  return y;
}

Tensor CubeLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x) const {
  const int64_t q = grid_->q, rows = x.numel() / in_, stacked_rows = out_ / q;
  if (has_bias_ && nn_detail::any_grad(pieces_, true, g)) {
    // The bias's gradient: dy's column sums over this rank's token rows (a
    // partial sum, completed over the token axes by the Trainer).
    Tensor db = Tensor::zeros({out_});
    ops::linear_backward(nullptr, nullptr, db.data<float>(), dy.data<float>(), nullptr, nullptr, rows, in_, out_);
    nn_detail::accumulate_grads(db, pieces_, true, g);
  }
  Tensor dys = Tensor::empty({q * rows, out_});
  output_group_->all_gather(dy, dys);
  Tensor xs = Tensor::empty({q * rows, in_});
  input_group_->all_gather(x, xs);
  // Frozen weights (every piece's): dx alone.
  const bool weight_grad = nn_detail::any_grad(pieces_, false, g);
  Tensor dxs = Tensor::empty({q * rows, in_});
  Tensor dw = weight_grad ? Tensor::zeros({out_, in_}) : Tensor();  // linear_backward adds to dW
  {
    const Tensor w = gather_weight(g.params);
    ops::linear_backward(dxs.data<float>(), weight_grad ? dw.data<float>() : nullptr, nullptr, dys.data<float>(),
                         xs.data<float>(), w.data<float>(), q * rows, in_, out_, ops::GradWrite::overwrite);
  }
  dys = Tensor();
  xs = Tensor();
  Tensor dx = Tensor::empty({rows, in_});
  input_group_->reduce_scatter(dxs, dx);
  dxs = Tensor();
  if (!weight_grad) return dx;
  // Back into the layers' order, then each layer's piece summed over the
  // depth (the other layers' tokens).
  Tensor layers = Tensor::empty({q, stacked_rows, in_});
  const int64_t row_bytes = in_ * static_cast<int64_t>(sizeof(float));
  for_each_run([&](int layer, int64_t stacked, int64_t feature, int64_t n) {
    ops::copy(static_cast<char*>(layers.raw()) + (layer * stacked_rows + stacked) * row_bytes,
              static_cast<const char*>(dw.raw()) + feature * row_bytes, static_cast<size_t>(n * row_bytes));
  });
  dw = Tensor();
  Tensor piece_grads = Tensor::empty({stacked_rows, in_});
  grid_->depth_group->reduce_scatter(layers, piece_grads);
  nn_detail::accumulate_grads(piece_grads, pieces_, false, g);
  return dx;
}

}  // namespace loom
