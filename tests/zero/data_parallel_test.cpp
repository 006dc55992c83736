// Every data-parallel layout reproduces the single-rank fp32 reference.
#include <gtest/gtest.h>

#include "zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

const RunResult& reference() {
  static const RunResult ref = testing::run_layout(testing::layout(0, 0));
  return ref;
}

struct Layout {
  int dp, stage;
};

class DataParallelFp32 : public ::testing::TestWithParam<Layout> {};

TEST_P(DataParallelFp32, MatchesTheReferenceAndIsBitIdenticalRunToRun) {
  const Layout l = GetParam();
  const RunResult a = testing::run_layout(testing::layout(l.dp, l.stage));
  ASSERT_EQ(a.stats.size(), 20u);
  EXPECT_TRUE(testing::matches_reference(a, reference(), 1e-5));
  std::printf("max loss rel diff %.3g, params rel diff %.3g, key bias max abs diff %.3g\n",
              testing::max_loss_rel_diff(a, reference()), testing::param_rel_diff(a, reference()),
              testing::key_bias_max_abs_diff(a, reference()));
  // Noise-driven, so only bounded: 20 steps of at most lr * 1e-3.
  EXPECT_LE(testing::key_bias_max_abs_diff(a, reference()), 20 * 1e-3 * 1e-3);
  const RunResult b = testing::run_layout(testing::layout(l.dp, l.stage));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, b.exp_avg_sq));
}

std::vector<Layout> all_layouts() {
  std::vector<Layout> v;
  for (int dp : {1, 2, 4})
    for (int stage : {0, 1, 2, 3}) v.push_back({dp, stage});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataParallelFp32, ::testing::ValuesIn(all_layouts()),
                         [](const ::testing::TestParamInfo<Layout>& i) {
                           return "dp" + std::to_string(i.param.dp) + "_stage" + std::to_string(i.param.stage);
                         });

TEST(DataParallel, GradientAccumulationMatchesTheReference) {
  for (int stage : {0, 2, 3}) {
    const RunResult a = testing::run_layout(testing::layout(2, stage, DType::f32, 2));
    EXPECT_TRUE(testing::matches_reference(a, reference(), 1e-5)) << "stage " << stage;
  }
}

TEST(DataParallel, DropoutMasksDoNotDependOnTheLayout) {
  DataParallelRun r = testing::layout(0, 0);
  r.dropout = 0.1f;
  r.steps = 5;
  const RunResult ref = testing::run_layout(r);
  r = testing::layout(4, 1, DType::f32, 2);
  r.dropout = 0.1f;
  r.steps = 5;
  const RunResult a = testing::run_layout(r);
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
}

// Ranks with unequal numbers of targets (masked prompts): the objective is
// the mean over the global batch's targets, not the mean of the ranks' means.
TEST(DataParallel, MaskedTargetsAreNormalizedOverTheGlobalBatch) {
  DataParallelRun r = testing::layout(0, 0);
  r.masked_targets = true;
  r.steps = 5;
  const RunResult ref = testing::run_layout(r);
  EXPECT_FALSE(testing::matches_reference(ref, [] {
    DataParallelRun unmasked = testing::layout(0, 0);
    unmasked.steps = 5;
    return testing::run_layout(unmasked);
  }(), 1e-3));
  for (auto [dp, stage, accumulation] : {std::tuple{2, 0, 1}, {2, 2, 2}, {4, 1, 1}}) {
    r = testing::layout(dp, stage, DType::f32, accumulation);
    r.masked_targets = true;
    r.steps = 5;
    EXPECT_TRUE(testing::matches_reference(testing::run_layout(r), ref, 1e-5))
        << "dp " << dp << " stage " << stage << " accumulation " << accumulation;
  }
}

// The comparison can fail: with every floating-point sum of the data-parallel
// group doubled, the gradients are twice the reference's.
TEST(DataParallel, ADoubledGradientReductionFailsTheComparison) {
  for (int stage : {0, 2}) {
    DataParallelRun r = testing::layout(2, stage);
    r.doubled_sums = MeshAxis::dp;
    const ::testing::AssertionResult match = testing::matches_reference(testing::run_layout(r), reference(), 1e-5);
    EXPECT_FALSE(match) << "stage " << stage;
    EXPECT_CONTAINS(std::string(match.message()), "step-0 gradient of");
    EXPECT_CONTAINS(std::string(match.message()), "gradient norm of step");
  }
}

