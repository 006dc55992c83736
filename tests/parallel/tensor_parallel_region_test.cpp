// The communication pairs at the edges of a tensor-parallel region, each
// direction on its own, with and without sequence parallelism.
#include <cmath>

#include <gtest/gtest.h>

#include "loom/parallel.h"

namespace loom {
namespace {

constexpr int kRanks = 2;
constexpr int64_t kRows = 4, kWidth = 3;  // every row of the micro-batch

// Element (row, col) of rank r's tensor: distinct per rank, row and column.
float value(int rank, int64_t row, int64_t col) { return static_cast<float>(100 * rank + 10 * row + col); }

Tensor rows_of_rank(int rank, int64_t first, int64_t rows) {
  Tensor t = Tensor::empty({rows, kWidth});
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < kWidth; ++c) t.data<float>()[i * kWidth + c] = value(rank, first + i, c);
  return t;
}

float at(const Tensor& t, int64_t row, int64_t col) { return t.data<float>()[row * kWidth + col]; }

TEST(TensorParallelRegion, TensorParallelEnterIsIdentityForwardAndAllReduceBackward) {
  run_local(kRanks, [](Communicator& world) {
    const TensorParallel tp{&world, false};
    const Tensor x = rows_of_rank(0, 0, kRows);  // replicated: the same on every rank
    EXPECT_EQ(TensorParallelRegion::enter_forward(tp, x).raw(), x.raw());
    const Tensor dx = rows_of_rank(world.rank(), 0, kRows);
    const Tensor summed = TensorParallelRegion::enter_backward(tp, dx);
    EXPECT_EQ(summed.raw(), dx.raw()) << "reduced in place";
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(summed, i, c), value(0, i, c) + value(1, i, c));
  });
}

TEST(TensorParallelRegion, TensorParallelLeaveIsAllReduceForwardAndIdentityBackward) {
  run_local(kRanks, [](Communicator& world) {
    const TensorParallel tp{&world, false};
    const Tensor partial = rows_of_rank(world.rank(), 0, kRows);
    const Tensor y = TensorParallelRegion::leave_forward(tp, partial);
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(y, i, c), value(0, i, c) + value(1, i, c));
    const Tensor dy = rows_of_rank(0, 0, kRows);
    EXPECT_EQ(TensorParallelRegion::leave_backward(tp, dy).raw(), dy.raw());
  });
}

TEST(TensorParallelRegion, SequenceParallelEnterIsAllGatherForwardAndReduceScatterBackward) {
  run_local(kRanks, [](Communicator& world) {
    const TensorParallel tp{&world, true};
    const int64_t mine = tp.local_rows(kRows), first = tp.first_row(kRows);
    ASSERT_EQ(mine, kRows / kRanks);
    // Each rank holds its rows of one activation; forward gathers all of them.
    const Tensor x = rows_of_rank(0, first, mine);
    const Tensor full = TensorParallelRegion::enter_forward(tp, x);
    ASSERT_EQ(full.numel(), kRows * kWidth);
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(full, i, c), value(0, i, c));
    // Backward: every rank's partial gradient of every row, summed, and each
    // rank keeps its own rows.
    const Tensor dfull = rows_of_rank(world.rank(), 0, kRows);
    const Tensor dx = TensorParallelRegion::enter_backward(tp, dfull);
    ASSERT_EQ(dx.numel(), mine * kWidth);
    for (int64_t i = 0; i < mine; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(dx, i, c), value(0, first + i, c) + value(1, first + i, c));
  });
}

TEST(TensorParallelRegion, SequenceParallelLeaveIsReduceScatterForwardAndAllGatherBackward) {
  run_local(kRanks, [](Communicator& world) {
    const TensorParallel tp{&world, true};
    const int64_t mine = tp.local_rows(kRows), first = tp.first_row(kRows);
    const Tensor y = TensorParallelRegion::leave_forward(tp, rows_of_rank(world.rank(), 0, kRows));
    ASSERT_EQ(y.numel(), mine * kWidth);
    for (int64_t i = 0; i < mine; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(y, i, c), value(0, first + i, c) + value(1, first + i, c));
    const Tensor dfull = TensorParallelRegion::leave_backward(tp, rows_of_rank(0, first, mine));
    ASSERT_EQ(dfull.numel(), kRows * kWidth);
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(at(dfull, i, c), value(0, i, c));
  });
}

// Each backward is the adjoint of its forward: summed over the ranks,
// <forward(x), dy> = <x, backward(dy)>, which is what makes the gradients of
// a split layer equal the unsplit layer's. Without sequence parallelism a
// replicated tensor appears once per rank in one of the two sums, hence the
// factor kRanks.
TEST(TensorParallelRegion, BackwardIsTheAdjointOfForward) {
  for (bool sp : {false, true}) {
    run_local(kRanks, [sp](Communicator& world) {
      const TensorParallel tp{&world, sp};
      const auto dot = [](const Tensor& a, const Tensor& b) {
        double s = 0.0;
        for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.data<float>()[i]) * b.data<float>()[i];
        return s;
      };
      const auto all_ranks = [&](double v) {
        float f = static_cast<float>(v);
        world.all_reduce(&f, 1, DType::f32, ReduceOp::sum);
        return static_cast<double>(f);
      };
      const int64_t mine = tp.local_rows(kRows), first = tp.first_row(kRows);
      // Enter: x lives outside the region (replicated, or split by token).
      const Tensor x = rows_of_rank(0, first, mine);
      const Tensor dfull = rows_of_rank(world.rank(), 0, kRows);
      const double lhs_enter = all_ranks(dot(TensorParallelRegion::enter_forward(tp, x), dfull));
      const double rhs_enter = all_ranks(dot(x, TensorParallelRegion::enter_backward(tp, dfull.clone(Tier::device))));
      const double replicas = sp ? 1.0 : kRanks;
      EXPECT_NEAR(lhs_enter * replicas, rhs_enter, 1e-5 * std::fabs(rhs_enter)) << "sp " << sp;
      // Leave: y is a partial sum inside the region.
      const Tensor partial = rows_of_rank(world.rank(), 0, kRows);
      const Tensor dy = rows_of_rank(0, first, mine);
      const double lhs_leave = all_ranks(dot(TensorParallelRegion::leave_forward(tp, partial.clone(Tier::device)), dy));
      const double rhs_leave = all_ranks(dot(partial, TensorParallelRegion::leave_backward(tp, dy)));
      EXPECT_NEAR(lhs_leave, rhs_leave * replicas, 1e-5 * std::fabs(lhs_leave)) << "sp " << sp;
    });
  }
}

TEST(TensorParallelRegion, AGroupOfOneReturnsItsArgument) {
  const TensorParallel none;
  const Tensor t = rows_of_rank(0, 0, kRows);
  EXPECT_EQ(TensorParallelRegion::enter_forward(none, t).raw(), t.raw());
  EXPECT_EQ(TensorParallelRegion::enter_backward(none, t).raw(), t.raw());
  EXPECT_EQ(TensorParallelRegion::leave_forward(none, t).raw(), t.raw());
  EXPECT_EQ(TensorParallelRegion::leave_backward(none, t).raw(), t.raw());
}

}  // namespace
}  // namespace loom
