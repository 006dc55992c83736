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
  dropout_forward(out.data(), x.data(), 1, n, n, p, key, first);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = philox_uniform(key, first + i) >= p;
    ASSERT_EQ(out[i], keep ? x[i] * (1.0f / (1.0f - p)) : 0.0f) << i;
    kept += keep;
  }
  EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.03);
  // A slice drawn with its global offset reproduces the whole.
  std::vector<float> part(1000);
  dropout_forward(part.data(), x.data() + 2000, 1, 1000, 1000, p, key, first + 2000);
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
  dropout_backward(dinp.data(), R.data(), 1, n, n, p, key, 0);
  std::vector<float> grad(n), out(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = dinp[i] - dinp0[i];
  auto loss = [&] {
    dropout_forward(out.data(), x.data(), 1, n, n, p, key, 0);
    return kernel_testing::weighted_sum(out, R);
  };
  kernel_testing::expect_gradient_matches("dinp", x, grad, loss,
                                          {.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5});
}

TEST(Dropout, ZeroProbabilityIsIdentityAndOneDropsEverything) {
  const int64_t n = 100;
  const auto x = random_vector(n, 1);
  std::vector<float> out(n);
  dropout_forward(out.data(), x.data(), 1, n, n, 0.0f, 5, 0);
  EXPECT_EQ(out, x);
  dropout_forward(out.data(), x.data(), 1, n, n, 1.0f, 5, 0);
  EXPECT_EQ(out, std::vector<float>(n, 0.0f));
  std::vector<float> dinp(n, 1.0f);
  dropout_backward(dinp.data(), x.data(), 1, n, n, 0.0f, 5, 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dinp[i], 1.0f + x[i]);
}

// A [rows, cols] block of a [rows, stride] tensor's columns [c0, c0 + cols)
// (a row-parallel layer's input under tensor parallelism) draws exactly the
// elements the whole tensor's 1-D call draws there, forward and backward.
TEST(Dropout, StridedBlockDrawsTheWholeTensorsMaskAtItsGlobalIndices) {
  const int64_t rows = 37, stride = 96, c0 = 32, cols = 48;
  const float p = 0.3f;
  const uint64_t key = stream_key(3, 1, 4), first = 777;
  const auto x = random_vector(rows * stride, 1), dout = random_vector(rows * stride, 2);
  std::vector<float> whole(rows * stride), whole_dinp(rows * stride, 0.5f), whole_overwrite(rows * stride);
  dropout_forward(whole.data(), x.data(), 1, rows * stride, rows * stride, p, key, first);
  dropout_backward(whole_dinp.data(), dout.data(), 1, rows * stride, rows * stride, p, key, first);
  dropout_backward(whole_overwrite.data(), dout.data(), 1, rows * stride, rows * stride, p, key, first,
                   GradWrite::overwrite);
  std::vector<float> in(rows * cols), g(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      in[r * cols + c] = x[r * stride + c0 + c];
      g[r * cols + c] = dout[r * stride + c0 + c];
    }
  std::vector<float> out(rows * cols), dinp(rows * cols, 0.5f), dinp_overwrite(rows * cols, 9.0f);
  dropout_forward(out.data(), in.data(), rows, cols, stride, p, key, first + c0);
  dropout_backward(dinp.data(), g.data(), rows, cols, stride, p, key, first + c0);
  dropout_backward(dinp_overwrite.data(), g.data(), rows, cols, stride, p, key, first + c0, GradWrite::overwrite);
  int64_t dropped = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c, w = r * stride + c0 + c;
      ASSERT_EQ(out[i], whole[w]) << r << ", " << c;
      ASSERT_EQ(dinp[i], whole_dinp[w]) << r << ", " << c;
      ASSERT_EQ(dinp_overwrite[i], whole_overwrite[w]) << r << ", " << c;
      dropped += out[i] == 0.0f;
    }
  EXPECT_NEAR(static_cast<double>(dropped) / (rows * cols), p, 0.03);
}

TEST(Dropout, ResultsDoNotDependOnThreadCount) {
  const int64_t n = 50001;
  const auto x = random_vector(n, 1), dout = random_vector(n, 2);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(n), dinp(n, 0.0f), block(n), dblock(n, 0.0f);
    dropout_forward(out.data(), x.data(), 1, n, n, 0.1f, 99, 12345);
    dropout_backward(dinp.data(), dout.data(), 1, n, n, 0.1f, 99, 12345);
    // 1001 rows of 49 columns, 100 apart.
    dropout_forward(block.data(), x.data(), 1001, 49, 100, 0.1f, 99, 12345);
    dropout_backward(dblock.data(), dout.data(), 1001, 49, 100, 0.1f, 99, 12345);
    return kernel_testing::concat({&out, &dinp, &block, &dblock});
  });
}

}  // namespace
}  // namespace loom::cpu
