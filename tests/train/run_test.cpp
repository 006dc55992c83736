// The main job end to end on a small slice of the corpus: resume; data,
// tensor, sequence and pipeline parallelism, ZeRO, mixed precision and memory
// placement against the single-rank run; memory budgets; checkpoints across
// layouts, checkpoint corruption, bad data and config, export, generation and
// evaluation.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>
#include <tuple>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "test_util.h"
#include "loom/comm.h"
#include "loom/config.h"
#include "loom/data.h"
#include "loom/inference.h"
#include "loom/io.h"
#include "loom/prune.h"
#include "loom/train.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// The weights of a run's latest checkpoint in a whole model.
struct CheckpointWeights {
  explicit CheckpointWeights(const fs::path& run)
      : info(read_checkpoint_info(resolve_checkpoint(run))), model(checkpoint_model_config(info)),
        ps(model.layout(), 0) {
    load_weights(info, model, ps);
  }
  CheckpointInfo info;
  GPT model;
  ParamStore ps;
};

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
    c.set_override("data.text=" + (*dir_ / "corpus.txt").string());
    c.set_override("train.out_dir=" + (*dir_ / out).string());
    c.set_override("train.steps=20");
    c.set_override("train.checkpoint_interval=5");
    c.set_override("train.eval_interval=0");
    c.set_override("train.sample_tokens=0");
    return c;
  }

  // The metrics.jsonl records of training steps (those with a "loss").
  static std::vector<nlohmann::json> step_records(const fs::path& metrics) {
    std::vector<nlohmann::json> out;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) out.push_back(j);
    }
    return out;
  }

  static std::vector<double> losses(const fs::path& metrics) { return losses_of(step_records(metrics)); }

  // Each step's loss from its last record, in step order: a restarted run
  // logs the steps after its checkpoint again.
  static std::vector<double> last_losses(const fs::path& metrics) {
    std::map<int64_t, double> last;
    for (const nlohmann::json& r : step_records(metrics)) last[r.at("step")] = r.at("loss");
    std::vector<double> out;
    for (const auto& [step, loss] : last) {
      EXPECT_EQ(step, static_cast<int64_t>(out.size()) + 1) << "a step with no record";
      out.push_back(loss);
    }
    return out;
  }

  // Losses of `a` and `b` agree step by step within `tolerance` (absolute).
  static void expect_losses_near(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tolerance) << "step " << i + 1;
  }

  RunOptions quiet() const {
    RunOptions r;
    r.quiet = true;
    return r;
  }

  // A quiet run of config(out) with `overrides`: its step records.
  std::vector<nlohmann::json> train(const std::string& out, std::initializer_list<std::string> overrides) const {
    Config c = config(out);
    for (const std::string& o : overrides) c.set_override(o);
    run_training(c, quiet());
    return step_records(*dir_ / out / "metrics.jsonl");
  }

  static std::vector<double> losses_of(const std::vector<nlohmann::json>& records) {
    std::vector<double> out;
    for (const nlohmann::json& j : records) out.push_back(j.at("loss").get<double>());
    return out;
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

TEST_F(MainJob, DistillsFromALoomCheckpointUnderEveryLayout) {
  // A teacher that is the initialization: one step at learning rate 0.
  train("teacher_init", {"train.steps=1", "train.lr=0", "train.min_lr=0"});
  const std::string teacher = "distill.teacher=" + (*dir_ / "teacher_init").string();
  // The student starts equal to it (same seed), whole or split over tp.
  for (const std::string tp : {"1", "2"}) {
    const auto same = train("distill_same_tp" + tp, {teacher, "distill.alpha=1", "parallel.tp=" + tp, "train.steps=1"});
    ASSERT_EQ(same.size(), 1u);
    EXPECT_NEAR(same[0].at("loss").get<double>(), 0.0, 1e-6) << "tp " << tp;
    EXPECT_NEAR(same[0].at("loss_kl").get<double>(), 0.0, 1e-7) << "tp " << tp;
    EXPECT_NEAR(same[0].at("loss_ce").get<double>(), std::log(512.0), 0.1) << "tp " << tp;
  }
  // Another seed's student learns from it alike on one rank and on two.
  const std::initializer_list<std::string> other = {teacher, "train.seed=7", "train.steps=3", "distill.temperature=3"};
  const auto single = train("distill_other", other);
  Config c = config("distill_other_dp2");
  for (const std::string& o : other) c.set_override(o);
  c.set_override("parallel.dp=2");
  run_training(c, quiet());
  const auto dp2 = step_records(*dir_ / "distill_other_dp2" / "metrics.jsonl");
  ASSERT_EQ(single.size(), 3u);
  ASSERT_EQ(dp2.size(), 3u);
  EXPECT_GT(single[0].at("loss_kl").get<double>(), 0.0);
  for (size_t i = 0; i < single.size(); ++i)
    EXPECT_NEAR(dp2[i].at("loss").get<double>(), single[i].at("loss").get<double>(),
                1e-5 * single[i].at("loss").get<double>())
        << "step " << i + 1;
}

TEST_F(MainJob, DistillationSettingsAreCheckedBeforeTheRun) {
  Config c = config("distill_bad");
  c.set_override("distill.teacher=hf:" LOOM_SOURCE_DIR "/tests/fixtures/hf/gpt2");
  std::string e = error_of([&] { run_training(c, quiet()); });
  EXPECT_CONTAINS(e, "distill.teacher");
  EXPECT_CONTAINS(e, "96");
  EXPECT_CONTAINS(e, "512");
  c = config("distill_bad");
  c.set_override("distill.teacher=" + (*dir_ / "no_such_run").string());
  EXPECT_CONTAINS(error_of([&] { run_training(c, quiet()); }), "distill.teacher");
  EXPECT_CONTAINS(error_of([&] { c.set_override("distill.alpha=1.5"); }), "distill.alpha");
  train("distill_teacher_for_errors", {"train.steps=1"});
  c = config("distill_bad");
  c.set_override("distill.teacher=" + (*dir_ / "distill_teacher_for_errors").string());
  c.set_override("distill.temperature=0");
  EXPECT_CONTAINS(error_of([&] { run_training(c, quiet()); }), "distill.temperature");
  EXPECT_FALSE(fs::exists(*dir_ / "distill_bad"));
}

TEST_F(MainJob, DataParallelZero1ReproducesTheSingleRankLosses) {
  // With dropout, so the masks must follow each sequence's place in the
  // global batch, not in a rank's slice.
  Config single = config("dp1");
  single.set_override("train.steps=10");
  single.set_override("model.dropout=0.1");
  const EvalResult reference = run_training(single, quiet()).final_eval;
  Config dp = config("dp2-zero1");
  dp.set_override("train.steps=10");
  dp.set_override("model.dropout=0.1");
  dp.set_override("parallel.dp=2");
  dp.set_override("zero.stage=1");
  const EvalResult sharded = run_training(dp, quiet()).final_eval;

  const std::vector<double> want = losses(*dir_ / "dp1" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 10u);
  expect_losses_near(losses(*dir_ / "dp2-zero1" / "metrics.jsonl"), want, 1e-5);
  // The final validation covers the whole split on either layout.
  EXPECT_EQ(sharded.tokens, reference.tokens);
  EXPECT_NEAR(sharded.loss_per_token, reference.loss_per_token, 1e-5);
  // Rank 0 alone writes the checkpoints, in the single-rank format.
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "dp2-zero1"));
  EXPECT_EQ(info.step, 10);
  EXPECT_EQ(info.fields.at("layout").at("dp"), 2);
  EXPECT_EQ(info.fields.at("layout").at("zero_stage"), 1);
}

