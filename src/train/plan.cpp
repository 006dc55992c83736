// A run's config turned into a validated plan: every cross-field rule is
// checked here, before a byte is allocated or a file is read (but the
// headers of an imported checkpoint, init.from, which are validated too).
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>

#include "loom/comm.h"
#include "loom/config.h"
#include "loom/io.h"
#include "loom/memory.h"
#include "loom/planner.h"
#include "loom/train.h"
#include "train/model_json.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

// Where init.from takes the initial weights from: a Hugging Face directory
// ("hf:DIR"), a loom checkpoint (a step directory, or a run directory's
// latest), or neither (a fresh initialization).
struct InitSource {
  std::optional<fs::path> hf;
  std::optional<CheckpointInfo> checkpoint;
};

InitSource init_source(const Config& cfg) {
  const std::string from = cfg.get<std::string>("init.from");
  if (from.empty()) return {};
  try {
    if (std::optional<fs::path> dir = hf_dir_of(from)) return {.hf = dir, .checkpoint = std::nullopt};
  } catch (const Error& e) {
    throw ConfigError(cfg, "init.from", e.what(), "write init.from = \"hf:DIR\"");
  }
  try {
    return {.hf = std::nullopt, .checkpoint = read_checkpoint_info(resolve_checkpoint(from))};
  } catch (const Error& e) {
    throw ConfigError(cfg, "init.from", e.what(),
                      str("name a loom checkpoint (a step directory, or a run directory with 'latest'), or write "
                          "init.from = \"hf:", from, "\" for a Hugging Face one; to continue a loom run, use `loom "
                          "train --resume`"));
  }
}

// The launcher parallel.backend names must be able to start `ranks` ranks from
// how this process was started (or, under a supervisor, exist in this build).
void check_launcher(const Config& cfg, const std::string& backend, int64_t ranks, int64_t model_ranks,
                    Launch launch) {
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
  if (launch == Launch::supervisor) return;
  if (!launched_by_mpirun())
    throw ConfigError(cfg, "parallel.backend",
                      "the mpi backend runs one process per rank, and this process was not started by mpirun",
                      str("start it with `mpirun -np ", ranks, " loom train ...`, or set parallel.backend = \"local\""));
  if (started != ranks)
    throw ConfigError(cfg, "parallel.dp",
                      str("mpirun started ", started,
                          " processes, but the layout has parallel.dp * parallel.tp * "
                          "parallel.pp = ",
                          ranks, " ranks"),
                      str("run `mpirun -np ", ranks, "`",
                          started % model_ranks == 0 ? str(", or set parallel.dp = ", started / model_ranks) : ""));
}

// The entries of a comma-separated list, spaces around each removed (empty
// ones kept, for the caller to judge).
std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> entries;
  for (size_t begin = 0; begin <= text.size();) {
    const size_t end = std::min(text.find(',', begin), text.size());
    std::string_view entry = std::string_view(text).substr(begin, end - begin);
    while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
    while (!entry.empty() && entry.back() == ' ') entry.remove_suffix(1);
    entries.emplace_back(entry);
    begin = end + 1;
  }
  return entries;
}

