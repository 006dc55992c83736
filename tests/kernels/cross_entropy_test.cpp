#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(CrossEntropy, ForwardMatchesReferenceAndIgnoresMinusOne) {
  const int64_t N = 6, V = 1001;
  // Large logits: without subtracting the max, exp would overflow.
  const auto logits = random_vector(N * V, 1, -100.0f, 100.0f);
  const std::vector<int32_t> targets = {3, -1, 1000, 0, 517, -1};
  std::vector<float> losses(N, 99.0f), lse(N);
  cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  std::vector<double> ref_loss(N), ref_lse(N);
  for (int64_t i = 0; i < N; ++i) {
    double m = -INFINITY, s = 0.0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(logits[i * V + j]));
    for (int64_t j = 0; j < V; ++j) s += std::exp(logits[i * V + j] - m);
    ref_lse[i] = m + std::log(s);
    ref_loss[i] = targets[i] < 0 ? 0.0 : ref_lse[i] - logits[i * V + targets[i]];
  }
  kernel_testing::expect_close("lse", lse, ref_lse, 1e-7, 0.0);
  kernel_testing::expect_close("loss", losses, ref_loss, 1e-6, 1e-5);
  EXPECT_EQ(losses[1], 0.0f);
  EXPECT_EQ(losses[5], 0.0f);
}

TEST(CrossEntropy, ForwardIsAccurateOverAGpt2Vocabulary) {
  const int64_t N = 2, V = 50257;
  const auto logits = random_vector(N * V, 1, -4.0f, 4.0f);
  const std::vector<int32_t> targets = {12345, 50256};
  std::vector<float> losses(N), lse(N);
  cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  for (int64_t i = 0; i < N; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(logits[i * V + j]));
    const double ref = std::log(s) - logits[i * V + targets[i]];
    EXPECT_NEAR(losses[i], ref, 1e-6 * ref) << "row " << i;
  }
}

TEST(CrossEntropy, BackwardMatchesSoftmaxAndFiniteDifferences) {
  const int64_t N = 5, V = 37;
  auto logits = random_vector(N * V, 1, -3.0f, 3.0f);
  const std::vector<int32_t> targets = {0, 36, -1, 17, 17};
  const auto dloss = random_vector(N, 2);
  std::vector<float> losses(N), lse(N);
  cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  std::vector<float> dlogits(N * V, 123.0f);  // written, not accumulated
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  std::vector<double> ref(N * V);
  for (int64_t i = 0; i < N; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(logits[i * V + j]));
    for (int64_t j = 0; j < V; ++j)
      ref[i * V + j] = targets[i] < 0 ? 0.0 : dloss[i] * (std::exp(logits[i * V + j]) / s - (j == targets[i]));
  }
  kernel_testing::expect_close("dlogits", dlogits, ref, 1e-6, 1e-8);
  std::vector<float> l2(N), lse2(N);
  auto loss = [&] {
    cross_entropy_forward(l2.data(), lse2.data(), logits.data(), targets.data(), N, V);
    return kernel_testing::weighted_sum(l2, dloss);
  };
  kernel_testing::expect_gradient_matches("dlogits", logits, dlogits, loss);
}

