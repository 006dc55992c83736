#include <gtest/gtest.h>

#include "loom/nn.h"
#include "loom/zero.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(ZeroPartition, BucketsCoverTheLayoutAndEveryRankOwnsItsBlock) {
  GPTConfig c = GPTConfig::preset("tiny");
  c.vocab_size = 101;
  GPT model(c);
  const ParamLayout& layout = model.layout();
  for (int ranks : {1, 2, 3, 4, 7}) {
    for (int64_t bucket : {int64_t(0), int64_t(1000), int64_t(1) << 30}) {
      ZeroPartition part(layout, ranks, 0, bucket);
      int64_t next = 0, padded = 0;
      for (const ZeroBucket& b : part.buckets()) {
        EXPECT_EQ(b.begin, next);
        EXPECT_EQ(b.padded_begin, padded);
        next = b.end;
        padded += b.shard * ranks;
        EXPECT_GE(b.shard * ranks, b.numel());
        EXPECT_LT(b.shard * ranks - b.numel(), ranks);  // padding below one element per rank
        // The blocks of all ranks tile the bucket exactly.
        int64_t covered = b.begin;
        for (int r = 0; r < ranks; ++r) {
          const FlatRange own = part.owned(b, r);
          EXPECT_EQ(own.begin, covered);
          covered = own.end;
        }
        EXPECT_EQ(covered, b.end);
        for (int g = b.first_group; g < b.end_group; ++g) EXPECT_EQ(&part.bucket_of_group(g), &b);
        EXPECT_EQ(&part.bucket_containing(b.end - 1), &b);
      }
      EXPECT_EQ(next, layout.numel());
      EXPECT_EQ(padded, part.padded_numel());
      if (bucket == 0) {
        EXPECT_EQ(part.buckets().size(), static_cast<size_t>(layout.num_groups()));
      }
      if (bucket == (int64_t(1) << 30)) {
        EXPECT_EQ(part.buckets().size(), 1u);
      }
    }
  }
}

TEST(ZeroPartition, PacksBucketsFromTheLastGroup) {
  GPT model(GPTConfig::preset("tiny"));
  const ParamLayout& layout = model.layout();
  const auto [lo, hi] = layout.group_range(layout.num_groups() - 2);  // the last block
  ZeroPartition part(layout, 2, 1, hi - lo);
  // The first bucket backward completes holds the final norm and the last
  // block, and is complete as soon as they are.
  const ZeroBucket& last = part.buckets().back();
  EXPECT_EQ(last.first_group, layout.num_groups() - 2);
  EXPECT_EQ(last.end_group, layout.num_groups());
}

TEST(ZeroOptions, InvalidValuesAreErrors) {
  EXPECT_CONTAINS(testing::error_of([] { validate(ZeroOptions{4, DType::f32, 1}); }), "zero.stage = 4");
  EXPECT_CONTAINS(testing::error_of([] { validate(ZeroOptions{1, DType::i32, 1}); }), "bf16 or fp16");
  EXPECT_CONTAINS(testing::error_of([] { validate(ZeroOptions{1, DType::f32, 0}); }), "bucket");
}

}  // namespace
}  // namespace loom
