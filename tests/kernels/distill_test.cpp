#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "loom/io.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

std::vector<int32_t> some_targets(int64_t N, int64_t V) {
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[i] = i % 5 == 3 ? -1 : static_cast<int32_t>((i * 131 + 7) % V);
  return t;
}

struct Forward {
  std::vector<float> losses, kl, ce, stats;
  Forward(int64_t N) : losses(N, 99.0f), kl(N, 99.0f), ce(N, 99.0f), stats(3 * N) {}
};

Forward forward(const std::vector<float>& x, const std::vector<float>& z, const std::vector<int32_t>& targets,
                Distillation d, int64_t N, int64_t V) {
  Forward f(N);
  distill_forward(f.losses.data(), f.kl.data(), f.ce.data(), f.stats.data(), x.data(), z.data(), targets.data(), d, N,
                  V);
  return f;
}

template <typename T>
std::vector<T> load(const SafetensorsReader& r, const std::string& name) {
  std::vector<T> v(r.entry(name).bytes / sizeof(T));
  r.read(name, v.data(), v.size() * sizeof(T));
  return v;
}

// tools/fixtures/make_kd_fixture.py: torch's kl_div over log_softmax at T and
// cross_entropy, in float64, for temperatures above and below 1.
TEST(Distill, MatchesPyTorchFixture) {
  const SafetensorsReader fx(LOOM_SOURCE_DIR "/tests/fixtures/kd_loss.safetensors");
  const int64_t N = std::stoll(fx.metadata().at("N")), V = std::stoll(fx.metadata().at("V"));
  const auto x = load<float>(fx, "logits"), z = load<float>(fx, "teacher");
  const auto targets = load<int32_t>(fx, "targets");
  const int64_t valid = std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
  ASSERT_GT(valid, 0);
  ASSERT_LT(valid, N) << "the fixture should mask some positions";
  const int cases = std::stoi(fx.metadata().at("cases"));
  ASSERT_GE(cases, 2);
  for (int k = 0; k < cases; ++k) {
    const std::string c = "case" + std::to_string(k) + ".";
    const auto params = load<float>(fx, c + "params");
    const Distillation d{params[0], params[1]};
    const Forward f = forward(x, z, targets, d, N, V);
    kernel_testing::expect_close(c + "kl", f.kl, kernel_testing::to_double(load<float>(fx, c + "kl")), 1e-5, 1e-7);
    kernel_testing::expect_close(c + "ce", f.ce, kernel_testing::to_double(load<float>(fx, c + "ce")), 1e-5, 1e-7);
    double sum = 0.0;
    add_sum_f64(&sum, f.losses.data(), N);
    const double want = load<float>(fx, c + "loss")[0];
    EXPECT_NEAR(sum / static_cast<double>(valid), want, 1e-5 * want) << c << "loss";
    // The mean's gradient: each row weighs 1 / valid, as the trainer's dloss.
    const std::vector<float> dloss(N, 1.0f / static_cast<float>(valid));
    std::vector<float> grad(N * V, 123.0f);
    distill_backward(grad.data(), x.data(), z.data(), f.stats.data(), targets.data(), dloss.data(), d, N, V);
    const auto want_grad = load<float>(fx, c + "grad");
    float scale = 0.0f;
    for (float g : want_grad) scale = std::max(scale, std::fabs(g));
    kernel_testing::expect_close(c + "grad", grad, kernel_testing::to_double(want_grad), 1e-5, 1e-6 * scale);
  }
}

TEST(Distill, BackwardMatchesFiniteDifferences) {
  const int64_t N = 6, V = 29;
  auto x = random_vector(N * V, 1, -3.0f, 3.0f);
  const auto z = random_vector(N * V, 2, -3.0f, 3.0f), dloss = random_vector(N, 3);
  const auto targets = some_targets(N, V);
  for (const Distillation d : {Distillation{2.0f, 0.6f}, Distillation{0.7f, 1.0f}, Distillation{1.0f, 0.0f}}) {
    const Forward f = forward(x, z, targets, d, N, V);
    std::vector<float> grad(N * V);
    distill_backward(grad.data(), x.data(), z.data(), f.stats.data(), targets.data(), dloss.data(), d, N, V);
    auto loss = [&] { return kernel_testing::weighted_sum(forward(x, z, targets, d, N, V).losses, dloss); };
    kernel_testing::expect_gradient_matches("T " + std::to_string(d.temperature) + " alpha " + std::to_string(d.alpha),
                                            x, grad, loss);
  }
}