TEST_F(MainJob, ParallelAutoTrainsTheSearchsFastestLayout) {
  // This machine's calibration, as `loom calibrate` would leave it: here the
  // H100 description, so that the test does not measure.
  TempDir cache;
  const testing::ScopedEnv home("XDG_CACHE_HOME", cache.path().string());
  const MachineRates rates = load_machine_rates(LOOM_SOURCE_DIR "/hardware/h100-sxm.json");
  fs::create_directories(default_calibration_path().parent_path());
  save_machine_rates(rates, default_calibration_path());

  Config cfg = config("auto");
  cfg.set_override("train.steps=2");
  cfg.set_override("train.checkpoint_interval=2");
  cfg.set_override("parallel.dp=2");
  cfg.set_override("parallel.auto=true");
  const LayoutSearch search = search_layouts(cfg, rates, 2, std::numeric_limits<double>::infinity());
  ASSERT_FALSE(search.ranked.empty());
  EXPECT_EQ(run_training(cfg, quiet()).steps_done, 2);

  // The run is the config with the search's first layout.
  Config expected = cfg;
  for (const std::string& s : layout_settings(search.ranked.front().layout)) expected.set_override(s);
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "auto"));
  EXPECT_EQ(info.step, 2);
  EXPECT_EQ(info.fields.at("config"), expected.to_json());
  const std::vector<double> trained = losses(*dir_ / "auto" / "metrics.jsonl");
  ASSERT_EQ(trained.size(), 2u);
  for (double loss : trained) EXPECT_TRUE(std::isfinite(loss));
}

TEST_F(MainJob, Zero3Bf16ResumesBitIdentically) {
  Config c = config("z3-whole");
  c.set_override("parallel.dp=2");
  c.set_override("zero.stage=3");
  c.set_override("precision=bf16");
  c.set_override("train.steps=12");
  c.set_override("train.checkpoint_interval=0");
  run_training(c, quiet());
  c.set_override("train.out_dir=" + (*dir_ / "z3-resumed").string());
  RunOptions stop = quiet();
  stop.stop_after = 6;
  run_training(c, stop);
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(c, resume);

  const std::vector<double> whole = losses(*dir_ / "z3-whole" / "metrics.jsonl");
  const std::vector<double> resumed = losses(*dir_ / "z3-resumed" / "metrics.jsonl");
  ASSERT_EQ(whole.size(), 12u);
  ASSERT_EQ(resumed.size(), 12u);
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(whole[i], resumed[i]) << "step " << i + 1;
  EXPECT_LT(whole.back(), whole.front());
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "z3-resumed"));
  EXPECT_EQ(info.fields.at("layout").at("precision"), "bf16");
}

TEST_F(MainJob, CheckpointOfZero2LoadsIntoTheSingleRankReference) {
  Config single = config("z2-reference");
  single.set_override("train.steps=12");
  run_training(single, quiet());
  Config sharded = config("z2-to-dp1");
  sharded.set_override("train.steps=12");
  sharded.set_override("parallel.dp=2");
  sharded.set_override("zero.stage=2");
  RunOptions stop = quiet();
  stop.stop_after = 6;
  run_training(sharded, stop);
  Config resumed = config("z2-to-dp1");
  resumed.set_override("train.steps=12");
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(resumed, resume);

  const std::vector<double> want = losses(*dir_ / "z2-reference" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 12u);
  expect_losses_near(losses(*dir_ / "z2-to-dp1" / "metrics.jsonl"), want, 1e-5);
}

TEST_F(MainJob, Fp16LogsItsLossScaleAndSkippedSteps) {
  // A reference checkpoint resumed under dp = 2, ZeRO-3, fp16 with a scale so
  // large (2^21) that the first steps overflow: each overflow halves it
  // (hysteresis 1) and skips the update, until the gradients fit in fp16.
  Config c = config("fp16");
  c.set_override("train.steps=12");
  RunOptions stop = quiet();
  stop.stop_after = 4;
  run_training(c, stop);
  Config reference = config("fp16-reference");
  reference.set_override("train.steps=12");
  stop.stop_after = 5;
  run_training(reference, stop);
  for (const char* o : {"parallel.dp=2", "zero.stage=3", "precision=fp16", "loss_scale.initial=2097152",
                        "loss_scale.hysteresis=1"})
    c.set_override(o);
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(c, resume);

  const std::vector<nlohmann::json> records = step_records(*dir_ / "fp16" / "metrics.jsonl");
  ASSERT_EQ(records.size(), 12u);
  EXPECT_FALSE(records[3].contains("loss_scale"));  // step 4 ran in fp32
  const nlohmann::json& first = records[4];
  // Step 5 starts from the loaded weights, rounded to fp16.
  EXPECT_NEAR(first.at("loss").get<double>(), losses(*dir_ / "fp16-reference" / "metrics.jsonl").at(4), 1e-2);
  const nlohmann::json& last = records.back();
  EXPECT_EQ(first.at("loss_scale").get<double>(), 2097152.0);
  EXPECT_EQ(first.at("skipped").get<int64_t>(), 1);
  const int64_t skipped = last.at("skipped").get<int64_t>();
  EXPECT_GT(skipped, 1);
  EXPECT_LT(skipped, 8) << "every fp16 step overflowed";
  EXPECT_EQ(last.at("loss_scale").get<double>(), std::ldexp(2097152.0, -static_cast<int>(skipped)));
  // The manifest keeps the two counters apart and the scaler's state.
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "fp16"));
  EXPECT_EQ(info.step, 12);
  EXPECT_EQ(info.fields.at("optimizer_steps").get<int64_t>(), 12 - skipped);
  EXPECT_EQ(info.fields.at("loss_scale").at("scale").get<double>(), last.at("loss_scale").get<double>());
  EXPECT_EQ(info.fields.at("layout").at("precision"), "f16");
}

// Six steps of the tiny model under each memory placement against the same
// steps with everything on the device: the step records of metrics.jsonl.
TEST_F(MainJob, MemoryPoliciesReproduceTheDeviceOnlyLosses) {
  const std::vector<nlohmann::json> device_only = train("mem-none", {"train.steps=6"});
  ASSERT_EQ(device_only.size(), 6u);
  EXPECT_TRUE(device_only.back().contains("host_peak_bytes"));
  // The caching allocator holds at least what was in use at the peak.
  for (const char* tier : {"device", "host"})
    EXPECT_GE(device_only.back().at(str(tier, "_peak_reserved_bytes")).get<int64_t>(),
              device_only.back().at(str(tier, "_peak_bytes")).get<int64_t>())
        << tier;
  EXPECT_FALSE(device_only.back().contains("host_to_device_bytes"));
  const std::vector<double> want = losses_of(device_only);

  const std::vector<nlohmann::json> offloaded =
      train("mem-static-1",
            {"train.steps=6", "memory.policy=static", "memory.offload_param_frac=1", "memory.offload_optim_frac=1"});
  expect_losses_near(losses_of(offloaded), want, 1e-6);
  // Every step brings the parameters from the host; nothing goes to NVMe.
  for (const nlohmann::json& j : offloaded) {
    EXPECT_GT(j.at("host_to_device_bytes").get<int64_t>(), 0) << j.dump();
    EXPECT_EQ(j.at("nvme_read_bytes").get<int64_t>() + j.at("nvme_write_bytes").get<int64_t>(), 0) << j.dump();
  }
  EXPECT_LT(offloaded.back().at("device_peak_bytes").get<int64_t>(),
            device_only.back().at("device_peak_bytes").get<int64_t>());

  expect_losses_near(losses_of(train("mem-static-half", {"train.steps=6", "memory.policy=static",
                                                         "memory.offload_param_frac=0.5",
                                                         "memory.offload_optim_frac=0.5"})),
                     want, 1e-6);
  expect_losses_near(losses_of(train("mem-auto", {"train.steps=6", "memory.policy=auto"})), want, 1e-6);
  // The checkpoint holds the whole state in the usual format.
  EXPECT_EQ(read_checkpoint_info(resolve_checkpoint(*dir_ / "mem-auto")).step, 6);
}

