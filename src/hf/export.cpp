// Writing a Hugging Face checkpoint directory: config.json and one
// model.safetensors, or shards and their index, published atomically.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "hf/staging.h"
#include "loom/hf.h"
#include "loom/io.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

}  // namespace

void write_hf_checkpoint(const fs::path& dir, const HFModelConfig& config,
                         const std::function<void(const HFParam& p, float* dst)>& fill,
                         const HFExportOptions& options) {
  LOOM_CHECK(options.dtype == DType::f32 || options.dtype == DType::bf16 || options.dtype == DType::f16,
             "HF export dtype must be f32, bf16 or f16, not ", dtype_name(options.dtype));
  LOOM_CHECK(options.max_shard_bytes > 0, "max_shard_bytes must be positive");
  const HFParamMap map(config);
  const std::vector<HFParam>& params = map.params();

  // Shards are filled in map order, as transformers does: a tensor that would
  // push the current shard past the limit starts the next one.
  std::vector<std::vector<SafetensorsSpec>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const HFParam& p : params) {
    SafetensorsSpec spec{p.hf_name, options.dtype, p.hf_shape()};
    if (!shards.back().empty() && shard_bytes + spec.bytes() > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += spec.bytes();
    total_bytes += spec.bytes();
    shards.back().push_back(std::move(spec));
  }

  fs::create_directories(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
  AtomicDirWriter out(dir);
  // One tensor at a time in loom's layout, HF's and the stored dtype, on the
  // host tier (accounted), grown to the largest tensor and reused.
  Tensor loom_layout, hf_layout, stored;
  nlohmann::json weight_map = nlohmann::json::object();
  size_t next = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file = shards.size() == 1 ? "model.safetensors" : shard_name(k, shards.size());
    SafetensorsWriter writer(out.path(file), shards[k], {{"format", "pt"}});
    for (const SafetensorsSpec& spec : shards[k]) {
      const HFParam& p = params[next++];
      const int64_t n = shape_numel(p.loom_shape);
      grow_scratch(loom_layout, n, DType::f32, Tier::host);
      std::fill_n(loom_layout.data<float>(), n, 0.0f);
      fill(p, loom_layout.data<float>());
      const float* src = loom_layout.data<float>();
      if (p.transform == HFTransform::transpose) {
        const int64_t rows = p.loom_shape[0], cols = p.loom_shape[1];
        grow_scratch(hf_layout, n, DType::f32, Tier::host);
        float* t = hf_layout.data<float>();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = src[r * cols + c];
        src = t;
      }
      grow_scratch(stored, n, options.dtype, Tier::host);
      convert(src, DType::f32, stored.raw(), options.dtype, n);
      writer.write(spec.name, stored.raw());
      weight_map[spec.name] = file;
    }
    writer.finish();
  }
  if (shards.size() > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    out.write_file("model.safetensors.index.json", index.dump(2) + "\n");
  }
  HFModelConfig written = config;
  written.dtype = options.dtype;
  out.write_file("config.json", hf_config_json(written));
  out.commit();
}

}  // namespace loom
