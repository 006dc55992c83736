// Frozen parameters (FrozenParams): every store family trains the rest of the
// model as the single-rank reference does, leaves the frozen values as they
// were initialized, and holds no gradient or optimizer state for them.
#include <gtest/gtest.h>

#include "loom/planner.h"
#include "zero_test_util.h"

namespace loom {
namespace {

using testing::ten_million;

using testing::DataParallelRun;
using testing::RunResult;

// About half of small_gpt's parameters: the token table (tied to the head),
// a whole block and the other block's first MLP matrix.
const std::vector<std::string> kFreeze = {"wte", "h.0", "h.1.mlp.c_fc"};

bool is_frozen(const std::string& name, const std::vector<std::string>& entries) {
  for (const std::string& e : entries)
    if (name == e || name.starts_with(e + ".")) return true;
  return false;
}


// Frozen elements of a layout: the parameters `entries` name, and those the
// model freezes itself.
int64_t frozen_numel(const GPT& model, const std::vector<std::string>& entries) {
  int64_t n = 0;
  for (const ParamSpec& p : model.layout().params())
    if (is_frozen(p.name, entries) || !p.trainable) n += p.numel();
  return n;
}

DataParallelRun frozen_run(DataParallelRun r) {
  r.freeze = kFreeze;
  return r;
}

const RunResult& reference() {
  static const RunResult ref = testing::run_layout(frozen_run(testing::layout(0, 0)));
  return ref;
}

using Case = testing::NamedLayout;

class FrozenLayouts : public ::testing::TestWithParam<Case> {};

TEST_P(FrozenLayouts, MatchTheReferenceAndLeaveFrozenValuesAsInitialized) {
  const RunResult a = testing::run_layout(frozen_run(GetParam().run));
  const RunResult& ref = reference();
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
  GPT model(ref.model);
  ASSERT_GT(frozen_numel(model, kFreeze) * 3, model.layout().numel());
  std::vector<float> init(static_cast<size_t>(model.layout().numel()));
  model.layout().initialize(init.data(), 0, model.layout().numel(), TrainOptions{}.seed);
  for (const ParamSpec& p : model.layout().params()) {
    int64_t changed = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i)
      changed += a.params[static_cast<size_t>(i)] != init[static_cast<size_t>(i)];
    if (is_frozen(p.name, kFreeze)) {
      EXPECT_EQ(changed, 0) << p.name << " is frozen";
      for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
        ASSERT_EQ(a.exp_avg[static_cast<size_t>(i)], 0.0f) << p.name;
        ASSERT_EQ(a.grads[static_cast<size_t>(i)], 0.0f) << p.name;
      }
    } else if (p.init.kind == ParamInit::Kind::normal) {
      EXPECT_GT(changed, p.numel() / 2) << p.name << " trains";
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> v{{"reference", testing::layout(0, 0)}};
  for (Case& c : testing::store_family_layouts()) v.push_back(std::move(c));
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, FrozenLayouts, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Freezing some of the parameters a Linear stacks into one GEMM (LLaMA's k
// of q | k | v, up of gate | up) leaves the others' gradients as they are
// without freezing, bit for bit, and the frozen ones without gradient.
TEST(Frozen, PartOfAStackedLinear) {
  DataParallelRun run = testing::layout(0, 0);
  run.model_variant = testing::llama_variant(2);
  const RunResult all = testing::run_layout(run);
  run.freeze = {"h.0.attn.k", "h.1.mlp.up"};
  const RunResult some = testing::run_layout(run);
  const GPT model(some.model);
  int frozen = 0;
  for (const ParamSpec& p : model.layout().params()) {
    const auto at = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + p.offset, v.begin() + p.offset + p.numel());
    };
    if (is_frozen(p.name, run.freeze)) {
      ++frozen;
      EXPECT_EQ(at(some.grads), std::vector<float>(static_cast<size_t>(p.numel()), 0.0f)) << p.name;
    } else {
      EXPECT_EQ(at(some.grads), at(all.grads)) << p.name;
    }
  }
  EXPECT_EQ(frozen, 2);
}

TEST(Frozen, UnknownEntryIsAnErrorNamingIt) {
  TrainOptions opts;
  opts.freeze = {"h.0.atn"};
  try {
    Trainer t(testing::small_gpt(0.0f), opts);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"h.0.atn\""), std::string::npos) << e.what();
  }
  opts.freeze = {"wte", "wpe", "h", "ln_f"};
  EXPECT_THROW(Trainer(testing::small_gpt(0.0f), opts), Error);  // nothing left to train
}

