#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "loom/data.h"
#include "loom/inference.h"
#include "generation_requests.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::requests;

GPTConfig small_config(const std::string& preset) {
  GPTConfig c = GPTConfig::preset(preset);
  c.block_size = 16;  // small enough that some sequences slide
  return c;
}

std::vector<GenerationResult> one_at_a_time(const GPT& model, ParamStore& ps,
                                            const std::vector<GenerationRequest>& reqs) {
  std::vector<GenerationResult> out;
  for (const GenerationRequest& r : reqs) out.push_back(Generator(model, ps, 1).run({r}).front());
  return out;
}

class Batched : public ::testing::TestWithParam<std::string> {};

// More prompts than the batch holds, so prompts are admitted as others
// finish; some stop at a stop token, the rest at their budgets, at
// different steps.
TEST_P(Batched, EachSequenceGetsTheTokensItGetsAlone) {
  const GPTConfig cfg = small_config(GetParam());
  const GPT model(cfg);
  ParamStore ps(model.layout(), 3);
  for (bool greedy : {true, false}) {
    SCOPED_TRACE(greedy ? "greedy" : "sampled");
    std::vector<GenerationRequest> reqs = requests(cfg, greedy);
    // A stop token each third sequence: the one it draws third alone.
    const std::vector<GenerationResult> unstopped = one_at_a_time(model, ps, reqs);
    for (size_t i = 1; i < reqs.size(); i += 3) reqs[i].stop_tokens = {unstopped[i].tokens[2]};
    const std::vector<GenerationResult> alone = one_at_a_time(model, ps, reqs);

    Generator gen(model, ps, 3);
    const std::vector<GenerationResult> batched = gen.run(reqs);
    ASSERT_EQ(batched.size(), reqs.size());
    std::set<size_t> lengths;
    int stopped = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(batched[i].tokens, alone[i].tokens) << "sequence " << i;
      EXPECT_EQ(batched[i].finish, alone[i].finish) << "sequence " << i;
      lengths.insert(batched[i].tokens.size());
      if (batched[i].finish == FinishReason::stop) {
        ++stopped;
        EXPECT_LT(batched[i].tokens.size(), 3u);
      } else {
        EXPECT_EQ(static_cast<int64_t>(batched[i].tokens.size()), reqs[i].max_tokens);
      }
    }
    EXPECT_GE(stopped, 2);
    EXPECT_GE(lengths.size(), 5u);  // the sequences finished at different steps
    EXPECT_EQ(gen.pool().bytes_in_use(), 0u);
    if (!greedy) {
      // Sampling draws differ from greedy somewhere, or the check proved less.
      const std::vector<GenerationResult> greedy_alone = one_at_a_time(model, ps, requests(cfg, true));
      bool differs = false;
      for (size_t i = 0; i < reqs.size(); ++i) differs |= greedy_alone[i].tokens != unstopped[i].tokens;
      EXPECT_TRUE(differs);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Batched, ::testing::Values("tiny", "llama-tiny"),
                         [](const auto& info) { return info.param == "tiny" ? "Gpt2" : "Llama"; });

TEST(Generator, StopStringsCutTheTextAndStreamingHoldsThemBack) {
  const Tokenizer tok =
      Tokenizer::load(std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer/gpt2/tokenizer.json");
  GPTConfig cfg = small_config("tiny");
  cfg.vocab_size = tok.vocab_size();
  const GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  GenerationRequest r;
  r.prompt = tok.encode("To be, or not");
  r.max_tokens = 30;
  r.sample.temperature = 0.0f;
  const GenerationResult full = Generator(model, ps, 2, &tok).run({r}).front();
  ASSERT_GT(full.text.size(), 12u);

  // A stop string from the middle of the text, and one that never appears.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  r.stop = {"never in this text \x01", stop};
  std::string streamed;
  r.on_text = [&](const std::string& piece) { streamed += piece; };
  Generator gen(model, ps, 2, &tok);
  const GenerationResult cut = gen.run({r}).front();
  EXPECT_EQ(cut.finish, FinishReason::stop);
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(streamed, cut.text);
  EXPECT_LT(cut.tokens.size(), full.tokens.size());
  EXPECT_EQ(cut.tokens, std::vector<int32_t>(full.tokens.begin(),
                                             full.tokens.begin() + static_cast<std::ptrdiff_t>(cut.tokens.size())));
  // The single-prompt path is the same engine.
  EXPECT_EQ(generate(model, ps, tok, "To be, or not", 30, r.sample), full.text);
}

TEST(Generator, RefusesWhatItCannotDo) {
  const GPTConfig cfg = small_config("tiny");
  const GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  Generator gen(model, ps, 1);
  GenerationRequest r;
  r.stop = {"\n"};
  EXPECT_CONTAINS(error_of([&] { gen.submit(r); }), "stop strings need a tokenizer");
  r.stop.clear();
  r.max_tokens = -1;
  EXPECT_CONTAINS(error_of([&] { gen.submit(r); }), "max_tokens = -1");
  r.max_tokens = 0;
  r.prompt = {1, static_cast<int32_t>(cfg.vocab_size)};
  EXPECT_CONTAINS(error_of([&] { gen.submit(r); }), "prompt token 1 is 256, outside the model's vocabulary");
  r.prompt.clear();
  const GenerationResult none = gen.run({r}).front();
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(none.finish, FinishReason::length);
}

// Cancelling frees an active sequence's slot at the next step and drops a
// waiting one; the others' tokens are untouched.
TEST(Generator, CancelFreesTheSlotAndLeavesTheOthers) {
  const GPTConfig cfg = small_config("tiny");
  const GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  std::vector<GenerationRequest> reqs = requests(cfg, false);
  reqs.resize(3);
  for (GenerationRequest& r : reqs) r.max_tokens = 10;
  const std::vector<GenerationResult> alone = one_at_a_time(model, ps, reqs);

  Generator gen(model, ps, 2);
  int64_t counted = 0;
  reqs[0].on_token = [&](int32_t) { ++counted; };
  std::vector<int64_t> ids;
  for (const GenerationRequest& r : reqs) ids.push_back(gen.submit(r));
  ASSERT_TRUE(gen.step());
  ASSERT_TRUE(gen.step());
  EXPECT_EQ(counted, 2);
  EXPECT_EQ(gen.pool().bytes_in_use(), 2 * gen.pool().slot_bytes());
  gen.cancel(ids[0]);  // active
  gen.cancel(ids[2]);  // waiting
  ASSERT_TRUE(gen.step());
  EXPECT_EQ(gen.active(), 1);
  EXPECT_EQ(gen.pool().bytes_in_use(), gen.pool().slot_bytes());
  while (gen.step()) {
  }
  EXPECT_EQ(counted, 2);
  EXPECT_EQ(gen.pool().bytes_in_use(), 0u);
  EXPECT_FALSE(gen.take(ids[0]).has_value());
  EXPECT_FALSE(gen.take(ids[2]).has_value());
  const std::optional<GenerationResult> kept = gen.take(ids[1]);
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->tokens, alone[1].tokens);
}

}  // namespace
}  // namespace loom
