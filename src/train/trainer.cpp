#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/kernels.h"
#include "loom/train.h"

namespace loom {

Trainer::Trainer(const GPTConfig& model, const TrainOptions& opts, Communicator* dp)
    : opts_(opts), dp_(dp), model_(model) {
  validate(opts_.zero);
  const ZeroOptions& z = opts_.zero;
  const ParamLayout& layout = model_.layout();
  if (!dp_) {
    if (z.stage != 0 || z.precision != DType::f32)
      throw Error(str("ZeRO stage ", z.stage, " with precision ", dtype_name(z.precision),
                      " needs a data-parallel communicator; the single-rank reference is stage 0 in fp32"));
    params_ = std::make_unique<ParamStore>(layout, opts_.seed);
    grads_ = std::make_unique<GradStore>(layout);
    reference_optim_ = std::make_unique<AdamW>(layout, opts_.adamw);
    return;
  }
  if (z.precision == DType::f16) scaler_ = std::make_unique<LossScaler>(opts_.loss_scale);
  // Stage 3 gathers and frees one group at a time; stages 0-2 reduce
  // gradients in buckets of about bucket_bytes.
  const int64_t bucket_numel = z.stage == 3 ? 0 : std::max<int64_t>(1, z.bucket_bytes / int64_t(dtype_size(z.precision)));
  partition_ = std::make_unique<ZeroPartition>(layout, dp_->size(), dp_->rank(), bucket_numel);
  auto params = std::make_unique<ZeroParamStore>(layout, *partition_, *dp_, z, opts_.seed);
  auto grads = std::make_unique<ZeroGradStore>(layout, *partition_, *dp_, z);
  zero_optim_ = std::make_unique<ZeroOptimizer>(layout, *partition_, *dp_, z, opts_.adamw, opts_.seed, *params, *grads);
  params_ = std::move(params);
  grads_ = std::move(grads);
}

Trainer::~Trainer() = default;

AdamW& Trainer::optimizer() { return reference_optim_ ? *reference_optim_ : zero_optim_->adamw(); }

StepStats Trainer::step(std::span<const MicroBatch> micro_batches) {
  LOOM_CHECK(!micro_batches.empty(), "a step needs at least one micro-batch");
  StepStats stats;
  // The objective is the mean over every target token of the global batch, so
  // each position's loss weighs 1 / (target tokens in the whole batch); the
  // ranks' gradients are then summed, not averaged.
  std::vector<int64_t> mb_targets;
  int64_t counts[2] = {0, 0};  // targets, tokens
  for (const MicroBatch& mb : micro_batches) {
    mb_targets.push_back(static_cast<int64_t>(std::count_if(mb.targets, mb.targets + mb.shape.N(),
                                                            [](int32_t t) { return t != -1; })));
    counts[0] += mb_targets.back();
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
  double loss_sum = 0.0;
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const MicroBatch& mb = micro_batches[m];
    ForwardOptions fo;
    fo.training = true;
    fo.checkpoint_activations = opts_.checkpoint_activations;
    fo.dropout_key = dropout_key;
    fo.first_sequence = mb.first_sequence;
    // Gradient accumulation: only the last micro-batch's buckets communicate.
    grads_->set_reduce(m + 1 == micro_batches.size());
    const float loss = model_.forward(*params_, mb.tokens, mb.targets, mb.shape, fo);
    loss_sum += static_cast<double>(loss) * static_cast<double>(mb_targets[m]);
    model_.backward(*params_, *grads_, dloss);
  }
  grads_->finish();
  params_->end_step();
  if (dp_) {
    float sum = static_cast<float>(loss_sum);
    dp_->all_reduce(&sum, 1, DType::f32, ReduceOp::sum);
    loss_sum = sum;
  }
  stats.loss = static_cast<float>(loss_sum / static_cast<double>(targets));
  if (opts_.on_gradients) opts_.on_gradients(*grads_);
  stats.lr = opts_.schedule.at(steps_);
  return apply_update(stats);
}

StepStats Trainer::apply_update(StepStats stats) {
  const auto diverged = [&] {
    return Error(str("the gradient norm is ", stats.grad_norm, " at step ", steps_ + 1,
                     ": training diverged; lower train.lr or enable train.grad_clip"));
  };
  if (reference_optim_) {
    Tensor g = grads_->flat();
    stats.grad_norm = std::sqrt(cpu::sum_squares(g.data<float>(), g.numel()));
    if (!std::isfinite(stats.grad_norm)) throw diverged();
    Tensor p = params_->flat();
    reference_optim_->step(p.data<float>(), g.data<float>(), stats.lr, clip_scale(stats.grad_norm, opts_.grad_clip));
    ++steps_;
    return stats;
  }
  const GradientCheck check = zero_optim_->check_gradients();
  stats.grad_norm = std::sqrt(check.sum_squares) / static_cast<double>(stats.loss_scale);
  const bool overflow = check.non_finite > 0 || !std::isfinite(stats.grad_norm);
  if (overflow && !scaler_) throw diverged();
  ++steps_;
  if (scaler_) scaler_->update(overflow);
  if (overflow) {
    // fp16: every rank saw the same count, so every rank skips this update
    // and its parameters and optimizer state stay as they were.
    stats.skipped = true;
    return stats;
  }
  zero_optim_->step(stats.lr, clip_scale(stats.grad_norm, opts_.grad_clip) / stats.loss_scale);
  return stats;
}

Trainer::State Trainer::gather_state() {
  State s;
  s.steps = steps_;
  s.optimizer_steps = optimizer().steps();
  if (scaler_) s.loss_scale = scaler_->state();
  if (reference_optim_) {
    s.params = params_->flat().clone(Tier::host);
    s.exp_avg = reference_optim_->exp_avg().clone(Tier::host);
    s.exp_avg_sq = reference_optim_->exp_avg_sq().clone(Tier::host);
  } else {
    zero_optim_->gather_state(s.params, s.exp_avg, s.exp_avg_sq);
  }
  return s;
}

void Trainer::load_state(const State& s) {
  if (reference_optim_) {
    params_->flat().copy_from(s.params);
    reference_optim_->exp_avg().copy_from(s.exp_avg);
    reference_optim_->exp_avg_sq().copy_from(s.exp_avg_sq);
  } else {
    zero_optim_->load_state(s.params, s.exp_avg, s.exp_avg_sq);
  }
  optimizer().set_steps(s.optimizer_steps);
  steps_ = s.steps;
  // A state saved without fp16 has no scaler state: the scaler starts afresh.
  if (scaler_ && s.loss_scale.scale > 0.0f) scaler_->restore(s.loss_scale);
}

}  // namespace loom
