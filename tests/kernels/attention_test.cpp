#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using kernel_testing::random_vector;

// Naive causal attention in double with the full T x T score matrix; query
// head h reads kv head h / (NH / NKV) of qkv [B, T, C + 2 NKV hs].
void reference_attention(std::vector<double>& out, std::vector<double>& lse, const std::vector<float>& qkv, int64_t B,
                         int64_t T, int64_t C, int64_t NH, int64_t NKV) {
  const int64_t hs = C / NH, row = C + 2 * NKV * hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(B * T * C, 0.0);
  lse.assign(B * NH * T, 0.0);
  std::vector<double> scores(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t kv = h / (NH / NKV);
        const float* q = &qkv[(b * T + t) * row + h * hs];
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float* k = &qkv[(b * T + j) * row + C + kv * hs];
          double s = 0.0;
          for (int64_t d = 0; d < hs; ++d) s += static_cast<double>(q[d]) * k[d];
          scores[j] = s * scale;
          m = std::max(m, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= t; ++j) sum += std::exp(scores[j] - m);
        lse[(b * NH + h) * T + t] = m + std::log(sum);
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(scores[j] - m) / sum;
          const float* v = &qkv[(b * T + j) * row + C + (NKV + kv) * hs];
          for (int64_t d = 0; d < hs; ++d) out[(b * T + t) * C + h * hs + d] += p * v[d];
        }
      }
}

struct AttentionCase {
  int64_t B, T, C, NH;
};

class AttentionForward : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionForward, MatchesNaiveAttention) {
  const auto [B, T, C, NH] = GetParam();
  const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  std::vector<double> ref_out, ref_lse;
  reference_attention(ref_out, ref_lse, qkv, B, T, C, NH, NH);
  kernel_testing::expect_close("out", out, ref_out, 1e-5, 1e-5);
  kernel_testing::expect_close("lse", lse, ref_lse, 1e-6, 1e-6);
}

// T below, at, and past the 64-row query tile (with a partial last tile),
// odd head sizes, several heads and batches.
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionForward,
                         ::testing::Values(AttentionCase{1, 1, 8, 2}, AttentionCase{2, 13, 15, 3},
                                           AttentionCase{1, 64, 16, 1}, AttentionCase{3, 130, 20, 4},
                                           AttentionCase{2, 200, 48, 2}));

class AttentionBackward : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionBackward, MatchesFiniteDifferences) {
  const auto [B, T, C, NH] = GetParam();
  auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f);
  const auto R = random_vector(B * T * C, 2);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), R.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  std::vector<float> out2(out.size()), lse2(lse.size());
  auto loss = [&] {
    attention_forward(out2.data(), lse2.data(), qkv.data(), B, T, C, NH, NH);
    return kernel_testing::weighted_sum(out2, R);
  };
  // A step of 4e-3, not the default 1e-3: the loss sums up to 2000 float
  // outputs, whose rounding alone moves a difference quotient at 1e-3 by
  // about 1e-3 when T = 250, as much as the tolerance (it failed by 3% in an
  // -O2 build); attention is smooth enough that the larger step's
  // truncation error stays far below it.
  kernel_testing::expect_gradient_matches("dqkv", qkv, dqkv, loss, {.step = 4e-3, .max_checks = 600});
  // q, k and v each get a nonzero gradient (none of the three GEMMs dropped).
  for (int64_t part = 0; part < 3; ++part) {
    double norm = 0.0;
    for (int64_t i = 0; i < B * T; ++i)
      for (int64_t c = 0; c < C; ++c) norm += std::fabs(dqkv[i * 3 * C + part * C + c]);
    EXPECT_GT(norm, 1.0) << "part " << part;
  }
}

// Two query tiles, the second partial (6 heads: the keys of each are cut into
// two ranges); one head over four tiles (four key ranges); 48 heads (no key
// ranges, one task per head).
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackward,
                         ::testing::Values(AttentionCase{2, 70, 24, 3}, AttentionCase{1, 250, 8, 1},
                                           AttentionCase{4, 66, 12, 12}));

