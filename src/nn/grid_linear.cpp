// A grid's linear layer: SUMMA or the cube's, as the grid is (nn.h).
#include "loom/nn.h"

namespace loom {

GridLinear::GridLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group,
                       float init_std, const TensorParallel& tp, bool has_bias, GridSide side) {
  LOOM_CHECK(tp.grid, "a grid's linear layer without a grid");
  if (tp.grid->cube)
    layer_ = CubeLinear(layout, parts, in, group, init_std, tp, has_bias, side);
  else
    layer_ = SummaLinear(layout, parts, in, group, init_std, tp, has_bias);
}

GridLinear::GridLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp) {
  LOOM_CHECK(tp.grid, "a grid's output head without a grid");
  if (tp.grid->cube)
    layer_ = CubeLinear(weight, layout, in, tp);
  else
    layer_ = SummaLinear(weight, layout, in, tp);
}

int64_t GridLinear::local_features(int64_t out, const TensorGridShape& grid) {
  // As TensorGrid::linear_cut cuts the rows (padding the last part): q parts
  // on 2D/2.5D; on a cube q^2, of which a rank's features are q.
  const int64_t q = grid.q, parts = grid.cube ? q * q : q;
  return (out + parts - 1) / parts * (grid.cube ? q : 1);
}

Tensor GridLinear::forward(const ParamStore& ps, const Tensor& x, const AdapterDropout&) const {
  return std::visit([&](const auto& l) { return l.forward(ps, x); }, layer_);
}

Tensor GridLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x, const AdapterDropout&) const {
  return std::visit([&](const auto& l) { return l.backward(g, dy, x); }, layer_);
}

}  // namespace loom
