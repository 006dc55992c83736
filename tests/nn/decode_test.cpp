// Generation's forward pass: a decode batch over a KV cache pool gives the
// logits of the training forward over each whole sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "loom/nn.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::random_tokens;

GPTConfig decode_config(const std::string& preset) {
  GPTConfig c = GPTConfig::preset(preset);  // llama-tiny: GQA, RoPE, RMSNorm, SwiGLU
  c.block_size = 16;
  return c;
}

// The training forward's logits of one whole sequence [T, V].
std::vector<float> full_logits(const GPT& model, ParamStore& ps, const std::vector<int32_t>& tokens) {
  ForwardOptions fo;
  fo.training = false;
  MicroBatchState s;
  model.forward(ps, s, tokens.data(), tokens.data(), {1, static_cast<int64_t>(tokens.size())}, fo);
  const Tensor host = s.logits.clone(Tier::host);
  return {host.data<float>(), host.data<float>() + host.numel()};
}

void expect_row(const Tensor& logits, int64_t row, const std::vector<float>& full, int64_t position, int64_t V,
                const std::string& what) {
  for (int64_t v = 0; v < V; ++v)
    ASSERT_NEAR(logits.data<float>()[row * V + v], full[static_cast<size_t>(position * V + v)], 1e-5f)
        << what << ", position " << position << ", logit " << v;
}

class Decode : public ::testing::TestWithParam<std::string> {};

// Sequences of different lengths: two prefill together, then decode one
// token per step; the third joins later, its prefill packed with the
// others' decode rows; each leaves when its tokens run out.
TEST_P(Decode, IncrementalLogitsMatchTheFullForward) {
  const GPTConfig cfg = decode_config(GetParam());
  const GPT model(cfg);
  ParamStore ps(model.layout(), 11);
  const int64_t V = cfg.vocab_size;
  struct Seq {
    std::vector<int32_t> tokens;
    int64_t prompt, joins;
    std::vector<float> full;
    int slot = -1;
    int64_t fed = 0;
  };
  std::vector<Seq> seqs{{random_tokens(11, V, 1), 4, 0, {}}, {random_tokens(7, V, 2), 6, 0, {}},
                        {random_tokens(16, V, 3), 3, 2, {}}};
  for (Seq& s : seqs) s.full = full_logits(model, ps, s.tokens);
  KVCachePool pool(cfg, 3);
  for (int64_t step = 0;; ++step) {
    std::vector<DecodeInput> batch;
    std::vector<Seq*> in;
    for (Seq& s : seqs) {
      if (step < s.joins || s.fed == static_cast<int64_t>(s.tokens.size())) continue;
      if (s.slot < 0) s.slot = pool.allocate();
      const int64_t n = s.fed == 0 ? s.prompt : 1;
      batch.push_back({s.slot, std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.fed),
                                                                          static_cast<size_t>(n))});
      in.push_back(&s);
    }
    if (batch.empty()) break;
    // The first step checks every prefilled position, later ones the last.
    const bool all = step == 0;
    const Tensor logits = model.forward_decode(ps, pool, batch, all).clone(Tier::host);
    int64_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      Seq& s = *in[i];
      const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
      const std::string what = "sequence " + std::to_string(&s - seqs.data()) + ", step " + std::to_string(step);
      if (all)
        for (int64_t t = 0; t < n; ++t) expect_row(logits, row++, s.full, s.fed + t, V, what);
      else
        expect_row(logits, row++, s.full, s.fed + n - 1, V, what);
      s.fed += n;
      EXPECT_EQ(pool.length(s.slot), s.fed);
      if (s.fed == static_cast<int64_t>(s.tokens.size())) pool.release(s.slot);
    }
  }
  EXPECT_EQ(pool.active(), 0);
}

