// The LLaMA-class variants of the model: their configuration, parameter
// counts, activation checkpointing and KV-cache inference.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/device.h"
#include "loom/hf.h"
#include "loom/nn.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::bit_equal;
using testing::error_of;
using testing::random_tokens;

// llama-tiny with dropout: grouped-query attention (4 query, 2 kv heads), RoPE
// with llama3 scaling, SwiGLU of intermediate size 160, untied head.
GPTConfig tiny_llama(float dropout = 0.0f) {
  GPTConfig c = GPTConfig::preset("llama-tiny");
  c.block_size = 16;
  c.dropout = dropout;
  c.rope_scaling.type = cpu::RopeScalingType::llama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_position_embeddings = 8;
  return c;
}

TEST(LlamaConfig, InvalidVariantsNameTheFieldAndTheFix) {
  GPTConfig c = tiny_llama();
  c.n_kv_head = 3;
  std::string m = error_of([&] { c.validate(); });
  EXPECT_CONTAINS(m, "model.n_kv_head = 3");
  EXPECT_CONTAINS(m, "divisor of n_head");

  c = tiny_llama();
  c.packed_qkv = true;
  m = error_of([&] { c.validate(); });
  EXPECT_CONTAINS(m, "packed_qkv = false");

  c = GPTConfig::preset("tiny");
  c.norm_eps = 1e-6f;
  m = error_of([&] { c.validate(); });
  EXPECT_CONTAINS(m, "model.norm_eps");
  EXPECT_CONTAINS(m, "layernorm");

  c = tiny_llama();
  c.norm_eps = 0.0f;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "model.norm_eps");

  c = tiny_llama();
  c.n_embd = 60;  // head_dim 15
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "even head dimension");

  c = tiny_llama();
  c.rope_scaling.high_freq_factor = 0.5;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "llama3");

  c = tiny_llama();
  c.intermediate_size = -1;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "model.intermediate_size");
}

TEST(LlamaConfig, FromHFTakesAHeadDimOtherThanHiddenOverHeads) {
  HFModelConfig hf = read_hf_config(LOOM_SOURCE_DIR "/tests/fixtures/hf/llama");
  const GPTConfig c = GPTConfig::from_hf(hf);
  EXPECT_EQ(c.kv_heads(), hf.num_key_value_heads);
  EXPECT_EQ(c.intermediate(), hf.intermediate_size);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_scaling.type, cpu::RopeScalingType::llama3);
  EXPECT_EQ(c.head_size, 0);  // hidden / heads: the default
  hf.head_dim *= 2;
  const GPTConfig wide = GPTConfig::from_hf(hf);
  EXPECT_EQ(wide.head_dim(), hf.head_dim);
  EXPECT_EQ(wide.q_dim(), 2 * wide.n_embd);
  const GPT model(wide);
  const ParamLayout& l = model.layout();
  EXPECT_EQ(l.param(l.find("h.0.attn.q.weight")).shape, (Shape{wide.q_dim(), wide.n_embd}));
  EXPECT_EQ(l.param(l.find("h.0.attn.k.weight")).shape, (Shape{wide.kv_heads() * hf.head_dim, wide.n_embd}));
  EXPECT_EQ(l.param(l.find("h.0.attn.c_proj.weight")).shape, (Shape{wide.n_embd, wide.q_dim()}));
  EXPECT_EQ(l.numel(), wide.num_params());
}

TEST(LlamaConfig, AnExplicitHeadDimFreesTheHeadsFromTheWidth) {
  GPTConfig c = GPTConfig::preset("tiny");
  c.n_embd = 62;  // not a multiple of 4 heads
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "model.head_dim");
  c.head_size = 8;
  c.validate();
  EXPECT_EQ(c.q_dim(), 32);
  EXPECT_EQ(GPT(c).layout().numel(), c.num_params());
  c.head_size = -2;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "model.head_dim = -2");
  c = tiny_llama();
  c.head_size = 7;
  EXPECT_CONTAINS(error_of([&] { c.validate(); }), "even head dimension; model.head_dim = 7");
}

// Every variant's formula agrees with the layout GPT builds (GPT's constructor
// checks it too, for the whole model on one rank).
TEST(LlamaConfig, NumParamsCountsEveryVariant) {
  for (const std::string& name : GPTConfig::preset_names()) {
    const GPTConfig c = GPTConfig::preset(name);
    EXPECT_EQ(GPT(c).layout().numel(), c.num_params()) << name;
  }
  GPTConfig c = tiny_llama();
  c.attention_bias = c.mlp_bias = c.tied_embeddings = true;
  c.n_kv_head = 1;
  EXPECT_EQ(GPT(c).layout().numel(), c.num_params());
  c = GPTConfig::preset("tiny");
  c.intermediate_size = 100;
  c.norm = NormKind::rmsnorm;
  c.positions = PositionKind::rope;
  EXPECT_EQ(GPT(c).layout().numel(), c.num_params());
}

TEST(LlamaConfig, PresetsHaveThePublishedSizes) {
  auto billions = [](const char* name) {
    return std::round(static_cast<double>(GPTConfig::preset(name).num_params()) / 1e7) / 100.0;
  };
  EXPECT_EQ(billions("llama2-7b"), 6.74);
  EXPECT_EQ(billions("llama3-8b"), 8.03);
  EXPECT_EQ(billions("llama3.2-1b"), 1.24);
  EXPECT_EQ(billions("llama2-70b"), 68.98);
  EXPECT_EQ(billions("llama3-70b"), 70.55);
}

TEST(LlamaModel, ActivationCheckpointingGivesBitIdenticalGradients) {
  for (float dropout : {0.0f, 0.2f}) {
    const GPTConfig cfg = tiny_llama(dropout);
    const BatchShape bs{2, 16};
    const std::vector<int32_t> tok = random_tokens(bs.N(), cfg.vocab_size, 5);
    const std::vector<int32_t> tgt = random_tokens(bs.N(), cfg.vocab_size, 6);
    auto run = [&](bool checkpoint) {
      GPT model(cfg);
      ParamStore ps(model.layout(), 5);
      GradStore gs(model.layout());
      ForwardOptions fo;
      fo.dropout_key = 7;
      fo.checkpoint_activations = checkpoint;
      MicroBatchState s;
      model.forward(ps, s, tok.data(), tgt.data(), bs, fo);
      model.backward(ps, gs, s, 1.0f / static_cast<float>(bs.N()));
      return gs.flat().clone(Tier::host);
    };
    const Tensor plain = run(false), recomputed = run(true);
    EXPECT_TRUE(bit_equal(plain, recomputed)) << "dropout " << dropout;
    double norm = 0;
    for (int64_t i = 0; i < plain.numel(); ++i) norm += std::fabs(plain.data<float>()[i]);
    EXPECT_GT(norm, 0.0);
  }
}

}  // namespace
}  // namespace loom
