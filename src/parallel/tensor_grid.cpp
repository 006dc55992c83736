// Tensor-parallel modes, a grid's axes and groups, and what a
// TensorParallel answers about them.
#include "loom/parallel.h"

namespace loom {

const char* tensor_parallel_mode_name(TensorParallelMode mode) {
  switch (mode) {
    case TensorParallelMode::one_d: return "1d";
    case TensorParallelMode::two_d: return "2d";
    case TensorParallelMode::two_and_half_d: return "2.5d";
    case TensorParallelMode::three_d: return "3d";
  }
  LOOM_CHECK(false, "unknown tensor-parallel mode");
}

TensorParallelMode parse_tensor_parallel_mode(std::string_view name) {
  for (TensorParallelMode mode : {TensorParallelMode::one_d, TensorParallelMode::two_d,
                                  TensorParallelMode::two_and_half_d, TensorParallelMode::three_d})
    if (name == tensor_parallel_mode_name(mode)) return mode;
  throw Error(str("unknown tensor-parallel mode '", name, "': use 1d, 2d, 2.5d or 3d"));
}

TensorGridShape tensor_grid_shape(TensorParallelMode mode, int64_t tp, int64_t depth) {
  if (mode == TensorParallelMode::one_d) return {};
  if (mode == TensorParallelMode::three_d) {
    int64_t q = 1;
    while ((q + 1) * (q + 1) * (q + 1) <= tp) ++q;
    if (q < 2 || q * q * q != tp) return {0, 1};
    return {static_cast<int>(q), static_cast<int>(q), true};
  }
  if (mode == TensorParallelMode::two_d) depth = 1;
  if (depth < 1 || tp % depth != 0) return {0, 1};
  int64_t q = 1;
  while ((q + 1) * (q + 1) <= tp / depth) ++q;
  if (q < 2 || q * q != tp / depth) return {0, 1};
  return {static_cast<int>(q), static_cast<int>(depth)};
}

int TensorGrid::coord(TpAxes axis) const {
  switch (axis) {
    case kTpRows: return row;
    case kTpCols: return col;
    case kTpDepth: return layer;
    default: break;
  }
  LOOM_CHECK(false, "grid axis ", int(axis), " is not one axis");
}

Communicator& TensorGrid::group_over(TpAxes axes) const {
  Communicator* group = nullptr;
  switch (axes) {
    case kTpCols: group = hidden_group; break;
    case kTpRows: group = weight_group; break;
    case kTpDepth: group = depth_group; break;
    case kTpRows | kTpDepth: group = token_group; break;
    case kTpCols | kTpDepth: group = cube ? inner_token_group : nullptr; break;
    default: break;
  }
  LOOM_CHECK(group, "no group of the grid spans axes ", int(axes));
  return *group;
}

ParamParallel TensorGrid::linear_cut(GridSide side, int64_t blocks) const {
  ParamParallel p;
  if (!cube) {
    p.split = TensorSplit{0, q, row, blocks};
    p.col_split = TensorSplit{1, q, col, 1};
    p.split_axes = kTpRows | kTpCols;
    p.partial_grad = depth > 1 ? kTpDepth : 0;
    return p;
  }
  // The layer gathers its weight over the layers, so each layer's piece is
  // a q-th of the rows the layer's output features need.
  const int in_coord = side == GridSide::entering ? col : row;
  const int out_coord = side == GridSide::entering ? row : col;
  p.split = TensorSplit{0, int64_t{q} * q, out_coord * q + layer, blocks};
  p.col_split = TensorSplit{1, q, in_coord, 1};
  p.split_axes = kTpAll;
  return p;
}

ParamParallel TensorGrid::linear_bias_cut(GridSide side, int64_t blocks) const {
  if (!cube || side == GridSide::leaving) return column_cut(0, blocks);
  ParamParallel p;
  p.split = TensorSplit{0, q, row, blocks};
  p.split_axes = kTpRows;
  p.partial_grad = kTpCols | kTpDepth;
  return p;
}

ParamParallel TensorGrid::column_cut(int dim, int64_t blocks) const {
  ParamParallel p;
  p.split = TensorSplit{dim, q, col, blocks};
  p.split_axes = kTpCols;
  p.partial_grad = kTpRows | kTpDepth;
  return p;
}

ParamParallel TensorParallel::cut(int dim, int64_t blocks) const {
  ParamParallel p;
  p.split = TensorSplit{dim, size(), rank(), blocks};
  p.split_axes = kTpAll;
  return p;
}

bool TensorParallel::owns_copy(TpAxes axes) const {
  if (!grid) return axes == 0 || rank() == 0;
  for (TpAxes axis : {kTpRows, kTpCols, kTpDepth})
    if ((axes & axis) && grid->coord(axis) != 0) return false;
  return true;
}

Communicator& TensorParallel::group_over(TpAxes axes) const {
  LOOM_CHECK(group && axes != 0, "no tensor-parallel group spans axes ", int(axes));
  return grid ? grid->group_over(axes) : *group;
}

}  // namespace loom
