// The packing rule ChunkLayout follows and the chunk size search counts with,
// kept in one place so that the search's waste is the layout's.
#pragma once

#include <cstdint>

namespace loom::chunk_packing {

// Parameters are packed whole, in layout order: one opens a new chunk when it
// does not fit in what is left of the current one.
struct GreedyPacker {
  int64_t capacity = 0;
  int64_t fill = 0;  // elements of the current chunk in use
  int chunks = 0;

  // Places a parameter of `numel` elements; true when it opens a new chunk.
  bool place(int64_t numel) {
    const bool opens = chunks == 0 || numel > capacity - fill;
    if (opens) {
      ++chunks;
      fill = 0;
    }
    fill += numel;
    return opens;
  }
};

}  // namespace loom::chunk_packing
