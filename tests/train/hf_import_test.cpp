// Hugging Face checkpoints as a run's weights: the GPT-2 fixture imported
// gives transformers' logits and loss; imported under data, tensor and
// pipeline parallelism, ZeRO-3 and chunk offload it is the same model and
// trains the same; export then import is an identity in the stored dtype; a
// broken checkpoint is an error naming the file and the tensor or key before
// anything is allocated.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "hf/hf_fixtures.h"
#include "loom/config.h"
#include "loom/device.h"
#include "loom/train.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::DataParallelRun;
using testing::error_of;
using testing::hf_fixture;
using testing::Raw;
using testing::RunResult;
using testing::TempDir;

// The fixtures, each opened once.
const HFImport& fixture(const std::string& name) {
  static std::map<std::string, std::unique_ptr<HFImport>> opened;
  std::unique_ptr<HFImport>& src = opened[name];
  if (!src) src = std::make_unique<HFImport>(hf_fixture(name));
  return *src;
}

TEST(HFImport, Gpt2FixtureGivesTransformersLogitsAndLoss) {
  const HFImport& src = fixture("gpt2");
  EXPECT_EQ(src.model.n_layer, 2);
  EXPECT_EQ(src.model.vocab_size, 96);
  GPT model(src.model);
  ParamStore ps(model.layout(), 0);
  load_hf_weights(src, model, ps);

  const SafetensorsReader ref(fs::path(LOOM_SOURCE_DIR) / "tests/fixtures/hf/gpt2.reference.safetensors");
  const Tensor ids = ref.load("input_ids"), want = ref.load("logits");
  const int64_t B = ids.shape()[0], T = ids.shape()[1], V = src.model.vocab_size;
  const std::vector<int32_t> targets = testing::next_token_targets(ids);
  MicroBatchState s;
  ForwardOptions fo;
  fo.training = false;
  model.forward(ps, s, ids.data<int32_t>(), targets.data(), {B, T}, fo);
  const Tensor got = s.logits.clone(Tier::host);
  ASSERT_EQ(got.numel(), B * T * V);
  double worst = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(got.data<float>()[i]) - want.data<float>()[i]));
  std::printf("max abs logit difference %.3g\n", worst);
  EXPECT_LE(worst, 1e-5);
  const double loss = s.host_loss_sum() / static_cast<double>(B * (T - 1));
  const double want_loss = ref.load("loss").data<float>()[0];
  EXPECT_NEAR(loss, want_loss, 1e-5 * want_loss);
}

// ---------------------------------------------------------------------------
// Layouts
// ---------------------------------------------------------------------------

DataParallelRun imported(DataParallelRun r, const HFImport& src) {
  r.model = src.model;
  r.n_head = static_cast<int>(src.model.n_head);
  r.init = [&src](Trainer& t) { load_hf_weights(src, t); };
  return r;
}

const RunResult& imported_reference(const std::string& name) {
  static std::map<std::string, RunResult> refs;
  if (!refs.contains(name)) refs[name] = testing::run_layout(imported(testing::layout(0, 0), fixture(name)));
  return refs.at(name);
}

