// Checkpoints: weights and optimizer state in safetensors in the whole
// model's global coordinates (one file per saving rank, or one file for the
// whole model), plus a manifest with the run's config, step, data position,
// where each piece of the state lies and the checksum of every file (and of
// every tensor of a sharded one); committed atomically.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "io/posix_file.h"
#include "loom/comm.h"
#include "loom/io.h"
#include "loom/quant.h"
#include "loom/device.h"
#include "loom/train.h"
#include "train/model_json.h"
#include "train/whole_runs.h"

namespace loom {

namespace fs = std::filesystem;

namespace {
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
// The manifest field that tells a sharded checkpoint (its value) from a
// single-file one (absent).
constexpr const char* kFormatField = "checkpoint_format";
constexpr int64_t kShardedFormat = 2;
// The three kinds of state each piece of a sharded checkpoint holds.
constexpr const char* kStateKinds[3] = {"params", "exp_avg", "exp_avg_sq"};

std::string shard_file(int rank) {
  std::string digits = std::to_string(rank);
  return "rank_" + std::string(digits.size() < 5 ? 5 - digits.size() : 0, '0') + digits + ".safetensors";
}

std::string piece_tensor(int kind, int64_t piece) { return str(kStateKinds[kind], ".", piece); }

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

// A checkpoint's state as the loaders read it: `n` elements of one kind
// (0 params, 1 exp_avg, 2 exp_avg_sq) of the whole model's flat state from
// flat element `global`, only their bytes read from the files.
class SavedState {
 public:
  virtual ~SavedState() = default;
  virtual void read(int kind, int64_t global, int64_t n, float* dst) = 0;
  // After the last read: whatever verification the reads left to do.
  virtual void finish() {}
};

// The single-file format: every parameter a tensor of model.safetensors and
// its moments tensors of optimizer.safetensors, under its global name.
class SingleFileState final : public SavedState {
 public:
  SingleFileState(const fs::path& dir, const ParamLayout& layout)
      : layout_(layout), model_(dir / kModelFile), optimizer_(dir / kOptimizerFile) {
    for (const ParamSpec& p : layout.params())
      for (int kind = 0; kind < 3; ++kind) check(kind, p);
  }

  void read(int kind, int64_t global, int64_t n, float* dst) override {
    while (n > 0) {
      // The parameter holding `global`: the last that starts at or before it.
      const std::vector<ParamSpec>& params = layout_.params();
      auto it = std::upper_bound(params.begin(), params.end(), global,
                                 [](int64_t g, const ParamSpec& q) { return g < q.offset; });
      LOOM_CHECK(it != params.begin(), "flat element ", global, " before the state");
      const ParamSpec& p = *--it;
      const int64_t from = global - p.offset, take = std::min(n, p.numel() - from);
      // Both moments come from the optimizer file, block by block: each
      // kind is its own stream of reads.
      (kind == 0 ? model_ : optimizer_)
          .read_range(name(kind, p), static_cast<uint64_t>(from) * 4, dst, static_cast<size_t>(take) * 4, kind);
      global += take;
      dst += take;
      n -= take;
    }
  }

 private:
  static std::string name(int kind, const ParamSpec& p) {
    return kind == 0 ? p.name : str(kStateKinds[kind], ".", p.name);
  }

  void check(int kind, const ParamSpec& p) const {
    const SafetensorsReader& r = kind == 0 ? model_ : optimizer_;
    const std::string tensor = name(kind, p);
    if (!r.contains(tensor))
      throw Error(str("checkpoint file '", r.path().string(), "' has no tensor '", tensor,
                      "': it was saved from a different model"));
    const auto& e = r.entry(tensor);
    if (e.dtype != DType::f32 || e.shape != p.shape)
      throw Error(str("tensor '", tensor, "' in '", r.path().string(), "' is ", dtype_name(e.dtype), " ",
                      shape_str(e.shape), ", the model needs f32 ", shape_str(p.shape)));
  }

