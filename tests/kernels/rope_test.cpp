#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <utility>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

// The inverse frequencies as the Llama papers and transformers define them,
// in double, case by case.
std::vector<double> reference_inv_freq(int64_t head_dim, double theta, const RopeScaling& sc) {
  std::vector<double> inv(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double base = 1.0 / std::pow(theta, 2.0 * i / head_dim);
    if (sc.type == RopeScalingType::linear) {
      inv[i] = base / sc.factor;
    } else if (sc.type == RopeScalingType::llama3) {
      const double old_len = static_cast<double>(sc.original_max_position_embeddings);
      const double wavelen = 2.0 * std::numbers::pi / base;
      if (wavelen < old_len / sc.high_freq_factor) {
        inv[i] = base;
      } else if (wavelen > old_len / sc.low_freq_factor) {
        inv[i] = base / sc.factor;
      } else {
        const double smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
        inv[i] = (1.0 - smooth) * base / sc.factor + smooth * base;
      }
    } else {
      inv[i] = base;
    }
  }
  return inv;
}

struct InvFreqCase {
  int64_t head_dim;
  double theta;
  RopeScaling scaling;
};

class RopeInvFreq : public ::testing::TestWithParam<InvFreqCase> {};

TEST_P(RopeInvFreq, MatchesReference) {
  const auto& [head_dim, theta, scaling] = GetParam();
  std::vector<float> inv(head_dim / 2);
  rope_inv_freq(inv.data(), head_dim, theta, scaling);
  kernel_testing::expect_close("inv_freq", inv, reference_inv_freq(head_dim, theta, scaling), 2e-6, 0.0);
}

RopeScaling llama3(double factor) {
  return {.type = RopeScalingType::llama3,
          .factor = factor,
          .low_freq_factor = 1.0,
          .high_freq_factor = 4.0,
          .original_max_position_embeddings = 8192};
}

// Llama 2 (theta 1e4), linear scaling, Llama 3.1 and 3.2 (theta 5e5, llama3
// scaling with factor 8 and 32) and a small head.
INSTANTIATE_TEST_SUITE_P(Configs, RopeInvFreq,
                         ::testing::Values(InvFreqCase{128, 10000.0, {}},
                                           InvFreqCase{64, 10000.0, {.type = RopeScalingType::linear, .factor = 4.0}},
                                           InvFreqCase{128, 500000.0, llama3(8.0)},
                                           InvFreqCase{64, 500000.0, llama3(32.0)},
                                           InvFreqCase{16, 10000.0, llama3(8.0)}));

TEST(Rope, Llama3ScalingCoversAllThreeBands) {
  // The test above proves little unless frequencies fall in every band:
  // kept, divided by factor, and interpolated.
  const int64_t head_dim = 128;
  const RopeScaling sc = llama3(8.0);
  std::vector<float> plain(head_dim / 2), scaled(head_dim / 2);
  rope_inv_freq(plain.data(), head_dim, 500000.0, {});
  rope_inv_freq(scaled.data(), head_dim, 500000.0, sc);
  int kept = 0, divided = 0, between = 0;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double ratio = static_cast<double>(plain[i]) / scaled[i];
    if (ratio == 1.0)
      ++kept;
    else if (std::fabs(ratio - sc.factor) < 1e-5)
      ++divided;
    else if (ratio > 1.0 && ratio < sc.factor)
      ++between;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(between, 0);
  EXPECT_EQ(kept + divided + between, head_dim / 2);
}

TEST(Rope, TablesMatchCosAndSinOfTheAngles) {
  const int64_t head_dim = 64, half = head_dim / 2, T = 50, pos0 = 1000;
  std::vector<float> inv(half);
  rope_inv_freq(inv.data(), head_dim, 10000.0, {});
  std::vector<float> cos(T * half), sin(T * half);
  rope_tables(cos.data(), sin.data(), inv.data(), T, half, pos0);
  // The angle is rounded to float32 first, as Hugging Face's float32
  // inv_freq @ position_ids product is.
  std::vector<double> ref_cos(T * half), ref_sin(T * half);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = inv[i] * static_cast<float>(pos0 + t);
      ref_cos[t * half + i] = std::cos(static_cast<double>(angle));
      ref_sin[t * half + i] = std::sin(static_cast<double>(angle));
    }
  kernel_testing::expect_close("cos", cos, ref_cos, 0.0, 2e-7);
  kernel_testing::expect_close("sin", sin, ref_sin, 0.0, 2e-7);
}

// Tables for T positions from pos0 with theta 10000.
struct Tables {
  std::vector<float> cos, sin;
  Tables(int64_t T, int64_t head_dim, int64_t pos0) : cos(T * head_dim / 2), sin(T * head_dim / 2) {
    std::vector<float> inv(head_dim / 2);
    rope_inv_freq(inv.data(), head_dim, 10000.0, {});
    rope_tables(cos.data(), sin.data(), inv.data(), T, head_dim / 2, pos0);
  }
};

