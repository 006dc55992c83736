// Checkpoints: weights and optimizer state in safetensors under global
// parameter names and shapes, plus a manifest with the run's config, step,
// data position and the SHA-256 of every file; committed atomically.
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "loom/comm.h"
#include "loom/io.h"
#include "loom/device.h"
#include "loom/train.h"
#include "train/model_json.h"

namespace loom {

namespace fs = std::filesystem;

namespace {
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";

std::vector<SafetensorsSpec> model_specs(const ParamLayout& layout) {
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params()) specs.push_back({p.name, DType::f32, p.shape});
  return specs;
}

std::vector<SafetensorsSpec> optimizer_specs(const ParamLayout& layout) {
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params()) {
    specs.push_back({"exp_avg." + p.name, DType::f32, p.shape});
    specs.push_back({"exp_avg_sq." + p.name, DType::f32, p.shape});
  }
  return specs;
}

// The parameters whose first element lies in `r` (a piece of the state holds
// whole parameters), with their offset into the piece.
template <typename Fn>
void for_each_param_in(const ParamLayout& layout, FlatRange r, Fn fn) {
  for (const ParamSpec& p : layout.params())
    if (p.offset >= r.begin && p.offset < r.end) fn(p, p.offset - r.begin);
}

void read_param(const SafetensorsReader& r, const ParamSpec& p, const std::string& prefix, float* dst) {
  const std::string name = prefix + p.name;
  if (!r.contains(name))
    throw Error(str("checkpoint file '", r.path().string(), "' has no tensor '", name,
                    "': it was saved from a different model"));
  const auto& e = r.entry(name);
  if (e.dtype != DType::f32 || e.shape != p.shape)
    throw Error(str("tensor '", name, "' in '", r.path().string(), "' is ", dtype_name(e.dtype), " ",
                    shape_str(e.shape), ", the model needs f32 ", shape_str(p.shape)));
  r.read(name, dst, static_cast<size_t>(p.numel()) * 4);
}

void read_params(const SafetensorsReader& r, const ParamLayout& layout, Tensor& flat, const std::string& prefix) {
  for (const ParamSpec& p : layout.params()) read_param(r, p, prefix, flat.data<float>() + p.offset);
}

// An integer field of `object` (the manifest or a part of it).
int64_t manifest_int(const CheckpointInfo& info, const nlohmann::json& object, const char* key) {
  if (!object.contains(key) || !object.at(key).is_number_integer())
    throw Error(str("manifest of checkpoint '", info.dir.string(), "' lacks the integer '", key,
                    "': the checkpoint is corrupt or not loom's"));
  return object.at(key).get<int64_t>();
}

