// 2D (Optimus), 2.5D (Tesseract) and 3D tensor parallelism, alone and composed
// with data parallelism, ZeRO-1, pipeline parallelism and activation
// checkpointing, for GPT-2 and a LLaMA-shaped model: each reproduces the
// single-rank fp32 reference and is bit-identical run to run.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "loom/planner.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;
using testing::RunResult;

// 4 heads (2 kv heads for LLaMA) and 64 columns split over a grid side of 2;
// vocabulary 61 pads to 62.
constexpr int kLayers = 4, kHeads = 4;

struct GridLayout {
  std::string name;
  int q = 2, depth = 1;
  bool cube = false;  // 3D: depth q
  int dp = 1, pp = 1;
  int stage = 0;
  bool checkpoint = false;
  int accumulation = 1;
  bool llama = false;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;
};

DataParallelRun run_of(const GridLayout& l) {
  DataParallelRun r = testing::layout(l.dp, l.stage, DType::f32, l.accumulation);
  r.tp = l.q * l.q * l.depth;
  r.grid = {l.q, l.depth, l.cube};
  r.pp = l.pp;
  r.mesh = true;
  r.n_layer = kLayers;
  r.n_head = kHeads;
  r.checkpoint_activations = l.checkpoint;
  r.model_parallel.schedule = l.schedule;
  r.model_parallel.virtual_stages = l.virtual_stages;
  if (l.llama) r.model_variant = testing::llama_variant(2);
  return r;
}

// The single-rank reference of the GPT-2 or the LLaMA-shaped model.
RunResult reference_run(bool llama) {
  DataParallelRun r = testing::layout(0, 0);
  r.n_layer = kLayers;
  r.n_head = kHeads;
  if (llama) r.model_variant = testing::llama_variant(2);
  return testing::run_layout(r);
}

const RunResult& reference(bool llama) {
  static const RunResult gpt2 = reference_run(false), llama_ref = reference_run(true);
  return llama ? llama_ref : gpt2;
}

class GridParallelFp32 : public ::testing::TestWithParam<GridLayout> {};

TEST_P(GridParallelFp32, MatchesTheReferenceAndIsBitIdenticalRunToRun) {
  const GridLayout l = GetParam();
  const RunResult a = testing::run_layout(run_of(l));
  ASSERT_EQ(a.stats.size(), 20u);
  const RunResult& ref = reference(l.llama);
  std::printf("%s: max loss rel diff %.3g, params rel diff %.3g\n", l.name.c_str(), testing::max_loss_rel_diff(a, ref),
              testing::param_rel_diff(a, ref));
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  const RunResult b = testing::run_layout(run_of(l));
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, b.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, b.params));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, b.exp_avg_sq));
}

std::vector<GridLayout> layouts() {
  std::vector<GridLayout> v;
  for (bool llama : {false, true}) {
    const std::string model = llama ? "llama_" : "gpt2_";
    for (const auto& [mode, depth, cube] :
         {std::tuple{"2d", 1, false}, std::tuple{"2p5d", 2, false}, std::tuple{"3d", 2, true}}) {
      const std::string p = model + mode;
      v.push_back({.name = p, .depth = depth, .cube = cube, .llama = llama});
      v.push_back({.name = p + "_dp2_zero1", .depth = depth, .cube = cube, .dp = 2, .stage = 1, .llama = llama});
      v.push_back(
          {.name = p + "_pp2_1f1b", .depth = depth, .cube = cube, .pp = 2, .accumulation = 2, .llama = llama});
      v.push_back({.name = p + "_checkpointing", .depth = depth, .cube = cube, .checkpoint = true, .llama = llama});
    }
    // The other schedules: GPipe on 2.5D, interleaved 1F1B (two chunks of one
    // layer per stage) on 3D.
    v.push_back({.name = model + "2p5d_pp2_gpipe", .depth = 2, .pp = 2, .accumulation = 2, .llama = llama,
                 .schedule = PipelineSchedule::gpipe});
    v.push_back({.name = model + "3d_pp2_interleaved", .depth = 2, .cube = true, .pp = 2, .accumulation = 2,
                 .llama = llama, .schedule = PipelineSchedule::interleaved_1f1b, .virtual_stages = 2});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GridParallelFp32, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<GridLayout>& i) { return i.param.name; });

