// Runs a small GPT under a parallel layout (data parallel with ZeRO, and
// tensor/pipeline parallel on a mesh) and under the single-rank reference, on
// the same global batches, for the zero and model-parallel suites.
#pragma once

#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/parallel.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom::testing {

struct DataParallelRun {
  int dp = 1;             // ranks; 0 = the single-rank reference (no communicator)
  int stage = 0;
  DType precision = DType::f32;
  int accumulation = 1;   // micro-batches per rank per step
  float dropout = 0.0f;
  int steps = 20;
  std::function<void(int step, GradStore&)> on_gradients;  // on every rank
  // Model parallelism: with tp or pp > 1 (or mesh) the Trainer runs on a
  // dp x pp x tp mesh.
  int tp = 1, pp = 1;
  TensorGridShape grid;  // the tp ranks' 2D/2.5D grid ({1, 1}: 1D)
  bool mesh = false;
  bool checkpoint_activations = false;
  ModelParallelOptions model_parallel;
  int n_layer = 2, n_head = 2;
  // Turns small_gpt's GPT-2 into another variant of the model (LLaMA's).
  std::function<void(GPTConfig&)> model_variant;
  // Chunk placement (memory.h) and the per-rank budgets it runs under.
  MemoryOptions memory;
  size_t device_budget = kUnlimited, host_budget = kUnlimited;
  // Shows that a comparison catches a faulty reduction: the floating-point
  // sums of this axis's group are doubled (CommOptions::test_double_sums).
  std::optional<MeshAxis> doubled_sums;
  // Masks most targets of the first half of each global batch and few of the
  // second (as prompts of fine-tuning data do), so the ranks hold unequal
  // numbers of targets.
  bool masked_targets = false;
  // Another model than small_gpt, and what each rank does once its Trainer
  // is built (an imported checkpoint's weights); RunResult::initial_params
  // then holds the state it left.
  std::optional<GPTConfig> model;
  std::function<void(Trainer&)> init;
  std::vector<std::string> freeze;  // TrainOptions::freeze
  std::vector<std::string> keep_zeros;  // AdamWConfig::keep_zeros
  LoRAConfig lora;                  // the model's adapters
  std::optional<DistillOptions> distill;  // TrainOptions::distill
  bool uses_mesh() const { return mesh || tp > 1 || pp > 1; }
};

struct RunResult {
  GPTConfig model;
  std::vector<StepStats> stats;  // rank 0's, per step
  std::vector<float> params;     // the final weights (master weights), layout order
  std::vector<float> exp_avg, exp_avg_sq;
  std::vector<float> grads;  // step 0's reduced gradient (Trainer::gather_gradients)
  std::vector<float> initial_params;  // after DataParallelRun::init, when given
  MemoryReport memory;  // rank 0's, after the last step
  ChunkPlacement placement;  // rank 0's final placement under a memory policy
};

inline DataParallelRun layout(int dp, int stage, DType precision = DType::f32, int accumulation = 1) {
  DataParallelRun r;
  r.dp = dp;
  r.stage = stage;
  r.precision = precision;
  r.accumulation = accumulation;
  return r;
}

// A layout and its name, for suites parameterized over layouts.
struct NamedLayout {
  std::string name;
  DataParallelRun run;
};

// gtest prints a parameter by its name.
inline std::ostream& operator<<(std::ostream& os, const NamedLayout& l) { return os << l.name; }

// One layout of every store family: dp 2 under ZeRO stages 0-3, tp 2, and
// chunk placement over dp 2 with half the parameters and all the optimizer
// state offloaded.
inline std::vector<NamedLayout> store_family_layouts() {
  std::vector<NamedLayout> v;
  for (int stage : {0, 1, 2, 3}) v.push_back({"dp2_stage" + std::to_string(stage), layout(2, stage)});
  DataParallelRun tp = layout(1, 0);
  tp.tp = 2;
  v.push_back({"tp2", tp});
  DataParallelRun chunks = layout(2, 3);
  chunks.memory.policy = MemoryPolicy::fixed;
  chunks.memory.offload_param_frac = 0.5;
  chunks.memory.offload_optim_frac = 1.0;
  v.push_back({"dp2_chunks_offloaded", chunks});
  return v;
}

inline GPTConfig small_gpt(float dropout, int n_layer = 2, int n_head = 2) {
  GPTConfig c;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = 32;
  c.vocab_size = 61;  // odd sizes make every bucket need padding
  c.block_size = 16;
  c.dropout = dropout;
  return c;
}

