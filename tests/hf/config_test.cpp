// config.json parsing and writing against the transformers fixtures.
#include <gtest/gtest.h>

#include "hf_fixtures.h"
#include "loom/hf.h"
#include "loom/io.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::hf_fixture;

TEST(HFConfig, ReadsGpt2Fixture) {
  const HFModelConfig c = read_hf_config(hf_fixture("gpt2"));
  EXPECT_EQ(c.arch, HFArch::gpt2);
  EXPECT_EQ(c.architecture, "GPT2LMHeadModel");
  EXPECT_EQ(c.model_type, "gpt2");
  EXPECT_EQ(c.vocab_size, 96);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate_size, 4 * 64);  // n_inner null
  EXPECT_EQ(c.max_position_embeddings, 64);
  EXPECT_EQ(c.hidden_act, HFActivation::gelu_tanh);
  EXPECT_EQ(c.hidden_act_name, "gelu_new");
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_EQ(c.rope_scaling.type, cpu::RopeScalingType::none);
  EXPECT_EQ(c.dtype, DType::f32);
}

TEST(HFConfig, ReadsLlamaFixtureWithLlama3Rope) {
  const HFModelConfig c = read_hf_config(hf_fixture("llama"));
  EXPECT_EQ(c.arch, HFArch::llama);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate_size, 160);
  EXPECT_EQ(c.hidden_act, HFActivation::silu);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, cpu::RopeScalingType::llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 32);
  EXPECT_EQ(read_hf_config(hf_fixture("llama_bf16_sharded")).dtype, DType::bf16);
}

TEST(HFConfig, ReadsMultiQueryFixtureWithLinearRope) {
  const HFModelConfig c = read_hf_config(hf_fixture("llama_mqa"));
  EXPECT_EQ(c.num_key_value_heads, 1);
  EXPECT_EQ(c.num_hidden_layers, 1);
  EXPECT_EQ(c.rope_scaling.type, cpu::RopeScalingType::linear);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 2.0);
}

// transformers 4.x spells the same config with rope_theta, rope_scaling and torch_dtype.
TEST(HFConfig, ReadsTransformers4Spelling) {
  const HFModelConfig v5 = read_hf_config(hf_fixture("llama_mqa"));
  const HFModelConfig v4 = parse_hf_config(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96,
    "max_position_embeddings": 64, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": {"type": "linear", "factor": 2.0}, "tie_word_embeddings": false, "torch_dtype": "float32"})");
  EXPECT_EQ(v4, v5);
}

TEST(HFConfig, WriterRoundTripsEveryFixture) {
  for (const char* name : {"gpt2", "llama", "llama_mqa", "llama_bf16_sharded"}) {
    const HFModelConfig c = read_hf_config(hf_fixture(name));
    EXPECT_EQ(parse_hf_config(hf_config_json(c)), c) << name;
  }
}

TEST(HFConfig, MistralReadsAsLlama) {
  HFModelConfig c = read_hf_config(hf_fixture("llama"));
  c.architecture = "MistralForCausalLM";
  c.model_type = "mistral";
  const HFModelConfig back = parse_hf_config(hf_config_json(c));
  EXPECT_EQ(back.arch, HFArch::llama);
  EXPECT_EQ(back, c);
}

// The llama fixture's config.json with `key`'s value (a scalar or a flat object) replaced.
std::string llama_with(const std::string& key, const std::string& value) {
  std::string text = read_file(hf_fixture("llama") / "config.json");
  const size_t at = text.find("\"" + key + "\"");
  EXPECT_NE(at, std::string::npos) << key;
  const size_t start = text.find(':', at) + 2;
  const char open = text[start];
  const size_t end = open == '{' || open == '[' ? text.find(open == '{' ? '}' : ']', start) + 1
                                                 : text.find_first_of(",\n", start);
  return text.substr(0, at) + "\"" + key + "\": " + value + text.substr(end);
}

