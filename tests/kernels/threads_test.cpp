#include <gtest/gtest.h>
#include <omp.h>

#include <thread>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

TEST(Threads, SetNumThreadsSetsTheCallersOpenMPBudget) {
  const int saved = num_threads();
  for (int n : {1, 3, 2}) {
    set_num_threads(n);
    EXPECT_EQ(num_threads(), n);
    EXPECT_EQ(omp_get_max_threads(), n);
  }
  set_num_threads(saved);
}

// gemm runs BLAS single-threaded by lowering the budget inside its own
// parallel region only.
TEST(Threads, GemmLeavesTheCallersBudgetAlone) {
  const int saved = num_threads();
  set_num_threads(2);
  const auto A = random_vector(300 * 300, 1);
  std::vector<float> C(300 * 300);
  gemm(false, false, 300, 300, 300, 1.0f, A.data(), 300, A.data(), 300, 0.0f, C.data(), 300);  // two tiles
  EXPECT_EQ(num_threads(), 2);
  gemm(false, false, 100, 100, 300, 1.0f, A.data(), 300, A.data(), 100, 0.0f, C.data(), 100);  // one tile
  EXPECT_EQ(num_threads(), 2);
  set_num_threads(saved);
}

// Each thread of a parallel region runs its own GEMM (attention does this).
TEST(Threads, GemmInsideAParallelRegionIsCorrect) {
  const int64_t M = 67, N = 45, K = 130;
  constexpr int kThreads = 2;
  std::vector<std::vector<float>> A, B, C(kThreads, std::vector<float>(M * N, 0.0f));
  for (int t = 0; t < kThreads; ++t) {
    A.push_back(random_vector(M * K, 10 + t));
    B.push_back(random_vector(K * N, 20 + t));
  }
#pragma omp parallel num_threads(kThreads)
  {
    const int t = omp_get_thread_num();
    for (int rep = 0; rep < 20; ++rep)
      gemm(false, false, M, N, K, 1.0f, A[t].data(), K, B[t].data(), N, 0.0f, C[t].data(), N);
  }
  for (int t = 0; t < kThreads; ++t) {
    const auto ref = kernel_testing::reference_gemm(false, false, M, N, K, 1.0f, A[t].data(), K, B[t].data(), N, 0.0f,
                                                    C[t].data(), N);
    kernel_testing::expect_close("C of thread " + std::to_string(t), C[t], ref, 1e-5, 1e-5);
  }
}

// Ranks run as threads, each with the same budget, calling GEMMs at once.
TEST(Threads, RankThreadsRunGemmsConcurrently) {
  const int64_t M = 200, N = 150, K = 120;
  const auto A = random_vector(M * K, 1), B = random_vector(K * N, 2);
  const auto ref =
      kernel_testing::reference_gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, nullptr, N);
  const int saved = num_threads();
  std::vector<std::vector<float>> C(2, std::vector<float>(M * N));
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      set_num_threads(1);
      for (int rep = 0; rep < 10; ++rep)
        gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C[r].data(), N);
    });
  for (auto& t : ranks) t.join();
  set_num_threads(saved);
  for (int r = 0; r < 2; ++r) kernel_testing::expect_close("C of rank " + std::to_string(r), C[r], ref, 1e-5, 1e-5);
}

}  // namespace
}  // namespace loom::cpu
