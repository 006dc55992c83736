#include <gtest/gtest.h>

#include <set>

#include "data/data_test_util.h"
#include "loom/data.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::TempDir;

std::vector<std::filesystem::path> counting_shards(const TempDir& dir, const std::vector<int>& sizes) {
  std::vector<std::filesystem::path> paths;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<int32_t> tokens(sizes[k]);
    for (int i = 0; i < sizes[k]; ++i) tokens[i] = static_cast<int32_t>(k * 1000 + i);
    paths.push_back(dir / ("val" + std::to_string(k) + ".bin"));
    write_token_shard(paths.back(), tokens, 10000);
  }
  return paths;
}

TEST(EvalLoader, ServesEveryWindowOnceInOrder) {
  TempDir dir;
  const int B = 3, T = 10;
  EvalLoader loader(counting_shards(dir, {75, 31}), T, B);  // 7 + 3 windows
  EXPECT_EQ(loader.total_windows(), 10);
  EXPECT_EQ(loader.batches(), 4);
  EXPECT_EQ(loader.target_tokens(), 100);
  std::vector<int32_t> inputs(B * T), targets(B * T), starts;
  for (int pass = 0; pass < 2; ++pass) {
    starts.clear();
    while (auto rows = loader.next(inputs, targets)) {
      for (int r = 0; r < *rows; ++r) {
        starts.push_back(inputs[r * T]);
        for (int t = 0; t < T; ++t) ASSERT_EQ(targets[r * T + t], inputs[r * T + t] + 1);
      }
      for (int i = *rows * T; i < B * T; ++i) {
        EXPECT_EQ(inputs[i], 0);
        EXPECT_EQ(targets[i], -1);
      }
    }
    EXPECT_EQ(starts, (std::vector<int32_t>{0, 10, 20, 30, 40, 50, 60, 1000, 1010, 1020}));
    loader.reset();
  }
}

TEST(EvalLoader, DataParallelRanksSplitTheWindowsAndRunEqualBatches) {
  TempDir dir;
  auto shards = counting_shards(dir, {120, 55});  // 11 + 5 = 16 windows of 10
  const int B = 2, T = 10, D = 3;
  std::multiset<int32_t> starts;
  for (int r = 0; r < D; ++r) {
    EvalLoader loader(shards, T, B, r, D);
    EXPECT_EQ(loader.batches(), 3) << "rank " << r;  // ceil(ceil(16/3)/2)
    std::vector<int32_t> inputs(B * T), targets(B * T);
    int64_t batches = 0, rows_total = 0;
    while (auto rows = loader.next(inputs, targets)) {
      ++batches;
      rows_total += *rows;
      for (int i = 0; i < *rows; ++i) starts.insert(inputs[i * T]);
    }
    EXPECT_EQ(batches, 3);
    EXPECT_EQ(rows_total, loader.rank_windows());
  }
  EXPECT_EQ(starts.size(), 16u);
  EXPECT_EQ(std::set<int32_t>(starts.begin(), starts.end()).size(), 16u);
}

TEST(EvalLoader, ErrorsNameTheShardAndCounts) {
  TempDir dir;
  auto shards = counting_shards(dir, {50, 8});
  expect_mentions(error_of([&] { EvalLoader loader(shards, 8, 2); }), {"val1.bin", "holds 8 tokens", "= 9"});
  expect_mentions(error_of([&] { EvalLoader loader({shards[0]}, 8, 2, 3, 2); }), {"dp_rank 3"});
  EvalLoader loader({shards[0]}, 8, 2);
  expect_mentions(error_of([&] { loader.check_vocab(49); }), {"val0.bin", "token id 49", "vocab_size is 49"});
}

}  // namespace
}  // namespace loom
