// The shared suite on the mpi backend: run under mpiexec, one process per
// rank (ctest runs it with 2 and 4 ranks). Rank 0 prints the usual GoogleTest
// report; the other ranks print only their failures, prefixed by their rank.
#include <gtest/gtest.h>

#include "comm/collective_suite.h"
#include "mpi_test_main.h"

namespace loom {
namespace {

Communicator* g_world = nullptr;

TEST(MpiBackend, AllReduceFoldsInRankOrder) { comm_suite::all_reduce_folds_in_rank_order(*g_world); }
TEST(MpiBackend, ReduceScatterFoldsInRankOrder) { comm_suite::reduce_scatter_folds_in_rank_order(*g_world); }
TEST(MpiBackend, AllGatherPlacesEveryBlock) { comm_suite::all_gather_places_every_block(*g_world); }
TEST(MpiBackend, BroadcastCopiesTheRoot) { comm_suite::broadcast_copies_the_root(*g_world); }
TEST(MpiBackend, MaxAndMinPropagateNan) { comm_suite::max_and_min_propagate_nan(*g_world); }
TEST(MpiBackend, TensorFormsCheckTheirShapes) { comm_suite::tensor_forms_check_their_shapes(*g_world); }
TEST(MpiBackend, LargeAllReduce) { comm_suite::large_all_reduce(*g_world); }
TEST(MpiBackend, LargeReduceScatter) { comm_suite::large_reduce_scatter(*g_world); }
TEST(MpiBackend, LargeAllGather) { comm_suite::large_all_gather(*g_world); }
TEST(MpiBackend, LargeBroadcast) { comm_suite::large_broadcast(*g_world); }
TEST(MpiBackend, SendRecvMatchBySourceAndTag) { comm_suite::send_recv_match_by_source_and_tag(*g_world); }
TEST(MpiBackend, RecvOfTheWrongSizeFails) { comm_suite::recv_of_the_wrong_size_fails(*g_world); }
TEST(MpiBackend, SubGroupsFollowColorAndKey) { comm_suite::sub_groups_follow_color_and_key(*g_world); }
TEST(MpiBackend, AsyncCollectivesOverlapAndKeepIssueOrder) {
  comm_suite::async_collectives_overlap_and_keep_issue_order(*g_world);
}
TEST(MpiBackend, StatsFollowTheRingCostModel) { comm_suite::stats_follow_the_ring_cost_model(*g_world); }
TEST(MpiBackend, TimeoutNamesOperationSequenceAndMissingRank) {
  comm_suite::timeout_names_operation_sequence_and_missing_rank(*g_world);
}
TEST(MpiBackend, MismatchedCollectivesAreReported) { comm_suite::mismatched_collectives_are_reported(*g_world); }

TEST(MpiBackend, LaunchedByMpirunDefaultsToMpi) {
  EXPECT_TRUE(launched_by_mpirun());
  EXPECT_EQ(default_backend(), "mpi");
  EXPECT_STREQ(g_world->backend(), "mpi");
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) { return loom::testing::run_mpi_tests(argc, argv, loom::g_world); }