TEST(Distill, AStudentEqualToItsTeacherHasZeroKLAndLogitsFarFromZeroStayFinite) {
  const int64_t N = 4, V = 301;
  const auto x = random_vector(N * V, 1, -100.0f, 100.0f);  // exp would overflow without the max
  const std::vector<int32_t> targets = {3, -1, 300, 0};
  const Distillation d{3.0f, 1.0f};
  const Forward f = forward(x, x, targets, d, N, V);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(f.kl[i], 0.0f) << "row " << i;
    EXPECT_EQ(f.losses[i], 0.0f) << "row " << i;
    EXPECT_TRUE(std::isfinite(f.ce[i])) << "row " << i;
  }
  EXPECT_GT(f.ce[0], 0.0f);
  std::vector<float> grad(N * V);
  const std::vector<float> dloss(N, 1.0f);
  distill_backward(grad.data(), x.data(), x.data(), f.stats.data(), targets.data(), dloss.data(), d, N, V);
  for (float g : grad) ASSERT_LE(std::fabs(g), 1e-6f);
  // A different teacher has a positive KL.
  const auto z = random_vector(N * V, 2, -100.0f, 100.0f);
  const Forward g = forward(x, z, targets, d, N, V);
  EXPECT_GT(g.kl[0], 0.0f);
  EXPECT_TRUE(std::isfinite(g.kl[0]));
}

// Student and teacher logits over a vocabulary large enough for the
// parallel path and the vector tails, with some positions masked.
struct LargeRows {
  static constexpr int64_t N = 23, V = 3001;
  std::vector<float> x = random_vector(N * V, 1, -5.0f, 5.0f), z = random_vector(N * V, 2, -5.0f, 5.0f),
                     dloss = random_vector(N, 3);
  std::vector<int32_t> targets = some_targets(N, V);
};

TEST(Distill, FusedForwardBackwardIsBitIdenticalToTheSeparatePasses) {
  const LargeRows in;
  const int64_t N = in.N, V = in.V;
  const auto& [x, z, dloss, targets] = in;
  const Distillation d{2.0f, 0.5f};
  const Forward f = forward(x, z, targets, d, N, V);
  std::vector<float> grad(N * V);
  distill_backward(grad.data(), x.data(), z.data(), f.stats.data(), targets.data(), dloss.data(), d, N, V);
  Forward fused(N);
  auto in_place = x;
  distill_forward_backward(fused.losses.data(), fused.kl.data(), fused.ce.data(), fused.stats.data(), in_place.data(),
                           z.data(), targets.data(), dloss.data(), d, N, V);
  EXPECT_EQ(fused.losses, f.losses);
  EXPECT_EQ(fused.kl, f.kl);
  EXPECT_EQ(fused.ce, f.ce);
  EXPECT_EQ(fused.stats, f.stats);
  EXPECT_EQ(in_place, grad);
}

TEST(Distill, ResultsDoNotDependOnThreadCount) {
  const LargeRows in;
  const int64_t N = in.N, V = in.V;
  const auto& [x, z, dloss, targets] = in;
  const Distillation d{1.5f, 0.8f};
  kernel_testing::expect_thread_invariant([&] {
    Forward f = forward(x, z, targets, d, N, V);
    std::vector<float> grad(N * V);
    distill_backward(grad.data(), x.data(), z.data(), f.stats.data(), targets.data(), dloss.data(), d, N, V);
    return kernel_testing::concat({&f.losses, &f.kl, &f.ce, &f.stats, &grad});
  });
}

// Student and teacher logits over V classes split over `shards` ranks of
// `width` columns, the last padded with large values that must be ignored.
struct ShardedPair {
  int64_t N, V, shards, width;
  std::vector<float> x, z;                  // [N, V]
  std::vector<std::vector<float>> xs, zs;  // [N, width] each
  ShardedPair(int64_t N_, int64_t V_, int64_t shards_)
      : N(N_), V(V_), shards(shards_), width((V_ + shards_ - 1) / shards_), x(random_vector(N_ * V_, 1, -5, 5)),
        z(random_vector(N_ * V_, 2, -5, 5)) {
    for (int64_t k = 0; k < shards; ++k) {
      auto& a = xs.emplace_back(random_vector(N * width, 10 + k, 50.0f, 60.0f));
      auto& b = zs.emplace_back(random_vector(N * width, 20 + k, 50.0f, 60.0f));
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < real(k); ++j) {
          a[i * width + j] = x[i * V + first(k) + j];
          b[i * width + j] = z[i * V + first(k) + j];
        }
    }
  }
  int64_t first(int64_t k) const { return k * width; }
  int64_t real(int64_t k) const { return std::min(width, V - first(k)); }

  // The forward as the loss runs it around its all-reduces (a max, then a
  // sum in shard order).
  Forward forward(const std::vector<int32_t>& targets, Distillation d) const {
    std::vector<float> row_max(2 * N, -INFINITY), part(2 * N), sums(5 * N, 0.0f), part_sums(5 * N);
    for (int64_t k = 0; k < shards; ++k) {
      distill_shard_max(part.data(), xs[k].data(), zs[k].data(), N, width, real(k));
      for (int64_t i = 0; i < 2 * N; ++i) row_max[i] = std::max(row_max[i], part[i]);
    }
    for (int64_t k = 0; k < shards; ++k) {
      distill_shard_sums(part_sums.data(), xs[k].data(), zs[k].data(), row_max.data(), targets.data(), d, first(k), N,
                         width, real(k));
      for (int64_t i = 0; i < 5 * N; ++i) sums[i] += part_sums[i];
    }
    Forward f(N);
    distill_shard_loss(f.losses.data(), f.kl.data(), f.ce.data(), f.stats.data(), row_max.data(), sums.data(),
                       targets.data(), d, N);
    return f;
  }
  std::vector<float> backward(int64_t k, const Forward& f, const std::vector<int32_t>& targets,
                              const std::vector<float>& dloss, Distillation d) const {
    std::vector<float> g(N * width, 123.0f);  // written, not accumulated
    distill_shard_backward(g.data(), xs[k].data(), zs[k].data(), f.stats.data(), targets.data(), dloss.data(), d,
                           first(k), N, width, real(k));
    return g;
  }
};

