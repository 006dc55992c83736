#include <gtest/gtest.h>

#include <cmath>

#include "loom/core.h"

namespace loom {
namespace {

TEST(Philox, MatchesPublishedKnownAnswer) {
  // Random123 known-answer test for philox4x32-10 with all-ones counter and key.
  auto r = Philox::block(0xffffffffffffffffull, 0xffffffffffffffffull, 0xffffffffffffffffull);
  EXPECT_EQ(r[0], 0x408f276du);
  EXPECT_EQ(r[1], 0x41c83b0eu);
  EXPECT_EQ(r[2], 0xa20bc7c6u);
  EXPECT_EQ(r[3], 0x6d5451fdu);
  auto z = Philox::block(0, 0, 0);
  EXPECT_EQ(z[0], 0x6627e8d5u);
  EXPECT_EQ(z[1], 0xe169c58du);
  EXPECT_EQ(z[2], 0xbc57ac4cu);
  EXPECT_EQ(z[3], 0x9b00dbd8u);
}

TEST(Philox, AnySliceReproducesTheWholeStream) {
  uint64_t key = stream_key(1337, "h.0.attn.c_attn.weight");
  std::vector<float> whole(1000), part(300);
  fill_normal(whole.data(), 1000, key, 0, 0.f, 0.02f);
  fill_normal(part.data(), 300, key, 500, 0.f, 0.02f);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(part[i], whole[500 + i]);
}

TEST(Philox, NormalHasUnitMomentsAndNamesDecorrelate) {
  const int n = 200000;
  uint64_t k1 = stream_key(1, "a"), k2 = stream_key(1, "b");
  double sum = 0, sq = 0, cross = 0;
  for (int i = 0; i < n; ++i) {
    double x = philox_normal(k1, i), y = philox_normal(k2, i);
    sum += x;
    sq += x * x;
    cross += x * y;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
  EXPECT_NEAR(cross / n, 0.0, 0.01);
  EXPECT_NE(stream_key(1, "a"), stream_key(2, "a"));
  double u = 0;
  for (int i = 0; i < n; ++i) u += philox_uniform(k1, i);
  EXPECT_NEAR(u / n, 0.5, 0.01);
}

}  // namespace
}  // namespace loom