TEST(Attention, BackwardAccumulates) {
  const int64_t B = 2, T = 67, C = 12, NH = 2;
  const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  std::vector<float> fresh(qkv.size(), 0.0f);
  attention_backward(fresh.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  auto acc = random_vector(qkv.size(), 3);
  const auto acc0 = acc;
  attention_backward(acc.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
  std::vector<double> expect(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) expect[i] = static_cast<double>(acc0[i]) + fresh[i];
  kernel_testing::expect_close("dqkv", acc, expect, 1e-5, 1e-5);
}

TEST(Attention, ResultsDoNotDependOnThreadCount) {
  // Several heads, and one head whose key ranges the backward's threads share.
  for (const AttentionCase& c : {AttentionCase{2, 150, 48, 3}, AttentionCase{1, 400, 16, 1}}) {
    const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
    SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << T << " NH=" << NH);
    const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
    kernel_testing::expect_thread_invariant([&] {
      std::vector<float> out(B * T * C), lse(B * NH * T), dqkv(qkv.size(), 0.0f);
      attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
      attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
      return kernel_testing::concat({&out, &lse, &dqkv});
    });
  }
}

// Grouped-query attention: NKV kv heads shared by groups of NH / NKV query heads.
struct GqaCase {
  int64_t B, T, C, NH, NKV;
  int64_t row() const { return C + 2 * NKV * (C / NH); }  // q | k | v floats per token
};

class GroupedQueryAttention : public ::testing::TestWithParam<GqaCase> {};

TEST_P(GroupedQueryAttention, ForwardMatchesNaiveAttention) {
  const GqaCase c = GetParam();
  const auto qkv = random_vector(c.B * c.T * c.row(), 1, -2.0f, 2.0f);
  std::vector<float> out(c.B * c.T * c.C), lse(c.B * c.NH * c.T);
  attention_forward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
  std::vector<double> ref_out, ref_lse;
  reference_attention(ref_out, ref_lse, qkv, c.B, c.T, c.C, c.NH, c.NKV);
  kernel_testing::expect_close("out", out, ref_out, 1e-5, 1e-5);
  kernel_testing::expect_close("lse", lse, ref_lse, 1e-6, 1e-6);
}

TEST_P(GroupedQueryAttention, BackwardMatchesFiniteDifferences) {
  const GqaCase c = GetParam();
  auto qkv = random_vector(c.B * c.T * c.row(), 1, -2.0f, 2.0f);
  const auto R = random_vector(c.B * c.T * c.C, 2);
  std::vector<float> out(c.B * c.T * c.C), lse(c.B * c.NH * c.T);
  attention_forward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), R.data(), out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
  std::vector<float> out2(out.size()), lse2(lse.size());
  auto loss = [&] {
    attention_forward(out2.data(), lse2.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
    return kernel_testing::weighted_sum(out2, R);
  };
  // The loss sums B*T*C float outputs, whose rounding makes a difference
  // quotient over a 1e-3 step noisy by ~1e-3 on the larger shapes; a wider
  // step keeps that noise well inside the tolerance (attention is smooth).
  kernel_testing::expect_gradient_matches("dqkv", qkv, dqkv, loss, {.step = 4e-3, .max_checks = 600});
  // Every query head and every kv head's k and v get a nonzero gradient.
  const int64_t hs = c.C / c.NH;
  for (int64_t col = 0; col < c.row(); col += hs) {
    double norm = 0.0;
    for (int64_t i = 0; i < c.B * c.T; ++i)
      for (int64_t d = 0; d < hs; ++d) norm += std::fabs(dqkv[i * c.row() + col + d]);
    EXPECT_GT(norm, 0.1) << "columns from " << col;
  }
}

// One kv head (multi-query), two, and as many as query heads; with key
// ranges shared out (few kv heads) and a partial last query tile.
INSTANTIATE_TEST_SUITE_P(Shapes, GroupedQueryAttention,
                         ::testing::Values(GqaCase{2, 70, 24, 4, 1}, GqaCase{1, 150, 16, 4, 2},
                                           GqaCase{2, 70, 24, 4, 4}, GqaCase{2, 13, 18, 6, 3}));

// qkv with each kv head repeated for the query heads of its group (repeat_kv):
// the multi-head layout that grouped-query attention must equal.
std::vector<float> repeat_kv(const std::vector<float>& qkv, const GqaCase& c) {
  const int64_t hs = c.C / c.NH, group = c.NH / c.NKV;
  std::vector<float> mha(static_cast<size_t>(c.B * c.T * 3 * c.C));
  for (int64_t i = 0; i < c.B * c.T; ++i) {
    const float* src = &qkv[i * c.row()];
    float* dst = &mha[i * 3 * c.C];
    std::copy_n(src, c.C, dst);
    for (int64_t h = 0; h < c.NH; ++h) {
      std::copy_n(src + c.C + h / group * hs, hs, dst + c.C + h * hs);
      std::copy_n(src + c.C + (c.NKV + h / group) * hs, hs, dst + 2 * c.C + h * hs);
    }
  }
  return mha;
}

TEST(GroupedQueryAttentionVsRepeatedKv, SameOutputAndSummedGradients) {
  for (const GqaCase& c : {GqaCase{2, 70, 24, 4, 1}, GqaCase{1, 200, 24, 6, 2}, GqaCase{3, 20, 16, 4, 2}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " NH=" << c.NH << " NKV=" << c.NKV);
    const auto qkv = random_vector(c.B * c.T * c.row(), 1, -2.0f, 2.0f), dout = random_vector(c.B * c.T * c.C, 2);
    const auto mha = repeat_kv(qkv, c);
    std::vector<float> out(c.B * c.T * c.C), lse(c.B * c.NH * c.T), out_mha(out.size()), lse_mha(lse.size());
    attention_forward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
    attention_forward(out_mha.data(), lse_mha.data(), mha.data(), c.B, c.T, c.C, c.NH, c.NH);
    // The same products on the same numbers, only read through other strides.
    EXPECT_EQ(out, out_mha);
    EXPECT_EQ(lse, lse_mha);
    std::vector<float> dqkv(qkv.size(), 0.0f), dmha(mha.size(), 0.0f);
    attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
    attention_backward(dmha.data(), dout.data(), out_mha.data(), lse_mha.data(), mha.data(), c.B, c.T, c.C, c.NH,
                       c.NH);
    // dq as multi-head attention's; a kv head's dk and dv the sums over its
    // group's repeated copies.
    const int64_t hs = c.C / c.NH, group = c.NH / c.NKV;
    std::vector<double> expect(dqkv.size(), 0.0);
    for (int64_t i = 0; i < c.B * c.T; ++i) {
      for (int64_t j = 0; j < c.C; ++j) expect[i * c.row() + j] = dmha[i * 3 * c.C + j];
      for (int64_t h = 0; h < c.NH; ++h)
        for (int64_t d = 0; d < hs; ++d) {
          expect[i * c.row() + c.C + h / group * hs + d] += dmha[i * 3 * c.C + c.C + h * hs + d];
          expect[i * c.row() + c.C + (c.NKV + h / group) * hs + d] += dmha[i * 3 * c.C + 2 * c.C + h * hs + d];
        }
    }
    kernel_testing::expect_close("dqkv", dqkv, expect, 1e-5, 1e-5);
  }
}

TEST(GroupedQueryAttention, ResultsDoNotDependOnThreadCount) {
  // Several kv heads, and one kv head whose key ranges the threads share.
  for (const GqaCase& c : {GqaCase{2, 150, 48, 4, 2}, GqaCase{1, 400, 16, 4, 1}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " NH=" << c.NH << " NKV=" << c.NKV);
    const auto qkv = random_vector(c.B * c.T * c.row(), 1, -2.0f, 2.0f), dout = random_vector(c.B * c.T * c.C, 2);
    kernel_testing::expect_thread_invariant([&] {
      std::vector<float> out(c.B * c.T * c.C), lse(c.B * c.NH * c.T), dqkv(qkv.size(), 0.0f);
      attention_forward(out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
      attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), c.B, c.T, c.C, c.NH, c.NKV);
      return kernel_testing::concat({&out, &lse, &dqkv});
    });
  }
}

