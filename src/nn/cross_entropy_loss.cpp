#include <algorithm>

#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

namespace {

// dObjective/dloss_i for each of N positions.
Tensor per_position(float dloss, int64_t N) {
  Tensor dl = Tensor::empty({N});
  dl.fill_(dloss);
  return dl;
}

void check_sum(const Tensor& sum, int64_t terms) {
  LOOM_CHECK(sum.dtype() == DType::f64 && sum.numel() == terms, "a loss of ", terms, " terms added to a ",
             dtype_name(sum.dtype()), " sum of ", sum.numel());
}

}  // namespace

VocabularyLoss::Slice VocabularyLoss::slice() const {
  const int64_t first = tp_.rank() * local_vocab_;
  return {first, std::clamp<int64_t>(V_ - first, 0, local_vocab_)};
}

void CrossEntropyLoss::forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                               const Tensor& sum, std::optional<float> dloss) const {
  const int64_t N = targets.numel(), Vl = local_vocab_;
  LOOM_CHECK(logits.numel() == N * Vl && !teacher.defined(), "cross-entropy over ", logits.numel(), " logits and ", N,
             " targets", teacher.defined() ? " with a teacher's logits" : "");
  check_sum(sum, terms());
  s.lse = Tensor::empty({N});
  s.fused = dloss.has_value();
  Tensor losses = Tensor::empty({N}), dl;
  if (s.fused) dl = per_position(*dloss, N);
  float* x = logits.data<float>();
  const int32_t* t = targets.data<int32_t>();
  if (tp_.size() == 1) {
    if (s.fused)
      ops::cross_entropy_forward_backward(losses.data<float>(), s.lse.data<float>(), x, t, dl.data<float>(), N, V_);
    else
      ops::cross_entropy_forward(losses.data<float>(), s.lse.data<float>(), x, t, N, V_);
  } else {
    const Slice v = slice();
    Tensor row_max = Tensor::empty({N});
    ops::cross_entropy_shard_max(row_max.data<float>(), x, N, Vl, v.real);
    tp_.group->all_reduce(row_max, ReduceOp::max);
    Tensor sums = Tensor::empty({N, 2});
    ops::cross_entropy_shard_sums(sums.data<float>(), x, row_max.data<float>(), t, v.first, N, Vl, v.real);
    tp_.group->all_reduce(sums);
    ops::cross_entropy_shard_loss(losses.data<float>(), s.lse.data<float>(), row_max.data<float>(),
                                  sums.data<float>(), t, N);
    // The gradient needs the global lse, known only after the all-reduces.
    if (s.fused)
      ops::cross_entropy_shard_backward(x, x, s.lse.data<float>(), t, dl.data<float>(), v.first, N, Vl, v.real);
  }
  // Positions without a target have a loss of exactly 0, so the sum over
  // every position is the sum over the targets, in the same order.
  ops::add_sum_f64(sum.data<double>(), losses.data<float>(), N);
}

void CrossEntropyLoss::backward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor&,
                                float dloss) const {
  LOOM_CHECK(s.lse.defined(), "cross-entropy backward without a preceding forward");
  if (s.fused) return;
  const int64_t N = targets.numel(), Vl = local_vocab_;
  const Tensor dl = per_position(dloss, N);
  float* x = logits.data<float>();
  if (tp_.size() == 1) {
    ops::cross_entropy_backward(x, x, s.lse.data<float>(), targets.data<int32_t>(), dl.data<float>(), N, V_);
  } else {
    const Slice v = slice();
    ops::cross_entropy_shard_backward(x, x, s.lse.data<float>(), targets.data<int32_t>(), dl.data<float>(), v.first,
                                      N, Vl, v.real);
  }
}

DistillationLoss::DistillationLoss(int64_t vocab_size, int64_t local_vocab, const TensorParallel& tp, Distillation d)
    : VocabularyLoss(vocab_size, local_vocab, tp), d_(d) {
  LOOM_CHECK(d.temperature > 0.0f && d.alpha >= 0.0f && d.alpha <= 1.0f, "distillation at temperature ",
             d.temperature, " with alpha ", d.alpha);
}

void DistillationLoss::forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                               const Tensor& sum, std::optional<float> dloss) const {
  const int64_t N = targets.numel(), Vl = local_vocab_;
  LOOM_CHECK(logits.numel() == N * Vl && teacher.defined() && teacher.numel() == N * Vl, "distillation over ",
             logits.numel(), " logits, ", N, " targets and ", teacher.defined() ? teacher.numel() : 0,
             " teacher logits");
  check_sum(sum, terms());
  s.lse = Tensor::empty({N, 3});
  s.fused = dloss.has_value();
  Tensor losses = Tensor::empty({N}), kl = Tensor::empty({N}), ce = Tensor::empty({N}), dl;
  if (s.fused) dl = per_position(*dloss, N);
  float* x = logits.data<float>();
  const float* z = teacher.data<float>();
  const int32_t* t = targets.data<int32_t>();
  float* stats = s.lse.data<float>();
  if (tp_.size() == 1) {
    if (s.fused)
      ops::distill_forward_backward(losses.data<float>(), kl.data<float>(), ce.data<float>(), stats, x, z, t,
                                    dl.data<float>(), d_, N, V_);
    else
      ops::distill_forward(losses.data<float>(), kl.data<float>(), ce.data<float>(), stats, x, z, t, d_, N, V_);
  } else {
    const Slice v = slice();
    Tensor row_max = Tensor::empty({N, 2});
    ops::distill_shard_max(row_max.data<float>(), x, z, N, Vl, v.real);
    tp_.group->all_reduce(row_max, ReduceOp::max);
    Tensor sums = Tensor::empty({N, 5});
    ops::distill_shard_sums(sums.data<float>(), x, z, row_max.data<float>(), t, d_, v.first, N, Vl, v.real);
    tp_.group->all_reduce(sums);
    ops::distill_shard_loss(losses.data<float>(), kl.data<float>(), ce.data<float>(), stats, row_max.data<float>(),
                            sums.data<float>(), t, d_, N);
    if (s.fused) ops::distill_shard_backward(x, x, z, stats, t, dl.data<float>(), d_, v.first, N, Vl, v.real);
  }
  double* out = sum.data<double>();
  ops::add_sum_f64(out, losses.data<float>(), N);
  ops::add_sum_f64(out + 1, kl.data<float>(), N);
  ops::add_sum_f64(out + 2, ce.data<float>(), N);
}

void DistillationLoss::backward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                                float dloss) const {
  LOOM_CHECK(s.lse.defined() && teacher.defined(), "distillation backward without a preceding forward");
  if (s.fused) return;
  const int64_t N = targets.numel(), Vl = local_vocab_;
  const Tensor dl = per_position(dloss, N);
  float* x = logits.data<float>();
  const float* z = teacher.data<float>();
  const int32_t* t = targets.data<int32_t>();
  if (tp_.size() == 1) {
    ops::distill_backward(x, x, z, s.lse.data<float>(), t, dl.data<float>(), d_, N, V_);
  } else {
    const Slice v = slice();
    ops::distill_shard_backward(x, x, z, s.lse.data<float>(), t, dl.data<float>(), d_, v.first, N, Vl, v.real);
  }
}

}  // namespace loom
