// `loom train` on a prepared fine-tuning dataset trains and evaluates on the
// responses alone.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/config.h"
#include "loom/data.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

// `loom train` on a fine-tuning dataset: a sentencepiece tokenizer trained
// on Shakespeare, examples whose prompt is a line and response the next.
class FineTuning : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    std::ifstream in(LOOM_SOURCE_DIR "/data/tinyshakespeare.txt", std::ios::binary);
    std::string text(60000, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    Tokenizer::train(text, *dir_ / "tokenizer.model", {.vocab_size = 512});
    std::istringstream lines(text);
    std::vector<std::string> kept;
    for (std::string line; std::getline(lines, line);)
      if (!line.empty()) kept.push_back(line);
    std::string jsonl;
    for (size_t i = 0; i + 1 < kept.size() && i < 400; i += 2)
      jsonl += nlohmann::json{{"prompt", kept[i] + "\n"}, {"response", kept[i + 1]}}.dump() + "\n";
    PrepareOptions po;
    po.inputs = {dir_->write("sft.jsonl", jsonl)};
    po.out_dir = *dir_ / "sft";
    po.tokenizer = *dir_ / "tokenizer.model";
    po.seq_len = 32;
    po.sft = true;
    prepare_dataset(po);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  static Config config(const std::string& out) {
    Config c(loom_schema());
    c.load_toml(LOOM_SOURCE_DIR "/configs/tiny-test.toml");
    c.set_override("data.dir=" + (*dir_ / "sft").string());
    c.set_override("train.out_dir=" + (*dir_ / out).string());
    c.set_override("train.steps=8");
    c.set_override("train.checkpoint_interval=0");
    c.set_override("train.eval_interval=0");
    c.set_override("train.sample_tokens=0");
    return c;
  }

  static std::vector<double> losses(const std::string& out) {
    std::vector<double> v;
    std::ifstream in(*dir_ / out / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) v.push_back(j.at("loss").get<double>());
    }
    return v;
  }

  static TempDir* dir_;
};
TempDir* FineTuning::dir_ = nullptr;

TEST_F(FineTuning, TrainsAndEvaluatesOnTheResponsesAlone) {
  RunOptions quiet;
  quiet.quiet = true;
  const EvalResult single = run_training(config("single"), quiet).final_eval;
  const DatasetInfo d = DatasetInfo::read(*dir_ / "sft");
  // Validation covers every packed row: its tokens are the val responses.
  EXPECT_EQ(single.tokens, d.val.targets);
  EXPECT_NEAR(single.loss_per_char * d.val.chars_per_token(), single.loss_per_token, 1e-9);

  // Two data-parallel ranks hold different numbers of response tokens; the
  // objective is still the mean over the whole global batch.
  Config dp2 = config("dp2");
  dp2.set_override("parallel.dp=2");
  run_training(dp2, quiet);
  const std::vector<double> a = losses("single"), b = losses("dp2");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-4 * a[i]) << "step " << i + 1;
  EXPECT_LT(a.back(), a.front());
}

TEST_F(FineTuning, ASeqLenOtherThanThePackingsIsAnErrorNamingTheMask) {
  Config c = config("short");
  c.set_override("train.seq_len=16");
  RunOptions quiet;
  quiet.quiet = true;
  const std::string e = error_of([&] { run_training(c, quiet); });
  EXPECT_CONTAINS(e, "train.mask.bin");
  EXPECT_CONTAINS(e, "packed for seq_len 32");
}

}  // namespace
}  // namespace loom
