// The element-wise work of the collectives: the fixed-order reduction and a
// copy that uses the calling rank's thread budget.
#pragma once

#include <cstddef>
#include <cstdint>

#include "loom/comm.h"

namespace loom::detail {

// For every i in [0, count) and every output j:
//   outputs[j][i] = op(... op(op(inputs[0][i], inputs[1][i]), inputs[2][i]) ..., inputs[n-1][i])
// with the accumulation rules of comm.h (fp32 for floating dtypes, rounded once;
// 64-bit integers otherwise; avg divides by num_inputs at the end). An output
// may alias an input at the same positions (in place): every block of
// elements is read from all inputs before any output is written.
void reduce_into(const void* const* inputs, int num_inputs, void* const* outputs, int num_outputs, int64_t count,
                 DType dtype, ReduceOp op);

// memcpy, split across the calling thread's OpenMP threads for large copies.
void copy_bytes(void* dst, const void* src, size_t bytes);

}  // namespace loom::detail
