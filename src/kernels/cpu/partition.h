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

// gemm (kernels.h) for a product whose inner dimension K is long and whose C
// is small: weight gradients, where K is the token count. Besides C's tiles,
// K is cut into chunks fixed by the shape, each chunk's product computed on
// its own, and the chunk products added into C in chunk order, so the result
// does not depend on the thread count and a small C still keeps every thread
// busy. Costs (chunks - 1) M N floats of scratch.
void gemm_split_k(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                  int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace loom::cpu
