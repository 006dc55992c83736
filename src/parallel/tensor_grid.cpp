// Tensor-parallel modes, the 2D/2.5D grid's axes and groups, and what a
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
  if (mode == TensorParallelMode::two_d) depth = 1;
  if (mode == TensorParallelMode::three_d || depth < 1 || tp % depth != 0) return {0, 1};
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
    default: break;
  }
  LOOM_CHECK(group, "no group of the grid spans axes ", int(axes));
  return *group;
}

ParamParallel TensorGrid::matrix_cut(int64_t blocks) const {
  ParamParallel p;
  p.split = TensorSplit{0, q, row, blocks};
  p.col_split = TensorSplit{1, q, col, 1};
  p.split_axes = kTpRows | kTpCols;
  p.partial_grad = depth > 1 ? kTpDepth : 0;
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
