// loom train: the training step (micro-batches, gradient accumulation,
// clipping, AdamW) on top of the model and the stores.
#pragma once

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/hf.h"
#include "loom/memory.h"
#include "loom/nn.h"
#include "loom/optim.h"
#include "loom/parallel.h"
#include "loom/planner.h"
#include "loom/store.h"
#include "loom/trace.h"
#include "loom/zero.h"

namespace loom {

// How a model is cut over the tensor- and pipeline-parallel axes of a mesh.
struct ModelParallelOptions {
  bool sequence_parallel = false;  // split the non-tensor-parallel regions by token (needs tp > 1)
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;  // model chunks per pipeline rank; > 1 only with interleaved_1f1b
  // Layers of each virtual stage in order (pp * virtual_stages entries summing
  // to n_layer); empty: balanced by the cost estimate (pipeline_layer_costs).
  std::vector<int> stage_layers;
};

// Knowledge distillation: the student trains with DistillationLoss against
// the logits of a frozen teacher, a second model of the same vocabulary run
// forward in the same micro-batch, placed as the student is (its own copy on
// every data-parallel rank, split over the same tensor-parallel ranks; not
// with pipeline parallelism).
struct DistillOptions {
  GPTConfig teacher;
  Distillation loss;  // temperature, alpha
};

struct TrainOptions {
  AdamWConfig adamw;
  LRSchedule schedule;
  float grad_clip = 1.0f;  // global-norm clipping; 0 turns it off
  bool checkpoint_activations = false;
  uint64_t seed = 1337;  // initialization and dropout
  // Data parallelism and precision; anything but stage 0 in fp32 needs a
  // data-parallel communicator (a group of one will do).
  ZeroOptions zero;
  LossScaleOptions loss_scale;  // fp16 only
  ModelParallelOptions model_parallel;  // used by the mesh constructor
  // Chunk-based placement over the device, host and NVMe tiers (memory.h);
  // any policy but none replaces the ZeRO stores with chunk stores, sharded
  // over dp as ZeRO-3 is. Not with tensor or pipeline parallelism.
  MemoryOptions memory;
  // Parameters to freeze besides those the model freezes itself (LoRA's
  // base weights): each entry names a parameter ("h.0.mlp.c_fc.weight") or
  // every parameter under a module ("h.0", "h.1.attn"). Frozen parameters
  // keep their values and have no gradient and no optimizer state
  // (FrozenParams, store.h).
  std::vector<std::string> freeze;
  // Called on every rank once the step's gradients are reduced, before they
  // are checked and applied (tests inject faults here).
  std::function<void(GradStore&)> on_gradients;
  // A diverging loss. With max_skipped_steps > 0 a step whose loss is not
  // finite, whose gradient is not (fp32, bf16; fp16's overflows are the loss
  // scaler's), or whose loss exceeds skip_spike_factor times the running
  // mean (LossWatch; 0: no spike test) applies no update, on every rank
  // alike; that many such steps in a row throw Error. 0: a non-finite loss
  // or gradient throws at once and no spike is looked for.
  int64_t max_skipped_steps = 0;
  double skip_spike_factor = 0.0;
  // Distillation; its teacher's weights start as TrainOptions::seed draws
  // them until Trainer::load_teacher_weights.
  std::optional<DistillOptions> distill;
};

// Why a step applied no update.
enum class StepSkip : uint8_t { none, overflow, non_finite_loss, non_finite_gradient, loss_spike };
const char* step_skip_name(StepSkip skip);  // "overflow", "non-finite loss", ...

// The losses of the steps that applied an update, as the diverging-loss test
// sees them: their running mean (the plain mean of the first kWindow, then an
// exponential average weighing each new loss 1/kWindow, about the last
// kWindow steps) and the diverging steps skipped since the last update. Every
// rank holds the same: the loss is reduced over the whole batch.
struct LossWatch {
  static constexpr int64_t kWindow = 10;
  double mean = 0.0;
  int64_t steps = 0;            // losses in the mean
  int64_t skipped_in_a_row = 0;  // diverging steps since the last update
  void add(double loss) {
    ++steps;
    mean += (loss - mean) / static_cast<double>(std::min(steps, kWindow));
  }
};

// Which parameters of `layout` a run freezes (TrainOptions::freeze): those
// the model freezes itself (ParamSpec::trainable false) and those `freeze`
// names, by id.
std::vector<bool> frozen_params(const ParamLayout& layout, const std::vector<std::string>& freeze);

// One micro-batch of the global batch, B sequences of T tokens.
struct MicroBatch {
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  BatchShape shape;
  int64_t first_sequence = 0;  // global index of its first sequence, for dropout masks
};

struct StepStats {
  float loss = 0.0f;       // mean over the global batch's target tokens
  // The loss's parts, each a mean as `loss` (Loss::term_names() after the
  // first: distillation's kl and ce), by name; empty for cross-entropy.
  std::vector<std::pair<std::string_view, double>> loss_parts;
  double grad_norm = 0.0;  // before clipping (unscaled); not finite when skipped
  float lr = 0.0f;
  int64_t tokens = 0;      // of the global batch
  bool skipped = false;    // no update: skip says why
  StepSkip skip = StepSkip::none;
  float loss_scale = 1.0f;  // the scale the step ran with
  double loss_mean = 0.0;   // the running mean the loss was compared with (0 before any update)
};

// Throws Error naming the key and the fix when `d` cannot distill into
// `student` on `pp` pipeline stages (a temperature not above 0, alpha
// outside [0, 1], a vocabulary other than the student's, pp > 1).
void check_distillation(const GPTConfig& student, const DistillOptions& d, int64_t pp);

// A distillation run's teacher on one rank: its model under the student's
// tensor-parallel layout (whole on every data-parallel rank) and its weights
// in a ParamStore of their own, fp32, with no gradient and no optimizer state.
class Teacher {
 public:
  Teacher(const GPTConfig& model, const TensorParallel& tp, uint64_t seed);
  const GPT& model() const { return model_; }
  ParamStore& params() { return params_; }
  // Forward only (no dropout; block inputs alone kept, and only until it
  // returns): the micro-batch's logits over this rank's vocabulary slice.
  // Collective over the tp group.
  Tensor logits(const MicroBatch& mb);

