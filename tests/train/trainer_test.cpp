#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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

}  // namespace
}  // namespace loom