// bf16 and fp16 on each grid stay within 1e-2 of the fp32 reference, as 1D
// tensor parallelism's do (ModelParallel.MixedPrecisionMatchesTheReference-
// Within1e2), and are bit-identical run to run.
TEST(GridParallel, MixedPrecisionMatchesTheReferenceWithin1e2) {
  for (DType precision : {DType::bf16, DType::f16})
    for (const GridLayout& l : {GridLayout{.name = "2d"}, GridLayout{.name = "2.5d", .depth = 2},
                                GridLayout{.name = "3d", .depth = 2, .cube = true}}) {
      DataParallelRun r = run_of(l);
      r.precision = precision;
      const RunResult a = testing::run_layout(r), b = testing::run_layout(r);
      const double loss = testing::max_loss_rel_diff(a, reference(false));
      std::printf("%s %s: max loss rel diff %.3g\n", l.name.c_str(), dtype_name(precision), loss);
      EXPECT_LE(loss, 1e-2) << l.name << " " << dtype_name(precision);
      EXPECT_TRUE(testing::bit_equal(a.params, b.params)) << l.name << " " << dtype_name(precision);
    }
}

// Every rank sends, over its grid's groups, the elements the documented
// per-step volume says (grid_step_elements_sent), step after step, for
// GPT-2 and LLaMA on each grid and with two micro-batches.
TEST(GridParallel, EveryRankSendsTheDocumentedVolumePerStep) {
  for (bool llama : {false, true})
    for (const GridLayout& l : {GridLayout{.name = "2d"}, GridLayout{.name = "2.5d", .depth = 2},
                                GridLayout{.name = "3d", .depth = 2, .cube = true},
                                GridLayout{.name = "3d accumulate", .depth = 2, .cube = true, .accumulation = 2}}) {
      GPTConfig cfg = testing::small_gpt(0.0f, kLayers, kHeads);
      if (llama) testing::llama_variant(2)(cfg);
      const TensorGridShape shape{l.q, l.depth, l.cube};
      const std::vector<int32_t> data = testing::step_tokens(0, cfg.vocab_size);
      std::vector<double> sent(static_cast<size_t>(shape.ranks()), 0.0);
      run_local(shape.ranks(), [&](Communicator& world) {
        MeshShape mesh_shape;
        mesh_shape[MeshAxis::tp] = shape.ranks();
        DeviceMesh mesh(world, mesh_shape, shape);
        Trainer trainer(cfg, {}, mesh);
        const std::vector<MicroBatch> mbs = testing::rank_micro_batches(data, 1, 0, l.accumulation);
        const TensorGrid& g = *mesh.tensor_grid();
        const std::set<Communicator*> groups{g.hidden_group, g.weight_group,      g.depth_group,
                                             g.token_group,  g.inner_token_group, g.table_group};
        const auto elements = [&] {
          double e = 0.0;
          for (Communicator* c : groups) e += c->stats().sent().elements;
          return e;
        };
        trainer.step(mbs);
        const double before = elements();
        trainer.step(mbs);
        sent[static_cast<size_t>(world.rank())] = elements() - before;
      });
      const double expected = grid_step_elements_sent(cfg, testing::kGlobal / l.accumulation, testing::kT,
                                                      l.accumulation, shape);
      for (size_t r = 0; r < sent.size(); ++r)
        EXPECT_NEAR(sent[r] / expected, 1.0, 1e-12)
            << (llama ? "llama " : "gpt2 ") << l.name << " rank " << r << ": " << sent[r] << " vs " << expected;
    }
}

// The comparison can fail: with the grid's floating-point sums doubled.
TEST(GridParallel, ADoubledReductionFailsTheComparison) {
  for (const GridLayout& l : {GridLayout{.name = "2d"}, GridLayout{.name = "3d", .depth = 2, .cube = true}}) {
    DataParallelRun r = run_of(l);
    r.doubled_sums = MeshAxis::tp;
    EXPECT_FALSE(testing::matches_reference(testing::run_layout(r), reference(false), 1e-5)) << l.name;
  }
}

}  // namespace
}  // namespace loom