 private:
  GPT model_;
  ParamStore params_;
};

// The training step. Without a communicator it is the single-rank fp32
// reference every parallel layout and memory strategy is tested against
// (ParamStore, GradStore and AdamW over the whole model). With one, the
// ZeRO stores of zero.h hold the state and every rank of `dp` runs the step on
// its own micro-batches of the same global batch.
class Trainer {
 public:
  Trainer(const GPTConfig& model, const TrainOptions& opts, Communicator* dp = nullptr);
  // Hybrid parallel training on a dp x pp x tp mesh (sp, ep of size 1): the
  // ZeRO stores shard over the mesh's dp group, the model's matrices over its
  // tp group and its layers over its pp group. Collective over the mesh,
  // which must outlive the Trainer. Throws Error for a combination it does
  // not support (ZeRO stage >= 2 with pp > 1).
  Trainer(const GPTConfig& model, const TrainOptions& opts, DeviceMesh& mesh);
  // The stores refer to the model's layout: a Trainer stays where it is built.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  ~Trainer();

  // Forward and backward over this rank's micro-batches (gradients
  // accumulate), then clipping and one AdamW update. Collective under dp.
  StepStats step(std::span<const MicroBatch> micro_batches);
  // Forward only (no dropout, no gradients) of one micro-batch: the sum of
  // the losses of its positions with a target, on every rank of the replica.
  // Collective over the mesh's tp and pp groups (and dp under ZeRO-3).
  double loss_sum(const MicroBatch& micro_batch);

  // Where this rank's bytes live: the chunk manager's report under a memory
  // policy, the allocators' figures otherwise.
  MemoryReport memory_report() const;
  // The chunk manager under a memory policy (nullptr otherwise).
  const ChunkManager* memory_manager() const { return chunk_memory_; }
  // AdamW updates applied (fp16 skips excluded).
  int64_t optimizer_steps() const;

  GPT& model() { return model_; }
  ParamStore& params() { return *params_; }
  GradStore& grads() { return *grads_; }
  OptimizerStore& optimizer() { return *optim_; }
  const TrainOptions& options() const { return opts_; }
  Communicator* data_parallel() const { return dp_; }
  // Steps run (skipped ones included); the optimizer counts applied updates.
  int64_t steps_done() const { return steps_; }
  const LossScaler* loss_scaler() const { return scaler_.get(); }
  const LossWatch& loss_watch() const { return loss_watch_; }
  // The frozen parameters (nullptr when every parameter trains).
  const FrozenParams* frozen() const { return frozen_.get(); }
  // How the model state is cut over the dp ranks (nullptr for the reference).
  const ZeroPartition* partition() const { return partition_.get(); }
  // The whole model's parameters, the layout State and checkpoints use (the
  // model's own layout unless it is split over tp or pp).
  const ParamLayout& state_layout() const { return whole_ ? whole_->layout() : model_.layout(); }
  // Where this rank's time went in the last step's pipeline (mesh only).
  const PipelineTiming& pipeline_timing() const { return pipeline_timing_; }