// Forwards to the ZeRO gradient store, recording at each group_ready how many
// reductions the data-parallel group had issued before it.
class CountingGradStore final : public GradStore {
 public:
  CountingGradStore(const ParamLayout& layout, GradStore& inner, const Communicator& dp)
      : GradStore(layout, NoStorage{}), inner_(inner), dp_(dp) {}
  Tensor grad(int id) const override { return inner_.grad(id); }
  void zero() override { inner_.zero(); }
  void set_reduce(bool reduce) override { inner_.set_reduce(reduce); }
  void group_ready(int group) override {
    issued_before_ready.push_back(reductions());
    inner_.group_ready(group);
  }
  void finish() override { inner_.finish(); }

  int64_t reductions() const { return dp_.stats().all_reduce.calls + dp_.stats().reduce_scatter.calls; }
  std::vector<int64_t> issued_before_ready;

 private:
  GradStore& inner_;
  const Communicator& dp_;
};

// Overlap: by the time backward reports its last group ready (the
// embedding's), buckets of the later layers are already being reduced.
TEST(DataParallel, BucketReductionsStartBeforeBackwardEnds) {
  for (int stage : {0, 1, 2, 3}) {
    run_local(2, [&](Communicator& dp) {
      const GPTConfig cfg = testing::small_gpt(0.0f);
      const ZeroOptions opts = testing::small_options(testing::layout(2, stage)).zero;
      GPT model(cfg);
      const int64_t bucket_numel = stage == 3 ? 0 : opts.bucket_bytes / 4;
      const ZeroPartition partition(model.layout(), dp.size(), dp.rank(), bucket_numel);
      ASSERT_GE(partition.buckets().size(), 3u);
      ZeroParamStore params(model.layout(), partition, dp, opts, 1337);
      ZeroGradStore zero_grads(model.layout(), partition, dp, opts);
      CountingGradStore grads(model.layout(), zero_grads, dp);
      const std::vector<int32_t> data = testing::step_tokens(0, cfg.vocab_size);
      const MicroBatch mb = testing::rank_micro_batches(data, 2, dp.rank(), 1)[0];
      grads.zero();
      params.begin_step();
      ForwardOptions fo;
      fo.training = true;
      fo.first_sequence = mb.first_sequence;
      MicroBatchState state;
      model.forward(params, state, mb.tokens, mb.targets, mb.shape, fo);
      const int64_t before = grads.reductions();
      model.backward(params, grads, state, 1.0f / static_cast<float>(testing::kGlobal * testing::kT));
      const int64_t during = grads.issued_before_ready.back() - before;
      grads.finish();
      params.end_step();
      EXPECT_GT(during, 0) << "stage " << stage;
      // One reduction per bucket, the last one started by the last group.
      EXPECT_EQ(grads.reductions() - before, static_cast<int64_t>(partition.buckets().size())) << "stage " << stage;
      EXPECT_LT(during, static_cast<int64_t>(partition.buckets().size())) << "stage " << stage;
    });
  }
}

struct MixedLayout {
  int dp, stage;
  DType precision;
};

class DataParallelMixedPrecision : public ::testing::TestWithParam<MixedLayout> {};

TEST_P(DataParallelMixedPrecision, StaysWithinOnePercentOfTheFp32Reference) {
  const MixedLayout l = GetParam();
  const RunResult a = testing::run_layout(testing::layout(l.dp, l.stage, l.precision));
  // The gradients too, unscaled by the fp16 loss scale.
  EXPECT_TRUE(testing::matches_reference(a, reference(), 1e-2));
  for (const StepStats& s : a.stats) EXPECT_FALSE(s.skipped);
  const RunResult b = testing::run_layout(testing::layout(l.dp, l.stage, l.precision));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
}

std::vector<MixedLayout> mixed_layouts() {
  std::vector<MixedLayout> v;
  for (DType p : {DType::bf16, DType::f16})
    for (int dp : {1, 2, 4})
      for (int stage : {0, 1, 2, 3}) v.push_back({dp, stage, p});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataParallelMixedPrecision, ::testing::ValuesIn(mixed_layouts()),
                         [](const ::testing::TestParamInfo<MixedLayout>& i) {
                           return std::string(dtype_name(i.param.precision)) + "_dp" + std::to_string(i.param.dp) +
                                  "_stage" + std::to_string(i.param.stage);
                         });

TEST(DataParallel, MixedPrecisionNeedsACommunicator) {
  TrainOptions o;
  o.zero.precision = DType::bf16;
  EXPECT_CONTAINS(testing::error_of([&] { Trainer t(testing::small_gpt(0.0f), o); }), "communicator");
}

}  // namespace
}  // namespace loom
