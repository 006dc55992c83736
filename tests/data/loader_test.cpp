#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "data/data_test_util.h"
#include "loom/data.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::TempDir;

// Shards whose tokens are distinct, consecutive integers (shard k holds
// k*100000 + i), so a row's first token says where its window starts.
constexpr int kVocab = 1000000;
std::vector<std::filesystem::path> counting_shards(const TempDir& dir, const std::vector<int>& sizes) {
  std::vector<std::filesystem::path> paths;
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<int32_t> tokens(sizes[k]);
    for (int i = 0; i < sizes[k]; ++i) tokens[i] = static_cast<int32_t>(k * 100000 + i);
    paths.push_back(dir / ("shard" + std::to_string(k) + ".bin"));
    write_token_shard(paths.back(), tokens, kVocab);
  }
  return paths;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  int64_t first = 0;
  bool operator==(const Batch&) const = default;
};

Batch next_batch(TokenLoader& loader, int B, int T) {
  Batch b{std::vector<int32_t>(B * T), std::vector<int32_t>(B * T)};
  b.first = loader.next(b.inputs, b.targets);
  return b;
}

// The rows of one global batch from D ranks, in rank and micro-batch order.
std::vector<int32_t> global_batch(std::vector<TokenLoader>& ranks, int B, int T) {
  std::vector<int32_t> rows;
  for (auto& loader : ranks)
    for (int m = 0; m < loader.micro_batches_per_step(); ++m) {
      Batch b = next_batch(loader, B, T);
      rows.insert(rows.end(), b.inputs.begin(), b.inputs.end());
    }
  return rows;
}

TEST(TokenLoader, TargetsAreInputsShiftedWithinOneShard) {
  TempDir dir;
  const int B = 4, T = 16;
  TokenLoader loader(
      {.shards = counting_shards(dir, {300, 170, 500}), .seq_len = T, .micro_batch = B, .global_batch = 8, .seed = 7});
  for (int step = 0; step < 20; ++step) {
    Batch b = next_batch(loader, B, T);
    for (int r = 0; r < B; ++r)
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(b.targets[r * T + t], b.inputs[r * T + t] + 1);
        if (t > 0) {
          ASSERT_EQ(b.inputs[r * T + t], b.inputs[r * T + t - 1] + 1);  // no shard boundary inside
        }
      }
  }
}

TEST(TokenLoader, UnshuffledEpochsWalkTheShardsInOrder) {
  TempDir dir;
  const int B = 2, T = 10;
  TokenLoader loader(
      {.shards = counting_shards(dir, {41, 31}), .seq_len = T, .micro_batch = B, .global_batch = 2, .shuffle = false});
  // (41-1)/10 = 4 and (31-1)/10 = 3 windows: 7, so 3 steps of 2 and one skipped.
  EXPECT_EQ(loader.windows_per_epoch(), 7);
  EXPECT_EQ(loader.steps_per_epoch(), 3);
  std::vector<int32_t> starts;
  for (int step = 0; step < 4; ++step) {
    Batch b = next_batch(loader, B, T);
    starts.push_back(b.inputs[0]);
    starts.push_back(b.inputs[T]);
  }
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 10, 20, 30, 100000, 100010, 0, 10}));
  EXPECT_EQ(loader.state(), (LoaderState{.epoch = 1, .step = 1, .micro = 0}));
}