  // The whole model state in state_layout()'s flat order, fp32: the weights
  // (the master weights under mixed precision) and the AdamW moments.
  struct State {
    Tensor params, exp_avg, exp_avg_sq;
    int64_t steps = 0, optimizer_steps = 0;
    LossScaler::State loss_scale;  // fp16 only
    LossWatch loss_watch;
  };
  // Collective under dp (the whole mesh): every rank gets the whole state, on
  // the host tier.
  State gather_state();
  // Collective under dp (the whole mesh): every rank takes its part of `state`.
  void load_state(const State& state);
  // Collective under dp (the whole mesh): the step's reduced gradient of the
  // whole model in state_layout()'s flat order, fp32 and divided by the loss
  // scale, on the host tier of every rank; called from
  // TrainOptions::on_gradients (tests compare layouts' gradients with it).
  Tensor gather_gradients();
  // Collective: the whole state in pieces of whole parameters in flat order:
  // one piece (gathered on the host), or one chunk at a time under a memory
  // policy, so that a model larger than the host streams through (checkpoints
  // are written from it).
  void visit_state(const StateVisitor& visit);
  // Collective: fresh weights (an imported checkpoint's) with the optimizer
  // state of a new run (zero moments, step 0). Unlike load_state, nothing is
  // assembled in the whole model's order: `fill` writes flat elements `range`
  // of this rank's own layout (whole parameters; the chunks under a memory
  // policy), so each rank reads only the pieces its layout holds.
  using WeightFiller = std::function<void(const ParamLayout& layout, FlatRange range, float* params)>;
  void load_weights(const WeightFiller& fill);
  // Distillation: the teacher's weights, `fill` as load_weights's over this
  // rank's layout of the teacher (teacher()->model().layout()). Not collective.
  void load_teacher_weights(const WeightFiller& fill);
  // The teacher (nullptr without TrainOptions::distill).
  Teacher* teacher() { return teacher_.get(); }

  // Sharded checkpoints: each rank saves only the state it holds. `n`
  // elements of the whole model's flat state (state_layout()) from `global`,
  // `at` elements into an owned range of the optimizer store.
  struct StateRun {
    int64_t global = 0, n = 0, at = 0;
  };
  // Per range of optimizer().owned_ranges(), the runs this rank saves, in
  // the range's order: exactly one rank of the mesh saves each element of
  // the whole state (data-parallel rank 0 of a store that is not sharded,
  // tensor-parallel rank 0 of a replicated parameter, never the tied copy
  // or padding).
  std::vector<std::vector<StateRun>> own_state_runs() const;
  // Not collective: the store's owned ranges in that order (local flat
  // ranges of this rank's layout), at most one range staged at a time.
  void visit_own_state(const StateVisitor& visit);
  // Collective: the counters of `counters` and the weights and moments of
  // every element this rank keeps (a sharded store asks for its own shard
  // only, OptimizerStore::load_owned_state) from `fill`, which writes `n`
  // elements of the whole model's flat state from `global` (padding is
  // zero), in the pieces the store loads: nothing in the whole model's
  // order, unlike load_state.
  using GlobalStateFiller =
      std::function<void(int64_t global, int64_t n, float* params, float* exp_avg, float* exp_avg_sq)>;
  void load_own_state(const State& counters, const GlobalStateFiller& fill);

