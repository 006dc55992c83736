// Writing Hugging Face checkpoint directories: fixture -> loom layout -> export
// -> import is bit-exact in the stored dtype, shards are indexed completely.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "hf/staging.h"
#include "hf_fixtures.h"
#include "loom/hf.h"
#include "loom/io.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::hf_fixture;
using testing::TempDir;

// Every parameter of a checkpoint in loom's layout, by loom name.
std::map<std::string, std::vector<float>> loom_params(const fs::path& dir) {
  const HFParamMap map(read_hf_config(dir));
  const HFCheckpoint ckpt(dir);
  ckpt.check(map);
  std::map<std::string, std::vector<float>> out;
  for (const HFParam& p : map.params()) {
    std::vector<float>& v = out[p.loom_name];
    v.resize(static_cast<size_t>(shape_numel(p.loom_shape)));
    ckpt.read_param(p, v.data());
  }
  return out;
}

void export_params(const fs::path& dir, const HFModelConfig& config,
                   const std::map<std::string, std::vector<float>>& params, const HFExportOptions& options) {
  write_hf_checkpoint(
      dir, config,
      [&](const HFParam& p, float* dst) { std::copy(params.at(p.loom_name).begin(), params.at(p.loom_name).end(), dst); },
      options);
}

// The stored bytes of every tensor, by name.
std::map<std::string, std::vector<uint8_t>> stored_bytes(const HFCheckpoint& ckpt) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const HFTensorInfo& t : ckpt.tensors()) {
    const SafetensorsReader r(t.file);
    std::vector<uint8_t>& b = out[t.name];
    b.resize(r.entry(t.name).bytes);
    r.read(t.name, b.data(), b.size());
  }
  return out;
}

// HF -> loom -> HF: the exported files hold the fixture's bytes, Conv1D
// transposes and all; the config reads back equal.
TEST(HFExport, F32RoundTripIsBitExact) {
  for (const char* name : {"gpt2", "llama", "llama_mqa"}) {
    TempDir dir;
    const HFModelConfig config = read_hf_config(hf_fixture(name));
    export_params(dir / "out", config, loom_params(hf_fixture(name)), {});
    EXPECT_TRUE(fs::exists(dir / "out" / "model.safetensors"));
    EXPECT_FALSE(fs::exists(dir / "out" / "model.safetensors.index.json"));
    EXPECT_EQ(read_hf_config(dir / "out"), config) << name;
    const HFCheckpoint exported(dir / "out");
    exported.check(HFParamMap(config));
    EXPECT_EQ(stored_bytes(exported), stored_bytes(HFCheckpoint(hf_fixture(name)))) << name;
  }
}

