#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(RMSNorm, ForwardMatchesReference) {
  const int64_t N = 9, C = 37;
  const float eps = 1e-6f;
  // An uneven scale per row and an offset mean, which RMSNorm keeps.
  auto inp = random_vector(N * C, 1);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) inp[i * C + c] = 0.5f * static_cast<float>(i) + (1.0f + i) * inp[i * C + c];
  const auto w = random_vector(C, 2, 0.5f, 1.5f);
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  std::vector<double> ref(N * C), ref_rstd(N);
  for (int64_t i = 0; i < N; ++i) {
    double sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sq += static_cast<double>(inp[i * C + c]) * inp[i * C + c];
    const double r = 1.0 / std::sqrt(sq / C + eps);
    for (int64_t c = 0; c < C; ++c) ref[i * C + c] = inp[i * C + c] * r * w[c];
    ref_rstd[i] = r;
  }
  kernel_testing::expect_close("out", out, ref, 1e-5, 1e-6);
  kernel_testing::expect_close("rstd", rstd, ref_rstd, 1e-5, 0.0);
}

TEST(RMSNorm, EpsilonIsUsed) {
  // A zero row: rstd = 1/sqrt(eps), the output zero.
  const int64_t C = 8;
  const std::vector<float> inp(C, 0.0f), w(C, 1.0f);
  std::vector<float> out(C, 1.0f), rstd(1);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), 1, C, 1e-4f);
  EXPECT_NEAR(rstd[0], 100.0f, 1e-3f);
  EXPECT_EQ(out, std::vector<float>(C, 0.0f));
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 23;
  const float eps = 1e-5f;
  auto inp = random_vector(N * C, 1), w = random_vector(C, 2, 0.5f, 1.5f);
  const auto R = random_vector(N * C, 4);
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_backward(dinp.data(), dw.data(), R.data(), inp.data(), w.data(), rstd.data(), N, C);
  std::vector<float> r2(N);
  auto loss = [&] {
    rmsnorm_forward(out.data(), r2.data(), inp.data(), w.data(), N, C, eps);
    return kernel_testing::weighted_sum(out, R);
  };
  kernel_testing::expect_gradient_matches("dinp", inp, dinp, loss);
  const kernel_testing::GradCheck linear{.step = 1e-2, .rtol = 1e-3, .atol = 1e-4, .norm_rtol = 1e-4};
  kernel_testing::expect_gradient_matches("dweight", w, dw, loss, linear);
}

TEST(RMSNorm, BackwardAccumulates) {
  const int64_t N = 100, C = 30;  // several row chunks of the dweight reduction
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), dout = random_vector(N * C, 4);
  std::vector<float> out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  auto dinp2 = random_vector(N * C, 5), dw2 = random_vector(C, 6);
  const auto dinp0 = dinp2, dw0 = dw2;
  rmsnorm_backward(dinp2.data(), dw2.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  kernel_testing::expect_close("dinp", dinp2, kernel_testing::plus(dinp0, dinp), 1e-5, 1e-5);
  kernel_testing::expect_close("dweight", dw2, kernel_testing::plus(dw0, dw), 1e-5, 1e-5);
}

TEST(RMSNorm, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 301, C = 130;
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), dout = random_vector(N * C, 4);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(N * C), rstd(N), dinp(N * C, 0.0f), dw(C, 0.0f);
    rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
    rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
    return kernel_testing::concat({&out, &rstd, &dinp, &dw});
  });
}

}  // namespace
}  // namespace loom::cpu