 private:
  // The ZeRO stores over dp_, for the model's (local) layout; returns the
  // optimizer store it made.
  ZeroOptimizer& build_zero_stores();
  // The chunk stores of memory.h under a memory policy.
  void build_chunk_stores();
  // Before the stores are built: the frozen parameters (the model's own and
  // TrainOptions::freeze) in a FrozenParams stored in `dtype`, if any.
  void split_frozen(DType dtype);
  // The layout the stores are built over: the trainable parameters.
  const ParamLayout& store_layout() const { return frozen_ ? frozen_->trainable() : model_.layout(); }
  // After the stores are built: with frozen parameters, the stores put
  // back in the model's layout (FrozenParamStore, ...).
  void wrap_frozen();
  // Before anything is allocated: TrainOptions::distill against the model
  // and the layout (pp: pipeline stages); builds the teacher.
  void build_teacher(int pp);
  // The mesh step: this rank's micro-batches through the pipeline schedule;
  // returns the sums of the loss's terms.
  std::vector<double> run_micro_batches(std::span<const MicroBatch> micro_batches, const ForwardOptions& base,
                                        float dloss);
  // Tensor-parallel partial gradients and the tied embedding's copies are
  // summed over their groups, then the data-parallel reduction starts.
  void reduce_model_parallel_gradients();
  StepStats apply_update(StepStats stats);
  // Whether the step diverged (max_skipped_steps > 0), and why.
  StepSkip divergence(const StepStats& stats, bool gradient_finite) const;
  // The step counters and the loss scaler's state of a State.
  void load_counters(const State& s);
  // Collective over the replica: the whole model's tensor (host tier) from
  // this rank's flat tensor of its own layout (itself unless split over tp
  // or pp).
  Tensor to_whole(const Tensor& local);

  TrainOptions opts_;
  Communicator* dp_;
  DeviceMesh* mesh_ = nullptr;
  GPT model_;
  std::unique_ptr<GPT> whole_;  // the unsplit model's description (no memory)
  std::unique_ptr<Communicator> model_parallel_group_;  // this replica's tp x pp ranks
  std::unique_ptr<Communicator> embedding_group_;       // first and last pipeline stage (pp > 1)
  bool defer_reduction_ = false;
  PipelineTiming pipeline_timing_;
  std::unique_ptr<ZeroPartition> partition_;
  std::unique_ptr<FrozenParams> frozen_;
  ZeroGradStore* zero_grads_ = nullptr;  // the ZeRO gradient store, wrapped or not
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<GradStore> grads_;
  // The optimizer store of whichever family holds the state (reference,
  // ZeRO, chunks); the chunk manager is also the memory policy's manager.
  std::unique_ptr<OptimizerStore> optim_;
  ChunkManager* chunk_memory_ = nullptr;
  std::unique_ptr<LossScaler> scaler_;
  LossWatch loss_watch_;
  int64_t steps_ = 0;
  std::unique_ptr<Teacher> teacher_;
};

}  // namespace loom

// ---------------------------------------------------------------------------
// The main job: config -> data -> training loop with progress, metrics,
// evaluation, checkpoints and a sample.
// ---------------------------------------------------------------------------

