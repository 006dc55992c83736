// Several parameters multiplied as one: their tensors stacked by rows into
// one [rows, cols] tensor (the tensor itself when there is one), and copied
// or added back. Linear's parts and the grid layers' pieces stack this way.
#pragma once

#include <vector>

#include "loom/device.h"
#include "loom/nn.h"

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

// Whether any piece's weight (or bias) has a gradient: a layer whose pieces
// are all frozen computes none. Every rank of a grid holds the same pieces,
// so all of them skip the same collectives.
template <typename Piece>
bool any_grad(const std::vector<Piece>& pieces, bool bias, const Grads& g) {
  for (const Piece& p : pieces)
    if (g.grads.grad(bias ? p.bias : p.weight).defined()) return true;
  return false;
}

// Adds `stacked` (pieces' weights, or biases, stacked by rows: a grid
// layer's gradient) back into each piece's gradient; a frozen piece (no
// gradient) is stepped over.
template <typename Piece>
void accumulate_grads(const Tensor& stacked, const std::vector<Piece>& pieces, bool bias, const Grads& g) {
  int64_t at = 0;
  for (const Piece& p : pieces) {
    const int id = bias ? p.bias : p.weight;
    const Tensor grad = g.grads.grad(id);
    if (grad.defined()) ops::accumulate(grad.data<float>(), stacked.data<float>() + at, grad.numel());
    at += g.params.layout().param(id).numel();
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
