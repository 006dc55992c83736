// The main job end to end on a small slice of the corpus: resume, checkpoint
// corruption, bad data and config, export, generation and evaluation.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "loom/config.h"
#include "loom/data.h"
#include "loom/io.h"
#include "loom/train.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// A dataset prepared once for the whole suite: 80 KB of Shakespeare, vocab 512.
class MainJob : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    std::ifstream in(LOOM_SOURCE_DIR "/data/tinyshakespeare.txt", std::ios::binary);
    std::string text(80000, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    PrepareOptions po;
    po.inputs = {dir_->write("corpus.txt", text)};
    po.out_dir = *dir_ / "data";
    po.vocab_size = 512;
    po.seq_len = 32;
    prepare_dataset(po);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  Config config(const std::string& out) const {
    Config c(loom_schema());
    c.load_toml(LOOM_SOURCE_DIR "/configs/tiny-test.toml");
    c.set_override("data.dir=" + (*dir_ / "data").string());
    c.set_override("train.out_dir=" + (*dir_ / out).string());
    c.set_override("train.steps=20");
    c.set_override("train.checkpoint_interval=5");
    c.set_override("train.eval_interval=0");
    c.set_override("train.sample_tokens=0");
    return c;
  }

  static std::vector<double> losses(const fs::path& metrics) {
    std::vector<double> out;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) out.push_back(j.at("loss").get<double>());
    }
    return out;
  }

  RunOptions quiet() const {
    RunOptions r;
    r.quiet = true;
    return r;
  }

  static TempDir* dir_;
};
TempDir* MainJob::dir_ = nullptr;

TEST_F(MainJob, ResumedRunIsBitIdenticalToAnUninterruptedOne) {
  run_training(config("whole"), quiet());
  RunOptions stop = quiet();
  stop.stop_after = 10;
  run_training(config("resumed"), stop);
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(config("resumed"), resume);

  std::vector<double> whole = losses(*dir_ / "whole" / "metrics.jsonl");
  std::vector<double> resumed = losses(*dir_ / "resumed" / "metrics.jsonl");
  ASSERT_EQ(whole.size(), 20u);
  ASSERT_EQ(resumed.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(whole[i], resumed[i]) << "step " << i + 1;
  EXPECT_LT(whole.back(), whole.front());
  // keep_last = 2: steps 15 and 20 remain, latest names 20.
  auto kept = list_checkpoints(*dir_ / "whole");
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept.back().step, 20);
  EXPECT_EQ(read_latest(*dir_ / "whole")->filename(), "step_00000020");
}