// An optional object of the manifest (nullptr when absent) whose `number`
// must be a number.
const nlohmann::json* manifest_part(const CheckpointInfo& info, const char* key, const char* number) {
  if (!info.fields.contains(key)) return nullptr;
  const nlohmann::json& part = info.fields.at(key);
  if (!part.is_object() || !part.contains(number) || !part.at(number).is_number())
    throw Error(str("manifest of checkpoint '", info.dir.string(), "' has a malformed '", key, "': ", part.dump()));
  return &part;
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
  const std::string name = checkpoint_dir_name(t.steps_done());
  const bool writes = !ranks || ranks->rank() == 0;
  const ParamLayout& layout = t.state_layout();
  // The state streams from the Trainer (collective) into the files on rank
  // 0: in one piece, or a chunk at a time under a memory policy.
  report_progress("checkpoint write", t.steps_done());
  std::optional<AtomicDirWriter> dir;
  std::optional<SafetensorsWriter> model_file, optimizer_file;
  if (writes) {
    fs::create_directories(root);
    dir.emplace(root / name);
    const std::map<std::string, std::string> metadata{{"format", "loom"}};
    model_file.emplace(dir->path(kModelFile), model_specs(layout), metadata);
    optimizer_file.emplace(dir->path(kOptimizerFile), optimizer_specs(layout), metadata);
  }
  t.visit_state([&](FlatRange r, const float* params, const float* exp_avg, const float* exp_avg_sq) {
    report_progress();
    if (!writes) return;
    for_each_param_in(layout, r, [&](const ParamSpec& p, int64_t at) {
      report_progress();
      model_file->write(p.name, params + at);
      optimizer_file->write("exp_avg." + p.name, exp_avg + at);
      optimizer_file->write("exp_avg_sq." + p.name, exp_avg_sq + at);
    });
  });
  if (writes) {
    model_file->finish();
    optimizer_file->finish();
    nlohmann::json f = fields;
    f["step"] = t.steps_done();
    f["optimizer_steps"] = t.optimizer_steps();
    const ZeroOptions& zero = t.options().zero;
    f["layout"] = {{"dp", dp ? dp->size() : 1},
                   {"tp", mesh ? mesh->size(MeshAxis::tp) : 1},
                   {"pp", mesh ? mesh->size(MeshAxis::pp) : 1},
                   {"zero_stage", zero.stage},
                   {"precision", dtype_name(zero.precision)}};
    if (const LossScaler* scaler = t.loss_scaler()) {
      const LossScaler::State ls = scaler->state();
      f["loss_scale"] = {
          {"scale", ls.scale}, {"clean_steps", ls.clean_steps}, {"hysteresis_left", ls.hysteresis_left}};
    }
    const LossWatch& lw = t.loss_watch();
    f["loss_watch"] = {{"mean", lw.mean}, {"steps", lw.steps}, {"skipped_in_a_row", lw.skipped_in_a_row}};
    f["model"] = model_json(t.model().config());
    write_manifest(dir->temp_dir(), f);
    dir->commit();
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
  for (const char* key : {"n_layer", "n_head", "n_embd", "vocab_size", "block_size", "dropout"})
    if (!j.contains(key))
      throw Error(str("manifest of checkpoint '", info.dir.string(), "' lacks model.", key,
                      ": the checkpoint is corrupt or not loom's"));
  // The variants are optional: a manifest written before them holds a GPT-2.
  const GPTConfig c = model_from_json(j);
  c.validate();
  return c;
}

void load_weights(const CheckpointInfo& info, const GPT& model, ParamStore& params) {
  SafetensorsReader r(info.dir / kModelFile);
  Tensor flat = params.flat();
  // The file is read straight into the parameters.
  const HostSection host;
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
  if (saved.lora.r != mc.lora.r || (mc.lora.enabled() && saved.lora.targets != mc.lora.targets))
    throw Error(str("checkpoint '", dir.string(), "' holds LoRA adapters of rank ", saved.lora.r, " on ",
                    saved.lora.targets.size(), " target(s); the config asks for rank ", mc.lora.r, " on ",
                    mc.lora.targets.size(), ": resume with the lora.* settings the run was started with"));
  nlohmann::json saved_variant = model_json(saved), variant = model_json(mc);
  saved_variant.erase("dropout");
  variant.erase("dropout");
  if (saved_variant != variant)
    throw Error(str("checkpoint '", dir.string(), "' holds the model ", saved_variant.dump(),
                    "; the config asks for ", variant.dump(), ": resume with the config the run was started with"));
  const ParamLayout& layout = trainer.state_layout();
  const SafetensorsReader model_file(dir / kModelFile), optimizer_file(dir / kOptimizerFile);
  Trainer::State state;
  state.steps = info.step;
  state.optimizer_steps = manifest_int(info, info.fields, "optimizer_steps");
  // Saved without fp16, a checkpoint has no scaler state (scale 0 in the
  // State): an fp16 trainer's scaler then starts afresh.
  if (const nlohmann::json* ls = manifest_part(info, "loss_scale", "scale")) {
    state.loss_scale.scale = ls->at("scale").get<float>();
    state.loss_scale.clean_steps = manifest_int(info, *ls, "clean_steps");
    state.loss_scale.hysteresis_left = static_cast<int>(manifest_int(info, *ls, "hysteresis_left"));
  }
  // Saved before the diverging-loss test, a checkpoint has no running mean:
  // it starts afresh.
  if (const nlohmann::json* lw = manifest_part(info, "loss_watch", "mean")) {
    state.loss_watch.mean = lw->at("mean").get<double>();
    state.loss_watch.steps = manifest_int(info, *lw, "steps");
    state.loss_watch.skipped_in_a_row = manifest_int(info, *lw, "skipped_in_a_row");
  }
  // Read in the pieces the Trainer takes them in (staged on the host tier, so
  // the device high-water mark stays the training's).
  trainer.load_state(state, [&](FlatRange r, float* params, float* exp_avg, float* exp_avg_sq) {
    for_each_param_in(layout, r, [&](const ParamSpec& p, int64_t at) {
      read_param(model_file, p, "", params + at);
      read_param(optimizer_file, p, "exp_avg.", exp_avg + at);
      read_param(optimizer_file, p, "exp_avg_sq.", exp_avg_sq + at);
    });
  });
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
