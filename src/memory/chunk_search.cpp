#include <algorithm>

#include "chunk_packing.h"
#include "loom/memory.h"

namespace loom {

ChunkSearch search_chunk_numel(const ParamLayout& layout, int ranks, int64_t max_numel) {
  if (ranks < 1) throw Error(str("memory: the chunk size search needs at least 1 data-parallel rank, got ", ranks));
  if (layout.params().empty())
    throw Error("memory: the chunk size search needs a model with parameters; the layout has none");
  // The sizes alone, contiguous, since every candidate walks them all.
  std::vector<int64_t> numels;
  numels.reserve(layout.params().size());
  for (const ParamSpec& p : layout.params()) numels.push_back(p.numel());

  const int64_t step = ranks * kChunkShardAlign;
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  const int64_t smallest = std::max<int64_t>(1, (largest + step - 1) / step) * step;
  const int64_t last = std::max(max_numel / step * step, smallest);
  ChunkSearch best;
  for (int64_t capacity = smallest; capacity <= last; capacity += step) {
    chunk_packing::GreedyPacker packer{capacity};
    for (int64_t n : numels) packer.place(n);
    const int64_t wasted = packer.chunks * capacity - layout.numel();
    ++best.candidates;
    if (best.candidates == 1 || wasted < best.wasted_numel) {
      best.chunk_numel = capacity;
      best.wasted_numel = wasted;
    }
  }
  return best;
}

}  // namespace loom
