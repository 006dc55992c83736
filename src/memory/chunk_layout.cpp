#include <algorithm>

#include "chunk_packing.h"
#include "loom/memory.h"

namespace loom {

ChunkLayout::ChunkLayout(const ParamLayout& layout, int64_t chunk_numel, int ranks)
    : layout_(layout), chunk_numel_(chunk_numel), ranks_(ranks) {
  if (ranks < 1)
    throw Error(str("memory: chunks are sharded over ", ranks, " data-parallel ranks; there must be at least 1"));
  const int64_t step = ranks * kChunkShardAlign;
  if (chunk_numel <= 0 || chunk_numel % step != 0)
    throw Error(str("memory.chunk_bytes gives chunks of ", chunk_numel,
                    " elements, which is not a positive multiple of ", step, " (", ranks, " ranks x ", kChunkShardAlign,
                    " elements per shard); set memory.chunk_bytes to a multiple of ", step,
                    " elements times the working precision's bytes, or to 0 to search the size"));
  chunk_of_param_.reserve(layout.params().size());
  chunks_of_group_.resize(static_cast<size_t>(layout.num_groups()));
  chunk_packing::GreedyPacker packer{chunk_numel};
  for (const ParamSpec& p : layout.params()) {
    const int id = static_cast<int>(chunk_of_param_.size());
    if (p.numel() > chunk_numel)
      throw Error(str("memory.chunk_bytes gives chunks of ", chunk_numel, " elements, but parameter ", p.name, " has ",
                      p.numel(),
                      "; parameters are not split across chunks, so raise memory.chunk_bytes to hold at least ",
                      (p.numel() + step - 1) / step * step,
                      " elements (times the working precision's bytes), or set it to 0 to search the size"));
    if (packer.place(p.numel())) chunks_.push_back({id, id, p.offset, p.offset});
    Chunk& c = chunks_.back();
    c.end_param = id + 1;
    c.end = p.offset + p.numel();
    const int index = num_chunks() - 1;
    chunk_of_param_.push_back(index);
    std::vector<int>& of_group = chunks_of_group_.at(static_cast<size_t>(p.group));
    if (of_group.empty() || of_group.back() != index) of_group.push_back(index);
  }
}

FlatRange ChunkLayout::owned(int c, int r) const {
  LOOM_CHECK(r >= 0 && r < ranks_, "rank ", r, " of a chunk layout over ", ranks_, " ranks");
  const Chunk& ch = chunk(c);
  const int64_t s = shard_numel();
  return {std::min(ch.begin + r * s, ch.end), std::min(ch.begin + (r + 1) * s, ch.end)};
}

int64_t ChunkLayout::wasted_numel() const { return num_chunks() * chunk_numel_ - layout_.numel(); }

}  // namespace loom
