// loom optim: AdamW over a range of the flat parameter space, learning-rate
// schedules and global gradient-norm clipping.
#pragma once

#include <cstdint>

#include <string>
#include <vector>

#include "loom/core.h"
#include "loom/device.h"
#include "loom/store.h"

namespace loom {

struct AdamWConfig {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  // Parameters (global names) whose zero elements stay zero through every
  // update, moments included: a pruned model's masks, which fine-tuning
  // keeps (docs/pruning.md). Every store family applies it here, in AdamW,
  // to the elements it updates, so the mask is sharded as the parameter is.
  std::vector<std::string> keep_zeros;
};

// Linear warmup from 0 to max_lr over warmup_steps, then cosine decay to
// min_lr at total_steps (and min_lr after).
struct LRSchedule {
  float max_lr = 3e-4f;
  float min_lr = 3e-5f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  // step is 0-based: the learning rate of the (step+1)-th update.
  float at(int64_t step) const;
};

// AdamW whose moment estimates cover a list of ranges of a layout's flat
// space, concatenated in the given order: the whole model for the reference
// path, the blocks a rank owns under ZeRO. Weight decay follows each
// parameter's spec.
class AdamW {
 public:
  AdamW(const ParamLayout& layout, const AdamWConfig& cfg, std::vector<FlatRange> ranges);
  AdamW(const ParamLayout& layout, const AdamWConfig& cfg) : AdamW(layout, cfg, {{0, layout.numel()}}) {}

  // One update of the whole model from its flat gradients (a single range
  // starting at element 0). grad_scale multiplies every gradient (clipping
  // and loss-scale unscaling folded in).
  void step(float* params, const float* grads, float lr, float grad_scale);
  // The same, range by range: begin_step advances the step count, then
  // update(i, ...) updates range i from pointers to its first element.
  void begin_step(float lr, float grad_scale);
  void update(size_t range, float* params, const float* grads);
  // The same for the flat elements `r` (not one of ranges()) with moments the
  // caller keeps (offloaded optimizer state); begin_step first.
  void update(FlatRange r, float* params, const float* grads, float* m, float* v) const;

  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  const std::vector<FlatRange>& ranges() const { return ranges_; }
  // Moments of all ranges, concatenated.
  Tensor exp_avg() const { return m_; }
  Tensor exp_avg_sq() const { return v_; }
  // Where range i starts in the moments.
  int64_t offset(size_t range) const { return offsets_.at(range); }
  const AdamWConfig& config() const { return cfg_; }

 private:
  const ParamLayout& layout_;
  AdamWConfig cfg_;
  std::vector<FlatRange> ranges_;
  std::vector<int64_t> offsets_;
  int64_t t_ = 0;
  ops::AdamWStep decay_, no_decay_;
  std::vector<bool> keep_zeros_;  // per parameter of the layout
  Tensor m_, v_;
};

// The single-rank reference's optimizer store: AdamW over the whole flat
// space of a ParamStore and a GradStore that keep it in one buffer each.
class ReferenceOptimizer final : public OptimizerStore {
 public:
  ReferenceOptimizer(ParamStore& params, GradStore& grads, const AdamWConfig& cfg);

  GradientCheck check_gradients() override;
  void step(float lr, float grad_scale) override;
  int64_t steps() const override { return adamw_.steps(); }
  void set_steps(int64_t t) override { adamw_.set_steps(t); }
  // One piece: the whole model.
  void visit_state(const StateVisitor& visit) override;
  void load_state(const StateFiller& fill) override;
  std::vector<FlatRange> owned_ranges() const override;
  void visit_owned_state(const StateVisitor& visit) override { visit_state(visit); }
  void visit_gradients(const GradientVisitor& visit) override;

 private:
  ParamStore& params_;
  GradStore& grads_;
  AdamW adamw_;
};

// The factor that scales gradients of global norm `norm` down to max_norm
// (1 when clipping is off, max_norm <= 0).
float clip_scale(double norm, float max_norm);

// Dynamic loss scaling for fp16 (Micikevicius et al. 2018, with Megatron's
// hysteresis). The loss is multiplied by scale() before backward so small
// gradients survive fp16; a step whose gradients overflowed is skipped. After
// `growth_interval` clean steps in a row the scale grows by `growth_factor`
// (and the hysteresis budget refills); each overflow spends one unit of the
// budget, and once it is spent every overflow multiplies the scale by
// `backoff_factor`. A scale that would fall below `min_scale` is an Error:
// the model produces non-finite gradients at any scale.
struct LossScaleOptions {
  float initial_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 1000;
  int hysteresis = 2;
  float min_scale = 1.0f;
};
// Throws Error naming the field of an option out of range.
void validate(const LossScaleOptions& opts);

class LossScaler {
 public:
  explicit LossScaler(const LossScaleOptions& opts = {});
  float scale() const { return scale_; }
  // Records one step; `overflow` means its gradients were not all finite.
  void update(bool overflow);

  // The whole state, for checkpoints.
  struct State {
    float scale = 0.0f;
    int64_t clean_steps = 0;
    int hysteresis_left = 0;
  };
  State state() const { return {scale_, clean_steps_, hysteresis_left_}; }
  void restore(const State& s);

 private:
  LossScaleOptions opts_;
  float scale_;
  int64_t clean_steps_ = 0;
  int hysteresis_left_;
};

}  // namespace loom
