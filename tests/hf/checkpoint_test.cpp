// Reading Hugging Face checkpoint directories: the transformers fixtures as
// saved (single file, bf16 shards, a PEFT adapter) and broken copies of them.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "hf_fixtures.h"
#include "loom/hf.h"
#include "loom/io.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::hf_fixture;
using testing::edited_copy;
using testing::Raw;
using testing::TempDir;

std::vector<float> read_all(const HFCheckpoint& c, const std::string& name) {
  std::vector<float> v(static_cast<size_t>(shape_numel(c.tensor(name).shape)));
  c.read_f32(name, v.data(), static_cast<int64_t>(v.size()));
  return v;
}

std::vector<float> read_param(const HFCheckpoint& c, const HFParam& p) {
  std::vector<float> v(static_cast<size_t>(shape_numel(p.loom_shape)));
  c.read_param(p, v.data());
  return v;
}

fs::path sharded_copy(const TempDir& dir) {
  const fs::path out = dir / "sharded";
  fs::copy(hf_fixture("llama_bf16_sharded"), out, fs::copy_options::recursive);
  return out;
}

TEST(HFCheckpoint, ReadsEveryTensorOfEachFixture) {
  for (const char* name : {"gpt2", "llama", "llama_mqa", "llama_bf16_sharded"}) {
    const HFModelConfig config = read_hf_config(hf_fixture(name));
    const HFCheckpoint ckpt(hf_fixture(name));
    ckpt.check(HFParamMap(config));
    for (const HFTensorInfo& t : ckpt.tensors()) {
      EXPECT_EQ(t.dtype, config.dtype) << t.name;
      const SafetensorsReader file(t.file);
      ASSERT_EQ(file.entry(t.name).shape, t.shape);
      std::vector<uint8_t> raw(file.entry(t.name).bytes);
      file.read(t.name, raw.data(), raw.size());
      std::vector<float> expected(static_cast<size_t>(shape_numel(t.shape)));
      convert(raw.data(), t.dtype, expected.data(), DType::f32, shape_numel(t.shape));
      EXPECT_TRUE(testing::bit_equal(read_all(ckpt, t.name), expected)) << name << ": " << t.name;
    }
  }
}

// transformers rounded the f32 LLaMA to bf16 (nearest even); loom's reader
// widens it exactly, so each value is loom's own rounding of the f32 one.
TEST(HFCheckpoint, Bf16ShardsHoldTheF32FixtureRounded) {
  const HFCheckpoint f32(hf_fixture("llama")), bf16(hf_fixture("llama_bf16_sharded"));
  EXPECT_FALSE(f32.sharded());
  EXPECT_TRUE(bf16.sharded());
  std::set<fs::path> files;
  ASSERT_EQ(bf16.tensors().size(), f32.tensors().size());
  for (const HFTensorInfo& t : bf16.tensors()) {
    files.insert(t.file);
    std::vector<float> rounded = read_all(f32, t.name);
    round_to(rounded.data(), static_cast<int64_t>(rounded.size()), DType::bf16);
    const std::vector<float> read = read_all(bf16, t.name);
    EXPECT_TRUE(testing::bit_equal(read, rounded)) << t.name;
    EXPECT_FALSE(testing::bit_equal(read, read_all(f32, t.name))) << t.name << " was not rounded";
  }
  EXPECT_GT(files.size(), 2u);
}

TEST(HFCheckpoint, RowRangesEqualRowsOfTheWholeParameter) {
  for (const char* name : {"gpt2", "llama", "llama_bf16_sharded"}) {
    const HFParamMap map(read_hf_config(hf_fixture(name)));
    const HFCheckpoint ckpt(hf_fixture(name));
    for (const HFParam& p : map.params()) {
      const std::vector<float> whole = read_param(ckpt, p);
      const int64_t rows = p.loom_shape[0], width = shape_numel(p.loom_shape) / rows;
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 1}, {1, 3}, {rows / 2, rows}, {rows, rows}}) {
        std::vector<float> part(static_cast<size_t>((e - b) * width));
        ckpt.read_param_rows(p, b, e, part.data());
        EXPECT_TRUE(testing::bit_equal(part, std::vector<float>(whole.begin() + b * width, whole.begin() + e * width)))
            << name << ": " << p.hf_name << " rows " << b << ".." << e;
      }
    }
  }
}

