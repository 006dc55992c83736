// How the CPU kernels split work so that results never depend on the number
// of threads: reductions over rows run over chunks whose size is fixed by the
// problem size alone, and chunk partials are summed in chunk order.
#pragma once

#include <cstdint>

namespace loom::cpu {

// Below about this many elements of work a parallel region costs more than it
// saves; kernels run serially there.
inline constexpr int64_t kMinParallelWork = 1 << 15;

// Rows per chunk of a column reduction (dbias of linear, dweight and dbias of
// layernorm): the partials take 1/kReduceRows of the input's memory.
inline constexpr int64_t kReduceRows = 32;

inline int64_t reduce_chunks(int64_t rows) { return (rows + kReduceRows - 1) / kReduceRows; }

// dst[c] += partials[0][c] + partials[1][c] + ... + partials[chunks-1][c],
// summed in that order; partials is [chunks, C] row-major.
void add_chunk_partials(float* dst, const float* partials, int64_t chunks, int64_t C);

}  // namespace loom::cpu
