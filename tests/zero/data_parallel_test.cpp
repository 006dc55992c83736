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
  EXPECT_LE(testing::max_loss_rel_diff(a, reference()), 1e-5);
  EXPECT_LE(testing::param_rel_diff(a, reference()), 1e-5);
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
    EXPECT_LE(testing::max_loss_rel_diff(a, reference()), 1e-5) << "stage " << stage;
    EXPECT_LE(testing::param_rel_diff(a, reference()), 1e-5) << "stage " << stage;
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
  EXPECT_LE(testing::max_loss_rel_diff(a, ref), 1e-5);
}

struct MixedLayout {
  int dp, stage;
  DType precision;
};

class DataParallelMixedPrecision : public ::testing::TestWithParam<MixedLayout> {};

TEST_P(DataParallelMixedPrecision, StaysWithinOnePercentOfTheFp32Reference) {
  const MixedLayout l = GetParam();
  const RunResult a = testing::run_layout(testing::layout(l.dp, l.stage, l.precision));
  EXPECT_LE(testing::max_loss_rel_diff(a, reference()), 1e-2);
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
