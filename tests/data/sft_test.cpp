// Fine-tuning data: JSONL examples -> packed rows + loss masks -> loader
// targets that are -1 exactly off the responses.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/data_test_util.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

const std::filesystem::path kTokenizer = std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer/llama3";
constexpr int kT = 24;

struct Turn {
  std::string text;
  bool response;
};
using Example = std::vector<Turn>;

std::string jsonl_line(const Example& ex) {
  if (ex.size() == 2 && !ex[0].response && ex[1].response)
    return nlohmann::json{{"prompt", ex[0].text}, {"response", ex[1].text}}.dump();
  nlohmann::json messages = nlohmann::json::array();
  for (size_t i = 0; i < ex.size(); ++i)
    messages.push_back({{"role", ex[i].response ? "assistant" : i == 0 ? "system" : "user"}, {"content", ex[i].text}});
  return nlohmann::json{{"messages", messages}}.dump();
}

// Prompt/response pairs of varied lengths (one longer than a row), and chat
// conversations with two assistant turns.
std::vector<Example> examples() {
  std::vector<Example> v;
  for (int i = 0; i < 14; ++i) {
    std::string prompt = "Question " + std::to_string(i) + ": what is " + std::string(static_cast<size_t>(i % 4), 'x');
    std::string response = "Answer " + std::to_string(i * 7) + (i % 3 == 0 ? " with a longer tail." : ".");
    if (i == 5) response = "This answer runs on and on, far longer than one packed row of tokens can hold at all.";
    if (i % 4 == 3)
      v.push_back({{"Be brief.", false}, {prompt, false}, {response, true}, {"And again?", false}, {"Same.", true}});
    else
      v.push_back({{prompt, false}, {response, true}});
  }
  return v;
}

std::filesystem::path write_examples(const TempDir& dir, const std::vector<Example>& v) {
  std::string text;
  for (const Example& ex : v) text += jsonl_line(ex) + "\n";
  write_bytes(dir / "sft.jsonl", text);
  return dir / "sft.jsonl";
}

PrepareOptions sft_options(const TempDir& dir) {
  return {.inputs = {write_examples(dir, examples())},
          .out_dir = dir / "out",
          .tokenizer = kTokenizer,
          .val_fraction = 0.25,
          .seq_len = kT,
          .sft = true};
}

// The documented layout, computed here from the examples: per token, its id
// and whether it is a target, in rows of T.
struct Labelled {
  std::vector<int32_t> tokens;
  std::vector<bool> target;
  int64_t truncated = 0;
};

Labelled expected_layout(std::span<const Example> exs, const Tokenizer& tok) {
  Labelled out;
  const int32_t eos = *tok.eos_id();
  auto pad_row = [&] {
    while (out.tokens.size() % kT != 0) {
      out.tokens.push_back(eos);
      out.target.push_back(false);
    }
  };
  for (const Example& ex : exs) {
    std::vector<int32_t> ids{*tok.bos_id()};
    std::vector<bool> target{false};
    for (const Turn& t : ex) {
      for (int32_t id : tok.encode(t.text)) {
        ids.push_back(id);
        target.push_back(t.response);
      }
      if (t.response) {
        ids.push_back(eos);
        target.push_back(true);
      }
    }
    if (ids.size() > kT) {
      ids.resize(kT);
      target.resize(kT);
      ++out.truncated;
    }
    if (out.tokens.size() % kT + ids.size() > kT) pad_row();
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.target.insert(out.target.end(), target.begin(), target.end());
  }
  pad_row();
  out.tokens.push_back(eos);
  out.target.push_back(false);
  return out;
}

