// The watchdog: ranks that advance, wait on each other or have returned are
// left alone; a stalled rank is reported once, within the timeout, naming its
// phase; under run_local every other rank then fails naming it and the
// process ends.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "test_util.h"
#include "loom/comm.h"

namespace loom {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What a watchdog reported, and when.
struct Stalls {
  std::mutex mu;
  std::vector<std::pair<int, std::string>> seen;
  Clock::time_point at;

  Watchdog::OnStall callback() {
    return [this](int rank, const std::string& message) {
      std::lock_guard lock(mu);
      seen.emplace_back(rank, message);
      at = Clock::now();
    };
  }
  size_t count() {
    std::lock_guard lock(mu);
    return seen.size();
  }
};

TEST(Watchdog, AdvancingRanksAreNotStalled) {
  Stalls stalls;
  Watchdog watchdog({0, 1}, 300ms, stalls.callback());
  // One rank changes phase, the other stays in one phase and reports that it
  // advances (a checkpoint writing tensor after tensor); both for 3 timeouts.
  std::thread phases([&] {
    Watchdog::Watch watch(watchdog, 0);
    for (int i = 0; i < 45; ++i) {
      report_progress("forward", i, "micro-batch", 0);
      std::this_thread::sleep_for(20ms);
    }
  });
  std::thread advancing([&] {
    Watchdog::Watch watch(watchdog, 1);
    report_progress("checkpoint write", 3);
    for (int i = 0; i < 45; ++i) {
      std::this_thread::sleep_for(20ms);
      report_progress();
    }
  });
  phases.join();
  advancing.join();
  EXPECT_EQ(stalls.count(), 0u);
}

TEST(Watchdog, StalledRankIsReportedOnceWithinTheTimeoutNamingItsPhase) {
  Stalls stalls;
  Watchdog watchdog({0, 7}, 200ms, stalls.callback());
  Clock::time_point last_report;
  std::thread stalled([&] {
    Watchdog::Watch watch(watchdog, 1);
    last_report = Clock::now();
    report_progress("forward", 2, "micro-batch", 0);
    std::this_thread::sleep_for(800ms);
  });
  stalled.join();
  ASSERT_EQ(stalls.count(), 1u);
  const double after = std::chrono::duration<double>(stalls.at - last_report).count();
  EXPECT_GE(after, 0.2);
  EXPECT_LT(after, 0.45);
  EXPECT_EQ(stalls.seen[0].first, 7);
  const std::string& message = stalls.seen[0].second;
  EXPECT_CONTAINS(message, "made no progress for 0.");
  EXPECT_CONTAINS(message, " while in 'forward step 2 micro-batch 0' (watchdog timeout 0.2 s)");
  EXPECT_CONTAINS(message, "raise train.watchdog_timeout");
}

TEST(Watchdog, PhaseWithoutStepOrItemIsNamedAlone) {
  Stalls stalls;
  Watchdog watchdog({3}, 100ms, stalls.callback());
  {
    Watchdog::Watch watch(watchdog, 0);
    report_progress("data load");
    std::this_thread::sleep_for(300ms);
  }
  ASSERT_EQ(stalls.count(), 1u);
  EXPECT_EQ(stalls.seen[0].first, 3);
  EXPECT_CONTAINS(stalls.seen[0].second, "while in 'data load' (");
}

TEST(Watchdog, RanksAreWatchedFromTheirFirstReportUntilTheyReturn) {
  Stalls stalls;
  Watchdog watchdog({0, 1}, 100ms, stalls.callback());
  std::thread silent([&] {
    Watchdog::Watch watch(watchdog, 0);
    std::this_thread::sleep_for(400ms);
  });
  {
    Watchdog::Watch watch(watchdog, 1);
    report_progress("optimizer", 1);
  }
  std::this_thread::sleep_for(400ms);
  silent.join();
  EXPECT_EQ(stalls.count(), 0u);
}

TEST(Watchdog, ZeroTimeoutWatchesNothingAndANegativeOneIsRefused) {
  Stalls stalls;
  {
    Watchdog watchdog({0}, 0ms, stalls.callback());
    Watchdog::Watch watch(watchdog, 0);
    report_progress("forward", 1, "micro-batch", 0);
    std::this_thread::sleep_for(300ms);
  }
  EXPECT_EQ(stalls.count(), 0u);
  EXPECT_CONTAINS(testing::error_of([&] { Watchdog({0}, -1ms, stalls.callback()); }), "0 to turn it off");
  CommOptions options;
  options.watchdog_timeout = -1ms;
  EXPECT_CONTAINS(testing::error_of([&] { run_local(1, [](Communicator&) {}, options); }),
                  "the watchdog timeout must be positive (or 0, off)");
}

// Rank 1 computes for three watchdog timeouts, reporting as it goes, while
// rank 0 waits for it in a barrier: waiting on another rank is not a stall.
TEST(Watchdog, WaitingForASlowButAdvancingRankIsNotAStall) {
  CommOptions options;
  options.watchdog_timeout = 300ms;
  run_local(2, [](Communicator& comm) {
    report_progress("forward", 1, "micro-batch", 0);
    if (comm.rank() == 1)
      for (int i = 0; i < 45; ++i) {
        std::this_thread::sleep_for(20ms);
        report_progress();
      }
    comm.barrier();
  }, options);
}

// Rank 1 stops inside a step, forever; ranks 0 and 2 wait for it in an
// all_reduce and report what they caught.
void stall_rank_one() {
  CommOptions options;
  options.watchdog_timeout = 1s;
  testing::StallClock stall;
  run_local(3, [&](Communicator& comm) {
    float x = 1.0f;
    comm.all_reduce(&x, 1, DType::f32);
    if (comm.rank() == 1) stall.start();
    report_progress("forward", 2, "micro-batch", 0);
    if (comm.rank() == 1)
      for (;;) std::this_thread::sleep_for(1h);
    testing::reporting_failure(comm.rank(), stall, [&] { comm.all_reduce(&x, 1, DType::f32); });
  }, options);
}

TEST(WatchdogDeathTest, StalledRankEndsEveryRankNamingItsPhase) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(stall_rank_one(), ::testing::ExitedWithCode(1),
              testing::rank_failures_match(
                  {0, 2}, 1.0, 1.6,
                  {"all_reduce #2 (1 x f32, sum) on world ranks [0-2] failed: rank 1 failed: made no progress for ",
                   " while in 'forward step 2 micro-batch 0' (watchdog timeout 1.0 s)", "raise train.watchdog_timeout"},
                  {"loom: rank 1 failed: made no progress for ",
                   "loom: rank(s) [1] did not return after the failure and cannot be stopped; ending the process"}));
}

// The calling thread alone, as the single-rank reference run is watched: its
// stall ends the process, naming the phase.
TEST(WatchdogDeathTest, StalledRunWithoutRanksEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_watched(200ms,
                          [] {
                            report_progress("optimizer", 4);
                            for (;;) std::this_thread::sleep_for(1h);
                          }),
              ::testing::ExitedWithCode(1),
              "loom: rank 0 failed: made no progress for 0\\.[2-4] s while in 'optimizer step 4' \\(watchdog "
              "timeout 0\\.2 s\\)");
  // Unwatched with a zero timeout; a run that returns is not ended.
  int runs = 0;
  run_watched(0ms, [&] {
    report_progress("optimizer", 4);
    std::this_thread::sleep_for(300ms);
    ++runs;
  });
  run_watched(100ms, [&] { ++runs; });
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(runs, 2);
}

}  // namespace
}  // namespace loom