// DataParallelRun::model_variant turning small_gpt into a LLaMA (RMSNorm,
// RoPE, SwiGLU of an intermediate size that is not 4C, q, k, v apart, no
// biases, an untied head) with n_kv_head kv heads.
inline std::function<void(GPTConfig&)> llama_variant(int n_kv_head) {
  return [n_kv_head](GPTConfig& c) {
    const GPTConfig tiny = GPTConfig::preset("llama-tiny");
    c.norm = tiny.norm;
    c.positions = tiny.positions;
    c.mlp = tiny.mlp;
    c.packed_qkv = tiny.packed_qkv;
    c.attention_bias = c.mlp_bias = c.tied_embeddings = false;
    c.intermediate_size = 72;
    c.n_kv_head = n_kv_head;
  };
}

// A model of about 10.6M parameters, for model-state bytes per rank.
inline GPTConfig ten_million() {
  GPTConfig c;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = 448;
  c.vocab_size = 2048;
  c.block_size = 32;
  return c;
}

inline TrainOptions small_options(const DataParallelRun& r) {
  TrainOptions o;
  o.schedule = {1e-3f, 1e-4f, 3, r.steps};
  o.zero.stage = r.stage;
  o.zero.precision = r.precision;
  o.zero.bucket_bytes = 8192;  // several buckets even in this small model
  o.checkpoint_activations = r.checkpoint_activations;
  o.model_parallel = r.model_parallel;
  o.memory = r.memory;
  o.memory.micro_batches = r.accumulation;
  o.freeze = r.freeze;
  o.distill = r.distill;
  o.adamw.keep_zeros = r.keep_zeros;
  return o;
}

// The global batch of every step: kGlobal sequences of kT tokens, the same
// whatever the layout. Rank r's m-th micro-batch holds the sequences
// [(m * dp + r) * micro, ... + micro).
constexpr int64_t kGlobal = 8, kT = 16;

inline std::vector<int32_t> step_tokens(int step, int64_t vocab) {
  return random_tokens(kGlobal * kT + 1, vocab, 1000 + static_cast<uint64_t>(step));
}

inline std::vector<MicroBatch> rank_micro_batches(const std::vector<int32_t>& data, int dp, int rank, int accumulation) {
  const int64_t micro = kGlobal / (dp * accumulation);
  std::vector<MicroBatch> mbs;
  for (int m = 0; m < accumulation; ++m) {
    const int64_t first = (m * dp + rank) * micro;
    mbs.push_back({data.data() + first * kT, data.data() + first * kT + 1, {micro, kT}, first});
  }
  return mbs;
}

// The targets of step_tokens with a prompt of 13 positions masked (-1) in
// each of the first kGlobal / 2 sequences and of 2 in the others.
inline std::vector<int32_t> masked_targets(const std::vector<int32_t>& data) {
  std::vector<int32_t> targets(data.begin() + 1, data.end());
  for (int64_t s = 0; s < kGlobal; ++s)
    for (int64_t j = 0; j < (s < kGlobal / 2 ? 13 : 2); ++j) targets[static_cast<size_t>(s * kT + j)] = -1;
  return targets;
}

