// Several parameters multiplied as one: their tensors stacked by rows into
// one [rows, cols] tensor (the tensor itself when there is one), and copied
// back. Linear's parts and SummaLinear's pieces stack this way.
#pragma once

#include <vector>

#include "loom/device.h"

namespace loom::nn_detail {

inline Tensor stack_rows(const std::vector<Tensor>& pieces, int64_t rows, int64_t cols) {
  if (pieces.size() == 1) return pieces[0];
  Tensor out = Tensor::empty({rows, cols});
  size_t at = 0;
  for (const Tensor& p : pieces) {
    ops::copy(static_cast<char*>(out.raw()) + at, p.raw(), p.nbytes());
    at += p.nbytes();
  }
  return out;
}

inline void unstack_rows(const Tensor& stacked, const std::vector<Tensor>& pieces) {
  if (pieces.size() == 1) return;
  size_t at = 0;
  for (const Tensor& p : pieces) {
    ops::copy(p.raw(), static_cast<const char*>(stacked.raw()) + at, p.nbytes());
    at += p.nbytes();
  }
}

}  // namespace loom::nn_detail
