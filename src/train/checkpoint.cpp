// Checkpoints: weights and optimizer state in safetensors under global
// parameter names and shapes, plus a manifest with the run's config, step,
// data position and the SHA-256 of every file; committed atomically.
#include <nlohmann/json.hpp>

#include "loom/comm.h"
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

// An integer field of `object` (the manifest or a part of it).
int64_t manifest_int(const CheckpointInfo& info, const nlohmann::json& object, const char* key) {
  if (!object.contains(key) || !object.at(key).is_number_integer())
    throw Error(str("manifest of checkpoint '", info.dir.string(), "' lacks the integer '", key,
                    "': the checkpoint is corrupt or not loom's"));
  return object.at(key).get<int64_t>();
}
}  // namespace

fs::path save_checkpoint(const fs::path& root, Trainer& t, const nlohmann::json& fields, int64_t keep_last,
                         DeviceMesh* mesh) {
  Communicator* dp = t.data_parallel();
  const ModelParallel& mp = t.model().parallel();
  // Every replica has a data-parallel rank 0: under a mesh only the world's
  // rank 0 may write.
  LOOM_CHECK(mesh || (mp.tp.size() == 1 && mp.first_stage && mp.last_stage),
             "a Trainer whose model is split over tp or pp ranks saves with the mesh it was built on");
  Communicator* ranks = mesh ? &mesh->world() : dp;
  // The reference trainer's own tensors are its whole state already; under
  // dp every rank gathers it (collective) and rank 0 writes it, and chunks
  // are gathered from wherever they are placed.
  const Trainer::State state =
      dp || t.options().memory.policy != MemoryPolicy::none ? t.gather_state()
         : Trainer::State{t.params().flat(), t.optimizer().exp_avg(), t.optimizer().exp_avg_sq(), t.steps_done(),
                          t.optimizer().steps(), {}};
  const std::string name = checkpoint_dir_name(state.steps);
  if (!ranks || ranks->rank() == 0) {
    fs::create_directories(root);
    AtomicDirWriter dir(root / name);
    const ParamLayout& layout = t.state_layout();
    write_params(dir.path(kModelFile), layout, state.params, "");
    {
      std::vector<SafetensorsSpec> specs;
      for (const ParamSpec& p : layout.params()) {
        specs.push_back({"exp_avg." + p.name, DType::f32, p.shape});
        specs.push_back({"exp_avg_sq." + p.name, DType::f32, p.shape});
      }
      SafetensorsWriter w(dir.path(kOptimizerFile), specs, {{"format", "loom"}});
      for (const ParamSpec& p : layout.params()) {
        w.write("exp_avg." + p.name, state.exp_avg.flat(p.offset, p.numel()).raw());
        w.write("exp_avg_sq." + p.name, state.exp_avg_sq.flat(p.offset, p.numel()).raw());
      }
      w.finish();
    }
    nlohmann::json f = fields;
    f["step"] = state.steps;
    f["optimizer_steps"] = state.optimizer_steps;
    const ZeroOptions& zero = t.options().zero;
    f["layout"] = {{"dp", dp ? dp->size() : 1},
                   {"tp", mesh ? mesh->size(MeshAxis::tp) : 1},
                   {"pp", mesh ? mesh->size(MeshAxis::pp) : 1},
                   {"zero_stage", zero.stage},
                   {"precision", dtype_name(zero.precision)}};
    if (t.loss_scaler())
      f["loss_scale"] = {{"scale", state.loss_scale.scale},
                         {"clean_steps", state.loss_scale.clean_steps},
                         {"hysteresis_left", state.loss_scale.hysteresis_left}};
    const GPTConfig& mc = t.model().config();
    f["model"] = {{"n_layer", mc.n_layer},       {"n_head", mc.n_head},         {"n_embd", mc.n_embd},
                  {"vocab_size", mc.vocab_size}, {"block_size", mc.block_size}, {"dropout", mc.dropout}};
    write_manifest(dir.temp_dir(), f);
    dir.commit();
    write_latest(root, name);
    apply_retention(root, keep_last);
  }
  // No rank goes on (and possibly reads `latest`) before the files exist.
  if (ranks) ranks->barrier();
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
  const ParamLayout& layout = trainer.state_layout();
  // Staged on the host tier: the device high-water mark stays the training's.
  Trainer::State state;
  state.params = Tensor::empty({layout.numel()}, DType::f32, Tier::host);
  state.exp_avg = Tensor::empty({layout.numel()}, DType::f32, Tier::host);
  state.exp_avg_sq = Tensor::empty({layout.numel()}, DType::f32, Tier::host);
  read_params(SafetensorsReader(dir / kModelFile), layout, state.params, "");
  {
    SafetensorsReader r(dir / kOptimizerFile);
    read_params(r, layout, state.exp_avg, "exp_avg.");
    read_params(r, layout, state.exp_avg_sq, "exp_avg_sq.");
  }
  state.steps = info.step;
  state.optimizer_steps = manifest_int(info, info.fields, "optimizer_steps");
  // Saved without fp16, a checkpoint has no scaler state (scale 0 in the
  // State): an fp16 trainer's scaler then starts afresh.
  if (info.fields.contains("loss_scale")) {
    const nlohmann::json& ls = info.fields.at("loss_scale");
    if (!ls.is_object() || !ls.contains("scale") || !ls.at("scale").is_number())
      throw Error(str("manifest of checkpoint '", dir.string(), "' has a malformed 'loss_scale': ", ls.dump()));
    state.loss_scale.scale = ls.at("scale").get<float>();
    state.loss_scale.clean_steps = manifest_int(info, ls, "clean_steps");
    state.loss_scale.hysteresis_left = static_cast<int>(manifest_int(info, ls, "hysteresis_left"));
  }
  trainer.load_state(state);
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