// f32 -> bf16 export rounds to nearest even exactly as torch did for the
// fixture's bf16 copy, and bf16 -> f32 -> bf16 is the identity.
TEST(HFExport, Bf16ShardedExportMatchesTorchAndRoundTrips) {
  TempDir dir;
  HFModelConfig config = read_hf_config(hf_fixture("llama"));
  const HFExportOptions options{DType::bf16, 30'000};
  export_params(dir / "a", config, loom_params(hf_fixture("llama")), options);

  const HFCheckpoint a(dir / "a");
  EXPECT_TRUE(a.sharded());
  EXPECT_EQ(read_hf_config(dir / "a").dtype, DType::bf16);
  EXPECT_EQ(stored_bytes(a), stored_bytes(HFCheckpoint(hf_fixture("llama_bf16_sharded"))));

  // The index lists every tensor in the shard that holds it; total_size adds them up.
  const nlohmann::json index = nlohmann::json::parse(read_file(dir / "a" / "model.safetensors.index.json"));
  const HFParamMap map(config);
  ASSERT_EQ(index["weight_map"].size(), map.params().size());
  uint64_t total = 0;
  size_t shards = 0;
  for (const HFParam& p : map.params()) {
    const HFTensorInfo& t = a.tensor(p.hf_name);
    EXPECT_EQ(index["weight_map"][p.hf_name], t.file.filename().string());
    total += static_cast<uint64_t>(shape_numel(t.shape)) * 2;
  }
  for (const auto& entry : fs::directory_iterator(dir / "a")) {
    if (entry.path().extension() != ".safetensors") continue;
    ++shards;
    EXPECT_LE(fs::file_size(entry.path()), options.max_shard_bytes + 4096) << entry.path();  // + header
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_GT(shards, 4u);
  EXPECT_TRUE(fs::exists(dir / "a" / ("model-00001-of-0000" + std::to_string(shards) + ".safetensors")));

  export_params(dir / "b", config, loom_params(dir / "a"), options);
  EXPECT_EQ(stored_bytes(HFCheckpoint(dir / "b")), stored_bytes(a));
}

// f16 is read back as the f32 values rounded to f16; a limit below every
// tensor's size gives each tensor a shard of its own.
TEST(HFExport, F16ExportReadsBackRoundedAndTinyShardsHoldOneTensorEach) {
  TempDir dir;
  const HFModelConfig config = read_hf_config(hf_fixture("llama_mqa"));
  const auto params = loom_params(hf_fixture("llama_mqa"));
  export_params(dir / "f16", config, params, {DType::f16, 1});
  const HFCheckpoint c(dir / "f16");
  const HFParamMap map(config);
  ASSERT_EQ(c.tensors().size(), map.params().size());
  std::set<fs::path> files;
  for (const HFParam& p : map.params()) {
    const HFTensorInfo& t = c.tensor(p.hf_name);
    EXPECT_EQ(t.dtype, DType::f16);
    EXPECT_TRUE(files.insert(t.file).second) << t.file;
    std::vector<float> expected = params.at(p.loom_name), read(expected.size());
    round_to(expected.data(), static_cast<int64_t>(expected.size()), DType::f16);
    c.read_param(p, read.data());
    EXPECT_TRUE(testing::bit_equal(read, expected)) << p.hf_name;
  }
  EXPECT_TRUE(fs::exists(dir / "f16" / ("model-00001-of-000" + std::to_string(files.size()) + ".safetensors")));
}

TEST(HFExport, ReplacesAtomicallyAndLeavesNothingOnFailure) {
  TempDir dir;
  const HFModelConfig config = read_hf_config(hf_fixture("llama_mqa"));
  const auto params = loom_params(hf_fixture("llama_mqa"));
  export_params(dir / "out", config, params, {});
  const auto before = stored_bytes(HFCheckpoint(dir / "out"));
  const std::string e = error_of([&] {
    write_hf_checkpoint(dir / "out", config, [](const HFParam& p, float*) {
      if (p.loom_name == "ln_f.weight") throw Error("disk full");
    });
  });
  EXPECT_CONTAINS(e, "disk full");
  EXPECT_EQ(stored_bytes(HFCheckpoint(dir / "out")), before);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);  // no temporary directory left behind
}

// The export's staging (a tensor in loom's layout, HF's and the stored dtype)
// is the host tier's: the allocator's peak holds it, and a host budget below
// it refuses the export, leaving nothing behind.
TEST(HFExport, StagingIsAccountedOnTheHostTier) {
  const HFModelConfig config = read_hf_config(hf_fixture("gpt2"));
  const auto params = loom_params(hf_fixture("gpt2"));
  int64_t largest = 0;
  const HFParamMap map(config);
  for (const HFParam& p : map.params()) largest = std::max(largest, shape_numel(p.loom_shape));
  TempDir dir;
  MemoryContext context;
  MemoryContext::Install install(context);
  Allocator& host = context.tier(Tier::host);
  HFExportOptions bf16;
  bf16.dtype = DType::bf16;
  export_params(dir / "out", config, params, bf16);
  EXPECT_GE(host.peak(), static_cast<size_t>(largest) * (4 + 2));
  EXPECT_EQ(host.used(), 0u);
  host.set_budget(static_cast<size_t>(largest) * 4 - 1);
  const std::string e = error_of([&] { export_params(dir / "small", config, params, bf16); });
  EXPECT_CONTAINS(e, "out of host memory");
  EXPECT_FALSE(fs::exists(dir / "small"));
}

// A scratch buffer grows to the largest request, is reused for smaller ones,
// and never holds the old and the new allocation at once.
TEST(HFStaging, GrowScratchReusesAndFreesBeforeGrowing) {
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  Allocator& host = ctx.tier(Tier::host);
  Tensor scratch;
  grow_scratch(scratch, 1, DType::f32, Tier::host);
  ASSERT_TRUE(scratch.defined());
  EXPECT_EQ(scratch.numel(), 1);
  grow_scratch(scratch, 1000, DType::f32, Tier::host);
  const void* grown = scratch.raw();
  EXPECT_EQ(scratch.numel(), 1000);
  grow_scratch(scratch, 10, DType::f32, Tier::host);
  EXPECT_EQ(scratch.raw(), grown);
  EXPECT_EQ(scratch.numel(), 1000);
  host.reset_peak();
  grow_scratch(scratch, 2000, DType::f32, Tier::host);
  EXPECT_EQ(host.used(), 2000 * sizeof(float));
  EXPECT_LT(host.peak(), (1000 + 2000) * sizeof(float));
  grow_scratch(scratch, 10, DType::bf16, Tier::host);  // another dtype: a buffer of its own
  EXPECT_EQ(scratch.dtype(), DType::bf16);
  EXPECT_EQ(scratch.numel(), 10);
}

}  // namespace
}  // namespace loom