TEST_F(MainJob, NvmeOffloadReproducesTheDeviceOnlyLosses) {
  const std::vector<double> want = losses_of(train("nvme-reference", {"train.steps=4"}));
  ASSERT_EQ(want.size(), 4u);
  TempDir nvme;
  for (const bool io_uring : {true, false}) {
    const std::string engine = io_uring ? "io_uring" : "threads";
    const std::vector<nlohmann::json> records =
        train("nvme-" + engine, {"train.steps=4", "memory.policy=static", "memory.offload_param_frac=1",
                                 "memory.offload_optim_frac=1", "memory.nvme_dir=" + nvme.path().string(),
                                 str("memory.nvme_io_uring=", io_uring ? "true" : "false")});
    ASSERT_EQ(records.size(), 4u) << engine;
    for (const nlohmann::json& j : records) {
      EXPECT_GT(j.at("nvme_read_bytes").get<int64_t>(), 0) << engine << " " << j.dump();
      EXPECT_GT(j.at("nvme_write_bytes").get<int64_t>(), 0) << engine << " " << j.dump();
    }
    expect_losses_near(losses_of(records), want, 1e-6);
    // The tier's scratch files are unlinked as soon as they are created.
    EXPECT_TRUE(fs::is_empty(nvme.path())) << engine;
  }
}

TEST_F(MainJob, ShardedChunksReproduceTheSingleRankLosses) {
  const std::vector<double> want = losses_of(train("chunks-reference", {"train.steps=4"}));
  const std::vector<nlohmann::json> sharded =
      train("chunks-dp2", {"train.steps=4", "parallel.dp=2", "zero.stage=3", "memory.policy=static",
                           "memory.offload_param_frac=0.5", "memory.offload_optim_frac=1"});
  // The reduction over two ranks sums in another order.
  expect_losses_near(losses_of(sharded), want, 1e-5);
}

TEST_F(MainJob, MemoryBudgetsHoldBeforeAndDuringTheRun) {
  // Under a policy the plan finds that the model state cannot fit, before a
  // file or a byte of the run exists.
  Config c = config("over-budget");
  for (const char* o : {"memory.policy=auto", "memory.device_budget=64KiB", "memory.host_budget=64KiB"})
    c.set_override(o);
  std::string e = error_of([&] { run_training(c, quiet()); });
  EXPECT_CONTAINS(e, "(memory.device_budget)");
  EXPECT_CONTAINS(e, "(memory.host_budget)");
  EXPECT_CONTAINS(e, format_bytes(64 << 10));
  EXPECT_FALSE(fs::exists(*dir_ / "over-budget"));
  // Without one the device allocator holds the budget.
  Config none = config("over-device-budget");
  none.set_override("memory.device_budget=64KiB");
  e = error_of([&] { run_training(none, quiet()); });
  EXPECT_CONTAINS(e, "out of device memory");
  EXPECT_CONTAINS(e, "memory.device_budget");
}

TEST_F(MainJob, TensorSequenceAndPipelineParallelRunReproducesTheSingleRankLosses) {
  // tp = 2 with sequence parallelism x pp = 2 (two micro-batches per step
  // fill the pipeline), with dropout: the masks must not depend on which rank
  // holds a token or a layer.
  Config single = config("mp-reference");
  single.set_override("train.steps=8");
  single.set_override("model.dropout=0.1");
  const EvalResult reference = run_training(single, quiet()).final_eval;
  Config mesh = config("tp2-sp-pp2");
  mesh.set_override("train.steps=8");
  mesh.set_override("model.dropout=0.1");
  for (const char* o : {"parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"}) mesh.set_override(o);
  const EvalResult split = run_training(mesh, quiet()).final_eval;

  const std::vector<double> want = losses(*dir_ / "mp-reference" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 8u);
  expect_losses_near(losses(*dir_ / "tp2-sp-pp2" / "metrics.jsonl"), want, 1e-5);
  // Validation goes through the pipeline and covers the same windows.
  EXPECT_EQ(split.tokens, reference.tokens);
  EXPECT_NEAR(split.loss_per_token, reference.loss_per_token, 1e-5);
  // World rank 0 alone writes the whole model in the single-rank format.
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "tp2-sp-pp2"));
  EXPECT_EQ(info.step, 8);
  EXPECT_EQ(info.fields.at("layout").at("tp"), 2);
  EXPECT_EQ(info.fields.at("layout").at("pp"), 2);
  GPT model(model_config_from(single));
  ParamStore ps(model.layout(), 0);
  load_weights(info, model, ps);
}

TEST_F(MainJob, CheckpointOfTensorAndPipelineParallelRunResumesUnderDataParallelism) {
  Config single = config("mp-to-dp-reference");
  single.set_override("train.steps=10");
  run_training(single, quiet());
  Config mesh = config("mp-to-dp");
  mesh.set_override("train.steps=10");
  for (const char* o : {"parallel.tp=2", "parallel.pp=2", "parallel.schedule=gpipe"}) mesh.set_override(o);
  RunOptions stop = quiet();
  stop.stop_after = 5;
  run_training(mesh, stop);
  Config dp = config("mp-to-dp");
  dp.set_override("train.steps=10");
  dp.set_override("parallel.dp=2");
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(dp, resume);

  const std::vector<double> want = losses(*dir_ / "mp-to-dp-reference" / "metrics.jsonl");
  ASSERT_EQ(want.size(), 10u);
  expect_losses_near(losses(*dir_ / "mp-to-dp" / "metrics.jsonl"), want, 1e-5);
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "mp-to-dp"));
  EXPECT_EQ(info.fields.at("layout").at("dp"), 2);
  EXPECT_EQ(info.fields.at("layout").at("tp"), 1);
}

TEST_F(MainJob, CorruptOrIncompleteCheckpointsAreRefusedByName) {
  Config c = config("corrupt");
  c.set_override("train.keep_last=0");
  RunOptions stop = quiet();
  stop.stop_after = 10;
  run_training(c, stop);
  const fs::path ckpt = *dir_ / "corrupt" / "step_00000010";
  {
    std::fstream f(ckpt / "rank_00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  RunOptions resume = quiet();
  resume.resume = true;
  EXPECT_CONTAINS(error_of([&] { run_training(c, resume); }), "rank_00000.safetensors");
  // The earlier checkpoint is untouched and still loads.
  GPT model(model_config_from(c));
  ParamStore ps(model.layout(), 0);
  const fs::path earlier = *dir_ / "corrupt" / "step_00000005";
  load_weights(read_checkpoint_info(earlier), model, ps);

  fs::remove(earlier / "rank_00000.safetensors");
  EXPECT_CONTAINS(error_of([&] { read_checkpoint_info(earlier); }), "rank_00000.safetensors");
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
  Config rms = config("other");
  rms.set_override("model.norm=rmsnorm");
  EXPECT_CONTAINS(error_of([&] { run_training(rms, resume); }), "the config asks for");
}

TEST_F(MainJob, FreshRunRefusesAnOutDirHoldingARunUnlessOverwritten) {
  Config first = config("taken");
  first.set_override("train.steps=10");
  run_training(first, quiet());
  const fs::path out = *dir_ / "taken";
  const auto before = testing::tree_contents(out);
  const std::vector<double> first_losses = losses(out / "metrics.jsonl");
  ASSERT_EQ(first_losses.size(), 10u);
  Config again = config("taken");
  again.set_override("train.steps=10");
  const std::string message = error_of([&] { run_training(again, quiet()); });
  for (const std::string& part : {out.string(), std::string("step 10"), std::string("--resume"),
                                  std::string("train.out_dir"), std::string("--overwrite")})
    EXPECT_CONTAINS(message, part);
  EXPECT_EQ(testing::tree_contents(out), before) << "a refused run changed the old run's files";

  RunOptions both = quiet();
  both.resume = both.overwrite = true;
  EXPECT_CONTAINS(error_of([&] { run_training(again, both); }), "only one");

  // --overwrite: the old run's checkpoints and metrics go, the new run's alone remain.
  RunOptions overwrite = quiet();
  overwrite.overwrite = true;
  overwrite.stop_after = 5;
  run_training(again, overwrite);
  const std::vector<CheckpointEntry> steps = list_checkpoints(out);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].step, 5);
  EXPECT_EQ(read_latest(out), steps[0].path);
  // A fresh start from the same seed: the first run's first five steps, not appended to its ten.
  EXPECT_EQ(losses(out / "metrics.jsonl"), std::vector<double>(first_losses.begin(), first_losses.begin() + 5));
}