namespace loom {

class Config;
class Tokenizer;

// The model a config describes: a preset, or model.* as given for "custom".
GPTConfig model_config_from(const Config& cfg);

// Everything a training run is, derived from a config and validated as a
// whole (cross-field rules) before anything is allocated or read.
struct TrainPlan {
  GPTConfig model;
  TrainOptions options;
  int64_t steps = 0;
  int64_t global_batch = 0;  // sequences per step
  int64_t micro_batch = 0;
  int64_t seq_len = 0;
  int64_t accumulation = 1;  // micro-batches per step and rank: global_batch / (dp * micro_batch)
  std::filesystem::path out_dir;
  // init.from = "hf:DIR": the run starts from DIR's weights (the model is
  // config.json's); empty: a fresh initialization.
  std::filesystem::path init_hf;
  // init.from = a loom checkpoint (a step directory): the run starts from
  // its weights with a fresh optimizer state, and keeps the zeros of the
  // matrices its manifest says were pruned (options.adamw.keep_zeros).
  std::filesystem::path init_checkpoint;
  // The tokenizer beside the HF checkpoint (hf_tokenizer_file) or the loom
  // checkpoint's, which then tokenizes the data; empty: the dataset's own.
  std::filesystem::path init_tokenizer;
  // distill.teacher: the teacher's checkpoint (options.distill holds its
  // model), a loom checkpoint directory or "hf:DIR"; empty: no distillation.
  std::string distill_teacher;
  int64_t dp = 1;                 // data-parallel ranks
  int64_t tp = 1;                 // tensor-parallel ranks
  TensorGridShape tensor_grid;    // their 2D/2.5D/3D grid ({1, 1}: 1D)
  int64_t pp = 1;                 // pipeline stages
  std::string backend = "local";  // parallel.backend
  int nproc = 1;                  // ranks to launch: dp * tp * pp
  // trace.path (empty: no trace) and the steps it records, within train.steps.
  std::filesystem::path trace_path;
  TraceSteps trace_steps;
  // train.watchdog_timeout: how long a rank may stall (CommOptions); 0: off.
  std::chrono::milliseconds watchdog_timeout{0};
  // Whether the run is the single-rank fp32 reference (a Trainer without a
  // communicator); anything else runs every rank with one.
  bool reference() const {
    return dp == 1 && tp == 1 && pp == 1 && options.zero.stage == 0 && options.zero.precision == DType::f32;
  }
};
// Who starts the run's ranks: this process (the local backend's threads, or
// the mpirun that started it), or a supervisor (`loom train --max-restarts`)
// that starts mpirun itself for each attempt, outside any mpirun.
enum class Launch : uint8_t { this_process, supervisor };
// Throws ConfigError naming the field, its origin, the rule and the fix.
TrainPlan plan_training(const Config& cfg, Launch launch = Launch::this_process);
// The dp x tp x pp mesh a plan's ranks run on, over `world`; null without
// tensor or pipeline parallelism (data-parallel ranks then use `world`).
std::unique_ptr<DeviceMesh> plan_mesh(const TrainPlan& plan, Communicator& world);

// The layout keys of `cfg` (parallel.*, train.micro_batch_size, zero.stage,
// train.activation_checkpointing, memory.policy).
Layout layout_of(const Config& cfg);
// What a layout of `cfg` is held against: `model` (model_config_from's), the
// batch, and what the config fixes (parallel.stage_layers, model.preset).
LayoutProblem layout_problem_of(const Config& cfg, const GPTConfig& model);
// Whether a memory policy's chunk stores and the rest of the step fit
// `budgets`, as `loom train` checks before anything is allocated: the chunk
// manager's closed-form needs under the placement it starts from
// (plan_memory), beside the memory model's other device bytes, with `freeze`
// (TrainOptions::freeze) kept out of the chunks. Throws plan_memory's Error
// naming the tier, or ConfigError for memory.chunk_bytes. The layout search
// holds its memory-policy candidates to it too, so it proposes none that
// `loom train` refuses.
void check_memory_policy_fits(const Config& cfg, const GPTConfig& model, const Layout& layout,
                              const StepMemoryOptions& step, const std::vector<std::string>& freeze,
                              const TierBytes& budgets);

// ---------------------------------------------------------------------------
// `loom plan`: a config's predicted memory and step time, and the search for
// the fastest layout that fits (docs/planning.md)
// ---------------------------------------------------------------------------

// Where the machine's rates come from: `rates` (a calibration), else
// `hardware` (a hardware description), else default_calibration_path() if it
// exists.
struct RatesSource {
  std::filesystem::path rates = {}, hardware = {};
};
// Error saying to run `loom calibrate` or pass --hardware when there are none.
MachineRates find_machine_rates(const RatesSource& source);

// The bytes a rank's device may hold: memory.device_budget when set, else a
// hardware file's device_memory_bytes, else unlimited (infinity).
double plan_device_budget(const Config& cfg, const RatesSource& source, const MachineRates& rates);

// A layout the search kept, with its predictions.
struct RankedLayout {
  Layout layout;
  StepTimePrediction time;
  double device_peak = 0.0;  // the busiest rank's device peak
};
// The candidates one layout rule rejected.
struct RuleRejections {
  std::string rule;
  int64_t count = 0;
  std::string example;  // the first one's violation, "key: problem"
};
struct LayoutSearch {
  int64_t world = 1;
  int64_t candidates = 0;              // layout_candidates' count
  std::vector<RuleRejections> rules;   // in layout_rules() order, rules that rejected any
  // Valid, but the same step as a candidate kept: parallel.pp = 1 with a
  // schedule other than the default.
  int64_t equivalent = 0;
  int64_t too_large = 0;               // valid, but a rank's device peak exceeds the budget
  double too_large_least_peak = 0.0;   // the smallest such peak
  // Under a memory policy, within the budget by their peaks but refused by
  // `loom train`'s check of the chunk stores (check_memory_policy_fits),
  // which counts the chunk manager's working buffers all at once.
  int64_t policy_refused = 0;
  std::string policy_refused_example;  // the first one's error
  double device_budget = 0.0;
  std::vector<RankedLayout> ranked;    // every one that fits, fastest first
};
// Every candidate layout of `world` ranks for `cfg`'s model and batch, held to
// the layout rules and the device budget and ranked by predicted step time
// (ties: the smaller device peak, then candidate order). The memory model
// and the time model run on every valid candidate (about a second for the
// 30,000 candidates of 8 ranks of a small model).
LayoutSearch search_layouts(const Config& cfg, const MachineRates& rates, int64_t world, double device_budget);

// "380.5 us per step (10763845 tokens/s, MFU 47.38%)".
std::string describe_step_time(const StepTimePrediction& t);

struct PlanCommandOptions {
  RatesSource rates = {};
  bool search = false;
  int64_t top = 5;    // layouts --search prints
  int64_t ranks = 0;  // the search's world size; 0: parallel.dp * tp * pp
  // Machines of the hardware file (its ranks_per_node ranks each) the run
  // spans; 0: as many as the layout's ranks fill. Sets the search's world
  // size, and the config's layout must fill them.
  int64_t nodes = 0;
  // Where to write the predicted step's timeline (predict_step_trace) of the
  // config's layout, or with search of the best one; empty: none. Like
  // trace.path, a new file in an existing directory.
  std::filesystem::path trace = {};
};
// `loom plan`: without search, the config (validated by plan_training) with
// its per-rank memory peaks and step time; with search, the best layouts.
// Error (before anything is priced) when --nodes comes without a hardware
// file, with --ranks, or does not match the config's layout, and when
// `trace` exists or its directory does not.
void run_plan(const Config& cfg, const PlanCommandOptions& options, std::ostream& out);

// Checkpoints: <root>/step_XXXXXXXX/, committed atomically, then
// <root>/latest, then retention (docs/checkpoints.md). Sharded: one
// rank_NNNNN.safetensors per rank that saves state and a manifest mapping
// every run of the whole model's flat state to its file. Single file (the
// first format, and a run with frozen parameters): model.safetensors and
// optimizer.safetensors under global names.
enum class CheckpointFormat : uint8_t { sharded, single_file };
struct CheckpointInfo {
  std::filesystem::path dir;
  int64_t step = 0;
  nlohmann::json fields;  // the manifest's fields (config, loader, ...)
};
// The files hold the whole state in fp32 (the master weights under mixed
// precision) in the whole model's global coordinates, whatever the layout that
// saved it, so any layout loads any checkpoint. Under dp both calls are
// collective. Sharded, every rank writes the state it alone holds into the
// staging directory rank 0 made, hashing as it writes; rank 0 writes the
// manifest with every rank's digest and commits. Single file, every rank
// gathers the state and rank 0 writes it. The ranks then meet in a barrier. A
// Trainer built on a mesh saves with that mesh (its world). A store that
// cannot visit its own state (frozen parameters) saves a single file.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, Trainer& trainer,
                                      const nlohmann::json& fields, int64_t keep_last, DeviceMesh* mesh = nullptr,
                                      CheckpointFormat format = CheckpointFormat::sharded);

