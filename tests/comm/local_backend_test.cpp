// The shared suite on the local backend with 1 to 4 ranks, and what only the
// local backend can show in-process: failure propagation across ranks, the
// per-rank memory contexts and thread budgets, and backend selection.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "comm/collective_suite.h"
#include "loom/kernels.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

void on_groups_of(std::initializer_list<int> sizes, void (*body)(Communicator&)) {
  for (int n : sizes) {
    SCOPED_TRACE(str(n, " ranks"));
    run_local(n, body);
  }
}

TEST(LocalBackend, AllReduceFoldsInRankOrder) {
  on_groups_of({1, 2, 3, 4}, comm_suite::all_reduce_folds_in_rank_order);
}
TEST(LocalBackend, ReduceScatterFoldsInRankOrder) {
  on_groups_of({1, 2, 3, 4}, comm_suite::reduce_scatter_folds_in_rank_order);
}
TEST(LocalBackend, AllGatherPlacesEveryBlock) { on_groups_of({1, 2, 3, 4}, comm_suite::all_gather_places_every_block); }
TEST(LocalBackend, BroadcastCopiesTheRoot) { on_groups_of({1, 2, 3, 4}, comm_suite::broadcast_copies_the_root); }
TEST(LocalBackend, MaxAndMinPropagateNan) { on_groups_of({1, 3}, comm_suite::max_and_min_propagate_nan); }
TEST(LocalBackend, TensorFormsCheckTheirShapes) {
  on_groups_of({1, 2, 3}, comm_suite::tensor_forms_check_their_shapes);
}
TEST(LocalBackend, LargeAllReduce) { on_groups_of({2}, comm_suite::large_all_reduce); }
TEST(LocalBackend, LargeReduceScatter) { on_groups_of({2}, comm_suite::large_reduce_scatter); }
TEST(LocalBackend, LargeAllGather) { on_groups_of({2}, comm_suite::large_all_gather); }
TEST(LocalBackend, LargeBroadcast) { on_groups_of({2}, comm_suite::large_broadcast); }
TEST(LocalBackend, SendRecvMatchBySourceAndTag) {
  on_groups_of({1, 2, 3, 4}, comm_suite::send_recv_match_by_source_and_tag);
}
TEST(LocalBackend, RecvOfTheWrongSizeFails) { on_groups_of({2}, comm_suite::recv_of_the_wrong_size_fails); }
TEST(LocalBackend, SubGroupsFollowColorAndKey) {
  on_groups_of({1, 2, 3, 4}, comm_suite::sub_groups_follow_color_and_key);
}
TEST(LocalBackend, AsyncCollectivesOverlapAndKeepIssueOrder) {
  on_groups_of({1, 2, 4}, comm_suite::async_collectives_overlap_and_keep_issue_order);
}
TEST(LocalBackend, StatsFollowTheRingCostModel) {
  on_groups_of({1, 2, 3}, comm_suite::stats_follow_the_ring_cost_model);
}
TEST(LocalBackend, TimeoutNamesOperationSequenceAndMissingRank) {
  on_groups_of({2, 3}, comm_suite::timeout_names_operation_sequence_and_missing_rank);
}
TEST(LocalBackend, MismatchedCollectivesAreReported) {
  on_groups_of({2, 3}, comm_suite::mismatched_collectives_are_reported);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `fn` on `nproc` ranks expecting run_local to fail; returns the message.
std::string failure_of(int nproc, const RankFunction& fn, const CommOptions& options = {}) {
  try {
    run_local(nproc, fn, options);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "run_local returned normally";
  return {};
}

TEST(LocalBackend, ExceptionOnOneRankEndsEveryRankNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> released{0};
  const std::string message = failure_of(4, [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == 2) throw std::runtime_error("injected failure");
    // The others wait for rank 2 in a collective (ranks 0, 1) or a receive (rank 3).
    try {
      if (comm.rank() == 3) {
        int64_t x;
        comm.recv(&x, 8, 2, 0);
      } else {
        float x = 1;
        comm.all_reduce(&x, 1, DType::f32);
      }
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2 failed: injected failure"), std::string::npos) << e.what();
      released++;
      throw;
    }
  });
  EXPECT_EQ(message, "rank 2 failed: injected failure");
  EXPECT_EQ(released.load(), 3);
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LocalBackend, FailureStopsRanksAtTheirNextCollective) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = failure_of(3, [](Communicator& comm) {
    if (comm.rank() == 0) throw Error("bad batch");
    std::this_thread::sleep_for(200ms);  // busy computing when rank 0 fails
    comm.barrier();
  });
  EXPECT_EQ(message, "rank 0 failed: bad batch");
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LocalBackend, RankThatReturnsEarlyFailsCollectivesThatNeedIt) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = failure_of(3, [](Communicator& comm) {
    if (comm.rank() == 1) return;
    float x = 1;
    comm.all_reduce(&x, 1, DType::f32);
  });
  EXPECT_NE(message.find("all_reduce #1"), std::string::npos) << message;
  EXPECT_NE(message.find("world rank(s) [1] returned without joining it"), std::string::npos) << message;
  EXPECT_LT(seconds_since(start), 5.0);  // well before the 300 s timeout
}

