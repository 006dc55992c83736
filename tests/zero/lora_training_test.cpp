// Training with LoRA adapters (LoRAConfig): only the adapters change, data
// and model parallel layouts match the single-rank reference (with dropout
// on the adapters' inputs too), and a model whose full fine-tuning does not
// fit a device budget fine-tunes with LoRA.
#include <gtest/gtest.h>

#include <cstring>

#include "zero_test_util.h"

namespace loom {
namespace {

using testing::DataParallelRun;

LoRAConfig adapters(std::vector<std::string> targets) {
  LoRAConfig c;
  c.r = 4;
  c.alpha = 8.0f;
  c.targets = std::move(targets);
  return c;
}

bool is_adapter(const ParamSpec& p) { return p.name.find(".lora_") != std::string::npos; }

TEST(LoRATraining, OnlyTheAdaptersChangeAndTheLossDrops) {
  GPTConfig cfg = testing::small_gpt(0.0f);
  cfg.lora = adapters({"c_attn"});
  TrainOptions opts;
  opts.schedule = {1e-2f, 1e-3f, 2, 20};
  Trainer trainer(cfg, opts);
  const GPT& model = trainer.model();
  std::vector<float> init(static_cast<size_t>(model.layout().numel()));
  model.layout().initialize(init.data(), 0, model.layout().numel(), opts.seed);
  const std::vector<int32_t> data = testing::random_tokens(4 * 16 + 1, cfg.vocab_size, 9);
  const MicroBatch mb{data.data(), data.data() + 1, {4, 16}, 0};
  std::vector<float> losses;
  for (int s = 0; s < 20; ++s) losses.push_back(trainer.step({&mb, 1}).loss);
  // The same batch every step: the adapters alone fit it step by step.
  for (size_t s = 1; s < losses.size(); ++s) EXPECT_LT(losses[s], losses[s - 1]) << "step " << s;
  EXPECT_LT(losses.back(), losses.front() - 0.05f);
  const Trainer::State state = trainer.gather_state();
  int adapters_seen = 0;
  for (const ParamSpec& p : model.layout().params()) {
    int64_t changed = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel(); ++i)
      changed += state.params.data<float>()[i] != init[static_cast<size_t>(i)];
    if (is_adapter(p)) {
      ++adapters_seen;
      EXPECT_GT(changed, p.numel() / 2) << p.name;
    } else {
      EXPECT_EQ(changed, 0) << p.name << " belongs to the base model";
    }
  }
  EXPECT_EQ(adapters_seen, 2 * cfg.n_layer);
}

TEST(LoRATraining, ParallelLayoutsMatchTheReference) {
  DataParallelRun ref = testing::layout(0, 0);
  // Adapters on a column-parallel (c_attn) and a row-parallel (mlp.c_proj)
  // layer: each splits a different factor over tp.
  ref.lora = adapters({"c_attn", "mlp.c_proj"});
  const testing::RunResult reference = testing::run_layout(ref);
  std::vector<std::pair<std::string, DataParallelRun>> layouts;
  for (int stage : {2, 3}) layouts.push_back({"dp2 stage " + std::to_string(stage), testing::layout(2, stage)});
  DataParallelRun tp = testing::layout(1, 0);
  tp.tp = 2;
  layouts.push_back({"tp2", tp});
  tp.model_parallel.sequence_parallel = true;
  layouts.push_back({"tp2 sp", tp});
  DataParallelRun hybrid = testing::layout(2, 1);
  hybrid.tp = 2;
  layouts.push_back({"dp2 tp2 stage 1", hybrid});
  for (auto& [name, r] : layouts) {
    r.lora = ref.lora;
    EXPECT_TRUE(testing::matches_reference(testing::run_layout(r), reference, 1e-5)) << name;
  }
}

// LLaMA with an adapter on every projection (q, k, v and gate, up stacked
// into one GEMM each; one kv head, so k, v and their adapters are replicated
// over tp with partial gradients): tensor-parallel layouts, sequence
// parallelism included, match the reference.
TEST(LoRATraining, LlamaTensorParallelWithOneKvHeadMatchesTheReference) {
  const auto llama = testing::llama_variant(1);
  DataParallelRun ref = testing::layout(0, 0);
  ref.model_variant = llama;
  ref.lora = adapters({"q", "k", "v", "o", "gate", "up", "down"});
  const testing::RunResult reference = testing::run_layout(ref);
  for (bool sp : {false, true}) {
    DataParallelRun tp = testing::layout(1, 0);
    tp.tp = 2;
    tp.model_parallel.sequence_parallel = sp;
    tp.model_variant = llama;
    tp.lora = ref.lora;
    EXPECT_TRUE(testing::matches_reference(testing::run_layout(tp), reference, 1e-5)) << (sp ? "tp2 sp" : "tp2");
  }
}

// The losses, gradient norms and final parameters of a run, bits compared.
bool bit_identical(const testing::RunResult& a, const testing::RunResult& b) {
  if (a.stats.size() != b.stats.size() || a.params.size() != b.params.size()) return false;
  for (size_t s = 0; s < a.stats.size(); ++s)
    if (std::memcmp(&a.stats[s].loss, &b.stats[s].loss, sizeof(float)) != 0 ||
        std::memcmp(&a.stats[s].grad_norm, &b.stats[s].grad_norm, sizeof(a.stats[s].grad_norm)) != 0)
      return false;
  return std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)) == 0;
}

