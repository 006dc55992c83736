#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loom/nn.h"
#include "loom/device.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::bit_equal;
using testing::random_tokens;

GPTConfig small_config(float dropout = 0.0f) {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 37;
  c.block_size = 12;
  c.dropout = dropout;
  return c;
}

// Gradients of one forward/backward over the whole batch.
Tensor gradients(const GPTConfig& cfg, const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt,
                 const BatchShape& bs, const ForwardOptions& fo, float* loss = nullptr) {
  GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  GradStore gs(model.layout());
  MicroBatchState s;
  model.forward(ps, s, tok.data(), tgt.data(), bs, fo);
  if (loss) *loss = static_cast<float>(s.host_loss_sum() / static_cast<double>(s.valid_targets));
  model.backward(ps, gs, s, 1.0f / static_cast<float>(bs.N()));
  return gs.flat().clone(Tier::host);
}

TEST(GPTConfig, PresetsHaveThePublishedSizes) {
  EXPECT_NEAR(static_cast<double>(GPTConfig::preset("gpt2").num_params()), 124.44e6, 0.01e6);
  EXPECT_NEAR(static_cast<double>(GPTConfig::preset("gpt2-medium").num_params()), 354.8e6, 0.1e6);
  EXPECT_NEAR(static_cast<double>(GPTConfig::preset("gpt2-large").num_params()), 774.0e6, 0.1e6);
  EXPECT_NEAR(static_cast<double>(GPTConfig::preset("gpt2-xl").num_params()), 1557.6e6, 0.1e6);
  EXPECT_THROW(GPTConfig::preset("gpt5"), Error);
}

TEST(GPTConfig, InvalidShapesNameTheFieldAndTheFix) {
  GPTConfig c = small_config();
  c.n_embd = 30;
  c.n_head = 4;
  try {
    c.validate();
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.n_embd = 30"), std::string::npos) << m;
    EXPECT_NE(m.find("n_head = 4"), std::string::npos) << m;
    EXPECT_NE(m.find("28 or 32"), std::string::npos) << m;
  }
  c = small_config();
  c.n_layer = 0;
  EXPECT_THROW(c.validate(), Error);
  c = small_config();
  c.vocab_size = -3;
  EXPECT_THROW(GPT{c}, Error);
  c = small_config();
  c.dropout = 1.0f;
  EXPECT_THROW(c.validate(), Error);
}

TEST(GPT, BadTokensAndContextAreErrors) {
  GPTConfig cfg = small_config();
  GPT model(cfg);
  ParamStore ps(model.layout(), 1);
  std::vector<int32_t> tok = random_tokens(2 * 8, cfg.vocab_size, 1), tgt = tok;
  MicroBatchState s;
  tok[5] = 37;
  try {
    model.forward(ps, s, tok.data(), tgt.data(), {2, 8});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 37"), std::string::npos) << e.what();
  }
  tok[5] = 0;
  tgt[3] = -7;
  EXPECT_THROW(model.forward(ps, s, tok.data(), tgt.data(), {2, 8}), Error);
  std::vector<int32_t> long_tok = random_tokens(13, cfg.vocab_size, 2);
  try {
    model.forward(ps, s, long_tok.data(), long_tok.data(), {1, 13});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_size = 12"), std::string::npos) << e.what();
  }
}

// The forward does not stop on a non-finite loss (the host does not read it
// per micro-batch); the sum carries it to the Trainer's once-per-step check.
TEST(GPT, NonFiniteLossReachesTheLossSum) {
  GPTConfig cfg = small_config();
  GPT model(cfg);
  ParamStore ps(model.layout(), 1);
  std::vector<int32_t> tok = random_tokens(8, cfg.vocab_size, 1);
  MicroBatchState s;
  model.forward(ps, s, tok.data(), tok.data(), {1, 8});
  EXPECT_TRUE(std::isfinite(s.host_loss_sum()));
  ps.param(model.layout().find("ln_f.weight")).fill_(std::numeric_limits<float>::quiet_NaN());
  model.forward(ps, s, tok.data(), tok.data(), {1, 8});
  EXPECT_FALSE(std::isfinite(s.host_loss_sum()));
}

