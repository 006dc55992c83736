#include <gtest/gtest.h>

#include <atomic>

#include "loom/parallel.h"

namespace loom {
namespace {

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an Error";
  return {};
}

TEST(MeshShape, TensorParallelIsInnermostThenSequenceExpertDataPipeline) {
  const MeshShape shape = MeshShape::from({{"pp", 2}, {"dp", 3}, {"ep", 1}, {"sp", 2}, {"tp", 2}});
  EXPECT_EQ(shape.ranks(), 24);
  EXPECT_EQ(shape.coords_of(1), (MeshCoords{0, 0, 0, 0, 1}));  // pp, dp, ep, sp, tp
  EXPECT_EQ(shape.coords_of(2), (MeshCoords{0, 0, 0, 1, 0}));
  EXPECT_EQ(shape.coords_of(4), (MeshCoords{0, 1, 0, 0, 0}));
  EXPECT_EQ(shape.coords_of(12), (MeshCoords{1, 0, 0, 0, 0}));
  EXPECT_EQ(shape.coords_of(23), (MeshCoords{1, 2, 0, 1, 1}));
  for (int rank = 0; rank < 24; ++rank) EXPECT_EQ(shape.rank_of(shape.coords_of(rank)), rank);
  EXPECT_EQ(shape.describe(), "pp=2 x dp=3 x sp=2 x tp=2");
}

TEST(MeshShape, ValidationNamesTheProblem) {
  MeshShape shape = MeshShape::from({{"dp", 2}, {"tp", 3}});
  std::string m = message_of([&] { shape.validate(4); });
  EXPECT_NE(m.find("pp=1 x dp=2 x tp=3 has 6 ranks but the world has 4"), std::string::npos) << m;
  shape[MeshAxis::tp] = 0;
  m = message_of([&] { shape.validate(0); });
  EXPECT_NE(m.find("mesh axis tp has size 0"), std::string::npos) << m;
  shape[MeshAxis::tp] = -2;
  m = message_of([&] { shape.validate(4); });
  EXPECT_NE(m.find("mesh axis tp has size -2"), std::string::npos) << m;
  m = message_of([] { MeshShape::from({{"xp", 2}}); });
  EXPECT_NE(m.find("unknown mesh axis 'xp'"), std::string::npos) << m;
  EXPECT_EQ(parse_mesh_axis("sp"), MeshAxis::sp);
}

TEST(DeviceMesh, InvalidShapeFailsBeforeAnyGroupIsCreated) {
  run_local(4, [](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::dp] = 3;
    EXPECT_THROW(DeviceMesh(world, shape), Error);
    EXPECT_EQ(world.collectives_issued(), 0u);
  });
}

