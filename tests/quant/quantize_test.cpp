#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loom/quant.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;

// Rows of very different magnitudes (row r scaled by 2^(r % 7 - 3)), so a
// scale shared across rows would miss the bound.
std::vector<float> weights(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  const uint64_t key = stream_key(seed, "quant-test");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      w[static_cast<size_t>(r * cols + c)] =
          std::ldexp(2.0f * philox_uniform(key, static_cast<uint64_t>(r * cols + c)) - 1.0f, static_cast<int>(r % 7) - 3);
  return w;
}

std::vector<float> host(const Tensor& t) {
  const Tensor h = t.clone(Tier::host);
  return {h.data<float>(), h.data<float>() + h.numel()};
}

// |w - dequantized| within half a step of the element's scale, allowing
// the rounding of the product (q - zero) * scale.
void expect_within_half_step(const std::vector<float>& w, const QuantizedWeight& q) {
  const std::vector<float> d = host(dequantize(q)), scales = host(q.scales);
  int failures = 0;
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) {
      const size_t i = static_cast<size_t>(r * q.cols + c);
      const float s = scales[static_cast<size_t>(r * q.groups() + c / q.group)];
      const double bound = 0.5 * s + std::ldexp(std::fabs(w[i]), -23);
      if (!(std::fabs(static_cast<double>(w[i]) - d[i]) <= bound) && ++failures <= 5)
        ADD_FAILURE() << "[" << r << ", " << c << "]: " << w[i] << " came back as " << d[i] << ", scale " << s;
    }
  EXPECT_EQ(failures, 0);
}

TEST(QuantizeInt8, EveryElementWithinHalfItsRowsStep) {
  // 70 columns: not a multiple of the kernels' 32-column blocks.
  const int64_t rows = 21, cols = 70;
  const std::vector<float> w = weights(rows, cols, 1);
  const QuantizedWeight q = quantize_int8(w.data(), rows, cols);
  ASSERT_EQ(q.values.dtype(), DType::i8);
  ASSERT_EQ(q.values.shape(), Shape({rows, cols}));
  ASSERT_EQ(q.scales.shape(), Shape({rows, 1}));
  expect_within_half_step(w, q);
  // Each row's largest magnitude takes the full range.
  for (int64_t r = 0; r < rows; ++r) {
    int max = 0;
    for (int64_t c = 0; c < cols; ++c) max = std::max(max, std::abs(int{q.values.data<int8_t>()[r * cols + c]}));
    EXPECT_EQ(max, 127) << "row " << r;
  }
}

TEST(QuantizeInt8, AnAllZeroRowComesBackExactly) {
  const int64_t rows = 3, cols = 40;
  std::vector<float> w = weights(rows, cols, 2);
  for (int64_t c = 0; c < cols; ++c) w[static_cast<size_t>(cols + c)] = 0.0f;
  const QuantizedWeight q = quantize_int8(w.data(), rows, cols);
  EXPECT_EQ(q.scales.data<float>()[1], 0.0f);
  const std::vector<float> d = host(dequantize(q));
  for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(d[static_cast<size_t>(cols + c)], 0.0f) << "column " << c;
  expect_within_half_step(w, q);
}

TEST(QuantizeInt4, EveryElementWithinHalfItsGroupsStep) {
  for (int64_t group : {32, 128}) {
    SCOPED_TRACE(group);
    const int64_t rows = 9, cols = 256;
    const std::vector<float> w = weights(rows, cols, 3);
    const QuantizedWeight q = quantize_int4(w.data(), rows, cols, group);
    ASSERT_EQ(q.values.shape(), Shape({rows, cols / 2}));
    ASSERT_EQ(q.scales.shape(), Shape({rows, cols / group}));
    ASSERT_EQ(q.zeros.shape(), Shape({rows, cols / group}));
    for (int64_t i = 0; i < q.zeros.numel(); ++i) EXPECT_LE(q.zeros.data<uint8_t>()[i], 15);
    expect_within_half_step(w, q);
  }
}

TEST(QuantizeInt4, ConstantGroupsComeBackExactly) {
  const int64_t rows = 2, cols = 128, group = 32;
  std::vector<float> w = weights(rows, cols, 4);
  // Row 0: a positive, a negative, a zero and a tiny constant group; row 1 random.
  const float constants[] = {0.37f, -1.9f, 0.0f, 3e-30f};
  for (int64_t g = 0; g < 4; ++g)
    for (int64_t c = 0; c < group; ++c) w[static_cast<size_t>(g * group + c)] = constants[g];
  const QuantizedWeight q = quantize_int4(w.data(), rows, cols, group);
  const std::vector<float> d = host(dequantize(q));
  for (int64_t c = 0; c < cols; ++c)
    EXPECT_EQ(d[static_cast<size_t>(c)], w[static_cast<size_t>(c)]) << "column " << c;
  expect_within_half_step(w, q);
}

TEST(QuantizeInt4, PacksColumnBesideColumnPlus16) {
  // Columns 0..31 of a ramp: range [0, 31], scale 31/15, zero point 0.
  std::vector<float> w(32);
  for (int c = 0; c < 32; ++c) w[static_cast<size_t>(c)] = static_cast<float>(c);
  const QuantizedWeight q = quantize_int4(w.data(), 1, 32, 32);
  ASSERT_EQ(q.zeros.data<uint8_t>()[0], 0);
  auto expected = [](int c) { return static_cast<int>(std::nearbyint(c * 15.0 / 31.0)); };
  for (int j = 0; j < 16; ++j) {
    const uint8_t byte = q.values.data<uint8_t>()[j];
    EXPECT_EQ(byte & 0x0f, expected(j)) << "low nibble of byte " << j;
    EXPECT_EQ(byte >> 4, expected(j + 16)) << "high nibble of byte " << j;
  }
}

TEST(Quantize, BadMethodOrGroupNamesTheChoices) {
  EXPECT_CONTAINS(error_of([] { parse_quant_method("int3"); }), "choose int8");
  EXPECT_EQ(parse_quant_method("int4"), QuantMethod::int4);
  EXPECT_CONTAINS(error_of([] { check_quant_group(48); }), "choose 32, 64 or 128");
  check_quant_group(128);
}

}  // namespace
}  // namespace loom
