// Data parallelism with one process per rank (ctest runs it with 2): stages 1
// and 3 reproduce the single-rank reference, which every process computes
// for itself.
#include <gtest/gtest.h>

#include "mpi_test_main.h"
#include "zero_test_util.h"

namespace loom {
namespace {

Communicator* g_world = nullptr;

void expect_matches_reference(int stage) {
  testing::RunResult ref, a, b;
  testing::train_on(nullptr, testing::layout(0, 0), ref);
  testing::train_on(g_world, testing::layout(g_world->size(), stage), a);
  testing::train_on(g_world, testing::layout(g_world->size(), stage), b);
  if (g_world->rank() != 0) return;  // rank 0 holds the results
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
}

TEST(DataParallelMpi, Stage1MatchesTheReference) { expect_matches_reference(1); }
TEST(DataParallelMpi, Stage3MatchesTheReference) { expect_matches_reference(3); }

}  // namespace
}  // namespace loom

int main(int argc, char** argv) { return loom::testing::run_mpi_tests(argc, argv, loom::g_world); }