// loom's [out, in] element (r, k) is Conv1D's stored (k, r).
TEST(HFCheckpoint, Gpt2Conv1DWeightsAreTransposedOnRead) {
  const HFParamMap map(read_hf_config(hf_fixture("gpt2")));
  const HFCheckpoint ckpt(hf_fixture("gpt2"));
  int transposed = 0;
  for (const HFParam& p : map.params()) {
    if (p.transform != HFTransform::transpose) continue;
    ++transposed;
    const std::vector<float> loom = read_param(ckpt, p), stored = read_all(ckpt, p.hf_name);
    const int64_t out = p.loom_shape[0], in = p.loom_shape[1];
    for (int64_t r = 0; r < out; r += 7)
      for (int64_t k = 0; k < in; k += 5) ASSERT_EQ(loom[r * in + k], stored[k * out + r]) << p.hf_name;
    std::vector<float> cols(static_cast<size_t>(in * 2));
    ckpt.read_cols_f32(p.hf_name, 3, 5, cols.data());
    for (int64_t k = 0; k < in; ++k) ASSERT_EQ(cols[k * 2 + 1], stored[k * out + 4]);
  }
  EXPECT_EQ(transposed, 4 * 2);
}

// GPT2Model checkpoints drop "transformer."; old ones carry mask buffers and a
// tied lm_head.weight. All of that reads as the same parameters.
TEST(HFCheckpoint, BareBaseModelNamesAndBuffersAreAccepted) {
  TempDir dir;
  const fs::path bare = edited_copy(dir, "gpt2", [](std::vector<Raw>& ts) {
    for (Raw& t : ts) t.name = t.name.substr(std::string("transformer.").size());
    ts.push_back({"h.0.attn.bias", DType::f32, {1, 1, 2, 2}, std::vector<uint8_t>(16)});
    ts.push_back({"lm_head.weight", DType::f32, {96, 64}, std::vector<uint8_t>(96 * 64 * 4)});
  });
  const HFParamMap map(read_hf_config(bare));
  const HFCheckpoint a(hf_fixture("gpt2")), b(bare);
  b.check(map);
  for (const HFParam& p : map.params()) EXPECT_TRUE(testing::bit_equal(read_param(a, p), read_param(b, p))) << p.hf_name;
}

TEST(HFCheckpoint, MissingExtraAndMisShapedTensorsNameTensorAndFile) {
  TempDir dir;
  const HFParamMap map(read_hf_config(hf_fixture("gpt2")));
  auto check = [&](const fs::path& d) { HFCheckpoint(d).check(map); };

  const fs::path missing = edited_copy(dir, "gpt2", [](std::vector<Raw>& ts) {
    std::erase_if(ts, [](const Raw& t) { return t.name == "transformer.h.1.ln_2.bias"; });
  });
  std::string e = error_of([&] { check(missing); });
  EXPECT_CONTAINS(e, "'transformer.h.1.ln_2.bias'");
  EXPECT_CONTAINS(e, (missing / "model.safetensors").string());

  TempDir dir2;
  const fs::path extra = edited_copy(dir2, "gpt2", [](std::vector<Raw>& ts) {
    ts.push_back({"transformer.h.0.attn.c_attn.scale", DType::f32, {1}, std::vector<uint8_t>(4)});
  });
  e = error_of([&] { check(extra); });
  EXPECT_CONTAINS(e, "unexpected tensor 'transformer.h.0.attn.c_attn.scale'");
  EXPECT_CONTAINS(e, (extra / "model.safetensors").string());

  TempDir dir3;
  const fs::path shaped = edited_copy(dir3, "gpt2", [](std::vector<Raw>& ts) {
    for (Raw& t : ts)
      if (t.name == "transformer.wpe.weight") {
        t.shape = {32, 64};
        t.bytes.resize(32 * 64 * 4);
      }
  });
  e = error_of([&] { check(shaped); });
  EXPECT_CONTAINS(e, "'transformer.wpe.weight'");
  EXPECT_CONTAINS(e, (shaped / "model.safetensors").string());
  EXPECT_CONTAINS(e, "[32, 64]");
  EXPECT_CONTAINS(e, "[64, 64]");
  std::vector<float> buf(64 * 64);
  e = error_of([&] { HFCheckpoint(shaped).read_param(*map.by_loom("wpe.weight"), buf.data()); });
  EXPECT_CONTAINS(e, "'transformer.wpe.weight'");
}

