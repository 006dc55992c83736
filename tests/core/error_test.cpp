// Message helpers of core.h.
#include <gtest/gtest.h>

#include "loom/core.h"

namespace loom {
namespace {

TEST(Messages, JoinedListsItemsWithTheSeparator) {
  EXPECT_EQ(joined({}), "");
  EXPECT_EQ(joined({"q"}), "q");
  EXPECT_EQ(joined({"q", "k", "v"}), "q, k, v");
  EXPECT_EQ(joined({"q", "", "v"}, ","), "q,,v");
  EXPECT_EQ(str("a", 1, ' ', 2.5), "a1 2.5");
}

}  // namespace
}  // namespace loom