TEST(SftPrepare, LoaderTargetsAreTheResponsesAndEveryOtherTargetIsMinusOne) {
  TempDir dir;
  const DatasetInfo info = prepare_dataset(sft_options(dir));
  const Tokenizer tok = Tokenizer::load(kTokenizer);
  const std::vector<Example> all = examples();
  const std::span<const Example> train_examples = std::span(all).first(all.size() - 4);
  const Labelled want = expected_layout(train_examples, tok);
  ASSERT_GE(want.truncated, 1);

  EXPECT_EQ(info.mode, DatasetMode::sft);
  EXPECT_EQ(info.seq_len, kT);
  EXPECT_EQ(info.train.examples, static_cast<int64_t>(train_examples.size()));
  EXPECT_EQ(info.val.examples, 4);
  EXPECT_EQ(info.train.truncated, want.truncated);
  EXPECT_EQ(info.train.tokens, static_cast<int64_t>(want.tokens.size()));
  EXPECT_EQ(info.train.targets, std::count(want.target.begin(), want.target.end(), true));
  const DatasetInfo read = DatasetInfo::read(dir / "out");
  EXPECT_EQ(read.mode, DatasetMode::sft);
  EXPECT_EQ(read.sources_sha256, std::vector<std::string>{sha256_file(dir / "sft.jsonl")});
  EXPECT_EQ(read.train.mask, info.train.mask);
  EXPECT_EQ(read.val.targets, info.val.targets);
  EXPECT_EQ(read.seq_len, kT);

  // Unshuffled, window w is row w: inputs are its tokens (prompts included),
  // targets the next tokens where they are responses and -1 elsewhere: on
  // prompts, after one example's EOS (the next one's BOS), on the row's filler
  // and at the row's end.
  const int64_t rows = static_cast<int64_t>(want.tokens.size() - 1) / kT;
  TokenLoader loader(LoaderOptions{.shards = {info.train.file},
                                   .masks = info.train.masks(),
                                   .seq_len = kT,
                                   .micro_batch = 1,
                                   .global_batch = 1,
                                   .shuffle = false});
  ASSERT_EQ(loader.windows_per_epoch(), rows);
  std::vector<int32_t> inputs(kT), targets(kT);
  int64_t response_targets = 0;
  for (int64_t w = 0; w < rows; ++w) {
    loader.next(inputs, targets);
    for (int64_t j = 0; j < kT; ++j) {
      const size_t at = static_cast<size_t>(w * kT + j);
      ASSERT_EQ(inputs[j], want.tokens[at]) << "row " << w << " position " << j;
      ASSERT_EQ(targets[j], want.target[at + 1] ? want.tokens[at + 1] : -1) << "row " << w << " position " << j;
      response_targets += targets[j] != -1;
    }
    EXPECT_EQ(targets[kT - 1], -1) << "row " << w;
  }
  EXPECT_EQ(response_targets, info.train.targets);

  // Shuffled, an epoch serves the same rows in another order: packed rows are
  // never cut at an offset.
  TokenLoader shuffled(LoaderOptions{.shards = {info.train.file},
                                     .masks = info.train.masks(),
                                     .seq_len = kT,
                                     .micro_batch = 1,
                                     .global_batch = 1,
                                     .seed = 3});
  std::vector<std::vector<int32_t>> in_order, in_epoch;
  for (int64_t w = 0; w < rows; ++w) {
    shuffled.next(inputs, targets);
    in_epoch.push_back(targets);
    in_order.emplace_back(kT);
    for (int64_t j = 0; j < kT; ++j) {
      const size_t at = static_cast<size_t>(w * kT + j) + 1;
      in_order.back()[j] = want.target[at] ? want.tokens[at] : -1;
    }
  }
  EXPECT_NE(in_epoch, in_order);
  std::sort(in_epoch.begin(), in_epoch.end());
  std::sort(in_order.begin(), in_order.end());
  EXPECT_EQ(in_epoch, in_order);

  // The evaluation loader masks the val split the same way.
  const Labelled want_val = expected_layout(std::span(all).last(4), tok);
  EvalLoader eval({info.val.file}, kT, 1, 0, 1, info.val.masks());
  ASSERT_EQ(eval.total_windows(), static_cast<int64_t>(want_val.tokens.size() - 1) / kT);
  for (int64_t w = 0; eval.next(inputs, targets); ++w)
    for (int64_t j = 0; j < kT; ++j) {
      const size_t at = static_cast<size_t>(w * kT + j) + 1;
      ASSERT_EQ(targets[j], want_val.target[at] ? want_val.tokens[at] : -1) << "val row " << w << " position " << j;
    }
}

TEST(SftPrepare, IsDeterministicAndLeavesTextModeAlone) {
  TempDir dir;
  PrepareOptions opts = sft_options(dir);
  prepare_dataset(opts);
  opts.out_dir = dir / "again";
  prepare_dataset(opts);
  for (const char* f : {"train.bin", "train.mask.bin", "val.bin", "val.mask.bin", "dataset.json"})
    EXPECT_EQ(read_bytes(dir / "out" / f), read_bytes(dir / "again" / f)) << f;
  // A text dataset's description has no mode and reads as text.
  const auto j = nlohmann::json::parse(read_bytes(dir / "out/dataset.json"));
  EXPECT_EQ(j.at("mode"), "sft");
  EXPECT_EQ(j.at("train").at("mask"), "train.mask.bin");
  write_bytes(dir / "corpus.txt", testing::shakespeare(0, 20000));
  const DatasetInfo text = prepare_dataset(
      {.inputs = {dir / "corpus.txt"}, .out_dir = dir / "text", .tokenizer = kTokenizer, .seq_len = 32});
  EXPECT_FALSE(nlohmann::json::parse(read_bytes(dir / "text/dataset.json")).contains("mode"));
  EXPECT_EQ(DatasetInfo::read(dir / "text").mode, DatasetMode::text);
  EXPECT_TRUE(text.train.masks().empty());
}

