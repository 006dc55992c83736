// Generation with the model split over tensor-parallel ranks and pipeline
// stages (local ranks as threads): the same logits as one rank, within float
// rounding, and the same tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "loom/comm.h"
#include "loom/inference.h"
#include "loom/parallel.h"
#include "generation_requests.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::random_tokens;

// A tiny model (2 layers, 4 heads, width 64) whose vocabulary does not split
// evenly over 2 or 4 ranks, so the last rank's head has padding rows.
GPTConfig tiny_config(const std::string& preset) {
  GPTConfig c = GPTConfig::preset(preset);
  c.vocab_size = 253;
  c.block_size = 16;  // small enough that some sequences slide
  return c;
}

// Every forward_decode's logits of one schedule: two sequences prefilled
// together (every position's logits), then decoded for a few steps on the
// given tokens (or, with none given, their greedy choices, returned in
// `fed`).
std::vector<std::vector<float>> decode_logits(const GPT& model, ParamStore& ps, std::vector<int32_t>& fed,
                                              Communicator* pipeline = nullptr) {
  const GPTConfig& cfg = model.config();
  KVCachePool pool(model, 2);
  const int a = pool.allocate(), b = pool.allocate();
  const std::vector<int32_t> pa = random_tokens(5, cfg.vocab_size, 1), pb = random_tokens(2, cfg.vocab_size, 2);
  std::vector<std::vector<float>> out;
  auto keep = [&](const Tensor& logits) {
    const Tensor host = logits.clone(Tier::host);
    out.emplace_back(host.data<float>(), host.data<float>() + host.numel());
  };
  const DecodeInput prefill[] = {{a, pa}, {b, pb}};
  keep(model.forward_decode(ps, pool, prefill, /*all_positions=*/true, pipeline));
  const bool choose = fed.empty();
  for (int step = 0; step < 4; ++step) {
    if (choose) {
      // Each sequence's last row of the previous logits.
      const std::vector<float>& last = out.back();
      const size_t V = static_cast<size_t>(cfg.vocab_size), rows = last.size() / V;
      for (size_t row : {step == 0 ? pa.size() - 1 : 0, rows - 1})
        fed.push_back(static_cast<int32_t>(std::max_element(last.begin() + static_cast<std::ptrdiff_t>(row * V),
                                                            last.begin() + static_cast<std::ptrdiff_t>((row + 1) * V)) -
                                           last.begin() - static_cast<std::ptrdiff_t>(row * V)));
    }
    const std::span<const int32_t> ta(&fed[static_cast<size_t>(2 * step)], 1),
        tb(&fed[static_cast<size_t>(2 * step + 1)], 1);
    const DecodeInput next[] = {{a, ta}, {b, tb}};
    keep(model.forward_decode(ps, pool, next, false, pipeline));
  }
  return out;
}

// Runs fn on tp x pp local ranks, each with its part of the model and the
// pipeline group (null without stages).
void run_split(int tp, int pp, const GPTConfig& cfg,
               const std::function<void(const ModelParallel&, Communicator*)>& fn) {
  run_local(tp * pp, [&](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::pp] = pp;
    shape[MeshAxis::tp] = tp;
    DeviceMesh mesh(world, shape);
    fn(generation_parallel(mesh, cfg), pp > 1 ? &mesh.group(MeshAxis::pp) : nullptr);
  });
}

// (preset, tp, pp)
class TensorParallelGeneration : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

// Prefill and decode logits within 1e-5 of one rank's (relative to the
// largest logit), with the same greedy choices, on every rank. llama-tiny's
// 2 kv heads split over tp = 2 and are replicated under tp = 4.
TEST_P(TensorParallelGeneration, LogitsMatchOneRank) {
  const auto& [preset, tp, pp] = GetParam();
  const GPTConfig cfg = tiny_config(preset);
  const GPT reference(cfg);
  ParamStore reference_ps(reference.layout(), 3);
  std::vector<int32_t> greedy;
  const std::vector<std::vector<float>> expected = decode_logits(reference, reference_ps, greedy);
  run_split(tp, pp, cfg, [&](const ModelParallel& mp, Communicator* pipeline) {
    const GPT model(cfg, mp);
    ParamStore ps(model.layout(), 3);  // initialized by global index: the same weights
    std::vector<int32_t> fed;
    const std::vector<std::vector<float>> got = decode_logits(model, ps, fed, pipeline);
    EXPECT_EQ(fed, greedy) << "rank " << current_rank();
    ASSERT_EQ(got.size(), expected.size());
    for (size_t step = 0; step < got.size(); ++step) {
      ASSERT_EQ(got[step].size(), expected[step].size());
      float scale = 0.0f, diff = 0.0f;
      for (size_t i = 0; i < got[step].size(); ++i) {
        scale = std::max(scale, std::fabs(expected[step][i]));
        diff = std::max(diff, std::fabs(got[step][i] - expected[step][i]));
      }
      EXPECT_LE(diff, 1e-5f * scale) << "rank " << current_rank() << ", forward " << step;
    }
  });
}