// parallel.stage_layers: comma-separated layer counts, one per virtual stage,
// held to pipeline_stage_layers' rules (planner.h) so that a bad override is
// reported against its key rather than as the planner's Error.
std::vector<int> parse_stage_layers(const Config& cfg, int64_t n_layer, int64_t virtual_stages, bool balanced_ok) {
  const std::string text = cfg.get<std::string>("parallel.stage_layers");
  const std::string fix = str("set parallel.stage_layers = \"", even_stage_layers(n_layer, virtual_stages), "\"",
                              balanced_ok ? ", or \"\" to balance the stages by cost" : "");
  std::vector<int> layers;
  for (const std::string& entry : comma_list(text)) {
    int count = 0;
    const auto [ptr, ec] = std::from_chars(entry.data(), entry.data() + entry.size(), count);
    if (entry.empty() || ec != std::errc() || ptr != entry.data() + entry.size())
      throw ConfigError(
          cfg, "parallel.stage_layers",
          str("must be comma-separated layer counts, one per virtual stage, and '", entry, "' is not a whole number"),
          fix);
    layers.push_back(count);
  }
  if (static_cast<int64_t>(layers.size()) != virtual_stages)
    throw ConfigError(cfg, "parallel.stage_layers",
                      str("has ", layers.size(), " entries, and parallel.pp * parallel.virtual_stages = ",
                          virtual_stages, " virtual stages need one each"),
                      fix);
  int64_t sum = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 1)
      throw ConfigError(cfg, "parallel.stage_layers",
                        str("gives virtual stage ", i, " ", layers[i], " layers, and every stage needs at least one"),
                        fix);
    sum += layers[i];
  }
  if (sum != n_layer)
    throw ConfigError(cfg, "parallel.stage_layers", str("sums to ", sum, " layers, and model.n_layer = ", n_layer),
                      fix);
  return layers;
}

// The tensor-, sequence- and pipeline-parallel options of a layout that
// check_layout accepted, with parallel.stage_layers parsed.
ModelParallelOptions plan_model_parallel(const Config& cfg, const TrainPlan& p, const Layout& layout) {
  ModelParallelOptions mp;
  mp.sequence_parallel = layout.sequence_parallel;
  mp.schedule = layout.schedule;
  mp.virtual_stages = static_cast<int>(layout.virtual_stages);
  const int64_t stages = layout.pp * layout.virtual_stages;
  const bool interleaved = layout.schedule == PipelineSchedule::interleaved_1f1b;
  if (!cfg.get<std::string>("parallel.stage_layers").empty())
    mp.stage_layers = parse_stage_layers(cfg, p.model.n_layer, stages, !interleaved || p.model.n_layer % stages == 0);
  return mp;
}

// memory.* as MemoryOptions, held to the rules that tie them to each other
// (those that tie them to the layout are check_layout's). `p` holds the
// layout and the batch.
MemoryOptions plan_memory_options(const Config& cfg, const TrainPlan& p) {
  MemoryOptions m;
  const std::string policy_name = cfg.get<std::string>("memory.policy");
  m.policy = parse_memory_policy(policy_name);
  m.offload_param_frac = cfg.get<double>("memory.offload_param_frac");
  m.offload_optim_frac = cfg.get<double>("memory.offload_optim_frac");
  m.nvme_dir = cfg.get<std::string>("memory.nvme_dir");
  m.nvme_io_uring = cfg.get<bool>("memory.nvme_io_uring");
  m.prefetch = static_cast<int>(cfg.get<int64_t>("memory.prefetch"));
  m.micro_batches = p.accumulation;
  const size_t chunk_bytes = cfg.get_bytes("memory.chunk_bytes");
  if (chunk_bytes > static_cast<size_t>(std::numeric_limits<int64_t>::max()))
    throw ConfigError(cfg, "memory.chunk_bytes", "is the capacity of one chunk and cannot be unlimited",
                      "set memory.chunk_bytes = 0 (the size that wastes least is searched) or a size such as \"4MiB\"");
  m.chunk_bytes = static_cast<int64_t>(chunk_bytes);

  const char* const fractions[] = {"memory.offload_param_frac", "memory.offload_optim_frac"};
  if (m.policy == MemoryPolicy::none) {
    // Without a policy there are no chunks: these keys would be ignored.
    for (const char* key : fractions)
      if (cfg.get<double>(key) > 0)
        throw ConfigError(cfg, key,
                          "applies only under memory.policy = \"static\", and memory.policy = \"none\" keeps all "
                          "model state on the device",
                          str("set memory.policy = \"static\", or ", key, " = 0"));
    if (!m.nvme_dir.empty())
      throw ConfigError(cfg, "memory.nvme_dir",
                        "applies only under memory.policy = \"static\" or \"auto\", and memory.policy = \"none\" "
                        "keeps all model state on the device",
                        "set memory.policy = \"static\" or \"auto\", or memory.nvme_dir = \"\"");
    if (m.chunk_bytes != 0)
      throw ConfigError(cfg, "memory.chunk_bytes",
                        "applies only under memory.policy = \"static\" or \"auto\", and memory.policy = \"none\" "
                        "packs no chunks",
                        "set memory.policy = \"static\" or \"auto\", or memory.chunk_bytes = 0");
    return m;
  }

  if (m.policy != MemoryPolicy::fixed)
    for (const char* key : fractions)
      if (cfg.get<double>(key) > 0)
        throw ConfigError(cfg, key,
                          str("applies only under memory.policy = \"static\", and memory.policy = \"", policy_name,
                              "\" places the chunks itself"),
                          str("set ", key, " = 0, or memory.policy = \"static\""));
  if (!m.nvme_dir.empty()) {
    const std::string or_host = "or set memory.nvme_dir = \"\" to keep the offloaded state in host memory";
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(m.nvme_dir, ec);
    if (!std::filesystem::exists(st))
      throw ConfigError(cfg, "memory.nvme_dir",
                        "must be an existing directory for the NVMe tier's scratch files, and it does not exist",
                        str("create it (mkdir -p ", m.nvme_dir.string(), "), ", or_host));
    if (!std::filesystem::is_directory(st))
      throw ConfigError(cfg, "memory.nvme_dir",
                        "must be an existing directory for the NVMe tier's scratch files, and it is not a directory",
                        str("point memory.nvme_dir at a directory, ", or_host));
    if (::access(m.nvme_dir.c_str(), W_OK | X_OK) != 0)
      throw ConfigError(cfg, "memory.nvme_dir",
                        "must be a directory this process can create the NVMe tier's scratch files in, and it is "
                        "not writable",
                        str("make it writable, ", or_host));
  }
  return m;
}