TEST_F(MainJob, OutDirWithUnrelatedFilesOrOnlyALatestPointer) {
  const fs::path out = *dir_ / "notes";
  fs::create_directories(out);
  std::ofstream(out / "notes.txt") << "mine";
  Config c = config("notes");
  c.set_override("train.steps=5");
  run_training(c, quiet());
  EXPECT_EQ(read_latest(out), out / checkpoint_dir_name(5));
  fs::remove_all(out / checkpoint_dir_name(5));
  EXPECT_CONTAINS(error_of([&] { run_training(c, quiet()); }), "'latest' pointer");
}

TEST_F(MainJob, DataTextOtherThanThePreparedDatasetsIsRefused) {
  const fs::path data = *dir_ / "data";
  const auto before = testing::tree_contents(data);
  const fs::path other = dir_->write("other.txt", "Some other text, not the corpus.\n");
  Config c = config("other-text");
  c.set_override("data.text=" + other.string());
  const std::string message = error_of([&] { run_training(c, quiet()); });
  for (const fs::path& part : {other, *dir_ / "corpus.txt", data}) EXPECT_CONTAINS(message, part.string());
  EXPECT_CONTAINS(message, "new directory");
  EXPECT_CONTAINS(message, "delete");
  EXPECT_EQ(testing::tree_contents(data), before) << "a refused run changed the prepared dataset";
  EXPECT_FALSE(fs::exists(*dir_ / "other-text")) << "a refused run created train.out_dir";

  // --overwrite deletes an old run only once the new one has passed its checks.
  Config keep = config("kept");
  keep.set_override("train.steps=5");
  run_training(keep, quiet());
  const auto kept = testing::tree_contents(*dir_ / "kept");
  keep.set_override("data.text=" + other.string());
  RunOptions overwrite = quiet();
  overwrite.overwrite = true;
  EXPECT_CONTAINS(error_of([&] { run_training(keep, overwrite); }), other.string());
  EXPECT_EQ(testing::tree_contents(*dir_ / "kept"), kept) << "a refused --overwrite deleted the old run";
}

TEST_F(MainJob, SameTextElsewhereOrADatasetWithoutSourceHashesIsAccepted) {
  const fs::path copy = *dir_ / "copy" / "corpus-again.txt";
  fs::create_directories(copy.parent_path());
  fs::copy_file(*dir_ / "corpus.txt", copy);
  Config same = config("same-text");
  same.set_override("train.steps=2");
  same.set_override("data.text=" + copy.string());
  EXPECT_GT(run_training(same, quiet()).final_eval.tokens, 0);

  // A dataset prepared before the hashes were recorded is used as it is.
  const fs::path legacy = *dir_ / "legacy-data";
  fs::copy(*dir_ / "data", legacy, fs::copy_options::recursive);
  nlohmann::json j = nlohmann::json::parse(read_file(legacy / "dataset.json"));
  ASSERT_TRUE(j.contains("sources_sha256"));
  j.erase("sources_sha256");
  write_file_atomic(legacy / "dataset.json", j.dump(2));
  Config old = config("legacy-data-run");
  old.set_override("train.steps=2");
  old.set_override("data.dir=" + legacy.string());
  old.set_override("data.text=" + dir_->write("unrelated.txt", "Not the corpus.\n").string());
  EXPECT_GT(run_training(old, quiet()).final_eval.tokens, 0);
}

TEST_F(MainJob, LlamaRunRecordsItsVariantsAndResumes) {
  Config c = config("llama");
  for (const char* o : {"model.norm=rmsnorm", "model.positions=rope", "model.rope_scaling=linear",
                        "model.rope_scaling_factor=2", "model.mlp=swiglu", "model.intermediate_size=80",
                        "model.n_kv_head=1", "model.packed_qkv=false", "model.attention_bias=false",
                        "model.mlp_bias=false", "model.tied_embeddings=false"})
    c.set_override(o);
  RunOptions stop = quiet();
  stop.stop_after = 5;
  run_training(c, stop);
  const GPTConfig want = plan_training(c).model;
  const GPTConfig saved = checkpoint_model_config(read_checkpoint_info(resolve_checkpoint(*dir_ / "llama")));
  EXPECT_EQ(saved.norm, want.norm);
  EXPECT_EQ(saved.positions, want.positions);
  EXPECT_EQ(saved.rope_scaling.type, want.rope_scaling.type);
  EXPECT_EQ(saved.rope_scaling.factor, want.rope_scaling.factor);
  EXPECT_EQ(saved.mlp, want.mlp);
  EXPECT_EQ(saved.intermediate(), want.intermediate());
  EXPECT_EQ(saved.kv_heads(), want.kv_heads());
  EXPECT_EQ(saved.packed_qkv, want.packed_qkv);
  EXPECT_EQ(saved.attention_bias, want.attention_bias);
  EXPECT_EQ(saved.tied_embeddings, want.tied_embeddings);
  EXPECT_EQ(saved.num_params(), want.num_params());
  // The checkpoint loads as the same model and samples through the KV cache.
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(*dir_ / "llama"));
  GPT model(checkpoint_model_config(info));
  ParamStore ps(model.layout(), 0);
  load_weights(info, model, ps);
  const Tokenizer tok = Tokenizer::load(info.fields.at("tokenizer").get<std::string>());
  const std::string sample = generate(model, ps, tok, "ROMEO:", 20, SampleOptions{});
  EXPECT_FALSE(sample.empty());
  EXPECT_EQ(sample, generate(model, ps, tok, "ROMEO:", 20, SampleOptions{}));
  RunOptions resume = quiet();
  resume.resume = true;
  run_training(c, resume);
  const std::vector<double> l = losses(*dir_ / "llama" / "metrics.jsonl");
  ASSERT_EQ(l.size(), 20u);
  EXPECT_LT(l.back(), l.front());
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
  export_hf(model, ps, *dir_ / "hf");
  SafetensorsReader r(*dir_ / "hf" / "model.safetensors");
  EXPECT_EQ(r.entries().size(), model.layout().params().size());
  const int fc = model.layout().find("h.0.mlp.c_fc.weight");
  const auto& e = r.entry("transformer.h.0.mlp.c_fc.weight");
  EXPECT_EQ(e.shape, (Shape{8, 32}));  // [in, out]
  Tensor t = r.load("transformer.h.0.mlp.c_fc.weight");
  const float* src = ps.param(fc).data<float>();  // [out, in]
  for (int64_t o = 0; o < 32; ++o)
    for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(t.data<float>()[i * 32 + o], src[o * 8 + i]);
  EXPECT_EQ(r.entry("transformer.wte.weight").shape, (Shape{11, 8}));
  EXPECT_EQ(r.entry("transformer.h.0.ln_1.bias").shape, (Shape{8}));
  nlohmann::json j = nlohmann::json::parse(read_file(*dir_ / "hf" / "config.json"));
  EXPECT_EQ(j.at("model_type"), "gpt2");
  EXPECT_EQ(j.at("n_positions"), 6);
  cfg.norm = NormKind::rmsnorm;
  GPT rms(cfg);
  ParamStore rms_params(rms.layout(), 3);
  // RMSNorm with GPT-2's other variants is neither architecture.
  EXPECT_CONTAINS(error_of([&] { export_hf(rms, rms_params, *dir_ / "hf-rms"); }), "mixes their variants");
}