TEST(DeviceMesh, GroupsAreTheAxisSlices) {
  std::atomic<int> checked{0};
  run_local(8, [&](Communicator& world) {
    DeviceMesh mesh(world, MeshShape::from({{"pp", 2}, {"dp", 2}, {"tp", 2}}));
    const MeshShape& shape = mesh.shape();
    EXPECT_EQ(mesh.coords(), shape.coords_of(world.rank()));
    for (MeshAxis axis : kMeshAxes) {
      Communicator& group = mesh.group(axis);
      ASSERT_EQ(group.size(), mesh.size(axis)) << mesh_axis_name(axis);
      EXPECT_EQ(group.rank(), mesh.coord(axis)) << mesh_axis_name(axis);
      for (int k = 0; k < group.size(); ++k) {
        MeshCoords member = mesh.coords();
        member[static_cast<size_t>(axis)] = k;
        EXPECT_EQ(group.world_ranks()[static_cast<size_t>(k)], shape.rank_of(member)) << mesh_axis_name(axis);
      }
    }
    // Every axis group communicates on its own: sum world ranks along it.
    for (MeshAxis axis : {MeshAxis::tp, MeshAxis::dp, MeshAxis::pp}) {
      int64_t value = world.rank();
      mesh.group(axis).all_reduce(&value, 1, DType::i64);
      int64_t expected = 0;
      for (int rank : mesh.group(axis).world_ranks()) expected += rank;
      EXPECT_EQ(value, expected) << mesh_axis_name(axis);
    }
    checked++;
  });
  EXPECT_EQ(checked.load(), 8);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// A 2 x 2 x 2 grid (2.5D) on the tp axis of a dp=2 mesh: every rank's
// coordinates, and each group holds exactly the ranks that share the other
// coordinates, ranked by the one they differ in.
TEST(TensorGrid, GroupsHoldTheRanksOfARowAColumnADepthAndTheTokens) {
  run_local(16, [](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::dp] = 2;
    shape[MeshAxis::tp] = 8;
    DeviceMesh mesh(world, shape, {2, 2});
    const TensorGrid* grid = mesh.tensor_grid();
    ASSERT_NE(grid, nullptr);
    const int t = mesh.coord(MeshAxis::tp);
    EXPECT_EQ(grid->col, t % 2);
    EXPECT_EQ(grid->row, (t / 2) % 2);
    EXPECT_EQ(grid->layer, t / 4);
    const int base = world.rank() - t;  // the replica's first world rank
    const auto members = [&](const Communicator& g) { return g.world_ranks(); };
    EXPECT_EQ(members(*grid->hidden_group), (std::vector<int>{base + t / 2 * 2, base + t / 2 * 2 + 1}));
    EXPECT_EQ(members(*grid->weight_group),
              (std::vector<int>{base + grid->layer * 4 + grid->col, base + grid->layer * 4 + 2 + grid->col}));
    EXPECT_EQ(members(*grid->depth_group), (std::vector<int>{base + t % 4, base + 4 + t % 4}));
    EXPECT_EQ(members(*grid->token_group),
              (std::vector<int>{base + grid->col, base + 2 + grid->col, base + 4 + grid->col, base + 6 + grid->col}));
    EXPECT_EQ(grid->token_group->rank(), grid->token_index());
    EXPECT_EQ(&grid->group_over(kTpRows | kTpDepth), grid->token_group);
  });
  MeshShape one;
  run_local(1, [&](Communicator& world) { EXPECT_EQ(DeviceMesh(world, one).tensor_grid(), nullptr); });
}

// A 2 x 2 x 2 cube (3D): the groups inside a block split the token rows over
// the (layer, column) pairs, and the token table's group is the token group.
TEST(TensorGrid, ACubeSplitsTheTokensInsideABlockOverLayersAndColumns) {
  run_local(8, [](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::tp] = 8;
    DeviceMesh mesh(world, shape, tensor_grid_shape(TensorParallelMode::three_d, 8, 1));
    const TensorGrid* grid = mesh.tensor_grid();
    ASSERT_NE(grid, nullptr);
    EXPECT_TRUE(grid->cube);
    const int t = world.rank();
    EXPECT_EQ(grid->inner_token_index(), t / 4 * 2 + t % 2);
    const int r = grid->row * 2;
    EXPECT_EQ(grid->inner_token_group->world_ranks(), (std::vector<int>{r, r + 1, r + 4, r + 5}));
    EXPECT_EQ(grid->inner_token_group->rank(), grid->inner_token_index());
    EXPECT_EQ(&grid->group_over(kTpCols | kTpDepth), grid->inner_token_group);
    EXPECT_EQ(grid->table_group, grid->token_group);
    EXPECT_EQ(grid->table_first_block(), 0);
    EXPECT_EQ(grid->inner_feature_axis(), kTpRows);
  });
}

TEST(TensorGrid, ShapesOfModes) {
  const TensorGridShape cube = tensor_grid_shape(TensorParallelMode::three_d, 27, 1);
  EXPECT_EQ(cube.q, 3);
  EXPECT_EQ(cube.depth, 3);
  EXPECT_TRUE(cube.cube);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::three_d, 16, 1).q, 0);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::three_d, 64, 1).ranks(), 64);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::two_d, 9, 1).q, 3);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::two_d, 8, 2).q, 0);  // 2D has one layer
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::two_and_half_d, 8, 2).q, 2);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::two_and_half_d, 12, 3).q, 2);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::two_and_half_d, 12, 2).q, 0);
  EXPECT_EQ(tensor_grid_shape(TensorParallelMode::one_d, 8, 1).ranks(), 1);
  EXPECT_EQ(parse_tensor_parallel_mode("2.5d"), TensorParallelMode::two_and_half_d);
  EXPECT_NE(message_of([] { parse_tensor_parallel_mode("4d"); }).find("use 1d, 2d, 2.5d or 3d"), std::string::npos);
}

}  // namespace
}  // namespace loom
