#include <algorithm>

#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

CrossEntropyLoss::CrossEntropyLoss(int64_t vocab_size, int64_t local_vocab, const TensorParallel& tp)
    : V_(vocab_size), local_vocab_(local_vocab), tp_(tp) {}

void CrossEntropyLoss::forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& sum,
                               std::optional<float> dloss) const {
  const int64_t N = targets.numel(), Vl = local_vocab_;
  LOOM_CHECK(logits.numel() == N * Vl && sum.dtype() == DType::f64 && sum.numel() == 1,
             "cross-entropy over ", logits.numel(), " logits, ", N, " targets and a ", dtype_name(sum.dtype()),
             " sum");
  s.lse = Tensor::empty({N});
  s.fused = dloss.has_value();
  Tensor losses = Tensor::empty({N}), dl;
  if (s.fused) {
    dl = Tensor::empty({N});
    dl.fill_(*dloss);
  }
  float* x = logits.data<float>();
  const int32_t* t = targets.data<int32_t>();
  if (tp_.size() == 1) {
    if (s.fused)
      ops::cross_entropy_forward_backward(losses.data<float>(), s.lse.data<float>(), x, t, dl.data<float>(), N, V_);
    else
      ops::cross_entropy_forward(losses.data<float>(), s.lse.data<float>(), x, t, N, V_);
  } else {
    const int64_t first = tp_.rank() * Vl, real = std::clamp<int64_t>(V_ - first, 0, Vl);
    Tensor row_max = Tensor::empty({N});
    ops::cross_entropy_shard_max(row_max.data<float>(), x, N, Vl, real);
    tp_.group->all_reduce(row_max, ReduceOp::max);
    Tensor sums = Tensor::empty({N, 2});
    ops::cross_entropy_shard_sums(sums.data<float>(), x, row_max.data<float>(), t, first, N, Vl, real);
    tp_.group->all_reduce(sums);
    ops::cross_entropy_shard_loss(losses.data<float>(), s.lse.data<float>(), row_max.data<float>(),
                                  sums.data<float>(), t, N);
    // The gradient needs the global lse, known only after the all-reduces.
    if (s.fused)
      ops::cross_entropy_shard_backward(x, x, s.lse.data<float>(), t, dl.data<float>(), first, N, Vl, real);
  }
  // Positions without a target have a loss of exactly 0, so the sum over
  // every position is the sum over the targets, in the same order.
  ops::add_sum_f64(sum.data<double>(), losses.data<float>(), N);
}

void CrossEntropyLoss::backward(Saved& s, const Tensor& logits, const Tensor& targets, float dloss) const {
  LOOM_CHECK(s.lse.defined(), "cross-entropy backward without a preceding forward");
  if (s.fused) return;
  const int64_t N = targets.numel(), Vl = local_vocab_;
  Tensor dl = Tensor::empty({N});
  dl.fill_(dloss);
  float* x = logits.data<float>();
  if (tp_.size() == 1) {
    ops::cross_entropy_backward(x, x, s.lse.data<float>(), targets.data<int32_t>(), dl.data<float>(), N, V_);
  } else {
    const int64_t first = tp_.rank() * Vl, real = std::clamp<int64_t>(V_ - first, 0, Vl);
    ops::cross_entropy_shard_backward(x, x, s.lse.data<float>(), targets.data<int32_t>(), dl.data<float>(), first,
                                      N, Vl, real);
  }
}

}  // namespace loom