// Sequences of different lengths decoded together: each is a whole
// sequence's qkv [T, row] whose first `cached` positions enter its cache in
// an earlier call (a prefill), the rest in a later one.
struct DecodeSeq {
  int64_t T, cached;
};

// Runs attention_decode over the sequences in two calls (their cached
// prefixes, then the remaining rows, all sequences packed together) and
// returns out and lse of every sequence's rows in sequence order, [T, C]
// and [T, NH] each. The caches live in one buffer in reverse slot order.
struct DecodeRun {
  std::vector<float> out, lse;
};
DecodeRun decode_in_two_calls(const std::vector<std::vector<float>>& qkv, const std::vector<DecodeSeq>& seqs,
                              int64_t C, int64_t NH, int64_t NKV, int64_t max_len) {
  const int64_t S = static_cast<int64_t>(seqs.size()), hs = C / NH, row = C + 2 * NKV * hs;
  const int64_t slot = NKV * max_len * hs;
  std::vector<float> k(static_cast<size_t>(S * slot), NAN), v(k.size(), NAN);
  std::vector<float*> kp, vp;
  for (int64_t s = 0; s < S; ++s) {
    kp.push_back(k.data() + (S - 1 - s) * slot);
    vp.push_back(v.data() + (S - 1 - s) * slot);
  }
  std::vector<std::vector<float>> out(seqs.size()), lse(seqs.size());
  for (int call = 0; call < 2; ++call) {
    std::vector<int32_t> lens, offsets{0};
    std::vector<float> packed;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int64_t first = call == 0 ? 0 : seqs[s].cached, last = call == 0 ? seqs[s].cached : seqs[s].T;
      lens.push_back(static_cast<int32_t>(first));
      offsets.push_back(offsets.back() + static_cast<int32_t>(last - first));
      packed.insert(packed.end(), qkv[s].begin() + first * row, qkv[s].begin() + last * row);
    }
    const int64_t N = offsets.back();
    std::vector<float> o(static_cast<size_t>(N * C)), l(static_cast<size_t>(N * NH));
    attention_decode(o.data(), l.data(), kp.data(), vp.data(), packed.data(), lens.data(), offsets.data(), S, N, C,
                     NH, NKV, max_len);
    for (size_t s = 0; s < seqs.size(); ++s) {
      out[s].insert(out[s].end(), o.begin() + offsets[s] * C, o.begin() + offsets[s + 1] * C);
      lse[s].insert(lse[s].end(), l.begin() + offsets[s] * NH, l.begin() + offsets[s + 1] * NH);
    }
  }
  DecodeRun r;
  for (size_t s = 0; s < seqs.size(); ++s) {
    r.out.insert(r.out.end(), out[s].begin(), out[s].end());
    r.lse.insert(r.lse.end(), lse[s].begin(), lse[s].end());
  }
  return r;
}