// memory.chunk_bytes against the largest parameter, which a chunk holds
// whole: the rule is on the capacity plan_memory will use (chunk_capacity).
void check_chunk_bytes(const Config& cfg, const StepMemoryOptions& step, int64_t dp, const ParamLayout& layout) {
  const int64_t chunk_bytes = step.memory.chunk_bytes;
  if (chunk_bytes == 0) return;
  const int64_t element = static_cast<int64_t>(dtype_size(step.precision));
  const int64_t capacity = chunk_capacity(chunk_bytes, step.precision, static_cast<int>(dp));
  const ParamSpec* largest = &layout.param(0);
  for (const ParamSpec& spec : layout.params())
    if (spec.numel() > largest->numel()) largest = &spec;
  if (capacity < largest->numel())
    throw ConfigError(cfg, "memory.chunk_bytes",
                      str("must hold the largest parameter whole, ", largest->name, " of ", largest->numel(),
                          " elements = ", largest->numel() * element, " bytes in ", cfg.get<std::string>("precision")),
                      str("set memory.chunk_bytes >= ", largest->numel() * element, ", or 0 (searched)"));
}

}  // namespace

void check_memory_policy_fits(const Config& cfg, const GPTConfig& model, const Layout& layout,
                              const StepMemoryOptions& step, const std::vector<std::string>& freeze,
                              const TierBytes& budgets) {
  // GPT's constructor declares the layout and allocates no parameters.
  const GPT whole(model);
  check_chunk_bytes(cfg, step, layout.dp, whole.layout());
  // What the step holds on the device besides the chunk stores, which
  // plan_memory places itself: the planner's memory model, the one the
  // layout search uses (activations, temporaries, LoRA's frozen base).
  const double beside_chunks = device_bytes_beside_chunks(layout_problem_of(cfg, model), layout, step);
  // Parameters train.freeze freezes besides the model's own stay out of the
  // chunks too: on the device in the working precision, and below fp32 two
  // groups of them at a time also in fp32 while acquired (FrozenParamStore).
  const std::vector<bool> frozen = frozen_params(whole.layout(), freeze);
  const int64_t precision_bytes = static_cast<int64_t>(dtype_size(step.precision));
  std::vector<int64_t> frozen_per_group(static_cast<size_t>(whole.layout().num_groups()), 0);
  int64_t frozen_bytes = 0;
  for (size_t id = 0; id < frozen.size(); ++id) {
    const ParamSpec& param = whole.layout().params()[id];
    if (frozen[id] && param.trainable) {
      frozen_bytes += param.numel() * precision_bytes;
      frozen_per_group[static_cast<size_t>(param.group)] += param.numel();
    }
  }
  if (step.precision != DType::f32) {
    std::sort(frozen_per_group.rbegin(), frozen_per_group.rend());
    for (size_t g = 0; g < std::min<size_t>(2, frozen_per_group.size()); ++g) frozen_bytes += 4 * frozen_per_group[g];
  }
  const bool any_frozen = std::find(frozen.begin(), frozen.end(), true) != frozen.end();
  plan_memory(any_frozen ? trainable_layout(whole.layout(), frozen) : whole.layout(), step.memory, step.precision,
              static_cast<int>(layout.dp), static_cast<int64_t>(std::ceil(beside_chunks)) + frozen_bytes, budgets);
}

