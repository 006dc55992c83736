#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

// Naive causal attention in double with the full T x T score matrix.
void reference_attention(std::vector<double>& out, std::vector<double>& lse, const std::vector<float>& qkv, int64_t B,
                         int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(B * T * C, 0.0);
  lse.assign(B * NH * T, 0.0);
  std::vector<double> scores(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* q = &qkv[(b * T + t) * 3 * C + h * hs];
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float* k = &qkv[(b * T + j) * 3 * C + C + h * hs];
          double s = 0.0;
          for (int64_t d = 0; d < hs; ++d) s += static_cast<double>(q[d]) * k[d];
          scores[j] = s * scale;
          m = std::max(m, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= t; ++j) sum += std::exp(scores[j] - m);
        lse[(b * NH + h) * T + t] = m + std::log(sum);
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(scores[j] - m) / sum;
          const float* v = &qkv[(b * T + j) * 3 * C + 2 * C + h * hs];
          for (int64_t d = 0; d < hs; ++d) out[(b * T + t) * C + h * hs + d] += p * v[d];
        }
      }
}

struct AttentionCase {
  int64_t B, T, C, NH;
};

class AttentionForward : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionForward, MatchesNaiveAttention) {
  const auto [B, T, C, NH] = GetParam();
  const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  std::vector<double> ref_out, ref_lse;
  reference_attention(ref_out, ref_lse, qkv, B, T, C, NH);
  kernel_testing::expect_close("out", out, ref_out, 1e-5, 1e-5);
  kernel_testing::expect_close("lse", lse, ref_lse, 1e-6, 1e-6);
}

// T below, at, and past the 64-row query tile (with a partial last tile),
// odd head sizes, several heads and batches.
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionForward,
                         ::testing::Values(AttentionCase{1, 1, 8, 2}, AttentionCase{2, 13, 15, 3},
                                           AttentionCase{1, 64, 16, 1}, AttentionCase{3, 130, 20, 4},
                                           AttentionCase{2, 200, 48, 2}));

class AttentionBackward : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionBackward, MatchesFiniteDifferences) {
  const auto [B, T, C, NH] = GetParam();
  auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f);
  const auto R = random_vector(B * T * C, 2);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), R.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH);
  std::vector<float> out2(out.size()), lse2(lse.size());
  auto loss = [&] {
    attention_forward(out2.data(), lse2.data(), qkv.data(), B, T, C, NH);
    return kernel_testing::weighted_sum(out2, R);
  };
  kernel_testing::expect_gradient_matches("dqkv", qkv, dqkv, loss, {.max_checks = 600});
  // q, k and v each get a nonzero gradient (none of the three GEMMs dropped).
  for (int64_t part = 0; part < 3; ++part) {
    double norm = 0.0;
    for (int64_t i = 0; i < B * T; ++i)
      for (int64_t c = 0; c < C; ++c) norm += std::fabs(dqkv[i * 3 * C + part * C + c]);
    EXPECT_GT(norm, 1.0) << "part " << part;
  }
}

// Two query tiles, the second partial (6 heads: the keys of each are cut into
// two ranges); one head over four tiles (four key ranges); 48 heads (no key
// ranges, one task per head).
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackward,
                         ::testing::Values(AttentionCase{2, 70, 24, 3}, AttentionCase{1, 250, 8, 1},
                                           AttentionCase{4, 66, 12, 12}));

TEST(Attention, BackwardAccumulates) {
  const int64_t B = 2, T = 67, C = 12, NH = 2;
  const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  std::vector<float> fresh(qkv.size(), 0.0f);
  attention_backward(fresh.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH);
  auto acc = random_vector(qkv.size(), 3);
  const auto acc0 = acc;
  attention_backward(acc.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH);
  std::vector<double> expect(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) expect[i] = static_cast<double>(acc0[i]) + fresh[i];
  kernel_testing::expect_close("dqkv", acc, expect, 1e-5, 1e-5);
}

TEST(Attention, ResultsDoNotDependOnThreadCount) {
  // Several heads, and one head whose key ranges the backward's threads share.
  for (const AttentionCase& c : {AttentionCase{2, 150, 48, 3}, AttentionCase{1, 400, 16, 1}}) {
    const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
    SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " NH=" << NH);
    const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
    kernel_testing::expect_thread_invariant([&] {
      std::vector<float> out(B * T * C), lse(B * NH * T), dqkv(qkv.size(), 0.0f);
      attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
      attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH);
      return kernel_testing::concat({&out, &lse, &dqkv});
    });
  }
}

}  // namespace
}  // namespace loom::cpu
