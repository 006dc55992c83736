#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "loom/parallel.h"
#include "loom/planner.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<int> balance(const std::vector<double>& costs, int parts) { return balance_layers(costs, parts); }

TEST(BalanceLayers, HandExamples) {
  EXPECT_EQ(balance({5}, 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(balance({1, 2, 3}, 1), (std::vector<int>{0, 3}));
  EXPECT_EQ(balance({1, 2, 3}, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(balance({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(balance({2, 1, 3, 1, 1}, 3), (std::vector<int>{0, 2, 3, 5}));
  // A costly last layer (the output head) gets a stage of its own.
  EXPECT_EQ(balance({1, 1, 1, 1, 4}, 2), (std::vector<int>{0, 4, 5}));
  EXPECT_EQ(balance({1, 1, 1, 1, 1, 1, 3}, 3), (std::vector<int>{0, 3, 6, 7}));
  // A costly first layer.
  EXPECT_EQ(balance({6, 1, 1, 1, 1}, 2), (std::vector<int>{0, 1, 5}));
}

TEST(BalanceLayers, TiesPutTheExtraLayersOnTheLaterParts) {
  EXPECT_EQ(balance({1, 1, 1, 1}, 3), (std::vector<int>{0, 1, 2, 4}));
  EXPECT_EQ(balance({1, 1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 5}));
  // 1,3,3 rather than 2,2,3: the middle part too takes as many as it can.
  EXPECT_EQ(balance({1, 1, 1, 1, 1, 1, 1}, 3), (std::vector<int>{0, 1, 4, 7}));
  // Zero-cost layers follow the same rule.
  EXPECT_EQ(balance({0, 0, 0}, 2), (std::vector<int>{0, 1, 3}));
}

// Every partition of `n` layers into `parts`, as boundaries.
void enumerate(int n, int parts, std::vector<int>& bounds, std::vector<std::vector<int>>& out) {
  if (static_cast<int>(bounds.size()) == parts) {
    bounds.push_back(n);
    out.push_back(bounds);
    bounds.pop_back();
    return;
  }
  const int remaining = parts - static_cast<int>(bounds.size());
  for (int next = bounds.back() + 1; next <= n - remaining; ++next) {
    bounds.push_back(next);
    enumerate(n, parts, bounds, out);
    bounds.pop_back();
  }
}

TEST(BalanceLayers, MatchesExhaustiveSearchWithTheTieRule) {
  for (int n = 1; n <= 8; ++n)
    for (int parts = 1; parts <= n; ++parts)
      for (uint64_t seed = 0; seed < 6; ++seed) {
        // Small integer costs make ties common.
        std::vector<double> costs;
        for (int32_t t : testing::random_tokens(n, 4, seed * 31 + static_cast<uint64_t>(n))) costs.push_back(t);
        std::vector<std::vector<int>> all;
        std::vector<int> start{0};
        enumerate(n, parts, start, all);
        auto costliest = [&](const std::vector<int>& b) {
          double worst = 0.0;
          for (size_t k = 0; k + 1 < b.size(); ++k)
            worst = std::max(worst, std::accumulate(costs.begin() + b[k], costs.begin() + b[k + 1], 0.0));
          return worst;
        };
        double optimum = costliest(all[0]);
        for (const std::vector<int>& b : all) optimum = std::min(optimum, costliest(b));
        // The tie rule: the last part as large as possible, then the one
        // before it, and so on: the boundaries, read from the last, smallest.
        std::vector<int> expected;
        for (const std::vector<int>& b : all) {
          if (costliest(b) != optimum) continue;
          if (expected.empty() ||
              std::lexicographical_compare(b.rbegin(), b.rend(), expected.rbegin(), expected.rend()))
            expected = b;
        }
        const std::vector<int> got = balance(costs, parts);
        EXPECT_EQ(got, expected) << n << " layers, " << parts << " parts, seed " << seed;
      }
}

TEST(BalanceLayersDeathTest, RejectsImpossibleSplits) {
  EXPECT_DEATH(balance({1, 2}, 0), "into 0 parts");
  EXPECT_DEATH(balance({1, 2}, 3), "2 layers into 3 parts");
}

GPTConfig four_layers(int64_t vocab) {
  GPTConfig cfg;
  cfg.n_layer = 4;
  cfg.n_head = 4;
  cfg.n_embd = 64;
  cfg.vocab_size = vocab;
  cfg.block_size = 64;
  return cfg;
}

TEST(PipelineLayerCosts, SplitMegatronsCountWithTheHeadOnTheLastLayer) {
  const GPTConfig cfg = GPTConfig::preset("gpt2");
  const std::vector<double> costs = pipeline_layer_costs(cfg, 256);
  ASSERT_EQ(costs.size(), static_cast<size_t>(cfg.n_layer));
  const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
  EXPECT_NEAR(total / training_flops_per_step(cfg, 1, 256), 1.0, 1e-12);
  for (size_t i = 1; i + 1 < costs.size(); ++i) EXPECT_EQ(costs[i], costs[0]);
  // The head: 6 s h V.
  EXPECT_NEAR((costs.back() - costs[0]) / (6.0 * 256 * 768 * 50257), 1.0, 1e-12);
}

TEST(PipelineStageLayers, BalancedByCost) {
  // A large vocabulary makes the head outweigh several blocks: the last
  // stage gets fewer layers.
  EXPECT_EQ(pipeline_stage_layers(four_layers(50000), 64, 2, {}), (std::vector<int>{3, 1}));
  EXPECT_EQ(pipeline_stage_layers(four_layers(64), 64, 2, {}), (std::vector<int>{2, 2}));
  EXPECT_EQ(pipeline_stage_layers(four_layers(64), 64, 4, {}), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(pipeline_stage_layers(four_layers(50000), 64, 2, {1, 3}), (std::vector<int>{1, 3}));
}

TEST(PipelineStageLayers, ErrorsNameTheKeyTheProblemAndTheFix) {
  const GPTConfig cfg = four_layers(50000);
  std::string m = testing::error_of([&] { pipeline_stage_layers(cfg, 64, 2, {1, 1, 2}); });
  EXPECT_CONTAINS(m, "parallel.stage_layers has 3 entries");
  EXPECT_CONTAINS(m, "2 virtual stages need one each");
  EXPECT_CONTAINS(m, "set parallel.stage_layers = \"3,1\"");
  m = testing::error_of([&] { pipeline_stage_layers(cfg, 64, 2, {4, 0}); });
  EXPECT_CONTAINS(m, "parallel.stage_layers gives virtual stage 1 0 layers");
  m = testing::error_of([&] { pipeline_stage_layers(cfg, 64, 2, {2, 3}); });
  EXPECT_CONTAINS(m, "parallel.stage_layers sums to 5 layers, and the model has 4");
  EXPECT_CONTAINS(m, "leave it empty to balance the stages by cost");
  m = testing::error_of([&] { pipeline_stage_layers(cfg, 64, 5, {}); });
  EXPECT_CONTAINS(m, "5 virtual stages needs at least a layer each, and the model has 4");
}

}  // namespace
}  // namespace loom
