// Several parameters multiplied as one: their tensors stacked by rows into
// one [rows, cols] tensor (the tensor itself when there is one), and copied
// or added back. Linear's parts and the grid layers' pieces stack this way.
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

// Adds `stacked` back into `pieces`, one after another (a stacked gradient
// into each parameter's).
inline void accumulate_rows(const Tensor& stacked, const std::vector<Tensor>& pieces) {
  int64_t at = 0;
  for (const Tensor& p : pieces) {
    ops::accumulate(p.data<float>(), stacked.data<float>() + at, p.numel());
    at += p.numel();
  }
}

// The tensors `get(id)` of each piece's weight, or of its bias (pieces with
// `weight` and `bias` ids: a grid layer's).
template <typename Piece, typename Get>
std::vector<Tensor> piece_tensors(const std::vector<Piece>& pieces, bool bias, Get&& get) {
  std::vector<Tensor> out;
  for (const Piece& p : pieces) out.push_back(get(bias ? p.bias : p.weight));
  return out;
}

}  // namespace loom::nn_detail