TEST(TokenLoader, ShuffledEpochVisitsEachWindowOnceAtOneOffsetPerShard) {
  TempDir dir;
  const int B = 3, T = 8;
  TokenLoader loader(
      {.shards = counting_shards(dir, {400, 250, 97}), .seq_len = T, .micro_batch = B, .global_batch = 6, .seed = 11});
  // (400-8)/8 + (250-8)/8 + (97-8)/8 = 49 + 30 + 11 = 90 windows, 15 steps.
  ASSERT_EQ(loader.windows_per_epoch(), 90);
  std::vector<std::vector<int32_t>> epoch_starts(3);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<int32_t> seen;
    std::map<int, std::set<int>> offsets;  // per shard, start % T
    for (int m = 0; m < 15 * 2; ++m) {
      Batch b = next_batch(loader, B, T);
      for (int r = 0; r < B; ++r) {
        int32_t start = b.inputs[r * T];
        EXPECT_TRUE(seen.insert(start).second) << "window at " << start << " twice in epoch " << epoch;
        offsets[start / 100000].insert(start % 100000 % T);
        epoch_starts[epoch].push_back(start);
      }
    }
    EXPECT_EQ(seen.size(), 90u);
    for (const auto& [shard, residues] : offsets) EXPECT_EQ(residues.size(), 1u) << "shard " << shard;
    EXPECT_EQ(loader.state().epoch, epoch + 1);
  }
  EXPECT_NE(epoch_starts[0], epoch_starts[1]);
  EXPECT_NE(epoch_starts[1], epoch_starts[2]);
}

TEST(TokenLoader, OrderIsAFunctionOfTheSeed) {
  TempDir dir;
  auto shards = counting_shards(dir, {2000});
  auto first_batches = [&](uint64_t seed) {
    TokenLoader loader({.shards = shards, .seq_len = 16, .micro_batch = 4, .global_batch = 4, .seed = seed});
    std::vector<int32_t> starts;
    for (int i = 0; i < 10; ++i) starts.push_back(next_batch(loader, 4, 16).inputs[0]);
    return starts;
  };
  EXPECT_EQ(first_batches(5), first_batches(5));
  EXPECT_NE(first_batches(5), first_batches(6));
}

TEST(TokenLoader, GlobalBatchIsTheSameForEveryDataParallelSize) {
  TempDir dir;
  auto shards = counting_shards(dir, {700, 333});
  const int B = 2, T = 12, G = 8;
  auto ranks_for = [&](int D) {
    std::vector<TokenLoader> ranks;
    for (int r = 0; r < D; ++r)
      ranks.emplace_back(LoaderOptions{
          .shards = shards, .seq_len = T, .micro_batch = B, .global_batch = G, .dp_rank = r, .dp_size = D, .seed = 3});
    return ranks;
  };
  std::vector<TokenLoader> d1 = ranks_for(1), d2 = ranks_for(2), d4 = ranks_for(4);
  ASSERT_EQ(d1[0].steps_per_epoch(), 10);  // 57 + 26 windows
  for (int step = 0; step < 25; ++step) {  // crosses two epoch boundaries
    std::vector<int32_t> reference = global_batch(d1, B, T);
    ASSERT_EQ(global_batch(d2, B, T), reference) << "step " << step;
    ASSERT_EQ(global_batch(d4, B, T), reference) << "step " << step;
  }
  // Each rank's position within the global batch, for dropout masks.
  TokenLoader rank1(
      {.shards = shards, .seq_len = T, .micro_batch = B, .global_batch = G, .dp_rank = 1, .dp_size = 2, .seed = 3});
  EXPECT_EQ(next_batch(rank1, B, T).first, 4);
  EXPECT_EQ(next_batch(rank1, B, T).first, 6);
  EXPECT_EQ(next_batch(rank1, B, T).first, 4);
}

TEST(TokenLoader, RestoredStateReproducesTheBatches) {
  TempDir dir;
  const LoaderOptions opts{
      .shards = counting_shards(dir, {900}), .seq_len = 10, .micro_batch = 2, .global_batch = 6, .seed = 99};
  TokenLoader original(opts);
  // 89 windows: 14 steps of 3 micro-batches per epoch; 100 micro-batches end
  // mid-step in the third epoch.
  for (int i = 0; i < 100; ++i) next_batch(original, 2, 10);
  nlohmann::json saved = original.state();
  EXPECT_EQ(saved, nlohmann::json::parse(R"({"epoch": 2, "step": 5, "micro": 1})"));

  TokenLoader resumed(opts);
  resumed.restore(nlohmann::json::parse(saved.dump()).get<LoaderState>());
  for (int i = 0; i < 50; ++i) ASSERT_EQ(next_batch(resumed, 2, 10), next_batch(original, 2, 10)) << i;
}

