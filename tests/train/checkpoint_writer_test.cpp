// The checkpoint writer: an asynchronous checkpoint holds the state of its
// step while training goes on, and a checkpoint that cannot be written (the
// disk full, here a file-size limit) leaves nothing of itself and the previous
// checkpoint intact, stopping the run or reported as configured.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <csignal>
#include <mutex>

#include "loom/io.h"
#include "loom/train.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::DataParallelRun;
using testing::TempDir;

constexpr int kSteps = 4, kSaveAt = 2;

struct WriterRun {
  std::vector<float> losses;             // rank 0's
  std::vector<CheckpointOutcome> outcomes;  // rank 0's, as reported
  std::string error;                     // what the run threw, if it did
};

// Trains steps [0, kSteps) of `r`. `before_save` runs at kSaveAt before a
// checkpoint is saved there (with a first, good one at step 1); every step
// after polls the writer, which finishes at the end.
WriterRun train(const DataParallelRun& r, const fs::path& root, CheckpointOptions options,
          const std::function<void()>& before_save = {}) {
  WriterRun run;
  std::mutex mu;
  const auto body = [&](Communicator* comm) {
    const GPTConfig cfg = testing::small_gpt(0.0f, r.n_layer, r.n_head);
    const std::unique_ptr<DeviceMesh> mesh = testing::mesh_of(comm, r);
    const std::unique_ptr<Trainer> trainer = mesh ? std::make_unique<Trainer>(cfg, testing::small_options(r), *mesh)
                                                  : std::make_unique<Trainer>(cfg, testing::small_options(r), comm);
    const bool first = !comm || comm->rank() == 0;
    CheckpointWriter writer(root, *trainer, mesh.get(), options, [&](const CheckpointOutcome& c) {
      if (first) run.outcomes.push_back(c);
    });
    const int dp = mesh ? r.dp : comm ? comm->size() : 1;
    const int rank = mesh ? mesh->coord(MeshAxis::dp) : comm ? comm->rank() : 0;
    for (int step = 0; step < kSteps; ++step) {
      const std::vector<int32_t> data = testing::step_tokens(step, cfg.vocab_size);
      const StepStats st = trainer->step(testing::rank_micro_batches(data, dp, rank, r.accumulation));
      if (first) run.losses.push_back(st.loss);
      writer.poll();
      if (step + 1 == 1) writer.save({});
      if (step + 1 == kSaveAt) {
        writer.finish();  // the first one is committed before the disk fills
        if (before_save && (!comm || comm->rank() == 0)) {
          const std::lock_guard lock(mu);
          before_save();
        }
        if (comm) comm->barrier();
        writer.save({});
      }
    }
    writer.finish();
  };
  try {
    if (r.dp == 0)
      body(nullptr);
    else
      run_local(r.dp * r.tp * r.pp, [&](Communicator& c) { body(&c); });
  } catch (const Error& e) {
    run.error = e.what();
  }
  return run;
}

// Files below this size are written, larger ones fail (EFBIG) while it is
// in force: a full disk without privileges. SIGXFSZ, which would end the
// process, is ignored, so the write returns the error.
class FileSizeLimit {
 public:
  FileSizeLimit() {
    getrlimit(RLIMIT_FSIZE, &saved_);
    previous_ = std::signal(SIGXFSZ, SIG_IGN);
  }
  void apply(rlim_t bytes) {
    rlimit l = saved_;
    l.rlim_cur = bytes;
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &l), 0);
  }
  void lift() { setrlimit(RLIMIT_FSIZE, &saved_); }
  ~FileSizeLimit() {
    lift();
    std::signal(SIGXFSZ, previous_);
  }

 private:
  rlimit saved_{};
  void (*previous_)(int) = nullptr;
};

// What is in a run directory: step directories and files, no staging left.
std::vector<std::string> entries(const fs::path& root) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

DataParallelRun dp2_zero3() {
  DataParallelRun r = testing::layout(2, 3);
  r.steps = kSteps;
  return r;
}

TEST(CheckpointWriter, AnAsynchronousCheckpointHoldsTheStateOfItsStep) {
  TempDir sync_root, async_root;
  const WriterRun sync_run = train(dp2_zero3(), sync_root.path(), {.keep_last = 0});
  const WriterRun async = train(dp2_zero3(), async_root.path(), {.keep_last = 0, .async = true});
  ASSERT_TRUE(sync_run.error.empty()) << sync_run.error;
  ASSERT_TRUE(async.error.empty()) << async.error;
  // Training is not disturbed by the writes behind it.
  EXPECT_TRUE(testing::bit_equal(sync_run.losses, async.losses));
  ASSERT_EQ(async.outcomes.size(), 2u);
  for (const CheckpointOutcome& c : async.outcomes) {
    EXPECT_TRUE(c.error.empty()) << c.error;
    // The same bytes as the checkpoint written at once, although the
    // training updated the state while they were written.
    const Manifest a = read_manifest(c.dir), s = read_manifest(sync_root.path() / c.dir.filename());
    ASSERT_EQ(a.files.size(), s.files.size());
    for (const auto& [file, digest] : s.files) EXPECT_EQ(a.files.at(file), digest) << file;
  }
  EXPECT_EQ(async.outcomes[1].step, kSaveAt);
}

// Per format and mode: the checkpoint at kSaveAt fails to be written.
struct FailureCase {
  std::string name;
  CheckpointOptions options;
};

class CheckpointFailure : public ::testing::TestWithParam<FailureCase> {};

TEST_P(CheckpointFailure, LeavesThePreviousCheckpointAndStopsOrIsReported) {
  for (const bool stop : {true, false}) {
    TempDir root;
    CheckpointOptions options = GetParam().options;
    options.stop_on_failure = stop;
    FileSizeLimit limit;
    const WriterRun run = train(dp2_zero3(), root.path(), options, [&] { limit.apply(1024); });
    limit.lift();
    const std::string first = checkpoint_dir_name(1), failed = checkpoint_dir_name(kSaveAt);
    if (stop) {
      EXPECT_CONTAINS(run.error, "checkpoint of step 2 could not be written");
      EXPECT_CONTAINS(run.error, "rank 0");
      EXPECT_CONTAINS(run.error, "train.checkpoint_failure = continue");
    } else {
      EXPECT_TRUE(run.error.empty()) << run.error;
      ASSERT_EQ(run.outcomes.size(), 2u);
      EXPECT_EQ(run.outcomes[1].step, kSaveAt);
      EXPECT_CONTAINS(run.outcomes[1].error, "rank 0");
      EXPECT_EQ(run.losses.size(), static_cast<size_t>(kSteps));  // trained on
    }
    // Nothing of the failed checkpoint, no staging directory; the first one
    // is still the latest, whole and loadable.
    EXPECT_EQ(entries(root.path()), (std::vector<std::string>{"latest", first})) << GetParam().name;
    EXPECT_EQ(resolve_checkpoint(root.path()).filename(), first);
    EXPECT_NO_THROW(read_checkpoint_info(root.path() / first));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, CheckpointFailure,
    ::testing::Values(FailureCase{"sharded", {.keep_last = 0}},
                      FailureCase{"sharded_async", {.keep_last = 0, .async = true}},
                      FailureCase{"single_file", {.keep_last = 0, .format = CheckpointFormat::single_file}}),
    [](const ::testing::TestParamInfo<FailureCase>& info) { return info.param.name; });

}  // namespace
}  // namespace loom