  const ParamLayout& layout_;
  const SafetensorsReader model_, optimizer_;
};

// Every rank's `text` in rank order (without ranks: its own).
std::vector<std::string> all_gather_text(Communicator* ranks, const std::string& text) {
  if (!ranks) return {text};
  const auto n = static_cast<size_t>(ranks->size());
  const int64_t length = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(n);
  ranks->all_gather(&length, lengths.data(), 1, DType::i64);
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::string padded = text, all(n * static_cast<size_t>(longest), '\0');
  padded.resize(static_cast<size_t>(longest));
  if (longest > 0) ranks->all_gather(padded.data(), all.data(), longest, DType::u8);
  std::vector<std::string> texts;
  for (size_t r = 0; r < n; ++r)
    texts.push_back(all.substr(r * static_cast<size_t>(longest), static_cast<size_t>(lengths[r])));
  return texts;
}

// The whole model's tensors as the manifest of a sharded checkpoint lists
// them: name, global shape and offset in the flat state the runs index.
nlohmann::json state_json(const ParamLayout& layout) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const ParamSpec& p : layout.params())
    tensors.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
  return {{"numel", layout.numel()}, {"tensors", tensors}};
}

using StateRuns = std::vector<std::vector<Trainer::StateRun>>;
// Receives this rank's own state in the order its shard file holds it: per
// piece, per kind, its runs' elements.
using PartWriter = std::function<void(size_t piece, int kind, const float* values, int64_t n)>;

// Streams this rank's own state from the store into `write`.
void stream_own_state(Trainer& t, const StateRuns& runs, const PartWriter& write) {
  size_t k = 0;
  t.visit_own_state([&](FlatRange, const float* params, const float* exp_avg, const float* exp_avg_sq) {
    const float* kinds[3] = {params, exp_avg, exp_avg_sq};
    for (int kind = 0; kind < 3; ++kind)
      for (const Trainer::StateRun& r : runs[k]) {
        report_progress();
        write(k, kind, kinds[kind] + r.at, r.n);
      }
    ++k;
  });
}

int64_t piece_numel(const std::vector<Trainer::StateRun>& piece) {
  int64_t n = 0;
  for (const Trainer::StateRun& r : piece) n += r.n;
  return n;
}

// This rank's own state copied into host memory at a step boundary: per
// piece, its three kinds back to back (empty for a piece without runs).
std::vector<Tensor> snapshot_own_state(Trainer& t, const StateRuns& runs) {
  std::vector<Tensor> pieces(runs.size());
  std::vector<int64_t> filled(3 * runs.size(), 0);
  for (size_t k = 0; k < runs.size(); ++k)
    if (const int64_t n = piece_numel(runs[k]); n > 0) pieces[k] = Tensor::empty({3 * n}, DType::f32, Tier::host);
  stream_own_state(t, runs, [&](size_t k, int kind, const float* values, int64_t n) {
    int64_t& at = filled[3 * k + static_cast<size_t>(kind)];
    std::copy_n(values, n, pieces[k].data<float>() + kind * (pieces[k].numel() / 3) + at);
    at += n;
  });
  return pieces;
}

