#include <gtest/gtest.h>

#include "loom/store.h"
#include "loom/device.h"
#include "test_util.h"

namespace loom {
namespace {

ParamLayout sample_layout() {
  ParamLayout l;
  int g0 = l.add_group("a");
  l.add("a.weight", {5, 7}, ParamInit::normal_(0.5f), true, g0);
  l.add("a.bias", {7}, ParamInit::constant(0.25f), false, g0);
  int g1 = l.add_group("b");
  l.add("b.weight", {3, 11}, ParamInit::normal_(1.0f), true, g1);
  return l;
}

TEST(ParamLayout, GroupsAreContiguousRangesInDeclarationOrder) {
  ParamLayout l = sample_layout();
  EXPECT_EQ(l.numel(), 35 + 7 + 33);
  EXPECT_EQ(l.group_range(0), (std::pair<int64_t, int64_t>{0, 42}));
  EXPECT_EQ(l.group_range(1), (std::pair<int64_t, int64_t>{42, 75}));
  EXPECT_EQ(l.param(l.find("b.weight")).offset, 42);
  EXPECT_EQ(l.find("nope"), -1);
}

TEST(ParamLayout, AnySliceInitializesLikeTheWhole) {
  // Layout-independent initialization: shards of any size draw the same values.
  ParamLayout l = sample_layout();
  std::vector<float> whole(static_cast<size_t>(l.numel()));
  l.initialize(whole.data(), 0, l.numel(), 42);
  for (int64_t shards : {2, 3, 7}) {
    const int64_t per = (l.numel() + shards - 1) / shards;
    for (int64_t s = 0; s < shards; ++s) {
      const int64_t first = s * per, n = std::min(per, l.numel() - first);
      std::vector<float> part(static_cast<size_t>(n));
      l.initialize(part.data(), first, n, 42);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(part[i], whole[first + i]);
    }
  }
  EXPECT_EQ(whole[35], 0.25f);  // constant init
  std::vector<float> other(whole.size());
  l.initialize(other.data(), 0, l.numel(), 43);
  EXPECT_NE(other[0], whole[0]);  // the seed matters
}

TEST(ParamStore, ViewsAliasTheFlatBuffer) {
  ParamLayout l = sample_layout();
  ParamStore ps(l, 1);
  GradStore gs(l);
  ops::synchronize();  // zeroing the gradients is stream work, and so is each zero() below
  ps.param(2).data<float>()[0] = 9.0f;
  EXPECT_EQ(ps.flat().data<float>()[42], 9.0f);
  gs.grad(1).data<float>()[3] = 2.0f;
  EXPECT_EQ(gs.flat().data<float>()[38], 2.0f);
  gs.zero();
  ops::synchronize();
  EXPECT_EQ(gs.flat().data<float>()[38], 0.0f);
  EXPECT_EQ(ps.param(0).shape(), (Shape{5, 7}));
}

}  // namespace
}  // namespace loom