TEST(CrossEntropy, BackwardMayOverwriteTheLogits) {
  const int64_t N = 4, V = 300;
  const auto logits = random_vector(N * V, 1, -5.0f, 5.0f);
  const std::vector<int32_t> targets = {299, 0, -1, 150};
  const auto dloss = random_vector(N, 2);
  std::vector<float> losses(N), lse(N), separate(N * V);
  cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  cross_entropy_backward(separate.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  auto in_place = logits;
  cross_entropy_backward(in_place.data(), in_place.data(), lse.data(), targets.data(), dloss.data(), N, V);
  EXPECT_EQ(in_place, separate);
}

// Over a vocabulary large enough for the parallel path and the vector tails.
TEST(CrossEntropy, FusedForwardBackwardIsBitIdenticalToTheSeparatePasses) {
  const int64_t N = 23, V = 3001;
  const auto logits = random_vector(N * V, 1, -5.0f, 5.0f), dloss = random_vector(N, 2);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 5 == 4 ? -1 : static_cast<int32_t>(i * 131 % V);
  std::vector<float> losses(N), lse(N), dlogits(N * V);
  cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  std::vector<float> fused_losses(N), fused_lse(N);
  auto fused = logits;
  cross_entropy_forward_backward(fused_losses.data(), fused_lse.data(), fused.data(), targets.data(), dloss.data(), N,
                                 V);
  EXPECT_EQ(fused_losses, losses);
  EXPECT_EQ(fused_lse, lse);
  EXPECT_EQ(fused, dlogits);
}

TEST(AddSumF64, AddsTheDoubleSumInOrderToTheAccumulator) {
  // 2^24 + 1 is not a float: a float sum would drop the ones.
  const std::vector<float> x = {16777216.0f, 1.0f, 1.0f, -0.5f};
  double sum = 0.25;
  add_sum_f64(&sum, x.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(sum, 0.25 + 16777217.5);
  add_sum_f64(&sum, x.data() + 1, 1);
  EXPECT_EQ(sum, 0.25 + 16777218.5);
}

TEST(CrossEntropy, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 23, V = 3001;
  const auto logits = random_vector(N * V, 1, -5.0f, 5.0f), dloss = random_vector(N, 2);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 5 == 4 ? -1 : static_cast<int32_t>(i * 131 % V);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> losses(N), lse(N), dlogits(N * V);
    cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
    return kernel_testing::concat({&losses, &lse, &dlogits});
  });
}

// A vocabulary of V classes split over `shards` ranks of `width` columns each,
// the last one padded; the padding holds large values that must be ignored.
struct ShardedLogits {
  int64_t N, V, shards, width;
  std::vector<float> whole;                // [N, V]
  std::vector<std::vector<float>> shard;  // [N, width] each
  ShardedLogits(int64_t N_, int64_t V_, int64_t shards_, uint64_t seed)
      : N(N_), V(V_), shards(shards_), width((V_ + shards_ - 1) / shards_), whole(random_vector(N_ * V_, seed, -5, 5)) {
    for (int64_t k = 0; k < shards; ++k) {
      auto& x = shard.emplace_back(random_vector(N * width, seed + 1 + k, 50.0f, 60.0f));
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < real(k); ++j) x[i * width + j] = whole[i * V + first(k) + j];
    }
  }
  int64_t first(int64_t k) const { return k * width; }
  int64_t real(int64_t k) const { return std::min(width, V - first(k)); }

  // The forward as the head runs it around its two all-reduces (a max, then a
  // sum in shard order): lse and loss per row.
  void forward(std::vector<float>& losses, std::vector<float>& lse, const std::vector<int32_t>& targets) const {
    std::vector<float> row_max(N, -INFINITY), part(N), sums(2 * N, 0.0f), part_sums(2 * N);
    for (int64_t k = 0; k < shards; ++k) {
      cross_entropy_shard_max(part.data(), shard[k].data(), N, width, real(k));
      for (int64_t i = 0; i < N; ++i) row_max[i] = std::max(row_max[i], part[i]);
    }
    for (int64_t k = 0; k < shards; ++k) {
      cross_entropy_shard_sums(part_sums.data(), shard[k].data(), row_max.data(), targets.data(), first(k), N, width,
                               real(k));
      for (int64_t i = 0; i < 2 * N; ++i) sums[i] += part_sums[i];
    }
    losses.resize(N);
    lse.resize(N);
    for (int64_t i = 0; i < N; ++i) {
      lse[i] = row_max[i] + std::log(sums[2 * i]);
      losses[i] = targets[i] < 0 ? 0.0f : lse[i] - sums[2 * i + 1];
    }
  }
};

