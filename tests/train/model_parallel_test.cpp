// Tensor-, sequence- and pipeline-parallel layouts, alone and composed with
// data parallelism, ZeRO-1 and activation checkpointing, reproduce the
// single-rank fp32 reference, and each is bit-identical run to run.
#include <cmath>

#include <gtest/gtest.h>

#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

// 8 layers so that 4 pipeline ranks can hold 2 chunks each; 4 heads so that
// 4 tensor-parallel ranks hold one each; vocabulary 61 pads to 62 and 64.
constexpr int kLayers = 8, kHeads = 4;

struct Layout {
  std::string name;
  int dp = 1, tp = 1, pp = 1;
  bool sequence_parallel = false;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;
  int stage = 0;
  bool checkpoint = false;
  int accumulation = 1;  // micro-batches per step and data-parallel rank
};

DataParallelRun run_of(const Layout& l) {
  DataParallelRun r = testing::layout(l.dp, l.stage, DType::f32, l.accumulation);
  r.tp = l.tp;
  r.pp = l.pp;
  r.mesh = true;
  r.n_layer = kLayers;
  r.n_head = kHeads;
  r.checkpoint_activations = l.checkpoint;
  r.model_parallel.sequence_parallel = l.sequence_parallel;
  r.model_parallel.schedule = l.schedule;
  r.model_parallel.virtual_stages = l.virtual_stages;
  return r;
}

const RunResult& reference() {
  static const RunResult ref = [] {
    DataParallelRun r = testing::layout(0, 0);
    r.n_layer = kLayers;
    r.n_head = kHeads;
    return testing::run_layout(r);
  }();
  return ref;
}

class ModelParallelFp32 : public ::testing::TestWithParam<Layout> {};

TEST_P(ModelParallelFp32, MatchesTheReferenceAndIsBitIdenticalRunToRun) {
  const Layout l = GetParam();
  const RunResult a = testing::run_layout(run_of(l));
  ASSERT_EQ(a.stats.size(), 20u);
  const double loss = testing::max_loss_rel_diff(a, reference()), params = testing::param_rel_diff(a, reference()),
               key_bias = testing::key_bias_max_abs_diff(a, reference());
  std::printf("%s: max loss rel diff %.3g, params rel diff %.3g, key bias max abs diff %.3g\n", l.name.c_str(), loss,
              params, key_bias);
  EXPECT_TRUE(testing::matches_reference(a, reference(), 1e-5));
  // Noise-driven (see is_key_bias), so only bounded: 20 steps of at most lr * 1e-3.
  EXPECT_LE(key_bias, 20 * 1e-3 * 1e-3);
  const RunResult b = testing::run_layout(run_of(l));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, b.exp_avg_sq));
}

