#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/kernels.h"
#include "loom/train.h"

namespace loom {

Trainer::Trainer(const GPTConfig& model, const TrainOptions& opts) : opts_(opts), model_(model) {
  params_ = std::make_unique<ParamStore>(model_.layout(), opts_.seed);
  grads_ = std::make_unique<GradStore>(model_.layout());
  optim_ = std::make_unique<AdamW>(model_.layout(), opts_.adamw);
}

StepStats Trainer::step(std::span<const MicroBatch> micro_batches) {
  LOOM_CHECK(!micro_batches.empty(), "a step needs at least one micro-batch");
  StepStats stats;
  // The objective is the mean over every target token of the global batch, so
  // each position's loss weighs 1 / (target tokens in the whole batch).
  std::vector<int64_t> mb_targets;
  int64_t targets = 0;
  for (const MicroBatch& mb : micro_batches) {
    mb_targets.push_back(static_cast<int64_t>(std::count_if(mb.targets, mb.targets + mb.shape.N(),
                                                            [](int32_t t) { return t != -1; })));
    targets += mb_targets.back();
    stats.tokens += mb.shape.N();
  }
  if (targets == 0) throw Error("the batch has no target tokens (every target is -1)");
  const float dloss = 1.0f / static_cast<float>(targets);

  const uint64_t dropout_key = stream_key(stream_key(opts_.seed, "dropout"), static_cast<uint64_t>(steps_done()), 0);
  grads_->zero();
  double loss_sum = 0.0;
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const MicroBatch& mb = micro_batches[m];
    ForwardOptions fo;
    fo.training = true;
    fo.checkpoint_activations = opts_.checkpoint_activations;
    fo.dropout_key = dropout_key;
    fo.first_sequence = mb.first_sequence;
    const float loss = model_.forward(*params_, mb.tokens, mb.targets, mb.shape, fo);
    loss_sum += static_cast<double>(loss) * static_cast<double>(mb_targets[m]);
    model_.backward(*params_, *grads_, dloss);
  }
  grads_->finish();
  stats.loss = static_cast<float>(loss_sum / static_cast<double>(targets));

  Tensor g = grads_->flat();
  stats.grad_norm = std::sqrt(cpu::sum_squares(g.data<float>(), g.numel()));
  if (!std::isfinite(stats.grad_norm))
    throw Error(str("the gradient norm is ", stats.grad_norm, " at step ", steps_done() + 1,
                    ": training diverged; lower train.lr or enable train.grad_clip"));
  stats.lr = opts_.schedule.at(steps_done());
  Tensor p = params_->flat();
  optim_->step(p.data<float>(), g.data<float>(), stats.lr, clip_scale(stats.grad_norm, opts_.grad_clip));
  return stats;
}

}  // namespace loom
