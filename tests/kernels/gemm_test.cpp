#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <tuple>

#include "kernel_test_util.h"
#include "kernels/cpu/partition.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

using GemmFn = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                       float, float*, int64_t);

// Every transpose combination on strided views (leading dimensions wider
// than the rows) with alpha and beta, against a double-precision reference.
void expect_matches_reference_for_all_transposes(const char* what, GemmFn fn, int64_t M, int64_t N, int64_t K,
                                                 double atol) {
  const int64_t pad = 7;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
      const auto A = random_vector((ta ? K : M) * lda, 1), B = random_vector((tb ? N : K) * ldb, 2);
      auto C = random_vector(M * ldc, 3);
      const auto ref =
          kernel_testing::reference_gemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, -1.5f, C.data(), ldc);
      const auto before = C;
      fn(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, -1.5f, C.data(), ldc);
      std::vector<float> dense(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) dense[i * N + j] = C[i * ldc + j];
      kernel_testing::expect_close(std::string(what) + " ta=" + (ta ? "T" : "N") + " tb=" + (tb ? "T" : "N"), dense,
                                   ref, 1e-5, atol);
      for (int64_t i = 0; i < M; ++i)  // the padding columns are left alone
        for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(C[i * ldc + j], before[i * ldc + j]);
    }
}

// One tile, several tiles along the rows of C, several along its columns.
TEST(Gemm, MatchesReferenceForAllTransposesOnStridedViews) {
  for (const auto& [M, N, K] : {std::array<int64_t, 3>{37, 29, 53}, {300, 21, 17}, {19, 290, 23}}) {
    expect_matches_reference_for_all_transposes("gemm", [](auto... args) { gemm(args...); }, M, N, K, 1e-5);
    expect_matches_reference_for_all_transposes(
        "gemm with fixed row blocks", [](auto... args) { gemm(args..., RowBlocking::fixed); }, M, N, K, 1e-5);
  }
}

TEST(Gemm, EmptyInnerDimensionScalesC) {
  std::vector<float> C = {1.0f, 2.0f, 3.0f, 4.0f};
  const float unused = 0.0f;
  gemm(false, false, 2, 2, 0, 1.0f, &unused, 1, &unused, 2, 3.0f, C.data(), 2);
  EXPECT_EQ(C, (std::vector<float>{3.0f, 6.0f, 9.0f, 12.0f}));
}

TEST(Gemm, ResultDoesNotDependOnThreadCount) {
  const int64_t M = 301, N = 257, K = 190;
  const auto A = random_vector(M * K, 4), B = random_vector(N * K, 5);
  kernel_testing::expect_thread_invariant([&] {
    std::vector<float> C(M * N);
    gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N);
    std::vector<float> D(K * N);
    gemm(true, false, K, N, M, 1.0f, A.data(), K, C.data(), N, 0.0f, D.data(), N);
    // A single tile with a long inner dimension, which BLAS would thread itself.
    std::vector<float> E(150 * 70);
    gemm(true, false, 150, 70, M, 1.0f, A.data(), K, B.data(), 70, 0.0f, E.data(), 70);
    return kernel_testing::concat({&C, &D, &E});
  });
}

// A small C with a long K (a weight gradient over many tokens): K is cut into
// chunks (here 2000 / 256 -> 7).
TEST(GemmSplitK, MatchesReferenceForAllTransposes) {
  expect_matches_reference_for_all_transposes("split-K gemm", gemm_split_k, 40, 90, 2000, 1e-4);
}

TEST(GemmSplitK, ResultDoesNotDependOnThreadCount) {
  // One tile of C and seven K chunks: the threads share the chunks.
  const int64_t M = 64, N = 48, K = 1900;
  const auto A = random_vector(K * M, 4), B = random_vector(K * N, 5), C0 = random_vector(M * N, 6);
  kernel_testing::expect_thread_invariant([&] {
    auto C = C0;
    gemm_split_k(true, false, M, N, K, 1.0f, A.data(), M, B.data(), N, 1.0f, C.data(), N);
    return C;
  });
}

TEST(Gemm, FixedRowBlocksGiveEachRowTheBitsItGetsAlone) {
  // Shapes where BLAS's own kernels change with the row count, transposed A
  // included; beta adds into C.
  for (const auto& [N, K, trans_a] : {std::tuple{int64_t{64}, int64_t{64}, false},
                                      std::tuple{int64_t{768}, int64_t{256}, false},
                                      std::tuple{int64_t{2048}, int64_t{1024}, true}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " K=" << K << " trans_a=" << trans_a);
    const int64_t M = 19;
    const auto A = random_vector(M * K, 1), B = random_vector(N * K, 2), C0 = random_vector(M * N, 3);
    auto run = [&](int64_t first, int64_t rows) {  // rows [first, first + rows) of the product
      std::vector<float> a(static_cast<size_t>(rows * K)), c(C0.begin() + first * N, C0.begin() + (first + rows) * N);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) a[r * K + k] = A[(first + r) * K + k];
      std::vector<float> at(a.size());  // op(A) = a when A is stored transposed
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) at[k * rows + r] = a[r * K + k];
      gemm(trans_a, true, rows, N, K, 0.5f, trans_a ? at.data() : a.data(), trans_a ? rows : K, B.data(), K, 1.0f,
           c.data(), N, RowBlocking::fixed);
      return c;
    };
    const std::vector<float> all = run(0, M);
    for (int64_t first : {int64_t{0}, int64_t{8}, int64_t{13}}) {
      const std::vector<float> one = run(first, 1), some = run(first, 3);
      EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin() + first * N)) << "row " << first << " alone";
      EXPECT_TRUE(std::equal(some.begin(), some.begin() + N, all.begin() + first * N)) << "row " << first;
    }
    const std::vector<double> want =
        kernel_testing::reference_gemm(false, true, M, N, K, 0.5f, A.data(), K, B.data(), K, 1.0f, C0.data(), N);
    kernel_testing::expect_close("fixed rows", all, want, 1e-5, 1e-5);
  }
}

}  // namespace
}  // namespace loom::cpu
