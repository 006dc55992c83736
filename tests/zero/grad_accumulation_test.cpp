// Gradient accumulation across micro-batches under bf16: fp32 sums, rounded
// to the working precision where the store documents it, never per
// micro-batch into a bf16 accumulator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "loom/device.h"
#include "loom/zero.h"
#include "zero_test_util.h"

namespace loom {
namespace {

constexpr int kMicroBatches = 16, kRanks = 2;

// Micro-batch m's gradient, on every element and rank: 1, then 15 times
// 2^-9. In bf16, 1 + 2^-9 rounds back to 1, so each small contribution
// vanishes from a bf16 accumulator; in fp32 they add up to 15/512.
float contribution(int m) { return m == 0 ? 1.0f : 0x1p-9f; }

// What the model does with a gradient: adds its contribution.
void accumulate(const Tensor& grad, float value) {
  Tensor add = Tensor::empty(grad.shape());
  add.fill_(value);
  ops::add_rounded(grad.raw(), DType::f32, add.data<float>(), grad.numel());
}

float bf16(float x) {
  round_to(&x, 1, DType::bf16);
  return x;
}

TEST(ZeroGradientAccumulation, SixteenBf16MicroBatchesMatchTheFp32Accumulation) {
  float fp32 = 0.0f, per_micro_batch = 0.0f;
  for (int m = 0; m < kMicroBatches; ++m) {
    fp32 += contribution(m);
    per_micro_batch = bf16(per_micro_batch + contribution(m));  // the rounding this store no longer does
  }
  const double exact = kRanks * static_cast<double>(fp32);
  // One bf16 rounding of the result is what the working precision allows.
  const double tolerance = 0x1p-8;
  const double old_error = std::fabs(kRanks * per_micro_batch - exact) / exact;
  EXPECT_GT(old_error, tolerance) << "the case must tell a bf16 accumulation apart";

  ParamLayout layout;
  const int a = layout.add_group("a");
  layout.add("a0", {1000}, ParamInit::normal_(0.02f), true, a);
  layout.add("a1", {999}, ParamInit::constant(1.0f), false, a);
  const int b = layout.add_group("b");
  layout.add("b0", {1001}, ParamInit::normal_(0.02f), true, b);
  for (int stage = 0; stage <= 3; ++stage) {
    // Stages 0-1 round the fp32 sum once before the bf16 reduction (exact:
    // both ranks hold the same value); stages 2-3 reduce each micro-batch's
    // rounded gradient (exact here) and accumulate the shards in fp32.
    const float expected = stage <= 1 ? kRanks * bf16(fp32) : kRanks * fp32;
    run_local(kRanks, [&](Communicator& dp) {
      const ZeroOptions opts{stage, DType::bf16, 2000};
      const ZeroPartition partition(layout, dp.size(), dp.rank(), 1000);
      ZeroGradStore grads(layout, partition, dp, opts);
      grads.zero();
      for (int m = 0; m < kMicroBatches; ++m) {
        grads.set_reduce(m + 1 == kMicroBatches);
        for (int group : {b, a}) {
          for (int id = 0; id < static_cast<int>(layout.params().size()); ++id)
            if (layout.param(id).group == group) accumulate(grads.grad(id), contribution(m));
          grads.group_ready(group);
        }
      }
      grads.finish();
      for (const ZeroBucket& bucket : partition.buckets()) {
        const FlatRange own = partition.owned(bucket);
        if (own.numel() == 0) continue;
        const Tensor g = grads.owned(own).clone(Tier::host);
        std::vector<float> values(static_cast<size_t>(own.numel()));
        convert(g.raw(), g.dtype(), values.data(), DType::f32, own.numel());
        for (size_t i = 0; i < values.size(); ++i) {
          ASSERT_EQ(values[i], expected) << "stage " << stage << ", rank " << dp.rank() << ", element "
                                         << own.begin + static_cast<int64_t>(i);
          ASSERT_LE(std::fabs(values[i] - exact) / exact, tolerance) << "stage " << stage;
        }
      }
    });
  }
}

// The fp32 reference rounded exactly where the bf16 path of one rank rounds:
// each step computes with the master weights rounded to bf16 (the working
// copy), and the update gets the micro-batches' fp32 gradient sum rounded
// once to bf16 (the reduced gradient) and applies it to the fp32 master
// weights.
std::vector<float> rounded_reference(int accumulation) {
  const testing::DataParallelRun r = testing::layout(0, 0, DType::f32, accumulation);
  const GPTConfig cfg = testing::small_gpt(0.0f);
  TrainOptions opts = testing::small_options(r);
  Trainer* self = nullptr;
  Trainer::State master;
  opts.on_gradients = [&](GradStore& g) {
    for (int id = 0; id < static_cast<int>(self->model().layout().params().size()); ++id) {
      const Tensor grad = g.grad(id);
      ops::round_to(grad.data<float>(), grad.numel(), DType::bf16);
    }
    self->load_state(master);
  };
  Trainer trainer(cfg, opts);
  self = &trainer;
  for (int step = 0; step < r.steps; ++step) {
    master = trainer.gather_state();
    Trainer::State working = trainer.gather_state();
    round_to(working.params.data<float>(), working.params.numel(), DType::bf16);
    trainer.load_state(working);
    trainer.step(testing::rank_micro_batches(testing::step_tokens(step, cfg.vocab_size), 1, 0, accumulation));
  }
  return testing::to_vector(trainer.gather_state().params);
}

TEST(ZeroGradientAccumulation, Bf16MatchesTheFp32ReferenceRoundedWhereItRounds) {
  // Stages 0-1 round the sum of two micro-batches once; stages 2-3 round
  // each micro-batch, which the reference matches with one micro-batch.
  for (int stage = 0; stage <= 3; ++stage) {
    const int accumulation = stage <= 1 ? 2 : 1;
    testing::RunResult ref;
    ref.model = testing::small_gpt(0.0f);
    ref.params = rounded_reference(accumulation);
    const testing::RunResult a = testing::run_layout(testing::layout(1, stage, DType::bf16, accumulation));
    const double diff = testing::param_rel_diff(a, ref);
    std::printf("stage %d, %d micro-batches: parameters after 20 steps within %.3g of the rounded reference\n", stage,
                accumulation, diff);
    EXPECT_LE(diff, 1e-5) << "stage " << stage;
  }
}

}  // namespace
}  // namespace loom
