// Sharded checkpoints: every rank writes only the state it holds, any layout
// loads them reading only its own pieces, and training continues bit-exactly
// under the layout that saved them and within 1e-5 under another.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <mutex>

#include "loom/device.h"
#include "loom/io.h"
#include "loom/train.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::DataParallelRun;
using testing::error_of;
using testing::RunResult;
using testing::TempDir;

constexpr int kSteps = 4, kSaveAt = 2;

// Four heads, so that tp4 loads what every layout saves.
DataParallelRun with_heads(DataParallelRun r) {
  r.n_head = 4;
  r.steps = kSteps;
  return r;
}

// A q x q x depth tensor-parallel grid (2D, or 2.5D with depth > 1, or a
// 3D cube with depth q).
DataParallelRun on_grid(int q, int depth, bool cube = false) {
  DataParallelRun r = with_heads(testing::layout(1, 0));
  r.tp = q * q * depth;
  r.grid = {q, depth, cube};
  return r;
}

// What one rank of a save measured.
struct SavePeak {
  size_t host_extra = 0;  // the host tier's peak during the save over what it held before
  int64_t own_numel = 0;  // elements of the store's owned ranges
  int64_t largest_range = 0;
};

struct Segment {
  RunResult result;  // rank 0's losses of the steps run and the state after them
  std::vector<float> loaded_params, loaded_exp_avg, loaded_exp_avg_sq;  // rank 0's, right after the load
  fs::path saved;
  std::vector<SavePeak> peaks;  // per rank
  std::vector<size_t> load_extra;  // per rank: the host tier's peak during the load over what it held before
  // Per rank: the elements a load asks of the checkpoint, and those the
  // store keeps (its owned ranges and the frozen parameters; -1 for a store
  // without owned ranges).
  std::vector<int64_t> load_asked, own_numel;
};

// Runs steps [from, to) of layout `r`, starting from checkpoint `load` (when
// not empty) and saving one into `save_root` after the last (when not empty).
Segment run_segment(const DataParallelRun& r, int from, int to, const fs::path& load, const fs::path& save_root,
                    CheckpointFormat format = CheckpointFormat::sharded) {
  Segment seg;
  std::mutex mu;
  const int world = r.dp == 0 ? 1 : r.dp * r.tp * r.pp;
  seg.peaks.resize(static_cast<size_t>(world));
  seg.load_extra.resize(static_cast<size_t>(world));
  seg.load_asked.resize(static_cast<size_t>(world));
  seg.own_numel.resize(static_cast<size_t>(world), -1);
  const auto body = [&](Communicator* comm) {
    const GPTConfig cfg = testing::model_of(r);
    const TrainOptions opts = testing::small_options(r);
    const std::unique_ptr<DeviceMesh> mesh = testing::mesh_of(comm, r);
    const std::unique_ptr<Trainer> trainer =
        mesh ? std::make_unique<Trainer>(cfg, opts, *mesh) : std::make_unique<Trainer>(cfg, opts, comm);
    Trainer& t = *trainer;
    const bool first = !comm || comm->rank() == 0;
    if (!load.empty()) {
      Allocator& host = MemoryContext::current().tier(Tier::host);
      const size_t before = host.used();
      host.reset_peak();
      load_checkpoint(load, t);
      const size_t me = static_cast<size_t>(comm ? comm->rank() : 0);
      seg.load_extra[me] = host.peak() - before;
      const Trainer::State s = t.gather_state();
      // Loading the gathered state again counts what a load asks for.
      t.load_own_state(s, [&](int64_t global, int64_t n, float* params, float* exp_avg, float* exp_avg_sq) {
        seg.load_asked[me] += n;
        std::copy_n(s.params.data<float>() + global, n, params);
        std::copy_n(s.exp_avg.data<float>() + global, n, exp_avg);
        std::copy_n(s.exp_avg_sq.data<float>() + global, n, exp_avg_sq);
      });
      {
        seg.own_numel[me] = 0;
        for (const FlatRange range : t.optimizer().owned_ranges()) seg.own_numel[me] += range.numel();
        // Frozen parameters are not sharded: every replica keeps them, one
        // (data-parallel rank 0) saves them.
        const int dp_rank = mesh ? mesh->coord(MeshAxis::dp) : comm ? comm->rank() : 0;
        if (t.frozen() && dp_rank != 0) seg.own_numel[me] += t.frozen()->numel();
      }
      if (first) {
        seg.loaded_params = testing::to_vector(s.params);
        seg.loaded_exp_avg = testing::to_vector(s.exp_avg);
        seg.loaded_exp_avg_sq = testing::to_vector(s.exp_avg_sq);
      }
    }
    const int dp = mesh ? r.dp : comm ? comm->size() : 1;
    const int rank = mesh ? mesh->coord(MeshAxis::dp) : comm ? comm->rank() : 0;
    std::vector<StepStats> stats;
    for (int step = from; step < to; ++step) {
      const std::vector<int32_t> data = testing::step_tokens(step, cfg.vocab_size);
      stats.push_back(t.step(testing::rank_micro_batches(data, dp, rank, r.accumulation)));
    }
    if (!save_root.empty()) {
      Allocator& host = MemoryContext::current().tier(Tier::host);
      const size_t before = host.used();
      host.reset_peak();
      const fs::path saved = save_checkpoint(save_root, t, {}, 0, mesh.get(), format);
      SavePeak peak{host.peak() - before, 0, 0};
      for (const FlatRange range : t.optimizer().owned_ranges()) {
        peak.own_numel += range.numel();
        peak.largest_range = std::max(peak.largest_range, range.numel());
      }
      const std::lock_guard lock(mu);
      seg.peaks[static_cast<size_t>(comm ? comm->rank() : 0)] = peak;
      seg.saved = saved;
    }
    const Trainer::State s = t.gather_state();
    if (first) {
      seg.result.model = cfg;
      seg.result.stats = stats;
      seg.result.params = testing::to_vector(s.params);
      seg.result.exp_avg = testing::to_vector(s.exp_avg);
      seg.result.exp_avg_sq = testing::to_vector(s.exp_avg_sq);
    }
  };
  if (r.dp == 0)
    body(nullptr);
  else
    run_local(world, [&](Communicator& c) { body(&c); });
  return seg;
}

