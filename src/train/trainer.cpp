#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "loom/device.h"
#include "loom/planner.h"
#include "loom/trace.h"
#include "loom/train.h"
#include "train/whole_runs.h"

namespace loom {

namespace {

// Checks a mesh and the options against each other and the model, and says
// which layers and parts this rank holds. Throws before anything is built.
ModelParallel model_parallel_for(const GPTConfig& model, const TrainOptions& opts, DeviceMesh& mesh) {
  const ModelParallelOptions& o = opts.model_parallel;
  const int pp = mesh.size(MeshAxis::pp), tp = mesh.size(MeshAxis::tp);
  if (mesh.size(MeshAxis::sp) != 1 || mesh.size(MeshAxis::ep) != 1)
    throw Error(str("the Trainer runs dp x pp x tp meshes; ", mesh.shape().describe(),
                    " uses sp or ep: give them size 1 (sequence parallelism is ModelParallelOptions::sequence_parallel "
                    "over the tp ranks)"));
  if (opts.zero.stage >= 2 && (pp > 1 || tp > 1))
    throw Error(str("ZeRO stage ", opts.zero.stage, " with tensor or pipeline parallelism (", mesh.shape().describe(),
                    ") is not supported: model-parallel gradients are summed over their groups before the "
                    "data-parallel reduction, which stages 2-3 start during backward; use zero.stage = 0 or 1"));
  if (o.sequence_parallel && tp == 1)
    throw Error("sequence parallelism splits tokens over the tensor-parallel ranks: it needs parallel.tp >= 2");
  const bool interleaved = o.schedule == PipelineSchedule::interleaved_1f1b;
  if (interleaved != (o.virtual_stages > 1))
    throw Error(str("parallel.virtual_stages = ", o.virtual_stages, " with schedule ",
                    pipeline_schedule_name(o.schedule),
                    ": interleaved_1f1b needs 2 or more virtual stages, the other schedules exactly 1"));
  if (o.sequence_parallel && mesh.tensor_grid())
    throw Error("sequence parallelism splits 1D tensor parallelism's activations by token; a 2D, 2.5D or 3D grid "
                "splits them already: use parallel.sequence_parallel = false, or parallel.tp_mode = \"1d\"");
  ModelParallel mp;
  mp.tp.group = &mesh.group(MeshAxis::tp);
  mp.tp.sequence_parallel = o.sequence_parallel;
  mp.tp.grid = mesh.tensor_grid();
  const int stage = mesh.coord(MeshAxis::pp);
  mp.first_stage = stage == 0;
  mp.last_stage = stage == pp - 1;
  std::vector<int> given = o.stage_layers;
  if (interleaved && given.empty()) {
    // The interleaved schedule cycles through the chunks in lockstep, so
    // they get equal layer counts (as in Megatron-LM) rather than a balance
    // of costs that would leave the head's chunk short.
    const int parts = pp * o.virtual_stages;
    if (model.n_layer % parts != 0)
      throw Error(str("model.n_layer = ", model.n_layer, " does not split evenly over ", pp, " x ", o.virtual_stages,
                      " interleaved virtual stages: give parallel.stage_layers or change the layer count"));
    given.assign(static_cast<size_t>(parts), static_cast<int>(model.n_layer) / parts);
  }
  const std::vector<int> layers = pipeline_stage_layers(model, model.block_size, pp * o.virtual_stages, given);
  std::vector<int> first{0};
  for (int n : layers) first.push_back(first.back() + n);
  // Chunk c of pipeline rank s is virtual stage c * pp + s.
  for (int c = 0; c < o.virtual_stages; ++c) {
    const size_t k = static_cast<size_t>(c * pp + stage);
    mp.chunks.push_back({first[k], first[k + 1]});
  }
  return mp;
}

// Whether this rank's values of p are the ones its replica saves and counts
// in the gradient norm: not the tied copy and, for a parameter replicated over
// the tensor-parallel ranks (or some axes of a grid), the copy at coordinate 0
// on those axes.
bool owns_values(const ParamSpec& p, const TensorParallel& tp) {
  return !p.parallel.tied_copy && tp.owns_copy(kTpAll & ~p.parallel.split_axes);
}

// Whether `name` is `entry` or a parameter under the module `entry`.
bool names_under(const std::string& name, const std::string& entry) {
  return name == entry || (name.size() > entry.size() && name.starts_with(entry) && name[entry.size()] == '.');
}

// The options of micro-batch mb's forward: base's, its first sequence and,
// when distilling, its teacher's logits.
ForwardOptions micro_batch_options(ForwardOptions fo, const MicroBatch& mb, Teacher* teacher) {
  fo.first_sequence = mb.first_sequence;
  if (teacher) fo.teacher_logits = teacher->logits(mb);
  return fo;
}

// The host's copy of a device accumulator of loss terms.
std::vector<double> host_sums(const Tensor& sums) {
  const Tensor host = sums.clone(Tier::host);
  return {host.data<double>(), host.data<double>() + host.numel()};
}

// One step's micro-batches as pipeline work for this rank's chunks.
class MicroBatchWork final : public PipelineStageWork {
 public:
  MicroBatchWork(GPT& model, ParamStore& ps, GradStore& gs, std::span<const MicroBatch> micro_batches,
                 const ForwardOptions& base, float dloss, bool reduce_last, int64_t step, Teacher* teacher)
      : model_(model), ps_(ps), gs_(gs), micro_batches_(micro_batches), base_(base), dloss_(dloss),
        reduce_last_(reduce_last), step_(step), teacher_(teacher), states_(micro_batches.size()),
        begun_(micro_batches.size(), false), loss_sum_(Tensor::zeros({model.loss().terms()}, DType::f64)) {}

