// exp(x) for float that the compiler can vectorize: std::exp is a libm call
// that GCC only vectorizes under -ffast-math, and the softmax in
// cross-entropy and attention spends most of its time in it.
#pragma once

#include <bit>
#include <cstdint>

namespace loom::cpu {

// Within about 1 ulp of exp over the whole float range (Cephes' polynomial
// after a Cody-Waite reduction); underflows to 0 and overflows to +inf as expf
// does, and NaN stays NaN. Branch-free, so loops calling it vectorize.
inline float simd_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so that n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  // Adding 1.5 * 2^23 rounds to an integer that then sits in the low mantissa
  // bits, which gives n both as a float and, through the bits, as an int.
  constexpr float kShifter = 12582912.0f;
  // exp underflows to 0 below -104 and overflows past 88.73, so clamping x
  // to [-104, 177] changes no result; at 177 the scale 2^n below is itself
  // inf. The clamp works on the bit pattern because integer min and masks are
  // straight-line code, whereas a float ?: with a constant arm lets GCC fold
  // that arm and leave the rest of the computation under a branch, which it
  // then will not vectorize (float operations may trap, so they are not
  // speculated). NaN passes through unclamped.
  constexpr int32_t kMaxBits = std::bit_cast<int32_t>(177.0f);
  constexpr int32_t kMinMagnitudeBits = std::bit_cast<int32_t>(104.0f);
  constexpr int32_t kInfBits = 0x7f800000;
  const int32_t bits = std::bit_cast<int32_t>(x);
  const int32_t negative = bits >> 31;  // all ones or zero
  const int32_t magnitude = bits & 0x7fffffff;
  const int32_t limit = kMaxBits + (negative & (kMinMagnitudeBits - kMaxBits));
  const int32_t nan = (kInfBits - magnitude) >> 31;  // all ones for NaN
  const int32_t clamped = magnitude < limit ? magnitude : limit;
  const float xc = std::bit_cast<float>((bits & INT32_MIN) | (clamped & ~nan) | (magnitude & nan));
  const float t = xc * kLog2e + kShifter;
  const float n = t - kShifter;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShifter);
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  // 2^n for n in [-150, 255] is applied in two halves that are normal floats
  // (or inf for n = 255), so results that underflow to subnormals round once,
  // at the last multiply, and results past the float range become inf there.
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float s1 = std::bit_cast<float>(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = std::bit_cast<float>(static_cast<uint32_t>(n2 + 127) << 23);
  return er * s1 * s2;
}

}  // namespace loom::cpu
