#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {
namespace {

using namespace kernel_testing;

// Random int8 weights in [-127, 127] with positive per-row scales.
struct Weights {
  std::vector<int8_t> q;
  std::vector<float> scale;
};

Weights random_weights(int64_t OC, int64_t C, uint64_t seed) {
  const std::vector<float> u = random_vector(OC * C, seed, -127.49f, 127.49f);
  Weights w;
  for (float x : u) w.q.push_back(static_cast<int8_t>(std::lround(x)));
  w.scale = random_vector(OC, seed + 1, 0.001f, 0.01f);
  return w;
}

std::vector<float> run(const Weights& w, const std::vector<float>& x, const float* inv_smooth, const float* bias,
                       int64_t N, int64_t C, int64_t OC, int64_t ldo, Int8Gemm gemm) {
  std::vector<float> out(static_cast<size_t>(N * ldo), -7.0f);
  linear_forward_w8a8(out.data(), ldo, x.data(), inv_smooth, w.q.data(), w.scale.data(), bias, N, C, OC, gemm);
  return out;
}

const Int8Gemm kPaths[] = {Int8Gemm::own, Int8Gemm::onednn, Int8Gemm::fastest};

// Against kernels.h's formula computed here in fp32 (the activation's
// quantization) and double (the products): each row divided by the
// smoothing, scaled to max 127, rounded; the integer dot product times both
// scales plus the bias. Every path, for the decode (N = 1), the tile
// remainders and a prefill-sized batch; C = 70 leaves a tail of the
// kernel's 16-column blocks.
TEST(W8A8Linear, MatchesTheQuantizedActivationsTimesTheWeights) {
  const int64_t OC = 37, ldo = 41;  // OC not a multiple of the 4-row tiles
  for (int64_t C : {96, 70}) {
    const Weights w = random_weights(OC, C, 1);
    const std::vector<float> bias = random_vector(OC, 3), inv_smooth = random_vector(C, 4, 0.25f, 4.0f);
    for (int64_t N : {1, 3, 4, 9, 33}) {
      const std::vector<float> x = random_vector(N * C, 5 + static_cast<uint64_t>(N));
      for (const float* s : {inv_smooth.data(), static_cast<const float*>(nullptr)})
        for (const float* b : {bias.data(), static_cast<const float*>(nullptr)})
          for (Int8Gemm path : kPaths) {
            SCOPED_TRACE(testing::Message() << "C " << C << " N " << N << " smooth " << (s != nullptr) << " bias "
                                            << (b != nullptr) << " path " << static_cast<int>(path));
            const std::vector<float> out = run(w, x, s, b, N, C, OC, ldo, path);
            int failures = 0;
            for (int64_t i = 0; i < N; ++i) {
              std::vector<float> xs(static_cast<size_t>(C));
              float max = 0.0f;
              for (int64_t c = 0; c < C; ++c) {
                xs[static_cast<size_t>(c)] = x[static_cast<size_t>(i * C + c)] * (s != nullptr ? s[c] : 1.0f);
                max = std::max(max, std::fabs(xs[static_cast<size_t>(c)]));
              }
              const float xscale = max / 127.0f;
              for (int64_t o = 0; o < ldo; ++o) {
                const float got = out[static_cast<size_t>(i * ldo + o)];
                if (o >= OC) {
                  EXPECT_EQ(got, -7.0f) << "column " << o << " past OC was written";
                  continue;
                }
                double dot = 0.0, mag = 0.0;
                for (int64_t c = 0; c < C; ++c) {
                  const double p = std::nearbyint(xs[static_cast<size_t>(c)] / xscale) * w.q[static_cast<size_t>(o * C + c)];
                  dot += p;
                  mag += std::fabs(p);
                }
                const double f = static_cast<double>(xscale) * w.scale[static_cast<size_t>(o)];
                const double ref = dot * f + (b != nullptr ? b[o] : 0.0);
                const double tol = 1e-5 * (mag * f + (b != nullptr ? std::fabs(b[o]) : 0.0));
                if (!(std::fabs(got - ref) <= tol) && ++failures <= 5)
                  ADD_FAILURE() << "out[" << i << ", " << o << "] = " << got << ", reference " << ref;
              }
            }
            EXPECT_EQ(failures, 0);
          }
    }
  }
}

// oneDNN and the own kernel compute the same integers: outputs bit-identical,
// also where every product is 127 * 127 (int8 kernels that sum pairs in
// int16 saturate there) and with outlier columns.
TEST(W8A8Linear, BothGemmsGiveTheSameBits) {
  if (!onednn_int8_gemm_available()) GTEST_SKIP() << "this build or CPU runs the own kernel only";
  const int64_t OC = 64, C = 1040;
  Weights w = random_weights(OC, C, 11);
  std::fill(w.q.begin(), w.q.begin() + C, int8_t{127});
  std::fill(w.q.begin() + C, w.q.begin() + 2 * C, int8_t{-127});
  for (int64_t N : {1, 8, 45}) {
    SCOPED_TRACE(N);
    std::vector<float> x = random_vector(N * C, 12);
    std::fill(x.begin(), x.begin() + C, 3.0f);                      // all at +127
    for (int64_t i = 1; i < N; ++i) x[static_cast<size_t>(i * C + 7)] = 60.0f;  // an outlier column
    const std::vector<float> own = run(w, x, nullptr, nullptr, N, C, OC, OC, Int8Gemm::own);
    const std::vector<float> onednn = run(w, x, nullptr, nullptr, N, C, OC, OC, Int8Gemm::onednn);
    EXPECT_EQ(0, std::memcmp(own.data(), onednn.data(), own.size() * sizeof(float)));
    // Row 0 times weight row 0: 127 * 127 per column, exactly.
    EXPECT_EQ(own[0], static_cast<float>(127 * 127 * C) * (3.0f / 127.0f) * w.scale[0]);
  }
}

// A row of the output is the same bits alone (decode, the own kernel) or in
// a batch (prefill, oneDNN where there is one).
TEST(W8A8Linear, ARowDoesNotDependOnTheBatch) {
  const int64_t OC = 200, N = 11, C = 1024;  // the batch is worth oneDNN's parallel region
  const Weights w = random_weights(OC, C, 21);
  const std::vector<float> x = random_vector(N * C, 22), bias = random_vector(OC, 23),
                           inv_smooth = random_vector(C, 24, 0.5f, 2.0f);
  const std::vector<float> batch = run(w, x, inv_smooth.data(), bias.data(), N, C, OC, OC, Int8Gemm::fastest);
  for (int64_t i = 0; i < N; ++i) {
    const std::vector<float> row(x.begin() + i * C, x.begin() + (i + 1) * C);
    const std::vector<float> alone = run(w, row, inv_smooth.data(), bias.data(), 1, C, OC, OC, Int8Gemm::fastest);
    EXPECT_EQ(0, std::memcmp(alone.data(), batch.data() + i * OC, static_cast<size_t>(OC) * sizeof(float)))
        << "row " << i;
  }
}

// Large enough for the parallel paths of every pass.
TEST(W8A8Linear, ThreadInvariant) {
  const int64_t OC = 300, N = 17, C = 1030;
  ASSERT_GE(N * OC * C, 64 * kMinParallelWork) << "the test must reach the parallel path";
  const Weights w = random_weights(OC, C, 31);
  const std::vector<float> x = random_vector(N * C, 32), bias = random_vector(OC, 33),
                           inv_smooth = random_vector(C, 34, 0.5f, 2.0f);
  for (Int8Gemm path : kPaths) {
    SCOPED_TRACE(static_cast<int>(path));
    expect_thread_invariant([&] { return run(w, x, inv_smooth.data(), bias.data(), N, C, OC, OC, path); });
  }
}

}  // namespace
}  // namespace loom::cpu
