// A grid's linear layers send what the documented volume says
// (grid_linear_elements_sent, planner.h): every rank, forward and backward,
// counted by the grid groups' CommStats, for 2D, 2.5D and 3D, for entering
// and leaving layers of several parts.
#include <gtest/gtest.h>

#include <set>

#include "loom/comm.h"
#include "loom/nn.h"
#include "loom/planner.h"
#include "test_util.h"

namespace loom {
namespace {

// Everything this rank sent over its grid's groups.
double grid_elements_sent(const TensorGrid& grid) {
  const std::set<Communicator*> groups{grid.hidden_group, grid.weight_group, grid.depth_group, grid.token_group,
                                       grid.inner_token_group, grid.table_group};
  double sent = 0.0;
  for (Communicator* g : groups) sent += g->stats().sent().elements;
  return sent;
}

struct Case {
  const char* name;
  TensorGridShape grid;
};

class GridLinearVolume : public ::testing::TestWithParam<Case> {};

TEST_P(GridLinearVolume, EveryRankSendsTheDocumentedElements) {
  const TensorGridShape shape = GetParam().grid;
  const int64_t in = 48, N = 64;
  // q | k | v-like parts of 3 blocks and 2 parts, entering; one, leaving.
  const std::vector<GridLinearPart> entering{{"a", 96, 3}, {"b", 32, 1}}, leaving{{"c", 48, 1}};
  run_local(shape.ranks(), [&](Communicator& world) {
    MeshShape mesh_shape;
    mesh_shape[MeshAxis::tp] = shape.ranks();
    const DeviceMesh mesh(world, mesh_shape, shape);
    TensorParallel tp{&world, false, mesh.tensor_grid()};
    const TensorGrid& grid = *tp.grid;
    for (const auto& [parts, side] : {std::pair{entering, GridSide::entering}, std::pair{leaving, GridSide::leaving}}) {
      ParamLayout layout;
      layout.add_group("layer");
      const GridLinear linear(layout, parts, in, 0, 0.02f, tp, true, side);
      ParamStore params(layout, 3);
      GradStore grads(layout);
      int64_t out = 0;
      for (const GridLinearPart& p : parts) out += p.out;
      Tensor x = Tensor::empty({tp.local_rows(N), in / grid.q});
      fill_normal(x.data<float>(), x.numel(), 5, 0, 0.0f, 1.0f);
      const double before = grid_elements_sent(grid);
      const Tensor y = linear.forward(params, x);
      EXPECT_EQ(y.numel(), tp.local_rows(N) * GridLinear::local_features(out, shape));
      const Tensor dx = linear.backward({params, grads}, y, x);
      EXPECT_EQ(dx.numel(), x.numel());
      EXPECT_DOUBLE_EQ(grid_elements_sent(grid) - before, grid_linear_elements_sent(out, in, N, shape))
          << (side == GridSide::entering ? "entering" : "leaving") << " layer on rank " << world.rank();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Grids, GridLinearVolume,
                         ::testing::Values(Case{"2d_tp4", {2, 1}}, Case{"2p5d_tp8", {2, 2}},
                                           Case{"3d_tp8", {2, 2, true}}),
                         [](const auto& info) { return std::string(info.param.name); });

// The cube sends less than 1D's pair of layers' all-reduces per layer at
// tp 8 once the activations outweigh the weights, and less than 2.5D's
// weights.
TEST(GridLinearVolume, TheCubeSendsLessThan1DAndLessWeightThan2p5D) {
  const int64_t h = 1024, N = 16 * 1024;
  const double one_d_per_layer = 4.0 * 7.0 / 8.0 * static_cast<double>(N * h) / 2.0;
  EXPECT_LT(grid_linear_elements_sent(h, h, N, {2, 2, true}), one_d_per_layer);
  EXPECT_LT(grid_linear_elements_sent(h, h, 0, {2, 2, true}), grid_linear_elements_sent(h, h, 0, {2, 2}));
}

}  // namespace
}  // namespace loom
