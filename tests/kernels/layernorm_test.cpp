#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(LayerNorm, ForwardMatchesReference) {
  const int64_t N = 9, C = 37;
  // An offset mean and uneven scale per row, as activations have.
  auto inp = random_vector(N * C, 1);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) inp[i * C + c] = 3.0f * static_cast<float>(i) + (1.0f + i) * inp[i * C + c];
  const auto w = random_vector(C, 2, 0.5f, 1.5f), b = random_vector(C, 3);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  std::vector<double> ref(N * C), ref_mean(N), ref_rstd(N);
  for (int64_t i = 0; i < N; ++i) {
    double m = 0.0, v = 0.0;
    for (int64_t c = 0; c < C; ++c) m += inp[i * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (inp[i * C + c] - m) * (inp[i * C + c] - m);
    const double r = 1.0 / std::sqrt(v / C + 1e-5);  // biased variance, eps 1e-5, as PyTorch
    for (int64_t c = 0; c < C; ++c) ref[i * C + c] = (inp[i * C + c] - m) * r * w[c] + b[c];
    ref_mean[i] = m;
    ref_rstd[i] = r;
  }
  kernel_testing::expect_close("out", out, ref, 1e-5, 1e-5);
  kernel_testing::expect_close("mean", mean, ref_mean, 1e-6, 1e-6);
  kernel_testing::expect_close("rstd", rstd, ref_rstd, 1e-5, 0.0);
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 7, C = 23;
  auto inp = random_vector(N * C, 1), w = random_vector(C, 2, 0.5f, 1.5f), b = random_vector(C, 3);
  const auto R = random_vector(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), mean.data(), rstd.data(), N, C);
  std::vector<float> m2(N), r2(N);
  auto loss = [&] {
    layernorm_forward(out.data(), m2.data(), r2.data(), inp.data(), w.data(), b.data(), N, C);
    return kernel_testing::weighted_sum(out, R);
  };
  kernel_testing::expect_gradient_matches("dinp", inp, dinp, loss);
  const kernel_testing::GradCheck linear{.step = 1e-2, .rtol = 1e-3, .atol = 1e-4, .norm_rtol = 1e-4};
  kernel_testing::expect_gradient_matches("dweight", w, dw, loss, linear);
  kernel_testing::expect_gradient_matches("dbias", b, db, loss, linear);
}

TEST(LayerNorm, BackwardAccumulates) {
  const int64_t N = 100, C = 30;  // several row chunks of the dweight reduction
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), b = random_vector(C, 3);
  const auto dout = random_vector(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(), rstd.data(), N,
                     C);
  auto dinp2 = random_vector(N * C, 5), dw2 = random_vector(C, 6), db2 = random_vector(C, 7);
  const auto dinp0 = dinp2, dw0 = dw2, db0 = db2;
  layernorm_backward(dinp2.data(), dw2.data(), db2.data(), dout.data(), inp.data(), w.data(), mean.data(), rstd.data(),
                     N, C);
  kernel_testing::expect_close("dinp", dinp2, kernel_testing::plus(dinp0, dinp), 1e-5, 1e-5);
  kernel_testing::expect_close("dweight", dw2, kernel_testing::plus(dw0, dw), 1e-5, 1e-5);
  kernel_testing::expect_close("dbias", db2, kernel_testing::plus(db0, db), 1e-5, 1e-5);
}

TEST(LayerNorm, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 301, C = 130;
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), b = random_vector(C, 3);
  const auto dout = random_vector(N * C, 4);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(N * C), mean(N), rstd(N), dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
    layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(), rstd.data(),
                       N, C);
    return kernel_testing::concat({&out, &mean, &rstd, &dinp, &dw, &db});
  });
}

}  // namespace
}  // namespace loom::cpu
