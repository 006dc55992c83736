// Hybrid layouts with one process per rank (ctest runs it with 4): tensor
// parallelism with sequence parallelism over pipeline stages, and data
// parallelism with ZeRO-1 over pipeline stages, reproduce the single-rank
// reference, which every process computes for itself, bit-identically twice.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace loom

int main(int argc, char** argv) { return loom::testing::run_mpi_tests(argc, argv, loom::g_world); }
