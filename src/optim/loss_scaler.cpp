#include <cmath>

#include "loom/optim.h"

namespace loom {

void validate(const LossScaleOptions& o) {
  if (!(o.initial_scale >= o.min_scale) || !std::isfinite(o.initial_scale))
    throw Error(str("loss scale: initial_scale = ", o.initial_scale, " must be finite and >= min_scale = ",
                    o.min_scale));
  if (!(o.min_scale > 0.0f)) throw Error(str("loss scale: min_scale = ", o.min_scale, " must be > 0"));
  if (!(o.growth_factor > 1.0f)) throw Error(str("loss scale: growth_factor = ", o.growth_factor, " must be > 1"));
  if (!(o.backoff_factor > 0.0f && o.backoff_factor < 1.0f))
    throw Error(str("loss scale: backoff_factor = ", o.backoff_factor, " must lie in (0, 1)"));
  if (o.growth_interval < 1)
    throw Error(str("loss scale: growth_interval = ", o.growth_interval, " must be >= 1"));
  if (o.hysteresis < 1) throw Error(str("loss scale: hysteresis = ", o.hysteresis, " must be >= 1"));
}

LossScaler::LossScaler(const LossScaleOptions& opts)
    : opts_(opts), scale_(opts.initial_scale), hysteresis_left_(opts.hysteresis) {
  validate(opts_);
}

void LossScaler::update(bool overflow) {
  if (!overflow) {
    if (++clean_steps_ == opts_.growth_interval) {
      scale_ *= opts_.growth_factor;
      clean_steps_ = 0;
      hysteresis_left_ = opts_.hysteresis;
    }
    return;
  }
  clean_steps_ = 0;
  if (--hysteresis_left_ > 0) return;
  hysteresis_left_ = 0;
  const float next = scale_ * opts_.backoff_factor;
  if (next < opts_.min_scale)
    throw Error(str("fp16 gradients overflow even at loss scale ", scale_, " (halving it would go below min_scale = ",
                    opts_.min_scale, "): training diverged; lower train.lr, enable train.grad_clip or use "
                    "precision = \"bf16\""));
  scale_ = next;
}

void LossScaler::restore(const State& s) {
  if (!(s.scale >= opts_.min_scale) || !std::isfinite(s.scale) || s.clean_steps < 0 || s.hysteresis_left < 0)
    throw Error(str("loss scaler state (scale ", s.scale, ", clean steps ", s.clean_steps, ", hysteresis left ",
                    s.hysteresis_left, ") is invalid"));
  scale_ = s.scale;
  clean_steps_ = s.clean_steps;
  hysteresis_left_ = s.hysteresis_left;
}

}  // namespace loom
