// Checkpoints: weights and optimizer state in safetensors under global
// parameter names and shapes, plus a manifest with the run's config, step,
// data position and the SHA-256 of every file; committed atomically.
#include <nlohmann/json.hpp>

#include "loom/io.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

namespace {
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";

void write_params(const fs::path& path, const ParamLayout& layout, const Tensor& flat, const std::string& prefix) {
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params()) specs.push_back({prefix + p.name, DType::f32, p.shape});
  SafetensorsWriter w(path, specs, {{"format", "loom"}});
  for (const ParamSpec& p : layout.params())
    w.write(prefix + p.name, flat.flat(p.offset, p.numel()).raw());
  w.finish();
}

void read_params(const SafetensorsReader& r, const ParamLayout& layout, Tensor& flat, const std::string& prefix) {
  for (const ParamSpec& p : layout.params()) {
    const std::string name = prefix + p.name;
    if (!r.contains(name))
      throw Error(str("checkpoint file '", r.path().string(), "' has no tensor '", name,
                      "': it was saved from a different model"));
    const auto& e = r.entry(name);
    if (e.dtype != DType::f32 || e.shape != p.shape)
      throw Error(str("tensor '", name, "' in '", r.path().string(), "' is ", dtype_name(e.dtype), " ",
                      shape_str(e.shape), ", the model needs f32 ", shape_str(p.shape)));
    r.read(name, flat.flat(p.offset, p.numel()).raw(), static_cast<size_t>(p.numel()) * 4);
  }
}
}  // namespace

fs::path save_checkpoint(const fs::path& root, Trainer& t, const nlohmann::json& fields, int64_t keep_last) {
  const int64_t step = t.steps_done();
  const std::string name = checkpoint_dir_name(step);
  fs::create_directories(root);
  AtomicDirWriter dir(root / name);
  const ParamLayout& layout = t.model().layout();
  write_params(dir.path(kModelFile), layout, t.params().flat(), "");
  {
    std::vector<SafetensorsSpec> specs;
    for (const ParamSpec& p : layout.params()) {
      specs.push_back({"exp_avg." + p.name, DType::f32, p.shape});
      specs.push_back({"exp_avg_sq." + p.name, DType::f32, p.shape});
    }
    SafetensorsWriter w(dir.path(kOptimizerFile), specs, {{"format", "loom"}});
    const Tensor m = t.optimizer().exp_avg(), v = t.optimizer().exp_avg_sq();
    for (const ParamSpec& p : layout.params()) {
      w.write("exp_avg." + p.name, m.flat(p.offset, p.numel()).raw());
      w.write("exp_avg_sq." + p.name, v.flat(p.offset, p.numel()).raw());
    }
    w.finish();
  }
  nlohmann::json f = fields;
  f["step"] = step;
  f["optimizer_steps"] = t.optimizer().steps();
  const GPTConfig& mc = t.model().config();
  f["model"] = {{"n_layer", mc.n_layer},       {"n_head", mc.n_head},         {"n_embd", mc.n_embd},
                {"vocab_size", mc.vocab_size}, {"block_size", mc.block_size}, {"dropout", mc.dropout}};
  write_manifest(dir.temp_dir(), f);
  dir.commit();
  write_latest(root, name);
  apply_retention(root, keep_last);
  return root / name;
}

CheckpointInfo read_checkpoint_info(const fs::path& dir) {
  Manifest m = verify_checkpoint_dir(dir);
  for (const char* file : {kModelFile, kOptimizerFile})
    if (!m.files.count(file))
      throw Error(str("checkpoint '", dir.string(), "' lists no ", file, ": it is incomplete"));
  CheckpointInfo info;
  info.dir = dir;
  info.fields = m.fields;
  if (!m.fields.contains("step") || !m.fields.contains("model"))
    throw Error(str("manifest of checkpoint '", dir.string(), "' lacks 'step' or 'model': not a loom checkpoint"));
  info.step = m.fields.at("step").get<int64_t>();
  return info;
}

GPTConfig checkpoint_model_config(const CheckpointInfo& info) {
  const nlohmann::json& j = info.fields.at("model");
  GPTConfig c;
  c.n_layer = j.at("n_layer").get<int64_t>();
  c.n_head = j.at("n_head").get<int64_t>();
  c.n_embd = j.at("n_embd").get<int64_t>();
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.block_size = j.at("block_size").get<int64_t>();
  c.dropout = j.at("dropout").get<float>();
  c.validate();
  return c;
}

void load_weights(const CheckpointInfo& info, const GPT& model, ParamStore& params) {
  SafetensorsReader r(info.dir / kModelFile);
  Tensor flat = params.flat();
  read_params(r, model.layout(), flat, "");
}

CheckpointInfo load_checkpoint(const fs::path& dir, Trainer& trainer) {
  CheckpointInfo info = read_checkpoint_info(dir);
  const GPTConfig saved = checkpoint_model_config(info);
  const GPTConfig& mc = trainer.model().config();
  if (saved.n_layer != mc.n_layer || saved.n_head != mc.n_head || saved.n_embd != mc.n_embd ||
      saved.vocab_size != mc.vocab_size || saved.block_size != mc.block_size)
    throw Error(str("checkpoint '", dir.string(), "' holds a model of ", saved.n_layer, " layers, width ",
                    saved.n_embd, ", vocab ", saved.vocab_size, ", context ", saved.block_size,
                    "; the config asks for ", mc.n_layer, ", ", mc.n_embd, ", ", mc.vocab_size, ", ",
                    mc.block_size, ": resume with the config the run was started with"));
  load_weights(info, trainer.model(), trainer.params());
  SafetensorsReader r(dir / kOptimizerFile);
  Tensor m = trainer.optimizer().exp_avg(), v = trainer.optimizer().exp_avg_sq();
  read_params(r, trainer.model().layout(), m, "exp_avg.");
  read_params(r, trainer.model().layout(), v, "exp_avg_sq.");
  trainer.optimizer().set_steps(info.fields.at("optimizer_steps").get<int64_t>());
  return info;
}

fs::path resolve_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(path / kManifestFile, ec)) return path;
  if (auto latest = read_latest(path)) return *latest;
  throw Error(str("'", path.string(), "' is neither a checkpoint directory (no ", kManifestFile,
                  ") nor a run directory with a 'latest' checkpoint"));
}

}  // namespace loom