TEST(HFCheckpoint, BrokenIndexesNameTheFiles) {
  const std::string index_name = "model.safetensors.index.json";
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  auto edit_index = [&](const fs::path& d, auto edit) {
    nlohmann::json index = nlohmann::json::parse(read_file(d / index_name));
    edit(index["weight_map"]);
    std::ofstream(d / index_name) << index.dump();
  };
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    fs::remove(d / "model-00003-of-00007.safetensors");
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, "model-00003-of-00007.safetensors");
    EXPECT_CONTAINS(e, "does not exist");
  }
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    edit_index(d, [&](nlohmann::json& map) { map[q] = "model-00002-of-00007.safetensors"; });
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, q);
    EXPECT_CONTAINS(e, "model-00002-of-00007.safetensors");
  }
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    edit_index(d, [&](nlohmann::json& map) { map.erase(q); });
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, q);
    EXPECT_CONTAINS(e, "not in the index");
  }
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    const fs::path shard = d / "model-00005-of-00007.safetensors";
    fs::resize_file(shard, fs::file_size(shard) - 100);
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, shard.string());
    EXPECT_CONTAINS(e, "truncated");
  }
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    const fs::path shard = d / "model-00002-of-00007.safetensors";
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);  // the header's opening brace
    f.put('!');
    f.close();
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, shard.string());
    EXPECT_CONTAINS(e, "not valid JSON");
  }
  {
    TempDir dir;
    const fs::path d = sharded_copy(dir);
    std::ofstream(d / index_name) << "{\"weight_map\": ";
    const std::string e = error_of([&] { HFCheckpoint c(d); });
    EXPECT_CONTAINS(e, (d / index_name).string());
  }
}

TEST(HFCheckpoint, PickleCheckpointsAreRefusedWithHowToConvert) {
  TempDir dir;
  dir.write("pytorch_model.bin", "PK");
  std::string e = error_of([&] { HFCheckpoint c(dir.path()); });
  EXPECT_CONTAINS(e, "pytorch_model.bin");
  EXPECT_CONTAINS(e, "only safetensors");
  EXPECT_CONTAINS(e, "safe_serialization=True");
  e = error_of([&] { HFCheckpoint c(dir / "absent"); });
  EXPECT_CONTAINS(e, "no such directory");
  e = error_of([] { HFCheckpoint(hf_fixture("llama")).tensor("model.norm.weights"); });
  EXPECT_CONTAINS(e, "did you mean 'model.norm.weight'");
}

// The PEFT adapter: every LoRA pair targets a parameter of the base map, with
// A [r, in] and B [out, r] for its [out, in] weight; the reference holds a
// gradient for each adapter tensor.
TEST(HFCheckpoint, LoraAdapterMatchesTheBaseModel) {
  const HFParamMap map(read_hf_config(hf_fixture("llama")));
  const HFCheckpoint adapter(hf_fixture("llama_lora"), "adapter_model");
  const int64_t r = nlohmann::json::parse(read_file(hf_fixture("llama_lora") / "adapter_config.json"))["r"];
  const SafetensorsReader reference(hf_fixture("llama_lora.reference.safetensors"));
  const std::string prefix = "base_model.model.";
  std::set<const HFParam*> targets;
  for (const HFTensorInfo& t : adapter.tensors()) {
    ASSERT_TRUE(t.name.starts_with(prefix)) << t.name;
    const bool a = t.name.ends_with(".lora_A.weight");
    ASSERT_TRUE(a || t.name.ends_with(".lora_B.weight")) << t.name;
    const std::string base = t.name.substr(prefix.size(), t.name.size() - prefix.size() - 14) + ".weight";
    const HFParam* p = map.by_hf(base);
    ASSERT_NE(p, nullptr) << base;
    targets.insert(p);
    EXPECT_EQ(t.shape, (a ? Shape{r, p->loom_shape[1]} : Shape{p->loom_shape[0], r})) << t.name;
    EXPECT_EQ(reference.entry("grad." + t.name).shape, t.shape);
    const std::vector<float> v = read_all(adapter, t.name);
    EXPECT_GT(*std::max_element(v.begin(), v.end()), 0.0f) << t.name << " is zero";
  }
  EXPECT_EQ(targets.size(), 7u * 2);  // 7 target modules in each of 2 layers
}

// Each model's reference holds the gradient of every stored parameter.
TEST(HFCheckpoint, ReferencesCoverEveryParameter) {
  for (const char* name : {"gpt2", "llama", "llama_mqa"}) {
    const HFCheckpoint ckpt(hf_fixture(name));
    const SafetensorsReader reference(hf_fixture(std::string(name) + ".reference.safetensors"));
    EXPECT_EQ(reference.entries().size(), ckpt.tensors().size() + 3) << name;
    for (const HFTensorInfo& t : ckpt.tensors()) EXPECT_EQ(reference.entry("grad." + t.name).shape, t.shape);
    const int64_t vocab = read_hf_config(hf_fixture(name)).vocab_size;
    EXPECT_EQ(reference.entry("logits").shape, (Shape{2, 16, vocab}));
    EXPECT_EQ(reference.entry("input_ids").shape, (Shape{2, 16}));
  }
}

}  // namespace
}  // namespace loom
