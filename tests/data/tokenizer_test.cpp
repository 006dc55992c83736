#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "data/data_test_util.h"
#include "loom/data.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::shakespeare;
using testing::TempDir;

constexpr int kVocab = 512;

// One small tokenizer shared by the suite: trained once on 150 KB.
class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    tok_ = std::make_unique<Tokenizer>(
        Tokenizer::train(shakespeare(0, 150000), *dir_ / "tok.model", {.vocab_size = kVocab}));
  }
  static void TearDownTestSuite() {
    tok_.reset();
    dir_.reset();
  }
  const Tokenizer& tok() const { return *tok_; }
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<Tokenizer> tok_;
};
std::unique_ptr<TempDir> TokenizerTest::dir_;
std::unique_ptr<Tokenizer> TokenizerTest::tok_;

TEST_F(TokenizerTest, HasTheRequestedVocabularyAndSpecialTokens) {
  EXPECT_EQ(tok().vocab_size(), kVocab);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_EQ(tok().path(), *dir_ / "tok.model");
}

TEST_F(TokenizerTest, RoundTripsUnseenCorpusText) {
  std::string text = shakespeare(400000, 120000);  // beyond the training slice
  ASSERT_GT(std::count(text.begin(), text.end(), '\n'), 1000);
  std::vector<int32_t> ids = tok().encode(text);
  EXPECT_EQ(tok().decode(ids), text);
  // BPE must actually compress (1.76 bytes per token at this small vocabulary);
  // a broken setup degrades to a byte per token.
  EXPECT_GT(static_cast<double>(text.size()) / ids.size(), 1.6);
}

TEST_F(TokenizerTest, RoundTripsWhitespaceControlsAndAnyCodePoint) {
  const std::string cases[] = {
      "",
      "\n",
      "\n\n\nThree blank lines above.\n",
      "  two leading spaces,   three inside, trailing   ",
      "tab\there\r\nwindows line\r\n",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 \xD0\x9F\xD1\x80\xD0\xB8",
      "the marker \xE2\x96\x81 itself, \xE2\x96\x81\xE2\x96\x81 twice, and at the end \xE2\x96\x81",
      std::string("nul\0and\x01\x7F controls", 19),
      "Digits 1234567890 and 3.14159\n",
  };
  for (const std::string& text : cases) {
    std::vector<int32_t> ids = tok().encode(text);
    EXPECT_EQ(tok().decode(ids), text) << "text: " << text;
  }
}

TEST_F(TokenizerTest, NewlinesAreTokensOfTheirOwn) {
  const std::vector<int32_t> nl = tok().encode("\n");
  ASSERT_EQ(nl.size(), 1u);
  std::string text = shakespeare(200000, 20000);
  std::vector<int32_t> ids = tok().encode(text);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), nl[0]), std::count(text.begin(), text.end(), '\n'));
}

TEST_F(TokenizerTest, EncodingIsLocalToLines) {
  // No piece spans a newline, so encoding line by line gives the same ids:
  // callers may cut text at line ends to encode it in parallel.
  std::string text = shakespeare(300000, 5000);
  std::vector<int32_t> whole = tok().encode(text), pieced;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start) + 1;
    std::vector<int32_t> line = tok().encode(std::string_view(text).substr(start, end - start));
    pieced.insert(pieced.end(), line.begin(), line.end());
    start = end;
  }
  EXPECT_EQ(whole, pieced);
}

TEST_F(TokenizerTest, DecodingPieceByPieceEqualsDecoding) {
  std::string text = "ROMEO:\n  Caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xE2\x96\x81 \xF0\x9F\x98\x80!\n";
  std::vector<int32_t> ids = tok().encode(text);
  std::string streamed;
  for (int32_t id : ids) streamed += tok().decode_piece(id);
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(tok().decode_piece(*tok().bos_id()), "");
}

TEST_F(TokenizerTest, LoadGivesTheSameTokenizer) {
  Tokenizer loaded = Tokenizer::load(*dir_ / "tok.model");
  std::string text = shakespeare(500000, 3000);
  EXPECT_EQ(loaded.vocab_size(), kVocab);
  EXPECT_EQ(loaded.encode(text), tok().encode(text));
}

TEST_F(TokenizerTest, TrainingIsDeterministic) {
  TempDir dir;
  std::string text = shakespeare(0, 60000);
  Tokenizer::train(text, dir / "a.model", {.vocab_size = 400});
  Tokenizer::train(text, dir / "b.model", {.vocab_size = 400});
  EXPECT_EQ(testing::read_bytes(dir / "a.model"), testing::read_bytes(dir / "b.model"));
}

TEST_F(TokenizerTest, TrainFileReadsTheText) {
  TempDir dir;
  std::string text = shakespeare(0, 60000);
  testing::write_bytes(dir / "corpus.txt", text);
  Tokenizer from_file = Tokenizer::train_file(dir / "corpus.txt", dir / "f.model", {.vocab_size = 400});
  Tokenizer from_text = Tokenizer::train(text, dir / "t.model", {.vocab_size = 400});
  EXPECT_EQ(testing::read_bytes(dir / "f.model"), testing::read_bytes(dir / "t.model"));
  EXPECT_EQ(from_file.encode(text), from_text.encode(text));
}

TEST_F(TokenizerTest, InvalidInputIsAnErrorNamingWhere) {
  expect_mentions(error_of([&] { tok().encode("good\xC3(bad"); }), {"not valid UTF-8", "byte offset 4"});
  expect_mentions(error_of([&] {
                    tok().decode(std::vector<int32_t>{5, kVocab});
                  }),
                  {"token id 512", "position 1", "[0, 512)", "tok.model"});
  expect_mentions(error_of([&] { tok().decode_piece(-1); }), {"token id -1"});
}

TEST(Tokenizer, BadModelFilesAreErrorsNamingThePath) {
  TempDir dir;
  expect_mentions(error_of([&] { Tokenizer::load(dir / "missing.model"); }), {"missing.model", "does not exist"});
  testing::write_bytes(dir / "garbage.model", "this is not a protobuf \xFF\xFF\xFF\xFF");
  expect_mentions(error_of([&] { Tokenizer::load(dir / "garbage.model"); }),
                  {"garbage.model", "not a sentencepiece model"});
  testing::write_bytes(dir / "empty.model", "");
  expect_mentions(error_of([&] { Tokenizer::load(dir / "empty.model"); }),
                  {"empty.model", "not a sentencepiece model"});
  expect_mentions(error_of([&] { Tokenizer::load(dir.path()); }), {dir.path().string(), "directory"});
}

TEST(Tokenizer, BadTrainingRequestsAreErrors) {
  TempDir dir;
  std::string text = shakespeare(0, 20000);
  expect_mentions(error_of([&] { Tokenizer::train(text, dir / "small.model", {.vocab_size = 100}); }),
                  {"100-token", "small.model", "vocab_size"});
  expect_mentions(error_of([&] { Tokenizer::train(text, dir / "huge.model", {.vocab_size = 60000}); }),
                  {"60000-token", "huge.model"});
  expect_mentions(error_of([&] { Tokenizer::train("", dir / "e.model"); }), {"empty text", "e.model"});
  expect_mentions(error_of([&] { Tokenizer::train("ab\xFF", dir / "u.model"); }), {"UTF-8", "byte offset 2"});
  expect_mentions(error_of([&] { Tokenizer::train_file(dir / "nope.txt", dir / "n.model"); }),
                  {"nope.txt", "does not exist"});
  EXPECT_FALSE(std::filesystem::exists(dir / "small.model"));
}

}  // namespace
}  // namespace loom