TEST(CrossEntropyShard, ShardsReproduceTheWholeVocabulary) {
  const int64_t N = 6, V = 1001;
  const ShardedLogits s(N, V, 3, 1);
  const std::vector<int32_t> targets = {3, -1, 1000, 0, 334, 668};  // in every shard, and at their edges
  std::vector<float> losses(N), lse(N), shard_losses, shard_lse;
  cross_entropy_forward(losses.data(), lse.data(), s.whole.data(), targets.data(), N, V);
  s.forward(shard_losses, shard_lse, targets);
  kernel_testing::expect_close("lse", shard_lse, kernel_testing::to_double(lse), 1e-6, 0.0);
  kernel_testing::expect_close("loss", shard_losses, kernel_testing::to_double(losses), 1e-5, 1e-5);
  // Given the same lse, each shard's gradient is its columns of the whole one, bit for bit.
  const auto dloss = random_vector(N, 9);
  std::vector<float> whole(N * V);
  cross_entropy_backward(whole.data(), s.whole.data(), lse.data(), targets.data(), dloss.data(), N, V);
  for (int64_t k = 0; k < s.shards; ++k) {
    std::vector<float> d(N * s.width, 123.0f);  // written, not accumulated
    cross_entropy_shard_backward(d.data(), s.shard[k].data(), lse.data(), targets.data(), dloss.data(), s.first(k), N,
                                 s.width, s.real(k));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < s.width; ++j) {
        const float expect = j < s.real(k) ? whole[i * V + s.first(k) + j] : 0.0f;
        ASSERT_EQ(d[i * s.width + j], expect) << "shard " << k << " row " << i << " column " << j;
      }
  }
}

TEST(CrossEntropyShard, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, V = 37;
  ShardedLogits s(N, V, 3, 1);  // 13 columns per shard, the last with 11 classes
  const std::vector<int32_t> targets = {0, 36, -1, 17, 12};
  const auto dloss = random_vector(N, 2);
  std::vector<float> losses, lse;
  s.forward(losses, lse, targets);
  for (int64_t k = 0; k < s.shards; ++k) {
    std::vector<float> d(N * s.width);
    cross_entropy_shard_backward(d.data(), s.shard[k].data(), lse.data(), targets.data(), dloss.data(), s.first(k), N,
                                 s.width, s.real(k));
    std::vector<float> l2, lse2;
    auto loss = [&] {
      s.forward(l2, lse2, targets);
      return kernel_testing::weighted_sum(l2, dloss);
    };
    // Padding columns included: their gradient is zero and so is the quotient.
    kernel_testing::expect_gradient_matches("dlogits shard " + std::to_string(k), s.shard[k], d, loss);
  }
}

TEST(CrossEntropyShard, BackwardMayOverwriteTheLogits) {
  const int64_t N = 4, V = 300;
  const ShardedLogits s(N, V, 2, 1);
  const std::vector<int32_t> targets = {299, 0, -1, 150};
  const auto dloss = random_vector(N, 2);
  std::vector<float> losses, lse;
  s.forward(losses, lse, targets);
  std::vector<float> separate(N * s.width);
  cross_entropy_shard_backward(separate.data(), s.shard[1].data(), lse.data(), targets.data(), dloss.data(),
                               s.first(1), N, s.width, s.real(1));
  auto in_place = s.shard[1];
  cross_entropy_shard_backward(in_place.data(), in_place.data(), lse.data(), targets.data(), dloss.data(), s.first(1),
                               N, s.width, s.real(1));
  EXPECT_EQ(in_place, separate);
}

TEST(CrossEntropyShard, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 23, V = 6001;
  const ShardedLogits s(N, V, 2, 1);  // 3001 columns per shard, the last padded by one
  const auto dloss = random_vector(N, 2);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 5 == 4 ? -1 : static_cast<int32_t>(i * 261 % V);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> losses, lse, all;
    s.forward(losses, lse, targets);
    all = kernel_testing::concat({&losses, &lse});
    for (int64_t k = 0; k < s.shards; ++k) {
      std::vector<float> d(N * s.width);
      cross_entropy_shard_backward(d.data(), s.shard[k].data(), lse.data(), targets.data(), dloss.data(), s.first(k),
                                   N, s.width, s.real(k));
      all.insert(all.end(), d.begin(), d.end());
    }
    return all;
  });
}

}  // namespace
}  // namespace loom::cpu
