#include <gtest/gtest.h>

#include "loom/planner.h"

namespace loom {
namespace {

TEST(StepCost, MegatronFlopsAreAboutSixTimesParamsTimesTokens) {
  // LLaMA's grouped-query attention and SwiGLU change the matmul weights; an
  // untied head's table counts once (the head), not twice.
  for (const char* name : {"gpt2", "llama2-7b", "llama3-8b"}) {
    const GPTConfig cfg = GPTConfig::preset(name);
    const double flops = training_flops_per_step(cfg, 4, 256);
    // 6 * params * tokens, plus attention, less the embeddings' share.
    const double embeddings = cfg.tied_embeddings ? 0.0 : static_cast<double>(cfg.vocab_size * cfg.n_embd);
    const double six_pt = 6.0 * (static_cast<double>(cfg.num_params()) - embeddings) * 4 * 256;
    EXPECT_GT(flops, 0.95 * six_pt) << name;
    EXPECT_LT(flops, 1.15 * six_pt) << name;
  }
  const GPTConfig gpt2 = GPTConfig::preset("gpt2");
  const double h = 768, s = 256, L = 12, V = 50257;
  EXPECT_NEAR(training_flops_per_step(gpt2, 4, 256) / (72.0 * 4 * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))),
              1.0, 1e-12);
}

// LoRA: the frozen weights skip their weight gradient (4 FLOPs per weight
// and token instead of 6), the adapters train; the pipeline's per-layer costs
// still sum to the step's.
TEST(StepCost, LoRASkipsTheFrozenWeightsGradients) {
  const GPTConfig full = GPTConfig::preset("llama2-7b");
  GPTConfig lora = full;
  lora.lora.r = 16;
  lora.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  const double s = 256, adapters = static_cast<double>(lora.num_adapter_params());
  const double attention = 12.0 * s * s * static_cast<double>(full.n_layer * full.n_embd);
  // Take away the full step's attention; 2/3 of the rest, and the adapters.
  const double expect = (training_flops_per_step(full, 1, 256) - attention) * 4.0 / 6.0 + attention + 6.0 * s * adapters;
  EXPECT_NEAR(training_flops_per_step(lora, 1, 256) / expect, 1.0, 1e-12);
  double layers = 0.0;
  for (double c : pipeline_layer_costs(lora, 256)) layers += c;
  EXPECT_NEAR(layers / training_flops_per_step(lora, 1, 256), 1.0, 1e-12);
  EXPECT_EQ(lora.num_trainable_params(), lora.num_adapter_params());
  EXPECT_EQ(full.num_trainable_params(), full.num_params());
  EXPECT_EQ(lora.num_params(), full.num_params() + lora.num_adapter_params());
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
