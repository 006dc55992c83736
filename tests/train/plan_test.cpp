// plan_training: the cross-field rules of data parallelism, ZeRO and mixed
// precision, each error naming the field, the rule and the fix.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>

#include "test_util.h"
#include "loom/comm.h"
#include "loom/config.h"
#include "loom/train.h"

namespace loom {
namespace {

using testing::error_of;

Config tiny(std::initializer_list<const char*> overrides = {}) {
  Config c(loom_schema());
  c.load_toml(LOOM_SOURCE_DIR "/configs/tiny-test.toml");
  for (const char* o : overrides) c.set_override(o);
  return c;
}

// Sets an environment variable for the scope of a test, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(PlanTraining, DefaultsAreTheSingleRankReference) {
  const TrainPlan p = plan_training(tiny());
  EXPECT_EQ(p.dp, 1);
  EXPECT_EQ(p.nproc, 1);
  EXPECT_EQ(p.backend, "local");
  EXPECT_EQ(p.accumulation, 2);  // 4 sequences in micro-batches of 2
  EXPECT_EQ(p.options.zero.stage, 0);
  EXPECT_EQ(p.options.zero.precision, DType::f32);
  EXPECT_TRUE(p.reference());
}

TEST(PlanTraining, DataParallelZeroAndPrecisionFillTheOptions) {
  const TrainPlan p = plan_training(
      tiny({"parallel.dp=2", "zero.stage=3", "precision=bf16", "zero.bucket_mb=3", "train.batch_size=8"}));
  EXPECT_EQ(p.dp, 2);
  EXPECT_EQ(p.nproc, 2);
  EXPECT_EQ(p.accumulation, 2);  // 8 / (2 ranks * 2 per micro-batch)
  EXPECT_EQ(p.options.zero.stage, 3);
  EXPECT_EQ(p.options.zero.precision, DType::bf16);
  EXPECT_EQ(p.options.zero.bucket_bytes, int64_t(3) << 20);
  EXPECT_FALSE(p.reference());

  const TrainPlan h = plan_training(tiny({"precision=fp16", "loss_scale.initial=1024", "loss_scale.growth_interval=7",
                                          "loss_scale.hysteresis=3", "loss_scale.min=0.5", "parallel.nproc=1"}));
  EXPECT_EQ(h.options.zero.precision, DType::f16);
  EXPECT_EQ(h.options.loss_scale.initial_scale, 1024.0f);
  EXPECT_EQ(h.options.loss_scale.growth_interval, 7);
  EXPECT_EQ(h.options.loss_scale.hysteresis, 3);
  EXPECT_EQ(h.options.loss_scale.min_scale, 0.5f);
  EXPECT_FALSE(h.reference());
}

TEST(PlanTraining, ZeroStagesWithOneRankAreAllowed) {
  for (const char* stage : {"zero.stage=1", "zero.stage=2", "zero.stage=3"}) {
    const TrainPlan p = plan_training(tiny({stage}));
    EXPECT_EQ(p.dp, 1);
    EXPECT_FALSE(p.reference()) << stage;
  }
  Config c = tiny();
  const std::string e = error_of([&] { c.set_override("zero.stage=4"); });
  EXPECT_CONTAINS(e, "zero.stage");
  EXPECT_CONTAINS(e, "[0, 3]");
}

TEST(PlanTraining, BatchMustSplitIntoMicroBatchesOfEveryRank) {
  std::string e = error_of([] { plan_training(tiny({"parallel.dp=2", "train.batch_size=6"})); });
  EXPECT_CONTAINS(e, "train.batch_size = 6");
  EXPECT_CONTAINS(e, "train.micro_batch_size * parallel.dp = 2 * 2 = 4");
  EXPECT_CONTAINS(e, "set train.batch_size to 4 or 8");
  e = error_of([] { plan_training(tiny({"parallel.dp=4", "train.batch_size=4"})); });
  EXPECT_CONTAINS(e, "= 8");
  EXPECT_CONTAINS(e, "set train.batch_size to 8");
  e = error_of([] { plan_training(tiny({"train.batch_size=5"})); });
  EXPECT_CONTAINS(e, "must be a multiple of train.micro_batch_size = 2");
  EXPECT_CONTAINS(e, "set train.batch_size to 4 or 6");
}

TEST(PlanTraining, TensorAndPipelineParallelismAreRefused) {
  std::string e = error_of([] { plan_training(tiny({"parallel.tp=2"})); });
  EXPECT_CONTAINS(e, "parallel.tp = 2");
  EXPECT_CONTAINS(e, "tensor/pipeline parallelism is not available in `loom train` yet");
  EXPECT_CONTAINS(e, "set parallel.tp = 1 and parallel.pp = 1");
  e = error_of([] { plan_training(tiny({"parallel.pp=2", "parallel.dp=2"})); });
  EXPECT_CONTAINS(e, "parallel.pp = 2");
  EXPECT_CONTAINS(error_of([] { plan_training(tiny({"memory.policy=auto"})); }), "set memory.policy = \"none\"");
}

TEST(PlanTraining, NprocMustMatchTheLayout) {
  EXPECT_EQ(plan_training(tiny({"parallel.dp=2", "parallel.nproc=2"})).nproc, 2);
  const std::string e = error_of([] { plan_training(tiny({"parallel.dp=2", "parallel.nproc=3"})); });
  EXPECT_CONTAINS(e, "parallel.nproc = 3");
  EXPECT_CONTAINS(e, "must be 0 or parallel.dp * parallel.tp * parallel.pp = 2");
  EXPECT_CONTAINS(e, "set parallel.nproc = 0");
  EXPECT_CONTAINS(e, "or parallel.dp = 3");
}

TEST(PlanTraining, MpiBackendNeedsMpirun) {
  if (launched_by_mpirun()) GTEST_SKIP() << "runs outside mpirun only";
  const std::string e = error_of([] { plan_training(tiny({"parallel.backend=mpi", "parallel.dp=2"})); });
  EXPECT_CONTAINS(e, "parallel.backend = \"mpi\"");
  if (mpi_available()) {
    EXPECT_CONTAINS(e, "not started by mpirun");
    EXPECT_CONTAINS(e, "mpirun -np 2");
  } else {
    EXPECT_CONTAINS(e, "no MPI");
  }
  EXPECT_CONTAINS(e, "parallel.backend = \"local\"");
}

TEST(PlanTraining, UnderMpirunTheBackendAndRankCountMustFit) {
  if (launched_by_mpirun()) GTEST_SKIP() << "fakes mpirun's environment, so runs outside it only";
  ScopedEnv world("OMPI_COMM_WORLD_SIZE", "4");
  std::string e = error_of([] { plan_training(tiny({"parallel.dp=2"})); });
  EXPECT_CONTAINS(e, "parallel.backend = \"local\"");
  EXPECT_CONTAINS(e, "one of 4 that mpirun started");
  EXPECT_CONTAINS(e, "set parallel.backend = \"mpi\"");
  if (!mpi_available()) return;
  e = error_of([] { plan_training(tiny({"parallel.backend=mpi", "parallel.dp=2"})); });
  EXPECT_CONTAINS(e, "parallel.dp = 2");
  EXPECT_CONTAINS(e, "mpirun started 4 processes");
  EXPECT_CONTAINS(e, "set parallel.dp = 4");
  EXPECT_EQ(plan_training(tiny({"parallel.backend=mpi", "parallel.dp=4", "train.batch_size=8"})).nproc, 4);
}

TEST(PlanTraining, LossScaleFloorMayNotExceedTheStartUnderFp16) {
  const std::string e =
      error_of([] { plan_training(tiny({"precision=fp16", "loss_scale.initial=8", "loss_scale.min=16"})); });
  EXPECT_CONTAINS(e, "loss_scale.min = 16.0");
  EXPECT_CONTAINS(e, "may not exceed loss_scale.initial = 8");
  EXPECT_CONTAINS(e, "set loss_scale.min <= 8");
  // Without fp16 the scaler does not exist, so its keys are not held together.
  plan_training(tiny({"precision=bf16", "loss_scale.initial=8", "loss_scale.min=16"}));
  Config c = tiny();
  EXPECT_CONTAINS(error_of([&] { c.set_override("loss_scale.hysteresis=0"); }), "loss_scale.hysteresis");
}

}  // namespace
}  // namespace loom
