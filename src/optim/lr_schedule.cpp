#include <algorithm>
#include <cmath>

#include "loom/optim.h"

namespace loom {

float LRSchedule::at(int64_t step) const {
  if (step < warmup_steps) return max_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  if (step >= total_steps) return min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = static_cast<double>(step - warmup_steps) / span;
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + (max_lr - min_lr) * cosine);
}

}  // namespace loom