// A LoRA run from a checkpoint: the base holds the checkpoint's tensors and
// the adapters, which it lacks, their fresh initialization, on one rank and
// under ZeRO-3 (which loads only each rank's own parameters).
TEST(HFImport, ALoRARunImportsTheBaseAndDrawsItsAdaptersFresh) {
  const HFImport& src = fixture("llama");
  GPT plain(src.model);
  ParamStore base(plain.layout(), 0);
  load_hf_weights(src, plain, base);
  const std::vector<float> base_values = testing::to_vector(base.flat());
  for (const DataParallelRun& layout : {testing::layout(0, 0), testing::layout(2, 3)}) {
    DataParallelRun r = imported(layout, src);
    r.lora = LoRAConfig{.r = 2, .alpha = 4.0f, .dropout = 0.0f, .targets = {"q", "v", "down"}};
    const RunResult res = testing::run_layout(r);
    const GPT model(res.model);
    std::vector<float> fresh(static_cast<size_t>(model.layout().numel()));
    model.layout().initialize(fresh.data(), 0, model.layout().numel(), testing::small_options(r).seed);
    int adapters = 0;
    for (const ParamSpec& p : model.layout().params()) {
      const auto initial = res.initial_params.begin() + p.offset;
      const bool in_checkpoint = src.map.by_loom(p.name) != nullptr;
      adapters += !in_checkpoint;
      const auto want = in_checkpoint ? base_values.begin() + plain.layout().param(plain.layout().find(p.name)).offset
                                      : fresh.begin() + p.offset;
      EXPECT_TRUE(std::equal(initial, initial + p.numel(), want)) << p.name << " under dp " << layout.dp;
    }
    EXPECT_EQ(adapters, 2 * 3 * src.model.n_layer);
  }
}

struct ImportLayout {
  std::string name;
  std::string fixture;  // tests/fixtures/hf/<fixture>
  DataParallelRun run;
};

class ImportedUnderLayout : public ::testing::TestWithParam<ImportLayout> {};

TEST_P(ImportedUnderLayout, HoldsTheSameWeightsAndTrainsAsSingleRank) {
  const HFImport& src = fixture(GetParam().fixture);
  const RunResult& ref = imported_reference(GetParam().fixture);
  // The reference holds the checkpoint's tensors, not a fresh initialization.
  const HFParam& wte = *src.map.by_loom("wte.weight");
  std::vector<float> table(static_cast<size_t>(shape_numel(wte.loom_shape)));
  src.checkpoint.read_param(wte, table.data());
  GPT whole(src.model);
  const ParamSpec& wte_spec = whole.layout().param(whole.layout().find("wte.weight"));
  ASSERT_EQ(ref.initial_params.size(), static_cast<size_t>(whole.layout().numel()));
  for (size_t i = 0; i < table.size(); ++i)
    ASSERT_EQ(ref.initial_params[static_cast<size_t>(wte_spec.offset) + i], table[i]) << "wte element " << i;

  const RunResult a = testing::run_layout(imported(GetParam().run, src));
  EXPECT_TRUE(testing::bit_equal(a.initial_params, ref.initial_params));
  ASSERT_EQ(a.stats.size(), 20u);
  std::printf("%s: max loss rel diff %.3g, params rel diff %.3g\n", GetParam().name.c_str(),
              testing::max_loss_rel_diff(a, ref), testing::param_rel_diff(a, ref));
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
}