// This rank's file of a sharded checkpoint in `staging`: per owned range with
// anything to save, the tensors params.<k>, exp_avg.<k> and exp_avg_sq.<k>
// holding its runs back to back, as `source` streams them. Returns its
// manifest entry (file, digest, pieces), null when it saves nothing, or
// {"error": why} when the file could not be written (a full disk).
nlohmann::json write_own_shard(const fs::path& staging, int rank, const StateRuns& runs,
                               const std::function<void(const PartWriter&)>& source) {
  std::vector<SafetensorsSpec> specs;
  nlohmann::json pieces = nlohmann::json::array();  // {"piece", "runs", "xxh3_128": [per kind]}
  for (size_t k = 0; k < runs.size(); ++k) {
    nlohmann::json listed = nlohmann::json::array();
    for (const Trainer::StateRun& r : runs[k]) listed.push_back({r.global, r.n});
    const int64_t n = piece_numel(runs[k]);
    if (n == 0) continue;
    for (int kind = 0; kind < 3; ++kind)
      specs.push_back({piece_tensor(kind, static_cast<int64_t>(k)), DType::f32, {n}});
    pieces.push_back({{"piece", k}, {"runs", listed}});
  }
  if (specs.empty()) return nullptr;
  const std::string file = shard_file(rank);
  try {
    SafetensorsWriter writer(staging / file, std::move(specs), {{"format", "loom"}});
    source([&](size_t k, int kind, const float* values, int64_t n) {
      writer.write_part(piece_tensor(kind, static_cast<int64_t>(k)), values, static_cast<size_t>(n) * 4);
    });
    writer.finish();
    // Each tensor's digest goes with its piece, so a loader verifies just
    // the tensors it reads.
    const std::vector<std::string>& digests = writer.tensor_digests();
    for (size_t j = 0; j < pieces.size(); ++j)
      pieces[j]["xxh3_128"] = {digests.at(3 * j), digests.at(3 * j + 1), digests.at(3 * j + 2)};
    // Flushed here, by the rank (or the thread) that wrote it, so that the
    // commit's sync of the directory finds nothing left to write.
    io_detail::fsync_path(staging / file);
    return {{"file", file}, {"digest", digest_json(writer.digest())}, {"pieces", pieces}};
  } catch (const std::exception& e) {
    return {{"error", e.what()}};
  }
}

// Gives the calling thread the lowest CPU priority (Linux keeps a nice value
// per thread). A background shard writer then runs on cycles the training
// step leaves idle: on a CPU run, whose step keeps every core busy, the
// write's copies into the page cache would otherwise take their share of the
// cores from the step (checkpoint_bench on two cores: steps 14% longer while
// a shard is written at the default priority, 4-8% at nice 19).
// Raising one's own nice value cannot fail, and a failure would only cost
// speed, so its result is not checked.
void yield_cpu_to_training() { ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19); }

// The manifest's fields of a checkpoint of the trainer's current step
// besides its files: the caller's, the counters, the layout that saved it,
// the loss scaler's and loss watch's state and the model.
nlohmann::json manifest_fields(Trainer& t, const nlohmann::json& fields, const DeviceMesh* mesh) {
  nlohmann::json f = fields;
  const Communicator* dp = t.data_parallel();
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
    f["loss_scale"] = {{"scale", ls.scale}, {"clean_steps", ls.clean_steps}, {"hysteresis_left", ls.hysteresis_left}};
  }
  const LossWatch& lw = t.loss_watch();
  f["loss_watch"] = {{"mean", lw.mean}, {"steps", lw.steps}, {"skipped_in_a_row", lw.skipped_in_a_row}};
  f["model"] = model_json(t.model().config());
  return f;
}

double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Whether a manifest's checkpoint is sharded; Error for a format this loom
// does not know.
bool is_sharded(const fs::path& dir, const nlohmann::json& fields) {
  if (!fields.contains(kFormatField)) return false;
  const nlohmann::json& f = fields.at(kFormatField);
  if (!f.is_number_integer() || f.get<int64_t>() != kShardedFormat)
    throw Error(str("checkpoint '", dir.string(), "' has ", kFormatField, " ", f.dump(), "; this loom reads ",
                    kShardedFormat, " (sharded) and checkpoints without the field (single file): ",
                    "a newer loom wrote it"));
  return true;
}