namespace {

// Whether the model state and the step fit the memory budgets under the
// placement the chunk manager will start from, from shapes alone (memory.h,
// plan_memory): a run that cannot fit fails here, before anything is
// allocated. Throws plan_memory's Error, which names the tier, what it needs
// and its budget.
void check_memory_fits(const Config& cfg, const TrainPlan& p) {
  StepMemoryOptions step;
  step.precision = p.options.zero.precision;
  step.bucket_bytes = p.options.zero.bucket_bytes;
  step.memory = p.options.memory;
  auto budget = [&](std::string_view key) {
    return static_cast<int64_t>(std::min(cfg.get_bytes(key), static_cast<size_t>(std::numeric_limits<int64_t>::max())));
  };
  TierBytes budgets;
  budgets[Tier::device] = budget("memory.device_budget");
  budgets[Tier::host] = budget("memory.host_budget");
  budgets[Tier::nvme] = std::numeric_limits<int64_t>::max();
  check_memory_policy_fits(cfg, p.model, layout_of(cfg), step, p.options.freeze, budgets);
}

}  // namespace

Layout layout_of(const Config& cfg) {
  return Layout{.dp = cfg.get<int64_t>("parallel.dp"),
                .tp = cfg.get<int64_t>("parallel.tp"),
                .pp = cfg.get<int64_t>("parallel.pp"),
                .tp_mode = parse_tensor_parallel_mode(cfg.get<std::string>("parallel.tp_mode")),
                .tp_depth = cfg.get<int64_t>("parallel.tp_depth"),
                .sequence_parallel = cfg.get<bool>("parallel.sequence_parallel"),
                .schedule = parse_pipeline_schedule(cfg.get<std::string>("parallel.schedule")),
                .virtual_stages = cfg.get<int64_t>("parallel.virtual_stages"),
                .micro_batch = cfg.get<int64_t>("train.micro_batch_size"),
                .zero_stage = static_cast<int>(cfg.get<int64_t>("zero.stage")),
                .recompute = cfg.get<bool>("train.activation_checkpointing"),
                .memory_policy = parse_memory_policy(cfg.get<std::string>("memory.policy"))};
}

LayoutProblem layout_problem_of(const Config& cfg, const GPTConfig& model) {
  return LayoutProblem{.model = model,
                       .global_batch = cfg.get<int64_t>("train.batch_size"),
                       .seq_len = cfg.get<int64_t>("train.seq_len"),
                       .stage_layers_given = !cfg.get<std::string>("parallel.stage_layers").empty(),
                       .model_shape_settable = cfg.get<std::string>("model.preset") == "custom"};
}