TEST(HFConfig, ErrorsNameTheFileTheKeyAndWhatIsSupported) {
  const std::string arch = error_of([] { parse_hf_config(llama_with("architectures", R"(["BertForMaskedLM"])"), "m/config.json"); });
  EXPECT_CONTAINS(arch, "m/config.json");
  EXPECT_CONTAINS(arch, "'architectures'");
  EXPECT_CONTAINS(arch, "\"BertForMaskedLM\"");
  EXPECT_CONTAINS(arch, "LlamaForCausalLM");

  const std::string yarn =
      error_of([] { parse_hf_config(llama_with("rope_parameters", R"({"rope_type": "yarn", "factor": 4.0})")); });
  EXPECT_CONTAINS(yarn, "'rope_parameters.rope_type'");
  EXPECT_CONTAINS(yarn, "yarn");
  EXPECT_CONTAINS(yarn, "llama3");

  const std::string act = error_of([] { parse_hf_config(llama_with("hidden_act", "\"gelu\"")); });
  EXPECT_CONTAINS(act, "'hidden_act'");
  EXPECT_CONTAINS(act, "silu");

  const std::string window = error_of([] { parse_hf_config(llama_with("pad_token_id", "null, \"sliding_window\": 4096")); });
  EXPECT_CONTAINS(window, "'sliding_window'");

  const std::string kv = error_of([] { parse_hf_config(llama_with("num_key_value_heads", "3")); });
  EXPECT_CONTAINS(kv, "'num_key_value_heads'");

  const std::string missing = error_of([] { parse_hf_config(llama_with("hidden_size", "null")); });
  EXPECT_CONTAINS(missing, "'hidden_size' is missing");

  const std::string json = error_of([] { parse_hf_config("{\"vocab_size\": 96,", "x/config.json"); });
  EXPECT_CONTAINS(json, "x/config.json");
  EXPECT_CONTAINS(json, "not valid JSON");

  const std::string file = error_of([] { read_hf_config(hf_fixture("no_such_model")); });
  EXPECT_CONTAINS(file, "no_such_model/config.json");
}

TEST(HFConfig, LegacyRopeScalingDynamicIsRefused) {
  const std::string text = read_file(hf_fixture("llama") / "config.json");
  std::string legacy = text.substr(0, text.find("\"rope_parameters\"")) +
                       R"("rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0},)" +
                       text.substr(text.find("\"tie_word_embeddings\""));
  const std::string e = error_of([&] { parse_hf_config(legacy); });
  EXPECT_CONTAINS(e, "'rope_scaling.type'");
  EXPECT_CONTAINS(e, "dynamic");
}

// Without "architectures" the model_type chooses; GPT-2's own switches are refused.
TEST(HFConfig, ModelTypeAloneChoosesTheArchitecture) {
  const std::string base = R"("vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    "intermediate_size": 96, "max_position_embeddings": 64, "hidden_act": "silu", "sliding_window": null)";
  const HFModelConfig c = parse_hf_config("{\"model_type\": \"mistral\", " + base + "}");
  EXPECT_EQ(c.arch, HFArch::llama);
  EXPECT_EQ(c.architecture, "MistralForCausalLM");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-6);  // LlamaConfig's default
  const std::string e = error_of([&] { parse_hf_config("{\"model_type\": \"bert\", " + base + "}"); });
  EXPECT_CONTAINS(e, "'model_type' is \"bert\"; loom supports gpt2, llama, mistral");

  std::string gpt2 = read_file(hf_fixture("gpt2") / "config.json");
  const std::string flag = "\"scale_attn_by_inverse_layer_idx\": false";
  ASSERT_NE(gpt2.find(flag), std::string::npos);
  gpt2.replace(gpt2.find(flag), flag.size(), "\"scale_attn_by_inverse_layer_idx\": true");
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(gpt2); }), "'scale_attn_by_inverse_layer_idx'");
}

}  // namespace
}  // namespace loom