TEST_P(Decode, RefusesToOutgrowTheContext) {
  const GPTConfig cfg = decode_config(GetParam());
  const GPT model(cfg);
  ParamStore ps(model.layout(), 11);
  KVCachePool pool(cfg, 1);
  const int slot = pool.allocate();
  const std::vector<int32_t> tokens = random_tokens(cfg.block_size, cfg.vocab_size, 4);
  const DecodeInput fill{slot, tokens};
  model.forward_decode(ps, pool, {&fill, 1});
  const DecodeInput more{slot, std::span<const int32_t>(tokens).first(1)};
  EXPECT_CONTAINS(error_of([&] { model.forward_decode(ps, pool, {&more, 1}); }), "more than the KV cache's 16");
  pool.reset(slot);
  EXPECT_EQ(model.forward_decode(ps, pool, {&more, 1}).numel(), cfg.vocab_size);
}

// Bit for bit: a sequence's logits do not depend on what else is in the
// batch (other prompts prefilling, others decoding), so its samples do not.
TEST_P(Decode, ASequenceGetsTheSameBitsAloneAndInABatch) {
  const GPTConfig cfg = decode_config(GetParam());
  const GPT model(cfg);
  ParamStore ps(model.layout(), 11);
  const std::vector<int32_t> mine = random_tokens(9, cfg.vocab_size, 5), other = random_tokens(12, cfg.vocab_size, 6);
  // Steps of (my new tokens, the other sequences' new tokens).
  auto run = [&](bool batched) {
    KVCachePool pool(cfg, 3);
    const int a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
    std::vector<float> logits;
    const std::span<const int32_t> m(mine), o(other);
    const std::vector<std::vector<DecodeInput>> steps{
        {{a, m.first(5)}, {b, o.first(7)}},
        {{b, o.subspan(7, 1)}, {a, m.subspan(5, 1)}, {c, o.first(10)}},
        {{c, o.subspan(10, 1)}, {a, m.subspan(6, 3)}, {b, o.subspan(8, 1)}}};
    for (const auto& step : steps) {
      std::vector<DecodeInput> batch;
      for (const DecodeInput& in : step)
        if (batched || in.slot == a) batch.push_back(in);
      const Tensor out = model.forward_decode(ps, pool, batch).clone(Tier::host);
      const size_t at = static_cast<size_t>(std::find_if(batch.begin(), batch.end(),
                                                         [&](const DecodeInput& in) { return in.slot == a; }) -
                                            batch.begin());
      const float* row = out.data<float>() + at * static_cast<size_t>(cfg.vocab_size);
      logits.insert(logits.end(), row, row + cfg.vocab_size);
    }
    return logits;
  };
  const std::vector<float> alone = run(false), together = run(true);
  ASSERT_EQ(alone.size(), together.size());
  EXPECT_EQ(std::memcmp(alone.data(), together.data(), alone.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, Decode, ::testing::Values("tiny", "llama-tiny"),
                         [](const auto& info) { return info.param == "tiny" ? "Gpt2" : "Llama"; });

TEST(KVCachePool, ReleasingASequenceReturnsItsBytes) {
  const GPTConfig cfg = decode_config("llama-tiny");
  const Allocator& device = MemoryContext::current().tier(Tier::device);
  const size_t before = device.used();
  KVCachePool pool(cfg, 2, 12);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
  EXPECT_EQ(device.used(), before);
  // n_layer x (k, v) x kv heads x positions x head size floats.
  EXPECT_EQ(pool.slot_bytes(), static_cast<size_t>(cfg.n_layer * 2 * cfg.kv_heads() * 12 * cfg.head_dim() * 4));
  const int a = pool.allocate(), b = pool.allocate();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.allocate(), -1);  // full
  EXPECT_EQ(pool.bytes_in_use(), 2 * pool.slot_bytes());
  EXPECT_EQ(device.used(), before + 2 * pool.slot_bytes());
  pool.release(a);
  EXPECT_EQ(pool.bytes_in_use(), pool.slot_bytes());
  EXPECT_EQ(device.used(), before + pool.slot_bytes());
  EXPECT_EQ(pool.allocate(), a);  // the freed slot is taken again
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(device.used(), before);
}

}  // namespace
}  // namespace loom
