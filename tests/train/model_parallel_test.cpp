// Tensor-, sequence- and pipeline-parallel layouts, alone and composed with
// data parallelism, ZeRO-1 and activation checkpointing, reproduce the
// single-rank fp32 reference, and each is bit-identical run to run.
#include <gtest/gtest.h>

#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

// 8 layers so that 4 pipeline ranks can hold 2 chunks each; 4 heads so that
// 4 tensor-parallel ranks hold one each; vocabulary 61 pads to 62 and 64.
constexpr int kLayers = 8, kHeads = 4;

struct Layout {
  std::string name;
  int dp = 1, tp = 1, pp = 1;
  bool sequence_parallel = false;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;
  int stage = 0;
  bool checkpoint = false;
  int accumulation = 1;  // micro-batches per step and data-parallel rank
};

DataParallelRun run_of(const Layout& l) {
  DataParallelRun r = testing::layout(l.dp, l.stage, DType::f32, l.accumulation);
  r.tp = l.tp;
  r.pp = l.pp;
  r.mesh = true;
  r.n_layer = kLayers;
  r.n_head = kHeads;
  r.checkpoint_activations = l.checkpoint;
  r.model_parallel.sequence_parallel = l.sequence_parallel;
  r.model_parallel.schedule = l.schedule;
  r.model_parallel.virtual_stages = l.virtual_stages;
  return r;
}

const RunResult& reference() {
  static const RunResult ref = [] {
    DataParallelRun r = testing::layout(0, 0);
    r.n_layer = kLayers;
    r.n_head = kHeads;
    return testing::run_layout(r);
  }();
  return ref;
}

class ModelParallelFp32 : public ::testing::TestWithParam<Layout> {};

TEST_P(ModelParallelFp32, MatchesTheReferenceAndIsBitIdenticalRunToRun) {
  const Layout l = GetParam();
  const RunResult a = testing::run_layout(run_of(l));
  ASSERT_EQ(a.stats.size(), 20u);
  const double loss = testing::max_loss_rel_diff(a, reference()), params = testing::param_rel_diff(a, reference()),
               key_bias = testing::key_bias_max_abs_diff(a, reference());
  std::printf("%s: max loss rel diff %.3g, params rel diff %.3g, key bias max abs diff %.3g\n", l.name.c_str(), loss,
              params, key_bias);
  EXPECT_LE(loss, 1e-5);
  EXPECT_LE(params, 1e-5);
  // Noise-driven (see is_key_bias), so only bounded: 20 steps of at most lr * 1e-3.
  EXPECT_LE(key_bias, 20 * 1e-3 * 1e-3);
  const RunResult b = testing::run_layout(run_of(l));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, b.exp_avg_sq));
}

std::vector<Layout> layouts() {
  using S = PipelineSchedule;
  std::vector<Layout> v;
  v.push_back({.name = "tp2", .tp = 2});
  v.push_back({.name = "tp4", .tp = 4});
  v.push_back({.name = "tp2_sp", .tp = 2, .sequence_parallel = true});
  for (int pp : {2, 4}) {
    const std::string p = "pp" + std::to_string(pp);
    v.push_back({.name = p + "_gpipe", .pp = pp, .schedule = S::gpipe, .accumulation = 4});
    v.push_back({.name = p + "_1f1b", .pp = pp, .schedule = S::one_f_one_b, .accumulation = 4});
    v.push_back({.name = p + "_interleaved", .pp = pp, .schedule = S::interleaved_1f1b, .virtual_stages = 2,
                 .accumulation = 4});
  }
  const std::vector<Layout> hybrids = {
      {.name = "dp2_tp2", .dp = 2, .tp = 2},
      {.name = "dp2_pp2", .dp = 2, .pp = 2, .accumulation = 2},
      {.name = "tp2_pp2", .tp = 2, .pp = 2, .accumulation = 2},
      {.name = "dp2_tp2_pp2", .dp = 2, .tp = 2, .pp = 2, .accumulation = 2},
  };
  for (const Layout& h : hybrids) {
    v.push_back(h);
    Layout zero1 = h;
    zero1.name += "_zero1";
    zero1.stage = 1;
    v.push_back(zero1);
    Layout ckpt = h;
    ckpt.name += "_checkpointing";
    ckpt.checkpoint = true;
    v.push_back(ckpt);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ModelParallelFp32, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

}  // namespace
}  // namespace loom
