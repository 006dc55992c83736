// fp16 overflow handling across data-parallel ranks.
#include <gtest/gtest.h>

#include "zero_test_util.h"

namespace loom {
namespace {

// Rank 1 sees an Inf in one gradient element it owns at the given steps;
// every rank records the step's stats and its state before and after.
// Plain copies: a rank's tensors may not outlive run_local.
struct Snapshot {
  std::vector<float> params, exp_avg, exp_avg_sq;
  std::vector<uint16_t> working;  // the fp16 working parameters
  int64_t steps = 0, optimizer_steps = 0;
};

struct Observed {
  std::vector<StepStats> stats;
  std::vector<Snapshot> states;  // after each step
  std::vector<float> scales;     // loss scale after each step
};

Observed run_with_overflow(int stage, int hysteresis, const std::vector<int>& bad_steps, int steps, int observe_rank) {
  Observed seen;
  run_local(2, [&](Communicator& world) {
    TrainOptions opts = testing::small_options(testing::layout(2, stage, DType::f16));
    opts.loss_scale.hysteresis = hysteresis;
    Trainer* self = nullptr;
    int step = 0;
    opts.on_gradients = [&](GradStore& g) {
      if (world.rank() != 1 || std::find(bad_steps.begin(), bad_steps.end(), step) == bad_steps.end()) return;
      const ZeroPartition& part = *self->partition();
      const FlatRange own = part.owned(part.buckets().back());
      Tensor grad = dynamic_cast<ZeroGradStore&>(g).owned({own.begin, own.begin + 1});
      // fp16 under stages 0-1, the fp32 accumulation under stages 2-3.
      grad.fill_(std::numeric_limits<float>::infinity());
    };
    Trainer trainer(testing::small_gpt(0.0f), opts, &world);
    self = &trainer;
    for (step = 0; step < steps; ++step) {
      const std::vector<int32_t> data = testing::step_tokens(step, trainer.model().config().vocab_size);
      StepStats st = trainer.step(testing::rank_micro_batches(data, 2, world.rank(), 1));
      Trainer::State state = trainer.gather_state();
      if (world.rank() == observe_rank) {
        const Tensor working = dynamic_cast<ZeroParamStore&>(trainer.params()).storage();
        seen.stats.push_back(st);
        seen.states.push_back({testing::to_vector(state.params), testing::to_vector(state.exp_avg),
                               testing::to_vector(state.exp_avg_sq),
                               {working.data<uint16_t>(), working.data<uint16_t>() + working.numel()},
                               state.steps, state.optimizer_steps});
        seen.scales.push_back(trainer.loss_scaler()->scale());
      }
    }
  });
  return seen;
}

void expect_unchanged(const Observed& o, int before, int after) {
  const Snapshot& a = o.states[static_cast<size_t>(before)];
  const Snapshot& b = o.states[static_cast<size_t>(after)];
  EXPECT_TRUE(testing::bit_equal(a.params, b.params)) << "steps " << before << " and " << after;
  EXPECT_TRUE(testing::bit_equal(a.exp_avg, b.exp_avg));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, b.exp_avg_sq));
  EXPECT_TRUE(testing::bit_equal(a.working, b.working));
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps);
}

class Fp16Overflow : public ::testing::TestWithParam<int> {};

TEST_P(Fp16Overflow, EveryRankSkipsTheStepAndTheScaleHalvesAfterTheHysteresis) {
  const int stage = GetParam();
  for (int rank : {0, 1}) {
    const Observed o = run_with_overflow(stage, 2, {2, 3}, 5, rank);
    EXPECT_FALSE(o.stats[1].skipped);
    EXPECT_TRUE(o.stats[2].skipped) << "rank " << rank;
    EXPECT_TRUE(o.stats[3].skipped) << "rank " << rank;
    EXPECT_FALSE(o.stats[4].skipped);
    expect_unchanged(o, 1, 2);
    expect_unchanged(o, 1, 3);
    EXPECT_EQ(o.scales[1], 65536.0f);
    EXPECT_EQ(o.scales[2], 65536.0f);  // the first overflow spends the hysteresis
    EXPECT_EQ(o.scales[3], 32768.0f);  // the second halves the scale, exactly
    EXPECT_EQ(o.stats[4].loss_scale, 32768.0f);
    EXPECT_EQ(o.states[4].optimizer_steps, 3);
    EXPECT_EQ(o.states[4].steps, 5);
  }
}

TEST_P(Fp16Overflow, WithoutHysteresisOneOverflowHalvesTheScale) {
  const Observed o = run_with_overflow(GetParam(), 1, {1}, 3, 0);
  EXPECT_TRUE(o.stats[1].skipped);
  expect_unchanged(o, 0, 1);
  EXPECT_EQ(o.scales[1], 32768.0f);
  EXPECT_FALSE(o.stats[2].skipped);
}

INSTANTIATE_TEST_SUITE_P(Stages, Fp16Overflow, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return "stage" + std::to_string(i.param); });

TEST(Bf16NonFiniteGradients, EndEveryRankWithAnError) {
  testing::DataParallelRun r = testing::layout(2, 1, DType::bf16);
  r.steps = 2;
  r.on_gradients = [](int step, GradStore& g) {
    if (step != 1 || current_rank() != 1) return;
    dynamic_cast<ZeroGradStore&>(g).storage().fill_(std::numeric_limits<float>::infinity());
  };
  EXPECT_CONTAINS(testing::error_of([&] { testing::run_layout(r); }), "gradient norm");
}

}  // namespace
}  // namespace loom
