// loom parallelism: the device mesh that names the parallel groups every
// parallel layer communicates over.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "loom/comm.h"

namespace loom {

// ---------------------------------------------------------------------------
// Device mesh
// ---------------------------------------------------------------------------

// Axes of the device mesh, outermost (slowest-varying in the rank) first:
//   pp  pipeline stages: point-to-point activations once per micro-batch,
//       the least traffic, so stages may sit on different hosts
//   dp  data-parallel replicas (ZeRO shards across them)
//   ep  expert parallelism
//   sp  sequence (context) parallelism
//   tp  tensor parallelism: collectives in every layer, the most traffic, so
//       its ranks are neighbours (the same host), as in Megatron-LM
// With sizes PP, DP, EP, SP, TP the rank of coordinates (pp, dp, ep, sp, tp) is
//   (((pp * DP + dp) * EP + ep) * SP + sp) * TP + tp.
enum class MeshAxis : uint8_t { pp, dp, ep, sp, tp };
constexpr int kNumMeshAxes = 5;
constexpr std::array<MeshAxis, kNumMeshAxes> kMeshAxes{MeshAxis::pp, MeshAxis::dp, MeshAxis::ep, MeshAxis::sp,
                                                      MeshAxis::tp};
const char* mesh_axis_name(MeshAxis axis);
// Throws Error naming an unknown axis and listing the known ones.
MeshAxis parse_mesh_axis(std::string_view name);

// A rank's coordinate on every axis, indexed by MeshAxis.
using MeshCoords = std::array<int, kNumMeshAxes>;

// The size of every axis (1 for an axis not in use).
struct MeshShape {
  std::array<int, kNumMeshAxes> sizes{1, 1, 1, 1, 1};

  int& operator[](MeshAxis axis) { return sizes[static_cast<size_t>(axis)]; }
  int operator[](MeshAxis axis) const { return sizes[static_cast<size_t>(axis)]; }
  // Sizes by axis name, e.g. {{"dp", 2}, {"tp", 4}}; throws Error for an
  // unknown name.
  static MeshShape from(const std::map<std::string, int>& sizes);

  // The product of the sizes.
  int64_t ranks() const;
  // Throws Error naming the problem unless every size is at least 1 and the
  // sizes multiply to `world_size`.
  void validate(int world_size) const;
  // "pp=1 x dp=2 x tp=4" (sp and ep only when used).
  std::string describe() const;

  MeshCoords coords_of(int rank) const;
  int rank_of(const MeshCoords& coords) const;
};

// The world as a mesh, with this rank's group along every axis: the ranks
// that differ from this one only in that coordinate, ranked by it.
class DeviceMesh {
 public:
  // Validates the shape against the world (Error before any group exists),
  // then creates the groups; collective over `world`, which must outlive the
  // mesh.
  DeviceMesh(Communicator& world, const MeshShape& shape);

  const MeshShape& shape() const { return shape_; }
  int size(MeshAxis axis) const { return shape_[axis]; }
  // This rank's coordinate along `axis`.
  int coord(MeshAxis axis) const { return coords_[static_cast<size_t>(axis)]; }
  const MeshCoords& coords() const { return coords_; }
  Communicator& group(MeshAxis axis) { return *groups_[static_cast<size_t>(axis)]; }
  Communicator& world() { return world_; }

 private:
  Communicator& world_;
  MeshShape shape_;
  MeshCoords coords_;
  std::array<std::unique_ptr<Communicator>, kNumMeshAxes> groups_;
};

}  // namespace loom
