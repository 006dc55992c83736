// main() of a GoogleTest executable run under mpiexec, one process per rank.
// Rank 0 prints the usual report; the other ranks print only their failures,
// prefixed by their rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "loom/comm.h"

namespace loom::testing {

// Failures of the non-zero ranks, which would otherwise go unseen.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "[rank %d] %s.%s failed at %s:%d\n%s\n", rank_, test ? test->test_suite_name() : "?",
                 test ? test->name() : "?", result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

// Initializes MPI, points `world` at MPI_COMM_WORLD and runs every test.
inline int run_mpi_tests(int argc, char** argv, Communicator*& world) {
  ::testing::InitGoogleTest(&argc, argv);
  // A broken test should fail within a minute rather than wait out the
  // default timeout.
  MpiRuntime mpi(CommOptions{std::chrono::seconds(60)});
  world = &mpi.world();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  return RUN_ALL_TESTS();
}

}  // namespace loom::testing
