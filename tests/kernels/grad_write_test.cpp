// GradWrite::overwrite: a backward kernel writing its input gradient into an
// uninitialized buffer gives what accumulating into zeros gives.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

// run(buffer, mode) computes one input gradient into buffer. Overwriting a
// NaN-filled buffer must equal accumulating into zeros, bit for bit, and
// accumulating must still add.
void expect_overwrite_matches_zeros(int64_t n, const std::function<void(float*, GradWrite)>& run) {
  std::vector<float> zeros(n, 0.0f), garbage(n, std::numeric_limits<float>::quiet_NaN());
  run(zeros.data(), GradWrite::accumulate);
  run(garbage.data(), GradWrite::overwrite);
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(&zeros[i], &garbage[i], sizeof(float)) != 0) {
      ADD_FAILURE() << "element " << i << " of " << n << ": overwritten " << garbage[i] << ", accumulated into zero "
                    << zeros[i];
      break;
    }
  auto acc = random_vector(n, 99);
  const auto acc0 = acc;
  run(acc.data(), GradWrite::accumulate);
  kernel_testing::expect_close("accumulated", acc, kernel_testing::plus(acc0, zeros), 1e-5, 1e-5);
}

TEST(InputGradWrite, LinearBackward) {
  const int64_t N = 300, C = 70, OC = 50;
  const auto inp = random_vector(N * C, 1), w = random_vector(OC * C, 2), dout = random_vector(N * OC, 3);
  std::vector<float> dw(OC * C);
  expect_overwrite_matches_zeros(N * C, [&](float* dinp, GradWrite mode) {
    linear_backward(dinp, dw.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC, mode);
  });
}

TEST(InputGradWrite, LayernormBackward) {
  const int64_t N = 200, C = 300;
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), b = random_vector(C, 3);
  const auto dout = random_vector(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N), dw(C), db(C);
  layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  expect_overwrite_matches_zeros(N * C, [&](float* dinp, GradWrite mode) {
    layernorm_backward(dinp, dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(), rstd.data(), N, C,
                       mode);
  });
}

TEST(InputGradWrite, GeluBackward) {
  const int64_t n = 50000;
  const auto x = random_vector(n, 1, -4.0f, 4.0f), dout = random_vector(n, 2);
  expect_overwrite_matches_zeros(n, [&](float* dinp, GradWrite mode) { gelu_backward(dinp, x.data(), dout.data(), n, mode); });
}

TEST(InputGradWrite, DropoutBackward) {
  const int64_t n = 50000;
  const auto dout = random_vector(n, 2);
  for (float p : {0.0f, 0.3f})
    expect_overwrite_matches_zeros(
        n, [&](float* dinp, GradWrite mode) { dropout_backward(dinp, dout.data(), 1, n, n, p, 7, 11, mode); });
}

TEST(InputGradWrite, RmsnormBackward) {
  const int64_t N = 200, C = 300;
  const auto inp = random_vector(N * C, 1), w = random_vector(C, 2), dout = random_vector(N * C, 4);
  std::vector<float> out(N * C), rstd(N), dw(C);
  rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
  expect_overwrite_matches_zeros(N * C, [&](float* dinp, GradWrite mode) {
    rmsnorm_backward(dinp, dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C, mode);
  });
}

TEST(InputGradWrite, RopeBackward) {
  const int64_t B = 2, T = 100, NH = 4, hd = 64;
  std::vector<float> inv(hd / 2), cos(T * hd / 2), sin(T * hd / 2);
  rope_inv_freq(inv.data(), hd, 10000.0);
  rope_tables(cos.data(), sin.data(), inv.data(), T, hd / 2, 0);
  const auto dout = random_vector(B * T * NH * hd, 1);
  expect_overwrite_matches_zeros(B * T * NH * hd, [&](float* dinp, GradWrite mode) {
    rope_backward(dinp, dout.data(), cos.data(), sin.data(), B, T, NH, hd, NH * hd, mode);
  });
}

TEST(InputGradWrite, SwigluBackward) {
  const int64_t N = 100, I = 300;
  const auto gu = random_vector(N * 2 * I, 1, -6.0f, 6.0f), dh = random_vector(N * I, 2);
  expect_overwrite_matches_zeros(N * 2 * I, [&](float* dgu, GradWrite mode) {
    swiglu_backward(dgu, dgu + I, dh.data(), gu.data(), gu.data() + I, N, I, 2 * I, mode);
  });
}

TEST(InputGradWrite, AttentionBackward) {
  // Several query tiles, with and without key ranges (3 heads: ranges; 48: none).
  for (const auto& [B, NH] : {std::pair<int64_t, int64_t>{1, 3}, {4, 12}}) {
    const int64_t T = 150, C = 4 * NH;
    const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
    std::vector<float> out(B * T * C), lse(B * NH * T);
    attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
    expect_overwrite_matches_zeros(B * T * 3 * C, [&](float* dqkv, GradWrite mode) {
      attention_backward(dqkv, dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH, mode);
    });
  }
}

TEST(InputGradWrite, GroupedQueryAttentionBackward) {
  // The group's later query heads add into the dk and dv its first one wrote;
  // one kv head over key ranges, and 8 kv heads over 48 query heads in all.
  for (const auto& [B, NH, NKV] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 1}, {4, 12, 2}}) {
    const int64_t T = 150, C = 4 * NH, row = C + 2 * NKV * 4;
    const auto qkv = random_vector(B * T * row, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
    std::vector<float> out(B * T * C), lse(B * NH * T);
    attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV);
    expect_overwrite_matches_zeros(B * T * row, [&](float* dqkv, GradWrite mode) {
      attention_backward(dqkv, dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV, mode);
    });
  }
}

}  // namespace
}  // namespace loom::cpu
