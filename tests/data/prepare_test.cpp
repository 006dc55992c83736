#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include <nlohmann/json.hpp>

#include "data/data_test_util.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::read_bytes;
using testing::shakespeare;
using testing::TempDir;
using testing::write_bytes;

std::vector<int32_t> read_all(const std::filesystem::path& p) {
  TokenShard shard(p);
  std::vector<int32_t> out(shard.size());
  shard.read(0, out);
  return out;
}

PrepareOptions small_options(const TempDir& dir, const std::string& text) {
  write_bytes(dir / "corpus.txt", text);
  return {.inputs = {dir / "corpus.txt"}, .out_dir = dir / "out", .vocab_size = 400, .seq_len = 64};
}

TEST(Prepare, WritesShardsTokenizerAndDescription) {
  TempDir dir;
  const std::string text = shakespeare(0, 100000);
  DatasetInfo info = prepare_dataset(small_options(dir, text));

  EXPECT_EQ(info.vocab_size, 400);
  EXPECT_EQ(info.sources, std::vector<std::string>{std::filesystem::absolute(dir / "corpus.txt").string()});
  EXPECT_EQ(info.tokenizer_sha256, sha256_hex(read_bytes(dir / "out/tokenizer.model")));
  Tokenizer tok = Tokenizer::load(info.tokenizer);
  EXPECT_EQ(tok.vocab_size(), 400);

  std::vector<int32_t> train = read_all(info.train.file), val = read_all(info.val.file);
  EXPECT_EQ(static_cast<int64_t>(train.size()), info.train.tokens);
  EXPECT_EQ(static_cast<int64_t>(val.size()), info.val.tokens);
  // The splits are the corpus, cut at a line start near 90%: val is its end.
  std::string train_text = tok.decode(train), val_text = tok.decode(val);
  EXPECT_EQ(train_text + val_text, text);
  EXPECT_EQ(train_text.back(), '\n');
  EXPECT_NEAR(static_cast<double>(val_text.size()) / text.size(), 0.1, 0.01);
  EXPECT_EQ(info.train.bytes, static_cast<int64_t>(train_text.size()));
  EXPECT_EQ(info.val.chars, count_utf8_chars(val_text));
  EXPECT_GT(info.val.chars_per_token(), 1.5);

  DatasetInfo read = DatasetInfo::read(dir / "out");
  EXPECT_EQ(read.dir, info.dir);
  EXPECT_EQ(read.tokenizer, info.tokenizer);
  EXPECT_EQ(read.tokenizer_sha256, info.tokenizer_sha256);
  EXPECT_EQ(read.train.file, info.train.file);
  EXPECT_EQ(read.val.tokens, info.val.tokens);
  EXPECT_EQ(read.val.chars, info.val.chars);
  EXPECT_EQ(read.val_fraction, 0.1);
  EXPECT_EQ(read.sources, info.sources);
  EXPECT_EQ(info.sources_sha256, std::vector<std::string>{sha256_hex(text)});
  EXPECT_EQ(read.sources_sha256, info.sources_sha256);
  auto j = nlohmann::json::parse(read_bytes(dir / "out/dataset.json"));
  EXPECT_EQ(j["val"]["file"], "val.bin");
  EXPECT_DOUBLE_EQ(j["val"]["chars_per_token"].get<double>(), info.val.chars_per_token());
}

TEST(Prepare, IsDeterministicAndReusesTokenizers) {
  TempDir dir;
  PrepareOptions opts = small_options(dir, shakespeare(100000, 80000));
  prepare_dataset(opts);
  opts.out_dir = dir / "again";
  prepare_dataset(opts);
  for (const char* f : {"tokenizer.model", "train.bin", "val.bin", "dataset.json"})
    EXPECT_EQ(read_bytes(dir / "out" / f), read_bytes(dir / "again" / f)) << f;

  // Reusing the tokenizer (vocab_size 0: the model's own) gives the same shards.
  opts.out_dir = dir / "reused";
  opts.tokenizer = dir / "out/tokenizer.model";
  opts.vocab_size = 0;
  DatasetInfo info = prepare_dataset(opts);
  EXPECT_EQ(info.vocab_size, 400);
  for (const char* f : {"tokenizer.model", "train.bin", "val.bin"})
    EXPECT_EQ(read_bytes(dir / "out" / f), read_bytes(dir / "reused" / f)) << f;

  opts.vocab_size = 512;
  expect_mentions(error_of([&] { prepare_dataset(opts); }),
                  {"out/tokenizer.model", "vocabulary of 400", "vocab_size 512"});
}