// The state of a sharded checkpoint: where each run of the whole model's flat
// state lies. A file is opened when first read; each tensor read is verified
// against its digest as it is read (TensorVerifier), or, in checkpoints
// written before tensor digests, the whole file's checksum first.
class ShardedState final : public SavedState {
 public:
  ShardedState(const CheckpointInfo& info, const ParamLayout& layout) : dir_(info.dir) {
    const Manifest m = read_manifest(dir_);
    const auto corrupt = [&](const std::string& problem) {
      return Error(str("manifest of checkpoint '", dir_.string(), "' is corrupt: ", problem,
                       "; resume from another checkpoint"));
    };
    try {
      const nlohmann::json& state = info.fields.at("state");
      if (state.at("numel").get<int64_t>() != layout.numel() || state.at("tensors").size() != layout.params().size())
        throw Error(str("checkpoint '", dir_.string(), "' holds a state of ", state.at("numel").get<int64_t>(),
                        " elements in ", state.at("tensors").size(), " tensors; the model has ", layout.numel(), " in ",
                        layout.params().size(), ": load it with the model it was saved from"));
      for (size_t i = 0; i < layout.params().size(); ++i) {
        const ParamSpec& p = layout.params()[i];
        const nlohmann::json& saved = state.at("tensors").at(i);
        if (saved.at("name").get<std::string>() != p.name || saved.at("shape").get<Shape>() != p.shape ||
            saved.at("offset").get<int64_t>() != p.offset)
          throw Error(str("checkpoint '", dir_.string(), "' holds ", saved.dump(), " where the model has '", p.name,
                          "' ", shape_str(p.shape), ": load it with the model it was saved from"));
      }
      for (const nlohmann::json& shard : info.fields.at("shards")) {
        const std::string file = shard.at("file").get<std::string>();
        if (!m.files.count(file)) throw corrupt(str("shard '", file, "' is not among its files"));
        File& f = files_.emplace_back();
        f.name = file;
        f.digest = m.files.at(file);
        for (const nlohmann::json& piece : shard.at("pieces")) {
          if (piece.contains("xxh3_128"))
            for (int kind = 0; kind < 3; ++kind)
              f.tensor_digests[piece_tensor(kind, piece.at("piece").get<int64_t>())] =
                  piece.at("xxh3_128").at(kind).get<std::string>();
          int64_t at = 0;
          for (const nlohmann::json& run : piece.at("runs")) {
            runs_.push_back({run.at(0).get<int64_t>(), run.at(1).get<int64_t>(), files_.size() - 1,
                             piece.at("piece").get<int64_t>(), at});
            at += runs_.back().n;
          }
        }
      }
    } catch (const nlohmann::json::exception& e) {
      throw corrupt(e.what());
    }
    std::sort(runs_.begin(), runs_.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
    // Every element in exactly one file.
    int64_t next = 0;
    for (const Run& r : runs_) {
      if (r.global != next || r.n <= 0)
        throw corrupt(str("elements from ", std::min(next, r.global), " of the state are ",
                          r.global > next ? "in no file" : "in two files"));
      next += r.n;
    }
    if (next != layout.numel()) throw corrupt(str("elements from ", next, " of the state are in no file"));
  }

  // `n` elements of kind `kind` (params, exp_avg, exp_avg_sq) from flat
  // element `global` into `dst`: only their bytes are read.
  void read(int kind, int64_t global, int64_t n, float* dst) override {
    auto it =
        std::upper_bound(runs_.begin(), runs_.end(), global, [](int64_t g, const Run& r) { return g < r.global; });
    LOOM_CHECK(it != runs_.begin(), "flat element ", global, " before the state");
    for (--it; n > 0; ++it) {
      LOOM_CHECK(it != runs_.end() && it->global <= global && global < it->global + it->n, "flat element ", global,
                 " outside the state");
      const int64_t from = global - it->global, take = std::min(n, it->n - from);
      const std::string tensor = piece_tensor(kind, it->piece);
      const uint64_t offset = static_cast<uint64_t>(it->at + from) * 4;
      const size_t bytes = static_cast<size_t>(take) * 4;
      File& f = open(it->file);
      // A piece's three kinds are read block by block: each is its own
      // stream of reads.
      if (f.verifier)
        f.verifier->read_range(tensor, offset, dst, bytes, kind);
      else
        f.reader->read_range(tensor, offset, dst, bytes, kind);
      global += take;
      dst += take;
      n -= take;
    }
  }

  void finish() override {
    for (File& f : files_)
      if (f.verifier) f.verifier->finish();
  }

 private:
  struct Run {
    int64_t global, n;
    size_t file;
    int64_t piece, at;  // the piece's tensors, and the run's first element in them
  };

  struct File {
    std::string name;
    FileDigest digest;
    std::map<std::string, std::string, std::less<>> tensor_digests;  // none before tensor digests
    std::unique_ptr<SafetensorsReader> reader;
    std::unique_ptr<TensorVerifier> verifier;  // where there are tensor digests
  };

  File& open(size_t file) {
    File& f = files_[file];
    if (!f.reader) {
      verify_checkpoint_file(dir_, f.name, f.digest, /*checksum=*/f.tensor_digests.empty());
      f.reader = std::make_unique<SafetensorsReader>(dir_ / f.name);
      if (!f.tensor_digests.empty()) f.verifier = std::make_unique<TensorVerifier>(*f.reader, f.tensor_digests);
    }
    return f;
  }

  fs::path dir_;
  std::vector<File> files_;
  std::vector<Run> runs_;  // by global
};

std::unique_ptr<SavedState> open_saved_state(const CheckpointInfo& info, const ParamLayout& layout) {
  if (is_sharded(info.dir, info.fields)) return std::make_unique<ShardedState>(info, layout);
  return std::make_unique<SingleFileState>(info.dir, layout);
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
// The fp32 loaders' guard: a quantized checkpoint is for inference.
void reject_quantized(const CheckpointInfo& info) {
  if (info.fields.contains(kQuantizationField))
    throw Error(str("checkpoint '", info.dir.string(), "' holds quantized weights (loom quantize): they serve ",
                    "inference (loom generate, eval, serve); train from the fp32 checkpoint it was made from, ",
                    info.fields.at(kQuantizationField).value("source", std::string("its source"))));
}
}  // namespace

fs::path save_checkpoint(const fs::path& root, Trainer& t, const nlohmann::json& fields, int64_t keep_last,
                         DeviceMesh* mesh, CheckpointFormat format) {
  CheckpointWriter writer(root, t, mesh, {.keep_last = keep_last, .format = format});
  writer.save(fields);
  return root / checkpoint_dir_name(t.steps_done());
}

// One checkpoint between its step boundary and its commit.
struct CheckpointWriter::Pending {
  int64_t step = 0;
  std::string name;
  double started = 0.0;
  nlohmann::json fields;               // rank 0: the manifest's fields
  std::optional<AtomicDirWriter> dir;  // rank 0: the staging directory (removed unless committed)
  std::map<std::string, FileDigest> files;  // rank 0: the single-file format's files
  std::vector<Tensor> snapshot;        // async: this rank's own state at the step boundary
  std::thread writer;                  // async: writes the shard from the snapshot
  std::atomic<bool> written{false};
  nlohmann::json own;  // this rank's shard entry, null, or {"error": why}