TEST(DistillShard, ShardsReproduceTheWholeVocabulary) {
  const int64_t N = 6, V = 1001;
  const ShardedPair s(N, V, 3);
  const std::vector<int32_t> targets = {3, -1, 1000, 0, 334, 668};  // in every shard, and at their edges
  const Distillation d{2.0f, 0.7f};
  const Forward whole = forward(s.x, s.z, targets, d, N, V), sharded = s.forward(targets, d);
  kernel_testing::expect_close("stats", sharded.stats, kernel_testing::to_double(whole.stats), 1e-6, 0.0);
  kernel_testing::expect_close("kl", sharded.kl, kernel_testing::to_double(whole.kl), 1e-5, 1e-6);
  kernel_testing::expect_close("ce", sharded.ce, kernel_testing::to_double(whole.ce), 1e-5, 1e-6);
  kernel_testing::expect_close("loss", sharded.losses, kernel_testing::to_double(whole.losses), 1e-5, 1e-6);
  // Given the same stats, each shard's gradient is its columns of the whole one, bit for bit.
  const auto dloss = random_vector(N, 9);
  std::vector<float> grad(N * V);
  distill_backward(grad.data(), s.x.data(), s.z.data(), whole.stats.data(), targets.data(), dloss.data(), d, N, V);
  for (int64_t k = 0; k < s.shards; ++k) {
    const auto g = s.backward(k, whole, targets, dloss, d);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < s.width; ++j) {
        const float expect = j < s.real(k) ? grad[i * V + s.first(k) + j] : 0.0f;
        ASSERT_EQ(g[i * s.width + j], expect) << "shard " << k << " row " << i << " column " << j;
      }
  }
}

TEST(DistillShard, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, V = 37;
  ShardedPair s(N, V, 3);  // 13 columns per shard, the last with 11 classes
  const std::vector<int32_t> targets = {0, 36, -1, 17, 12};
  const auto dloss = random_vector(N, 4);
  const Distillation d{1.7f, 0.4f};
  const Forward f = s.forward(targets, d);
  for (int64_t k = 0; k < s.shards; ++k) {
    const auto g = s.backward(k, f, targets, dloss, d);
    auto loss = [&] { return kernel_testing::weighted_sum(s.forward(targets, d).losses, dloss); };
    // Padding columns included: their gradient is zero and so is the quotient.
    // A larger step than the default: the loss sums three float log-sum-exps
    // per row, whose rounding would otherwise dominate the quotient.
    kernel_testing::GradCheck check;
    check.step = 1e-2;
    kernel_testing::expect_gradient_matches("dlogits shard " + std::to_string(k), s.xs[k], g, loss, check);
  }
}

TEST(DistillShard, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 23, V = 6001;
  const ShardedPair s(N, V, 2);  // 3001 columns per shard, the last padded by one
  const auto dloss = random_vector(N, 4);
  const auto targets = some_targets(N, V);
  const Distillation d{2.5f, 0.5f};
  kernel_testing::expect_thread_invariant([&] {
    Forward f = s.forward(targets, d);
    std::vector<float> all = kernel_testing::concat({&f.losses, &f.kl, &f.ce, &f.stats});
    for (int64_t k = 0; k < s.shards; ++k) {
      const auto g = s.backward(k, f, targets, dloss, d);
      all.insert(all.end(), g.begin(), g.end());
    }
    return all;
  });
}

}  // namespace
}  // namespace loom::cpu
