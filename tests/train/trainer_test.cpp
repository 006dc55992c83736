#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loom/comm.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::random_tokens;

GPTConfig config() {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 50;
  c.block_size = 16;
  return c;
}

std::vector<float> run_losses(int micro_batches, bool ckpt, int steps) {
  const GPTConfig cfg = config();
  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-3f, 2, steps};
  opts.checkpoint_activations = ckpt;
  Trainer trainer(cfg, opts);
  const int64_t B = 4, T = 16;
  std::vector<int32_t> data = random_tokens(B * T + 1, cfg.vocab_size, 17);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    std::vector<MicroBatch> mbs;
    const int64_t per = B / micro_batches;
    for (int m = 0; m < micro_batches; ++m)
      mbs.push_back({data.data() + m * per * T, data.data() + m * per * T + 1, {per, T}, m * per});
    losses.push_back(trainer.step(mbs).loss);
  }
  return losses;
}

TEST(Trainer, LearnsAFixedBatch) {
  std::vector<float> l = run_losses(1, false, 20);
  EXPECT_LT(l.back(), 0.5f * l.front());
}

TEST(Trainer, IsBitIdenticalRunToRun) {
  EXPECT_EQ(run_losses(2, false, 5), run_losses(2, false, 5));
}

TEST(Trainer, GradientAccumulationMatchesOneLargeBatch) {
  std::vector<float> one = run_losses(1, false, 20), four = run_losses(4, false, 20);
  for (size_t s = 0; s < one.size(); ++s) EXPECT_LE(std::fabs(one[s] - four[s]) / one[s], 1e-5) << "step " << s;
}

TEST(Trainer, ActivationCheckpointingIsBitIdentical) {
  EXPECT_EQ(run_losses(2, false, 5), run_losses(2, true, 5));
}

TEST(Trainer, ABatchWithoutTargetsIsAnError) {
  Trainer trainer(config(), {});
  std::vector<int32_t> tok(16, 1), tgt(16, -1);
  MicroBatch mb{tok.data(), tgt.data(), {1, 16}, 0};
  EXPECT_THROW(trainer.step({&mb, 1}), Error);
}