TEST(Rope, ForwardMatchesRotateHalfFormula) {
  const int64_t B = 2, T = 5, NH = 3, hd = 16, half = hd / 2;
  const Tables tab(T, hd, 7);
  const auto x = random_vector(B * T * NH * hd, 1);
  std::vector<float> out(x.size());
  rope_forward(out.data(), x.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd);
  // q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1), with cos and
  // sin repeated over both halves.
  std::vector<double> ref(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          const int64_t at = ((b * T + t) * NH + h) * hd;
          const double c = tab.cos[t * half + d % half], s = tab.sin[t * half + d % half];
          const double rotated = d < half ? -static_cast<double>(x[at + d + half]) : x[at + d - half];
          ref[at + d] = x[at + d] * c + rotated * s;
        }
  kernel_testing::expect_close("out", out, ref, 1e-6, 1e-7);
}

TEST(Rope, BackwardMatchesFiniteDifferencesAndInvertsForward) {
  const int64_t B = 2, T = 6, NH = 2, hd = 8;
  const Tables tab(T, hd, 3);
  auto x = random_vector(B * T * NH * hd, 1);
  const auto R = random_vector(x.size(), 2);
  std::vector<float> dx(x.size(), 0.0f), out(x.size());
  rope_backward(dx.data(), R.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd);
  auto loss = [&] {
    rope_forward(out.data(), x.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd);
    return kernel_testing::weighted_sum(out, R);
  };
  const kernel_testing::GradCheck linear{.step = 1e-2, .rtol = 1e-3, .atol = 1e-4, .norm_rtol = 1e-4};
  kernel_testing::expect_gradient_matches("dinp", x, dx, loss, linear);
  // A rotation's inverse is its transpose: backward undoes forward.
  std::vector<float> back(x.size());
  rope_forward(out.data(), x.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd);
  rope_backward(back.data(), out.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd, GradWrite::overwrite);
  kernel_testing::expect_close("backward(forward(x))", back, kernel_testing::to_double(x), 1e-5, 1e-6);
}

TEST(Rope, BackwardAccumulates) {
  const int64_t B = 1, T = 9, NH = 2, hd = 12;
  const Tables tab(T, hd, 0);
  const auto dout = random_vector(B * T * NH * hd, 1);
  std::vector<float> fresh(dout.size());
  rope_backward(fresh.data(), dout.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd, GradWrite::overwrite);
  auto acc = random_vector(dout.size(), 2);
  const auto acc0 = acc;
  rope_backward(acc.data(), dout.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, NH * hd);
  kernel_testing::expect_close("dinp", acc, kernel_testing::plus(acc0, fresh), 1e-6, 1e-6);
}

TEST(Rope, InPlaceOnPackedQkvRotatesOnlyItsHeads) {
  // q (NH heads) | k (NKV heads) | v per token, as attention reads them: q and
  // k rotated in place through the row stride, v left alone; the same bits as
  // rotating contiguous copies out of place.
  const int64_t B = 2, T = 7, NH = 4, NKV = 2, hd = 10, C = NH * hd, row = C + 2 * NKV * hd;
  const Tables tab(T, hd, 5);
  const auto qkv0 = random_vector(B * T * row, 1);
  auto qkv = qkv0;
  rope_forward(qkv.data(), qkv.data(), tab.cos.data(), tab.sin.data(), B, T, NH, hd, row);
  rope_forward(qkv.data() + C, qkv.data() + C, tab.cos.data(), tab.sin.data(), B, T, NKV, hd, row);
  for (const auto& [offset, width] : {std::pair<int64_t, int64_t>{0, C}, {C, NKV * hd}}) {
    std::vector<float> part(B * T * width), rotated(part.size());
    for (int64_t i = 0; i < B * T; ++i) std::memcpy(&part[i * width], &qkv0[i * row + offset], width * sizeof(float));
    rope_forward(rotated.data(), part.data(), tab.cos.data(), tab.sin.data(), B, T, width / hd, hd, width);
    for (int64_t i = 0; i < B * T; ++i)
      EXPECT_EQ(std::memcmp(&rotated[i * width], &qkv[i * row + offset], width * sizeof(float)), 0)
          << "token " << i << ", columns from " << offset;
  }
  for (int64_t i = 0; i < B * T; ++i)
    EXPECT_EQ(std::memcmp(&qkv0[i * row + C + NKV * hd], &qkv[i * row + C + NKV * hd], NKV * hd * sizeof(float)), 0)
        << "v of token " << i;
}

TEST(Rope, ResultsDoNotDependOnThreadCount) {
  const int64_t B = 2, T = 128, NH = 8, hd = 64;
  const auto x = random_vector(B * T * NH * hd, 1), dout = random_vector(B * T * NH * hd, 2);
  std::vector<float> inv(hd / 2);
  rope_inv_freq(inv.data(), hd, 500000.0, llama3(8.0));
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> cos(T * hd / 2), sin(T * hd / 2), out(x.size()), dx(x.size(), 0.0f);
    rope_tables(cos.data(), sin.data(), inv.data(), T, hd / 2, 10);
    rope_forward(out.data(), x.data(), cos.data(), sin.data(), B, T, NH, hd, NH * hd);
    rope_backward(dx.data(), dout.data(), cos.data(), sin.data(), B, T, NH, hd, NH * hd);
    return kernel_testing::concat({&cos, &sin, &out, &dx});
  });
}

}  // namespace
}  // namespace loom::cpu