inline std::vector<float> to_vector(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

// The dp x pp x tp mesh of `r` over `world`, or nullptr when it uses none.
inline std::unique_ptr<DeviceMesh> mesh_of(Communicator* world, const DataParallelRun& r) {
  if (!r.uses_mesh()) return nullptr;
  MeshShape shape;
  shape[MeshAxis::dp] = r.dp;
  shape[MeshAxis::tp] = r.tp;
  shape[MeshAxis::pp] = r.pp;
  return std::make_unique<DeviceMesh>(*world, shape, r.grid);
}

// The model `r` trains: small_gpt or r.model, with r's variant and adapters.
inline GPTConfig model_of(const DataParallelRun& r) {
  GPTConfig cfg = r.model ? *r.model : small_gpt(r.dropout, r.n_layer, r.n_head);
  if (r.model_variant) r.model_variant(cfg);
  if (r.lora.enabled()) cfg.lora = r.lora;
  return cfg;
}

// Trains on `comm` (nullptr: the reference); rank 0's figures land in `result`.
inline void train_on(Communicator* comm, const DataParallelRun& r, RunResult& result) {
  // Budgets apply to a context of the run's own (each rank thread already
  // has one; the single-rank run would otherwise change the process's).
  MemoryContext context;
  MemoryContext::Install install(context);
  context.tier(Tier::device).set_budget(r.device_budget);
  context.tier(Tier::host).set_budget(r.host_budget);
  const GPTConfig cfg = model_of(r);
  TrainOptions opts = small_options(r);
  int step = 0;
  Trainer* trainer_of_step = nullptr;
  std::vector<float> grads;
  opts.on_gradients = [&](GradStore& g) {
    if (step == 0) {
      // Gathered on the host, which the run's budget need not hold.
      context.tier(Tier::host).set_budget(kUnlimited);
      grads = to_vector(trainer_of_step->gather_gradients());
      context.tier(Tier::host).set_budget(r.host_budget);
    }
    if (r.on_gradients) r.on_gradients(step, g);
  };
  const std::unique_ptr<DeviceMesh> mesh = mesh_of(comm, r);
  if (r.doubled_sums) {
    std::vector<Communicator*> groups{mesh ? &mesh->group(*r.doubled_sums) : comm};
    // A grid's tensor-parallel communication runs over its own groups.
    if (const TensorGrid* grid = mesh ? mesh->tensor_grid() : nullptr; grid && *r.doubled_sums == MeshAxis::tp)
      groups.insert(groups.end(), {grid->hidden_group, grid->weight_group, grid->depth_group, grid->token_group});
    for (Communicator* group : groups) {
      CommOptions faulty = group->options();
      faulty.test_double_sums = true;
      group->set_options(faulty);
    }
  }
  std::unique_ptr<Trainer> trainer =
      mesh ? std::make_unique<Trainer>(cfg, opts, *mesh) : std::make_unique<Trainer>(cfg, opts, comm);
  trainer_of_step = trainer.get();
  if (r.init) {
    r.init(*trainer);
    context.tier(Tier::host).set_budget(kUnlimited);
    const Trainer::State initial = trainer->gather_state();
    context.tier(Tier::host).set_budget(r.host_budget);
    if (!comm || comm->rank() == 0) result.initial_params = to_vector(initial.params);
  }
  const int dp = mesh ? r.dp : comm ? comm->size() : 1;
  const int rank = mesh ? mesh->coord(MeshAxis::dp) : comm ? comm->rank() : 0;
  std::vector<StepStats> stats;
  for (step = 0; step < r.steps; ++step) {
    const std::vector<int32_t> data = step_tokens(step, cfg.vocab_size);
    std::vector<MicroBatch> micro = rank_micro_batches(data, dp, rank, r.accumulation);
    const std::vector<int32_t> targets = r.masked_targets ? masked_targets(data) : std::vector<int32_t>{};
    if (r.masked_targets)
      for (MicroBatch& mb : micro) mb.targets = targets.data() + (mb.targets - (data.data() + 1));
    stats.push_back(trainer->step(micro));
  }
  const MemoryReport report = trainer->memory_report();
  // The whole state is gathered on the host, which the run's budget need
  // not hold.
  context.tier(Tier::host).set_budget(kUnlimited);
  Trainer::State s = trainer->gather_state();
  if (!comm || comm->rank() == 0) {
    result.memory = report;
    if (r.memory.policy != MemoryPolicy::none) result.placement = trainer->memory_manager()->placement();
    result.model = cfg;
    result.stats = stats;
    result.params = to_vector(s.params);
    result.exp_avg = to_vector(s.exp_avg);
    result.exp_avg_sq = to_vector(s.exp_avg_sq);
    result.grads = std::move(grads);
  }
}

// The run on its ranks of the local backend, or the reference for dp 0.
inline RunResult run_layout(const DataParallelRun& r) {
  RunResult result;
  if (r.dp == 0)
    train_on(nullptr, r, result);
  else
    run_local(r.dp * r.tp * r.pp, [&](Communicator& world) { train_on(&world, r, result); });
  return result;
}

// Largest relative difference of the losses, step by step.
inline double max_loss_rel_diff(const RunResult& a, const RunResult& ref) {
  double worst = 0.0;
  for (size_t s = 0; s < ref.stats.size(); ++s)
    worst = std::max(worst, std::fabs(static_cast<double>(a.stats[s].loss) - ref.stats[s].loss) /
                                std::fabs(static_cast<double>(ref.stats[s].loss)));
  return worst;
}

// Whether flat element i is in the key third of an attention's c_attn.bias.
// That bias does not change the model's function (softmax ignores a shift
// shared by all keys), so its gradient is analytically zero and in floating
// point it is rounding noise of ~1e-12, which Adam scales to updates of about
// lr * 1e-4 whose sign depends on the summation order: its values are not
// comparable between layouts, only bounded (key_bias_max_abs_diff).
inline bool is_key_bias(const ParamLayout& layout, int64_t i) {
  for (const ParamSpec& p : layout.params()) {
    if (i < p.offset || i >= p.offset + p.numel()) continue;
    const int64_t C = p.numel() / 3;
    return p.name.ends_with("attn.c_attn.bias") && i - p.offset >= C && i - p.offset < 2 * C;
  }
  return false;
}

// Parameters compared as one whole-model vector: |a - ref| / |ref| in the L2
// norm, over every element but the key biases.
inline double param_rel_diff(const RunResult& a, const RunResult& ref) {
  GPT model(ref.model);
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    if (is_key_bias(model.layout(), static_cast<int64_t>(i))) continue;
    const double d = static_cast<double>(a.params[i]) - ref.params[i];
    diff += d * d;
    norm += static_cast<double>(ref.params[i]) * ref.params[i];
  }
  return std::sqrt(diff / norm);
}