TEST(SftPrepare, BadLinesAreErrorsNamingTheFileTheLineAndTheFix) {
  TempDir dir;
  const std::string good = R"({"prompt": "Hi", "response": "Hello"})";
  auto error_for = [&](const std::string& text) {
    write_bytes(dir / "bad.jsonl", text);
    PrepareOptions opts = sft_options(dir);
    opts.inputs = {dir / "bad.jsonl"};
    return error_of([&] { prepare_dataset(opts); });
  };
  expect_mentions(error_for(good + "\n" + good + "\n{\"prompt\": \"Hi\", \"response\": \n"),
                  {"bad.jsonl", "line 3", "not JSON", "\"prompt\""});
  expect_mentions(error_for(good + "\n{\"prompt\": \"Hi\"}\n" + good + "\n"),
                  {"bad.jsonl", "line 2", "no \"response\"", "{\"prompt\": \"...\", \"response\": \"...\"}"});
  expect_mentions(error_for(good + "\n" + good + "\n{\"prompt\": \"Hi\", \"response\": 7}\n"),
                  {"bad.jsonl", "line 3", "\"response\"", "not a string"});
  expect_mentions(error_for(good + "\n\n" + good + "\n"), {"bad.jsonl", "line 2", "empty", "remove blank lines"});
  expect_mentions(error_for(good + "\n{\"prompt\": \"Hi\", \"response\": \"\"}\n"),
                  {"bad.jsonl", "line 2", "\"response\" is empty"});
  expect_mentions(error_for(good + "\n" + R"({"messages": [{"role": "user", "content": "Hi"}]})" + "\n"),
                  {"bad.jsonl", "line 2", "no assistant message"});
  expect_mentions(error_for(good + "\n" + R"({"messages": [{"role": "bot", "content": "Hi"}]})" + "\n"),
                  {"bad.jsonl", "line 2", "\"bot\"", "\"assistant\""});
  expect_mentions(error_for(""), {"bad.jsonl", "holds no examples"});
  expect_mentions(error_for(good + "\n"), {"1 fine-tuning examples", "no training examples", "val_fraction"});
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));

  // A tokenizer that names no EOS needs --eos; the tokenizer is required.
  PrepareOptions opts = sft_options(dir);
  opts.tokenizer = std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer/fallback/tokenizer.json";
  expect_mentions(error_of([&] { prepare_dataset(opts); }), {"fallback/tokenizer.json", "end-of-sequence", "--eos"});
  opts.tokenizer.clear();
  expect_mentions(error_of([&] { prepare_dataset(opts); }), {"no tokenizer", "--tokenizer"});
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));
}

TEST(SftPrepare, MissingOrMismatchedMasksAreErrorsNamingTheFile) {
  TempDir dir;
  const DatasetInfo info = prepare_dataset(sft_options(dir));
  auto loader_error = [&](std::vector<std::filesystem::path> masks, int T) {
    return error_of([&] {
      TokenLoader loader(LoaderOptions{
          .shards = {info.train.file}, .masks = std::move(masks), .seq_len = T, .micro_batch = 1, .global_batch = 1});
    });
  };
  expect_mentions(loader_error({info.val.mask}, kT), {"val.mask.bin", "train.bin", "prepare the dataset again"});
  expect_mentions(loader_error({info.train.mask}, kT / 2),
                  {"train.mask.bin", "packed for seq_len 24", "seq_len is 12", "--seq-len 12"});
  write_bytes(dir / "junk.bin", "not a mask");
  expect_mentions(loader_error({dir / "junk.bin"}, kT), {"junk.bin", "truncated"});

  std::filesystem::remove(info.train.mask);
  expect_mentions(error_of([&] { DatasetInfo::read(dir / "out"); }),
                  {"train.mask.bin", "does not exist", "loom prepare --sft"});
  expect_mentions(loader_error({info.train.mask}, kT), {"train.mask.bin", "does not exist"});
}

}  // namespace
}  // namespace loom