TEST(LocalBackend, TimeoutFailsTheRunNamingOperationAndMissingRank) {
  const std::string message = failure_of(
      3,
      [](Communicator& comm) {
        if (comm.rank() == 2) {
          std::this_thread::sleep_for(2s);
          return;
        }
        comm.barrier();
      },
      CommOptions{500ms});
  EXPECT_NE(message.find("barrier #1"), std::string::npos) << message;
  EXPECT_NE(message.find("timed out after 0.5 s waiting for world rank(s) [2]"), std::string::npos) << message;
}

TEST(LocalBackend, AbandonedAsyncCollectiveDuringAnExceptionDoesNotHang) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = failure_of(2, [](Communicator& comm) {
    std::vector<float> grads(1000, 1.0f);
    if (comm.rank() == 0) {
      // The handle dies during unwinding while rank 1 never joins: the
      // collective must be cancelled, not waited for.
      Work pending = comm.all_reduce_async(grads.data(), 1000, DType::f32);
      throw std::runtime_error("out of patience");
    }
    std::this_thread::sleep_for(300ms);
    comm.barrier();
  });
  EXPECT_EQ(message, "rank 0 failed: out of patience");
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LocalBackend, EachRankHasItsOwnMemoryContextAndShareOfThreads) {
  const int threads = cpu::num_threads();
  std::atomic<int> checked{0};
  run_local(2, [&](Communicator& comm) {
    EXPECT_EQ(current_rank(), comm.rank());
    EXPECT_EQ(cpu::num_threads(), std::max(1, threads / 2));
    Allocator& device = MemoryContext::current().tier(Tier::device);
    EXPECT_EQ(device.used(), 0u);
    Tensor t = Tensor::empty({(comm.rank() + 1) * 1024}, DType::f32, Tier::device);
    comm.barrier();  // both ranks hold their tensor now
    EXPECT_EQ(device.used(), static_cast<size_t>(comm.rank() + 1) * 4096);
    comm.barrier();
    checked++;
  });
  EXPECT_EQ(checked.load(), 2);
}

TEST(LocalBackend, BadArgumentsAreErrors) {
  auto nothing = [](Communicator&) {};
  EXPECT_THROW(run_local(0, nothing), Error);
  EXPECT_THROW(run_local(2, nothing, CommOptions{0ms}), Error);
  EXPECT_THROW(run_local(1, [](Communicator& comm) { comm.set_options({-1ms}); }), Error);
}

TEST(Launch, PicksTheBackendByName) {
  ASSERT_FALSE(launched_by_mpirun());
  EXPECT_EQ(default_backend(), "local");
  std::atomic<int> ranks{0};
  launch("auto", 3, [&](Communicator& comm) {
    EXPECT_STREQ(comm.backend(), "local");
    EXPECT_EQ(comm.size(), 3);
    ranks++;
  });
  EXPECT_EQ(ranks.load(), 3);
  try {
    launch("nccl", 2, [](Communicator&) {});
    ADD_FAILURE() << "an unknown backend was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'nccl'"), std::string::npos) << e.what();
  }
  // Outside mpirun the mpi backend cannot start several ranks itself.
  try {
    launch("mpi", 2, [](Communicator&) {});
    ADD_FAILURE() << "the mpi backend started ranks without mpirun";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(mpi_available() ? "mpirun -np 2" : "not in this build"), std::string::npos)
        << e.what();
  }
}

TEST(BlockedSeconds, CountWaitingInSynchronousCollectivesAndInWait) {
  run_local(2, [](Communicator& comm) {
    float x = 1.0f;
    const double before = blocked_seconds();
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(60));
    comm.all_reduce(&x, 1, DType::f32);
    const double synchronous = blocked_seconds() - before;
    // Rank 1 arrived last and hardly waited; blocked time is per thread.
    EXPECT_TRUE(comm.rank() == 0 ? synchronous >= 0.05 : synchronous < 0.05) << "rank " << comm.rank();
    if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(60));
    Work w = comm.all_reduce_async(&x, 1, DType::f32);
    const double issued = blocked_seconds();
    w.wait();
    if (comm.rank() == 1) {
      EXPECT_GE(blocked_seconds() - issued, 0.05);
    }
  });
}

}  // namespace
}  // namespace loom