TEST(Prepare, ReusesAHuggingFaceTokenizerJson) {
  TempDir dir;
  const std::string text = shakespeare(100000, 40000);
  PrepareOptions opts = small_options(dir, text);
  opts.vocab_size = 0;
  // A checkpoint directory: its tokenizer.json, with the config naming bos/eos.
  opts.tokenizer = std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer/llama3";
  DatasetInfo info = prepare_dataset(opts);
  EXPECT_EQ(info.tokenizer, info.dir / "tokenizer.json");
  EXPECT_EQ(read_bytes(info.tokenizer), read_bytes(opts.tokenizer / "tokenizer.json"));
  const Tokenizer source = Tokenizer::load(opts.tokenizer), copy = Tokenizer::load(info.tokenizer);
  EXPECT_EQ(info.vocab_size, source.vocab_size());
  EXPECT_EQ(copy.eos_id(), source.eos_id());
  EXPECT_TRUE(copy.eos_id().has_value());
  const std::vector<int32_t> train = read_all(info.train.file), val = read_all(info.val.file);
  EXPECT_EQ(copy.decode(train) + copy.decode(val), text);
  EXPECT_EQ(train, source.encode(copy.decode(train)));
}

TEST(Prepare, ConcatenatesInputsAtLineBoundaries) {
  TempDir dir;
  const std::string a = shakespeare(0, 40000), b = shakespeare(40000, 40000);
  write_bytes(dir / "a.txt", a.substr(0, a.size() - 1));  // no final newline
  write_bytes(dir / "b.txt", b);
  DatasetInfo info = prepare_dataset(
      {.inputs = {dir / "a.txt", dir / "b.txt"}, .out_dir = dir / "out", .vocab_size = 400, .seq_len = 32});
  EXPECT_EQ(info.sources.size(), 2u);
  // Each input's own bytes, not the joined corpus's.
  EXPECT_EQ(info.sources_sha256, (std::vector<std::string>{sha256_hex(a.substr(0, a.size() - 1)), sha256_hex(b)}));
  Tokenizer tok = Tokenizer::load(info.tokenizer);
  EXPECT_EQ(tok.decode(read_all(info.train.file)) + tok.decode(read_all(info.val.file)), a + b);
}

TEST(Prepare, BadInputsAreErrorsNamingFileAndOffset) {
  TempDir dir;
  expect_mentions(error_of([&] { prepare_dataset({.inputs = {dir / "none.txt"}, .out_dir = dir / "out"}); }),
                  {"none.txt", "does not exist"});
  write_bytes(dir / "latin1.txt", "Caf\xE9 au lait\n");
  expect_mentions(error_of([&] { prepare_dataset({.inputs = {dir / "latin1.txt"}, .out_dir = dir / "out"}); }),
                  {"latin1.txt", "not valid UTF-8", "byte offset 3"});
  write_bytes(dir / "empty.txt", "");
  expect_mentions(error_of([&] { prepare_dataset({.inputs = {dir / "empty.txt"}, .out_dir = dir / "out"}); }),
                  {"no text"});
  write_bytes(dir / "file", "x");
  expect_mentions(error_of([&] { prepare_dataset({.inputs = {dir / "latin1.txt"}, .out_dir = dir / "file"}); }),
                  {"file", "not a directory"});
  expect_mentions(
      error_of([&] { prepare_dataset({.inputs = {dir / "latin1.txt"}, .out_dir = dir / "out", .val_fraction = 1.5}); }),
      {"val_fraction", "1.5"});
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));
}