namespace {

// init.from's model `m` (described by `source`), which the model.* keys a
// user set may repeat but not contradict.
GPTConfig imported_model_config(const Config& cfg, GPTConfig m, const std::string& source) {
  if (!cfg.is_default("model.preset") && cfg.get<std::string>("model.preset") != "custom")
    throw ConfigError(cfg, "model.preset", str("contradicts init.from: the model is the one ", source, " describes"),
                      "remove model.preset or set it to \"custom\" (configs/finetune-hf.toml sets none)");
  // A key the user set contradicts the checkpoint when setting it changes
  // the model it describes.
  const nlohmann::json keys = cfg.to_json().at("model"), imported = model_json(m);
  for (const auto& [name, value] : keys.items()) {
    const std::string key = "model." + name;
    if (!imported.contains(name) || name == "dropout" || cfg.is_default(key)) continue;
    if (!(model_from_json({{name, value}}, m) == m))
      throw ConfigError(cfg, key, str("contradicts ", source, ", which gives ", imported.at(name).dump()),
                        str("remove ", key, " or set it to ", imported.at(name).dump(),
                            " (configs/finetune-hf.toml sets no model shape: the checkpoint's is used)"));
  }
  m.dropout = static_cast<float>(cfg.get<double>("model.dropout"));
  m.validate();
  return m;
}

}  // namespace

GPTConfig model_config_from(const Config& cfg) {
  GPTConfig m;
  const InitSource init = init_source(cfg);
  if (init.hf) {
    m = imported_model_config(cfg, gpt_config_from_hf(read_hf_config(*init.hf), *init.hf),
                              (*init.hf / "config.json").string());
  } else if (init.checkpoint) {
    m = imported_model_config(cfg, checkpoint_model_config(*init.checkpoint),
                              (init.checkpoint->dir / kManifestFile).string());
  } else {
    const std::string preset = cfg.get<std::string>("model.preset");
    m = preset == "custom" ? model_from_json(cfg.to_json().at("model")) : GPTConfig::preset(preset);
    m.dropout = static_cast<float>(cfg.get<double>("model.dropout"));
  }
  // Adapters go on any model, a fresh one or an imported one.
  m.lora.r = cfg.get<int64_t>("lora.r");
  m.lora.alpha = static_cast<float>(cfg.get<double>("lora.alpha"));
  m.lora.dropout = static_cast<float>(cfg.get<double>("lora.dropout"));
  for (const std::string& t : comma_list(cfg.get<std::string>("lora.targets")))
    if (!t.empty()) m.lora.targets.push_back(t);
  m.validate();
  return m;
}

namespace {

// trace.path and trace.steps: a well-formed range inside the run, and a path
// that holds nothing yet (the trace never replaces a file silently).
void plan_trace(const Config& cfg, TrainPlan& p) {
  const std::string steps = cfg.get<std::string>("trace.steps");
  const std::optional<TraceSteps> parsed = TraceSteps::parse(steps);
  if (!parsed)
    throw ConfigError(cfg, "trace.steps", str("must be one step \"N\" or an inclusive range \"FIRST-LAST\" with ",
                                              "1 <= FIRST <= LAST, not \"", steps, "\""),
                      "write e.g. trace.steps = \"2-4\" (step 1 warms caches) or \"3\"");
  p.trace_steps = *parsed;
  p.trace_path = cfg.get<std::string>("trace.path");
  if (p.trace_path.empty()) return;
  if (p.trace_steps.first > p.steps)
    throw ConfigError(cfg, "trace.steps", str("starts after the run's last step (train.steps = ", p.steps, ")"),
                      str("trace steps up to ", p.steps, ", e.g. trace.steps = \"", p.steps, "\""));
  std::error_code ec;
  if (fs::exists(p.trace_path, ec))
    throw ConfigError(cfg, "trace.path", str("'", p.trace_path.string(), "' already exists"),
                      "remove it, or set trace.path to a new file");
  const fs::path dir = p.trace_path.parent_path();
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw ConfigError(cfg, "trace.path", str("its directory '", dir.string(), "' does not exist"),
                      "create it, or set trace.path to a file in an existing directory");
}

// distill.*: the teacher's model, read from its checkpoint's config (its
// tensors are read by the ranks once the trainer is built), checked against
// the model and the layout.
void plan_distillation(const Config& cfg, TrainPlan& p) {
  p.distill_teacher = cfg.get<std::string>("distill.teacher");
  if (p.distill_teacher.empty()) return;
  DistillOptions d;
  try {
    d.teacher = teacher_model_config(p.distill_teacher);
  } catch (const Error& e) {
    throw ConfigError(cfg, "distill.teacher", e.what(),
                      "give a loom checkpoint directory (or its run directory) or \"hf:DIR\"");
  }
  d.loss.temperature = static_cast<float>(cfg.get<double>("distill.temperature"));
  d.loss.alpha = static_cast<float>(cfg.get<double>("distill.alpha"));
  check_distillation(p.model, d, p.pp);
  p.options.distill = d;
}

}  // namespace