// The data bytes of every file of a sharded checkpoint: the whole state
// exactly once (three fp32 kinds) when no element is written twice.
int64_t shard_data_bytes(const fs::path& dir) {
  int64_t bytes = 0;
  for (const auto& [file, digest] : read_manifest(dir).files) {
    const SafetensorsReader reader(dir / file);
    for (const SafetensorsReader::Entry& e : reader.entries()) bytes += static_cast<int64_t>(e.bytes);
  }
  return bytes;
}

struct SavedLayout {
  std::string name;
  DataParallelRun run;
};

class ShardedCheckpoint : public ::testing::TestWithParam<SavedLayout> {};

TEST_P(ShardedCheckpoint, SavesOwnStateAndResumesUnderAnyLayout) {
  const DataParallelRun saver = GetParam().run;
  TempDir dir;
  const Segment whole = run_segment(saver, 0, kSteps, {}, {});
  const Segment first = run_segment(saver, 0, kSaveAt, {}, dir.path() / "run");
  const GPT model(whole.result.model);
  const int64_t numel = model.layout().numel();
  int64_t largest_param = 0;
  for (const ParamSpec& p : model.layout().params()) largest_param = std::max(largest_param, p.numel());

  // Every element saved once, by one rank; the files are the ranks' own.
  const Manifest m = read_manifest(first.saved);
  EXPECT_EQ(m.fields.at("checkpoint_format"), 2);
  EXPECT_FALSE(m.files.contains("model.safetensors"));
  EXPECT_EQ(shard_data_bytes(first.saved), 12 * numel);
  // A save stages at most one buffer of the size of an owned range (a chunk's
  // shard, padding included, under a memory policy) on the host, never the
  // whole model (the single-file format gathers three copies of it).
  int64_t largest_range = 0;
  for (const SavePeak& p : first.peaks) largest_range = std::max(largest_range, p.largest_range);
  for (size_t rank = 0; rank < first.peaks.size(); ++rank) {
    const SavePeak& p = first.peaks[rank];
    EXPECT_GT(p.own_numel, 0) << "rank " << rank;
    EXPECT_LE(p.host_extra, static_cast<size_t>(12 * largest_range)) << "rank " << rank;
    EXPECT_LT(p.host_extra, static_cast<size_t>(12 * numel)) << "rank " << rank;
  }
  std::printf("%s: host bytes staged by a save, per rank:", GetParam().name.c_str());
  for (const SavePeak& p : first.peaks) std::printf(" %zu (own state %lld)", p.host_extra, 12LL * p.own_numel);
  std::printf("\n");

  // The same layout continues bit-exactly, each rank asking the checkpoint
  // for no element beyond those it keeps (under ZeRO and chunks, its shard).
  const Segment same = run_segment(saver, kSaveAt, kSteps, first.saved, {});
  for (size_t rank = 0; rank < same.load_asked.size(); ++rank)
    if (same.own_numel[rank] >= 0) {
      EXPECT_LE(same.load_asked[rank], same.own_numel[rank]) << "rank " << rank;
    }
  EXPECT_TRUE(testing::bit_equal(same.loaded_params, first.result.params));
  EXPECT_TRUE(testing::bit_equal(same.result.params, whole.result.params));
  EXPECT_TRUE(testing::bit_equal(same.result.exp_avg, whole.result.exp_avg));
  EXPECT_TRUE(testing::bit_equal(same.result.exp_avg_sq, whole.result.exp_avg_sq));
  for (int s = 0; s < kSteps - kSaveAt; ++s)
    EXPECT_EQ(same.result.stats[static_cast<size_t>(s)].loss,
              whole.result.stats[static_cast<size_t>(kSaveAt + s)].loss);

  // Other layouts load the same state bit for bit, staging at most one
  // parameter's state on the host, and continue within 1e-5.
  DataParallelRun tp4 = with_heads(testing::layout(1, 0));
  tp4.tp = 4;
  const std::vector<std::pair<std::string, DataParallelRun>> loaders{
      {"single rank", with_heads(testing::layout(0, 0))},
      {"dp4 ZeRO-3", with_heads(testing::layout(4, 3))},
      {"tp4", tp4},
      {"2d tp4", on_grid(2, 1)},
      {"2.5d tp8", on_grid(2, 2)},
      {"3d tp8", on_grid(2, 2, true)}};
  RunResult tail = whole.result;
  tail.stats.erase(tail.stats.begin(), tail.stats.begin() + kSaveAt);
  for (auto [name, loader] : loaders) {
    // The same model and the same parameters trained; LoRA adapters run
    // under 1D tensor parallelism only.
    if (saver.lora.enabled() && loader.grid.q > 1) continue;
    loader.freeze = saver.freeze;
    loader.lora = saver.lora;
    const Segment other = run_segment(loader, kSaveAt, kSteps, first.saved, {});
    EXPECT_TRUE(testing::bit_equal(other.loaded_params, first.result.params)) << name;
    for (size_t rank = 0; rank < other.load_extra.size(); ++rank)
      EXPECT_LE(other.load_extra[rank], static_cast<size_t>(12 * largest_param)) << name << " rank " << rank;
    for (size_t rank = 0; rank < other.load_asked.size(); ++rank)
      if (other.own_numel[rank] >= 0) {
        EXPECT_LE(other.load_asked[rank], other.own_numel[rank]) << name << " rank " << rank;
      }
    EXPECT_TRUE(testing::bit_equal(other.loaded_exp_avg, first.result.exp_avg)) << name;
    EXPECT_TRUE(testing::bit_equal(other.loaded_exp_avg_sq, first.result.exp_avg_sq)) << name;
    EXPECT_LE(testing::max_loss_rel_diff(other.result, tail), 1e-5) << name;
    EXPECT_LE(testing::param_rel_diff(other.result, tail), 1e-5) << name;
  }
}