  Shape activation_shape(int, int micro_batch) const override {
    const MicroBatch& mb = micro_batches_[static_cast<size_t>(micro_batch)];
    const TensorParallel& tp = model_.parallel().tp;
    return {tp.local_rows(mb.shape.N()), tp.local_width(model_.config().n_embd)};
  }
  Tensor forward(int chunk, int micro_batch, const Tensor& input) override {
    if (step_ >= 0) report_progress("forward", step_, "micro-batch", micro_batch);
    const size_t m = static_cast<size_t>(micro_batch);
    if (!begun_[m]) {
      const MicroBatch& mb = micro_batches_[m];
      model_.begin(states_[m], mb.tokens, mb.targets, mb.shape, micro_batch_options(base_, mb, teacher_), loss_sum_);
      begun_[m] = true;
    }
    return model_.forward_chunk(ps_, states_[m], chunk, input);
  }
  Tensor backward(int chunk, int micro_batch, const Tensor& grad_output) override {
    if (step_ >= 0) report_progress("backward", step_, "micro-batch", micro_batch);
    // Without model-parallel reductions the last micro-batch's buckets start
    // the data-parallel reduction during backward, as in the dp-only step.
    gs_.set_reduce(reduce_last_ && micro_batch + 1 == static_cast<int>(micro_batches_.size()));
    return model_.backward_chunk(ps_, gs_, states_[static_cast<size_t>(micro_batch)], chunk, grad_output, dloss_);
  }
  // The micro-batches' sums of the loss's terms on every rank of
  // `pipeline`: only the last stage computes losses (its tensor-parallel
  // ranks all the same ones, or on a grid each group of ranks that splits
  // the head's vocabulary its tokens').
  // One read of the device accumulator.
  std::vector<double> loss_sums(Communicator& pipeline) const {
    std::vector<double> sums = host_sums(loss_sum_);
    if (const TensorGrid* grid = model_.parallel().tp.grid)
      grid->inner_token_group->all_reduce(sums.data(), static_cast<int64_t>(sums.size()), DType::f64,
                                          ReduceOp::sum);
    if (pipeline.size() > 1)
      pipeline.all_reduce(sums.data(), static_cast<int64_t>(sums.size()), DType::f64, ReduceOp::sum);
    return sums;
  }

