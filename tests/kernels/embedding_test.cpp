#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

struct EmbeddingCase {
  int64_t B = 3, T = 5, C = 19, V = 11, P = 9, pos0 = 2;
  // Token 4 occurs several times, so dwte sums repeated rows.
  std::vector<int32_t> tokens = {4, 0, 4, 10, 3, 4, 1, 1, 9, 4, 7, 2, 4, 5, 6};
};

TEST(Embedding, ForwardAddsTokenAndPositionRows) {
  const EmbeddingCase e;
  const auto wte = random_vector(e.V * e.C, 1), wpe = random_vector(e.P * e.C, 2);
  std::vector<float> out(e.B * e.T * e.C);
  embedding_forward(out.data(), e.tokens.data(), wte.data(), wpe.data(), e.B, e.T, e.C, e.pos0);
  for (int64_t b = 0; b < e.B; ++b)
    for (int64_t t = 0; t < e.T; ++t)
      for (int64_t c = 0; c < e.C; ++c)
        EXPECT_EQ(out[(b * e.T + t) * e.C + c], wte[e.tokens[b * e.T + t] * e.C + c] + wpe[(e.pos0 + t) * e.C + c]);
}

TEST(Embedding, BackwardMatchesFiniteDifferencesWithRepeatedTokens) {
  const EmbeddingCase e;
  auto wte = random_vector(e.V * e.C, 1), wpe = random_vector(e.P * e.C, 2);
  const auto R = random_vector(e.B * e.T * e.C, 3);
  std::vector<float> dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f), out(R.size());
  embedding_backward(dwte.data(), dwpe.data(), R.data(), e.tokens.data(), e.B, e.T, e.C, e.pos0);
  auto loss = [&] {
    embedding_forward(out.data(), e.tokens.data(), wte.data(), wpe.data(), e.B, e.T, e.C, e.pos0);
    return kernel_testing::weighted_sum(out, R);
  };
  const kernel_testing::GradCheck opt{.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5, .max_checks = 1000};
  kernel_testing::expect_gradient_matches("dwte", wte, dwte, loss, opt);
  kernel_testing::expect_gradient_matches("dwpe", wpe, dwpe, loss, opt);
  // Rows of tokens that never occur, and positions outside [pos0, pos0 + T), stay zero.
  for (int64_t c = 0; c < e.C; ++c) {
    EXPECT_EQ(dwte[8 * e.C + c], 0.0f);
    EXPECT_EQ(dwpe[0 * e.C + c], 0.0f);
    EXPECT_EQ(dwpe[8 * e.C + c], 0.0f);
  }
}

TEST(Embedding, BackwardAccumulatesAndSkipsNullGradients) {
  const EmbeddingCase e;
  const auto dout = random_vector(e.B * e.T * e.C, 3);
  auto dwte = random_vector(e.V * e.C, 4), dwpe = random_vector(e.P * e.C, 5);
  const auto dwte0 = dwte, dwpe0 = dwpe;
  embedding_backward(dwte.data(), nullptr, dout.data(), e.tokens.data(), e.B, e.T, e.C, e.pos0);
  EXPECT_NE(dwte, dwte0);
  embedding_backward(nullptr, dwpe.data(), dout.data(), e.tokens.data(), e.B, e.T, e.C, e.pos0);
  for (int64_t t = 0; t < e.T; ++t)
    for (int64_t c = 0; c < e.C; ++c) {
      double expect = dwpe0[(e.pos0 + t) * e.C + c];
      for (int64_t b = 0; b < e.B; ++b) expect += dout[(b * e.T + t) * e.C + c];
      EXPECT_NEAR(dwpe[(e.pos0 + t) * e.C + c], expect, 1e-6);
    }
}

TEST(Embedding, ResultsDoNotDependOnThreadCount) {
  const int64_t B = 4, T = 64, C = 200, V = 50, pos0 = 3;
  std::vector<int32_t> tokens(B * T);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7) % 13);  // many repeats
  const auto wte = random_vector(V * C, 1), wpe = random_vector((T + pos0) * C, 2);
  const auto dout = random_vector(B * T * C, 3);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(B * T * C), dwte(V * C, 0.0f), dwpe((T + pos0) * C, 0.0f);
    embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, pos0);
    embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, pos0);
    return kernel_testing::concat({&out, &dwte, &dwpe});
  });
}

// A vocabulary of V rows split over three shards of `rows` rows each (the
// last one padded), as tensor parallelism holds the table.
struct ShardedTable {
  int64_t V = 11, C = 19, shards = 3, rows = 4;
  std::vector<int32_t> tokens = EmbeddingCase{}.tokens;
  int64_t N() const { return static_cast<int64_t>(tokens.size()); }
};