  // The shard's writer ends before the staging directory goes.
  ~Pending() {
    if (writer.joinable()) writer.join();
  }
};

CheckpointWriter::CheckpointWriter(fs::path root, Trainer& trainer, DeviceMesh* mesh, CheckpointOptions options,
                                   Report report)
    : root_(std::move(root)), trainer_(trainer), mesh_(mesh), options_(options), report_(std::move(report)) {
  const ModelParallel& mp = trainer.model().parallel();
  // Every replica has a data-parallel rank 0: under a mesh only the world's
  // rank 0 commits.
  LOOM_CHECK(mesh || (mp.tp.size() == 1 && mp.first_stage && mp.last_stage),
             "a Trainer whose model is split over tp or pp ranks saves with the mesh it was built on");
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::save(const nlohmann::json& fields) {
  finish();
  Trainer& t = trainer_;
  Communicator* ranks = mesh_ ? &mesh_->world() : t.data_parallel();
  const int rank = ranks ? ranks->rank() : 0;
  auto p = std::make_unique<Pending>();
  p->step = t.steps_done();
  p->name = checkpoint_dir_name(p->step);
  p->started = seconds_since_epoch();
  std::optional<StateRuns> runs;
  if (options_.format == CheckpointFormat::sharded) runs = t.own_state_runs();
  report_progress("checkpoint write", p->step);
  if (rank == 0) {
    fs::create_directories(root_);
    p->dir.emplace(root_ / p->name);
    p->fields = manifest_fields(t, fields, mesh_);
  }
  if (runs) {
    if (p->dir) {
      p->fields[kFormatField] = kShardedFormat;
      p->fields["state"] = state_json(t.state_layout());
    }
    // Every rank writes into rank 0's staging directory; the commit waits
    // for every rank's digest, so a rank that fails leaves nothing behind.
    const fs::path staging = all_gather_text(ranks, p->dir ? p->dir->temp_dir().string() : "")[0];
    if (options_.async) {
      p->snapshot = snapshot_own_state(t, *runs);
      Pending* q = p.get();
      q->writer = std::thread([q, staging, rank, runs = *runs] {
        yield_cpu_to_training();
        q->own = write_own_shard(staging, rank, runs, [&](const PartWriter& write) {
          for (size_t k = 0; k < runs.size(); ++k) {
            const Tensor& piece = q->snapshot[k];
            if (!piece.defined()) continue;
            const int64_t n = piece.numel() / 3;
            for (int kind = 0; kind < 3; ++kind) write(k, kind, piece.data<float>() + kind * n, n);
          }
        });
        q->written = true;
      });
      pending_ = std::move(p);
      return;
    }
    p->own = write_own_shard(staging, rank, *runs,
                             [&](const PartWriter& write) { stream_own_state(t, *runs, write); });
  } else {
    // The state streams from the Trainer (collective) into the files on rank
    // 0: in one piece, or a chunk at a time under a memory policy. A write
    // that fails is remembered; the rank goes on taking part in the gather.
    std::optional<SafetensorsWriter> model_file, optimizer_file;
    const ParamLayout& layout = t.state_layout();
    std::string error;
    const auto writing = [&](const std::function<void()>& write) {
      if (!p->dir || !error.empty()) return;
      try {
        write();
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
    writing([&] {
      const std::map<std::string, std::string> metadata{{"format", "loom"}};
      model_file.emplace(p->dir->path(kModelFile), model_specs(layout), metadata);
      optimizer_file.emplace(p->dir->path(kOptimizerFile), optimizer_specs(layout), metadata);
    });
    t.visit_state([&](FlatRange r, const float* params, const float* exp_avg, const float* exp_avg_sq) {
      report_progress();
      writing([&] {
        for_each_param_in(layout, r, [&](const ParamSpec& param, int64_t at) {
          report_progress();
          model_file->write(param.name, params + at);
          optimizer_file->write("exp_avg." + param.name, exp_avg + at);
          optimizer_file->write("exp_avg_sq." + param.name, exp_avg_sq + at);
        });
      });
    });
    writing([&] {
      model_file->finish();
      optimizer_file->finish();
      p->files[kModelFile] = model_file->digest();
      p->files[kOptimizerFile] = optimizer_file->digest();
    });
    if (!error.empty()) p->own = {{"error", error}};
  }
  pending_ = std::move(p);
  commit();
}

void CheckpointWriter::poll() {
  if (!pending_) return;
  // Committed only once every rank's shard is written: the ranks agree.
  int32_t written = pending_->written ? 1 : 0;
  if (Communicator* ranks = mesh_ ? &mesh_->world() : trainer_.data_parallel())
    ranks->all_reduce(&written, 1, DType::i32, ReduceOp::min);
  if (written == 1) commit();
}

void CheckpointWriter::finish() {
  if (pending_) commit();
}

void CheckpointWriter::commit() {
  Pending& p = *pending_;
  if (p.writer.joinable()) p.writer.join();
  Communicator* ranks = mesh_ ? &mesh_->world() : trainer_.data_parallel();
  std::string error;
  nlohmann::json shards = nlohmann::json::array();
  const std::vector<std::string> entries = all_gather_text(ranks, p.own.dump());
  for (size_t r = 0; r < entries.size(); ++r) {
    nlohmann::json shard = nlohmann::json::parse(entries[r]);
    if (shard.is_null()) continue;
    if (shard.contains("error")) {
      if (error.empty()) error = str("rank ", r, ": ", shard.at("error").get<std::string>());
      continue;
    }
    const std::optional<FileDigest> digest = parse_digest_json(shard.at("digest"));
    LOOM_CHECK(digest.has_value(), "rank ", r, " sent the digest ", shard.at("digest").dump());
    p.files[shard.at("file").get<std::string>()] = *digest;
    shard.erase("digest");
    shards.push_back(std::move(shard));
  }
  if (p.dir && error.empty()) {
    try {
      if (p.fields.contains(kFormatField)) p.fields["shards"] = std::move(shards);
      write_manifest(p.dir->temp_dir(), p.fields, std::move(p.files));
      p.dir->commit();
      write_latest(root_, p.name);
      apply_retention(root_, options_.keep_last);
    } catch (const std::exception& e) {
      error = str("rank 0: ", e.what());
    }
  }
  // Every rank takes rank 0's verdict, and none goes on (and possibly reads
  // `latest`) before the commit.
  error = all_gather_text(ranks, error)[0];
  const CheckpointOutcome outcome{.step = p.step,
                                  .dir = error.empty() ? root_ / p.name : fs::path(),
                                  .error = error,
                                  .seconds = seconds_since_epoch() - p.started};
  pending_.reset();  // an uncommitted staging directory goes with it
  if (report_) report_(outcome);
  if (!error.empty() && options_.stop_on_failure)
    throw Error(str("the checkpoint of step ", outcome.step, " could not be written (", error,
                    "); nothing of it was kept and any earlier checkpoint in '", root_.string(),
                    "' is intact: free space there, or set train.checkpoint_failure = continue to train on "
                    "without it"));
}

CheckpointInfo read_checkpoint_info(const fs::path& dir) {
  // A sharded checkpoint's files are checked by size here and by checksum
  // as each rank first reads one: no rank reads files it does not need.
  const bool sharded = is_sharded(dir, read_manifest(dir).fields);
  Manifest m = verify_checkpoint_dir(dir, !sharded);
  // A quantized checkpoint (quant.h) holds weights only.
  const bool quantized = m.fields.contains(kQuantizationField);
  for (const char* file : {kModelFile, kOptimizerFile})
    if (!sharded && !m.files.count(file) && !(quantized && file == kOptimizerFile))
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

namespace {

// Reads a rank's piece of one parameter (p, of the rank's layout) from the
// whole model's saved state, where the whole tensor starts at flat element
// `first`: run by run of consecutive global elements (padding: zero).
void read_piece(SavedState& state, const ParamSpec& p, int64_t first, float* dst) {
  for (int64_t i = 0, run = 0; i < p.numel(); i += run) {
    const int64_t g = p.global_index(i, &run);
    run = std::min(run, p.numel() - i);
    if (g < 0)
      std::fill(dst + i, dst + i + run, 0.0f);
    else
      state.read(0, first + g, run, dst + i);
  }
}

}  // namespace

void load_weights(const CheckpointInfo& info, const GPT& model, ParamStore& params) {
  reject_quantized(info);
  Tensor flat = params.flat();
  // The files are read straight into the parameters.
  const HostSection host;
  const ModelParallel& mp = model.parallel();
  if (mp.tp.size() == 1 && mp.first_stage && mp.last_stage && model.num_chunks() == 1) {
    const std::unique_ptr<SavedState> state = open_saved_state(info, model.layout());
    state->read(0, 0, flat.numel(), flat.data<float>());
    state->finish();
    return;
  }
  // A rank's part of the model (tensor-parallel generation): only its pieces.
  const GPT saved(checkpoint_model_config(info));
  const ParamLayout& whole = saved.layout();
  const std::unique_ptr<SavedState> state = open_saved_state(info, whole);
  for (const ParamSpec& p : model.layout().params()) {
    const int id = whole.find(p.name);
    LOOM_CHECK(id >= 0, "parameter '", p.name, "' is not in the checkpoint's model");
    read_piece(*state, p, whole.param(id).offset, flat.data<float>() + p.offset);
  }
  state->finish();
}

void load_weights(const CheckpointInfo& info, Trainer& trainer, uint64_t seed) {
  const GPT saved(checkpoint_model_config(info));
  const ParamLayout& whole = saved.layout();
  const std::unique_ptr<SavedState> state = open_saved_state(info, whole);
  trainer.load_weights([&](const ParamLayout& layout, FlatRange range, float* params) {
    for_each_param_in(layout, range, [&](const ParamSpec& p, int64_t at) {
      report_progress();
      const int id = whole.find(p.name);
      if (id < 0)
        layout.initialize(params + at, p.offset, p.numel(), seed);
      else
        read_piece(*state, p, whole.param(id).offset, params + at);
    });
  });
  state->finish();
}

CheckpointInfo load_checkpoint(const fs::path& dir, Trainer& trainer) {
  CheckpointInfo info = read_checkpoint_info(dir);
  reject_quantized(info);
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
  // Each rank reads the runs of its own layout's pieces, nothing else, in the
  // pieces its store takes them in (staged on the host tier, so the device
  // high-water mark stays the training's).
  report_progress("checkpoint read", info.step);
  const std::unique_ptr<SavedState> saved_state = open_saved_state(info, layout);
  trainer.load_own_state(state, [&](int64_t global, int64_t n, float* params, float* exp_avg, float* exp_avg_sq) {
    report_progress();
    saved_state->read(0, global, n, params);
    saved_state->read(1, global, n, exp_avg);
    saved_state->read(2, global, n, exp_avg_sq);
  });
  saved_state->finish();
  return info;
}

std::vector<std::string> pruned_params(const CheckpointInfo& info) {
  if (!info.fields.contains(kPruningField)) return {};
  const nlohmann::json& pruning = info.fields.at(kPruningField);
  try {
    return pruning.at("params").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception&) {
    throw Error(str("manifest of checkpoint '", info.dir.string(), "' has a malformed '", kPruningField,
                    "' (it needs \"params\": [names]): ", pruning.dump()));
  }
}

fs::path resolve_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(path / kManifestFile, ec)) return path;
  if (auto latest = read_latest(path)) return *latest;
  throw Error(str("'", path.string(), "' is neither a checkpoint directory (no ", kManifestFile,
                  ") nor a run directory with a 'latest' checkpoint"));
}


GPTConfig teacher_model_config(const std::string& source) {
  if (const std::optional<fs::path> dir = hf_dir_of(source)) return HFImport(*dir).model;
  return checkpoint_model_config(read_checkpoint_info(resolve_checkpoint(source)));
}

void load_teacher(const std::string& source, Trainer& trainer) {
  if (const std::optional<fs::path> dir = hf_dir_of(source)) {
    const HFImport src(*dir);
    const uint64_t seed = trainer.options().seed;
    trainer.load_teacher_weights(
        [&](const ParamLayout& layout, FlatRange r, float* p) { src.fill(layout, r, p, seed); });
    return;
  }
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(source));
  // The saved state is in the whole teacher's coordinates; a tensor-parallel
  // rank reads the runs of its pieces.
  const GPT whole(checkpoint_model_config(info));
  const std::unique_ptr<SavedState> saved = open_saved_state(info, whole.layout());
  trainer.load_teacher_weights([&](const ParamLayout& layout, FlatRange r, float* params) {
    for_each_whole_run(
        layout, whole.layout(),
        [&](const ParamSpec&, int64_t at, int64_t global, int64_t n) {
          float* dst = params + (at - r.begin);
          if (global < 0)
            std::fill_n(dst, n, 0.0f);  // vocabulary padding
          else
            saved->read(0, global, n, dst);
        },
        r);
  });
  saved->finish();
}

}  // namespace loom
