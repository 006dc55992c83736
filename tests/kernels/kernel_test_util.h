// Shared helpers for the CPU kernel tests: reproducible random inputs, a
// finite-difference gradient check, and the thread-count invariance check.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom::cpu::kernel_testing {

// Uniform in [lo, hi), a pure function of (seed, index).
inline std::vector<float> random_vector(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  const uint64_t key = stream_key(seed, "kernel-test");
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = lo + (hi - lo) * philox_uniform(key, i);
  return v;
}

// sum(out * weights), accumulated in double: the scalar loss whose gradient
// with respect to out is `weights`.
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& weights) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * weights[i];
  return s;
}

struct GradCheck {
  double step = 1e-3;
  double rtol = 1e-2;       // per element, relative to the difference quotient
  double atol = 1e-3;       // per element, absolute
  double norm_rtol = 2e-3;  // |analytic - numeric| / |numeric| over all checked elements
  int max_checks = 300;     // elements checked, spread evenly over x
};

// Compares grad (the analytic gradient of loss() with respect to x) with
// central differences. loss() must read x; x is restored afterwards. The
// step is the float difference actually applied, so rounding x +- h does not
// bias the quotient.
inline void expect_gradient_matches(const std::string& what, std::vector<float>& x, const std::vector<float>& grad,
                                    const std::function<double()>& loss, const GradCheck& opt = {}) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  const size_t n = x.size();
  const size_t stride = n <= static_cast<size_t>(opt.max_checks) ? 1 : (n + opt.max_checks - 1) / opt.max_checks;
  double err2 = 0.0, ref2 = 0.0;
  int failures = 0;
  for (size_t i = (n - 1) % stride; i < n; i += stride) {
    const float orig = x[i];
    const float xp = static_cast<float>(orig + opt.step), xm = static_cast<float>(orig - opt.step);
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = orig;
    const double numeric = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
    const double diff = grad[i] - numeric;
    err2 += diff * diff;
    ref2 += numeric * numeric;
    if (std::fabs(diff) > opt.atol + opt.rtol * std::fabs(numeric) && ++failures <= 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << grad[i] << " vs finite difference " << numeric;
  }
  EXPECT_EQ(failures, 0) << what << ": elements outside tolerance";
  EXPECT_GT(ref2, 0.0) << what << ": the gradient is identically zero, the check proves nothing";
  EXPECT_LE(std::sqrt(err2), opt.norm_rtol * std::sqrt(ref2)) << what << ": relative error of the whole gradient";
}

// Elementwise |a - b| <= atol + rtol |b|, reporting the first few misses.
inline void expect_close(const std::string& what, const std::vector<float>& a, const std::vector<double>& b,
                         double rtol, double atol) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= atol + rtol * std::fabs(b[i])) && ++failures <= 5)
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs reference " << b[i];
  EXPECT_EQ(failures, 0) << what;
}

// alpha op(A) op(B) + beta C in double, as a dense M x N result.
inline std::vector<double> reference_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                                          const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                                          const float* C, int64_t ldc) {
  std::vector<double> out(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k)
        s += static_cast<double>(trans_a ? A[k * lda + i] : A[i * lda + k]) *
             (trans_b ? B[j * ldb + k] : B[k * ldb + j]);
      out[static_cast<size_t>(i * N + j)] =
          alpha * s + (beta == 0.0f ? 0.0 : beta * static_cast<double>(C[i * ldc + j]));
    }
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// a + b element by element in double: what an accumulating kernel must produce
// from a buffer holding a and a fresh gradient b.
inline std::vector<double> plus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<double> s(a.size());
  for (size_t i = 0; i < a.size(); ++i) s[i] = static_cast<double>(a[i]) + b[i];
  return s;
}

// Runs `run` (which returns every output and gradient it computed,
// concatenated) under thread budgets 1, 2 and 3 and expects identical bytes.
inline void expect_thread_invariant(const std::function<std::vector<float>()>& run) {
  const int saved = num_threads();
  set_num_threads(1);
  const std::vector<float> serial = run();
  for (int threads : {2, 3}) {
    set_num_threads(threads);
    const std::vector<float> parallel = run();
    ASSERT_EQ(serial.size(), parallel.size());
    size_t first = serial.size();
    for (size_t i = 0; i < serial.size() && first == serial.size(); ++i)
      if (std::memcmp(&serial[i], &parallel[i], sizeof(float)) != 0) first = i;
    if (first < serial.size())
      ADD_FAILURE() << "with " << threads << " threads, element " << first << " of " << serial.size() << " is "
                    << parallel[first] << ", not " << serial[first] << " as with 1 thread";
  }
  set_num_threads(saved);
}

inline std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return all;
}

}  // namespace loom::cpu::kernel_testing