TEST(AttentionDecode, MatchesTheFullCausalForwardPerSequence) {
  // One token after a long cache, a prefill longer than a query tile, an
  // empty cache, several new rows after a short one.
  const std::vector<DecodeSeq> seqs{{90, 89}, {150, 5}, {7, 0}, {30, 26}};
  const int64_t C = 24, NH = 4, max_len = 160;
  for (int64_t NKV : {int64_t{1}, int64_t{2}, NH}) {
    SCOPED_TRACE(::testing::Message() << "NKV=" << NKV);
    const int64_t row = C + 2 * NKV * (C / NH);
    std::vector<std::vector<float>> qkv;
    std::vector<float> want_out, want_lse;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int64_t T = seqs[s].T;
      qkv.push_back(random_vector(T * row, 10 + s, -2.0f, 2.0f));
      std::vector<float> out(T * C), lse(NH * T);
      attention_forward(out.data(), lse.data(), qkv.back().data(), 1, T, C, NH, NKV);
      want_out.insert(want_out.end(), out.begin(), out.end());
      for (int64_t t = 0; t < T; ++t)  // [NH, T] -> [T, NH]
        for (int64_t h = 0; h < NH; ++h) want_lse.push_back(lse[h * T + t]);
    }
    const DecodeRun got = decode_in_two_calls(qkv, seqs, C, NH, NKV, max_len);
    kernel_testing::expect_close("out", got.out, kernel_testing::to_double(want_out), 1e-5, 1e-5);
    kernel_testing::expect_close("lse", got.lse, kernel_testing::to_double(want_lse), 1e-5, 1e-5);
  }
}

TEST(AttentionDecode, ResultsDoNotDependOnThreadCountOrTheRestOfTheBatch) {
  const std::vector<DecodeSeq> seqs{{70, 3}, {12, 11}, {40, 20}};
  const int64_t C = 32, NH = 4, NKV = 2, max_len = 80, row = C + 2 * NKV * (C / NH);
  std::vector<std::vector<float>> qkv;
  for (size_t s = 0; s < seqs.size(); ++s) qkv.push_back(random_vector(seqs[s].T * row, 20 + s, -2.0f, 2.0f));
  kernel_testing::expect_thread_invariant([&] {
    const DecodeRun r = decode_in_two_calls(qkv, seqs, C, NH, NKV, max_len);
    return kernel_testing::concat({&r.out, &r.lse});
  });
  // The last sequence alone gives the bits it gets in the batch.
  const DecodeRun all = decode_in_two_calls(qkv, seqs, C, NH, NKV, max_len);
  const DecodeRun alone = decode_in_two_calls({qkv.back()}, {seqs.back()}, C, NH, NKV, max_len);
  const std::vector<float> tail(all.out.end() - static_cast<std::ptrdiff_t>(alone.out.size()), all.out.end());
  EXPECT_EQ(tail, alone.out);
}

}  // namespace
}  // namespace loom::cpu
