// The layout rules (planner.h) are the config check's: on every candidate a
// search over a small grid enumerates, plan_training accepts exactly the
// layouts check_layout accepts and rejects the others with the same message,
// and every rule is the reason for rejecting some candidate.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "loom/config.h"
#include "loom/planner.h"
#include "loom/train.h"

namespace loom {
namespace {

struct Grid {
  const char* what;
  std::vector<std::string> model;  // model.* and train.* settings
  int64_t world;
};

// Small custom models whose shapes make every rule fire on some layout of
// `world` ranks: 6 heads that 4 ranks cannot split and 5 layers that 4
// virtual stages cannot; kv heads that 3 ranks can neither split nor share
// and a vocabulary smaller than 6 ranks; an MLP width 4 ranks cannot split,
// 7-token sequences that 2 ranks cannot, and 3 micro-batches per rank that
// an interleaved pipeline of 2 cannot group.
const std::vector<Grid>& grids() {
  static const std::vector<Grid> g{
      {"gpt, 6 heads on 4 ranks",
       {"model.n_layer=5", "model.n_head=6", "model.n_embd=48", "model.vocab_size=64", "model.block_size=16",
        "train.seq_len=6", "train.batch_size=4"},
       4},
      {"gqa, 2 kv heads on 6 ranks",
       {"model.n_layer=3", "model.n_head=6", "model.n_kv_head=2", "model.packed_qkv=false", "model.n_embd=24", "model.intermediate_size=24",
        "model.vocab_size=5", "data.vocab_size=4", "model.block_size=8", "train.seq_len=8", "train.batch_size=6"},
       6},
      {"mlp width 6 and 7-token sequences on 4 ranks",
       {"model.n_layer=4", "model.n_head=4", "model.n_embd=16", "model.intermediate_size=6", "model.vocab_size=32",
        "model.block_size=8", "train.seq_len=7", "train.batch_size=6"},
       4},
  };
  return g;
}

Config grid_config(const Grid& grid, const Layout* layout) {
  Config c(loom_schema());
  c.set_override("model.preset=custom");
  c.set_override("data.vocab_size=4");
  for (const std::string& s : grid.model) c.set_override(s);
  if (layout)
    for (const std::string& s : layout_settings(*layout)) c.set_override(s);
  return c;
}

LayoutProblem problem_of(const Config& c, const GPTConfig& model) {
  return LayoutProblem{.model = model,
                       .global_batch = c.get<int64_t>("train.batch_size"),
                       .seq_len = c.get<int64_t>("train.seq_len"),
                       .stage_layers_given = false,
                       .model_shape_settable = true};
}

TEST(LayoutRules, ConfigCheckAgreesWithTheRulesOnEveryCandidate) {
  std::map<std::string, int> rejected_by;
  for (const Grid& grid : grids()) {
    SCOPED_TRACE(grid.what);
    const Config base = grid_config(grid, nullptr);
    const LayoutProblem problem = problem_of(base, model_config_from(base));
    std::vector<Layout> candidates = layout_candidates(problem, grid.world);
    // The search enumerates the grids each tp forms; variants in every mode
    // (grids the tp does not form among them) hold the grid rules to the
    // config check.
    for (size_t i = 0, n = candidates.size(); i < n; ++i)
      for (const auto& [mode, depth] : {std::pair{TensorParallelMode::two_d, 1}, {TensorParallelMode::two_d, 2},
                                        {TensorParallelMode::two_and_half_d, 2}, {TensorParallelMode::three_d, 1}}) {
        Layout variant = candidates[i];
        variant.tp_mode = mode;
        variant.tp_depth = depth;
        candidates.push_back(variant);
      }
    int valid = 0;
    for (const Layout& layout : candidates) {
      const Config c = grid_config(grid, &layout);
      const std::optional<LayoutViolation> broken = check_layout(problem, layout);
      std::string thrown;
      try {
        const TrainPlan plan = plan_training(c);
        EXPECT_EQ(plan.dp * plan.tp * plan.pp, grid.world);
      } catch (const ConfigError& e) {
        thrown = e.what();
      }
      if (broken) {
        ++rejected_by[broken->rule];
        ASSERT_EQ(thrown, ConfigError(c, broken->key, broken->problem, broken->fix).what())
            << "rule " << broken->rule << " on " << layout_settings(layout)[0] << " " << layout_settings(layout)[1];
      } else {
        ++valid;
        ASSERT_EQ(thrown, "") << "check_layout accepts a layout plan_training rejects";
      }
    }
    EXPECT_GT(valid, 0);
  }
  // grid_divides_model needs a grid side (3 and up) that these worlds cannot
  // form; PlanTraining.InvalidGridsNameTheFix holds it (tp = 9).
  for (const LayoutRule& rule : layout_rules())
    if (std::string_view(rule.name) != "grid_divides_model") {
      EXPECT_GT(rejected_by[rule.name], 0) << "no candidate is rejected by " << rule.name;
    }
}

TEST(LayoutRules, CandidatesCoverEveryFactorizationOfTheWorld) {
  const Config c = grid_config(grids()[0], nullptr);
  const std::vector<Layout> candidates = layout_candidates(problem_of(c, model_config_from(c)), 4);
  std::set<std::tuple<int64_t, int64_t, int64_t>> shapes;
  for (const Layout& l : candidates) {
    ASSERT_EQ(l.dp * l.tp * l.pp, 4);
    shapes.insert({l.dp, l.tp, l.pp});
  }
  // (dp, tp, pp) with dp * tp * pp = 4: 6 factorizations.
  EXPECT_EQ(shapes.size(), 6u);
}

TEST(LayoutRules, StageLayersLiftTheEvenSplitRule) {
  const Config c = grid_config(grids()[1], nullptr);  // 3 layers
  LayoutProblem problem = problem_of(c, model_config_from(c));
  const Layout layout{.dp = 1, .tp = 1, .pp = 2, .schedule = PipelineSchedule::interleaved_1f1b, .virtual_stages = 2,
                      .micro_batch = 1};
  problem.global_batch = 4;
  ASSERT_TRUE(check_layout(problem, layout));
  EXPECT_EQ(check_layout(problem, layout)->rule, "layer_per_virtual_stage");
  problem.model.n_layer = 6;
  EXPECT_EQ(check_layout(problem, layout)->rule, "interleaving_splits_layers_evenly");
  EXPECT_NE(check_layout(problem, layout)->fix.find("parallel.stage_layers = \"2,2,1,1\""), std::string::npos);
  problem.stage_layers_given = true;
  EXPECT_FALSE(check_layout(problem, layout));
}

}  // namespace
}  // namespace loom