// How a run writes its checkpoints (train.keep_last, train.checkpoint_async,
// train.checkpoint_failure).
struct CheckpointOptions {
  int64_t keep_last = 2;
  CheckpointFormat format = CheckpointFormat::sharded;
  // Snapshot this rank's own state into host memory at the step boundary and
  // write it while training goes on, at most one checkpoint in flight. Only
  // the sharded format: a single-file checkpoint is written at once.
  bool async = false;
  // A checkpoint that cannot be written (a full disk, a failing file
  // system): an Error on every rank, or reported while training goes on.
  // Either way nothing of it is left and the previous checkpoint is intact.
  bool stop_on_failure = true;
};
// What became of one checkpoint.
struct CheckpointOutcome {
  int64_t step = 0;
  std::filesystem::path dir;  // committed, when error is empty
  std::string error;          // the first failing rank and why
  double seconds = 0.0;       // from the step boundary to the commit
};
// A run's checkpoint writer: save_checkpoint's phases (every rank writes its
// own shard into rank 0's staging directory, then rank 0 writes the manifest
// and commits) with the shard writes optionally behind the training. Every
// call is collective over the mesh's world (or the trainer's data-parallel
// group) and made at the same step boundaries on every rank.
class CheckpointWriter {
 public:
  using Report = std::function<void(const CheckpointOutcome&)>;
  CheckpointWriter(std::filesystem::path root, Trainer& trainer, DeviceMesh* mesh, CheckpointOptions options,
                   Report report = {});
  // Waits for a shard still being written (uncommitted: its staging
  // directory is removed).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // A checkpoint of the trainer's current step, with `fields` in its
  // manifest: written and committed now, or (async) snapshotted now and
  // committed by a later poll or finish. A checkpoint still in flight is
  // finished first.
  void save(const nlohmann::json& fields);
  // Commits the checkpoint in flight if every rank has written its shard.
  void poll();
  // Waits for the checkpoint in flight and commits it.
  void finish();
  bool in_flight() const { return pending_ != nullptr; }