std::vector<Layout> layouts() {
  using S = PipelineSchedule;
  std::vector<Layout> v;
  v.push_back({.name = "tp2", .tp = 2});
  v.push_back({.name = "tp4", .tp = 4});
  v.push_back({.name = "tp2_sp", .tp = 2, .sequence_parallel = true});
  for (int pp : {2, 4}) {
    const std::string p = "pp" + std::to_string(pp);
    v.push_back({.name = p + "_gpipe", .pp = pp, .schedule = S::gpipe, .accumulation = 4});
    v.push_back({.name = p + "_1f1b", .pp = pp, .schedule = S::one_f_one_b, .accumulation = 4});
    v.push_back({.name = p + "_interleaved", .pp = pp, .schedule = S::interleaved_1f1b, .virtual_stages = 2,
                 .accumulation = 4});
  }
  const std::vector<Layout> hybrids = {
      {.name = "dp2_tp2", .dp = 2, .tp = 2},
      {.name = "dp2_pp2", .dp = 2, .pp = 2, .accumulation = 2},
      {.name = "tp2_pp2", .tp = 2, .pp = 2, .accumulation = 2},
      {.name = "dp2_tp2_pp2", .dp = 2, .tp = 2, .pp = 2, .accumulation = 2},
  };
  for (const Layout& h : hybrids) {
    v.push_back(h);
    Layout zero1 = h;
    zero1.name += "_zero1";
    zero1.stage = 1;
    v.push_back(zero1);
    Layout ckpt = h;
    ckpt.name += "_checkpointing";
    ckpt.checkpoint = true;
    v.push_back(ckpt);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ModelParallelFp32, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// LLaMA's variants (RMSNorm, RoPE, SwiGLU of an intermediate size that is not
// 4C, no biases, an untied head) under ZeRO-3 and tensor parallelism: k and v
// split by kv heads (2 kv heads on 2 ranks) or replicated with partial
// gradients (1 kv head on 2 ranks, 2 on 4).
struct LlamaLayout {
  Layout layout;
  int n_kv_head = 1;
};

class LlamaModelParallelFp32 : public ::testing::TestWithParam<LlamaLayout> {};

TEST_P(LlamaModelParallelFp32, MatchesTheReferenceAndIsBitIdenticalRunToRun) {
  const int n_kv_head = GetParam().n_kv_head;
  const auto llama = testing::llama_variant(n_kv_head);
  DataParallelRun ref_run = testing::layout(0, 0);
  ref_run.n_layer = kLayers;
  ref_run.n_head = kHeads;
  ref_run.model_variant = llama;
  const RunResult ref = testing::run_layout(ref_run);
  DataParallelRun r = run_of(GetParam().layout);
  r.model_variant = llama;
  const RunResult a = testing::run_layout(r);
  std::printf("%s, %d kv heads: max loss rel diff %.3g, params rel diff %.3g\n", GetParam().layout.name.c_str(),
              n_kv_head, testing::max_loss_rel_diff(a, ref), testing::param_rel_diff(a, ref));
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  const RunResult b = testing::run_layout(r);
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LlamaModelParallelFp32,
    ::testing::Values(LlamaLayout{{.name = "dp2_zero3", .dp = 2, .stage = 3}, 2},
                      LlamaLayout{{.name = "tp2_kv2", .tp = 2}, 2}, LlamaLayout{{.name = "tp2_kv1", .tp = 2}, 1},
                      LlamaLayout{{.name = "tp4_kv2", .tp = 4}, 2},
                      LlamaLayout{{.name = "tp2_sp_kv1", .tp = 2, .sequence_parallel = true}, 1},
                      LlamaLayout{{.name = "dp2_tp2_pp2_checkpointing_kv1", .dp = 2, .tp = 2, .pp = 2,
                                   .checkpoint = true, .accumulation = 2},
                                  1}),
    [](const ::testing::TestParamInfo<LlamaLayout>& i) { return i.param.layout.name; });

// The comparison can fail: with the tensor-parallel group's floating-point
// sums doubled (the partial gradients, and the activations' reductions), or
// the data-parallel group's on a hybrid.
TEST(ModelParallel, ADoubledReductionFailsTheComparison) {
  for (auto [l, axis] : {std::pair{Layout{.name = "tp2", .tp = 2}, MeshAxis::tp},
                         std::pair{Layout{.name = "dp2_tp2", .dp = 2, .tp = 2}, MeshAxis::dp}}) {
    DataParallelRun r = run_of(l);
    r.doubled_sums = axis;
    const ::testing::AssertionResult match = testing::matches_reference(testing::run_layout(r), reference(), 1e-5);
    EXPECT_FALSE(match) << l.name;
    EXPECT_CONTAINS(std::string(match.message()), "step-0 gradient of");
  }
}

// bf16 and fp16 on the 8-rank hybrid (with sequence parallelism and ZeRO-1)
// and on tensor parallelism alone stay within 1e-2 of the fp32 reference and
// are bit-identical run to run.
TEST(ModelParallel, MixedPrecisionMatchesTheReferenceWithin1e2) {
  for (DType precision : {DType::bf16, DType::f16}) {
    Layout hybrid{.name = "dp2_tp2_sp_pp2_zero1", .dp = 2, .tp = 2, .pp = 2, .sequence_parallel = true, .stage = 1,
                  .accumulation = 2};
    Layout tensor{.name = "tp2", .tp = 2};
    for (const Layout& l : {hybrid, tensor}) {
      DataParallelRun r = run_of(l);
      r.precision = precision;
      const RunResult a = testing::run_layout(r), b = testing::run_layout(r);
      const double loss = testing::max_loss_rel_diff(a, reference());
      std::printf("%s %s: max loss rel diff %.3g\n", l.name.c_str(), dtype_name(precision), loss);
      EXPECT_LE(loss, 1e-2) << l.name << " " << dtype_name(precision);
      EXPECT_TRUE(testing::bit_equal(a.params, b.params)) << l.name << " " << dtype_name(precision);
    }
  }
}

// Evaluation runs the forwards alone through the pipeline (gpipe over the
// chunks, so interleaved models too) and every rank gets the loss.
TEST(ModelParallel, ForwardOnlyLossMatchesTheReference) {
  const GPTConfig cfg = testing::small_gpt(0.0f, kLayers, kHeads);
  const std::vector<int32_t> data = testing::step_tokens(0, cfg.vocab_size);
  const MicroBatch mb{data.data(), data.data() + 1, {testing::kGlobal, testing::kT}, 0};
  Trainer reference_trainer(cfg, {}, nullptr);
  const double expected = reference_trainer.loss_sum(mb);
  TrainOptions opts;
  opts.model_parallel.schedule = PipelineSchedule::interleaved_1f1b;
  opts.model_parallel.virtual_stages = 2;
  opts.model_parallel.sequence_parallel = true;
  run_local(8, [&](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::pp] = 4;
    shape[MeshAxis::tp] = 2;
    DeviceMesh mesh(world, shape);
    Trainer trainer(cfg, opts, mesh);
    EXPECT_NEAR(trainer.loss_sum(mb), expected, 1e-5 * expected) << "rank " << world.rank();
  });
}

// The point of model parallelism: a model whose state does not fit one
// rank's device budget trains when its layers and matrices are split.
TEST(ModelParallel, AModelTooLargeForOneRankTrainsOnATensorByPipelineMesh) {
  GPTConfig cfg = testing::small_gpt(0.0f, kLayers, kHeads);
  cfg.n_embd = 128;
  const double state = 16.0 * static_cast<double>(cfg.num_params());  // fp32 parameters, gradients, moments
  const size_t budget = static_cast<size_t>(0.5 * state);
  const std::vector<int32_t> data = testing::step_tokens(0, cfg.vocab_size);
  const std::string error = testing::error_of([&] {
    run_local(1, [&](Communicator&) {
      MemoryContext::current().tier(Tier::device).set_budget(budget);
      Trainer trainer(cfg, {}, nullptr);
    });
  });
  EXPECT_CONTAINS(error, "budget");
  TrainOptions opts;
  opts.model_parallel.sequence_parallel = true;
  run_local(4, [&](Communicator& world) {
    MemoryContext::current().tier(Tier::device).set_budget(budget);
    MeshShape shape;
    shape[MeshAxis::pp] = 2;
    shape[MeshAxis::tp] = 2;
    DeviceMesh mesh(world, shape);
    Trainer trainer(cfg, opts, mesh);
    const std::vector<MicroBatch> mbs = testing::rank_micro_batches(data, 1, 0, 2);
    for (int step = 0; step < 2; ++step) EXPECT_TRUE(std::isfinite(trainer.step(mbs).loss));
    EXPECT_LE(MemoryContext::current().tier(Tier::device).peak(), budget);
  });
}

TEST(ModelParallel, RefusesZeroStagesThatShardGradientsUnderModelParallelism) {
  for (int stage : {2, 3}) {
    for (const Layout& l : {Layout{.name = "pp2", .pp = 2, .stage = stage, .accumulation = 2},
                            Layout{.name = "tp2", .tp = 2, .stage = stage}}) {
      const std::string error = testing::error_of([&] { testing::run_layout(run_of(l)); });
      EXPECT_CONTAINS(error, "ZeRO stage " + std::to_string(stage));
      EXPECT_CONTAINS(error, "zero.stage = 0 or 1");
    }
  }
}

}  // namespace
}  // namespace loom
