// loom optim: AdamW over a range of the flat parameter space, learning-rate
// schedules and global gradient-norm clipping.
#pragma once

#include <cstdint>

#include "loom/core.h"
#include "loom/store.h"

namespace loom {

struct AdamWConfig {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
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

// AdamW whose moment estimates (the OptimStore) cover the flat elements
// [begin, end) of a layout: the whole model for the reference path, one
// shard under ZeRO. Weight decay follows each parameter's spec.
class AdamW {
 public:
  AdamW(const ParamLayout& layout, const AdamWConfig& cfg, int64_t begin, int64_t end);
  AdamW(const ParamLayout& layout, const AdamWConfig& cfg) : AdamW(layout, cfg, 0, layout.numel()) {}

  // One update of params[begin, end) from grads[begin, end), both given as
  // pointers to flat element `begin`. grad_scale multiplies every gradient
  // (clipping and loss-scale unscaling folded in).
  void step(float* params, const float* grads, float lr, float grad_scale);

  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  Tensor exp_avg() const { return m_; }
  Tensor exp_avg_sq() const { return v_; }
  const AdamWConfig& config() const { return cfg_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }

 private:
  const ParamLayout& layout_;
  AdamWConfig cfg_;
  int64_t begin_, end_;
  int64_t t_ = 0;
  Tensor m_, v_;
};

// The factor that scales gradients of global norm `norm` down to max_norm
// (1 when clipping is off, max_norm <= 0).
float clip_scale(double norm, float max_norm);

}  // namespace loom