std::vector<SavedLayout> saved_layouts() {
  DataParallelRun mesh = with_heads(testing::layout(2, 1));
  mesh.tp = 2;
  mesh.pp = 2;
  DataParallelRun replicated_mesh = mesh;  // every data-parallel replica holds the same
  replicated_mesh.stage = 0;
  DataParallelRun offload = with_heads(testing::layout(2, 3));
  offload.memory.policy = MemoryPolicy::fixed;
  offload.memory.offload_param_frac = 0.5;
  offload.memory.offload_optim_frac = 0.5;
  offload.memory.chunk_bytes = 32 << 10;  // several chunks
  DataParallelRun grid_mesh = on_grid(2, 1);
  grid_mesh.dp = 2;
  grid_mesh.stage = 1;
  // Frozen parameters (saved by one data-parallel replica, as they are not
  // sharded) between trainable ones that ZeRO shards.
  DataParallelRun frozen = with_heads(testing::layout(2, 3));
  frozen.freeze = {"wte", "h.0.attn", "h.1.mlp.c_fc"};
  DataParallelRun lora = mesh;
  lora.lora = LoRAConfig{.r = 2, .alpha = 4.0f, .dropout = 0.0f, .targets = {"c_attn", "mlp.c_proj"}};
  return {{"tp2_pp2_dp2_zero1", mesh},
          {"2d_tp4_dp2_zero1", grid_mesh},
          {"2p5d_tp8", on_grid(2, 2)},
          {"3d_tp8", on_grid(2, 2, true)},
          {"tp2_pp2_dp2_zero0", replicated_mesh},
          {"dp2_zero0", with_heads(testing::layout(2, 0))},
          {"dp2_zero3", with_heads(testing::layout(2, 3))},
          {"dp2_chunk_offload", offload},
          {"dp2_zero3_frozen", frozen},
          {"lora_tp2_pp2_dp2_zero1", lora}};
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedCheckpoint, ::testing::ValuesIn(saved_layouts()),
                         [](const auto& info) { return info.param.name; });

