#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(Dropout, MaskIsPhiloxOfTheGlobalIndex) {
  const int64_t n = 5000;
  const float p = 0.3f;
  const uint64_t key = stream_key(42, 7, 3), first = 1000;
  const auto x = random_vector(n, 1);
  std::vector<float> out(n);
  dropout_forward(out.data(), x.data(), n, p, key, first);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = philox_uniform(key, first + i) >= p;
    ASSERT_EQ(out[i], keep ? x[i] * (1.0f / (1.0f - p)) : 0.0f) << i;
    kept += keep;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.03);
  // A slice drawn with its global offset reproduces the whole.
  std::vector<float> part(1000);
  dropout_forward(part.data(), x.data() + 2000, 1000, p, key, first + 2000);
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(part[i], out[2000 + i]);
}

TEST(Dropout, BackwardRegeneratesTheMaskAndAccumulates) {
  const int64_t n = 3000;
  const float p = 0.25f;
  const uint64_t key = stream_key(1, 2, 3);
  auto x = random_vector(n, 1);
  const auto R = random_vector(n, 2);
  auto dinp = random_vector(n, 3);
  const auto dinp0 = dinp;
  dropout_backward(dinp.data(), R.data(), n, p, key, 0);
  std::vector<float> grad(n), out(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = dinp[i] - dinp0[i];
  auto loss = [&] {
    dropout_forward(out.data(), x.data(), n, p, key, 0);
    return kernel_testing::weighted_sum(out, R);
  };
  kernel_testing::expect_gradient_matches("dinp", x, grad, loss,
                                          {.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5});
}

TEST(Dropout, ZeroProbabilityIsIdentityAndOneDropsEverything) {
  const int64_t n = 100;
  const auto x = random_vector(n, 1);
  std::vector<float> out(n);
  dropout_forward(out.data(), x.data(), n, 0.0f, 5, 0);
  EXPECT_EQ(out, x);
  dropout_forward(out.data(), x.data(), n, 1.0f, 5, 0);
  EXPECT_EQ(out, std::vector<float>(n, 0.0f));
  std::vector<float> dinp(n, 1.0f);
  dropout_backward(dinp.data(), x.data(), n, 0.0f, 5, 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dinp[i], 1.0f + x[i]);
}

TEST(Dropout, ResultsDoNotDependOnThreadCount) {
  const int64_t n = 50001;
  const auto x = random_vector(n, 1), dout = random_vector(n, 2);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(n), dinp(n, 0.0f);
    dropout_forward(out.data(), x.data(), n, 0.1f, 99, 12345);
    dropout_backward(dinp.data(), dout.data(), n, 0.1f, 99, 12345);
    return kernel_testing::concat({&out, &dinp});
  });
}

}  // namespace
}  // namespace loom::cpu
