#include <gtest/gtest.h>

#include <cmath>

#include "loom/optim.h"
#include "loom/device.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(LRSchedule, WarmsUpLinearlyThenDecaysByCosine) {
  LRSchedule s{1.0f, 0.1f, 10, 110};
  EXPECT_FLOAT_EQ(s.at(0), 0.1f);
  EXPECT_FLOAT_EQ(s.at(9), 1.0f);
  EXPECT_FLOAT_EQ(s.at(10), 1.0f);
  EXPECT_NEAR(s.at(60), 0.55f, 1e-6);  // halfway through the decay
  EXPECT_NEAR(s.at(109), 0.1f, 1e-3);
  EXPECT_FLOAT_EQ(s.at(500), 0.1f);
  for (int64_t t = 10; t < 110; ++t) EXPECT_LE(s.at(t + 1), s.at(t));
}

TEST(ClipScale, FollowsPyTorch) {
  EXPECT_EQ(clip_scale(5.0, 0.0f), 1.0f);
  EXPECT_EQ(clip_scale(0.5, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(clip_scale(4.0, 1.0f), static_cast<float>(1.0 / (4.0 + 1e-6)));
}

TEST(AdamW, DecaysOnlyParametersThatAskForIt) {
  ParamLayout l;
  int g = l.add_group("m");
  l.add("w", {2}, ParamInit::constant(1.0f), true, g);
  l.add("b", {2}, ParamInit::constant(1.0f), false, g);
  AdamW opt(l, {0.1f, 0.9f, 0.999f, 1e-8f, 0.5f, {}});
  float p[4] = {1, 1, 1, 1}, grad[4] = {0.5f, -0.5f, 0.5f, -0.5f};
  opt.step(p, grad, 0.1f, 1.0f);
  ops::synchronize();  // the update is stream work
  // Step 1: the bias-corrected update is lr * sign(g) (m/sqrt(v) = g/|g|).
  EXPECT_NEAR(p[0], 1.0f * (1 - 0.1f * 0.5f) - 0.1f, 1e-6);
  EXPECT_NEAR(p[1], 1.0f * (1 - 0.1f * 0.5f) + 0.1f, 1e-6);
  EXPECT_NEAR(p[2], 1.0f - 0.1f, 1e-6);
  EXPECT_NEAR(p[3], 1.0f + 0.1f, 1e-6);
  EXPECT_EQ(opt.steps(), 1);
}

TEST(AdamW, AShardUpdatesLikeTheWhole) {
  ParamLayout l;
  int g = l.add_group("m");
  l.add("w", {6}, ParamInit::normal_(1.0f), true, g);
  l.add("b", {5}, ParamInit::constant(0.0f), false, g);
  std::vector<float> p(11), grad(11);
  l.initialize(p.data(), 0, 11, 3);
  for (int i = 0; i < 11; ++i) grad[i] = 0.1f * static_cast<float>(i - 5);
  std::vector<float> shard_p = p;
  AdamW whole(l, {});
  // Ranges in any order, crossing the parameter boundary (decay on, then off).
  AdamW ends(l, {}, {{7, 11}, {0, 4}}), middle(l, {}, {{4, 7}});
  for (int s = 0; s < 3; ++s) {
    whole.step(p.data(), grad.data(), 1e-2f, 0.5f);
    ends.begin_step(1e-2f, 0.5f);
    ends.update(0, shard_p.data() + 7, grad.data() + 7);
    ends.update(1, shard_p.data(), grad.data());
    middle.begin_step(1e-2f, 0.5f);
    middle.update(0, shard_p.data() + 4, grad.data() + 4);
  }
  ops::synchronize();  // the updates are stream work
  for (int i = 0; i < 11; ++i) EXPECT_EQ(p[i], shard_p[i]);
  EXPECT_EQ(ends.offset(1), 4);
  EXPECT_EQ(ends.exp_avg().data<float>()[4], whole.exp_avg().data<float>()[0]);
}

TEST(AdamW, KeepsTheZerosOfTheParametersItIsToldTo) {
  ParamLayout l;
  int g = l.add_group("m");
  l.add("w", {4}, ParamInit::constant(1.0f), true, g);
  l.add("b", {4}, ParamInit::constant(1.0f), false, g);
  AdamWConfig cfg;
  cfg.keep_zeros = {"w", "absent"};  // a name this layout lacks (another stage's) is no error
  // A shard crossing the boundary, as ZeRO's blocks do.
  AdamW opt(l, cfg, {{2, 8}, {0, 2}});
  float p[8] = {0, 1, 0, 1, 0, 1, 0, 1}, grad[8] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  opt.begin_step(0.1f, 1.0f);
  opt.update(0, p + 2, grad + 2);
  opt.update(1, p, grad);
  ops::synchronize();
  for (int i = 0; i < 8; ++i) {
    if (i < 4 && i % 2 == 0)
      EXPECT_EQ(p[i], 0.0f) << i;  // w's zeros
    else
      EXPECT_NE(p[i], i % 2 == 0 ? 0.0f : 1.0f) << i;  // w's others and every element of b move
  }
}

TEST(LossScaler, GrowsAfterCleanStepsAndBacksOffAfterTheHysteresis) {
  LossScaleOptions o;
  o.growth_interval = 3;
  LossScaler s(o);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0f);
  s.update(true);  // the first overflow spends the hysteresis
  EXPECT_EQ(s.scale(), 131072.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0f);
  s.update(true);  // the budget stays spent until the scale grows again
  EXPECT_EQ(s.scale(), 32768.0f);
  s.update(false);
  s.update(false);
  s.update(true);  // an overflow restarts the count of clean steps
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16384.0f);
  s.update(false);
  EXPECT_EQ(s.scale(), 32768.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0f);
}

TEST(LossScaler, FallingBelowTheMinimumIsAnError) {
  LossScaleOptions o;
  o.initial_scale = 4.0f;
  o.min_scale = 2.0f;
  o.hysteresis = 1;
  LossScaler s(o);
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0f);
  EXPECT_CONTAINS(testing::error_of([&] { s.update(true); }), "min_scale");
}

TEST(LossScaler, StateRoundTripsAndInvalidOptionsAreErrors) {
  LossScaler a;
  a.update(true);
  LossScaler b;
  b.restore(a.state());
  b.update(true);
  EXPECT_EQ(b.scale(), 32768.0f);
  LossScaleOptions bad;
  bad.hysteresis = 0;
  EXPECT_CONTAINS(testing::error_of([&] { LossScaler s(bad); }), "hysteresis");
  bad = {};
  bad.backoff_factor = 1.0f;
  EXPECT_CONTAINS(testing::error_of([&] { LossScaler s(bad); }), "backoff_factor");
}

}  // namespace
}  // namespace loom
