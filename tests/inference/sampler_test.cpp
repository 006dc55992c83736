#include <gtest/gtest.h>

#include "loom/inference.h"

namespace loom {
namespace {

TEST(Sampler, GreedyTopKAndTopP) {
  const float logits[5] = {0.1f, 3.0f, 2.9f, -1.0f, 0.0f};
  SampleOptions greedy;
  greedy.temperature = 0.0f;
  EXPECT_EQ(sample_token(logits, 5, greedy, 0), 1);
  SampleOptions k2;
  k2.top_k = 2;
  for (uint64_t d = 0; d < 200; ++d) {
    const int32_t t = sample_token(logits, 5, k2, d);
    EXPECT_TRUE(t == 1 || t == 2);
  }
  SampleOptions p;
  p.temperature = 1.0f;
  p.top_p = 0.3f;  // the top token alone has about half the mass
  for (uint64_t d = 0; d < 200; ++d) EXPECT_EQ(sample_token(logits, 5, p, d), 1);
}

}  // namespace
}  // namespace loom
