#include <gtest/gtest.h>

#include <cmath>

#include "loom/optim.h"

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
  AdamW opt(l, {0.1f, 0.9f, 0.999f, 1e-8f, 0.5f});
  float p[4] = {1, 1, 1, 1}, grad[4] = {0.5f, -0.5f, 0.5f, -0.5f};
  opt.step(p, grad, 0.1f, 1.0f);
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
  AdamW lo(l, {}, 0, 4), hi(l, {}, 4, 11);
  for (int s = 0; s < 3; ++s) {
    whole.step(p.data(), grad.data(), 1e-2f, 0.5f);
    lo.step(shard_p.data(), grad.data(), 1e-2f, 0.5f);
    hi.step(shard_p.data() + 4, grad.data() + 4, 1e-2f, 0.5f);
  }
  for (int i = 0; i < 11; ++i) EXPECT_EQ(p[i], shard_p[i]);
}

}  // namespace
}  // namespace loom
