#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "loom/core.h"

namespace loom {
namespace {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Reference RNE rounding to bf16 via the nearest of the two candidate neighbours.
uint16_t reference_bf16(float x) {
  uint32_t u = bits(x);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  double dlo = std::fabs(static_cast<double>(bf16_to_f32(lo)) - x);
  double dhi = std::fabs(static_cast<double>(bf16_to_f32(hi)) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(DType, Bf16RoundTripIsExactForRepresentableValues) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), h);
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  for (uint32_t u = 0; u < 0x7f7f0000u; u += 0x3f1u) {
    float x = from_bits(u);
    ASSERT_EQ(f32_to_bf16(x), reference_bf16(x)) << "x=" << x;
  }
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to Inf
}

TEST(DType, F16RoundTripIsExactForEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), h) << "half bits " << h;
  }
}

TEST(DType, F16RoundsToNearestEven) {
  // Every value halfway between two adjacent halves rounds to the even one,
  // and values just off the midpoint round to the nearer one.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    double a = f16_to_f32(static_cast<uint16_t>(h));
    double b = f16_to_f32(static_cast<uint16_t>(h + 1));
    float mid = static_cast<float>((a + b) / 2);
    uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
    ASSERT_EQ(f32_to_f16(mid), even) << "between " << a << " and " << b;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.0f)), h);
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 1e9f)), h + 1);
  }
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds to Inf
  EXPECT_EQ(f32_to_f16(-1e-9f), 0x8000);
}

TEST(DType, BulkConversionMatchesScalar) {
  std::vector<float> x = {0.1f, -2.5f, 3.14159f, 1e-6f, -65504.f, 7.0f};
  std::vector<uint16_t> h(x.size());
  convert(x.data(), DType::f32, h.data(), DType::f16, static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(h[i], f32_to_f16(x[i]));
  std::vector<float> r = x;
  round_to(r.data(), static_cast<int64_t>(r.size()), DType::bf16);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(r[i], bf16_to_f32(f32_to_bf16(x[i])));
}

TEST(DType, ParseNamesThePrecisionsOnError) {
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp16"), DType::f16);
  try {
    parse_dtype("fp8");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos);
  }
}

}  // namespace
}  // namespace loom