// GPT-2 and LLaMA (GQA with 2 key/value heads, llama3 RoPE, untied head;
// and one key/value head, replicated over tensor-parallel ranks).
std::vector<ImportLayout> import_layouts() {
  std::vector<ImportLayout> v;
  for (const std::string fixture : {"gpt2", "llama", "llama_mqa"}) {
    v.push_back({fixture + "_dp2_zero3", fixture, testing::layout(2, 3)});
    DataParallelRun tp = testing::layout(1, 0);
    tp.tp = 2;
    v.push_back({fixture + "_tp2", fixture, tp});
    if (fixture == "llama_mqa") continue;  // the layouts below see nothing of the key/value heads
    DataParallelRun pp = testing::layout(1, 0);
    pp.pp = 2;
    v.push_back({fixture + "_pp2", fixture, pp});
    DataParallelRun offload = testing::layout(2, 3);
    offload.memory.policy = MemoryPolicy::fixed;
    offload.memory.offload_param_frac = 0.5;
    offload.memory.offload_optim_frac = 0.5;
    offload.memory.chunk_bytes = 128 << 10;  // several chunks
    v.push_back({fixture + "_dp2_chunk_offload", fixture, offload});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(HFImport, ImportedUnderLayout, ::testing::ValuesIn(import_layouts()),
                         [](const auto& info) { return info.param.name; });

TEST(TrainerLoadWeights, EachRankFillsOnlyThePiecesItHolds) {
  const GPTConfig cfg = testing::small_gpt(0.0f);
  const int64_t whole = GPT(cfg).layout().numel();
  for (const bool tensor_parallel : {false, true}) {
    std::mutex mu;
    std::vector<int64_t> filled;
    DataParallelRun r = testing::layout(2, tensor_parallel ? 0 : 3);
    if (tensor_parallel) {
      r.dp = 1;
      r.tp = 2;
    }
    r.steps = 1;
    r.init = [&](Trainer& t) {
      int64_t n = 0;
      t.load_weights([&](const ParamLayout& layout, FlatRange range, float* params) {
        layout.initialize(params, range.begin, range.numel(), 5);
        n += range.numel();
      });
      const std::lock_guard lock(mu);
      filled.push_back(n);
    };
    testing::run_layout(r);
    ASSERT_EQ(filled.size(), 2u);
    int64_t total = 0;
    for (int64_t n : filled) {
      EXPECT_LT(n, whole) << (tensor_parallel ? "tp2" : "dp2 ZeRO-3");
      total += n;
    }
    EXPECT_GE(total, whole);
  }
}

// ---------------------------------------------------------------------------
// Export, then import
// ---------------------------------------------------------------------------

std::vector<float> flat_of(const ParamStore& ps) {
  const HostSection host;
  const Tensor f = ps.flat();
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

std::vector<float> imported_flat(const fs::path& dir) {
  const HFImport src(dir);
  GPT model(src.model);
  ParamStore ps(model.layout(), 99);
  load_hf_weights(src, model, ps);
  return flat_of(ps);
}

TEST(HFExport, ThenImportIsAnIdentityInTheStoredDtype) {
  TempDir dir;
  const GPTConfig cfg = testing::small_gpt(0.0f);
  GPT model(cfg);
  ParamStore ps(model.layout(), 7);
  const std::vector<float> source = flat_of(ps);

  HFExportOptions f32;
  export_hf(model, ps, dir / "f32", f32);
  EXPECT_EQ(imported_flat(dir / "f32"), source);

  HFExportOptions bf16;
  bf16.dtype = DType::bf16;
  export_hf(model, ps, dir / "bf16", bf16);
  std::vector<float> rounded(source.size());
  {
    std::vector<uint16_t> stored(source.size());
    convert(source.data(), DType::f32, stored.data(), DType::bf16, static_cast<int64_t>(source.size()));
    convert(stored.data(), DType::bf16, rounded.data(), DType::f32, static_cast<int64_t>(source.size()));
  }
  EXPECT_NE(rounded, source);  // the rounding is visible, so the comparison below can fail
  const std::vector<float> back = imported_flat(dir / "bf16");
  EXPECT_EQ(back, rounded);
  // Exported again in bf16, the imported weights are the same bytes.
  const HFImport src(dir / "bf16");
  GPT again(src.model);
  ParamStore again_ps(again.layout(), 0);
  load_hf_weights(src, again, again_ps);
  export_hf(again, again_ps, dir / "bf16_again", bf16);
  EXPECT_EQ(read_file(dir / "bf16" / "model.safetensors"), read_file(dir / "bf16_again" / "model.safetensors"));
}

// A LLaMA-class model (grouped-query attention, untied head, llama3 RoPE)
// exports as LlamaForCausalLM and imports back to the same model and bytes.
// With model.head_dim apart from n_embd / n_head (heads 24 wide beside
// 64 / 4 = 16), config.json's head_dim carries it.
TEST(HFExport, ALlamaModelRoundTripsThroughTheLlamaArchitecture) {
  for (int64_t head_size : {0, 24}) {
    TempDir dir;
    GPTConfig cfg = GPTConfig::preset("llama-tiny");
    cfg.tied_embeddings = false;
    cfg.rope_scaling = fixture("llama").model.rope_scaling;
    cfg.head_size = head_size;
    cfg.validate();
    GPT model(cfg);
    ParamStore ps(model.layout(), 5);
    export_hf(model, ps, dir / "llama");
    const nlohmann::json config = nlohmann::json::parse(read_file(dir / "llama" / "config.json"));
    EXPECT_EQ(config.at("architectures").at(0), "LlamaForCausalLM");
    EXPECT_EQ(config.at("num_key_value_heads"), cfg.n_kv_head);
    EXPECT_EQ(config.at("head_dim"), cfg.head_dim());
    EXPECT_EQ(config.at("rope_scaling").at("rope_type"), "llama3");
    const HFImport back(dir / "llama");
    EXPECT_TRUE(back.model == cfg) << "head_dim " << head_size;
    EXPECT_EQ(imported_flat(dir / "llama"), flat_of(ps));
  }
}

TEST(HFExport, AGpt2WhoseHeadsAreNotNEmbdWideIsRefused) {
  TempDir dir;
  GPTConfig cfg = testing::small_gpt(0.0f);
  cfg.head_size = 8;  // 2 heads of 8 beside n_embd 32
  GPT model(cfg);
  ParamStore ps(model.layout(), 5);
  const std::string e = error_of([&] { export_hf(model, ps, dir / "gpt2"); });
  EXPECT_CONTAINS(e, "GPT-2's config.json has no head_dim");
  EXPECT_CONTAINS(e, "LLaMA-shaped");
  EXPECT_FALSE(fs::exists(dir / "gpt2"));
}

TEST(HFExport, ShardedExportIndexesEveryTensorAndImports) {
  TempDir dir;
  const GPTConfig cfg = testing::small_gpt(0.0f);
  GPT model(cfg);
  ParamStore ps(model.layout(), 7);
  HFExportOptions o;
  o.max_shard_bytes = 16 << 10;
  export_hf(model, ps, dir / "sharded", o);
  const nlohmann::json index = nlohmann::json::parse(read_file(dir / "sharded" / "model.safetensors.index.json"));
  const HFParamMap map(hf_config_from_gpt(cfg));
  const nlohmann::json& weight_map = index.at("weight_map");
  EXPECT_EQ(weight_map.size(), map.params().size());
  std::set<std::string> files;
  for (const HFParam& p : map.params()) {
    ASSERT_TRUE(weight_map.contains(p.hf_name)) << p.hf_name;
    files.insert(weight_map.at(p.hf_name).get<std::string>());
  }
  EXPECT_GT(files.size(), 1u);
  EXPECT_TRUE(HFImport(dir / "sharded").checkpoint.sharded());
  EXPECT_EQ(imported_flat(dir / "sharded"), flat_of(ps));
}

TEST(HFExport, ImportUnderTensorParallelismPadsTheVocabularyWithZeros) {
  // Vocabulary 61 over 2 tensor-parallel ranks: 31 rows each, one padding row.
  TempDir dir;
  const GPTConfig cfg = testing::small_gpt(0.0f);
  GPT model(cfg);
  ParamStore ps(model.layout(), 7);
  export_hf(model, ps, dir / "hf");
  const HFImport src(dir / "hf");
  std::atomic<int64_t> padding_seen{0}, padding_nonzero{0};
  DataParallelRun r = testing::layout(1, 0);
  r.tp = 2;
  r.steps = 1;
  r.model = src.model;
  r.init = [&](Trainer& t) {
    load_hf_weights(src, t);
    // This rank's own layout, padding included (collective).
    const ParamSpec& wte = t.model().layout().param(t.model().layout().find("wte.weight"));
    t.optimizer().visit_state([&](FlatRange range, const float* p, const float*, const float*) {
      for (int64_t i = 0; i < wte.numel(); ++i) {
        if (wte.offset + i < range.begin || wte.offset + i >= range.end || wte.global_index(i) >= 0) continue;
        ++padding_seen;
        if (p[wte.offset + i - range.begin] != 0.0f) ++padding_nonzero;
      }
    });
  };
  const RunResult a = testing::run_layout(r);
  EXPECT_EQ(a.initial_params, flat_of(ps));
  EXPECT_EQ(padding_seen.load(), cfg.n_embd);
  EXPECT_EQ(padding_nonzero.load(), 0);
}

// ---------------------------------------------------------------------------
// Broken checkpoints and configs: errors before anything is allocated
// ---------------------------------------------------------------------------

Config import_config(const fs::path& dir) {
  Config c(loom_schema());
  c.set_override("init.from=hf:" + dir.string());
  c.set_override("train.seq_len=16");
  c.set_override("train.batch_size=4");
  c.set_override("train.micro_batch_size=4");
  c.set_override("data.vocab_size=96");
  return c;
}

std::string plan_error(const fs::path& dir) {
  return error_of([&] { plan_training(import_config(dir)); });
}

TEST(HFImportErrors, AMissingOrMisshapedTensorNamesItAndTheFile) {
  TempDir dir;
  const fs::path missing = testing::edited_copy(dir, "gpt2", [](std::vector<Raw>& t) {
    std::erase_if(t, [](const Raw& r) { return r.name == "transformer.h.1.mlp.c_fc.bias"; });
  });
  std::string e = plan_error(missing);
  EXPECT_CONTAINS(e, "transformer.h.1.mlp.c_fc.bias");
  EXPECT_CONTAINS(e, (missing / "model.safetensors").string());

  TempDir other;
  const fs::path shape = testing::edited_copy(other, "gpt2", [](std::vector<Raw>& t) {
    for (Raw& r : t)
      if (r.name == "transformer.wpe.weight") {
        r.shape = {32, 64};
        r.bytes.resize(32 * 64 * 4);
      }
  });
  e = plan_error(shape);
  EXPECT_CONTAINS(e, "transformer.wpe.weight");
  EXPECT_CONTAINS(e, (shape / "model.safetensors").string());
  EXPECT_CONTAINS(e, "[32, 64]");
}

TEST(HFImportErrors, AnUnknownArchitectureOrACorruptHeaderNamesTheFile) {
  TempDir dir;
  const fs::path bert = dir / "bert";
  fs::copy(hf_fixture("gpt2"), bert, fs::copy_options::recursive);
  nlohmann::json j = nlohmann::json::parse(read_file(bert / "config.json"));
  j["architectures"] = {"BertForMaskedLM"};
  j["model_type"] = "bert";
  std::ofstream(bert / "config.json") << j.dump(2);
  std::string e = plan_error(bert);
  EXPECT_CONTAINS(e, (bert / "config.json").string());
  EXPECT_CONTAINS(e, "BertForMaskedLM");

  const fs::path corrupt = dir / "corrupt";
  fs::copy(hf_fixture("gpt2"), corrupt, fs::copy_options::recursive);
  {
    std::fstream f(corrupt / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("#### not json", 13);
  }
  e = plan_error(corrupt);
  EXPECT_CONTAINS(e, (corrupt / "model.safetensors").string());
}

TEST(HFImportErrors, ModelKeysThatContradictConfigJsonNameBoth) {
  Config c = import_config(hf_fixture("gpt2"));
  c.set_override("model.n_layer=2");  // the same: allowed
  const TrainPlan plan = plan_training(c);
  EXPECT_EQ(plan.init_hf, hf_fixture("gpt2"));
  EXPECT_EQ(plan.model.n_embd, 64);
  c.set_override("model.n_embd=128");
  const std::string e = error_of([&] { plan_training(c); });
  EXPECT_CONTAINS(e, "model.n_embd");
  EXPECT_CONTAINS(e, (hf_fixture("gpt2") / "config.json").string());
  EXPECT_CONTAINS(e, "64");
  Config bad(loom_schema());
  bad.set_override("init.from=runs/x");
  const std::string neither = error_of([&] { plan_training(bad); });
  EXPECT_CONTAINS(neither, "neither a checkpoint directory");
  EXPECT_CONTAINS(neither, "init.from = \"hf:runs/x\"");
}

}  // namespace
}  // namespace loom
