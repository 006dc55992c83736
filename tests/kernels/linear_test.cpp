#include <gtest/gtest.h>

#include <algorithm>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

std::vector<double> reference_linear(const std::vector<float>& inp, const std::vector<float>& w, const float* bias,
                                     int64_t N, int64_t C, int64_t OC) {
  std::vector<double> out(N * OC);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t o = 0; o < OC; ++o) {
      double s = bias != nullptr ? bias[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) s += static_cast<double>(inp[i * C + c]) * w[o * C + c];
      out[i * OC + o] = s;
    }
  return out;
}

TEST(Linear, ForwardMatchesReferenceWithAndWithoutBias) {
  const int64_t N = 13, C = 37, OC = 21;
  const auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), b = random_vector(OC, 3);
  std::vector<float> out(N * OC, 99.0f);
  linear_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
  kernel_testing::expect_close("out with bias", out, reference_linear(inp, w, b.data(), N, C, OC), 1e-5, 1e-5);
  linear_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
  kernel_testing::expect_close("out without bias", out, reference_linear(inp, w, nullptr, N, C, OC), 1e-5, 1e-5);
}

// Generation's fixed row blocks: each output row a function of its own
// input row alone (the same bits alone, in a batch of tile size or not, on
// any thread count), and the same products as the reference. Widths with
// and without a tail past the vector blocks, and a decode-sized matrix that
// takes the parallel path.
TEST(Linear, FixedRowsGiveEachRowTheBitsItGetsAlone) {
  for (const auto& [C, OC] : {std::pair<int64_t, int64_t>{37, 21}, {96, 13}, {1024, 2100}}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C << " OC=" << OC);
    const int64_t N = 11;  // a tile of 8 tokens and 3 alone
    const auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), b = random_vector(OC, 3);
    auto run = [&](int64_t first, int64_t rows) {
      std::vector<float> out(static_cast<size_t>(rows * OC));
      linear_forward(out.data(), inp.data() + first * C, w.data(), b.data(), rows, C, OC, RowBlocking::fixed);
      return out;
    };
    const std::vector<float> all = run(0, N);
    kernel_testing::expect_close("fixed rows", all, reference_linear(inp, w, b.data(), N, C, OC), 1e-5, 1e-5);
    for (int64_t first : {int64_t{0}, int64_t{5}, int64_t{10}}) {
      const std::vector<float> one = run(first, 1);
      EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin() + first * OC)) << "row " << first << " alone";
    }
    kernel_testing::expect_thread_invariant([&] { return run(0, N); });
  }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t N = 11, C = 19, OC = 7;
  auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), b = random_vector(OC, 3);
  const auto R = random_vector(N * OC, 4);
  std::vector<float> dinp(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  linear_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), N, C, OC);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    linear_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
    return kernel_testing::weighted_sum(out, R);
  };
  // The loss is linear in each input, so a large step has no truncation error.
  const kernel_testing::GradCheck opt{.step = 1e-2, .rtol = 1e-3, .atol = 1e-4, .norm_rtol = 1e-4};
  kernel_testing::expect_gradient_matches("dinp", inp, dinp, loss, opt);
  kernel_testing::expect_gradient_matches("dweight", w, dw, loss, opt);
  kernel_testing::expect_gradient_matches("dbias", b, db, loss, opt);
}

TEST(Linear, BackwardAccumulatesAndSkipsNullGradients) {
  const int64_t N = 70, C = 33, OC = 45;  // dbias spans several row chunks
  const auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), dout = random_vector(N * OC, 3);
  std::vector<float> dinp(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  auto dinp2 = random_vector(N * C, 5), dw2 = random_vector(OC * C, 6), db2 = random_vector(OC, 7);
  const auto dinp0 = dinp2, dw0 = dw2, db0 = db2;
  linear_backward(dinp2.data(), dw2.data(), db2.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  kernel_testing::expect_close("dinp", dinp2, kernel_testing::plus(dinp0, dinp), 1e-5, 1e-5);
  kernel_testing::expect_close("dweight", dw2, kernel_testing::plus(dw0, dw), 1e-5, 1e-5);
  kernel_testing::expect_close("dbias", db2, kernel_testing::plus(db0, db), 1e-5, 1e-5);
  // Null dinp and dbias are skipped; dweight still accumulates.
  auto dw3 = dw0;
  linear_backward(nullptr, dw3.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
  EXPECT_EQ(dw3, dw2);
}

TEST(Linear, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 257, C = 70, OC = 150;
  const auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), b = random_vector(OC, 3);
  const auto dout = random_vector(N * OC, 4);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(N * OC), dinp(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
    linear_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
    linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C, OC);
    return kernel_testing::concat({&out, &dinp, &dw, &db});
  });
}

TEST(AddBias, AddsToEveryRowAndItsGradientIsLinearsDbias) {
  const int64_t N = 9, OC = 21;
  auto bias = random_vector(OC, 1);
  const auto base = random_vector(N * OC, 2), R = random_vector(N * OC, 3);
  std::vector<float> out = base;
  add_bias(out.data(), bias.data(), N, OC);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < OC; ++j) EXPECT_EQ(out[i * OC + j], base[i * OC + j] + bias[j]) << i << "," << j;
  // A row-parallel layer's bias gradient comes from linear_backward's dbias.
  std::vector<float> dbias(OC, 0.0f);
  linear_backward(nullptr, nullptr, dbias.data(), R.data(), nullptr, nullptr, N, 1, OC);
  auto loss = [&] {
    out = base;
    add_bias(out.data(), bias.data(), N, OC);
    return kernel_testing::weighted_sum(out, R);
  };
  const kernel_testing::GradCheck opt{.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5};
  kernel_testing::expect_gradient_matches("dbias", bias, dbias, loss, opt);
}

TEST(AddBias, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 300, OC = 250;
  const auto bias = random_vector(OC, 1), base = random_vector(N * OC, 2);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out = base;
    add_bias(out.data(), bias.data(), N, OC);
    return out;
  });
}

}  // namespace
}  // namespace loom::cpu