std::unique_ptr<DeviceMesh> plan_mesh(const TrainPlan& plan, Communicator& world) {
  if (plan.tp == 1 && plan.pp == 1) return nullptr;
  MeshShape shape;
  shape[MeshAxis::dp] = static_cast<int>(plan.dp);
  shape[MeshAxis::tp] = static_cast<int>(plan.tp);
  shape[MeshAxis::pp] = static_cast<int>(plan.pp);
  return std::make_unique<DeviceMesh>(world, shape, plan.tensor_grid);
}

TrainPlan plan_training(const Config& cfg, Launch launch) {
  TrainPlan p;
  p.model = model_config_from(cfg);
  const InitSource init = init_source(cfg);
  if (init.hf) {
    // Every tensor is checked against config.json before the run allocates.
    const HFImport checked(*init.hf);
    p.init_hf = *init.hf;
    if (std::optional<fs::path> tokenizer = hf_tokenizer_file(*init.hf)) p.init_tokenizer = *tokenizer;
  } else if (init.checkpoint) {
    p.init_checkpoint = init.checkpoint->dir;
    p.init_tokenizer = init.checkpoint->fields.value("tokenizer", std::string());
    // A pruned model fine-tunes with its zeros kept (docs/pruning.md).
    p.options.adamw.keep_zeros = pruned_params(*init.checkpoint);
  }
  p.steps = cfg.get<int64_t>("train.steps");
  p.global_batch = cfg.get<int64_t>("train.batch_size");
  p.micro_batch = cfg.get<int64_t>("train.micro_batch_size");
  p.seq_len = cfg.get<int64_t>("train.seq_len");
  p.out_dir = cfg.get<std::string>("train.out_dir");

  const int64_t dp = cfg.get<int64_t>("parallel.dp"), tp = cfg.get<int64_t>("parallel.tp"),
                pp = cfg.get<int64_t>("parallel.pp");
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  const int64_t ranks = dp * tp * pp;
  const int64_t nproc = cfg.get<int64_t>("parallel.nproc");
  if (nproc != 0 && nproc != ranks)
    throw ConfigError(cfg, "parallel.nproc",
                      str("must be 0 or parallel.dp * parallel.tp * parallel.pp = ", dp, " * ", tp, " * ", pp, " = ",
                          ranks, " (one rank each)"),
                      str("set parallel.nproc = 0 (it follows the layout) or ", ranks,
                          nproc % (tp * pp) == 0 ? str(", or parallel.dp = ", nproc / (tp * pp)) : ""));
  p.nproc = static_cast<int>(ranks);
  p.backend = cfg.get<std::string>("parallel.backend");
  check_launcher(cfg, p.backend, ranks, tp * pp, launch);
  const double watchdog = cfg.get<double>("train.watchdog_timeout");
  // The watchdog samples every tenth of its timeout: below 0.1 s it would
  // wake more often than every 10 ms and trip on scheduling noise.
  if (watchdog > 0 && watchdog < 0.1)
    throw ConfigError(cfg, "train.watchdog_timeout", str("is ", watchdog, " s, shorter than the 0.1 s minimum"),
                      "set train.watchdog_timeout to at least a few seconds, or to 0 to turn the watchdog off");
  p.watchdog_timeout = std::chrono::milliseconds(std::llround(watchdog * 1000.0));

  if (p.seq_len > p.model.block_size)
    throw ConfigError(cfg, "train.seq_len", str("may not exceed the model's context block_size = ", p.model.block_size),
                      str("set train.seq_len <= ", p.model.block_size, " or raise model.block_size"));
  const Layout layout = layout_of(cfg);
  if (const std::optional<LayoutViolation> broken = check_layout(layout_problem_of(cfg, p.model), layout))
    throw ConfigError(cfg, broken->key, broken->problem, broken->fix);
  p.accumulation = p.global_batch / (dp * p.micro_batch);
  p.tensor_grid = tensor_grid_shape(layout.tp_mode, layout.tp, layout.tp_depth);
  // A tokenizer beside an imported checkpoint replaces data.vocab_size's (the
  // run checks it against the model once the data is prepared).
  if (p.init_tokenizer.empty() && cfg.get<int64_t>("data.vocab_size") > p.model.vocab_size)
    throw ConfigError(cfg, "data.vocab_size",
                      str("the tokenizer's vocabulary may not exceed model.vocab_size = ", p.model.vocab_size),
                      p.init_hf.empty() ? str("set model.vocab_size >= ", cfg.get<int64_t>("data.vocab_size"),
                                              " or lower data.vocab_size")
                                        : str("set data.vocab_size <= ", p.model.vocab_size, " (the vocab_size of ",
                                              (p.init_hf / "config.json").string(),
                                              "), or place the checkpoint's tokenizer beside it"));
  p.options.model_parallel = plan_model_parallel(cfg, p, layout);

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
  o.max_skipped_steps = cfg.get<int64_t>("train.max_skipped_steps");
  o.skip_spike_factor = cfg.get<double>("train.skip_spike_factor");
  if (o.skip_spike_factor > 0.0 && o.skip_spike_factor <= 1.0)
    throw ConfigError(cfg, "train.skip_spike_factor",
                      "must be 0 (off) or above 1: at 1 or less every loss above the running mean would be skipped",
                      "set train.skip_spike_factor = 0, or a factor such as 3");
  if (o.skip_spike_factor > 0.0 && o.max_skipped_steps == 0)
    throw ConfigError(cfg, "train.skip_spike_factor",
                      "skips diverging steps, which train.max_skipped_steps = 0 turns off",
                      "set train.max_skipped_steps to the skipped steps in a row that stop the run, e.g. 5");
  o.checkpoint_activations = cfg.get<bool>("train.activation_checkpointing");
  o.seed = static_cast<uint64_t>(cfg.get<int64_t>("train.seed"));

  // zero.stage > 0 with one rank shards over a group of one: the same as
  // stage 0, so it is allowed without comment.
  o.zero.stage = static_cast<int>(cfg.get<int64_t>("zero.stage"));
  o.zero.precision = parse_dtype(cfg.get<std::string>("precision"));
  o.zero.bucket_bytes = cfg.get<int64_t>("zero.bucket_mb") << 20;
  o.memory = plan_memory_options(cfg, p);
  o.loss_scale.initial_scale = static_cast<float>(cfg.get<double>("loss_scale.initial"));
  o.loss_scale.growth_interval = cfg.get<int64_t>("loss_scale.growth_interval");
  o.loss_scale.hysteresis = static_cast<int>(cfg.get<int64_t>("loss_scale.hysteresis"));
  o.loss_scale.min_scale = static_cast<float>(cfg.get<double>("loss_scale.min"));
  if (o.zero.precision == DType::f16 && o.loss_scale.min_scale > o.loss_scale.initial_scale)
    throw ConfigError(cfg, "loss_scale.min", str("may not exceed loss_scale.initial = ", o.loss_scale.initial_scale),
                      str("set loss_scale.min <= ", o.loss_scale.initial_scale, " or raise loss_scale.initial"));
  if (o.memory.policy != MemoryPolicy::none) check_memory_fits(cfg, p);
  plan_trace(cfg, p);
  plan_distillation(cfg, p);
  return p;
}

}  // namespace loom
