// plan_training: the cross-field rules of data, tensor, sequence and pipeline
// parallelism, ZeRO, mixed precision and memory placement, each error naming
// the field, the rule and the fix.
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

TEST(PlanTraining, DefaultsAreTheSingleRankReference) {
  const TrainPlan p = plan_training(tiny());
  EXPECT_EQ(p.dp, 1);
  EXPECT_EQ(p.tp, 1);
  EXPECT_EQ(p.pp, 1);
  EXPECT_EQ(p.nproc, 1);
  EXPECT_EQ(p.backend, "local");
  EXPECT_EQ(p.accumulation, 2);  // 4 sequences in micro-batches of 2
  EXPECT_EQ(p.options.zero.stage, 0);
  EXPECT_EQ(p.options.zero.precision, DType::f32);
  const ModelParallelOptions& mp = p.options.model_parallel;
  EXPECT_FALSE(mp.sequence_parallel);
  EXPECT_EQ(mp.schedule, PipelineSchedule::one_f_one_b);
  EXPECT_EQ(mp.virtual_stages, 1);
  EXPECT_TRUE(mp.stage_layers.empty());
  EXPECT_TRUE(p.reference());
}

TEST(PlanTraining, WatchdogTimeoutIsInSecondsAndZeroOrAtLeastATenth) {
  EXPECT_EQ(plan_training(tiny()).watchdog_timeout, std::chrono::seconds(60));
  EXPECT_EQ(plan_training(tiny({"train.watchdog_timeout=2.5"})).watchdog_timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(plan_training(tiny({"train.watchdog_timeout=0"})).watchdog_timeout.count(), 0);
  const std::string e = error_of([] { plan_training(tiny({"train.watchdog_timeout=0.05"})); });
  EXPECT_CONTAINS(e, "train.watchdog_timeout");
  EXPECT_CONTAINS(e, "shorter than the 0.1 s minimum");
  EXPECT_CONTAINS(e, "or to 0 to turn the watchdog off");
  EXPECT_CONTAINS(error_of([] { tiny({"train.watchdog_timeout=-1"}); }), "train.watchdog_timeout");
}

TEST(PlanTraining, LoRAKeysFillTheModelsAdapters) {
  EXPECT_FALSE(plan_training(tiny()).model.lora.enabled());
  const TrainPlan p = plan_training(tiny({"lora.r=4", "lora.alpha=16", "lora.targets=c_attn, mlp.c_proj"}));
  EXPECT_EQ(p.model.lora.r, 4);
  EXPECT_EQ(p.model.lora.alpha, 16.0f);
  EXPECT_EQ(p.model.lora.targets, (std::vector<std::string>{"c_attn", "mlp.c_proj"}));
  try {
    plan_training(tiny({"lora.r=4", "lora.targets=c_fc,q_proj"}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"q_proj\""), std::string::npos) << m;
    EXPECT_NE(m.find("valid: "), std::string::npos) << m;
  }
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

TEST(PlanTraining, DivergingStepKeysFillTheOptionsAndSpikeNeedsSkipping) {
  const TrainPlan off = plan_training(tiny());
  EXPECT_EQ(off.options.max_skipped_steps, 0);
  EXPECT_EQ(off.options.skip_spike_factor, 0.0);
  const TrainPlan on = plan_training(tiny({"train.max_skipped_steps=5", "train.skip_spike_factor=3"}));
  EXPECT_EQ(on.options.max_skipped_steps, 5);
  EXPECT_EQ(on.options.skip_spike_factor, 3.0);
  std::string e = error_of([] { plan_training(tiny({"train.max_skipped_steps=5", "train.skip_spike_factor=1"})); });
  EXPECT_CONTAINS(e, "train.skip_spike_factor");
  EXPECT_CONTAINS(e, "must be 0 (off) or above 1");
  e = error_of([] { plan_training(tiny({"train.skip_spike_factor=3"})); });
  EXPECT_CONTAINS(e, "train.max_skipped_steps = 0 turns off");
  EXPECT_CONTAINS(e, "set train.max_skipped_steps");
  Config c = tiny();
  e = error_of([&] { c.set_override("train.max_skiped_steps=2"); });
  EXPECT_CONTAINS(e, "train.max_skipped_steps");  // did you mean
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

TEST(PlanTraining, MemoryPoliciesFillTheMemoryOptions) {
  testing::TempDir nvme;
  Config c = tiny({"memory.policy=static", "memory.offload_param_frac=0.5", "memory.offload_optim_frac=1",
                   "memory.chunk_bytes=128KiB", "memory.prefetch=3", "memory.nvme_io_uring=false"});
  c.set_override("memory.nvme_dir=" + nvme.path().string());
  const TrainPlan p = plan_training(c);
  const MemoryOptions& m = p.options.memory;
  EXPECT_EQ(m.policy, MemoryPolicy::fixed);
  EXPECT_EQ(m.offload_param_frac, 0.5);
  EXPECT_EQ(m.offload_optim_frac, 1.0);
  EXPECT_EQ(m.nvme_dir, nvme.path());
  EXPECT_FALSE(m.nvme_io_uring);
  EXPECT_EQ(m.chunk_bytes, 128 << 10);
  EXPECT_EQ(m.prefetch, 3);
  EXPECT_EQ(m.micro_batches, p.accumulation);

  const TrainPlan a = plan_training(tiny({"memory.policy=auto"}));
  EXPECT_EQ(a.options.memory.policy, MemoryPolicy::automatic);
  EXPECT_EQ(a.options.memory.chunk_bytes, 0);
  EXPECT_TRUE(a.options.memory.nvme_io_uring);
  EXPECT_EQ(a.options.memory.prefetch, 2);
  const TrainPlan none = plan_training(tiny());
  EXPECT_EQ(none.options.memory.policy, MemoryPolicy::none);
  // Chunks shard as ZeRO-3 does: stage 3 over dp ranks, 0 or 3 on one.
  EXPECT_EQ(plan_training(tiny({"memory.policy=auto", "zero.stage=3"})).options.zero.stage, 3);
  EXPECT_EQ(plan_training(tiny({"memory.policy=static", "parallel.dp=2", "zero.stage=3", "train.batch_size=8",
                                "precision=bf16"}))
                .options.memory.policy,
            MemoryPolicy::fixed);
}

TEST(PlanTraining, MemoryKeysOfThePoliciesAreErrorsWithoutOne) {
  std::string e = error_of([] { plan_training(tiny({"memory.offload_param_frac=0.5"})); });
  EXPECT_CONTAINS(e, "memory.offload_param_frac = 0.5");
  EXPECT_CONTAINS(e, "applies only under memory.policy = \"static\"");
  EXPECT_CONTAINS(e, "set memory.policy = \"static\", or memory.offload_param_frac = 0");
  e = error_of([] { plan_training(tiny({"memory.offload_optim_frac=1"})); });
  EXPECT_CONTAINS(e, "memory.offload_optim_frac = 1.0");
  e = error_of([] { plan_training(tiny({"memory.nvme_dir=/tmp"})); });
  EXPECT_CONTAINS(e, "memory.nvme_dir = \"/tmp\"");
  EXPECT_CONTAINS(e, "applies only under memory.policy = \"static\" or \"auto\"");
  EXPECT_CONTAINS(e, "or memory.nvme_dir = \"\"");
  e = error_of([] { plan_training(tiny({"memory.chunk_bytes=64KiB"})); });
  EXPECT_CONTAINS(e, "memory.chunk_bytes = \"64KiB\"");
  EXPECT_CONTAINS(e, "or memory.chunk_bytes = 0");
  // The fractions are the static policy's alone.
  e = error_of([] { plan_training(tiny({"memory.policy=auto", "memory.offload_optim_frac=0.5"})); });
  EXPECT_CONTAINS(e, "memory.offload_optim_frac = 0.5");
  EXPECT_CONTAINS(e, "memory.policy = \"auto\" places the chunks itself");
  EXPECT_CONTAINS(e, "set memory.offload_optim_frac = 0, or memory.policy = \"static\"");
}

TEST(PlanTraining, MemoryPoliciesShardOverDataParallelismOnlyAsZero3Does) {
  std::string e = error_of([] { plan_training(tiny({"memory.policy=static", "parallel.tp=2"})); });
  EXPECT_CONTAINS(e, "memory.policy = \"static\"");
  EXPECT_CONTAINS(e, "over the data-parallel ranks only, and parallel.tp = 2");
  EXPECT_CONTAINS(e, "set parallel.tp = 1");
  e = error_of([] { plan_training(tiny({"memory.policy=auto", "parallel.pp=2"})); });
  EXPECT_CONTAINS(e, "memory.policy = \"auto\"");
  EXPECT_CONTAINS(e, "parallel.pp = 2");
  EXPECT_CONTAINS(e, "or memory.policy = \"none\"");

  e = error_of([] {
    plan_training(tiny({"memory.policy=static", "parallel.dp=2", "zero.stage=1", "train.batch_size=8"}));
  });
  EXPECT_CONTAINS(e, "zero.stage = 1");
  EXPECT_CONTAINS(e, "as stage 3 does, and parallel.dp = 2");
  EXPECT_CONTAINS(e, "set zero.stage = 3, or memory.policy = \"none\"");
  e = error_of([] { plan_training(tiny({"memory.policy=static", "parallel.dp=2", "train.batch_size=8"})); });
  EXPECT_CONTAINS(e, "zero.stage = 0");
  e = error_of([] { plan_training(tiny({"memory.policy=auto", "zero.stage=2"})); });
  EXPECT_CONTAINS(e, "zero.stage = 2");
  EXPECT_CONTAINS(e, "set zero.stage = 3 or 0, or memory.policy = \"none\"");
}

TEST(PlanTraining, NvmeDirMustBeAnExistingDirectory) {
  testing::TempDir dir;
  Config missing = tiny({"memory.policy=static", "memory.offload_optim_frac=1"});
  missing.set_override("memory.nvme_dir=" + (dir / "absent").string());
  std::string e = error_of([&] { plan_training(missing); });
  EXPECT_CONTAINS(e, "memory.nvme_dir = \"" + (dir / "absent").string() + "\"");
  EXPECT_CONTAINS(e, "it does not exist");
  EXPECT_CONTAINS(e, "mkdir -p " + (dir / "absent").string());
  Config file = tiny({"memory.policy=auto"});
  file.set_override("memory.nvme_dir=" + dir.write("a-file", "x").string());
  e = error_of([&] { plan_training(file); });
  EXPECT_CONTAINS(e, "memory.nvme_dir");
  EXPECT_CONTAINS(e, "it is not a directory");
}

TEST(PlanTraining, ChunksMustHoldTheLargestParameter) {
  // The tiny model's largest parameter is wte.weight, 512 x 32 elements.
  std::string e = error_of([] { plan_training(tiny({"memory.policy=auto", "memory.chunk_bytes=32KiB"})); });
  EXPECT_CONTAINS(e, "memory.chunk_bytes = \"32KiB\"");
  EXPECT_CONTAINS(e, "must hold the largest parameter whole, wte.weight of 16384 elements = 65536 bytes in fp32");
  EXPECT_CONTAINS(e, "set memory.chunk_bytes >= 65536, or 0 (searched)");
  e = error_of([] { plan_training(tiny({"memory.policy=static", "memory.chunk_bytes=20000", "precision=bf16"})); });
  EXPECT_CONTAINS(e, "16384 elements = 32768 bytes in bf16");
  // A capacity is rounded up to whole shards (2048 elements per rank).
  EXPECT_EQ(plan_training(tiny({"memory.policy=static", "memory.chunk_bytes=30000", "parallel.dp=2", "zero.stage=3",
                                "train.batch_size=8", "precision=bf16"}))
                .options.memory.chunk_bytes,
            30000);
  e = error_of([] { plan_training(tiny({"memory.policy=auto", "memory.chunk_bytes=unlimited"})); });
  EXPECT_CONTAINS(e, "memory.chunk_bytes = \"unlimited\"");
  EXPECT_CONTAINS(e, "cannot be unlimited");
  EXPECT_EQ(plan_training(tiny({"memory.policy=auto", "memory.chunk_bytes=64KiB"})).options.memory.chunk_bytes,
            64 << 10);
}

TEST(PlanTraining, ModelStateThatCannotFitTheBudgetsFailsBeforeAllocating) {
  const std::string e = error_of([] {
    plan_training(tiny({"memory.policy=auto", "memory.device_budget=64KiB", "memory.host_budget=64KiB"}));
  });
  EXPECT_CONTAINS(e, "memory.policy = \"auto\" cannot fit this model");
  EXPECT_CONTAINS(e, "but its budget is " + format_bytes(64 << 10) + " (memory.device_budget)");
  EXPECT_CONTAINS(e, "but its budget is " + format_bytes(64 << 10) + " (memory.host_budget)");
  // The same budgets without a policy are not planned: the allocators hold them.
  plan_training(tiny({"memory.device_budget=64KiB", "memory.host_budget=64KiB"}));
}

// LoRA's frozen base stays out of the chunks (FrozenParams keeps it on the
// device, in the working precision): host budgets too small for full
// fine-tuning's chunked state hold the adapters', and the device budget must
// hold the frozen weights.
TEST(PlanTraining, LoRAPlansTheAdaptersStateAndTheFrozenWeightsOnTheDevice) {
  const char* host = "memory.host_budget=256KiB";
  std::string e = error_of([&] { plan_training(tiny({"memory.policy=auto", host})); });
  EXPECT_CONTAINS(e, "(memory.host_budget)");
  const auto lora = [&](const char* device_budget) {
    return tiny({"memory.policy=auto", host, device_budget, "lora.r=4", "lora.targets=c_attn"});
  };
  EXPECT_NO_THROW(plan_training(lora("memory.device_budget=unlimited")));
  // The frozen weights alone: ~40K fp32 parameters.
  const GPT whole(plan_training(lora("memory.device_budget=unlimited")).model);
  int64_t frozen = 0;
  for (const ParamSpec& p : whole.layout().params()) frozen += p.trainable ? 0 : p.numel() * 4;
  ASSERT_GT(frozen, 100 << 10);
  e = error_of([&] { plan_training(lora("memory.device_budget=100KiB")); });
  EXPECT_CONTAINS(e, "(memory.device_budget)");
  EXPECT_CONTAINS(e, "activations and frozen weights");
}

TEST(PlanTraining, NprocMustMatchTheLayout) {
  EXPECT_EQ(plan_training(tiny({"parallel.dp=2", "parallel.nproc=2"})).nproc, 2);
  std::string e = error_of([] { plan_training(tiny({"parallel.dp=2", "parallel.nproc=3"})); });
  EXPECT_CONTAINS(e, "parallel.nproc = 3");
  EXPECT_CONTAINS(e, "must be 0 or parallel.dp * parallel.tp * parallel.pp = 2 * 1 * 1 = 2");
  EXPECT_CONTAINS(e, "set parallel.nproc = 0");
  EXPECT_CONTAINS(e, "or parallel.dp = 3");
  e = error_of([] { plan_training(tiny({"parallel.tp=2", "parallel.pp=2", "parallel.nproc=8"})); });
  EXPECT_CONTAINS(e, "parallel.dp * parallel.tp * parallel.pp = 1 * 2 * 2 = 4");
  EXPECT_CONTAINS(e, "set parallel.nproc = 0 (it follows the layout) or 4, or parallel.dp = 2");
  // No data-parallel size makes 6 ranks of tp * pp = 4.
  e = error_of([] { plan_training(tiny({"parallel.tp=2", "parallel.pp=2", "parallel.nproc=6"})); });
  EXPECT_CONTAINS(e, "set parallel.nproc = 0 (it follows the layout) or 4");
  EXPECT_EQ(e.find("parallel.dp ="), std::string::npos) << e;
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
  const testing::ScopedEnv world("OMPI_COMM_WORLD_SIZE", "4");
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
  e = error_of([] { plan_training(tiny({"parallel.backend=mpi", "parallel.tp=2"})); });
  EXPECT_CONTAINS(e, "parallel.dp * parallel.tp * parallel.pp = 2 ranks");
  EXPECT_CONTAINS(e, "run `mpirun -np 2`, or set parallel.dp = 2");
  EXPECT_EQ(plan_training(tiny({"parallel.backend=mpi", "parallel.dp=2", "parallel.tp=2"})).nproc, 4);
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

TEST(PlanTraining, HybridLayoutFillsTheModelParallelOptions) {
  const TrainPlan p =
      plan_training(tiny({"parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.schedule=interleaved_1f1b",
                          "parallel.virtual_stages=2", "model.n_layer=4", "train.batch_size=8", "zero.stage=1"}));
  EXPECT_EQ(p.dp, 2);
  EXPECT_EQ(p.tp, 2);
  EXPECT_EQ(p.pp, 2);
  EXPECT_EQ(p.nproc, 8);
  EXPECT_EQ(p.accumulation, 2);  // 8 / (2 ranks * 2 per micro-batch), one group of pp = 2
  EXPECT_EQ(p.options.zero.stage, 1);
  const ModelParallelOptions& mp = p.options.model_parallel;
  EXPECT_FALSE(mp.sequence_parallel);
  EXPECT_EQ(mp.schedule, PipelineSchedule::interleaved_1f1b);
  EXPECT_EQ(mp.virtual_stages, 2);
  EXPECT_TRUE(mp.stage_layers.empty());  // 4 layers over 4 virtual stages: the even split
  EXPECT_FALSE(p.reference());

  const TrainPlan g = plan_training(
      tiny({"parallel.pp=2", "parallel.schedule=gpipe", "model.n_layer=5", "parallel.stage_layers= 3, 2"}));
  EXPECT_EQ(g.options.model_parallel.schedule, PipelineSchedule::gpipe);
  EXPECT_EQ(g.options.model_parallel.stage_layers, (std::vector<int>{3, 2}));
  EXPECT_FALSE(g.reference());
  EXPECT_FALSE(plan_training(tiny({"parallel.tp=2"})).reference());
}

TEST(PlanTraining, SequenceParallelPlan) {
  const TrainPlan p = plan_training(tiny({"parallel.tp=2", "parallel.sequence_parallel=true"}));
  EXPECT_EQ(p.tp, 2);
  EXPECT_EQ(p.pp, 1);
  EXPECT_EQ(p.nproc, 2);
  EXPECT_TRUE(p.options.model_parallel.sequence_parallel);
  EXPECT_EQ(p.options.model_parallel.schedule, PipelineSchedule::one_f_one_b);
  EXPECT_FALSE(p.reference());
}

TEST(PlanTraining, TensorParallelMustDivideTheHeads) {
  std::string e = error_of([] { plan_training(tiny({"model.n_head=6", "model.n_embd=48", "parallel.tp=4"})); });
  EXPECT_CONTAINS(e, "parallel.tp = 4");
  EXPECT_CONTAINS(e, "must divide model.n_head = 6");
  EXPECT_CONTAINS(e, "set parallel.tp = 3 or 6, or model.n_head = 4 or 8");
  // A preset fixes model.n_head, so only tp is suggested.
  e = error_of([] { plan_training(tiny({"model.preset=gpt2", "parallel.tp=5"})); });
  EXPECT_CONTAINS(e, "must divide model.n_head = 12");
  EXPECT_CONTAINS(e, "set parallel.tp = 4 or 6");
  EXPECT_EQ(e.find("or model.n_head"), std::string::npos) << e;
}

// model.head_dim frees the heads from n_embd: 6 heads of 10 beside width 48
// (not 48 / 6 = 8); the tp rule then suggests head counts that need not
// divide n_embd.
TEST(PlanTraining, HeadDimKeySetsTheHeadWidthApartFromNEmbd) {
  const TrainPlan p = plan_training(tiny({"model.n_head=6", "model.n_embd=48", "model.head_dim=10", "parallel.tp=2"}));
  EXPECT_EQ(p.model.head_dim(), 10);
  EXPECT_EQ(p.model.q_dim(), 60);
  EXPECT_EQ(GPT(p.model).layout().numel(), p.model.num_params());
  const std::string e =
      error_of([] { plan_training(tiny({"model.n_head=5", "model.n_embd=48", "model.head_dim=10", "parallel.tp=2"})); });
  EXPECT_CONTAINS(e, "or model.n_head = 4 or 6");
  EXPECT_CONTAINS(error_of([] { plan_training(tiny({"model.n_head=5", "model.n_embd=48"})); }), "model.head_dim");
}

TEST(PlanTraining, LlamaKeysBuildTheModelAndTheirTensorParallelRules) {
  const TrainPlan p = plan_training(tiny({"model.n_head=4", "model.norm=rmsnorm", "model.positions=rope",
                                          "model.mlp=swiglu", "model.n_kv_head=2", "model.packed_qkv=false",
                                          "model.rope_scaling=linear", "model.rope_scaling_factor=2",
                                          "model.tied_embeddings=false", "parallel.tp=4"}));
  EXPECT_EQ(p.model.norm, NormKind::rmsnorm);
  EXPECT_EQ(p.model.positions, PositionKind::rope);
  EXPECT_EQ(p.model.mlp, MlpKind::swiglu);
  EXPECT_EQ(p.model.kv_heads(), 2);
  EXPECT_EQ(p.model.rope_scaling.type, cpu::RopeScalingType::linear);
  EXPECT_FALSE(p.model.tied_embeddings);
  std::string e = error_of([] {
    plan_training(tiny({"model.n_head=6", "model.n_embd=48", "model.n_kv_head=3", "model.packed_qkv=false",
                        "parallel.tp=2"}));
  });
  EXPECT_CONTAINS(e, "must divide or be a multiple of model.n_kv_head = 3");
  EXPECT_CONTAINS(e, "fix: parallel.tp = 1 or 3");
  e = error_of([] { plan_training(tiny({"model.n_head=4", "model.intermediate_size=100", "parallel.tp=8"})); });
  EXPECT_CONTAINS(e, "model.n_head = 4");  // the heads' rule comes first
  e = error_of([] { plan_training(tiny({"model.n_head=4", "model.intermediate_size=102", "parallel.tp=4"})); });
  EXPECT_CONTAINS(e, "must divide the MLP's model.intermediate_size = 102");
  e = error_of([] { plan_training(tiny({"model.n_kv_head=3"})); });
  EXPECT_CONTAINS(e, "model.n_kv_head = 3");
}

TEST(PlanTraining, TensorParallelPadsTheVocabularyButNeedsARowPerRank) {
  // 510 rows over 4 ranks is padded to 512 by the model: no error.
  EXPECT_EQ(plan_training(tiny({"model.n_head=4", "parallel.tp=4", "model.vocab_size=510", "data.vocab_size=500"})).tp,
            4);
  const std::string e = error_of([] {
    plan_training(tiny({"model.n_head=4", "parallel.tp=4", "model.vocab_size=2", "data.vocab_size=2"}));
  });
  EXPECT_CONTAINS(e, "parallel.tp = 4");
  EXPECT_CONTAINS(e, "may not exceed model.vocab_size = 2");
  EXPECT_CONTAINS(e, "set parallel.tp <= 2");
}

TEST(PlanTraining, GridPlans) {
  const TrainPlan p = plan_training(tiny({"parallel.tp=4", "parallel.tp_mode=2d"}));
  EXPECT_EQ(p.tp, 4);
  EXPECT_EQ(p.tensor_grid.q, 2);
  EXPECT_EQ(p.tensor_grid.depth, 1);
  const TrainPlan t = plan_training(
      tiny({"parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=2", "train.micro_batch_size=4"}));
  EXPECT_EQ(t.tensor_grid.q, 2);
  EXPECT_EQ(t.tensor_grid.depth, 2);
  const TrainPlan c = plan_training(tiny({"parallel.tp=8", "parallel.tp_mode=3d", "train.micro_batch_size=4"}));
  EXPECT_EQ(c.tensor_grid.q, 2);
  EXPECT_EQ(c.tensor_grid.depth, 2);
  EXPECT_TRUE(c.tensor_grid.cube);
  EXPECT_FALSE(t.tensor_grid.cube);
  EXPECT_EQ(plan_training(tiny({"parallel.tp=2"})).tensor_grid.ranks(), 1);
}

// Invalid grids are config errors naming the key and the nearest valid values.
TEST(PlanTraining, InvalidGridsNameTheFix) {
  std::string e = error_of([] { plan_training(tiny({"parallel.tp=6", "parallel.tp_mode=2d"})); });
  EXPECT_CONTAINS(e, "parallel.tp = 6");
  EXPECT_CONTAINS(e, "does not form a 2d grid");
  EXPECT_CONTAINS(e, "set parallel.tp = 4 or 9");
  e = error_of([] {
    plan_training(tiny({"parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=3"}));
  });
  EXPECT_CONTAINS(e, "parallel.tp = 8");
  EXPECT_CONTAINS(e, "q * q * parallel.tp_depth = q * q * 3");
  EXPECT_CONTAINS(e, "parallel.tp_depth = 2");
  e = error_of([] { plan_training(tiny({"parallel.tp=4", "parallel.tp_depth=2"})); });
  EXPECT_CONTAINS(e, "parallel.tp_depth = 2");
  EXPECT_CONTAINS(e, "set parallel.tp_mode = \"2.5d\", or parallel.tp_depth = 1");
  e = error_of([] {
    plan_training(tiny({"parallel.tp=4", "parallel.tp_mode=2d", "parallel.sequence_parallel=true"}));
  });
  EXPECT_CONTAINS(e, "parallel.sequence_parallel = true");
  EXPECT_CONTAINS(e, "set parallel.sequence_parallel = false, or parallel.tp_mode = \"1d\"");
  e = error_of([] { plan_training(tiny({"parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch_size=1"})); });
  EXPECT_CONTAINS(e, "train.micro_batch_size = 1");
  EXPECT_CONTAINS(e, "set train.micro_batch_size = 2");
  e = error_of([] { plan_training(tiny({"parallel.tp=9", "parallel.tp_mode=2d", "train.micro_batch_size=3",
                                        "train.batch_size=3"})); });
  EXPECT_CONTAINS(e, "makes a grid of side 3, which must divide model.n_embd = 32");
  e = error_of([] { plan_training(tiny({"parallel.tp=4", "parallel.tp_mode=3d"})); });
  EXPECT_CONTAINS(e, "does not form a 3d grid of a cube q * q * q ranks");
  EXPECT_CONTAINS(e, "set parallel.tp = 8");
  e = error_of([] { plan_training(tiny({"parallel.tp=8", "parallel.tp_mode=3d", "parallel.tp_depth=2"})); });
  EXPECT_CONTAINS(e, "set parallel.tp_mode = \"2.5d\", or parallel.tp_depth = 1");
  e = error_of([] { plan_training(tiny({"parallel.tp=8", "parallel.tp_mode=3d", "train.micro_batch_size=2"})); });
  EXPECT_CONTAINS(e, "token groups (q * q)");
  EXPECT_CONTAINS(e, "set train.micro_batch_size = 4");
  e = error_of([] { plan_training(tiny({"parallel.tp=8", "parallel.tp_mode=3d", "train.micro_batch_size=4",
                                        "model.n_embd=38", "model.n_head=2"})); });
  EXPECT_CONTAINS(e, "whose q^2 = 4 must divide model.n_embd = 38");
  EXPECT_CONTAINS(e, "with q^2 dividing model.n_embd");
}

TEST(PlanTraining, SequenceParallelNeedsTensorParallelism) {
  const std::string e = error_of([] { plan_training(tiny({"parallel.sequence_parallel=true"})); });
  EXPECT_CONTAINS(e, "parallel.sequence_parallel = true");
  EXPECT_CONTAINS(e, "parallel.tp = 1");
  EXPECT_CONTAINS(e, "set parallel.tp >= 2, or parallel.sequence_parallel = false");
}

TEST(PlanTraining, SequenceParallelSplitsTheTokenRowsEvenly) {
  const std::string e = error_of([] {
    plan_training(
        tiny({"parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=1", "train.seq_len=31"}));
  });
  EXPECT_CONTAINS(e, "train.seq_len = 31");
  EXPECT_CONTAINS(e, "train.micro_batch_size * train.seq_len = 1 * 31 = 31, must split evenly over parallel.tp = 2");
  EXPECT_CONTAINS(e,
                  "set train.seq_len = 30 or 32, or train.micro_batch_size = 2, or parallel.sequence_parallel = false");
  // Without sequence parallelism the rows need not split.
  plan_training(tiny({"parallel.tp=2", "train.micro_batch_size=1", "train.seq_len=31"}));
}

TEST(PlanTraining, VirtualStagesNeedTheInterleavedSchedule) {
  std::string e = error_of([] { plan_training(tiny({"parallel.pp=2", "parallel.virtual_stages=2"})); });
  EXPECT_CONTAINS(e, "parallel.virtual_stages = 2");
  EXPECT_CONTAINS(e, "parallel.schedule = \"1f1b\"");
  EXPECT_CONTAINS(e, "set parallel.schedule = \"interleaved_1f1b\", or parallel.virtual_stages = 1");
  e = error_of([] { plan_training(tiny({"parallel.pp=2", "parallel.schedule=interleaved_1f1b"})); });
  EXPECT_CONTAINS(e, "parallel.schedule = \"interleaved_1f1b\"");
  EXPECT_CONTAINS(e, "needs at least 2 model chunks per pipeline rank, and parallel.virtual_stages = 1");
  EXPECT_CONTAINS(e, "set parallel.virtual_stages >= 2, or parallel.schedule = \"1f1b\"");
  e = error_of([] { plan_training(tiny({"parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2"})); });
  EXPECT_CONTAINS(e, "parallel.schedule = \"interleaved_1f1b\"");
  EXPECT_CONTAINS(e, "parallel.pp = 1");
  EXPECT_CONTAINS(e, "set parallel.pp >= 2");
}

TEST(PlanTraining, EveryPipelineStageNeedsALayer) {
  std::string e = error_of([] { plan_training(tiny({"parallel.pp=4", "train.batch_size=8"})); });
  EXPECT_CONTAINS(e, "parallel.pp = 4");
  EXPECT_CONTAINS(e, "each of the 4 pipeline stages needs a layer, and model.n_layer = 2");
  EXPECT_CONTAINS(e, "set parallel.pp <= 2, or model.n_layer >= 4");
  e = error_of([] {
    plan_training(tiny({"parallel.pp=3", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                        "model.n_layer=5", "train.batch_size=6"}));
  });
  EXPECT_CONTAINS(e, "parallel.virtual_stages = 2");
  EXPECT_CONTAINS(e,
                  "parallel.pp * parallel.virtual_stages = 3 * 2 = 6 virtual stages need a layer each, and "
                  "model.n_layer = 5");
  EXPECT_CONTAINS(e, "set parallel.pp <= 2, or model.n_layer >= 6");
}

TEST(PlanTraining, InterleavingWithoutStageLayersSplitsTheLayersEvenly) {
  const std::string e = error_of([] {
    plan_training(
        tiny({"parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "model.n_layer=6"}));
  });
  EXPECT_CONTAINS(e, "parallel.virtual_stages = 2");
  EXPECT_CONTAINS(e,
                  "splits the model.n_layer = 6 layers evenly over parallel.pp * parallel.virtual_stages = 2 * 2 = 4");
  EXPECT_CONTAINS(e,
                  "set parallel.stage_layers = \"2,2,1,1\", or parallel.virtual_stages = 3, or "
                  "model.n_layer = 4 or 8");
  const TrainPlan p =
      plan_training(tiny({"parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                          "model.n_layer=6", "parallel.stage_layers=2,2,1,1"}));
  EXPECT_EQ(p.options.model_parallel.stage_layers, (std::vector<int>{2, 2, 1, 1}));
}

TEST(PlanTraining, StageLayersAreOneCountPerVirtualStageSummingToTheLayers) {
  const auto plan = [](const char* layers) {
    return error_of([&] { plan_training(tiny({"parallel.pp=2", "model.n_layer=4", layers})); });
  };
  const char* fix = "set parallel.stage_layers = \"2,2\", or \"\" to balance the stages by cost";
  std::string e = plan("parallel.stage_layers=3,x");
  EXPECT_CONTAINS(e, "parallel.stage_layers = \"3,x\"");
  EXPECT_CONTAINS(e, "must be comma-separated layer counts, one per virtual stage, and 'x' is not a whole number");
  EXPECT_CONTAINS(e, fix);
  EXPECT_CONTAINS(plan("parallel.stage_layers=3,,1"), "'' is not a whole number");
  EXPECT_CONTAINS(plan("parallel.stage_layers=2.5,1.5"), "'2.5' is not a whole number");
  e = plan("parallel.stage_layers=1,1,2");
  EXPECT_CONTAINS(e, "has 3 entries, and parallel.pp * parallel.virtual_stages = 2 virtual stages need one each");
  EXPECT_CONTAINS(e, fix);
  e = plan("parallel.stage_layers=4,0");
  EXPECT_CONTAINS(e, "gives virtual stage 1 0 layers, and every stage needs at least one");
  EXPECT_CONTAINS(e, fix);
  EXPECT_CONTAINS(plan("parallel.stage_layers=5,-1"), "gives virtual stage 1 -1 layers");
  e = plan("parallel.stage_layers=2,3");
  EXPECT_CONTAINS(e, "sums to 5 layers, and model.n_layer = 4");
  EXPECT_CONTAINS(e, fix);
  // Interleaving an uneven split has no balanced default to fall back on.
  e = error_of([] {
    plan_training(tiny({"parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                        "model.n_layer=6", "parallel.stage_layers=3,3"}));
  });
  EXPECT_CONTAINS(e, "has 2 entries, and parallel.pp * parallel.virtual_stages = 4 virtual stages need one each");
  EXPECT_CONTAINS(e, "fix: set parallel.stage_layers = \"2,2,1,1\"");
  EXPECT_EQ(e.find("to balance"), std::string::npos) << e;
}

TEST(PlanTraining, PipelineNeedsAsManyMicroBatchesAsStages) {
  std::string e = error_of([] { plan_training(tiny({"parallel.pp=2", "train.micro_batch_size=4"})); });
  EXPECT_CONTAINS(e, "train.batch_size = 4");
  EXPECT_CONTAINS(e, "needs at least 2 micro-batches per step and rank to fill");
  EXPECT_CONTAINS(e, "train.batch_size / (parallel.dp * train.micro_batch_size) = 4 / (1 * 4) = 1");
  EXPECT_CONTAINS(e, "set train.batch_size = 8, or train.micro_batch_size = 2");
  e = error_of([] {
    plan_training(tiny({"parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                        "model.n_layer=4", "train.batch_size=6"}));
  });
  EXPECT_CONTAINS(e, "train.batch_size = 6");
  EXPECT_CONTAINS(e, "in groups of parallel.pp = 2");
  EXPECT_CONTAINS(e, "= 6 / (1 * 2) = 3 per step and rank, not a multiple of 2");
  EXPECT_CONTAINS(e, "set train.batch_size = 4 or 8");
  // 1F1B and GPipe take any count from pp up.
  EXPECT_EQ(plan_training(tiny({"parallel.pp=2", "train.batch_size=6"})).accumulation, 3);
}

TEST(PlanTraining, ZeroStagesAboveOneNeedNoModelParallelism) {
  std::string e = error_of([] { plan_training(tiny({"parallel.pp=2", "zero.stage=2"})); });
  EXPECT_CONTAINS(e, "zero.stage = 2");
  EXPECT_CONTAINS(e, "parallel.pp = 2");
  EXPECT_CONTAINS(e, "set zero.stage = 0 or 1, or parallel.pp = 1");
  e = error_of([] { plan_training(tiny({"parallel.tp=2", "zero.stage=3"})); });
  EXPECT_CONTAINS(e, "zero.stage = 3");
  EXPECT_CONTAINS(e, "parallel.tp = 2");
  EXPECT_CONTAINS(e, "set zero.stage = 0 or 1, or parallel.tp = 1");
  EXPECT_EQ(plan_training(tiny({"parallel.tp=2", "parallel.pp=2", "zero.stage=1"})).options.zero.stage, 1);
}

TEST(PlanTraining, TraceKeysAreCheckedBeforeTheRun) {
  const TrainPlan off = plan_training(tiny());
  EXPECT_TRUE(off.trace_path.empty());
  EXPECT_EQ(off.trace_steps.first, 2);
  EXPECT_EQ(off.trace_steps.last, 4);
  for (const char* bad : {"trace.steps=two", "trace.steps=4-2", "trace.steps=0"}) {
    const std::string e = error_of([&] { plan_training(tiny({bad})); });
    EXPECT_NE(e.find("trace.steps"), std::string::npos) << e;
    EXPECT_NE(e.find("FIRST-LAST"), std::string::npos) << e;
  }
  testing::TempDir dir;
  const std::string fresh = "trace.path=" + (dir / "trace.json").string();
  const TrainPlan on = plan_training(tiny({fresh.c_str(), "trace.steps=3-5"}));
  EXPECT_EQ(on.trace_path, dir / "trace.json");
  EXPECT_EQ(on.trace_steps.first, 3);
  std::string e = error_of([&] { plan_training(tiny({fresh.c_str(), "trace.steps=11-12"})); });
  EXPECT_NE(e.find("train.steps = 10"), std::string::npos) << e;
  const std::string taken = "trace.path=" + dir.write("taken.json", "{}").string();
  e = error_of([&] { plan_training(tiny({taken.c_str()})); });
  EXPECT_NE(e.find("already exists"), std::string::npos) << e;
  EXPECT_NE(e.find("trace.path"), std::string::npos) << e;
  const std::string nowhere = "trace.path=" + (dir / "missing" / "trace.json").string();
  e = error_of([&] { plan_training(tiny({nowhere.c_str()})); });
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
}

}  // namespace
}  // namespace loom