// Several prompts of different lengths (one longer than the context), more
// than the batch holds, greedy (GPT::decode_greedy's steps), seeded sampling
// with top-k/top-p, and both in one batch: every rank gets one rank's tokens.
TEST_P(TensorParallelGeneration, GeneratorGivesOneRanksTokens) {
  const auto& [preset, tp, pp] = GetParam();
  const GPTConfig cfg = tiny_config(preset);
  for (const char* mode : {"greedy", "sampled", "mixed"}) {
    SCOPED_TRACE(mode);
    std::vector<GenerationRequest> reqs = testing::requests(cfg, mode == std::string("greedy"));
    // Mixed: greedy and sampled sequences in the same steps.
    if (mode == std::string("mixed"))
      for (size_t i = 0; i < reqs.size(); i += 2) reqs[i].sample.temperature = 0.0f;
    const GPT reference(cfg);
    ParamStore reference_ps(reference.layout(), 3);
    const std::vector<GenerationResult> expected = Generator(reference, reference_ps, 3).run(reqs);
    run_split(tp, pp, cfg, [&](const ModelParallel& mp, Communicator* pipeline) {
      const GPT model(cfg, mp);
      ParamStore ps(model.layout(), 3);
      Generator gen(model, ps, 3, nullptr, pipeline);
      const std::vector<GenerationResult> got = gen.run(reqs);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(got[i].tokens, expected[i].tokens) << "rank " << current_rank() << ", sequence " << i;
      EXPECT_EQ(gen.pool().bytes_in_use(), 0u);
    });
  }
}

// The point of split generation: a model whose weights do not fit one
// rank's device budget generates when its matrices (tp = 2) or its layers
// (pp = 2) are split.
TEST(TensorParallelGeneration, AModelTooLargeForOneRankGeneratesOnTwo) {
  GPTConfig cfg = tiny_config("tiny");
  cfg.n_embd = 128;
  const size_t weights = sizeof(float) * static_cast<size_t>(cfg.num_params());
  const size_t budget = weights * 7 / 10;
  const std::vector<GenerationRequest> reqs = testing::requests(cfg, /*greedy=*/true);
  const std::string error = testing::error_of([&] {
    run_local(1, [&](Communicator&) {
      MemoryContext::current().tier(Tier::device).set_budget(budget);
      const GPT model(cfg);
      ParamStore ps(model.layout(), 3);
    });
  });
  EXPECT_CONTAINS(error, "budget");
  const GPT reference(cfg);
  ParamStore reference_ps(reference.layout(), 3);
  const std::vector<GenerationResult> expected = Generator(reference, reference_ps, 3).run(reqs);
  for (const auto& [tp, pp] : {std::pair(2, 1), std::pair(1, 2)}) {
    SCOPED_TRACE(str("tp ", tp, ", pp ", pp));
    run_split(tp, pp, cfg, [&](const ModelParallel& mp, Communicator* pipeline) {
      MemoryContext::current().tier(Tier::device).set_budget(budget);
      const GPT model(cfg, mp);
      ParamStore ps(model.layout(), 3);
      const std::vector<GenerationResult> got = Generator(model, ps, 3, nullptr, pipeline).run(reqs);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].tokens, expected[i].tokens) << "sequence " << i;
      EXPECT_LE(MemoryContext::current().tier(Tier::device).peak(), budget);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorParallelGeneration,
                         ::testing::Values(std::tuple("tiny", 2, 1), std::tuple("tiny", 4, 1), std::tuple("tiny", 1, 2),
                                           std::tuple("tiny", 2, 2), std::tuple("llama-tiny", 2, 1),
                                           std::tuple("llama-tiny", 4, 1), std::tuple("llama-tiny", 1, 2)),
                         [](const auto& info) {
                           return str(std::get<0>(info.param) == std::string("tiny") ? "Gpt2" : "Llama", "Tp",
                                      std::get<1>(info.param), "Pp", std::get<2>(info.param));
                         });

}  // namespace
}  // namespace loom
