#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

double reference_gelu(double x) {
  // PyTorch's gelu(approximate='tanh').
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(Gelu, ForwardMatchesTanhFormula) {
  const int64_t n = 1001;
  const auto x = random_vector(n, 1, -12.0f, 12.0f);
  std::vector<float> out(n);
  gelu_forward(out.data(), x.data(), n);
  std::vector<double> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = reference_gelu(x[i]);
  kernel_testing::expect_close("gelu", out, ref, 2e-6, 1e-7);
  const std::vector<float> extremes = {0.0f, -0.0f, 1e-20f, -1e-20f, 50.0f, -50.0f, 1e30f, -1e30f};
  std::vector<float> ext_out(extremes.size());
  gelu_forward(ext_out.data(), extremes.data(), static_cast<int64_t>(extremes.size()));
  for (size_t i = 0; i < extremes.size(); ++i)
    EXPECT_NEAR(ext_out[i], reference_gelu(extremes[i]), 1e-6 * std::fabs(extremes[i])) << extremes[i];
}

TEST(Gelu, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const int64_t n = 301;
  auto x = random_vector(n, 1, -5.0f, 5.0f);
  const auto R = random_vector(n, 2);
  auto dinp = random_vector(n, 3);
  const auto dinp0 = dinp;
  gelu_backward(dinp.data(), x.data(), R.data(), n);
  std::vector<float> grad(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = dinp[i] - dinp0[i];
  std::vector<float> out(n);
  auto loss = [&] {
    gelu_forward(out.data(), x.data(), n);
    return kernel_testing::weighted_sum(out, R);
  };
  kernel_testing::expect_gradient_matches("dinp", x, grad, loss, {.rtol = 2e-3, .atol = 2e-4, .norm_rtol = 1e-3});
  // Saturated inputs: the derivative is 1 far right and 0 far left, never NaN.
  const std::vector<float> big = {30.0f, -30.0f, 1e10f, -1e10f}, ones(4, 1.0f);
  std::vector<float> dbig(4, 0.0f);
  gelu_backward(dbig.data(), big.data(), ones.data(), 4);
  EXPECT_EQ(dbig, (std::vector<float>{1.0f, 0.0f, 1.0f, 0.0f}));
}

// Vectorized and scalar code paths round identically, so elements give the
// same bits wherever a thread's slice starts.
TEST(Gelu, ElementsDoNotDependOnTheirPositionOrThreadCount) {
  const int64_t n = 100003;
  const auto x = random_vector(n, 1, -6.0f, 6.0f), dout = random_vector(n, 2);
  std::vector<float> whole(n), single(1);
  gelu_forward(whole.data(), x.data(), n);
  for (int64_t i = 0; i < n; i += 997) {
    gelu_forward(single.data(), x.data() + i, 1);
    EXPECT_EQ(std::memcmp(&single[0], &whole[i], sizeof(float)), 0) << "element " << i;
  }
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(n), dinp(n, 0.0f);
    gelu_forward(out.data(), x.data(), n);
    gelu_backward(dinp.data(), x.data(), dout.data(), n);
    return kernel_testing::concat({&out, &dinp});
  });
}

}  // namespace
}  // namespace loom::cpu
