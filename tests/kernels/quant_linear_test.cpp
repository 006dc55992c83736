#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "loom/device.h"
#include "loom/quant.h"

namespace loom::cpu {
namespace {

using namespace kernel_testing;

struct Case {
  QuantMethod method;
  int64_t group;  // int4
  int64_t C;
};

// Quantizing is stream work; the CPU kernels under test read its result on
// the host.
QuantizedWeight quantized(const Case& k, const std::vector<float>& w, int64_t OC) {
  QuantizedWeight q =
      k.method == QuantMethod::int8 ? quantize_int8(w.data(), OC, k.C) : quantize_int4(w.data(), OC, k.C, k.group);
  ops::synchronize();
  return q;
}

// The kernel's output rows ldo apart: the columns past OC must stay as they were.
std::vector<float> run(const QuantizedWeight& q, const std::vector<float>& x, const float* bias, int64_t N,
                       int64_t ldo) {
  std::vector<float> out(static_cast<size_t>(N * ldo), -7.0f);
  if (q.method == QuantMethod::int8)
    linear_forward_int8(out.data(), ldo, x.data(), q.values.data<int8_t>(), q.scales.data<float>(), bias, N, q.cols,
                        q.rows);
  else
    linear_forward_int4(out.data(), ldo, x.data(), q.values.data<uint8_t>(), q.scales.data<float>(),
                        q.zeros.data<uint8_t>(), bias, N, q.cols, q.rows, q.group);
  return out;
}

class QuantLinear : public ::testing::TestWithParam<Case> {};

// Against x W^T + b in double with W the dequantized weights, for the
// decode (N = 1), the tile remainders and a prefill-sized batch; the error
// is relative to the sum of the products' magnitudes (the dot products
// cancel, so |y| alone would be no scale).
TEST_P(QuantLinear, MatchesTheDequantizedWeightsInFp32) {
  const Case k = GetParam();
  const int64_t OC = 37, ldo = 41;  // OC not a multiple of the 4-row tiles
  const std::vector<float> w = random_vector(OC * k.C, 1), bias = random_vector(OC, 2);
  const QuantizedWeight q = quantized(k, w, OC);
  const Tensor deq_t = dequantize(q);
  ops::synchronize();  // dequantizing is stream work too
  const float* deq = deq_t.data<float>();
  for (int64_t N : {1, 3, 4, 9, 33}) {
    SCOPED_TRACE(N);
    const std::vector<float> x = random_vector(N * k.C, 3 + static_cast<uint64_t>(N));
    for (const float* b : {bias.data(), static_cast<const float*>(nullptr)}) {
      const std::vector<float> out = run(q, x, b, N, ldo);
      int failures = 0;
      for (int64_t i = 0; i < N; ++i)
        for (int64_t o = 0; o < ldo; ++o) {
          const float got = out[static_cast<size_t>(i * ldo + o)];
          if (o >= OC) {
            EXPECT_EQ(got, -7.0f) << "column " << o << " past OC was written";
            continue;
          }
          double ref = b != nullptr ? b[o] : 0.0, scale = b != nullptr ? std::fabs(b[o]) : 0.0;
          for (int64_t c = 0; c < k.C; ++c) {
            const double p = static_cast<double>(x[static_cast<size_t>(i * k.C + c)]) * deq[o * k.C + c];
            ref += p;
            scale += std::fabs(p);
          }
          if (!(std::fabs(got - ref) <= 1e-5 * scale) && ++failures <= 5)
            ADD_FAILURE() << "out[" << i << ", " << o << "] = " << got << ", reference " << ref;
        }
      EXPECT_EQ(failures, 0);
    }
  }
}

// A row of the output is the same bits whether its input row comes alone
// (decode) or in a batch (prefill, other tiles): generation's sequences
// must not depend on one another.
TEST_P(QuantLinear, ARowDoesNotDependOnTheBatch) {
  const Case k = GetParam();
  const int64_t OC = 13, N = 11;  // a tile of 8 tokens and 3 alone
  const QuantizedWeight q = quantized(k, random_vector(OC * k.C, 4), OC);
  const std::vector<float> x = random_vector(N * k.C, 5), bias = random_vector(OC, 6);
  const std::vector<float> batch = run(q, x, bias.data(), N, OC);
  for (int64_t i = 0; i < N; ++i) {
    const std::vector<float> row(x.begin() + i * k.C, x.begin() + (i + 1) * k.C);
    const std::vector<float> alone = run(q, row, bias.data(), 1, OC);
    EXPECT_EQ(0, std::memcmp(alone.data(), batch.data() + i * OC, static_cast<size_t>(OC) * sizeof(float)))
        << "row " << i;
  }
}

// Large enough for the parallel path (int8: 1050 columns keep a tail).
TEST_P(QuantLinear, ThreadInvariant) {
  const Case k = GetParam();
  const int64_t OC = 300, N = 7, C = k.method == QuantMethod::int8 ? k.C * 15 : 1024;
  const Case wide{k.method, k.group, C};
  const QuantizedWeight q = quantized(wide, random_vector(OC * C, 7), OC);
  ASSERT_GE(N * OC * C, 8 * 32768) << "the test must reach the parallel path";
  const std::vector<float> x = random_vector(N * C, 8), bias = random_vector(OC, 9);
  expect_thread_invariant([&] { return run(q, x, bias.data(), N, OC); });
}

// A quantized token table's lookup gives the dequantized matrix's rows,
// bit for bit (repeated and out-of-order ids included).
TEST_P(QuantLinear, EmbeddingLookupGivesTheDequantizedRows) {
  const Case k = GetParam();
  const int64_t rows = 19;
  const QuantizedWeight q = quantized(k, random_vector(rows * k.C, 10), rows);
  const Tensor deq_t = dequantize(q);
  ops::synchronize();
  const float* deq = deq_t.data<float>();
  const std::vector<int32_t> tokens = {3, 0, 18, 3, 7};
  const int64_t N = static_cast<int64_t>(tokens.size());
  std::vector<float> out(static_cast<size_t>(N * k.C), -7.0f);
  if (q.method == QuantMethod::int8)
    embedding_lookup_int8(out.data(), tokens.data(), q.values.data<int8_t>(), q.scales.data<float>(), N, q.cols);
  else
    embedding_lookup_int4(out.data(), tokens.data(), q.values.data<uint8_t>(), q.scales.data<float>(),
                          q.zeros.data<uint8_t>(), N, q.cols, q.group);
  for (int64_t i = 0; i < N; ++i)
    EXPECT_TRUE(std::equal(out.begin() + i * k.C, out.begin() + (i + 1) * k.C, deq + tokens[static_cast<size_t>(i)] * k.C))
        << "token " << tokens[static_cast<size_t>(i)];
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantLinear,
                         ::testing::Values(Case{QuantMethod::int8, 0, 96}, Case{QuantMethod::int8, 0, 70},
                                           Case{QuantMethod::int4, 32, 96}, Case{QuantMethod::int4, 128, 256}),
                         [](const auto& info) {
                           return str(quant_method_name(info.param.method), "_g", info.param.group, "_C",
                                      info.param.C);
                         });

}  // namespace
}  // namespace loom::cpu