 private:
  struct Pending;
  void commit();

  std::filesystem::path root_;
  Trainer& trainer_;
  DeviceMesh* mesh_;
  CheckpointOptions options_;
  Report report_;
  std::unique_ptr<Pending> pending_;
};
// Loads weights, optimizer state, the step counters and (fp16) the loss
// scaler's state, either format: each rank reads only the byte ranges of the
// pieces its own layout holds. Sharded, a rank verifies the checksum of each
// file it reads from; single file, every file is verified first.
CheckpointInfo load_checkpoint(const std::filesystem::path& dir, Trainer& trainer);
// Weights only (generate, eval, export): verifies the checkpoint and returns
// its info; `load_weights` fills a ParamStore of the model it describes (or
// of a rank's part of it, ModelParallel: only that rank's pieces are read).
CheckpointInfo read_checkpoint_info(const std::filesystem::path& dir);
GPTConfig checkpoint_model_config(const CheckpointInfo& info);
void load_weights(const CheckpointInfo& info, const GPT& model, ParamStore& params);
// Collective: a checkpoint's weights into a Trainer of its model (any
// layout; each rank reads only its pieces), with a fresh optimizer state.
// A parameter the checkpoint lacks (an adapter added for fine-tuning) keeps
// its fresh initialization from `seed`.
void load_weights(const CheckpointInfo& info, Trainer& trainer, uint64_t seed);
// The manifest field of a pruned checkpoint (`loom prune`, prune.h):
// {"method", "pattern", "sparsity", "source", "params": [the pruned
// matrices' names]}.
inline constexpr const char* kPruningField = "pruning";
// The matrices a checkpoint's manifest says were pruned (none when it was
// not); Error naming the checkpoint when the field is malformed.
std::vector<std::string> pruned_params(const CheckpointInfo& info);
// Resolves a checkpoint argument: a step directory, or a run directory whose
// `latest` names one.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);
// Distillation (distill.teacher): the model of `source`, a loom checkpoint
// (resolve_checkpoint) or "hf:DIR", validated; and its weights into the
// trainer's teacher, each rank reading only the pieces its layout holds.
GPTConfig teacher_model_config(const std::string& source);
void load_teacher(const std::string& source, Trainer& trainer);

// Hugging Face checkpoints (hf.h) as a run's weights, and loom's weights as
// one. A directory is named "hf:DIR" wherever a checkpoint or an initial
// model is (init.from, --checkpoint); hf_dir_of gives DIR, or nullopt for any
// other spelling.
std::optional<std::filesystem::path> hf_dir_of(std::string_view spec);
// The tokenizer of a checkpoint directory, as Tokenizer::load chooses it
// (tokenizer.json, else tokenizer.model); nullopt when it has neither.
std::optional<std::filesystem::path> hf_tokenizer_file(const std::filesystem::path& dir);
// The loom model a config.json describes. Error naming `source` (the
// directory) and the key for what loom's model does not run.
GPTConfig gpt_config_from_hf(const HFModelConfig& hf, const std::filesystem::path& source);
// The config.json of a loom model, for export.
HFModelConfig hf_config_from_gpt(const GPTConfig& model);

// An opened and validated checkpoint directory: config.json, the model it
// describes, and every tensor checked against it (names, shapes, dtypes) -
// all before anything is allocated. Tensors are read on demand.
struct HFImport {
  explicit HFImport(const std::filesystem::path& dir);
  HFModelConfig hf;
  GPTConfig model;
  HFParamMap map;
  HFCheckpoint checkpoint;
  // Writes flat elements `range` (whole parameters) of `layout` - any rank's
  // layout of `model`, split over tp or not, with or without LoRA adapters:
  // each tensor-parallel piece reads only the rows it covers, one tensor at a
  // time, converted to f32; the vocabulary's padding rows are zero. An
  // adapter, which the checkpoint lacks, gets its fresh initialization
  // (ParamLayout::initialize with `seed`), as a run that imports nothing.
  void fill(const ParamLayout& layout, FlatRange range, float* params, uint64_t seed) const;
};
// Collective: the checkpoint's weights into a Trainer of `src.model` (any
// layout, adapters added or not), with a fresh optimizer state.
void load_hf_weights(const HFImport& src, Trainer& trainer);
// Into the reference ParamStore of a whole model (generate, eval); adapters
// keep the values `params` holds.
void load_hf_weights(const HFImport& src, const GPT& model, ParamStore& params);
// Writes a whole model's weights (a reference ParamStore) as a Hugging Face
// checkpoint directory (write_hf_checkpoint: names per HFParamMap, sharded
// above options.max_shard_bytes, in options.dtype). LoRA adapters are merged
// into their base weights, W + (alpha / r) B A: the export is the plain
// architecture.
void export_hf(const GPT& model, const ParamStore& params, const std::filesystem::path& out_dir,
               const HFExportOptions& options = {});