TEST(Frozen, StateSavedUnderOneLayoutLoadsUnderAnother) {
  TrainOptions opts;
  opts.freeze = kFreeze;
  const GPTConfig cfg = testing::small_gpt(0.0f);
  Trainer reference(cfg, opts);
  Trainer::State saved = reference.gather_state();
  // Values no initialization gives, frozen parameters included.
  float* p = saved.params.data<float>();
  for (int64_t i = 0; i < saved.params.numel(); ++i) p[i] = 0.001f * static_cast<float>(i % 97) - 0.05f;
  for (const DataParallelRun& layout : {testing::layout(2, 3), testing::layout(2, 1)}) {
    std::vector<float> loaded;
    run_local(2, [&](Communicator& world) {
      TrainOptions o = opts;
      o.zero.stage = layout.stage;
      Trainer t(cfg, o, &world);
      t.load_state(saved);
      const Trainer::State back = t.gather_state();
      if (world.rank() == 0) loaded = testing::to_vector(back.params);
    });
    EXPECT_EQ(loaded, testing::to_vector(saved.params)) << "stage " << layout.stage;
  }
}

// Model-state bytes per rank, read from the device allocator after a step:
// the frozen parameters in the working precision, and the trainable ones as
// the ZeRO formula has them.
struct MemoryCase {
  int stage;
  DType precision;
};

class FrozenModelState : public ::testing::TestWithParam<MemoryCase> {};

// Device bytes per rank after two steps (everything a step allocates beyond
// the model state is freed by its end).
std::vector<double> model_state_bytes(const GPTConfig& cfg, const TrainOptions& base, int ranks) {
  std::vector<double> measured(static_cast<size_t>(ranks), 0.0);
  run_local(ranks, [&](Communicator& world) {
    Allocator& device = MemoryContext::current().tier(Tier::device);
    const size_t before = device.used();
    Trainer trainer(cfg, base, &world);
    const std::vector<int32_t> data = testing::random_tokens(ranks * 8 + 1, cfg.vocab_size, 5);
    MicroBatch mb{data.data() + world.rank() * 8, data.data() + world.rank() * 8 + 1, {1, 8}, world.rank()};
    trainer.step({&mb, 1});
    trainer.step({&mb, 1});
    measured[static_cast<size_t>(world.rank())] = static_cast<double>(device.used() - before);
  });
  return measured;
}

void expect_formula(const GPTConfig& cfg, const std::vector<std::string>& freeze, const MemoryCase& c) {
  constexpr int kRanks = 2;
  const GPT whole(cfg);
  const double frozen = static_cast<double>(frozen_numel(whole, freeze));
  const double trainable = static_cast<double>(whole.layout().numel()) - frozen;
  ASSERT_GT(frozen, 2.0 * trainable);
  const double expected = frozen * static_cast<double>(dtype_size(c.precision)) +
                          zero_model_state_bytes(c.stage, c.precision, trainable, kRanks);
  TrainOptions opts;
  opts.zero.stage = c.stage;
  opts.zero.precision = c.precision;
  opts.freeze = freeze;
  const std::vector<double> measured = model_state_bytes(cfg, opts, kRanks);
  for (int r = 0; r < kRanks; ++r)
    EXPECT_NEAR(measured[static_cast<size_t>(r)] / expected, 1.0, 0.02)
        << "rank " << r << ": " << format_bytes(measured[static_cast<size_t>(r)]) << ", formula "
        << format_bytes(expected);
}

TEST_P(FrozenModelState, BytesPerRankAreFrozenWeightsPlusTheZeroFormulaOfTheRest) {
  expect_formula(ten_million(), {"h.0", "h.1", "h.2"}, GetParam());
}

// LoRA: the base weights (frozen) and the adapters' weights, gradients and
// optimizer state alone.
TEST_P(FrozenModelState, LoRABytesPerRankAreBaseWeightsPlusTheAdaptersState) {
  GPTConfig cfg = ten_million();
  cfg.lora.r = 8;
  cfg.lora.targets = {"c_attn", "c_proj", "c_fc"};
  expect_formula(cfg, {}, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Stages, FrozenModelState,
                         ::testing::Values(MemoryCase{0, DType::f32}, MemoryCase{1, DType::f32},
                                           MemoryCase{2, DType::f32}, MemoryCase{3, DType::f32},
                                           MemoryCase{0, DType::bf16}, MemoryCase{2, DType::bf16},
                                           MemoryCase{3, DType::bf16}),
                         [](const ::testing::TestParamInfo<MemoryCase>& i) {
                           return std::string(dtype_name(i.param.precision)) + "_stage" +
                                  std::to_string(i.param.stage);
                         });

}  // namespace
}  // namespace loom