TEST_F(MainJob, CorruptOrIncompleteCheckpointsAreRefusedByName) {
  Config c = config("corrupt");
  c.set_override("train.keep_last=0");
  RunOptions stop = quiet();
  stop.stop_after = 10;
  run_training(c, stop);
  const fs::path ckpt = *dir_ / "corrupt" / "step_00000010";
  {
    std::fstream f(ckpt / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  RunOptions resume = quiet();
  resume.resume = true;
  EXPECT_CONTAINS(error_of([&] { run_training(c, resume); }), "model.safetensors");
  // The earlier checkpoint is untouched and still loads.
  GPT model(model_config_from(c));
  ParamStore ps(model.layout(), 0);
  const fs::path earlier = *dir_ / "corrupt" / "step_00000005";
  load_weights(read_checkpoint_info(earlier), model, ps);

  fs::remove(earlier / "optimizer.safetensors");
  EXPECT_CONTAINS(error_of([&] { read_checkpoint_info(earlier); }), "optimizer.safetensors");
  fs::remove(earlier / kManifestFile);
  EXPECT_CONTAINS(error_of([&] { read_checkpoint_info(earlier); }), kManifestFile);
}

TEST_F(MainJob, ResumeWithoutACheckpointOrWithAnotherModelIsAnError) {
  RunOptions resume = quiet();
  resume.resume = true;
  EXPECT_CONTAINS(error_of([&] { run_training(config("nothing"), resume); }), "no checkpoint");
  RunOptions stop = quiet();
  stop.stop_after = 5;
  run_training(config("other"), stop);
  Config wider = config("other");
  wider.set_override("model.n_embd=64");
  EXPECT_CONTAINS(error_of([&] { run_training(wider, resume); }), "the config asks for");
}

TEST_F(MainJob, VocabularyMismatchAndShortCorpusAreErrors) {
  Config c = config("vocab");
  c.set_override("model.vocab_size=400");
  c.set_override("data.vocab_size=400");
  EXPECT_CONTAINS(error_of([&] { run_training(c, quiet()); }), "vocabulary of 512");

  Config small = config("small");
  small.set_override("data.dir=" + (*dir_ / "small-data").string());
  small.set_override("data.text=" + dir_->write("small.txt", "To be, or not to be.\n").string());
  EXPECT_THROW(run_training(small, quiet()), Error);

  Config bad = config("bad");
  bad.set_override("train.batch_size=5");
  EXPECT_CONTAINS(error_of([&] { plan_training(bad); }), "train.batch_size = 5");
  Config ctx = config("ctx");
  ctx.set_override("train.seq_len=64");
  EXPECT_CONTAINS(error_of([&] { plan_training(ctx); }), "block_size = 32");
}

TEST_F(MainJob, ExportWritesHuggingFaceNamesAndConv1DLayouts) {
  GPTConfig cfg;
  cfg.n_layer = 1;
  cfg.n_head = 2;
  cfg.n_embd = 8;
  cfg.vocab_size = 11;
  cfg.block_size = 6;
  GPT model(cfg);
  ParamStore ps(model.layout(), 3);
  export_hf_gpt2(model, ps, *dir_ / "hf");
  SafetensorsReader r(*dir_ / "hf" / "model.safetensors");
  EXPECT_EQ(r.entries().size(), model.layout().params().size());
  const int fc = model.layout().find("h.0.mlp.c_fc.weight");
  const auto& e = r.entry("h.0.mlp.c_fc.weight");
  EXPECT_EQ(e.shape, (Shape{8, 32}));  // [in, out]
  Tensor t = r.load("h.0.mlp.c_fc.weight");
  const float* src = ps.param(fc).data<float>();  // [out, in]
  for (int64_t o = 0; o < 32; ++o)
    for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(t.data<float>()[i * 32 + o], src[o * 8 + i]);
  EXPECT_EQ(r.entry("wte.weight").shape, (Shape{11, 8}));
  EXPECT_EQ(r.entry("h.0.ln_1.bias").shape, (Shape{8}));
  nlohmann::json j = nlohmann::json::parse(read_file(*dir_ / "hf" / "config.json"));
  EXPECT_EQ(j.at("model_type"), "gpt2");
  EXPECT_EQ(j.at("n_positions"), 6);
}

TEST_F(MainJob, GenerationIsSeededAndEvaluationReportsPerCharLoss) {
  Config c = config("gen");
  c.set_override("train.steps=5");
  const EvalResult final_eval = run_training(c, quiet());
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "gen"));
  GPT model(checkpoint_model_config(info));
  ParamStore ps(model.layout(), 0);
  load_weights(info, model, ps);
  const Tokenizer tok = Tokenizer::load(info.fields.at("tokenizer").get<std::string>());
  SampleOptions so;
  so.top_k = 20;
  so.top_p = 0.9f;
  const std::string a = generate(model, ps, tok, "ROMEO:", 40, so);
  EXPECT_EQ(a, generate(model, ps, tok, "ROMEO:", 40, so));
  so.seed += 1;
  EXPECT_NE(a, generate(model, ps, tok, "ROMEO:", 40, so));

  const DatasetInfo d = DatasetInfo::read(*dir_ / "data");
  const EvalResult r = evaluate(model, ps, {d.val.file}, 32, 2, d.val.chars_per_token());
  EXPECT_DOUBLE_EQ(r.loss_per_token, final_eval.loss_per_token);
  EXPECT_NEAR(r.loss_per_char * d.val.chars_per_token(), r.loss_per_token, 1e-9);
}

TEST(Sampler, GreedyTopKAndTopP) {
  const float logits[5] = {0.1f, 3.0f, 2.9f, -1.0f, 0.0f};
  SampleOptions greedy;
  greedy.temperature = 0.0f;
  EXPECT_EQ(sample_token(logits, 5, greedy, 0), 1);
  SampleOptions k2;
  k2.top_k = 2;
  for (uint64_t d = 0; d < 200; ++d) {
    const int32_t t = sample_token(logits, 5, k2, d);
    EXPECT_TRUE(t == 1 || t == 2);
  }
  SampleOptions p;
  p.temperature = 1.0f;
  p.top_p = 0.3f;  // the top token alone has about half the mass
  for (uint64_t d = 0; d < 200; ++d) EXPECT_EQ(sample_token(logits, 5, p, d), 1);
}

}  // namespace
}  // namespace loom
