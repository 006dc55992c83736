#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
}  // namespace loom