TEST(EmbeddingRange, ShardsTogetherLookUpEveryToken) {
  const ShardedTable s;
  const auto wte = random_vector(s.shards * s.rows * s.C, 1);  // padded to shards * rows rows
  std::vector<float> sum(s.N() * s.C, 0.0f), out(s.N() * s.C, 99.0f);
  for (int64_t k = 0; k < s.shards; ++k) {
    embedding_lookup_range(out.data(), s.tokens.data(), wte.data() + k * s.rows * s.C, k * s.rows, s.rows, s.N(), s.C);
    for (size_t i = 0; i < out.size(); ++i) sum[i] += out[i];
  }
  for (int64_t i = 0; i < s.N(); ++i)
    for (int64_t c = 0; c < s.C; ++c) EXPECT_EQ(sum[i * s.C + c], wte[s.tokens[i] * s.C + c]) << "row " << i;
}

TEST(EmbeddingRange, BackwardMatchesFiniteDifferencesAndTheWholeTable) {
  const ShardedTable s;
  const auto R = random_vector(s.N() * s.C, 3);
  const kernel_testing::GradCheck opt{.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5, .max_checks = 1000};
  std::vector<float> whole(s.V * s.C, 0.0f);
  embedding_backward(whole.data(), nullptr, R.data(), s.tokens.data(), 1, s.N(), s.C, 0);
  for (int64_t k = 1; k < s.shards; ++k) {  // the middle shard and the padded last one
    auto wte = random_vector(s.rows * s.C, 1);
    std::vector<float> dwte(wte.size(), 0.0f), out(R.size());
    embedding_lookup_range_backward(dwte.data(), R.data(), s.tokens.data(), k * s.rows, s.rows, s.N(), s.C);
    auto loss = [&] {
      embedding_lookup_range(out.data(), s.tokens.data(), wte.data(), k * s.rows, s.rows, s.N(), s.C);
      return kernel_testing::weighted_sum(out, R);
    };
    kernel_testing::expect_gradient_matches("dwte shard " + std::to_string(k), wte, dwte, loss, opt);
    // Each real row of the shard is the whole table's row, summed in the same order.
    for (int64_t r = 0; r < s.rows && k * s.rows + r < s.V; ++r)
      for (int64_t c = 0; c < s.C; ++c)
        EXPECT_EQ(dwte[r * s.C + c], whole[(k * s.rows + r) * s.C + c]) << "shard " << k << " row " << r;
  }
}

TEST(EmbeddingRange, PositionAddAndBackwardMatchFiniteDifferences) {
  // Rows [row0, row0 + N) of a micro-batch of sequences of T tokens, as one
  // sequence-parallel rank holds them: they wrap around a sequence boundary.
  const int64_t T = 7, C = 13, row0 = 5, N = 12, pos0 = 2;
  auto wpe = random_vector((pos0 + T) * C, 1);
  const auto base = random_vector(N * C, 2), R = random_vector(N * C, 3);
  std::vector<float> out = base;
  position_embedding_add(out.data(), wpe.data(), row0, N, T, C, pos0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(out[i * C + c], base[i * C + c] + wpe[(pos0 + (row0 + i) % T) * C + c]) << "row " << i;
  // The backward indexes dwpe from the first position in use.
  std::vector<float> dwpe(wpe.size(), 0.0f);
  position_embedding_backward(dwpe.data() + pos0 * C, R.data(), row0, N, T, C);
  auto loss = [&] {
    out = base;
    position_embedding_add(out.data(), wpe.data(), row0, N, T, C, pos0);
    return kernel_testing::weighted_sum(out, R);
  };
  const kernel_testing::GradCheck opt{.step = 1e-2, .rtol = 1e-4, .atol = 1e-5, .norm_rtol = 1e-5, .max_checks = 1000};
  kernel_testing::expect_gradient_matches("dwpe", wpe, dwpe, loss, opt);
}

TEST(EmbeddingRange, ResultsDoNotDependOnThreadCount) {
  const int64_t N = 256, C = 200, rows = 20, first = 20, T = 64, row0 = 32;
  std::vector<int32_t> tokens(N);
  for (int64_t i = 0; i < N; ++i) tokens[i] = static_cast<int32_t>((i * 7) % 50);  // repeats, in and out of range
  const auto wte = random_vector(rows * C, 1), wpe = random_vector(T * C, 2), dout = random_vector(N * C, 3);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> out(N * C), dwte(rows * C, 0.0f), dwpe(T * C, 0.0f);
    embedding_lookup_range(out.data(), tokens.data(), wte.data(), first, rows, N, C);
    position_embedding_add(out.data(), wpe.data(), row0, N, T, C, 0);
    embedding_lookup_range_backward(dwte.data(), dout.data(), tokens.data(), first, rows, N, C);
    position_embedding_backward(dwpe.data(), dout.data(), row0, N, T, C);
    return kernel_testing::concat({&out, &dwte, &dwpe});
  });
}

}  // namespace
}  // namespace loom::cpu
