// Training on masked targets (fine-tuning data): the loss is the mean over
// the targets that are not -1, its gradient that of those targets alone, and
// `loom train` on a prepared SFT dataset trains and evaluates on the responses.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/config.h"
#include "loom/data.h"
#include "loom/train.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::random_tokens;
using testing::TempDir;

GPTConfig small_model() {
  GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 50;
  c.block_size = 16;
  return c;
}

std::vector<float> host_values(const Tensor& t) {
  const Tensor h = t.clone(Tier::host);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

TEST(MaskedTargets, LossIsTheMeanOverUnmaskedTargetsAndTheGradientIsTheirs) {
  const GPTConfig cfg = small_model();
  const int64_t B = 2, T = 16;
  const std::vector<int32_t> tokens = random_tokens(B * T + 1, cfg.vocab_size, 5);
  // Row 0 a short prompt, row 1 a long one, and a masked run inside row 0's
  // response, as packed examples give.
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  const int64_t prompt[2] = {4, 11};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < T; ++j)
      if (j < prompt[b] || (b == 0 && j >= 9 && j < 12)) targets[static_cast<size_t>(b * T + j)] = -1;
  std::vector<int64_t> valid;
  for (int64_t i = 0; i < B * T; ++i)
    if (targets[static_cast<size_t>(i)] != -1) valid.push_back(i);
  ASSERT_EQ(valid.size(), 14u);

  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-3f, 1, 1};
  Trainer* trainer_ptr = nullptr;
  std::vector<float> trainer_grad;
  opts.on_gradients = [&](GradStore&) { trainer_grad = host_values(trainer_ptr->gather_gradients()); };
  Trainer trainer(cfg, opts);
  trainer_ptr = &trainer;
  const MicroBatch mb{tokens.data(), targets.data(), {B, T}, 0};
  const StepStats st = trainer.step({&mb, 1});

  // Independently, one forward and backward per unmasked target, each with
  // that target alone: the per-token losses and the sum of their gradients
  // over the count, from the Trainer's initial weights.
  GPT model(cfg);
  ParamStore ps(model.layout(), opts.seed);
  GradStore gs(model.layout());
  gs.zero();
  const float dloss = 1.0f / static_cast<float>(valid.size());
  double loss_sum = 0.0;
  for (int64_t p : valid) {
    std::vector<int32_t> one(targets.size(), -1);
    one[static_cast<size_t>(p)] = targets[static_cast<size_t>(p)];
    MicroBatchState s;
    ForwardOptions fo;
    fo.training = true;
    fo.dloss = dloss;
    model.forward(ps, s, tokens.data(), one.data(), {B, T}, fo);
    model.backward(ps, gs, s, dloss);
    const double loss_p = s.host_loss_sum();
    EXPECT_GT(loss_p, 0.0);
    loss_sum += loss_p;
  }
  const double mean = loss_sum / static_cast<double>(valid.size());
  EXPECT_NEAR(st.loss, mean, 1e-6 * mean);
  // Over every position it would be diluted by the masked ones.
  EXPECT_GT(std::fabs(st.loss - loss_sum / static_cast<double>(B * T)), 0.1 * mean);

  const std::vector<float> want = host_values(gs.flat());
  ASSERT_EQ(trainer_grad.size(), want.size());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(trainer_grad[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(diff, 1e-5 * scale) << "max abs difference " << diff << " of max abs " << scale;
}

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
  const EvalResult single = run_training(config("single"), quiet);
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