// A model's LoRA adapters in PEFT's layout, loadable by
// PeftModel.from_pretrained over the base model export_hf writes (GPT-2 or
// LLaMA): adapter_config.json and adapter_model.safetensors with
// base_model.model.<HF module>.lora_A.weight [r, in] and .lora_B.weight
// [out, r] (f32), the HF module named by HFParamMap. Throws Error for a model
// without adapters.
void export_peft_adapter(const GPT& model, const ParamStore& params, const std::filesystem::path& out_dir);

struct EvalResult {
  double loss_per_token = 0.0;
  double loss_per_char = 0.0;
  int64_t tokens = 0;
};
// Mean loss over every window of the shards (chars_per_token converts);
// max_batches > 0 stops after that many micro-batches (per rank under dp).
// With a data-parallel communicator it is collective: each rank evaluates its
// slice of the windows (EvalLoader) and every rank gets the whole result.
// `masks`: the shards' loss masks (fine-tuning data, SplitInfo::masks()), or none.
EvalResult evaluate(GPT& model, ParamStore& params, const std::vector<std::filesystem::path>& shards,
                    int64_t seq_len, int64_t micro_batch, double chars_per_token, int64_t max_batches = 0,
                    Communicator* dp = nullptr, const std::vector<std::filesystem::path>& masks = {});
// What evaluating on a token shard takes from the dataset.json beside it
// (nothing for a bare shard): the windows' length, chars per token and the
// loss masks of fine-tuning data.
struct EvalData {
  std::filesystem::path shard;
  int64_t seq_len = 0;
  double chars_per_token = 0.0;  // 0: unknown
  std::vector<std::filesystem::path> masks;
};
// `seq_len` 0: `block_size` (the model's context), or a fine-tuning
// dataset's packing length. Error when the dataset was tokenized with
// another tokenizer than the one of SHA-256 `tokenizer_sha256`.
EvalData eval_data(const std::filesystem::path& shard, const std::string& tokenizer_sha256, int64_t seq_len,
                   int64_t block_size);
// The same through a Trainer's model, whatever its layout (Trainer::loss_sum):
// each data-parallel replica evaluates its slice of the windows. Collective
// over the Trainer's ranks (the whole mesh under a mesh).
EvalResult evaluate(Trainer& trainer, const std::vector<std::filesystem::path>& shards, int64_t seq_len,
                    int64_t micro_batch, double chars_per_token, int64_t max_batches = 0,
                    const std::vector<std::filesystem::path>& masks = {});

// The exit status of `loom train` when SIGTERM or SIGINT stopped it: every
// rank finished the step it was in, a checkpoint of that step was written, and
// `--resume` continues the run bit-exactly. EX_TEMPFAIL of sysexits.h: a
// scheduler that sees it knows the job is to be started again.
inline constexpr int kPreemptedExitStatus = 75;

struct RunOptions {
  bool resume = false;
  // A fresh run refuses a train.out_dir that holds a run's checkpoints; with
  // overwrite it deletes them (and the run's metrics) and starts afresh.
  bool overwrite = false;
  int64_t stop_after = 0;  // stop after this step as if interrupted (tests); 0 = run to the end
  bool quiet = false;
  // Called on every rank after each step, before the ranks agree whether to
  // stop (tests raise a signal here).
  std::function<void(int64_t step)> after_step;
};

struct RunResult {
  EvalResult final_eval;  // of the whole validation split; empty when the run stopped early
  int64_t steps_done = 0;
  // SIGTERM or SIGINT when a signal stopped the run (after steps_done, with
  // a checkpoint of it); 0 otherwise.
  int stop_signal = 0;
};
// `loom train`: the reference run on this thread, or plan.nproc ranks through
// launch() (comm.h) of which rank 0 prints, logs and samples. While it runs,
// SIGTERM and SIGINT ask it to stop: the ranks agree at the end of each step,
// write a checkpoint of it and return with stop_signal set; a second signal
// ends the process at once, as without the handlers.
RunResult run_training(const Config& cfg, const RunOptions& run);

}  // namespace loom
