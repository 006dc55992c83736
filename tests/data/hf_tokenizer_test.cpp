// Hugging Face tokenizer.json files against the ids `tokenizers` itself gave
// (tests/fixtures/tokenizer, made by tools/fixtures/make_tokenizer_fixtures.py).
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <nlohmann/json.hpp>

#include "data/data_test_util.h"
#include "loom/data.h"

namespace loom {
namespace {

using nlohmann::json;
using namespace loom::testing;  // TempDir, error_of, expect_mentions, read_bytes, write_bytes, shakespeare

const std::filesystem::path kFixtures = std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer";

std::string concat_pieces(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += tok.decode_piece(id);
  return out;
}

class HfTokenizerFixture : public ::testing::TestWithParam<const char*> {
 protected:
  std::filesystem::path dir() const { return kFixtures / GetParam(); }
  json expected() const { return json::parse(read_bytes(dir() / "expected.json")); }
};

TEST_P(HfTokenizerFixture, GivesTheIdsOfHuggingFaceTokenizers) {
  const Tokenizer tok = Tokenizer::load(dir());
  EXPECT_TRUE(tok.is_hf_json());
  EXPECT_EQ(tok.path(), dir() / "tokenizer.json");
  const json exp = expected();
  ASSERT_GT(exp["samples"].size(), 40u);
  for (const json& sample : exp["samples"]) {
    const std::string text = sample["text"];
    const std::vector<int32_t> ids = tok.encode(text);
    EXPECT_EQ(ids, sample["ids"].get<std::vector<int32_t>>()) << "line: " << text;
    EXPECT_EQ(tok.decode(ids), sample["decoded"].get<std::string>()) << "line: " << text;
    EXPECT_EQ(concat_pieces(tok, ids), tok.decode(ids)) << "line: " << text;
  }
  const std::string corpus = read_bytes(kFixtures / "corpus.txt");
  const std::vector<int32_t> ids = tok.encode(corpus);
  EXPECT_EQ(ids, exp["corpus_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(tok.decode(ids), exp["corpus_decoded"].get<std::string>());
  EXPECT_EQ(concat_pieces(tok, ids), tok.decode(ids));
  // One pre-token with thousands of merges.
  const std::string word = exp["long_word"];
  EXPECT_EQ(tok.encode(word), exp["long_word_ids"].get<std::vector<int32_t>>());
}

// gpt2 and llama3: fallback/ maps newlines to <unk>, so it cannot round-trip.
class HfTokenizerRoundTrip : public HfTokenizerFixture {};

TEST_P(HfTokenizerRoundTrip, RoundTripsTextThatNoStrippingTokenTouches) {
  const Tokenizer tok = Tokenizer::load(dir() / "tokenizer.json");
  size_t round_trips = 0;
  const json exp = expected();
  for (const json& sample : exp["samples"]) {
    const std::string text = sample["text"];
    if (sample["decoded"] != text) continue;  // an lstrip/rstrip token removed spaces
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
    ++round_trips;
  }
  EXPECT_GE(round_trips + 2, exp["samples"].size());
  const std::string text = shakespeare(400000, 60000);
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  const std::string word = exp["long_word"];
  EXPECT_EQ(tok.decode(tok.encode(word)), word);
}

// fallback/: byte_fallback, a fused unk_token and add_prefix_space.
INSTANTIATE_TEST_SUITE_P(Fixtures, HfTokenizerFixture, ::testing::Values("gpt2", "llama3", "fallback"));
INSTANTIATE_TEST_SUITE_P(Fixtures, HfTokenizerRoundTrip, ::testing::Values("gpt2", "llama3"));

TEST(HfTokenizer, SpecialTokensAreSingleIdsAndNameBosEos) {
  const Tokenizer gpt2 = Tokenizer::load(kFixtures / "gpt2");
  ASSERT_TRUE(gpt2.eos_id().has_value());
  EXPECT_EQ(gpt2.bos_id(), gpt2.eos_id());
  EXPECT_EQ(gpt2.decode_piece(*gpt2.eos_id()), "<|endoftext|>");
  EXPECT_EQ(gpt2.encode("<|endoftext|>"), std::vector<int32_t>{*gpt2.eos_id()});
  const std::vector<int32_t> ids = gpt2.encode("a<|endoftext|>b");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], *gpt2.eos_id());

  const Tokenizer llama = Tokenizer::load(kFixtures / "llama3");
  ASSERT_TRUE(llama.bos_id().has_value() && llama.eos_id().has_value());
  EXPECT_NE(llama.bos_id(), llama.eos_id());
  EXPECT_EQ(llama.encode("<|begin_of_text|>"), std::vector<int32_t>{*llama.bos_id()});
  EXPECT_EQ(llama.encode("<|end_of_text|>"), std::vector<int32_t>{*llama.eos_id()});
  EXPECT_EQ(llama.decode(std::vector<int32_t>{*llama.bos_id(), *llama.eos_id()}),
            "<|begin_of_text|><|end_of_text|>");
  // Added beyond the trained vocabulary.
  const std::vector<int32_t> eot = llama.encode("<|eot_id|>");
  ASSERT_EQ(eot.size(), 1u);
  EXPECT_EQ(llama.decode_piece(eot[0]), "<|eot_id|>");
}

TEST(HfTokenizer, ConcurrentEncodesAgree) {
  const Tokenizer tok = Tokenizer::load(kFixtures / "llama3");
  const std::string text = read_bytes(kFixtures / "corpus.txt") + shakespeare(0, 30000);
  const std::vector<int32_t> expected = tok.encode(text);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (auto& g : got) threads.emplace_back([&] { g = tok.encode(text); });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST(HfTokenizer, LoadsByContentAndPrefersTokenizerJsonInADirectory) {
  TempDir dir;
  const std::string json_text = read_bytes(kFixtures / "gpt2/tokenizer.json");
  // Alone, without tokenizer_config.json: nothing names bos/eos.
  write_bytes(dir / "renamed.bin", json_text);
  const Tokenizer renamed = Tokenizer::load(dir / "renamed.bin");
  EXPECT_TRUE(renamed.is_hf_json());
  EXPECT_EQ(renamed.bos_id(), std::nullopt);
  EXPECT_EQ(renamed.eos_id(), std::nullopt);

  write_bytes(dir / "tokenizer.model", "not read: tokenizer.json comes first");
  write_bytes(dir / "tokenizer.json", json_text);
  EXPECT_EQ(Tokenizer::load(dir.path()).path(), dir / "tokenizer.json");
  std::filesystem::remove(dir / "tokenizer.json");
  expect_mentions(error_of([&] { Tokenizer::load(dir.path()); }), {"tokenizer.model", "not a sentencepiece model"});
}

TEST(HfTokenizer, UnsupportedOrBrokenFilesAreErrorsNamingFileAndKey) {
  TempDir dir;
  const json good = json::parse(read_bytes(kFixtures / "llama3/tokenizer.json"));
  auto error_for = [&](const std::string& name, const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    write_bytes(dir / name, j.dump());
    return error_of([&] { Tokenizer::load(dir / name); });
  };
  expect_mentions(error_for("wordpiece.json", [](json& j) { j["model"]["type"] = "WordPiece"; }),
                  {"wordpiece.json", "model.type", "WordPiece", "byte-level BPE"});
  expect_mentions(error_for("unigram.json", [](json& j) { j["model"]["type"] = "Unigram"; }),
                  {"unigram.json", "model.type", "Unigram"});
  expect_mentions(
      error_for("whitespace.json", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["type"] = "Whitespace"; }),
      {"whitespace.json", "pre_tokenizer.pretokenizers[0].type", "Whitespace", "ByteLevel"});
  expect_mentions(error_for("metaspace.json", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }),
                  {"metaspace.json", "pre_tokenizer.type", "Metaspace"});
  expect_mentions(error_for("nfc.json", [](json& j) { j["normalizer"] = {{"type", "NFC"}}; }),
                  {"nfc.json", "normalizer", "NFC", "only null"});
  expect_mentions(error_for("merge.json", [](json& j) { j["model"]["merges"][3] = {"\xC4\xA0t", "zzz"}; }),
                  {"merge.json", "model.merges[3]", "zzz", "not in model.vocab"});
  expect_mentions(error_for("regex.json",
                            [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
                  {"regex.json", "pre_tokenizer.pretokenizers[0].pattern.Regex", "(unclosed"});

  expect_mentions(error_for("huge_id.json", [](json& j) { j["added_tokens"][0]["id"] = 1 << 30; }),
                  {"huge_id.json", "added_tokens[0].id", "1073741824"});

  std::string text = read_bytes(kFixtures / "gpt2/tokenizer.json");
  write_bytes(dir / "truncated.json", text.substr(0, text.size() / 2));
  expect_mentions(error_of([&] { Tokenizer::load(dir / "truncated.json"); }), {"truncated.json", "not valid JSON"});
  expect_mentions(error_of([&] { Tokenizer::load(dir / "missing.json"); }), {"missing.json", "does not exist"});

  const Tokenizer llama = Tokenizer::load(kFixtures / "llama3");
  expect_mentions(error_of([&] { llama.decode_piece(llama.vocab_size()); }),
                  {str("token id ", llama.vocab_size()), "outside the vocabulary", "tokenizer.json"});
}

}  // namespace
}  // namespace loom
