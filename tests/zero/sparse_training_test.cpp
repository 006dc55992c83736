// Fine-tuning a pruned model keeps its masks (AdamWConfig::keep_zeros) under
// every layout: the pruned weights stay exactly zero through 20 steps with
// ZeRO 0-3 over dp 2, tensor parallelism over 2 ranks (alone and with ZeRO-1
// over dp 2) and chunk placement with offloaded optimizer state, and
// each run matches the single-rank masked run.
#include <gtest/gtest.h>

#include "loom/prune.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

// Every rank prunes the fresh weights alike (magnitude, half of each linear
// weight), as a pruned checkpoint's weights would arrive.
void prune_at_start(Trainer& t) {
  Trainer::State s = t.gather_state();
  const GPT whole(t.model().config());
  ParamStore ps(whole.layout(), 0);
  ps.flat().copy_from(s.params);
  prune_model(whole, ps, {.sparsity = 0.5});
  s.params.copy_from(ps.flat());
  t.load_state(s);
}

DataParallelRun sparse(DataParallelRun r, bool keep = true) {
  r.init = prune_at_start;
  const GPT model(testing::small_gpt(r.dropout, r.n_layer, r.n_head));
  if (keep)
    for (int id : prunable_params(model.layout())) r.keep_zeros.push_back(model.layout().param(id).name);
  return r;
}

const RunResult& reference() {
  static const RunResult ref = testing::run_layout(sparse(testing::layout(0, 0)));
  return ref;
}

// The elements of the pruned matrices that the pruning zeroed.
std::vector<size_t> pruned_elements(const RunResult& r) {
  const GPT model(r.model);
  std::vector<size_t> at;
  for (int id : prunable_params(model.layout())) {
    const ParamSpec& p = model.layout().param(id);
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i)
      if (r.initial_params[static_cast<size_t>(i)] == 0.0f) at.push_back(static_cast<size_t>(i));
  }
  return at;
}

// How many of them are zero in r's final parameters.
int64_t zeros_kept(const RunResult& r) {
  int64_t kept = 0;
  for (size_t i : pruned_elements(r)) kept += r.params[i] == 0.0f;
  return kept;
}

TEST(SparseTraining, TheReferenceKeepsThePrunedWeightsZeroAndTrainsTheRest) {
  const RunResult& ref = reference();
  const GPT model(ref.model);
  int64_t half = 0;
  for (int id : prunable_params(model.layout())) half += model.layout().param(id).numel() / 2;
  const int64_t pruned = static_cast<int64_t>(pruned_elements(ref).size());
  EXPECT_EQ(pruned, half);
  EXPECT_EQ(zeros_kept(ref), pruned);
  int64_t trained = 0;
  for (size_t i = 0; i < ref.params.size(); ++i)
    trained += ref.initial_params[i] != 0.0f && ref.params[i] != ref.initial_params[i];
  EXPECT_GT(trained, static_cast<int64_t>(ref.params.size()) / 2);
  // Without the masks the zeros train like any weight.
  const RunResult free = testing::run_layout(sparse(testing::layout(0, 0), false));
  EXPECT_EQ(free.initial_params, ref.initial_params);
  EXPECT_LT(zeros_kept(free), pruned / 100);
}

using Case = testing::NamedLayout;

class SparseLayouts : public ::testing::TestWithParam<Case> {};

TEST_P(SparseLayouts, KeepTheMasksAndMatchTheMaskedReference) {
  const RunResult a = testing::run_layout(sparse(GetParam().run));
  const RunResult& ref = reference();
  ASSERT_EQ(a.initial_params, ref.initial_params);
  EXPECT_EQ(zeros_kept(a), static_cast<int64_t>(pruned_elements(ref).size()));
  EXPECT_LE(testing::max_loss_rel_diff(a, ref), 1e-5);
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
}

std::vector<Case> cases() {
  std::vector<Case> v = testing::store_family_layouts();
  DataParallelRun dp_tp = testing::layout(2, 1);
  dp_tp.tp = 2;
  v.push_back({"dp2_tp2_zero1", dp_tp});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, SparseLayouts, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace loom
