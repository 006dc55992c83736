// A run's config turned into a validated plan: every cross-field rule is
// checked here, before a byte is allocated or a file is read.
#include "loom/config.h"
#include "loom/train.h"

namespace loom {

GPTConfig model_config_from(const Config& cfg) {
  const std::string preset = cfg.get<std::string>("model.preset");
  GPTConfig m;
  if (preset == "custom") {
    m.n_layer = cfg.get<int64_t>("model.n_layer");
    m.n_head = cfg.get<int64_t>("model.n_head");
    m.n_embd = cfg.get<int64_t>("model.n_embd");
    m.vocab_size = cfg.get<int64_t>("model.vocab_size");
    m.block_size = cfg.get<int64_t>("model.block_size");
  } else {
    m = GPTConfig::preset(preset);
  }
  m.dropout = static_cast<float>(cfg.get<double>("model.dropout"));
  m.validate();
  return m;
}

TrainPlan plan_training(const Config& cfg) {
  TrainPlan p;
  p.model = model_config_from(cfg);
  p.steps = cfg.get<int64_t>("train.steps");
  p.global_batch = cfg.get<int64_t>("train.batch_size");
  p.micro_batch = cfg.get<int64_t>("train.micro_batch_size");
  p.seq_len = cfg.get<int64_t>("train.seq_len");
  p.out_dir = cfg.get<std::string>("train.out_dir");

  const int64_t dp = cfg.get<int64_t>("parallel.dp"), tp = cfg.get<int64_t>("parallel.tp"),
                pp = cfg.get<int64_t>("parallel.pp");
  if (dp * tp * pp != 1)
    throw ConfigError(cfg, dp != 1 ? "parallel.dp" : tp != 1 ? "parallel.tp" : "parallel.pp",
                      "multi-rank layouts are not available yet in `loom train`", "set parallel.dp/tp/pp to 1");
  if (cfg.get<int64_t>("zero.stage") != 0)
    throw ConfigError(cfg, "zero.stage", "ZeRO needs data-parallel ranks, which `loom train` does not run yet",
                      "set zero.stage = 0");
  if (cfg.get<std::string>("precision") != "fp32")
    throw ConfigError(cfg, "precision", "mixed precision is not available yet", "set precision = \"fp32\"");
  if (cfg.get<std::string>("memory.policy") != "none")
    throw ConfigError(cfg, "memory.policy", "offload policies are not available yet", "set memory.policy = \"none\"");
  if (p.seq_len > p.model.block_size)
    throw ConfigError(cfg, "train.seq_len", str("may not exceed the model's context block_size = ", p.model.block_size),
                      str("set train.seq_len <= ", p.model.block_size, " or raise model.block_size"));
  if (p.global_batch % p.micro_batch != 0) {
    const int64_t down = p.global_batch / p.micro_batch * p.micro_batch;
    throw ConfigError(cfg, "train.batch_size",
                      str("must be a multiple of train.micro_batch_size = ", p.micro_batch),
                      str("set train.batch_size to ", down > 0 ? str(down, " or ") : std::string(),
                          down + p.micro_batch));
  }
  p.accumulation = p.global_batch / p.micro_batch;
  if (cfg.get<int64_t>("data.vocab_size") > p.model.vocab_size)
    throw ConfigError(cfg, "data.vocab_size",
                      str("the tokenizer's vocabulary may not exceed model.vocab_size = ", p.model.vocab_size),
                      str("set model.vocab_size >= ", cfg.get<int64_t>("data.vocab_size"),
                          " or lower data.vocab_size"));

  TrainOptions& o = p.options;
  o.adamw.lr = static_cast<float>(cfg.get<double>("train.lr"));
  o.adamw.beta1 = static_cast<float>(cfg.get<double>("train.beta1"));
  o.adamw.beta2 = static_cast<float>(cfg.get<double>("train.beta2"));
  o.adamw.eps = static_cast<float>(cfg.get<double>("train.eps"));
  o.adamw.weight_decay = static_cast<float>(cfg.get<double>("train.weight_decay"));
  o.schedule.max_lr = o.adamw.lr;
  o.schedule.min_lr = static_cast<float>(cfg.get<double>("train.min_lr"));
  o.schedule.warmup_steps = cfg.get<int64_t>("train.warmup_steps");
  o.schedule.total_steps = p.steps;
  if (o.schedule.min_lr > o.schedule.max_lr)
    throw ConfigError(cfg, "train.min_lr", str("may not exceed train.lr = ", o.schedule.max_lr),
                      "lower train.min_lr");
  o.grad_clip = static_cast<float>(cfg.get<double>("train.grad_clip"));
  o.checkpoint_activations = cfg.get<bool>("train.activation_checkpointing");
  o.seed = static_cast<uint64_t>(cfg.get<int64_t>("train.seed"));
  return p;
}

}  // namespace loom
