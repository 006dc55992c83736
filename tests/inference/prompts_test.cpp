#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loom/inference.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

TEST(Prompts, OnePromptPerLine) {
  TempDir dir;
  PromptSpec defaults;
  defaults.max_tokens = 7;
  const auto prompts = read_prompts(dir.write("p.txt", "first prompt\n\nsecond {not json}\r\n"), defaults);
  ASSERT_EQ(prompts.size(), 2u);
  EXPECT_EQ(prompts[0].prompt, "first prompt");
  EXPECT_EQ(prompts[1].prompt, "second {not json}");
  EXPECT_EQ(prompts[1].max_tokens, 7);
}

TEST(Prompts, JsonLinesSetTheirOwnSettings) {
  TempDir dir;
  PromptSpec defaults;
  defaults.max_tokens = 9;
  defaults.sample.temperature = 0.5f;
  const auto prompts = read_prompts(
      dir.write("p.jsonl", "{\"prompt\": \"a\", \"max_tokens\": 3, \"temperature\": 0, \"top_p\": 0.9, \"top_k\": 4, "
                           "\"seed\": 5}\n{\"prompt\": \"b\"}\n"),
      defaults);
  ASSERT_EQ(prompts.size(), 2u);
  EXPECT_EQ(prompts[0].prompt, "a");
  EXPECT_EQ(prompts[0].max_tokens, 3);
  EXPECT_EQ(prompts[0].sample.temperature, 0.0f);
  EXPECT_EQ(prompts[0].sample.top_p, 0.9f);
  EXPECT_EQ(prompts[0].sample.top_k, 4);
  EXPECT_EQ(prompts[0].sample.seed, 5u);
  EXPECT_EQ(prompts[1].max_tokens, 9);
  EXPECT_EQ(prompts[1].sample.temperature, 0.5f);
}

TEST(Prompts, ABadLineIsNamedWithItsField) {
  TempDir dir;
  auto error = [&](const std::string& second_line) {
    return error_of([&] { read_prompts(dir.write("p.jsonl", "{\"prompt\": \"ok\"}\n" + second_line + "\n"), {}); });
  };
  std::string m = error("{\"prompt\": \"x\", \"temp\": 1}");
  EXPECT_CONTAINS(m, "p.jsonl line 2: unknown field 'temp'");
  EXPECT_CONTAINS(m, "temperature");  // the valid fields are listed
  EXPECT_CONTAINS(error("{\"prompt\": \"x\", \"max_tokens\": \"ten\"}"), "line 2: field 'max_tokens' is \"ten\"");
  EXPECT_CONTAINS(error("{\"max_tokens\": 3}"), "line 2: no \"prompt\" field");
  EXPECT_CONTAINS(error("{\"prompt\": \"x\""), "line 2: not a JSON object");
  EXPECT_CONTAINS(error_of([&] { read_prompts(dir / "missing.txt", {}); }), "cannot read the prompts file");
}

TEST(Prompts, ResultLinesAreJson) {
  GenerationResult r;
  r.tokens = {1, 2, 3};
  r.text = "said \"hi\"\n";
  r.finish = FinishReason::stop;
  const nlohmann::json j = nlohmann::json::parse(result_json_line(4, "p", r));
  EXPECT_EQ(j, (nlohmann::json{{"index", 4}, {"prompt", "p"}, {"text", r.text}, {"tokens", 3},
                               {"finish_reason", "stop"}}));
}

}  // namespace
}  // namespace loom
