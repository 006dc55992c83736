#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

TEST(AdamW, StepComputesBiasCorrectionsInDouble) {
  const AdamWStep s = AdamWStep::at(3, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f);
  EXPECT_FLOAT_EQ(s.bias_correction1, static_cast<float>(1.0 - std::pow(0.9f, 3.0)));
  EXPECT_FLOAT_EQ(s.bias_correction2, static_cast<float>(1.0 - std::pow(0.999f, 3.0)));
  EXPECT_EQ(s.lr, 1e-3f);
  EXPECT_EQ(s.weight_decay, 0.1f);
  EXPECT_EQ(s.grad_scale, 1.0f);
}

// Three steps of torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
// weight_decay=0.1, foreach=False) from PyTorch 1.13 on p_i = sin(i + 1) with
// gradients 0.5 * cos(0.7 i + k) * 10^(-2 (i mod 3)) at step k; here the 0.5
// comes in through grad_scale.
TEST(AdamW, MatchesPyTorch) {
  const int64_t n = 8;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(std::sin(i + 1.0));
  for (int64_t k = 0; k < 3; ++k) {
    for (int64_t i = 0; i < n; ++i)
      g[i] = static_cast<float>(std::cos(0.7 * static_cast<double>(i) + static_cast<double>(k)) *
                                std::pow(10.0, -2.0 * static_cast<double>(i % 3)));
    AdamWStep s = AdamWStep::at(k + 1, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f);
    s.grad_scale = 0.5f;
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, s);
  }
  const std::vector<double> torch_p = {8.147642016e-01,  8.933016658e-01,  1.440563649e-01, -7.254185677e-01,
                                       -9.288417101e-01, -2.590532005e-01, 6.593552828e-01, 9.587793946e-01};
  const std::vector<double> torch_m = {4.400625825e-02,  -2.002550464e-04, -7.463895599e-06, -9.414854646e-02,
                                       -6.937859580e-04, -1.197882057e-06, 5.105479434e-02,  9.007653571e-04};
  const std::vector<double> torch_v = {1.691260561e-02, 1.701331257e-06, 1.846666153e-10, 1.885999925e-02,
                                       1.754035679e-06, 1.669843014e-10, 1.773186959e-02, 1.892510227e-06};
  kernel_testing::expect_close("param", p, torch_p, 1e-6, 0.0);
  kernel_testing::expect_close("m", m, torch_m, 1e-6, 0.0);
  kernel_testing::expect_close("v", v, torch_v, 1e-6, 0.0);
}

TEST(AdamW, ResultsDoNotDependOnThreadCount) {
  const int64_t n = 100003;
  const auto p0 = kernel_testing::random_vector(n, 1), g = kernel_testing::random_vector(n, 2);
  const auto m0 = kernel_testing::random_vector(n, 3), v0 = kernel_testing::random_vector(n, 4, 0.0f, 1e-3f);
  kernel_testing::expect_thread_invariant([&] {
    auto p = p0, m = m0, v = v0;
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, AdamWStep::at(7, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.01f));
    return kernel_testing::concat({&p, &m, &v});
  });
}

TEST(AdamW, KeepZerosLeavesZeroParametersAndTheirMomentsAndUpdatesTheRestAlike) {
  const int64_t n = 1001;
  auto p0 = kernel_testing::random_vector(n, 1);
  for (int64_t i = 0; i < n; i += 3) p0[static_cast<size_t>(i)] = 0.0f;
  const auto g = kernel_testing::random_vector(n, 2), m0 = kernel_testing::random_vector(n, 3),
             v0 = kernel_testing::random_vector(n, 4, 0.0f, 1e-3f);
  AdamWStep s = AdamWStep::at(7, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.01f);
  auto p = p0, m = m0, v = v0, plain_p = p0, plain_m = m0, plain_v = v0;
  adamw_update(plain_p.data(), g.data(), plain_m.data(), plain_v.data(), n, s);
  s.keep_zeros = true;
  adamw_update(p.data(), g.data(), m.data(), v.data(), n, s);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const bool zero = i % 3 == 0;
    EXPECT_EQ(p[i], zero ? 0.0f : plain_p[i]) << i;
    EXPECT_EQ(m[i], zero ? m0[i] : plain_m[i]) << i;
    EXPECT_EQ(v[i], zero ? v0[i] : plain_v[i]) << i;
    // Without it the zeros move.
    if (zero) {
      EXPECT_NE(plain_p[i], 0.0f) << i;
    }
  }
}

}  // namespace
}  // namespace loom::cpu
