// Export of LoRA adapters in PEFT's layout (export_peft_adapter), held to the
// layout of the adapter PEFT itself saved (tests/fixtures/hf/llama_lora).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "loom/hf.h"
#include "loom/io.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

const std::filesystem::path kPeftFixture = LOOM_SOURCE_DIR "/tests/fixtures/hf/llama_lora";

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// B starts at zero: values worth comparing.
void give_b_values(const GPT& model, ParamStore& ps) {
  const HostSection host;
  float* flat = ps.flat().data<float>();
  for (const ParamSpec& p : model.layout().params())
    if (p.name.ends_with("lora_B.weight"))
      for (int64_t i = 0; i < p.numel(); ++i) flat[p.offset + i] = 0.001f * static_cast<float>(i + 1);
}

TEST(PeftExport, AdaptersLandUnderPeftsNamesWithTheirValues) {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.lora.r = 4;
  cfg.lora.alpha = 16.0f;
  cfg.lora.dropout = 0.05f;
  cfg.lora.targets = {"c_attn", "mlp.c_proj"};
  const GPT model(cfg);
  ParamStore ps(model.layout(), 3);
  give_b_values(model, ps);
  testing::TempDir dir;
  export_peft_adapter(model, ps, dir.path() / "adapter");

  const HFCheckpoint ck(dir.path() / "adapter", "adapter_model");
  std::set<std::string> names;
  for (const HFTensorInfo& t : ck.tensors()) names.insert(t.name);
  std::set<std::string> expected;
  for (int i = 0; i < cfg.n_layer; ++i)
    for (const char* m : {"attn.c_attn", "mlp.c_proj"})
      for (const char* f : {"lora_A", "lora_B"})
        expected.insert(str("base_model.model.transformer.h.", i, ".", m, ".", f, ".weight"));
  EXPECT_EQ(names, expected);
  for (const ParamSpec& p : model.layout().params()) {
    if (p.name.find(".lora_") == std::string::npos) continue;
    std::vector<float> read(static_cast<size_t>(p.numel()));
    ck.read_f32("base_model.model.transformer." + p.name, read.data(), p.numel());
    const float* want = ps.flat().data<float>() + p.offset;
    EXPECT_EQ(read, std::vector<float>(want, want + p.numel())) << p.name;
  }

  // The configuration PEFT reads: the fixture's keys with this run's values.
  const nlohmann::json ours = read_json(dir.path() / "adapter" / "adapter_config.json");
  const nlohmann::json peft = read_json(kPeftFixture / "adapter_config.json");
  for (const char* key : {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "fan_in_fan_out", "bias",
                          "task_type", "use_rslora", "use_dora"})
    EXPECT_TRUE(peft.contains(key) && ours.contains(key)) << key;
  EXPECT_EQ(ours["peft_type"], peft["peft_type"]);
  EXPECT_EQ(ours["r"], 4);
  EXPECT_EQ(ours["lora_alpha"], 16.0);
  // As written in the file: 0.05, not the float's 0.05000000074505806.
  EXPECT_EQ(ours["lora_dropout"].dump(), "0.05");
  // Whole module paths: "c_proj" alone would name the attention's too.
  nlohmann::json modules = nlohmann::json::array();
  for (int i = 0; i < cfg.n_layer; ++i)
    for (const char* m : {"attn.c_attn", "mlp.c_proj"}) modules.push_back(str("transformer.h.", i, ".", m));
  EXPECT_EQ(ours["target_modules"], modules);
  EXPECT_TRUE(ours["fan_in_fan_out"].get<bool>());  // GPT-2's Conv1D layers
}

// The names and shapes PEFT wrote: base_model.model.<module>.lora_A.weight
// [r, in] and .lora_B.weight [out, r], which the export follows.
TEST(PeftExport, FixtureSavedByPeftHasTheLayoutTheExportWrites) {
  const HFCheckpoint ck(kPeftFixture, "adapter_model");
  const int64_t r = read_json(kPeftFixture / "adapter_config.json")["r"].get<int64_t>();
  ASSERT_FALSE(ck.tensors().empty());
  for (const HFTensorInfo& t : ck.tensors()) {
    EXPECT_TRUE(t.name.starts_with("base_model.model.")) << t.name;
    ASSERT_EQ(t.shape.size(), 2u) << t.name;
    if (t.name.ends_with(".lora_A.weight"))
      EXPECT_EQ(t.shape[0], r) << t.name;
    else if (t.name.ends_with(".lora_B.weight"))
      EXPECT_EQ(t.shape[1], r) << t.name;
    else
      ADD_FAILURE() << t.name;
  }
}

// The GPT-2 export of a LoRA model holds W + (alpha / r) B A in place of each
// adapted weight (Conv1D: [in, out]) and no adapter tensors.
TEST(PeftExport, MergedExportAddsTheScaledProductToTheBaseWeights) {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.lora.r = 2;
  cfg.lora.alpha = 6.0f;
  cfg.lora.targets = {"c_fc"};
  const GPT model(cfg);
  ParamStore ps(model.layout(), 3);
  give_b_values(model, ps);
  testing::TempDir dir;
  export_hf(model, ps, dir.path() / "hf");
  const SafetensorsReader r(dir.path() / "hf" / "model.safetensors");
  for (const auto& e : r.entries()) EXPECT_EQ(e.name.find("lora_"), std::string::npos) << e.name;
  const HostSection host;
  const float* flat = ps.flat().data<float>();
  const ParamSpec& w = model.layout().param(model.layout().find("h.1.mlp.c_fc.weight"));
  const ParamSpec& a = model.layout().param(model.layout().find("h.1.mlp.c_fc.lora_A.weight"));
  const ParamSpec& b = model.layout().param(model.layout().find("h.1.mlp.c_fc.lora_B.weight"));
  const int64_t out = w.shape[0], in = w.shape[1];
  std::vector<float> stored(static_cast<size_t>(w.numel()));
  r.read("transformer.h.1.mlp.c_fc.weight", stored.data(), stored.size() * sizeof(float));
  double worst = 0.0, delta = 0.0;
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double update = 0.0;
      for (int64_t k = 0; k < 2; ++k) update += 3.0 * flat[b.offset + o * 2 + k] * flat[a.offset + k * in + i];
      const double want = flat[w.offset + o * in + i] + update;
      worst = std::max(worst, std::fabs(stored[static_cast<size_t>(i * out + o)] - want));
      delta = std::max(delta, std::fabs(update));
    }
  EXPECT_GT(delta, 1e-3);
  EXPECT_LT(worst, 1e-6);
}