TEST(ShardedCheckpointFiles, ACorruptFileIsRefusedByName) {
  TempDir dir;
  const Segment first = run_segment(with_heads(testing::layout(2, 3)), 0, 1, {}, dir.path());
  const fs::path file = first.saved / "rank_00001.safetensors";
  ASSERT_TRUE(fs::exists(file));
  testing::flip_bit(file, -5, std::ios::end);
  const std::string error =
      error_of([&] { run_segment(with_heads(testing::layout(0, 0)), 1, 1, first.saved, {}); });
  EXPECT_CONTAINS(error, "rank_00001.safetensors");
  EXPECT_CONTAINS(error, "corrupt");
}

// Sharded checkpoints written before tensor digests (no "xxh3_128" in their
// pieces) load, verified a whole file at a time.
TEST(ShardedCheckpointFiles, ACheckpointWithoutTensorDigestsStillLoads) {
  TempDir dir;
  const Segment first = run_segment(with_heads(testing::layout(2, 3)), 0, 1, {}, dir.path());
  const fs::path manifest = first.saved / kManifestFile;
  nlohmann::json m = nlohmann::json::parse(read_file(manifest));
  for (nlohmann::json& shard : m.at("shards"))
    for (nlohmann::json& piece : shard.at("pieces")) ASSERT_EQ(piece.erase("xxh3_128"), 1u);
  write_file_atomic(manifest, m.dump());
  const Segment loaded = run_segment(with_heads(testing::layout(0, 0)), 1, 1, first.saved, {});
  EXPECT_TRUE(testing::bit_equal(loaded.loaded_params, first.result.params));
  EXPECT_TRUE(testing::bit_equal(loaded.loaded_exp_avg_sq, first.result.exp_avg_sq));

  // A corrupt byte is then found by the file's checksum.
  const fs::path file = first.saved / "rank_00000.safetensors";
  testing::flip_bit(file, -9, std::ios::end);
  const std::string error =
      error_of([&] { run_segment(with_heads(testing::layout(0, 0)), 1, 1, first.saved, {}); });
  EXPECT_CONTAINS(error, "'rank_00000.safetensors' has xxh3_128");
}

// The first format, one file for the whole model, still loads under any layout.
TEST(ShardedCheckpointFiles, ASingleFileCheckpointStillLoads) {
  TempDir dir;
  const Segment first = run_segment(with_heads(testing::layout(2, 3)), 0, kSaveAt, {}, dir.path(),
                                    CheckpointFormat::single_file);
  EXPECT_FALSE(read_manifest(first.saved).fields.contains("checkpoint_format"));
  EXPECT_TRUE(fs::exists(first.saved / "model.safetensors"));
  DataParallelRun tp2 = with_heads(testing::layout(1, 0));
  tp2.tp = 2;
  for (const DataParallelRun& loader : {with_heads(testing::layout(0, 0)), tp2}) {
    const Segment other = run_segment(loader, kSaveAt, kSaveAt, first.saved, {});
    EXPECT_TRUE(testing::bit_equal(other.loaded_params, first.result.params));
    EXPECT_TRUE(testing::bit_equal(other.loaded_exp_avg_sq, first.result.exp_avg_sq));
  }
  // generate, eval and export read the weights of either format.
  TempDir sharded;
  const Segment s = run_segment(with_heads(testing::layout(2, 3)), 0, kSaveAt, {}, sharded.path());
  const CheckpointInfo info = read_checkpoint_info(s.saved);
  GPT model(checkpoint_model_config(info));
  ParamStore ps(model.layout(), 0);
  load_weights(info, model, ps);
  const HostSection host;
  EXPECT_TRUE(testing::bit_equal(testing::to_vector(ps.flat()), s.result.params));
}

}  // namespace
}  // namespace loom
