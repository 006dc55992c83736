#include <algorithm>

#include "loom/device.h"
#include "loom/optim.h"

namespace loom {

AdamW::AdamW(const ParamLayout& layout, const AdamWConfig& cfg, std::vector<FlatRange> ranges)
    : layout_(layout), cfg_(cfg), ranges_(std::move(ranges)) {
  int64_t total = 0;
  for (const FlatRange& r : ranges_) {
    LOOM_CHECK(0 <= r.begin && r.begin <= r.end && r.end <= layout.numel(), "optimizer range [", r.begin, ", ",
               r.end, ") outside the ", layout.numel(), "-element parameter space");
    offsets_.push_back(total);
    total += r.numel();
  }
  // A rank's layout holds only some of the parameters (pipeline stages).
  keep_zeros_.assign(layout.params().size(), false);
  for (const std::string& name : cfg_.keep_zeros)
    if (const int id = layout.find(name); id >= 0) keep_zeros_[static_cast<size_t>(id)] = true;
  m_ = Tensor::zeros({total});
  v_ = Tensor::zeros({total});
}

void AdamW::step(float* params, const float* grads, float lr, float grad_scale) {
  LOOM_CHECK(ranges_.size() == 1 && ranges_[0].begin == 0, "AdamW::step(params, grads) needs one range from 0");
  begin_step(lr, grad_scale);
  update(0, params, grads);
}

void AdamW::begin_step(float lr, float grad_scale) {
  ++t_;
  decay_ = ops::AdamWStep::at(t_, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay);
  decay_.grad_scale = grad_scale;
  no_decay_ = decay_;
  no_decay_.weight_decay = 0.0f;
}

void AdamW::update(size_t range, float* params, const float* grads) {
  update(ranges_.at(range), params, grads, m_.data<float>() + offsets_[range], v_.data<float>() + offsets_[range]);
}

void AdamW::update(FlatRange r, float* params, const float* grads, float* m, float* v) const {
  // Walk the parameters overlapping the range: each is decayed or not.
  for (size_t id = 0; id < layout_.params().size(); ++id) {
    const ParamSpec& p = layout_.params()[id];
    const int64_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.numel());
    if (lo >= hi) continue;
    const int64_t i = lo - r.begin;
    ops::AdamWStep s = p.weight_decay ? decay_ : no_decay_;
    s.keep_zeros = keep_zeros_[id];
    ops::adamw_update(params + i, grads + i, m + i, v + i, hi - lo, s);
  }
}

float clip_scale(double norm, float max_norm) {
  if (max_norm <= 0.0f) return 1.0f;
  // As PyTorch's clip_grad_norm_: min(1, max_norm / (norm + 1e-6)).
  return static_cast<float>(std::min(1.0, static_cast<double>(max_norm) / (norm + 1e-6)));
}

}  // namespace loom
