#include <gtest/gtest.h>

#include "test_util.h"
#include "loom/config.h"
#include "loom/nn.h"

namespace loom {
namespace {

using testing::error_of;

const std::filesystem::path kConfigs = std::filesystem::path(LOOM_SOURCE_DIR) / "configs";

TEST(LoomSchema, HasTheKeysTheTrainerReads) {
  const ConfigSchema& s = loom_schema();
  for (const char* name :
       {"model.preset", "model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size", "model.block_size",
        "model.dropout", "train.batch_size", "train.micro_batch_size", "train.seq_len", "train.steps", "train.lr",
        "train.min_lr", "train.warmup_steps", "train.weight_decay", "train.beta1", "train.beta2", "train.eps",
        "train.grad_clip", "train.seed", "train.log_interval", "train.eval_interval", "train.eval_batches",
        "train.checkpoint_interval", "train.keep_last", "train.out_dir", "train.activation_checkpointing",
        "train.sample_tokens", "train.sample_prompt", "train.watchdog_timeout", "data.dir", "data.text", "data.vocab_size",
        "data.val_fraction", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.sequence_parallel",
        "parallel.schedule", "parallel.virtual_stages", "parallel.stage_layers", "parallel.backend", "parallel.nproc",
        "zero.stage", "zero.bucket_mb", "precision", "loss_scale.initial", "loss_scale.growth_interval",
        "loss_scale.hysteresis", "loss_scale.min", "memory.device_budget", "memory.host_budget",
        "memory.nvme_dir", "memory.policy", "memory.offload_param_frac", "memory.offload_optim_frac",
        "memory.chunk_bytes", "memory.prefetch", "memory.nvme_io_uring"}) {
    EXPECT_NE(s.find(name), nullptr) << name;
  }
  for (const ConfigKey& k : s.keys()) EXPECT_FALSE(k.doc.empty()) << k.name;
}

TEST(LoomSchema, ModelPresetChoicesAreTheModelsPresets) {
  const ConfigKey* preset = loom_schema().find("model.preset");
  ASSERT_NE(preset, nullptr);
  EXPECT_EQ(preset->choices.front(), "custom");
  for (const std::string& name : preset->choices)
    if (name != "custom") {
      EXPECT_GT(GPTConfig::preset(name).num_params(), 0) << name;
    }
  EXPECT_EQ(preset->choices.size(), GPTConfig::preset_names().size() + 1);
}

TEST(LoomSchema, ShakespeareConfigSetsEveryKey) {
  Config c(loom_schema());
  c.load_toml(kConfigs / "shakespeare.toml");
  for (const ConfigKey& k : loom_schema().keys()) EXPECT_FALSE(c.is_default(k.name)) << k.name << " is not in the file";
}

TEST(LoomSchema, TinyTestConfigLoadsAndIsSmall) {
  Config c(loom_schema());
  c.load_toml(kConfigs / "tiny-test.toml");
  EXPECT_LE(c.get<int64_t>("model.n_layer") * c.get<int64_t>("model.n_embd"), 256);
  EXPECT_LE(c.get<int64_t>("train.steps"), 50);
}

TEST(LoomSchema, DefaultsRoundTripThroughToml) {
  Config defaults(loom_schema());
  Config reread(loom_schema());
  reread.load_toml_string(defaults.to_toml(), "to_toml");
  for (const ConfigKey& k : loom_schema().keys()) EXPECT_EQ(reread.value(k.name), defaults.value(k.name)) << k.name;
}

}  // namespace
}  // namespace loom
