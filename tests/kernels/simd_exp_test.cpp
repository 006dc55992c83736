#include "kernels/cpu/simd_exp.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace loom::cpu {
namespace {

// Distance in units of the last place of the float nearest to exp(x).
double ulp_error(float got, double exact) {
  const float rounded = static_cast<float>(exact);
  const double ulp = std::nextafter(std::fabs(rounded), std::numeric_limits<float>::infinity()) - std::fabs(rounded);
  return std::fabs(got - exact) / ulp;
}

TEST(SimdExp, WithinOneUlpAcrossTheRange) {
  // Every 4099th float in [-104, 89] (~1.3 M values), through the vectorized loop.
  std::vector<float> x, y;
  for (uint64_t b = 0; b < 0x100000000ull; b += 4099) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(b));
    if (f > -104.0f && f < 89.0f) x.push_back(f);
  }
  y.resize(x.size());
  const size_t n = x.size();
#pragma omp simd
  for (size_t i = 0; i < n; ++i) y[i] = simd_exp(x[i]);
  double worst = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const double exact = std::exp(static_cast<double>(x[i]));
    // Scalar and vector code paths round identically.
    ASSERT_EQ(std::bit_cast<uint32_t>(simd_exp(x[i])), std::bit_cast<uint32_t>(y[i])) << x[i];
    if (exact > std::numeric_limits<float>::max()) {
      ASSERT_EQ(y[i], std::numeric_limits<float>::infinity()) << x[i];
    } else if (exact < std::numeric_limits<float>::min()) {
      ASSERT_NEAR(y[i], exact, std::numeric_limits<float>::denorm_min()) << x[i];  // subnormal results
    } else if (const double e = ulp_error(y[i], exact); e > worst) {
      worst = e;
      worst_x = x[i];
    }
  }
  EXPECT_LT(worst, 1.1) << "at x = " << worst_x;
}

TEST(SimdExp, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(simd_exp(0.0f), 1.0f);
  EXPECT_EQ(simd_exp(-0.0f), 1.0f);
  EXPECT_EQ(simd_exp(-inf), 0.0f);
  EXPECT_EQ(simd_exp(-1e30f), 0.0f);
  EXPECT_EQ(simd_exp(-110.0f), 0.0f);
  EXPECT_EQ(simd_exp(inf), inf);
  EXPECT_EQ(simd_exp(1e30f), inf);
  EXPECT_EQ(simd_exp(89.0f), inf);
  EXPECT_LT(ulp_error(simd_exp(88.7f), std::exp(static_cast<double>(88.7f))), 1.1);  // just below overflow
  EXPECT_TRUE(std::isnan(simd_exp(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(simd_exp(-std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace loom::cpu
