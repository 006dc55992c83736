#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(Elementwise, AddAccumulateScale) {
  const int64_t n = 40001;  // large enough to run in parallel
  const auto a = random_vector(n, 1), b = random_vector(n, 2);
  std::vector<float> out(n);
  add(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  auto y = a;
  add(y.data(), y.data(), b.data(), n);  // out aliasing a
  EXPECT_EQ(y, out);
  y = a;
  accumulate(y.data(), b.data(), n);
  EXPECT_EQ(y, out);
  scale(y.data(), n, -0.5f);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], out[i] * -0.5f);
}

TEST(Elementwise, SumSquaresIsAccurateAndThreadInvariant) {
  const int64_t n = 100003;
  const auto x = random_vector(n, 1);
  double ref = 0.0;
  for (float v : x) ref += static_cast<double>(v) * v;
  EXPECT_NEAR(sum_squares(x.data(), n), ref, 1e-12 * ref);
  EXPECT_EQ(sum_squares(x.data(), 0), 0.0);
  const int saved = num_threads();
  set_num_threads(1);
  const double serial = sum_squares(x.data(), n);
  set_num_threads(3);
  EXPECT_EQ(sum_squares(x.data(), n), serial);
  set_num_threads(saved);
}

}  // namespace
}  // namespace loom::cpu

namespace loom {
namespace {

TEST(Elementwise, CopyBytesCopiesEveryByteOfAnySize) {
  // Empty, below a block, a block and one byte past it, and enough blocks
  // for the copy to split over the threads with a ragged end.
  for (size_t bytes : {size_t(0), size_t(1), size_t(1) << 18, (size_t(1) << 18) + 1, (size_t(5) << 18) + 12345}) {
    std::vector<unsigned char> src(bytes), dst(bytes + 1, 0xAB);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
    cpu::copy_bytes(dst.data(), src.data(), bytes);
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin())) << bytes << " bytes";
    EXPECT_EQ(dst[bytes], 0xAB) << "nothing written past the end";
  }
}

}  // namespace
}  // namespace loom
