// A run's config turned into a validated plan: every cross-field rule is
// checked here, before a byte is allocated or a file is read.
#include <cstdlib>

#include "loom/comm.h"
#include "loom/config.h"
#include "loom/train.h"

namespace loom {

namespace {

// The launcher parallel.backend names must be able to start `ranks` ranks from
// how this process was started.
void check_launcher(const Config& cfg, const std::string& backend, int64_t ranks) {
  const int64_t started = launched_by_mpirun() ? std::atoll(std::getenv("OMPI_COMM_WORLD_SIZE")) : 1;
  if (backend == "local") {
    if (started > 1)
      throw ConfigError(cfg, "parallel.backend",
                        str("this process is one of ", started,
                            " that mpirun started, and each would train a copy of the run on local ranks"),
                        "set parallel.backend = \"mpi\", or start loom without mpirun");
    return;
  }
  if (!mpi_available())
    throw ConfigError(cfg, "parallel.backend", "this build of loom has no MPI",
                      "set parallel.backend = \"local\", or install OpenMPI and reconfigure with -DLOOM_WITH_MPI=ON");
  if (!launched_by_mpirun())
    throw ConfigError(cfg, "parallel.backend",
                      "the mpi backend runs one process per rank, and this process was not started by mpirun",
                      str("start it with `mpirun -np ", ranks, " loom train ...`, or set parallel.backend = \"local\""));
  if (started != ranks)
    throw ConfigError(cfg, "parallel.dp",
                      str("mpirun started ", started, " processes, but the layout has parallel.dp * parallel.tp * "
                          "parallel.pp = ", ranks, " ranks"),
                      str("run `mpirun -np ", ranks, "`, or set parallel.dp = ", started));
}

}  // namespace

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
  if (tp != 1 || pp != 1)
    throw ConfigError(cfg, tp != 1 ? "parallel.tp" : "parallel.pp",
                      "tensor/pipeline parallelism is not available in `loom train` yet",
                      "set parallel.tp = 1 and parallel.pp = 1 (parallel.dp runs data parallel)");
  if (cfg.get<std::string>("memory.policy") != "none")
    throw ConfigError(cfg, "memory.policy", "offload policies are not available yet", "set memory.policy = \"none\"");
  p.dp = dp;
  const int64_t ranks = dp * tp * pp;
  const int64_t nproc = cfg.get<int64_t>("parallel.nproc");
  if (nproc != 0 && nproc != ranks)
    throw ConfigError(cfg, "parallel.nproc",
                      str("must be 0 or parallel.dp * parallel.tp * parallel.pp = ", ranks, " (one rank each)"),
                      str("set parallel.nproc = 0 (it follows the layout) or ", ranks, ", or parallel.dp = ", nproc));
  p.nproc = static_cast<int>(ranks);
  p.backend = cfg.get<std::string>("parallel.backend");
  check_launcher(cfg, p.backend, ranks);

  if (p.seq_len > p.model.block_size)
    throw ConfigError(cfg, "train.seq_len", str("may not exceed the model's context block_size = ", p.model.block_size),
                      str("set train.seq_len <= ", p.model.block_size, " or raise model.block_size"));
  const int64_t per_step = dp * p.micro_batch;
  if (p.global_batch % per_step != 0) {
    const int64_t down = p.global_batch / per_step * per_step;
    throw ConfigError(cfg, "train.batch_size",
                      dp == 1 ? str("must be a multiple of train.micro_batch_size = ", p.micro_batch)
                              : str("must be a multiple of train.micro_batch_size * parallel.dp = ", p.micro_batch,
                                    " * ", dp, " = ", per_step),
                      str("set train.batch_size to ", down > 0 ? str(down, " or ") : std::string(), down + per_step));
  }
  p.accumulation = p.global_batch / per_step;
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

  // zero.stage > 0 with one rank shards over a group of one: the same as
  // stage 0, so it is allowed without comment.
  o.zero.stage = static_cast<int>(cfg.get<int64_t>("zero.stage"));
  o.zero.precision = parse_dtype(cfg.get<std::string>("precision"));
  o.zero.bucket_bytes = cfg.get<int64_t>("zero.bucket_mb") << 20;
  o.loss_scale.initial_scale = static_cast<float>(cfg.get<double>("loss_scale.initial"));
  o.loss_scale.growth_interval = cfg.get<int64_t>("loss_scale.growth_interval");
  o.loss_scale.hysteresis = static_cast<int>(cfg.get<int64_t>("loss_scale.hysteresis"));
  o.loss_scale.min_scale = static_cast<float>(cfg.get<double>("loss_scale.min"));
  if (o.zero.precision == DType::f16 && o.loss_scale.min_scale > o.loss_scale.initial_scale)
    throw ConfigError(cfg, "loss_scale.min", str("may not exceed loss_scale.initial = ", o.loss_scale.initial_scale),
                      str("set loss_scale.min <= ", o.loss_scale.initial_scale, " or raise loss_scale.initial"));
  return p;
}

}  // namespace loom