// The host reads the loss once per step, after the micro-batches: a
// non-finite loss stops the step there, before the optimizer runs.
TEST(Trainer, ANonFiniteLossIsAnErrorOfTheStep) {
  Trainer trainer(config(), {});
  trainer.params()
      .param(trainer.model().layout().find("ln_f.weight"))
      .fill_(std::numeric_limits<float>::quiet_NaN());
  std::vector<int32_t> tok = random_tokens(2 * 16 + 1, config().vocab_size, 3);
  const MicroBatch mbs[] = {{tok.data(), tok.data() + 1, {1, 16}, 0}, {tok.data() + 16, tok.data() + 17, {1, 16}, 1}};
  try {
    trainer.step(mbs);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not finite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(trainer.optimizer_steps(), 0);
}

// With train.max_skipped_steps a non-finite loss skips the step instead,
// until that many in a row stop the run.
TEST(Trainer, ANonFiniteLossIsSkippedWhenSkippingIsOn) {
  TrainOptions opts;
  opts.max_skipped_steps = 2;
  Trainer trainer(config(), opts);
  trainer.params()
      .param(trainer.model().layout().find("ln_f.weight"))
      .fill_(std::numeric_limits<float>::quiet_NaN());
  std::vector<int32_t> tok = random_tokens(16 + 1, config().vocab_size, 3);
  const MicroBatch mb{tok.data(), tok.data() + 1, {1, 16}, 0};
  const StepStats st = trainer.step({&mb, 1});
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(st.skip, StepSkip::non_finite_loss);
  EXPECT_EQ(trainer.steps_done(), 1);
  EXPECT_EQ(trainer.optimizer_steps(), 0);
  const std::string e = testing::error_of([&] { trainer.step({&mb, 1}); });
  EXPECT_NE(e.find("2 diverging steps in a row skipped"), std::string::npos) << e;
  EXPECT_NE(e.find("non-finite loss"), std::string::npos) << e;
  EXPECT_EQ(trainer.optimizer_steps(), 0);
}

// An fp32 gradient that is not finite (injected after the reduction) skips
// its step when skipping is on; the next step updates.
TEST(Trainer, ANonFiniteGradientIsSkippedWhenSkippingIsOn) {
  TrainOptions opts;
  opts.max_skipped_steps = 2;
  int64_t step = 0;
  opts.on_gradients = [&](GradStore& g) {
    if (++step == 2) g.flat().flat(0, 1).fill_(std::numeric_limits<float>::infinity());
  };
  Trainer trainer(config(), opts);
  std::vector<int32_t> tok = random_tokens(16 + 1, config().vocab_size, 3);
  const MicroBatch mb{tok.data(), tok.data() + 1, {1, 16}, 0};
  EXPECT_FALSE(trainer.step({&mb, 1}).skipped);
  const Tensor before = trainer.params().flat().clone(Tier::host);
  const StepStats st = trainer.step({&mb, 1});
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(st.skip, StepSkip::non_finite_gradient);
  EXPECT_TRUE(testing::bit_equal(trainer.params().flat().clone(Tier::host), before));
  EXPECT_EQ(trainer.optimizer_steps(), 1);
  EXPECT_FALSE(trainer.step({&mb, 1}).skipped);
  EXPECT_EQ(trainer.optimizer_steps(), 2);
}

// Steps on a batch of one repeated token, which the model soon predicts with
// confidence, then a batch of another: its loss spikes past 2.5x the running
// mean (7.5x on one rank, 3.8x on two). On one rank, or on two where only rank 1's half of the batch is the
// other token: every rank skips the update alike (weights and moments bit for
// bit as before, the optimizer's step count too), the next ordinary step
// updates, and two spikes in a row stop the run.
void check_spike_skipping(Communicator* dp) {
  const GPTConfig cfg = config();
  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-2f, 0, 100};
  opts.max_skipped_steps = 2;
  opts.skip_spike_factor = 2.5;
  if (dp) opts.zero.stage = 1;
  Trainer trainer(cfg, opts, dp);
  const int64_t B = 2, T = 16;
  const int rank = dp ? dp->rank() : 0;
  const std::vector<int32_t> easy(B * T + 1, 1), other(B * T + 1, 2);
  const std::vector<int32_t>& spike = rank == (dp ? 1 : 0) ? other : easy;
  auto step = [&](const std::vector<int32_t>& data) {
    const MicroBatch mb{data.data(), data.data() + 1, {B, T}, rank * B};
    return trainer.step({&mb, 1});
  };
  for (int s = 0; s < 20; ++s) EXPECT_FALSE(step(easy).skipped) << "step " << s + 1;
  auto expect_unchanged = [&](const Trainer::State& before) {
    const Trainer::State after = trainer.gather_state();
    EXPECT_TRUE(testing::bit_equal(after.params, before.params));
    EXPECT_TRUE(testing::bit_equal(after.exp_avg, before.exp_avg));
    EXPECT_TRUE(testing::bit_equal(after.exp_avg_sq, before.exp_avg_sq));
    EXPECT_EQ(after.optimizer_steps, before.optimizer_steps);
  };
  const Trainer::State before = trainer.gather_state();
  const StepStats st = step(spike);
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(st.skip, StepSkip::loss_spike);
  EXPECT_GT(st.loss, 2.5 * st.loss_mean);
  EXPECT_EQ(st.loss_mean, before.loss_watch.mean);
  EXPECT_EQ(trainer.steps_done(), 21);
  EXPECT_EQ(trainer.loss_watch().skipped_in_a_row, 1);
  expect_unchanged(before);

  const StepStats next = step(easy);
  EXPECT_FALSE(next.skipped);
  EXPECT_EQ(trainer.optimizer_steps(), 21);
  EXPECT_EQ(trainer.loss_watch().skipped_in_a_row, 0);
  const Trainer::State good = trainer.gather_state();
  EXPECT_TRUE(step(spike).skipped);
  const std::string e = testing::error_of([&] { step(spike); });
  EXPECT_NE(e.find("step 24: 2 diverging steps in a row skipped"), std::string::npos) << e;
  EXPECT_NE(e.find("loss spike"), std::string::npos) << e;
  expect_unchanged(good);
}