TEST_F(MainJob, ARunStartsFromAnExportedCheckpointWithItsTokenizer) {
  Config a = config("hf-source");
  a.set_override("train.steps=5");
  const EvalResult source = run_training(a, quiet()).final_eval;
  // `loom export`: the weights, and the tokenizer beside them.
  const CheckpointWeights w(*dir_ / "hf-source");
  const fs::path hf = *dir_ / "hf-export";
  export_hf(w.model, w.ps, hf);
  const fs::path tokenizer = w.info.fields.at("tokenizer").get<std::string>();
  fs::copy_file(tokenizer, hf / tokenizer.filename());

  // With no learning rate the imported weights stay as they are: the final
  // validation is the source run's.
  for (const char* tp : {"1", "2"}) {
    Config b = config(str("hf-import-tp", tp));
    b.set_override(str("init.from=hf:", hf.string()));
    b.set_override(str("parallel.tp=", tp));
    b.set_override("train.steps=2");
    b.set_override("train.lr=0");
    b.set_override("train.min_lr=0");
    const EvalResult imported = run_training(b, quiet()).final_eval;
    if (std::string(tp) == "1")
      EXPECT_EQ(imported.loss_per_token, source.loss_per_token);
    else
      EXPECT_NEAR(imported.loss_per_token, source.loss_per_token, 1e-5 * source.loss_per_token);
  }
  // A model key that contradicts config.json stops the run before it starts.
  Config wider = config("hf-wider");
  wider.set_override(str("init.from=hf:", hf.string()));
  wider.set_override("model.n_embd=64");
  EXPECT_CONTAINS(error_of([&] { run_training(wider, quiet()); }), "model.n_embd");
}

// `loom prune`'s checkpoint as init.from: the run keeps the pruned weights
// zero (AdamWConfig::keep_zeros from its manifest) and its own checkpoints
// say what was pruned; tensor parallelism changes neither.
TEST_F(MainJob, FineTuningAPrunedCheckpointKeepsItsZeros) {
  Config a = config("prune-source");
  a.set_override("train.steps=5");
  run_training(a, quiet());
  CheckpointWeights w(*dir_ / "prune-source");
  const PruneOptions o{.sparsity = 0.5};
  const PruneReport r = prune_model(w.model, w.ps, o);
  write_pruned_checkpoint(*dir_ / "pruned", w.model, w.ps, o, r,
                          {"prune-source", w.info.fields.at("tokenizer").get<std::string>(),
                           w.info.fields.at("tokenizer_sha256").get<std::string>()});
  std::vector<std::string> names;
  for (const PruneReport::Matrix& m : r.matrices) names.push_back(m.name);
  const Tensor pruned = w.ps.flat();
  std::vector<double> tp_losses[2];
  for (int tp : {1, 2}) {
    const std::string out = str("pruned-finetune-tp", tp);
    Config b = config(out);
    b.set_override(str("init.from=", (*dir_ / "pruned").string()));
    b.set_override(str("parallel.tp=", tp));
    b.set_override("train.steps=6");
    EXPECT_EQ(plan_training(b).options.adamw.keep_zeros, names);
    run_training(b, quiet());
    tp_losses[tp - 1] = losses(*dir_ / out / "metrics.jsonl");
    const CheckpointWeights after(*dir_ / out);
    EXPECT_EQ(pruned_params(after.info), names);
    int64_t zeros = 0, kept = 0, moved = 0;
    for (int id : prunable_params(w.model.layout())) {
      const ParamSpec& p = w.model.layout().param(id);
      for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
        const float before = pruned.data<float>()[i], now = after.ps.flat().data<float>()[i];
        zeros += before == 0.0f;
        kept += before == 0.0f && now == 0.0f;
        moved += before != now;
      }
    }
    EXPECT_EQ(kept, zeros) << "tp " << tp;
    EXPECT_GT(moved, zeros / 2) << "tp " << tp << ": the other weights train";
  }
  expect_losses_near(tp_losses[0], tp_losses[1], 1e-4);
}

