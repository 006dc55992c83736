#pragma once
// Staging buffers of the Hugging Face reader and writer: host-tier Tensors,
// so every byte they hold is accounted against the host budget.
#include "loom/core.h"

namespace loom {

// A scratch buffer reused across tensors and sized by the largest: makes
// `buffer` hold at least `numel` elements of `dt` on `tier`, leaving it as it
// is when it already does. The old buffer is freed before the new one is
// allocated, so the allocator never holds both.
inline void grow_scratch(Tensor& buffer, int64_t numel, DType dt, Tier tier) {
  if (buffer.defined() && buffer.numel() >= numel && buffer.dtype() == dt && buffer.tier() == tier) return;
  buffer = Tensor();
  buffer = Tensor::empty({numel}, dt, tier);
}

}  // namespace loom