// A LoRA run's checkpoint records its adapters: loading it builds the same
// model (the commands that read checkpoints: generate, eval, export), and a
// resume with other lora.* settings is an Error.
TEST(PeftExport, CheckpointsRecordTheAdapters) {
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.lora.r = 2;
  cfg.lora.targets = {"c_attn"};
  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-3f, 0, 2};
  Trainer trainer(cfg, opts);
  const std::vector<int32_t> data = testing::random_tokens(2 * 8 + 1, cfg.vocab_size, 3);
  const MicroBatch mb{data.data(), data.data() + 1, {2, 8}, 0};
  trainer.step({&mb, 1});
  testing::TempDir dir;
  const std::filesystem::path saved = save_checkpoint(dir.path(), trainer, {}, 0);
  const CheckpointInfo info = read_checkpoint_info(saved);
  const GPTConfig loaded = checkpoint_model_config(info);
  EXPECT_EQ(loaded.lora.r, 2);
  EXPECT_EQ(loaded.lora.targets, cfg.lora.targets);
  const GPT model(loaded);
  ParamStore ps(model.layout(), 99);
  load_weights(info, model, ps);
  const Trainer::State state = trainer.gather_state();
  const HostSection host;
  const int b = model.layout().find("h.0.attn.c_attn.lora_B.weight");
  ASSERT_GE(b, 0);
  const ParamSpec& p = model.layout().param(b);
  const float* trained = state.params.data<float>() + p.offset;
  const float* read = ps.flat().data<float>() + p.offset;
  EXPECT_EQ(std::vector<float>(read, read + p.numel()), std::vector<float>(trained, trained + p.numel()));
  GPTConfig other = cfg;
  other.lora.r = 4;
  Trainer resumed(other, opts);
  EXPECT_THROW(load_checkpoint(saved, resumed), Error);
}

// A LLaMA model's adapters (one per stacked q, k, v and gate, up
// parameter) export under the names and with the configuration PEFT gave
// the fixture: loading tests/fixtures/hf/llama_lora and exporting it again
// reproduces every tensor.
TEST(PeftExport, LlamaAdaptersExportAsPeftSavedThem) {
  const HFImport base(kPeftFixture.parent_path() / "llama");
  const nlohmann::json peft = read_json(kPeftFixture / "adapter_config.json");
  GPTConfig cfg = base.model;
  cfg.lora.r = peft["r"].get<int64_t>();
  cfg.lora.alpha = peft["lora_alpha"].get<float>();
  cfg.lora.targets = {"q", "k", "v", "o", "gate", "up", "down"};
  const GPT model(cfg);
  ParamStore ps(model.layout(), 3);
  load_hf_weights(base, model, ps);
  const HFCheckpoint fixture(kPeftFixture, "adapter_model");
  {
    const HostSection host;
    float* flat = ps.flat().data<float>();
    for (const ParamSpec& p : model.layout().params()) {
      if (base.map.by_loom(p.name)) continue;
      const size_t at = p.name.find(".lora_");
      const std::string hf = base.map.by_loom(p.name.substr(0, at) + ".weight")->hf_name;
      fixture.read_f32("base_model.model." + hf.substr(0, hf.rfind(".weight")) + p.name.substr(at),
                       flat + p.offset, p.numel());
    }
  }
  testing::TempDir dir;
  export_peft_adapter(model, ps, dir.path() / "adapter");
  const HFCheckpoint ours(dir.path() / "adapter", "adapter_model");
  ASSERT_EQ(ours.tensors().size(), fixture.tensors().size());
  for (const HFTensorInfo& t : fixture.tensors()) {
    ASSERT_TRUE(ours.contains(t.name)) << t.name;
    EXPECT_EQ(ours.tensor(t.name).shape, t.shape) << t.name;
    const int64_t n = shape_numel(t.shape);
    std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    fixture.read_f32(t.name, want.data(), n);
    ours.read_f32(t.name, got.data(), n);
    EXPECT_EQ(got, want) << t.name;
  }
  const nlohmann::json config = read_json(dir.path() / "adapter" / "adapter_config.json");
  for (const char* key : {"peft_type", "r", "lora_alpha", "fan_in_fan_out", "auto_mapping"})
    EXPECT_EQ(config[key], peft[key]) << key;
}

TEST(PeftExport, AModelWithoutAdaptersIsAnError) {
  const GPT model(GPTConfig::preset("tiny"));
  ParamStore ps(model.layout(), 3);
  testing::TempDir dir;
  EXPECT_THROW(export_peft_adapter(model, ps, dir.path() / "adapter"), Error);
}

}  // namespace
}  // namespace loom
