// The HF <-> loom name tables, expanded for the fixtures' configs.
#include <gtest/gtest.h>

#include <set>

#include "hf_fixtures.h"
#include "loom/hf.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::hf_fixture;

// Every stored tensor of every fixture is a parameter, found both ways, and
// HF -> loom -> HF returns the same entry: the map is a bijection.
TEST(HFParamMap, RoundTripsEveryFixtureName) {
  for (const char* name : {"gpt2", "llama", "llama_mqa", "llama_bf16_sharded"}) {
    const HFParamMap map(read_hf_config(hf_fixture(name)));
    const HFCheckpoint ckpt(hf_fixture(name));
    ASSERT_EQ(ckpt.tensors().size(), map.params().size()) << name;
    std::set<std::string> loom_names;
    for (const HFTensorInfo& t : ckpt.tensors()) {
      const HFParam* p = map.by_hf(t.name);
      ASSERT_NE(p, nullptr) << name << ": " << t.name;
      EXPECT_EQ(p->hf_shape(), t.shape) << t.name;
      const HFParam* back = map.by_loom(p->loom_name);
      ASSERT_EQ(back, p) << t.name;
      EXPECT_EQ(back->hf_name, t.name);
      EXPECT_TRUE(loom_names.insert(p->loom_name).second) << p->loom_name;
      if (!p->hf_alias.empty()) {
        EXPECT_EQ(map.by_hf(p->hf_alias), p);
      }
    }
  }
}

TEST(HFParamMap, Gpt2NamesAreLoomsAndConv1DWeightsTranspose) {
  const HFParamMap map(read_hf_config(hf_fixture("gpt2")));
  const HFParam* c_attn = map.by_loom("h.1.attn.c_attn.weight");
  ASSERT_NE(c_attn, nullptr);
  EXPECT_EQ(c_attn->hf_name, "transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(c_attn->hf_alias, "h.1.attn.c_attn.weight");
  EXPECT_EQ(c_attn->loom_shape, (Shape{3 * 64, 64}));
  EXPECT_EQ(c_attn->hf_shape(), (Shape{64, 3 * 64}));
  EXPECT_EQ(map.by_loom("h.1.attn.c_attn.bias")->transform, HFTransform::none);
  EXPECT_EQ(map.by_loom("h.0.mlp.c_proj.weight")->hf_shape(), (Shape{256, 64}));
  EXPECT_EQ(map.by_loom("lm_head.weight"), nullptr);  // tied
  EXPECT_TRUE(map.ignorable("transformer.h.11.attn.masked_bias"));
  EXPECT_TRUE(map.ignorable("h.0.attn.bias"));
  EXPECT_TRUE(map.ignorable("lm_head.weight"));
  EXPECT_FALSE(map.ignorable("transformer.h.x.attn.bias"));
  EXPECT_FALSE(map.ignorable("transformer.h.0.attn.c_attn.bias"));
}

TEST(HFParamMap, LlamaNamesFollowConfig) {
  HFModelConfig c = read_hf_config(hf_fixture("llama"));
  {
    const HFParamMap map(c);
    EXPECT_EQ(map.by_loom("h.1.attn.k.weight")->hf_name, "model.layers.1.self_attn.k_proj.weight");
    EXPECT_EQ(map.by_loom("h.1.attn.k.weight")->loom_shape, (Shape{2 * 16, 64}));
    EXPECT_EQ(map.by_loom("h.0.attn.c_proj.weight")->hf_name, "model.layers.0.self_attn.o_proj.weight");
    EXPECT_EQ(map.by_loom("h.0.mlp.c_proj.weight")->loom_shape, (Shape{64, 160}));
    EXPECT_EQ(map.by_loom("lm_head.weight")->hf_name, "lm_head.weight");
    EXPECT_EQ(map.by_hf("layers.0.mlp.up_proj.weight"), map.by_loom("h.0.mlp.up.weight"));
    EXPECT_EQ(map.by_loom("h.0.attn.q.bias"), nullptr);
    EXPECT_FALSE(map.ignorable("lm_head.weight"));  // untied: a parameter
    EXPECT_TRUE(map.ignorable("model.layers.0.self_attn.rotary_emb.inv_freq"));
    for (const HFParam& p : map.params()) EXPECT_EQ(p.transform, HFTransform::none) << p.hf_name;
  }
  c.attention_bias = true;
  c.mlp_bias = true;
  c.tie_word_embeddings = true;
  const HFParamMap biased(c);
  EXPECT_EQ(biased.by_loom("h.1.attn.v.bias")->hf_name, "model.layers.1.self_attn.v_proj.bias");
  EXPECT_EQ(biased.by_loom("h.1.mlp.gate.bias")->loom_shape, (Shape{160}));
  EXPECT_EQ(biased.by_loom("lm_head.weight"), nullptr);
  EXPECT_TRUE(biased.ignorable("lm_head.weight"));
  EXPECT_EQ(biased.params().size(), HFParamMap(read_hf_config(hf_fixture("llama"))).params().size() + 2 * 7 - 1);
}

}  // namespace
}  // namespace loom