TEST_F(MainJob, GenerationIsSeededAndEvaluationReportsPerCharLoss) {
  Config c = config("gen");
  c.set_override("train.steps=5");
  const EvalResult final_eval = run_training(c, quiet()).final_eval;
  CheckpointWeights w(*dir_ / "gen");
  const CheckpointInfo& info = w.info;
  GPT& model = w.model;
  ParamStore& ps = w.ps;
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

// `loom quantize` and `loom prune` with --data report the compressed model's
// size, the loss and perplexity before and after and their change: the loss
// before is what `loom eval` measures of the source checkpoint, the loss
// after what it measures of the checkpoint the command wrote.
TEST_F(MainJob, CompressionCommandsReportTheLossesLoomEvalMeasures) {
  train("compress-source", {"train.steps=5"});
  const std::string source = (*dir_ / "compress-source").string(), val = (*dir_ / "data" / "val.bin").string();
  auto loom = [](const std::string& args) {
    const std::string command = str(LOOM_CLI, " ", args, " 2>&1");
    FILE* pipe = popen(command.c_str(), "r");
    EXPECT_NE(pipe, nullptr) << command;
    std::string out;
    char buf[4096];
    while (pipe && fgets(buf, sizeof buf, pipe)) out += buf;
    EXPECT_EQ(pipe ? pclose(pipe) : -1, 0) << command << "\n" << out;
    return out;
  };
  auto eval_loss = [&](const std::string& checkpoint) {
    const std::string out = loom(str("eval --checkpoint ", checkpoint, " --data ", val));
    double loss = 0;
    EXPECT_EQ(std::sscanf(out.c_str(), "loss %lf nats/token", &loss), 1) << out;
    return loss;
  };
  const double before = eval_loss(source);
  const std::vector<std::pair<std::string, std::string>> commands = {
      {"quantize --method int8", "int8"},
      {"prune --method wanda --sparsity 0.5", "wanda"},
      {"prune --method channels --sparsity 0.5", "channels"}};
  for (const auto& [args, name] : commands) {
    SCOPED_TRACE(args);
    const fs::path out = *dir_ / ("compressed-" + name);
    const std::string report = loom(str(args, " --checkpoint ", source, " --data ", val, " --out ", out.string()));
    // The size: quantize's weight bytes, prune's nonzero parameters and dense f32 megabytes.
    EXPECT_TRUE(report.find(" bytes, ") != std::string::npos || report.find(" MB dense f32") != std::string::npos)
        << report;
    const size_t at = report.find("\nloss ");
    ASSERT_NE(at, std::string::npos) << report;
    double l0 = 0, l1 = 0, change = 0, p0 = 0, p1 = 0, ppl_change = 0;
    long long tokens = 0;
    ASSERT_EQ(std::sscanf(report.c_str() + at + 1,
                          "loss %lf -> %lf nats/token (%lf%%), perplexity %lf -> %lf (%lf%%) over %lld tokens", &l0,
                          &l1, &change, &p0, &p1, &ppl_change, &tokens),
              7)
        << report;
    EXPECT_EQ(l0, before);  // both printed to 6 decimals from the same evaluation
    EXPECT_EQ(l1, eval_loss(out.string()));
    EXPECT_NE(l1, l0) << "compression changes the loss";
    EXPECT_NEAR(p0, std::exp(l0), 1e-4 * p0);
    EXPECT_NEAR(p1, std::exp(l1), 1e-4 * p1);
    EXPECT_NEAR(change, 100.0 * (l1 / l0 - 1.0), 1e-3);
    EXPECT_NEAR(ppl_change, 100.0 * (p1 / p0 - 1.0), 1e-3);
    EXPECT_GT(tokens, 0);
  }
}

// A traced run's timeline on every layout: each rank has a step span per
// traced step, the step's direct children (idle included) tile it, and rank
// 0's step span measures the step time the run logs itself.
TEST_F(MainJob, TraceTimelineTilesEveryRanksStepsAndMatchesTheLoggedStepTime) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"trace_single", {}},
      {"trace_dp2", {"parallel.dp=2"}},
      {"trace_pp2", {"parallel.pp=2"}},
      {"trace_tp2", {"parallel.tp=2"}}};
  for (const auto& [out, layout] : layouts) {
    SCOPED_TRACE(out);
    const fs::path path = *dir_ / (out + ".json");
    Config c = config(out);
    // Steps of tens of milliseconds, so that a loaded machine's scheduling
    // delays stay well inside 5%, and no checkpoint or validation between
    // the traced steps.
    for (const std::string& o : {std::string("model.n_embd=256"), std::string("model.n_head=4"),
                                 std::string("train.batch_size=16"), std::string("train.steps=5"),
                                 std::string("train.checkpoint_interval=0"), "trace.path=" + path.string(),
                                 std::string("trace.steps=2-4")})
      c.set_override(o);
    for (const std::string& o : layout) c.set_override(o);
    run_training(c, quiet());
    const int ranks = layout.empty() ? 1 : 2;

    // The run's own step time: tokens per step over its logged throughput.
    const double tokens = static_cast<double>(c.get<int64_t>("train.batch_size") * c.get<int64_t>("train.seq_len"));
    std::map<int64_t, double> logged_us;
    for (const nlohmann::json& r : step_records(*dir_ / out / "metrics.jsonl"))
      logged_us[r.at("step").get<int64_t>()] = tokens / r.at("tokens_per_s").get<double>() * 1e6;

    const nlohmann::json trace = nlohmann::json::parse(read_file(path));
    std::map<int, std::map<std::string, std::pair<double, double>>> steps;  // rank -> name -> (ts, dur)
    std::map<int, std::map<std::string, double>> children;                   // rank -> step -> summed dur
    std::set<std::string> categories;
    for (const nlohmann::json& e : trace.at("traceEvents"))
      if (e.at("ph") == "X" && e.at("cat") == "step")
        steps[e.at("pid").get<int>()][e.at("name").get<std::string>()] = {e.at("ts").get<double>(),
                                                                          e.at("dur").get<double>()};
    for (const nlohmann::json& e : trace.at("traceEvents")) {
      if (e.at("ph") != "X" || e.at("args").at("depth") != 1) continue;
      categories.insert(e.at("cat").get<std::string>());
      const double ts = e.at("ts").get<double>();
      for (const auto& [name, span] : steps[e.at("pid").get<int>()])
        if (ts >= span.first && ts < span.first + span.second)
          children[e.at("pid").get<int>()][name] += e.at("dur").get<double>();
    }
    ASSERT_EQ(static_cast<int>(steps.size()), ranks);
    for (const char* cat : {"compute", "optimizer", "data"}) EXPECT_TRUE(categories.count(cat)) << cat;
    if (ranks > 1) {
      EXPECT_TRUE(categories.count("communication"));
    }
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(steps[r].size(), 3u) << "rank " << r;
      for (int64_t n = 2; n <= 4; ++n) {
        const std::string name = str("step ", n);
        ASSERT_TRUE(steps[r].count(name)) << "rank " << r << " " << name;
        const double dur = steps[r][name].second;
        EXPECT_NEAR(children[r][name], dur, 0.05 * dur) << "rank " << r << " " << name;
        // The logged step time is rank 0's clock; another rank's step starts
        // when the scheduler wakes it from the barrier, which on a loaded
        // machine is a tick or two later.
        if (r == 0) {
          EXPECT_NEAR(dur, logged_us.at(n), 0.05 * logged_us.at(n)) << name;
        }
      }
    }
  }
}

// The records of metrics.jsonl that have `key`.
std::vector<nlohmann::json> records_with(const fs::path& metrics, const char* key) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j);
  }
  return out;
}

// Two runs' latest checkpoints hold the same weights, bit for bit.
void expect_same_weights(const fs::path& a, const fs::path& b) {
  const CheckpointWeights wa(a), wb(b);
  EXPECT_EQ(wa.info.step, wb.info.step);
  EXPECT_TRUE(testing::bit_equal(wa.ps.flat(), wb.ps.flat()));
}