// Training knows dloss before the forward, which then writes the logits'
// gradient in its pass over them: the same bits as the separate backward.
TEST(GPT, FusedLossGradientIsBitIdentical) {
  for (float dropout : {0.0f, 0.2f}) {
    GPTConfig cfg = small_config(dropout);
    std::vector<int32_t> tok = random_tokens(2 * 12, cfg.vocab_size, 5), tgt = random_tokens(24, cfg.vocab_size, 6);
    tgt[3] = -1;  // an ignored position
    ForwardOptions plain, fused;
    plain.dropout_key = fused.dropout_key = 7;
    fused.dloss = 1.0f / 24.0f;
    float l1 = 0, l2 = 0;
    Tensor g1 = gradients(cfg, tok, tgt, {2, 12}, plain, &l1);
    Tensor g2 = gradients(cfg, tok, tgt, {2, 12}, fused, &l2);
    EXPECT_EQ(l1, l2);
    EXPECT_TRUE(bit_equal(g1, g2)) << "dropout " << dropout;
  }
}

TEST(GPT, SameRunTwiceIsBitIdentical) {
  GPTConfig cfg = small_config(0.1f);
  std::vector<int32_t> tok = random_tokens(3 * 10, cfg.vocab_size, 3), tgt = random_tokens(30, cfg.vocab_size, 4);
  ForwardOptions fo;
  fo.dropout_key = 99;
  EXPECT_TRUE(bit_equal(gradients(cfg, tok, tgt, {3, 10}, fo), gradients(cfg, tok, tgt, {3, 10}, fo)));
}

TEST(GPT, ActivationCheckpointingGivesBitIdenticalGradients) {
  for (float dropout : {0.0f, 0.2f}) {
    GPTConfig cfg = small_config(dropout);
    std::vector<int32_t> tok = random_tokens(2 * 12, cfg.vocab_size, 5), tgt = random_tokens(24, cfg.vocab_size, 6);
    ForwardOptions plain, ckpt;
    plain.dropout_key = ckpt.dropout_key = 7;
    ckpt.checkpoint_activations = true;
    float l1 = 0, l2 = 0;
    Tensor g1 = gradients(cfg, tok, tgt, {2, 12}, plain, &l1);
    Tensor g2 = gradients(cfg, tok, tgt, {2, 12}, ckpt, &l2);
    EXPECT_EQ(l1, l2);
    EXPECT_TRUE(bit_equal(g1, g2)) << "dropout " << dropout;
  }
}

TEST(GPT, CheckpointingKeepsOnlyBlockInputs) {
  GPTConfig cfg = small_config();
  cfg.n_layer = 4;
  std::vector<int32_t> tok = random_tokens(4 * 12, cfg.vocab_size, 5);
  auto peak_of = [&](bool ckpt) {
    MemoryContext ctx;
    MemoryContext::Install install(ctx);
    GPT model(cfg);
    ParamStore ps(model.layout(), 1);
    size_t before = ctx.tier(Tier::device).used();
    ForwardOptions fo;
    fo.checkpoint_activations = ckpt;
    MicroBatchState s;
    model.forward(ps, s, tok.data(), tok.data(), {4, 12}, fo);
    return ctx.tier(Tier::device).used() - before;
  };
  // Kept after forward: 16 N C per block without checkpointing, N C with.
  const double N = 48, C = 16;
  const double per_block_full = 4 * (16 * N * C + 4 * N + cfg.n_head * N), per_block_ckpt = 4 * N * C;
  double saved = static_cast<double>(peak_of(false)) - static_cast<double>(peak_of(true));
  EXPECT_NEAR(saved, cfg.n_layer * (per_block_full - per_block_ckpt), 1.0);
}

TEST(GPT, MicroBatchesAccumulateToTheFullBatchGradient) {
  GPTConfig cfg = small_config(0.1f);
  std::vector<int32_t> tok = random_tokens(4 * 10, cfg.vocab_size, 8), tgt = random_tokens(40, cfg.vocab_size, 9);
  ForwardOptions fo;
  fo.dropout_key = 3;
  Tensor full = gradients(cfg, tok, tgt, {4, 10}, fo);

  GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  GradStore gs(model.layout());
  for (int64_t mb = 0; mb < 2; ++mb) {
    ForwardOptions f = fo;
    f.first_sequence = 2 * mb;  // masks follow the global sequence index
    MicroBatchState s;
    model.forward(ps, s, tok.data() + mb * 20, tgt.data() + mb * 20, {2, 10}, f);
    model.backward(ps, gs, s, 1.0f / 40.0f);
  }
  ops::synchronize();
  const float* a = gs.flat().data<float>();
  const float* b = full.data<float>();
  double scale = 0;
  for (int64_t i = 0; i < full.numel(); ++i) scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  for (int64_t i = 0; i < full.numel(); ++i) ASSERT_NEAR(a[i], b[i], 1e-6 * scale) << "element " << i;
}

}  // namespace
}  // namespace loom
