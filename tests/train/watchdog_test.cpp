// The watchdog over data-parallel training: a rank that stops inside a step
// ends every rank, each naming it and the phase of the step it stopped in.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "test_util.h"
#include "zero/zero_test_util.h"
#include "loom/train.h"

namespace loom {
namespace {

// Two data-parallel ranks train; in step 2, once its gradients are reduced,
// rank 1 sleeps forever. Rank 0 reports what it caught.
void train_with_rank_one_stalled() {
  CommOptions options;
  options.watchdog_timeout = std::chrono::seconds(2);
  testing::StallClock stall;
  run_local(2, [&](Communicator& world) {
    TrainOptions opts = testing::small_options(testing::layout(2, 1, DType::f32, 2));
    int step = 0;
    opts.on_gradients = [&](GradStore&) {
      if (world.rank() != 1 || step != 1) return;
      stall.start();
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    };
    Trainer trainer(testing::small_gpt(0.0f), opts, &world);
    for (step = 0; step < 3; ++step) {
      const std::vector<int32_t> data = testing::step_tokens(step, trainer.model().config().vocab_size);
      testing::reporting_failure(world.rank(), stall,
                                 [&] { trainer.step(testing::rank_micro_batches(data, 2, world.rank(), 2)); });
    }
  }, options);
}

TEST(WatchdogDeathTest, RankStalledInsideAStepEndsTrainingNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The stall is timed from just after rank 1's last report.
  EXPECT_EXIT(train_with_rank_one_stalled(), ::testing::ExitedWithCode(1),
              testing::rank_failures_match(
                  {0}, 1.95, 2.6,
                  {"rank 1 failed: made no progress for ", " while in 'optimizer step 2' (watchdog timeout 2.0 s)",
                   "raise train.watchdog_timeout"},
                  {"loom: rank 1 failed: made no progress for ", "loom: rank(s) [1] did not return"}));
}

}  // namespace
}  // namespace loom