inline double key_bias_max_abs_diff(const RunResult& a, const RunResult& ref) {
  GPT model(ref.model);
  double worst = 0.0;
  for (size_t i = 0; i < ref.params.size(); ++i)
    if (is_key_bias(model.layout(), static_cast<int64_t>(i)))
      worst = std::max(worst, std::fabs(static_cast<double>(a.params[i]) - ref.params[i]));
  return worst;
}

// The equivalence check of every layout against its reference: the loss and
// the global gradient norm of every step (relative difference), the whole
// parameters after the run (param_rel_diff) and the step-0 gradient of every
// parameter (its largest absolute difference over its largest absolute value
// in the reference), each within `tolerance`. A gradient off by a constant
// factor (a sum where a mean belongs, a reduction applied twice, a tied
// weight counted twice) fails; the message names the worst step and tensor.
inline ::testing::AssertionResult matches_reference(const RunResult& a, const RunResult& ref, double tolerance) {
  if (a.stats.size() != ref.stats.size() || a.grads.size() != ref.grads.size() || ref.grads.empty())
    return ::testing::AssertionFailure() << a.stats.size() << " steps and " << a.grads.size()
                                         << " gradients against the reference's " << ref.stats.size() << " and "
                                         << ref.grads.size();
  const auto rel = [](double x, double r) { return std::fabs(x - r) / std::fabs(r); };
  std::string failures;
  size_t loss_step = 0, norm_step = 0;
  for (size_t s = 0; s < ref.stats.size(); ++s) {
    if (rel(a.stats[s].loss, ref.stats[s].loss) > rel(a.stats[loss_step].loss, ref.stats[loss_step].loss)) loss_step = s;
    if (rel(a.stats[s].grad_norm, ref.stats[s].grad_norm) >
        rel(a.stats[norm_step].grad_norm, ref.stats[norm_step].grad_norm))
      norm_step = s;
  }
  const double loss = rel(a.stats[loss_step].loss, ref.stats[loss_step].loss);
  if (!(loss <= tolerance))
    failures += str("\n  loss of step ", loss_step, ": ", a.stats[loss_step].loss, " vs ", ref.stats[loss_step].loss,
                    " (relative difference ", loss, ")");
  const double norm = rel(a.stats[norm_step].grad_norm, ref.stats[norm_step].grad_norm);
  if (!(norm <= tolerance))
    failures += str("\n  gradient norm of step ", norm_step, ": ", a.stats[norm_step].grad_norm, " vs ",
                    ref.stats[norm_step].grad_norm, " (relative difference ", norm, ")");
  const double params = param_rel_diff(a, ref);
  if (!(params <= tolerance)) failures += str("\n  final parameters: relative L2 difference ", params);
  GPT model(ref.model);
  double worst = -1.0;
  std::string worst_name;
  for (const ParamSpec& p : model.layout().params()) {
    double diff = 0.0, scale = 0.0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
      const size_t k = static_cast<size_t>(i);
      diff = std::max(diff, std::fabs(static_cast<double>(a.grads[k]) - ref.grads[k]));
      scale = std::max(scale, std::fabs(static_cast<double>(ref.grads[k])));
    }
    // A frozen parameter's gradient is zero in both.
    const double d = diff == 0.0 ? 0.0 : diff / scale;
    if (!(d <= worst)) {
      worst = d;
      worst_name = str(p.name, " (max abs difference ", diff, ", max abs ", scale, ")");
    }
  }
  if (!(worst <= tolerance))
    failures += str("\n  step-0 gradient of ", worst_name, ": ", worst, " of its scale");
  if (failures.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "differs from the reference beyond " << tolerance << ":" << failures;
}

}  // namespace loom::testing
