// The split-width norm kernels, run over column slices of each row with the
// slices' partial sums added as the ranks' all-reduce would, match the
// whole-row LayerNorm and RMSNorm kernels.
#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

constexpr int64_t kN = 11, kC = 48;
// Three ranks' column slices of uneven widths.
const std::vector<std::pair<int64_t, int64_t>> kSlices{{0, 16}, {16, 24}, {40, 8}};  // (first, width)

std::vector<float> columns(const std::vector<float>& x, int64_t first, int64_t width) {
  std::vector<float> out(static_cast<size_t>(kN * width));
  for (int64_t i = 0; i < kN; ++i)
    for (int64_t c = 0; c < width; ++c) out[i * width + c] = x[i * kC + first + c];
  return out;
}

void put_columns(std::vector<float>& x, const std::vector<float>& part, int64_t first, int64_t width) {
  for (int64_t i = 0; i < kN; ++i)
    for (int64_t c = 0; c < width; ++c) x[i * kC + first + c] = part[i * width + c];
}

// Every slice's partial sums (n per row), added in slice order.
std::vector<float> summed(const std::function<std::vector<float>(int64_t, int64_t)>& partial) {
  std::vector<float> total;
  for (const auto& [first, width] : kSlices) {
    const std::vector<float> p = partial(first, width);
    if (total.empty())
      total = p;
    else
      for (size_t i = 0; i < p.size(); ++i) total[i] += p[i];
  }
  return total;
}

void check(bool layernorm) {
  auto x = random_vector(kN * kC, 1);
  for (int64_t i = 0; i < kN * kC; ++i) x[i] = 0.3f + 2.0f * x[i];  // an offset mean
  const auto w = random_vector(kC, 2, 0.5f, 1.5f), b = random_vector(kC, 3), dout = random_vector(kN * kC, 4);
  const float eps = 1e-5f;

  // Whole rows.
  std::vector<float> out(kN * kC), mean(kN), rstd(kN), dinp(kN * kC), dw(kC, 0.0f), db(kC, 0.0f);
  if (layernorm) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), kN, kC);
    layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(),
                       kN, kC, GradWrite::overwrite);
  } else {
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), kN, kC, eps);
    rmsnorm_backward(dinp.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), kN, kC,
                     GradWrite::overwrite);
  }

  // Split rows: the protocol of kernels.h.
  std::vector<float> split_mean;
  if (layernorm) {
    split_mean = summed([&](int64_t first, int64_t width) {
      std::vector<float> s(kN);
      norm_row_sums(s.data(), columns(x, first, width).data(), kN, width);
      return s;
    });
    for (float& m : split_mean) m *= 1.0f / static_cast<float>(kC);
  }
  const float* m = layernorm ? split_mean.data() : nullptr;
  std::vector<float> split_rstd = summed([&](int64_t first, int64_t width) {
    std::vector<float> s(kN);
    norm_row_square_sums(s.data(), columns(x, first, width).data(), m, kN, width);
    return s;
  });
  norm_rstd(split_rstd.data(), split_rstd.data(), kN, kC, eps);
  const std::vector<float> sums = summed([&](int64_t first, int64_t width) {
    std::vector<float> s(2 * kN);
    norm_backward_sums(s.data(), columns(dout, first, width).data(), columns(x, first, width).data(), w.data() + first,
                       m, split_rstd.data(), kN, width);
    return s;
  });
  std::vector<float> split_out(kN * kC), split_dinp(kN * kC), split_dw(kC, 0.0f), split_db(kC, 0.0f);
  for (const auto& [first, width] : kSlices) {
    const std::vector<float> xs = columns(x, first, width);
    std::vector<float> o(kN * width), d(kN * width);
    norm_apply(o.data(), xs.data(), m, split_rstd.data(), w.data() + first, layernorm ? b.data() + first : nullptr,
               kN, width);
    norm_backward_apply(d.data(), split_dw.data() + first, layernorm ? split_db.data() + first : nullptr,
                        columns(dout, first, width).data(), xs.data(), w.data() + first, m, split_rstd.data(),
                        sums.data(), kN, width, kC, GradWrite::overwrite);
    put_columns(split_out, o, first, width);
    put_columns(split_dinp, d, first, width);
  }
  using kernel_testing::expect_close;
  using kernel_testing::to_double;
  expect_close("out", split_out, to_double(out), 1e-5, 1e-6);
  expect_close("rstd", split_rstd, to_double(rstd), 1e-5, 0.0);
  expect_close("dinp", split_dinp, to_double(dinp), 1e-5, 1e-6);
  expect_close("dweight", split_dw, to_double(dw), 1e-5, 1e-6);
  if (layernorm) {
    expect_close("mean", split_mean, to_double(mean), 1e-5, 1e-6);
    expect_close("dbias", split_db, to_double(db), 1e-5, 1e-6);
  }
}

TEST(SplitNorm, LayerNormOverColumnSlicesMatchesWholeRows) { check(/*layernorm=*/true); }
TEST(SplitNorm, RMSNormOverColumnSlicesMatchesWholeRows) { check(/*layernorm=*/false); }

}  // namespace
}  // namespace loom::cpu