// Starts `loom train` (LOOM_CLI) with the suite's data, `out` as
// train.out_dir and `sets` on top, its output to `log`; returns its pid.
pid_t spawn_loom_train(const fs::path& data_dir, const fs::path& out, const std::vector<std::string>& sets,
                       const std::vector<std::string>& extra, const std::string& log) {
  std::vector<std::string> args = {LOOM_CLI, "train", "--config", LOOM_SOURCE_DIR "/configs/tiny-test.toml"};
  std::vector<std::string> all = {"data.dir=" + (data_dir / "data").string(),
                                  "data.text=" + (data_dir / "corpus.txt").string(), "train.out_dir=" + out.string(),
                                  "train.eval_interval=0", "train.sample_tokens=0"};
  all.insert(all.end(), sets.begin(), sets.end());
  for (const std::string& o : all) args.insert(args.end(), {"--set", o});
  args.insert(args.end(), extra.begin(), extra.end());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

TEST_F(MainJob, SignalStopsEveryRankAfterTheSameStepWithACheckpointAndResumesBitExactly) {
  // Two rank threads (data-parallel, or two pipeline stages); the second to
  // finish step 7 raises the signal on its own thread once the first has gone
  // on to read the flag (still unset), so only the ranks' agreement stops
  // both after step 7.
  const std::vector<std::tuple<std::string, std::vector<std::string>, int>> cases = {
      {"sig-dp2", {"parallel.dp=2", "zero.stage=1"}, SIGTERM}, {"sig-pp2", {"parallel.pp=2"}, SIGINT}};
  for (const auto& [out, layout, signal] : cases) {
    SCOPED_TRACE(out);
    const std::string name = signal == SIGINT ? "SIGINT" : "SIGTERM";
    Config whole_run = config(out + "-whole"), c = config(out);
    for (Config* k : {&whole_run, &c}) {
      for (const std::string& o : layout) k->set_override(o);
      k->set_override("train.steps=12");
    }
    run_training(whole_run, quiet());
    const std::vector<double> whole = losses(*dir_ / (out + "-whole") / "metrics.jsonl");
    ASSERT_EQ(whole.size(), 12u);

    struct sigaction before {};
    sigaction(signal, nullptr, &before);
    RunOptions stop = quiet();
    std::atomic<int> finished{0};
    stop.after_step = [&](int64_t step) {
      if (step != 7 || finished.fetch_add(1) == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      raise(signal);
    };
    const RunResult stopped = run_training(c, stop);
    EXPECT_EQ(stopped.stop_signal, signal);
    EXPECT_EQ(stopped.steps_done, 7);
    // The handler the process had is back.
    struct sigaction after {};
    sigaction(signal, nullptr, &after);
    EXPECT_EQ(after.sa_handler, before.sa_handler);

    // Step 7 is no checkpoint step (every 5): the stop wrote it.
    const fs::path run = *dir_ / out;
    EXPECT_EQ(read_latest(run)->filename(), "step_00000007");
    EXPECT_EQ(read_checkpoint_info(run / "step_00000007").step, 7);
    const std::vector<nlohmann::json> stops = records_with(run / "metrics.jsonl", "stopped_by");
    ASSERT_EQ(stops.size(), 1u);
    EXPECT_EQ(stops[0].at("step"), 7);
    EXPECT_EQ(stops[0].at("stopped_by"), name);
    EXPECT_EQ(stops[0].at("checkpoint"), "step_00000007");
    EXPECT_EQ(losses(run / "metrics.jsonl").size(), 7u);

    RunOptions resume = quiet();
    resume.resume = true;
    const RunResult resumed = run_training(c, resume);
    EXPECT_EQ(resumed.stop_signal, 0);
    EXPECT_EQ(resumed.steps_done, 12);
    EXPECT_GT(resumed.final_eval.tokens, 0);
    const std::vector<double> continued = losses(run / "metrics.jsonl");
    ASSERT_EQ(continued.size(), 12u);
    for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(continued[i], whole[i]) << "step " << i + 1;
    expect_same_weights(*dir_ / (out + "-whole"), run);
  }
}

// `loom train` as a child process: a SIGTERM once training is under way ends
// it with kPreemptedExitStatus and a checkpoint of the step it stopped
// after; `loom train --resume` finishes the run as if never stopped. The
// learning rate is constant after warm-up (train.min_lr = train.lr), so the
// schedule does not depend on train.steps: the run is set far longer than it
// can get before the signal, whenever that comes, and is resumed to end 5
// steps after the stop, as a run of that length does in one go.
TEST_F(MainJob, TheCommandExitsWithThePreemptedStatusOnSigtermAndResumes) {
  const std::vector<std::string> layout = {"parallel.dp=2", "train.lr=1e-3", "train.min_lr=1e-3",
                                           "train.checkpoint_interval=0"};
  const fs::path run = *dir_ / "cli-run";
  // `loom train` with config("cli-run")'s settings, `layout` and `extra`:
  // its exit status (128 + the signal if one ended it).
  auto loom_train = [&](const std::vector<std::string>& extra, bool terminate_once_training) {
    const std::string log = (*dir_ / "cli.log").string();
    const pid_t pid = spawn_loom_train(dir_->path(), run, layout, extra, log);
    if (terminate_once_training) {
      // The first step's record says training is under way.
      auto training = [&] {
        std::error_code ec;
        return fs::exists(run / "metrics.jsonl", ec) &&
               read_file(run / "metrics.jsonl").find("\"loss\"") != std::string::npos;
      };
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!training() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      kill(pid, SIGTERM);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  };

  ASSERT_EQ(loom_train({"--set", "train.steps=1000000"}, true), kPreemptedExitStatus)
      << read_file(*dir_ / "cli.log");
  const std::vector<nlohmann::json> stops = records_with(run / "metrics.jsonl", "stopped_by");
  ASSERT_EQ(stops.size(), 1u);
  const int64_t step = stops[0].at("step").get<int64_t>();
  EXPECT_EQ(stops[0].at("stopped_by"), "SIGTERM");
  EXPECT_EQ(read_latest(run)->filename(), checkpoint_dir_name(step));
  EXPECT_EQ(static_cast<int64_t>(losses(run / "metrics.jsonl").size()), step);
  EXPECT_NE(read_file(*dir_ / "cli.log").find(str("stopped by SIGTERM after step ", step)), std::string::npos);

  const std::string steps = str("train.steps=", step + 5);
  ASSERT_EQ(loom_train({"--set", steps, "--resume"}, false), 0) << read_file(*dir_ / "cli.log");
  Config c = config("cli-whole");
  for (const std::string& o : layout) c.set_override(o);
  c.set_override(steps);
  run_training(c, quiet());
  const std::vector<double> whole = losses(*dir_ / "cli-whole" / "metrics.jsonl");
  const std::vector<double> continued = losses(run / "metrics.jsonl");
  ASSERT_EQ(whole.size(), static_cast<size_t>(step + 5));
  ASSERT_EQ(continued.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(continued[i], whole[i]) << "step " << i + 1;
  expect_same_weights(*dir_ / "cli-whole", run);
}

// The child process of the `loom train --max-restarts` supervisor, once the
// run has logged `step` (0 if that does not happen within two minutes).
pid_t child_once_logged(pid_t supervisor, const fs::path& metrics, int64_t step) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    if (fs::exists(metrics, ec)) {
      const std::vector<nlohmann::json> records = records_with(metrics, "loss");
      if (!records.empty() && records.back().at("step").get<int64_t>() >= step) {
        std::ifstream children(str("/proc/", supervisor, "/task/", supervisor, "/children"));
        pid_t child = 0;
        if (children >> child) return child;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return 0;
}

// `loom train --max-restarts 2` on four ranks (two data-parallel replicas of
// a model split over two tensor-parallel ranks): the run's process is killed
// with SIGKILL twice, at whatever moment it has reached once step 7 and then
// step 23 are logged; each time the supervisor starts it again from the
// newest checkpoint (every 5 steps), says so and records it. The run
// finishes with the losses (the last record of each step: the steps after a
// checkpoint run again) and the weights of an uninterrupted run, bit for bit.
TEST_F(MainJob, MaxRestartsContinuesAKilledRunFromItsCheckpointBitExactly) {
  const std::vector<std::string> layout = {"parallel.dp=2", "parallel.tp=2", "train.steps=40"};
  const fs::path run = *dir_ / "restarted";
  std::vector<std::string> sets = layout;
  sets.push_back("train.checkpoint_interval=5");
  const std::string log = (*dir_ / "restarts.log").string();
  const pid_t supervisor = spawn_loom_train(dir_->path(), run, sets, {"--max-restarts", "2"}, log);
  for (int64_t step : {7, 23}) {
    const pid_t child = child_once_logged(supervisor, run / "metrics.jsonl", step);
    ASSERT_GT(child, 0) << read_file(log);
    kill(child, SIGKILL);
  }
  int status = 0;
  waitpid(supervisor, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(log);

  const std::vector<nlohmann::json> restarts = records_with(run / "metrics.jsonl", "restart");
  ASSERT_EQ(restarts.size(), 2u) << read_file(log);
  for (size_t i = 0; i < restarts.size(); ++i) {
    EXPECT_EQ(restarts[i].at("restart"), static_cast<int>(i) + 1);
    EXPECT_EQ(restarts[i].at("cause"), "killed by SIGKILL");
    EXPECT_EQ(restarts[i].at("resume_step").get<int64_t>() % 5, 0);
  }
  EXPECT_NE(read_file(log).find("the run killed by SIGKILL; restart 2 of 2 from step"), std::string::npos);

  Config c = config("restarted-whole");
  for (const std::string& o : layout) c.set_override(o);
  run_training(c, quiet());
  EXPECT_EQ(last_losses(run / "metrics.jsonl"), losses(*dir_ / "restarted-whole" / "metrics.jsonl"));
  expect_same_weights(*dir_ / "restarted-whole", run);
}

// `--max-restarts 1 --elastic`: a run on 4 data-parallel ranks is killed
// once step 7 is logged and continues on 3 (12 sequences a step: 3 micro-
// batches per rank, then 4), as if the failed rank's machine were gone. The
// same sequences make each step, so the losses stay within 1e-5 of the
// uninterrupted 4-rank run's (the gradients are summed in another order).
TEST_F(MainJob, ElasticRestartContinuesOnFewerDataParallelRanks) {
  const std::vector<std::string> layout = {"parallel.dp=4", "train.batch_size=12", "train.micro_batch_size=1",
                                           "train.steps=20", "train.checkpoint_interval=5"};
  const fs::path run = *dir_ / "elastic";
  const std::string log = (*dir_ / "elastic.log").string();
  const pid_t supervisor = spawn_loom_train(dir_->path(), run, layout, {"--max-restarts", "1", "--elastic"}, log);
  const pid_t child = child_once_logged(supervisor, run / "metrics.jsonl", 7);
  ASSERT_GT(child, 0) << read_file(log);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(supervisor, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(log);
  const std::vector<nlohmann::json> restarts = records_with(run / "metrics.jsonl", "restart");
  ASSERT_EQ(restarts.size(), 1u);
  EXPECT_EQ(restarts[0].at("dp"), 3);
  EXPECT_NE(read_file(log).find("on 3 data-parallel ranks"), std::string::npos) << read_file(log);

  Config c = config("elastic-whole");
  for (const std::string& o : layout) c.set_override(o);
  run_training(c, quiet());
  const std::vector<double> restarted = last_losses(run / "metrics.jsonl");
  const std::vector<double> whole = losses(*dir_ / "elastic-whole" / "metrics.jsonl");
  ASSERT_EQ(restarted.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_NEAR(restarted[i], whole[i], 1e-5 * whole[i]) << "step " << i + 1;
}

// `loom train --max-restarts 2` under parallel.backend = "mpi", run outside
// mpirun: the supervisor starts mpirun with four ranks (dp2 x tp2;
// LOOM_MPIRUN carries its flags); one rank's process is killed with SIGKILL
// once step 7 is logged and another once step 23 is, mpirun ends the rest,
// and each time the supervisor starts mpirun again from the newest
// checkpoint. The losses and weights equal an uninterrupted run's bit for
// bit: the local backend's on the same four ranks (every reduction a sum of
// two, which no backend can order differently).
TEST_F(MainJob, MaxRestartsStartsMpirunAgainWhenAnMpiRankIsKilled) {
  if (!mpi_available()) GTEST_SKIP() << "the mpi backend is not in this build";
  const std::vector<std::string> layout = {"parallel.dp=2", "parallel.tp=2", "train.steps=40"};
  std::vector<std::string> sets = layout;
  sets.insert(sets.end(), {"parallel.backend=mpi", "train.checkpoint_interval=5"});
  const fs::path run = *dir_ / "mpi-restarted";
  const std::string log = (*dir_ / "mpi-restarts.log").string();
  // As ctest's MPI tests run (tests/CMakeLists.txt): as root in CI, without
  // cross-process memory copies. Under the sanitizers' build, OpenMPI's
  // allocations still held at exit would be reported as leaks and fail the
  // ranks' exit status: the MPI processes run without leak detection.
  setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  setenv("LOOM_MPIRUN", "mpirun --oversubscribe", 1);
  const pid_t supervisor = spawn_loom_train(dir_->path(), run, sets, {"--max-restarts", "2"}, log);
  for (const auto& [step, which] : {std::pair{7, 0}, std::pair{23, 3}}) {
    const pid_t mpirun = child_once_logged(supervisor, run / "metrics.jsonl", step);
    ASSERT_GT(mpirun, 0) << read_file(log);
    std::vector<pid_t> ranks;
    std::ifstream children(str("/proc/", mpirun, "/task/", mpirun, "/children"));
    for (pid_t rank = 0; children >> rank;) ranks.push_back(rank);
    ASSERT_EQ(ranks.size(), 4u) << "mpirun's rank processes: " << read_file(log);
    kill(ranks[static_cast<size_t>(which)], SIGKILL);
  }
  int status = 0;
  waitpid(supervisor, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(log);
  const std::vector<nlohmann::json> restarts = records_with(run / "metrics.jsonl", "restart");
  ASSERT_EQ(restarts.size(), 2u) << read_file(log);
  for (const nlohmann::json& r : restarts) EXPECT_EQ(r.at("resume_step").get<int64_t>() % 5, 0);
  EXPECT_NE(read_file(log).find("restart 2 of 2 from step"), std::string::npos) << read_file(log);

  Config c = config("mpi-restarted-whole");
  for (const std::string& o : layout) c.set_override(o);
  run_training(c, quiet());
  EXPECT_EQ(last_losses(run / "metrics.jsonl"), losses(*dir_ / "mpi-restarted-whole" / "metrics.jsonl"));
  expect_same_weights(*dir_ / "mpi-restarted-whole", run);
}

// Data gone bad mid-run: a run on two data-parallel ranks resumes on a
// dataset of symbols Shakespeare never uses (the same tokenizer), so every
// step's loss spikes past train.skip_spike_factor times the running mean
// carried over in the checkpoint (by about 1.7x: the model has learnt the
// text's tokens, and those symbols are none of them). The first spike is skipped, said and
// recorded; the second in a row (train.max_skipped_steps = 2) stops the run
// with an error, and the checkpoint it resumed from stays the latest, intact.
TEST_F(MainJob, DivergingStepsAreSkippedAndTooManyInARowStopTheRun) {
  const std::initializer_list<std::string> layout = {
      "parallel.dp=2", "train.lr=1e-2", "train.steps=30", "train.checkpoint_interval=0",
      "train.max_skipped_steps=2", "train.skip_spike_factor=1.3"};
  Config c = config("spike");
  for (const std::string& o : layout) c.set_override(o);
  RunOptions stop = quiet();
  stop.stop_after = 20;
  run_training(c, stop);
  const fs::path run = *dir_ / "spike";
  EXPECT_TRUE(records_with(run / "metrics.jsonl", "skip").empty());

  std::string symbols;
  uint64_t x = 7;
  for (int i = 0; i < 40000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    symbols += "#@%&*~^|<>{}[]$_=+"[(x >> 33) % 18];
    if (i % 60 == 59) symbols += '\n';
  }
  PrepareOptions po;
  po.inputs = {dir_->write("symbols.txt", symbols)};
  po.out_dir = *dir_ / "symbols-data";
  po.tokenizer = *dir_ / "data" / "tokenizer.model";
  po.seq_len = 32;
  prepare_dataset(po);
  c.set_override("data.dir=" + (*dir_ / "symbols-data").string());
  c.set_override("data.text=");
  RunOptions resume = quiet();
  resume.resume = true;
  const std::string e = error_of([&] { run_training(c, resume); });
  EXPECT_NE(e.find("step 22: 2 diverging steps in a row skipped (train.max_skipped_steps = 2), the last for its "
                   "loss spike"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("train.skip_spike_factor"), std::string::npos) << e;

  const std::vector<nlohmann::json> skipped = records_with(run / "metrics.jsonl", "skip");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].at("step"), 21);
  EXPECT_EQ(skipped[0].at("skip"), "loss spike");
  EXPECT_GT(skipped[0].at("loss").get<double>(), 1.3 * skipped[0].at("loss_mean").get<double>());
  // The running mean is the one the first run ended with: its last ten steps'.
  const std::vector<double> before = losses(run / "metrics.jsonl");
  ASSERT_EQ(before.size(), 21u);
  double mean = 0.0;
  for (size_t i = 0; i < 20; ++i) mean += (before[i] - mean) / static_cast<double>(std::min<size_t>(i + 1, 10));
  EXPECT_EQ(skipped[0].at("loss_mean").get<double>(), mean);

  EXPECT_EQ(read_latest(run)->filename(), "step_00000020");
  ASSERT_EQ(list_checkpoints(run).size(), 1u);
  const CheckpointInfo info = read_checkpoint_info(run / "step_00000020");  // checksums verified
  EXPECT_EQ(info.fields.at("loss_watch").at("steps"), 20);
  EXPECT_EQ(info.fields.at("loss_watch").at("mean").get<double>(), mean);
}

}  // namespace
}  // namespace loom
