// Knowledge distillation in the Trainer: the teacher's logits feed
// DistillationLoss in the same micro-batch step, under every layout.
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

// The parts a step logged, by name.
double part(const StepStats& st, std::string_view name) {
  for (const auto& [n, v] : st.loss_parts)
    if (n == name) return v;
  ADD_FAILURE() << "no loss part " << name;
  return NAN;
}

// A teacher other than the student: one layer fewer, wider, another
// variant, the same vocabulary.
GPTConfig other_teacher() {
  GPTConfig t = testing::small_gpt(0.0f, 1, 2);
  t.n_embd = 48;
  return t;
}

DataParallelRun distilled(int dp, DistillOptions d, int steps) {
  DataParallelRun r = testing::layout(dp, 0);
  r.steps = steps;
  r.distill = d;
  return r;
}

TEST(Distillation, ATeacherEqualToTheInitializationHasZeroKLAtStepZero) {
  // Same config, same seed: the teacher starts as the student does.
  const GPTConfig student = testing::small_gpt(0.0f);
  const RunResult pure = testing::run_layout(distilled(0, {student, {2.0f, 1.0f}}, 1));
  EXPECT_NEAR(pure.stats[0].loss, 0.0f, 1e-6f);
  EXPECT_NEAR(part(pure.stats[0], "kl"), 0.0, 1e-7);
  // The cross-entropy part is still measured: near ln V at initialization.
  EXPECT_NEAR(part(pure.stats[0], "ce"), std::log(61.0), 0.1);
  const RunResult mixed = testing::run_layout(distilled(0, {student, {2.0f, 0.25f}}, 1));
  EXPECT_NEAR(mixed.stats[0].loss, 0.75 * part(mixed.stats[0], "ce"), 1e-6);
}

TEST(Distillation, TheLossIsTheWeightedSumOfItsParts) {
  const Distillation w{3.0f, 0.6f};
  const RunResult r = testing::run_layout(distilled(0, {other_teacher(), w}, 6));
  for (const StepStats& st : r.stats) {
    const double want = w.alpha * w.temperature * w.temperature * part(st, "kl") + (1 - w.alpha) * part(st, "ce");
    EXPECT_NEAR(st.loss, want, 1e-5 * want);
  }
  EXPECT_GT(part(r.stats[0], "kl"), 0.0);
  // Cross-entropy alone reports no parts, and alpha 0 trains on it alone.
  const RunResult plain = testing::run_layout(testing::layout(0, 0));
  EXPECT_TRUE(plain.stats[0].loss_parts.empty());
  const RunResult ce_only = testing::run_layout(distilled(0, {other_teacher(), {2.0f, 0.0f}}, 1));
  EXPECT_EQ(ce_only.stats[0].loss, plain.stats[0].loss);
}

struct DistillLayout {
  std::string name;
  int dp = 0, tp = 1;
  bool sequence_parallel = false, masked = false;
};

class DistillationLayouts : public ::testing::TestWithParam<DistillLayout> {};

DataParallelRun run_of(const DistillLayout& l) {
  DataParallelRun r = distilled(l.dp, {other_teacher(), {2.0f, 0.7f}}, 4);
  r.tp = l.tp;
  r.model_parallel.sequence_parallel = l.sequence_parallel;
  r.masked_targets = l.masked;
  return r;
}

TEST_P(DistillationLayouts, MatchTheSingleRankRun) {
  const DistillLayout l = GetParam();
  DistillLayout single;
  single.masked = l.masked;
  const RunResult ref = testing::run_layout(run_of(single)), a = testing::run_layout(run_of(l));
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  // A KL near 0 is a difference of log-sum-exps of the loss's size, whose
  // rounding it keeps: the parts are compared at the loss's scale.
  for (size_t s = 0; s < ref.stats.size(); ++s)
    for (const char* name : {"kl", "ce"})
      EXPECT_NEAR(part(a.stats[s], name), part(ref.stats[s], name), 1e-5 * ref.stats[s].loss)
          << name << " of step " << s;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DistillationLayouts,
                         ::testing::Values(DistillLayout{.name = "dp2", .dp = 2},
                                           DistillLayout{.name = "dp2_masked", .dp = 2, .masked = true},
                                           DistillLayout{.name = "tp2", .dp = 1, .tp = 2},
                                           DistillLayout{.name = "dp2_tp2_sp", .dp = 2, .tp = 2,
                                                         .sequence_parallel = true}),
                         [](const auto& info) { return info.param.name; });

// The teacher's weights from a Hugging Face checkpoint, whole and split
// over tp: a student imported from the same checkpoint has zero KL, one that
// is not has some.
TEST(Distillation, AHuggingFaceTeacherLoadsIntoEveryLayout) {
  const std::string dir = LOOM_SOURCE_DIR "/tests/fixtures/hf/gpt2";
  const HFImport src{std::filesystem::path(dir)};
  for (int tp : {1, 2}) {
    DataParallelRun r = distilled(tp == 1 ? 0 : 1, {src.model, {2.0f, 1.0f}}, 1);
    r.tp = tp;
    r.model = src.model;
    r.init = [&](Trainer& t) {
      load_hf_weights(src, t);
      load_teacher("hf:" + dir, t);
    };
    const RunResult same = testing::run_layout(r);
    EXPECT_NEAR(same.stats[0].loss, 0.0f, 1e-6f) << "tp " << tp;
    EXPECT_NEAR(part(same.stats[0], "kl"), 0.0, 1e-7) << "tp " << tp;
    r.init = [&](Trainer& t) { load_teacher("hf:" + dir, t); };
    const RunResult fresh = testing::run_layout(r);
    EXPECT_GT(part(fresh.stats[0], "kl"), 1e-3) << "tp " << tp;
  }
}

void expect_error_naming(const std::function<void()>& f, std::initializer_list<std::string_view> parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (std::string_view p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(Distillation, BadSettingsAreErrorsNamingTheKeyBeforeAnythingIsAllocated) {
  const GPTConfig student = testing::small_gpt(0.0f);
  GPTConfig wide_vocab = student;
  wide_vocab.vocab_size = 67;
  TrainOptions o;
  const auto build = [&](DistillOptions d) {
    o.distill = d;
    const size_t before = MemoryContext::current().tier(Tier::device).used();
    try {
      Trainer t(student, o);
    } catch (...) {
      EXPECT_EQ(MemoryContext::current().tier(Tier::device).used(), before);
      throw;
    }
  };
  expect_error_naming([&] { build({wide_vocab, {2.0f, 0.5f}}); }, {"distill.teacher", "67", "61", "model.vocab_size"});
  expect_error_naming([&] { build({student, {0.0f, 0.5f}}); }, {"distill.temperature", "> 0"});
  expect_error_naming([&] { build({student, {2.0f, 1.5f}}); }, {"distill.alpha", "[0, 1]"});
  expect_error_naming([&] { check_distillation(student, {student, {2.0f, 0.5f}}, 2); }, {"parallel.pp = 2"});
}

}  // namespace
}  // namespace loom
