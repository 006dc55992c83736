// The caching allocator's size classes, shared with the planner's memory
// model, which replays the allocator's blocks. Internal to src/.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>

#include "loom/core.h"

namespace loom::detail {

// `step` must be a power of two, as every step here is: a mask, not a
// division, which the planner's memory model, replaying millions of
// allocations in a search, spent a fifth of its time in.
inline size_t round_up_bytes(size_t bytes, size_t step) { return (bytes + step - 1) & ~(step - 1); }
static_assert(std::has_single_bit(kMemoryAlignment));

// The block size a request is served from. Sixteen classes per power of two
// (at most 6.25% rounded up) let tensors of nearby sizes share blocks; above
// 32 MiB the step stays 2 MiB, so a large buffer wastes at most that.
// Multiples of kMemoryAlignment, as aligned_alloc requires.
inline size_t size_class(size_t bytes) {
  if (bytes <= 16 * kMemoryAlignment) return round_up_bytes(std::max<size_t>(bytes, 1), kMemoryAlignment);
  const size_t top = std::bit_floor(bytes);
  return round_up_bytes(bytes, std::min<size_t>(top / 16, size_t{2} << 20));
}

}  // namespace loom::detail