TEST(Trainer, ALossSpikeIsSkippedAndTooManyInARowStopTheRun) { check_spike_skipping(nullptr); }

TEST(Trainer, EveryDataParallelRankSkipsTheSpikeOfOneRanksData) {
  run_local(2, [](Communicator& dp) { check_spike_skipping(&dp); });
}

std::vector<float> host_values(const Tensor& t) {
  const Tensor h = t.clone(Tier::host);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

// Fine-tuning data masks prompt targets (-1): the loss is the mean over the
// other targets and its gradient is theirs alone.
TEST(Trainer, MaskedTargetsLossIsTheMeanOverUnmaskedTargetsAndTheGradientIsTheirs) {
  const GPTConfig cfg = config();
  const int64_t B = 2, T = 16;
  const std::vector<int32_t> tokens = random_tokens(B * T + 1, cfg.vocab_size, 5);
  // Row 0 a short prompt, row 1 a long one, and a masked run inside row 0's
  // response, as packed examples give.
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  const int64_t prompt[2] = {4, 11};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < T; ++j)
      if (j < prompt[b] || (b == 0 && j >= 9 && j < 12)) targets[static_cast<size_t>(b * T + j)] = -1;
  std::vector<int64_t> valid;
  for (int64_t i = 0; i < B * T; ++i)
    if (targets[static_cast<size_t>(i)] != -1) valid.push_back(i);
  ASSERT_EQ(valid.size(), 14u);

  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-3f, 1, 1};
  Trainer* trainer_ptr = nullptr;
  std::vector<float> trainer_grad;
  opts.on_gradients = [&](GradStore&) { trainer_grad = host_values(trainer_ptr->gather_gradients()); };
  Trainer trainer(cfg, opts);
  trainer_ptr = &trainer;
  const MicroBatch mb{tokens.data(), targets.data(), {B, T}, 0};
  const StepStats st = trainer.step({&mb, 1});

  // Independently, one forward and backward per unmasked target, each with
  // that target alone: the per-token losses and the sum of their gradients
  // over the count, from the Trainer's initial weights.
  GPT model(cfg);
  ParamStore ps(model.layout(), opts.seed);
  GradStore gs(model.layout());
  gs.zero();
  const float dloss = 1.0f / static_cast<float>(valid.size());
  double loss_sum = 0.0;
  for (int64_t p : valid) {
    std::vector<int32_t> one(targets.size(), -1);
    one[static_cast<size_t>(p)] = targets[static_cast<size_t>(p)];
    MicroBatchState s;
    ForwardOptions fo;
    fo.training = true;
    fo.dloss = dloss;
    model.forward(ps, s, tokens.data(), one.data(), {B, T}, fo);
    model.backward(ps, gs, s, dloss);
    const double loss_p = s.host_loss_sum();
    EXPECT_GT(loss_p, 0.0);
    loss_sum += loss_p;
  }
  const double mean = loss_sum / static_cast<double>(valid.size());
  EXPECT_NEAR(st.loss, mean, 1e-6 * mean);
  // Over every position it would be diluted by the masked ones.
  EXPECT_GT(std::fabs(st.loss - loss_sum / static_cast<double>(B * T)), 0.1 * mean);

  const std::vector<float> want = host_values(gs.flat());
  ASSERT_EQ(trainer_grad.size(), want.size());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(trainer_grad[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(diff, 1e-5 * scale) << "max abs difference " << diff << " of max abs " << scale;
}

}  // namespace
}  // namespace loom
