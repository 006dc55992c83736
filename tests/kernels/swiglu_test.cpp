#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(SwiGLU, ForwardMatchesFormulaOnFusedAndSeparateLayouts) {
  const int64_t N = 11, I = 37;
  const auto gu = random_vector(N * 2 * I, 1, -12.0f, 12.0f);  // gate | up per row
  std::vector<double> ref(N * I);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      const double g = gu[i * 2 * I + j], u = gu[i * 2 * I + I + j];
      ref[i * I + j] = g / (1.0 + std::exp(-g)) * u;
    }
  std::vector<float> fused(N * I);
  swiglu_forward(fused.data(), gu.data(), gu.data() + I, N, I, 2 * I);
  kernel_testing::expect_close("fused", fused, ref, 2e-6, 1e-7);
  std::vector<float> g(N * I), u(N * I), separate(N * I);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      g[i * I + j] = gu[i * 2 * I + j];
      u[i * I + j] = gu[i * 2 * I + I + j];
    }
  swiglu_forward(separate.data(), g.data(), u.data(), N, I, I);
  EXPECT_EQ(separate, fused);
}

TEST(SwiGLU, BackwardMatchesFiniteDifferences) {
  const int64_t N = 9, I = 21;
  auto gu = random_vector(N * 2 * I, 1, -5.0f, 5.0f);
  const auto R = random_vector(N * I, 2);
  std::vector<float> dgu(gu.size(), 0.0f), h(N * I);
  swiglu_backward(dgu.data(), dgu.data() + I, R.data(), gu.data(), gu.data() + I, N, I, 2 * I);
  auto loss = [&] {
    swiglu_forward(h.data(), gu.data(), gu.data() + I, N, I, 2 * I);
    return kernel_testing::weighted_sum(h, R);
  };
  kernel_testing::expect_gradient_matches("dgate|dup", gu, dgu, loss, {.rtol = 2e-3, .atol = 2e-4, .norm_rtol = 1e-3});
}

TEST(SwiGLU, BackwardAccumulatesAndSaturatesWithoutNaN) {
  const int64_t N = 5, I = 40;
  const auto g = random_vector(N * I, 1, -6.0f, 6.0f), u = random_vector(N * I, 2), dh = random_vector(N * I, 3);
  std::vector<float> dg(N * I), du(N * I);
  swiglu_backward(dg.data(), du.data(), dh.data(), g.data(), u.data(), N, I, I, GradWrite::overwrite);
  auto dg2 = random_vector(N * I, 4), du2 = random_vector(N * I, 5);
  const auto dg0 = dg2, du0 = du2;
  swiglu_backward(dg2.data(), du2.data(), dh.data(), g.data(), u.data(), N, I, I);
  kernel_testing::expect_close("dgate", dg2, kernel_testing::plus(dg0, dg), 1e-6, 1e-6);
  kernel_testing::expect_close("dup", du2, kernel_testing::plus(du0, du), 1e-6, 1e-6);
  // silu'(x) -> 1 far right, 0 far left; silu(x) -> x and 0.
  const std::vector<float> big = {100.0f, -200.0f, 1e10f, -1e10f}, ones(4, 1.0f);
  std::vector<float> dbig(4), dup(4);
  swiglu_backward(dbig.data(), dup.data(), ones.data(), big.data(), ones.data(), 1, 4, 4, GradWrite::overwrite);
  EXPECT_EQ(dbig, (std::vector<float>{1.0f, 0.0f, 1.0f, 0.0f}));
  EXPECT_EQ(dup, (std::vector<float>{100.0f, 0.0f, 1e10f, 0.0f}));
}

TEST(SwiGLU, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 257, I = 300;
  const auto gu = random_vector(N * 2 * I, 1, -6.0f, 6.0f), dh = random_vector(N * I, 2);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> h(N * I), dgu(gu.size(), 0.0f);
    swiglu_forward(h.data(), gu.data(), gu.data() + I, N, I, 2 * I);
    swiglu_backward(dgu.data(), dgu.data() + I, dh.data(), gu.data(), gu.data() + I, N, I, 2 * I);
    return kernel_testing::concat({&h, &dgu});
  });
}

}  // namespace
}  // namespace loom::cpu
