#include "loom/parallel.h"

namespace loom {

const char* mesh_axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::pp: return "pp";
    case MeshAxis::dp: return "dp";
    case MeshAxis::ep: return "ep";
    case MeshAxis::sp: return "sp";
    case MeshAxis::tp: return "tp";
  }
  LOOM_CHECK(false, "unknown mesh axis");
}

MeshAxis parse_mesh_axis(std::string_view name) {
  for (MeshAxis axis : kMeshAxes)
    if (name == mesh_axis_name(axis)) return axis;
  throw Error(str("unknown mesh axis '", name, "': use dp, pp, tp, sp or ep"));
}

MeshShape MeshShape::from(const std::map<std::string, int>& sizes) {
  MeshShape shape;
  for (const auto& [name, size] : sizes) shape[parse_mesh_axis(name)] = size;
  return shape;
}

int64_t MeshShape::ranks() const {
  int64_t product = 1;
  for (int size : sizes) product *= size;
  return product;
}

std::string MeshShape::describe() const {
  std::string out;
  for (MeshAxis axis : kMeshAxes) {
    if ((axis == MeshAxis::sp || axis == MeshAxis::ep) && (*this)[axis] == 1) continue;
    out += str(out.empty() ? "" : " x ", mesh_axis_name(axis), "=", (*this)[axis]);
  }
  return out;
}

void MeshShape::validate(int world_size) const {
  for (MeshAxis axis : kMeshAxes)
    if ((*this)[axis] < 1)
      throw Error(str("mesh axis ", mesh_axis_name(axis), " has size ", (*this)[axis],
                      "; every axis needs a size of at least 1"));
  if (ranks() != world_size)
    throw Error(str("the mesh ", describe(), " has ", ranks(), " ranks but the world has ", world_size,
                    "; choose sizes whose product is ", world_size));
}

MeshCoords MeshShape::coords_of(int rank) const {
  LOOM_CHECK(rank >= 0 && rank < ranks(), "rank ", rank, " outside the mesh ", describe());
  MeshCoords coords{};
  for (int i = kNumMeshAxes - 1; i >= 0; --i) {
    coords[static_cast<size_t>(i)] = rank % sizes[static_cast<size_t>(i)];
    rank /= sizes[static_cast<size_t>(i)];
  }
  return coords;
}

int MeshShape::rank_of(const MeshCoords& coords) const {
  int rank = 0;
  for (size_t i = 0; i < kNumMeshAxes; ++i) {
    LOOM_CHECK(coords[i] >= 0 && coords[i] < sizes[i], "coordinate ", coords[i], " on axis ",
               mesh_axis_name(kMeshAxes[i]), " outside the mesh ", describe());
    rank = rank * sizes[i] + coords[i];
  }
  return rank;
}

DeviceMesh::DeviceMesh(Communicator& world, const MeshShape& shape, const TensorGridShape& grid)
    : world_(world), shape_(shape) {
  shape_.validate(world.size());
  coords_ = shape_.coords_of(world.rank());
  for (MeshAxis axis : kMeshAxes) {
    // The ranks of one slice share every other coordinate: the rank with
    // this coordinate at 0 names the slice.
    MeshCoords first = coords_;
    first[static_cast<size_t>(axis)] = 0;
    groups_[static_cast<size_t>(axis)] = world.split(shape_.rank_of(first), coord(axis));
  }
  if (grid.ranks() == 1) return;
  LOOM_CHECK(grid.q > 1 && grid.depth >= 1 && grid.ranks() == shape_[MeshAxis::tp], "a ", grid.q, " x ", grid.q,
             " x ", grid.depth, " grid over ", shape_[MeshAxis::tp], " tensor-parallel ranks");
  // Within the tp group: t = (layer * q + row) * q + col. Each split's color
  // is the coordinates its ranks share, its key the one they differ in.
  Communicator& tp = group(MeshAxis::tp);
  const int t = tp.rank(), q = grid.q;
  grid_.q = q;
  grid_.depth = grid.depth;
  grid_.cube = grid.cube;
  grid_.col = t % q;
  grid_.row = (t / q) % q;
  grid_.layer = t / (q * q);
  hidden_group_ = tp.split(grid_.layer * q + grid_.row, grid_.col);
  weight_group_ = tp.split(grid_.layer * q + grid_.col, grid_.row);
  depth_group_ = tp.split(grid_.row * q + grid_.col, grid_.layer);
  token_group_ = tp.split(grid_.col, grid_.token_index());
  grid_.hidden_group = hidden_group_.get();
  grid_.weight_group = weight_group_.get();
  grid_.depth_group = depth_group_.get();
  grid_.token_group = token_group_.get();
  grid_.inner_token_group = grid_.token_group;
  grid_.table_group = grid_.weight_group;
  if (grid.cube) {
    LOOM_CHECK(grid.depth == q, "a cube of side ", q, " with ", grid.depth, " layers");
    inner_token_group_ = tp.split(grid_.row, grid_.inner_token_index());
    grid_.inner_token_group = inner_token_group_.get();
    grid_.table_group = grid_.token_group;
  }
}

}  // namespace loom
