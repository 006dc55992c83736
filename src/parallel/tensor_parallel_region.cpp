// Megatron's f and g operators, with their sequence-parallel counterparts.
// The all-reduce forms work in place, so the plain tensor-parallel path costs
// no extra activation memory; the sequence-parallel forms change the number
// of rows and so return new tensors.
#include "loom/parallel.h"

namespace loom {

namespace {

// The same tensor with `rows` token rows of its last dimension.
Shape with_rows(const Tensor& t, int64_t rows) {
  const int64_t width = t.dim(t.ndim() - 1);
  return {rows, width};
}

int64_t rows_of(const Tensor& t) { return t.numel() / t.dim(t.ndim() - 1); }

Tensor all_gather_rows(Communicator& group, const Tensor& x) {
  Tensor full = Tensor::empty(with_rows(x, rows_of(x) * group.size()), x.dtype());
  group.all_gather(x, full);
  return full;
}

Tensor reduce_scatter_rows(Communicator& group, const Tensor& x) {
  const int64_t rows = rows_of(x);
  LOOM_CHECK(rows % group.size() == 0, rows, " token rows do not split over ", group.size(), " ranks");
  Tensor mine = Tensor::empty(with_rows(x, rows / group.size()), x.dtype());
  group.reduce_scatter(x, mine);
  return mine;
}

}  // namespace

Tensor TensorParallelRegion::enter_forward(const TensorParallel& tp, const Tensor& x) {
  return tp.splits_tokens() ? all_gather_rows(*tp.group, x) : x;
}

Tensor TensorParallelRegion::enter_backward(const TensorParallel& tp, const Tensor& dx) {
  if (tp.size() == 1) return dx;
  if (tp.splits_tokens()) return reduce_scatter_rows(*tp.group, dx);
  tp.group->all_reduce(dx);
  return dx;
}

Tensor TensorParallelRegion::leave_forward(const TensorParallel& tp, const Tensor& y) {
  if (tp.size() == 1) return y;
  if (tp.splits_tokens()) return reduce_scatter_rows(*tp.group, y);
  tp.group->all_reduce(y);
  return y;
}

Tensor TensorParallelRegion::leave_backward(const TensorParallel& tp, const Tensor& dy) {
  return tp.splits_tokens() ? all_gather_rows(*tp.group, dy) : dy;
}

}  // namespace loom