TEST(TokenLoader, StateSavedBetweenStepsRestoresUnderAnotherDataParallelSize) {
  TempDir dir;
  auto shards = counting_shards(dir, {1200});
  const int B = 2, T = 10, G = 4;
  std::vector<TokenLoader> d1;
  d1.emplace_back(LoaderOptions{.shards = shards, .seq_len = T, .micro_batch = B, .global_batch = G, .seed = 1});
  for (int step = 0; step < 7; ++step) global_batch(d1, B, T);
  const LoaderState saved = d1[0].state();
  ASSERT_EQ(saved.micro, 0);
  std::vector<TokenLoader> d2;
  for (int r = 0; r < 2; ++r) {
    d2.emplace_back(LoaderOptions{
        .shards = shards, .seq_len = T, .micro_batch = B, .global_batch = G, .dp_rank = r, .dp_size = 2, .seed = 1});
    d2.back().restore(saved);
  }
  for (int step = 0; step < 5; ++step) ASSERT_EQ(global_batch(d2, B, T), global_batch(d1, B, T));
}

TEST(TokenLoader, BadOptionsAndDataAreErrorsNamingTheCounts) {
  TempDir dir;
  auto shards = counting_shards(dir, {100, 20});
  auto make = [&](LoaderOptions o) { return error_of([&] { TokenLoader loader(o); }); };
  expect_mentions(make({.shards = shards, .seq_len = 32, .micro_batch = 1, .global_batch = 1}),
                  {"shard1.bin", "holds 20 tokens", "seq_len + 1 = 33"});
  expect_mentions(make({.shards = {shards[0]}, .seq_len = 16, .micro_batch = 4, .global_batch = 8}),
                  {"5 sequences of seq_len + 1 = 17", "global batch of 8", "shard0.bin\" (100 tokens)"});
  expect_mentions(make({.shards = shards, .seq_len = 4, .micro_batch = 3, .global_batch = 8, .dp_size = 2}),
                  {"global_batch 8", "micro_batch * dp_size = 3 * 2 = 6"});
  expect_mentions(
      make({.shards = shards, .seq_len = 4, .micro_batch = 1, .global_batch = 2, .dp_rank = 2, .dp_size = 2}),
      {"dp_rank 2", "dp_size = 2"});
  expect_mentions(make({.shards = {}, .seq_len = 4, .micro_batch = 1, .global_batch = 1}), {"no token shards"});
  expect_mentions(make({.shards = {dir / "gone.bin"}, .seq_len = 4, .micro_batch = 1, .global_batch = 1}),
                  {"gone.bin", "does not exist"});

  TokenLoader loader({.shards = shards, .seq_len = 4, .micro_batch = 2, .global_batch = 4});
  expect_mentions(error_of([&] { loader.restore({.epoch = 0, .step = loader.steps_per_epoch(), .micro = 0}); }),
                  {"step 7", "7 steps per epoch"});
  expect_mentions(error_of([&] { loader.restore({.epoch = 0, .step = 0, .micro = 2}); }), {"micro 2"});
  expect_mentions(error_of([&] { nlohmann::json::parse(R"({"epoch": 1})").get<LoaderState>(); }),
                  {"\"step\"", "corrupt"});
}

TEST(TokenLoader, CheckVocabNamesTheShardItsLargestIdAndTheVocabulary) {
  TempDir dir;
  TokenLoader loader({.shards = counting_shards(dir, {50, 60}), .seq_len = 8, .micro_batch = 1, .global_batch = 1});
  loader.check_vocab(100060);
  expect_mentions(error_of([&] { loader.check_vocab(100059); }),
                  {"shard1.bin", "token id 100059", "vocab_size is 100059"});
  expect_mentions(error_of([&] { loader.check_vocab(40); }), {"shard0.bin", "token id 49", "vocab_size is 40"});
}

}  // namespace
}  // namespace loom
