// Hybrid layouts with one process per rank (ctest runs it with 4): tensor
// parallelism with sequence parallelism over pipeline stages, data
// parallelism with ZeRO-1 over pipeline stages, and a 2D grid, reproduce the
// single-rank reference, which every process computes for itself,
// bit-identically twice.
// A sharded checkpoint written by the four processes loads in each of them
// alone.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "loom/io.h"
#include "mpi_test_main.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

Communicator* g_world = nullptr;

testing::DataParallelRun hybrid(int dp, int tp, int pp, bool sequence_parallel, int stage) {
  testing::DataParallelRun r = testing::layout(dp, stage, DType::f32, 2);
  r.tp = tp;
  r.pp = pp;
  r.n_layer = 4;
  r.n_head = 4;
  r.model_parallel.sequence_parallel = sequence_parallel;
  return r;
}

void expect_matches_reference(const testing::DataParallelRun& layout) {
  testing::DataParallelRun reference = testing::layout(0, 0);
  reference.n_layer = layout.n_layer;
  reference.n_head = layout.n_head;
  testing::RunResult ref, a, b;
  testing::train_on(nullptr, reference, ref);
  testing::train_on(g_world, layout, a);
  testing::train_on(g_world, layout, b);
  if (g_world->rank() != 0) return;  // rank 0 holds the results
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
}

TEST(ModelParallelMpi, TensorSequenceAndPipelineMatchTheReference) {
  ASSERT_EQ(g_world->size(), 4);
  expect_matches_reference(hybrid(1, 2, 2, true, 0));
}

TEST(ModelParallelMpi, DataParallelZero1OverPipelineStagesMatchesTheReference) {
  ASSERT_EQ(g_world->size(), 4);
  expect_matches_reference(hybrid(2, 1, 2, false, 1));
}

// A 2 x 2 grid (2D tensor parallelism) of one process per rank: the grid's
// groups split from the MPI world.
TEST(ModelParallelMpi, TwoDimensionalGridMatchesTheReference) {
  ASSERT_EQ(g_world->size(), 4);
  testing::DataParallelRun r = hybrid(1, 4, 1, false, 0);
  r.grid = {2, 1};
  r.mesh = true;
  expect_matches_reference(r);
}

// Every process writes its own file into rank 0's staging directory (whose
// name holds rank 0's pid); the committed checkpoint then loads on one rank.
TEST(ModelParallelMpi, ShardedCheckpointOfTensorAndPipelineRanksLoadsOnOneRank) {
  ASSERT_EQ(g_world->size(), 4);
  int64_t pid = getpid();
  g_world->broadcast(&pid, 1, DType::i64, 0);
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("loom-sharded-mpi-" + std::to_string(pid));
  testing::DataParallelRun r = hybrid(1, 2, 2, false, 0);
  r.accumulation = 1;
  const GPTConfig cfg = testing::small_gpt(0.0f, r.n_layer, r.n_head);
  const std::unique_ptr<DeviceMesh> mesh = testing::mesh_of(g_world, r);
  Trainer trainer(cfg, testing::small_options(r), *mesh);
  const std::vector<int32_t> data = testing::step_tokens(0, cfg.vocab_size);
  trainer.step(testing::rank_micro_batches(data, 1, 0, 1));
  const std::filesystem::path saved = save_checkpoint(root, trainer, {}, 0, mesh.get());
  const Trainer::State state = trainer.gather_state();
  EXPECT_EQ(read_manifest(saved).files.size(), 4u);
  Trainer single(cfg, testing::small_options(testing::layout(0, 0)));
  load_checkpoint(saved, single);
  const Trainer::State loaded = single.gather_state();
  EXPECT_TRUE(testing::bit_equal(loaded.params, state.params));
  EXPECT_TRUE(testing::bit_equal(loaded.exp_avg_sq, state.exp_avg_sq));
  g_world->barrier();
  if (g_world->rank() == 0) std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) { return loom::testing::run_mpi_tests(argc, argv, loom::g_world); }
