#include <gtest/gtest.h>

#include "loom/planner.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(StepCost, MegatronFlopsAreAboutSixTimesParamsTimesTokens) {
  GPTConfig cfg = GPTConfig::preset("gpt2");
  const double flops = training_flops_per_step(cfg, 4, 256);
  // 6 * params * tokens, plus attention, less the position embedding's share.
  const double six_pt = 6.0 * static_cast<double>(cfg.num_params()) * 4 * 256;
  EXPECT_GT(flops, 0.95 * six_pt);
  EXPECT_LT(flops, 1.15 * six_pt);
}

TEST(StepCost, EstimatedPeakMatchesTheAllocatorsHighWaterMark) {
  for (bool ckpt : {false, true}) {
    GPTConfig cfg;
    cfg.n_layer = 3;
    cfg.n_head = 4;
    cfg.n_embd = 64;
    cfg.vocab_size = 500;
    cfg.block_size = 32;
    const int64_t B = 4, T = 32;
    MemoryContext ctx;
    MemoryContext::Install install(ctx);
    TrainOptions opts;
    opts.checkpoint_activations = ckpt;
    Trainer trainer(cfg, opts);
    std::vector<int32_t> tok = testing::random_tokens(B * T, cfg.vocab_size, 1);
    MicroBatch mb{tok.data(), tok.data(), {B, T}, 0};
    trainer.step({&mb, 1});
    const double measured = static_cast<double>(ctx.tier(Tier::device).peak());
    const double estimate = estimate_step_memory(cfg, B, T, ckpt).total();
    EXPECT_NEAR(measured / estimate, 1.0, 0.10) << "checkpointing " << ckpt << ": measured " << measured
                                                << " estimate " << estimate;
  }
}

TEST(ZeroModelState, FollowsThePaperPerStageAndPrecision) {
  // 1000 parameters on 4 ranks, bytes per rank.
  const double fp32[] = {16000, 10000, 7000, 4000}, mixed[] = {16000, 7000, 6000, 4500};
  for (int stage = 0; stage < 4; ++stage) {
    EXPECT_EQ(zero_model_state_bytes(stage, DType::f32, 1000, 4), fp32[stage]) << "stage " << stage;
    EXPECT_EQ(zero_model_state_bytes(stage, DType::bf16, 1000, 4), mixed[stage]) << "stage " << stage;
    EXPECT_EQ(zero_model_state_bytes(stage, DType::f16, 1000, 4), mixed[stage]) << "stage " << stage;
    EXPECT_EQ(zero_model_state_bytes(stage, DType::f32, 1000, 1), 16000) << "stage " << stage;
  }
}

}  // namespace
}  // namespace loom