TEST(Prepare, TooLittleTextIsAnErrorNamingTheCounts) {
  TempDir dir;
  // 20 KB gives a val split of ~2 KB: fewer than 4097 bytes, so fewer tokens.
  PrepareOptions opts = small_options(dir, shakespeare(0, 20000));
  opts.seq_len = 4096;
  expect_mentions(error_of([&] { prepare_dataset(opts); }),
                  {"val split holds", "bytes", "seq_len + 1 = 4097", "raise val_fraction"});
  EXPECT_FALSE(std::filesystem::exists(dir / "out/tokenizer.model"));

  // Enough bytes but not enough tokens (BPE packs more than 1.25 bytes in a
  // token): found after tokenizing. Preparing over an existing dataset, the
  // failure leaves no dataset.json describing the half-rewritten directory.
  opts.seq_len = 64;
  const int64_t val_bytes = prepare_dataset(opts).val.bytes;
  ASSERT_TRUE(std::filesystem::exists(dir / "out/dataset.json"));
  opts.seq_len = static_cast<int>(val_bytes * 4 / 5);
  expect_mentions(error_of([&] { prepare_dataset(opts); }),
                  {"val split holds", str("tokens, fewer than the seq_len + 1 = ", opts.seq_len + 1)});
  EXPECT_FALSE(std::filesystem::exists(dir / "out/dataset.json"));
  expect_mentions(error_of([&] { DatasetInfo::read(dir / "out"); }), {"dataset.json", "does not exist"});

  // One long line: no line starts after the cut, so val is cut mid-line.
  write_bytes(dir / "line.txt", std::string(2000, 'a') + "\n");
  expect_mentions(error_of([&] { prepare_dataset({.inputs = {dir / "line.txt"}, .out_dir = dir / "o2"}); }),
                  {"val split holds 201 bytes", "seq_len + 1 = 257"});
  // A fraction too small to leave a single byte.
  expect_mentions(
      error_of([&] { prepare_dataset({.inputs = {dir / "line.txt"}, .out_dir = dir / "o2", .val_fraction = 1e-17}); }),
      {"val split of 2001 bytes", "is empty"});
}

TEST(Prepare, RejectsATokenizerThatDoesNotReproduceTheText) {
  // sentencepiece's defaults (NFKC, whitespace clean-up) lose runs of spaces.
  TempDir dir;
  const std::string text = shakespeare(0, 60000) + "two  spaces\n" + shakespeare(60000, 20000);
  write_bytes(dir / "corpus.txt", text);
  auto status = sentencepiece::SentencePieceTrainer::Train({{"input", (dir / "corpus.txt").string()},
                                                            {"model_prefix", (dir / "lossy").string()},
                                                            {"vocab_size", "300"},
                                                            {"model_type", "bpe"},
                                                            {"minloglevel", "2"}});
  ASSERT_TRUE(status.ok()) << status.ToString();
  expect_mentions(
      error_of([&] {
        prepare_dataset(
            {.inputs = {dir / "corpus.txt"}, .out_dir = dir / "out", .tokenizer = dir / "lossy.model", .seq_len = 32});
      }),
      {"lossy.model", "does not reproduce", "corpus.txt"});
  EXPECT_FALSE(std::filesystem::exists(dir / "out/tokenizer.model"));
}

TEST(DatasetInfo, MissingOrMalformedDescriptionsAreErrorsNamingTheFile) {
  TempDir dir;
  expect_mentions(error_of([&] { DatasetInfo::read(dir.path()); }), {"dataset.json", "does not exist"});
  write_bytes(dir / "dataset.json", "{not json");
  expect_mentions(error_of([&] { DatasetInfo::read(dir.path()); }), {"dataset.json", "malformed"});
  write_bytes(dir / "dataset.json", R"({"format": "loom.dataset", "format_version": 1, "sources": []})");
  expect_mentions(error_of([&] { DatasetInfo::read(dir / "dataset.json"); }), {"dataset.json", "val_fraction"});
}

}  // namespace
}  // namespace loom