 private:
  GPT& model_;
  ParamStore& ps_;
  GradStore& gs_;
  std::span<const MicroBatch> micro_batches_;
  ForwardOptions base_;
  float dloss_;
  bool reduce_last_;
  int64_t step_;  // the training step being run, for progress reports; -1: evaluation
  Teacher* teacher_;  // nullptr unless distilling
  std::vector<MicroBatchState> states_;
  std::vector<bool> begun_;
  Tensor loss_sum_;  // [loss terms] f64 on the device, shared by the micro-batches
};

}  // namespace

std::vector<bool> frozen_params(const ParamLayout& layout, const std::vector<std::string>& freeze) {
  std::vector<bool> frozen;
  for (const ParamSpec& p : layout.params())
    frozen.push_back(!p.trainable || std::any_of(freeze.begin(), freeze.end(), [&](const std::string& e) {
                       return names_under(p.name, e);
                     }));
  return frozen;
}

Trainer::Trainer(const GPTConfig& model, const TrainOptions& opts, Communicator* dp)
    : opts_(opts), dp_(dp), model_(model) {
  validate(opts_.zero);
  build_teacher(1);
  const ZeroOptions& z = opts_.zero;
  if (opts_.memory.policy != MemoryPolicy::none) {
    build_chunk_stores();
    return;
  }
  if (!dp_) {
    if (z.stage != 0 || z.precision != DType::f32)
      throw Error(str("ZeRO stage ", z.stage, " with precision ", dtype_name(z.precision),
                      " needs a data-parallel communicator; the single-rank reference is stage 0 in fp32"));
    split_frozen(DType::f32);
    params_ = std::make_unique<ParamStore>(store_layout(), opts_.seed);
    grads_ = std::make_unique<GradStore>(store_layout());
    optim_ = std::make_unique<ReferenceOptimizer>(*params_, *grads_, opts_.adamw);
    wrap_frozen();
    return;
  }
  build_zero_stores();
}

Trainer::Trainer(const GPTConfig& model, const TrainOptions& opts, DeviceMesh& mesh)
    : opts_((validate(opts.zero), opts)),
      dp_(&mesh.group(MeshAxis::dp)),
      mesh_(&mesh),
      model_(model, model_parallel_for(model, opts, mesh)) {
  const int pp = mesh.size(MeshAxis::pp), tp = mesh.size(MeshAxis::tp);
  build_teacher(pp);
  if (opts_.memory.policy != MemoryPolicy::none)
    throw Error(str("memory.policy = \"", memory_policy_name(opts_.memory.policy), "\" with ", mesh.shape().describe(),
                    ": chunk placement shards over data parallelism only; use parallel.tp = 1 and parallel.pp = 1, "
                    "or memory.policy = \"none\""));
  const TensorParallel& tpl = model_.parallel().tp;
  whole_ = std::make_unique<GPT>(model);
  Communicator& world = mesh.world();
  // The ranks of one data-parallel replica: every (pp, tp) coordinate.
  model_parallel_group_ = world.split(mesh.coord(MeshAxis::dp), world.rank());
  const int stage = mesh.coord(MeshAxis::pp);
  if (pp > 1) {
    const bool holds_table = stage == 0 || stage == pp - 1;
    embedding_group_ = world.split(holds_table ? mesh.coord(MeshAxis::dp) * tp + mesh.coord(MeshAxis::tp) : -1, stage);
  }
  // A gradient that is a partial sum over tp (sequence parallelism's norms,
  // kv heads replicated over the tp ranks, a tensor-parallel LoRA adapter's
  // replicated factor) is summed after the schedule, before the data-parallel
  // reduction.
  const auto& params = model_.layout().params();
  defer_reduction_ = pp > 1 || std::any_of(params.begin(), params.end(), [&](const ParamSpec& p) {
                       return p.parallel.partial_grad != 0 && tpl.size() > 1;
                     });
  ZeroOptimizer& zero = build_zero_stores();
  std::vector<FlatRange> duplicates;
  for (const ParamSpec& p : store_layout().params())
    if (!owns_values(p, tpl))
      duplicates.push_back({p.offset, p.offset + p.numel()});
  zero.count_norm_over(*model_parallel_group_, std::move(duplicates));
}

ZeroOptimizer& Trainer::build_zero_stores() {
  const ZeroOptions& z = opts_.zero;
  split_frozen(z.precision);
  const ParamLayout& layout = store_layout();
  if (z.precision == DType::f16) scaler_ = std::make_unique<LossScaler>(opts_.loss_scale);
  // Stage 3 gathers and frees one group at a time; stages 0-2 reduce
  // gradients in buckets of about bucket_bytes.
  const int64_t bucket_numel = z.stage == 3 ? 0 : std::max<int64_t>(1, z.bucket_bytes / int64_t(dtype_size(z.precision)));
  partition_ = std::make_unique<ZeroPartition>(layout, dp_->size(), dp_->rank(), bucket_numel);
  auto params = std::make_unique<ZeroParamStore>(layout, *partition_, *dp_, z, opts_.seed);
  auto grads = std::make_unique<ZeroGradStore>(layout, *partition_, *dp_, z);
  auto optim = std::make_unique<ZeroOptimizer>(layout, *partition_, *dp_, z, opts_.adamw, opts_.seed, *params, *grads);
  ZeroOptimizer& zero = *optim;
  zero_grads_ = grads.get();
  params_ = std::move(params);
  grads_ = std::move(grads);
  optim_ = std::move(optim);
  wrap_frozen();
  return zero;
}

void Trainer::build_chunk_stores() {
  const ZeroOptions& z = opts_.zero;
  if (dp_ && dp_->size() > 1 && z.stage != 3)
    throw Error(str("memory.policy = \"", memory_policy_name(opts_.memory.policy), "\" on ", dp_->size(),
                    " data-parallel ranks with zero.stage = ", z.stage,
                    ": chunks shard parameters, gradients and optimizer state as ZeRO-3 does; set zero.stage = 3"));
  if (z.precision == DType::f16) scaler_ = std::make_unique<LossScaler>(opts_.loss_scale);
  // The activations are not known before the first batch: the manager
  // checks the model state and its own working set against the budgets,
  // plan_training the whole step.
  split_frozen(z.precision);
  auto manager = std::make_unique<ChunkManager>(store_layout(), opts_.memory, z.precision, dp_, opts_.adamw,
                                                opts_.seed, 0);
  chunk_memory_ = manager.get();
  params_ = std::make_unique<ChunkParamStore>(*manager);
  grads_ = std::make_unique<ChunkGradStore>(*manager);
  optim_ = std::move(manager);
  wrap_frozen();
}

void Trainer::split_frozen(DType dtype) {
  const ParamLayout& layout = model_.layout();
  // Entries are checked against the whole model: a pipeline stage need not
  // hold what an entry names.
  for (const std::string& e : opts_.freeze) {
    const auto& all = state_layout().params();
    if (std::none_of(all.begin(), all.end(), [&](const ParamSpec& p) { return names_under(p.name, e); }))
      throw Error(str("train.freeze entry \"", e, "\" names no parameter or module of the model (e.g. \"",
                      all.front().name, "\", or \"h.0\" for a whole block)"));
  }
  const std::vector<bool> frozen = frozen_params(layout, opts_.freeze);
  if (std::find(frozen.begin(), frozen.end(), true) != frozen.end())
    frozen_ = std::make_unique<FrozenParams>(layout, frozen, dtype, opts_.seed);
}

void Trainer::wrap_frozen() {
  if (!frozen_) return;
  params_ = std::make_unique<FrozenParamStore>(*frozen_, std::move(params_));
  grads_ = std::make_unique<FrozenGradStore>(*frozen_, std::move(grads_));
  optim_ = std::make_unique<FrozenOptimizer>(*frozen_, std::move(optim_), !dp_ || dp_->rank() == 0);
}

namespace {
// The whole model on every pipeline stage (there is one), split over `tp`.
ModelParallel split_over(const TensorParallel& tp) {
  ModelParallel mp;
  mp.tp = tp;
  return mp;
}
}  // namespace

Teacher::Teacher(const GPTConfig& model, const TensorParallel& tp, uint64_t seed)
    : model_(model, split_over(tp)), params_(model_.layout(), seed) {}

Tensor Teacher::logits(const MicroBatch& mb) {
  ForwardOptions fo;
  fo.training = false;
  fo.checkpoint_activations = true;
  fo.first_sequence = mb.first_sequence;
  MicroBatchState s;
  model_.forward(params_, s, mb.tokens, mb.targets, mb.shape, fo);
  return s.logits;
}

void check_distillation(const GPTConfig& student, const DistillOptions& d, int64_t pp) {
  if (!(d.loss.temperature > 0.0f))
    throw Error(str("distill.temperature = ", d.loss.temperature,
                    ": the softmax temperature must be > 0 (1 is the plain softmax; 2 to 4 are usual)"));
  if (!(d.loss.alpha >= 0.0f && d.loss.alpha <= 1.0f))
    throw Error(str("distill.alpha = ", d.loss.alpha,
                    ": the weight of the KL term must be in [0, 1] (1: distillation alone, 0: cross-entropy alone)"));
  if (d.teacher.vocab_size != student.vocab_size)
    throw Error(str("distill.teacher has a vocabulary of ", d.teacher.vocab_size, " tokens and the model one of ",
                    student.vocab_size, ": distillation compares the two models' logits token by token; use a "
                    "teacher with the model's tokenizer, or set model.vocab_size = ", d.teacher.vocab_size));
  if (pp > 1)
    throw Error(str("distillation with parallel.pp = ", pp, " is not supported: the teacher runs beside the model's "
                    "head; use parallel.pp = 1 (data and tensor parallelism work)"));
}

void Trainer::build_teacher(int pp) {
  if (!opts_.distill) return;
  check_distillation(model_.config(), *opts_.distill, pp);
  model_.distill(opts_.distill->loss);
  teacher_ = std::make_unique<Teacher>(opts_.distill->teacher, model_.parallel().tp, opts_.seed);
}

void Trainer::load_teacher_weights(const WeightFiller& fill) {
  LOOM_CHECK(teacher_, "teacher weights without TrainOptions::distill");
  // The weights are written in place, as the reference store's are.
  const HostSection host;
  const ParamLayout& layout = teacher_->model().layout();
  fill(layout, {0, layout.numel()}, teacher_->params().flat().data<float>());
}

Trainer::~Trainer() = default;

int64_t Trainer::optimizer_steps() const { return optim_->steps(); }

MemoryReport Trainer::memory_report() const {
  return chunk_memory_ ? chunk_memory_->report() : allocator_report();
}

StepStats Trainer::step(std::span<const MicroBatch> micro_batches) {
  LOOM_CHECK(!micro_batches.empty(), "a step needs at least one micro-batch");
  if (chunk_memory_ && static_cast<int64_t>(micro_batches.size()) > opts_.memory.micro_batches)
    throw Error(str("a step of ", micro_batches.size(), " micro-batches on a Trainer whose memory manager was built for ",
                    opts_.memory.micro_batches, " (MemoryOptions::micro_batches): with one, gradients reuse the "
                    "parameters' memory and cannot accumulate"));
  StepStats stats;
  // The objective is the mean over every target token of the global batch, so
  // each position's loss weighs 1 / (target tokens in the whole batch); the
  // ranks' gradients are then summed, not averaged.
  int64_t counts[2] = {0, 0};  // targets, tokens
  for (const MicroBatch& mb : micro_batches) {
    counts[0] += std::count_if(mb.targets, mb.targets + mb.shape.N(), [](int32_t t) { return t != -1; });
    counts[1] += mb.shape.N();
  }
  if (dp_) dp_->all_reduce(counts, 2, DType::i64, ReduceOp::sum);
  const int64_t targets = counts[0];
  stats.tokens = counts[1];
  if (targets == 0) throw Error("the batch has no target tokens (every target is -1)");
  stats.loss_scale = scaler_ ? scaler_->scale() : 1.0f;
  const float dloss = stats.loss_scale / static_cast<float>(targets);

  const uint64_t dropout_key = stream_key(stream_key(opts_.seed, "dropout"), static_cast<uint64_t>(steps_), 0);
  grads_->zero();
  params_->begin_step();
  std::vector<double> loss_sums;
  if (mesh_) {
    ForwardOptions base;
    base.training = true;
    base.checkpoint_activations = opts_.checkpoint_activations;
    base.dropout_key = dropout_key;
    base.dloss = dloss;
    loss_sums = run_micro_batches(micro_batches, base, dloss);
  } else {
    // The losses accumulate on the device; the host reads them once per step.
    const Tensor device_loss_sum = Tensor::zeros({model_.loss().terms()}, DType::f64);
    for (size_t m = 0; m < micro_batches.size(); ++m) {
      const MicroBatch& mb = micro_batches[m];
      ForwardOptions fo;
      fo.training = true;
      fo.checkpoint_activations = opts_.checkpoint_activations;
      fo.dropout_key = dropout_key;
      fo.dloss = dloss;
      // Gradient accumulation: only the last micro-batch's buckets communicate.
      grads_->set_reduce(m + 1 == micro_batches.size());
      MicroBatchState s;
      report_progress("forward", steps_ + 1, "micro-batch", static_cast<int64_t>(m));
      model_.forward(*params_, s, mb.tokens, mb.targets, mb.shape, micro_batch_options(fo, mb, teacher_.get()),
                     device_loss_sum);
      report_progress("backward", steps_ + 1, "micro-batch", static_cast<int64_t>(m));
      model_.backward(*params_, *grads_, s, dloss);
    }
    loss_sums = host_sums(device_loss_sum);
  }
  report_progress("gradient reduction", steps_ + 1);
  grads_->finish();
  params_->end_step();
  if (dp_) dp_->all_reduce(loss_sums.data(), static_cast<int64_t>(loss_sums.size()), DType::f64, ReduceOp::sum);
  const double loss_sum = loss_sums[0];
  if (!std::isfinite(loss_sum) && opts_.max_skipped_steps == 0)
    throw Error(str("the loss is ", loss_sum, " (not finite) at step ", steps_ + 1,
                    ": training diverged; lower train.lr, enable train.grad_clip, or use a lower-risk precision"));
  stats.loss = static_cast<float>(loss_sum / static_cast<double>(targets));
  const std::vector<std::string_view> terms = model_.loss().term_names();
  for (size_t i = 1; i < terms.size(); ++i)
    stats.loss_parts.emplace_back(terms[i], loss_sums[i] / static_cast<double>(targets));
  report_progress("optimizer", steps_ + 1);
  if (opts_.on_gradients) opts_.on_gradients(*grads_);
  stats.lr = opts_.schedule.at(steps_);
  return apply_update(stats);
}

std::vector<double> Trainer::run_micro_batches(std::span<const MicroBatch> micro_batches, const ForwardOptions& base,
                                               float dloss) {
  const ModelParallelOptions& o = opts_.model_parallel;
  Communicator& pipeline = mesh_->group(MeshAxis::pp);
  MicroBatchWork work(model_, *params_, *grads_, micro_batches, base, dloss, !defer_reduction_, steps_ + 1,
                      teacher_.get());
  pipeline_timing_ = run_pipeline(pipeline, o.schedule, static_cast<int>(micro_batches.size()), o.virtual_stages, work);
  if (defer_reduction_) reduce_model_parallel_gradients();
  return work.loss_sums(pipeline);
}

namespace {

// Sums the gradients of `ids` over `group` in one all-reduce: packed back to
// back, reduced, unpacked. Element-wise sums in rank order, so the result is
// the one a collective per parameter gives.
void all_reduce_fused(Communicator& group, ZeroGradStore& grads, const std::vector<int>& ids) {
  if (ids.empty()) return;
  const DType dt = grads.accumulated(ids[0]).dtype();
  int64_t total = 0;
  for (int id : ids) total += grads.accumulated(id).numel();
  Tensor packed = Tensor::empty({total}, dt);
  int64_t at = 0;
  for (int id : ids) {
    const Tensor g = grads.accumulated(id);
    ops::copy(packed.flat(at, g.numel()).raw(), g.raw(), g.nbytes());
    at += g.numel();
  }
  group.all_reduce(packed);
  at = 0;
  for (int id : ids) {
    const Tensor g = grads.accumulated(id);
    ops::copy(g.raw(), packed.flat(at, g.numel()).raw(), g.nbytes());
    at += g.numel();
  }
}

}  // namespace

void Trainer::reduce_model_parallel_gradients() {
  ZeroGradStore& grads = *zero_grads_;
  const TensorParallel& tp = model_.parallel().tp;
  // What each parameter's gradient is summed over is a property of the
  // parameter (ParamParallel), not of its name; frozen ones have none.
  // Partial sums are reduced over the group their axes span, one fused
  // all-reduce per distinct set of axes, in a fixed order.
  std::map<TpAxes, std::vector<int>> over_tp;
  std::vector<int> over_stages;
  for (int id = 0; id < static_cast<int>(store_layout().params().size()); ++id) {
    const ParamParallel& p = store_layout().param(id).parallel;
    if (p.partial_grad != 0 && tp.size() > 1) over_tp[p.partial_grad].push_back(id);
    if (p.tied_across_stages) over_stages.push_back(id);
  }
  for (const auto& [axes, ids] : over_tp) all_reduce_fused(tp.group_over(axes), grads, ids);
  if (!over_stages.empty()) {
    LOOM_CHECK(embedding_group_, "a parameter tied across pipeline stages without the stages' group");
    all_reduce_fused(*embedding_group_, grads, over_stages);
  }
  grads.reduce_all();
}

double Trainer::loss_sum(const MicroBatch& mb) {
  ForwardOptions fo;
  fo.training = false;
  if (!mesh_) {
    MicroBatchState s;
    model_.forward(*params_, s, mb.tokens, mb.targets, mb.shape, micro_batch_options(fo, mb, teacher_.get()));
    return s.host_loss_sum();
  }
  MicroBatchWork work(model_, *params_, *grads_, {&mb, 1}, fo, 0.0f, false, -1, teacher_.get());
  Communicator& pipeline = mesh_->group(MeshAxis::pp);
  run_pipeline(pipeline, PipelineSchedule::gpipe, 1, opts_.model_parallel.virtual_stages, work, true);
  return work.loss_sums(pipeline)[0];
}

const char* step_skip_name(StepSkip skip) {
  switch (skip) {
    case StepSkip::none: return "none";
    case StepSkip::overflow: return "overflow";
    case StepSkip::non_finite_loss: return "non-finite loss";
    case StepSkip::non_finite_gradient: return "non-finite gradient";
    case StepSkip::loss_spike: return "loss spike";
  }
  return "?";
}

StepSkip Trainer::divergence(const StepStats& stats, bool gradient_finite) const {
  if (!std::isfinite(stats.loss)) return StepSkip::non_finite_loss;
  if (opts_.skip_spike_factor > 0.0 && loss_watch_.steps > 0 &&
      stats.loss > opts_.skip_spike_factor * loss_watch_.mean)
    return StepSkip::loss_spike;
  // fp16's overflows are the loss scaler's to handle.
  if (!gradient_finite && !scaler_) return StepSkip::non_finite_gradient;
  return StepSkip::none;
}

StepStats Trainer::apply_update(StepStats stats) {
  const auto diverged = [&] {
    return Error(str("the gradient norm is ", stats.grad_norm, " at step ", steps_ + 1,
                     ": training diverged; lower train.lr or enable train.grad_clip"));
  };
  const GradientCheck check = [&] {
    TraceScope trace(TraceCategory::optimizer, "gradient check");
    return optim_->check_gradients();
  }();
  stats.grad_norm = std::sqrt(check.sum_squares) / static_cast<double>(stats.loss_scale);
  const bool overflow = check.non_finite > 0 || !std::isfinite(stats.grad_norm);
  stats.loss_mean = loss_watch_.mean;
  // Every rank has the same loss and gradient check, so every rank makes the
  // same decision and skips the same updates.
  if (opts_.max_skipped_steps > 0)
    stats.skip = divergence(stats, !overflow);
  else if (overflow && !scaler_)
    throw diverged();
  ++steps_;
  if (stats.skip == StepSkip::none && scaler_) {
    scaler_->update(overflow);
    if (overflow) stats.skip = StepSkip::overflow;
  }
  if (stats.skip != StepSkip::none) {
    // Every rank skips this update: its parameters and optimizer state stay
    // as they were (the optimizer's step count too); the step still counts.
    stats.skipped = true;
    optim_->after_skip();
    if (stats.skip != StepSkip::overflow && ++loss_watch_.skipped_in_a_row >= opts_.max_skipped_steps)
      throw Error(str("step ", steps_, ": ", loss_watch_.skipped_in_a_row,
                      " diverging steps in a row skipped (train.max_skipped_steps = ", opts_.max_skipped_steps,
                      "), the last for its ", step_skip_name(stats.skip), ": loss ", stats.loss, ", running mean ",
                      loss_watch_.mean, " (train.skip_spike_factor = ", opts_.skip_spike_factor,
                      "): training diverged; resume from the last checkpoint with a lower train.lr or "
                      "train.grad_clip, or raise train.skip_spike_factor or train.max_skipped_steps"));
    return stats;
  }
  loss_watch_.skipped_in_a_row = 0;
  loss_watch_.add(stats.loss);
  TraceScope trace(TraceCategory::optimizer, "clip and update");
  optim_->step(stats.lr, clip_scale(stats.grad_norm, opts_.grad_clip) / stats.loss_scale);
  return stats;
}

// The state moves between the host and the stores outside the streams: each
// of these first lets the device's work finish.
Trainer::State Trainer::gather_state() {
  ops::synchronize();
  State s;
  s.steps = steps_;
  s.optimizer_steps = optimizer_steps();
  if (scaler_) s.loss_scale = scaler_->state();
  s.loss_watch = loss_watch_;
  for (Tensor* t : {&s.params, &s.exp_avg, &s.exp_avg_sq})
    *t = Tensor::empty({model_.layout().numel()}, DType::f32, Tier::host);
  optim_->visit_state([&](FlatRange r, const float* p, const float* m, const float* v) {
    std::copy_n(p, r.numel(), s.params.data<float>() + r.begin);
    std::copy_n(m, r.numel(), s.exp_avg.data<float>() + r.begin);
    std::copy_n(v, r.numel(), s.exp_avg_sq.data<float>() + r.begin);
  });
  for (Tensor* t : {&s.params, &s.exp_avg, &s.exp_avg_sq}) *t = to_whole(*t);
  return s;
}

Tensor Trainer::gather_gradients() {
  ops::synchronize();
  Tensor g = Tensor::empty({model_.layout().numel()}, DType::f32, Tier::host);
  optim_->visit_gradients(
      [&](FlatRange r, const float* grads) { std::copy_n(grads, r.numel(), g.data<float>() + r.begin); });
  if (scaler_) {
    const float unscale = 1.0f / scaler_->scale();
    float* values = g.data<float>();  // host memory
    for (int64_t i = 0; i < g.numel(); ++i) values[i] *= unscale;
  }
  return to_whole(g);
}

Tensor Trainer::to_whole(const Tensor& local) {
  if (!whole_) return local;
  // Each element of the whole model comes from exactly one rank of the
  // replica (zeros elsewhere), so a sum assembles it.
  const TensorParallel& tp = model_.parallel().tp;
  Tensor whole = Tensor::zeros({state_layout().numel()}, DType::f32, Tier::host);
  for_each_whole_run(model_.layout(), state_layout(), [&](const ParamSpec& p, int64_t at, int64_t global, int64_t n) {
    if (global < 0 || !owns_values(p, tp)) return;
    std::copy_n(local.data<float>() + at, n, whole.data<float>() + global);
  });
  model_parallel_group_->all_reduce(whole);
  return whole;
}

void Trainer::load_state(const State& s) {
  ops::synchronize();
  // This rank's layout's elements of the whole-model state.
  State local;
  const State* own = &s;
  if (whole_) {
    for (auto [from, to] : {std::pair{&s.params, &local.params}, {&s.exp_avg, &local.exp_avg},
                            {&s.exp_avg_sq, &local.exp_avg_sq}}) {
      *to = Tensor::zeros({model_.layout().numel()}, DType::f32, Tier::host);
      for_each_whole_run(model_.layout(), state_layout(), [&](const ParamSpec&, int64_t local_at, int64_t global, int64_t n) {
        if (global >= 0) std::copy_n(from->data<float>() + global, n, to->data<float>() + local_at);
      });
    }
    own = &local;
  }
  optim_->load_state([&](FlatRange r, float* p, float* m, float* v) {
    std::copy_n(own->params.data<float>() + r.begin, r.numel(), p);
    std::copy_n(own->exp_avg.data<float>() + r.begin, r.numel(), m);
    std::copy_n(own->exp_avg_sq.data<float>() + r.begin, r.numel(), v);
  });
  load_counters(s);
}

void Trainer::load_counters(const State& s) {
  optim_->set_steps(s.optimizer_steps);
  steps_ = s.steps;
  loss_watch_ = s.loss_watch;
  // A state saved without fp16 has no scaler state: the scaler starts afresh.
  if (scaler_ && s.loss_scale.scale > 0.0f) scaler_->restore(s.loss_scale);
}

void Trainer::visit_state(const StateVisitor& visit) {
  ops::synchronize();
  // A split model's pieces are assembled into the whole model's order first.
  if (whole_) {
    const State s = gather_state();
    visit({0, s.params.numel()}, s.params.data<float>(), s.exp_avg.data<float>(), s.exp_avg_sq.data<float>());
    return;
  }
  optim_->visit_state(visit);
}

std::vector<std::vector<Trainer::StateRun>> Trainer::own_state_runs() const {
  const std::vector<FlatRange> ranges = optim_->owned_ranges();
  std::vector<std::vector<StateRun>> runs(ranges.size());
  // Every data-parallel replica of a store that is not sharded holds the same.
  const bool replicated = !chunk_memory_ && opts_.zero.stage == 0;
  if (replicated && dp_ && dp_->rank() != 0) return runs;
  const TensorParallel& tp = model_.parallel().tp;
  size_t first = 0;
  for_each_whole_run(model_.layout(), state_layout(), [&](const ParamSpec& p, int64_t at, int64_t global, int64_t n) {
    if (global < 0 || !owns_values(p, tp)) return;
    // Both the runs and the ranges come in increasing local order.
    while (first < ranges.size() && ranges[first].end <= at) ++first;
    for (size_t k = first; k < ranges.size() && ranges[k].begin < at + n; ++k) {
      const FlatRange r = ranges[k];
      const int64_t b = std::max(at, r.begin), e = std::min(at + n, r.end);
      std::vector<StateRun>& out = runs[k];
      const StateRun run{global + (b - at), e - b, b - r.begin};
      if (!out.empty() && out.back().global + out.back().n == run.global && out.back().at + out.back().n == run.at)
        out.back().n += run.n;
      else
        out.push_back(run);
    }
  });
  return runs;
}

void Trainer::visit_own_state(const StateVisitor& visit) {
  ops::synchronize();
  optim_->visit_owned_state(visit);
}

void Trainer::load_own_state(const State& counters, const GlobalStateFiller& fill) {
  ops::synchronize();
  optim_->load_owned_state([&](FlatRange r, float* p, float* m, float* v) {
    for_each_whole_run(
        model_.layout(), state_layout(),
        [&](const ParamSpec&, int64_t at, int64_t global, int64_t n) {
          const int64_t b = std::max(at, r.begin), e = std::min(at + n, r.end);
          if (b >= e) return;
          const int64_t o = b - r.begin;
          if (global >= 0) return fill(global + (b - at), e - b, p + o, m + o, v + o);
          for (float* values : {p, m, v}) std::fill_n(values + o, e - b, 0.0f);
        },
        r);
  });
  load_counters(counters);
}

void Trainer::load_weights(const WeightFiller& fill) {
  ops::synchronize();
  const ParamLayout& layout = model_.layout();
  optim_->load_state([&](FlatRange r, float* p, float* m, float* v) {
    fill(layout, r, p);
    std::fill_n(m, r.numel(), 0.0f);
    std::fill_n(v, r.numel(), 0.0f);
  });
  // Step 0; a fresh State has no loss-scaler state, so an fp16 scaler keeps
  // its initial one.
  load_counters(State{});
}

}  // namespace loom