// Adapters with dropout (0.1) on column- and row-parallel layers: each
// adapter's mask is drawn by global element of its layer's input, so tensor
// parallelism (a row-parallel rank holds a column range of the input),
// sequence parallelism, data parallelism with ZeRO and gradient
// accumulation, a pipeline and activation checkpointing's recompute all draw
// the reference's masks and match it; the run repeats bit for bit, and
// dropout does change it.
void expect_adapter_dropout_layouts_match(const std::function<void(GPTConfig&)>& variant,
                                          const std::vector<std::string>& targets) {
  DataParallelRun ref = testing::layout(0, 0);
  ref.model_variant = variant;
  ref.lora = adapters(targets);
  ref.lora.dropout = 0.1f;
  const testing::RunResult reference = testing::run_layout(ref);
  EXPECT_TRUE(bit_identical(testing::run_layout(ref), reference)) << "the same run twice";
  DataParallelRun plain = ref;
  plain.lora.dropout = 0.0f;
  const testing::RunResult without = testing::run_layout(plain);
  EXPECT_GT(testing::max_loss_rel_diff(without, reference), 1e-5) << "dropout changes the losses too little";
  EXPECT_FALSE(testing::matches_reference(without, reference, 1e-5)) << "dropout changes nothing";

  std::vector<std::pair<std::string, DataParallelRun>> layouts;
  DataParallelRun tp = testing::layout(1, 0);
  tp.tp = 2;
  layouts.push_back({"tp2", tp});
  tp.model_parallel.sequence_parallel = true;
  layouts.push_back({"tp2 sp", tp});
  layouts.push_back({"dp2 zero2", testing::layout(2, 2)});
  layouts.push_back({"dp2 zero1 accumulation 2", testing::layout(2, 1, DType::f32, 2)});
  DataParallelRun pp = testing::layout(1, 0);
  pp.pp = 2;
  layouts.push_back({"pp2", pp});
  DataParallelRun checkpointed = testing::layout(0, 0);
  checkpointed.checkpoint_activations = true;
  layouts.push_back({"activation checkpointing", checkpointed});
  tp.checkpoint_activations = true;
  layouts.push_back({"tp2 sp activation checkpointing", tp});
  for (auto& [name, r] : layouts) {
    r.model_variant = variant;
    r.lora = ref.lora;
    EXPECT_TRUE(testing::matches_reference(testing::run_layout(r), reference, 1e-5)) << name;
  }
}

TEST(LoRATraining, AdapterDropoutLayoutsMatchTheReference) {
  expect_adapter_dropout_layouts_match({}, {"c_attn", "c_proj", "c_fc"});
}

// LLaMA's q, k, v (one kv head: k and v replicated over tp) and gate, up are
// parts of one stacked layer each, every part with its own mask.
TEST(LoRATraining, LlamaAdapterDropoutLayoutsMatchTheReference) {
  expect_adapter_dropout_layouts_match(testing::llama_variant(1), {"q", "k", "v", "o", "gate", "up", "down"});
}

// Under a device budget between the two runs' needs, full fine-tuning fails
// with the allocator's out-of-memory error and LoRA trains.
TEST(LoRATraining, FitsADeviceBudgetFullFineTuningDoesNot) {
  GPTConfig full = testing::ten_million();
  full.n_layer = 2;
  GPTConfig lora = full;
  lora.lora = adapters({"c_attn", "c_proj", "c_fc"});
  const std::vector<int32_t> data = testing::random_tokens(2 * 16 + 1, full.vocab_size, 4);
  const MicroBatch mb{data.data(), data.data() + 1, {2, 16}, 0};
  const auto train = [&](const GPTConfig& cfg, size_t budget) {
    MemoryContext context;
    MemoryContext::Install install(context);
    context.tier(Tier::device).set_budget(budget);
    Trainer trainer(cfg, TrainOptions{});
    for (int s = 0; s < 2; ++s) trainer.step({&mb, 1});
    return context.tier(Tier::device).peak();
  };
  const size_t lora_peak = train(lora, kUnlimited);
  const size_t budget = lora_peak + lora_peak / 10;
  EXPECT_NO_THROW(train(lora, budget));
  try {
    train(full, budget);
    FAIL() << "full fine-tuning fit in " << format_bytes(static_cast<double>(budget));
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of device memory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom
