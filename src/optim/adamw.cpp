#include <algorithm>

#include "loom/kernels.h"
#include "loom/optim.h"

namespace loom {

AdamW::AdamW(const ParamLayout& layout, const AdamWConfig& cfg, int64_t begin, int64_t end)
    : layout_(layout), cfg_(cfg), begin_(begin), end_(end) {
  LOOM_CHECK(0 <= begin && begin <= end && end <= layout.numel(), "optimizer range [", begin, ", ", end,
             ") outside the ", layout.numel(), "-element parameter space");
  m_ = Tensor::zeros({end - begin});
  v_ = Tensor::zeros({end - begin});
}

void AdamW::step(float* params, const float* grads, float lr, float grad_scale) {
  ++t_;
  cpu::AdamWStep decay = cpu::AdamWStep::at(t_, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay);
  decay.grad_scale = grad_scale;
  cpu::AdamWStep no_decay = decay;
  no_decay.weight_decay = 0.0f;
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  // Walk the parameters overlapping [begin, end): each is decayed or not.
  for (const ParamSpec& p : layout_.params()) {
    const int64_t lo = std::max(begin_, p.offset), hi = std::min(end_, p.offset + p.numel());
    if (lo >= hi) continue;
    const int64_t i = lo - begin_;
    cpu::adamw_update(params + i, grads + i, m + i, v + i, hi - lo, p.weight_decay ? decay : no_decay);
  }
}

float clip_scale(double norm, float max_norm) {
  if (max_norm <= 0.0f) return 1.0f;
  // As PyTorch's clip_grad_norm_: min(1, max_norm / (norm + 1e-6)).
  return static_cast<float>(std::min(1.0, static_cast<double>(max_norm) / (norm + 1e-6)));
}

}  // namespace loom
