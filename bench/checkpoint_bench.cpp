// Checkpoints (issue: training that survives), each figure against a
// baseline measured in the same run:
//
//   checkpoint_bench [dir|-] [state_GB] [ranks] [async_state_MB] [steps]
//   e.g. checkpoint_bench - 1.0 4 256 8   (the defaults)
//
// 1. Save and load of a model with state_GB of model state (fp32 weights and
//    both AdamW moments, 12 bytes a parameter) on `ranks` local data-parallel
//    ranks under ZeRO-3, so every rank holds a quarter: the sharded save
//    (every rank writes its own file, hashing as it writes), the gathered
//    single-file save (rank 0 writes everything), and the sharded load (each
//    rank reads what it holds). Baseline: `dd` writing (conv=fsync, as the
//    commit syncs) and reading the same bytes per rank, one dd per rank at
//    once. Figures: dd's time over loom's (1 = dd's speed; target >= 0.7)
//    and the sharded save's speed-up over the gathered one. The load reads
//    what the save just wrote, as dd's read does: both from the page cache
//    unless the machine is short of memory.
// 2. Asynchronous checkpoints: a model of async_state_MB of state on 2
//    ranks trains `steps` steps with nothing written, then `steps` steps
//    with a checkpoint started before each one that found none in flight.
//    Figures: the median step time while a checkpoint is written over the
//    median without (target <= 1.10), and the pause at the step boundary
//    (the snapshot into host memory) over the median step.
//
// "-" (the default) writes under ./loom-checkpoint-bench-<pid>, removed at
// the end. On two shared cores the writer's hashing competes with the step's
// threads; OMP_WAIT_POLICY=passive keeps idle threads from spinning.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/train.h"

using namespace loom;
using bench::median;
using bench::now_seconds;
namespace fs = std::filesystem;

namespace {

class BenchDir {
 public:
  explicit BenchDir(const std::string& arg) {
    if (arg != "-") {
      path_ = arg;
      if (!fs::is_directory(path_)) throw Error(str("directory ", path_, " does not exist; create it or pass -"));
      path_ /= str("loom-checkpoint-bench-", ::getpid());
    } else {
      path_ = fs::current_path() / str("loom-checkpoint-bench-", ::getpid());
    }
    fs::create_directories(path_);
  }
  ~BenchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  BenchDir(const BenchDir&) = delete;
  BenchDir& operator=(const BenchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A GPT-2-shaped model of about `state_bytes` of model state: 12 bytes a
// parameter, about 12 * n_embd^2 parameters a layer.
GPTConfig model_of(double state_bytes) {
  GPTConfig cfg;
  cfg.vocab_size = 512;
  cfg.block_size = 64;
  cfg.n_embd = 512;
  cfg.n_head = 8;
  const double per_layer = 12.0 * (12.0 * cfg.n_embd * cfg.n_embd);
  cfg.n_layer = std::max<int64_t>(1, std::llround(state_bytes / per_layer));
  return cfg;
}

TrainOptions options_of(int zero_stage) {
  TrainOptions o;
  o.zero.stage = zero_stage;
  return o;
}

// Seconds of `ranks` dd processes at once, each moving `bytes`.
double dd_seconds(const fs::path& dir, int ranks, int64_t bytes, bool write) {
  const int64_t mib = std::max<int64_t>(1, bytes >> 20);
  std::string cmd = "(";
  for (int r = 0; r < ranks; ++r) {
    const std::string file = (dir / str("dd_", r)).string();
    cmd += write ? str("dd if=/dev/zero of=", file, " bs=1M count=", mib, " conv=fsync status=none & ")
                 : str("dd if=", file, " of=/dev/null bs=1M status=none & ");
  }
  cmd += "wait)";
  const double t = now_seconds();
  if (std::system(cmd.c_str()) != 0) throw Error(str("dd failed: ", cmd));
  return now_seconds() - t;
}

int64_t state_bytes(const GPTConfig& cfg) { return 12 * GPT(cfg).layout().numel(); }

void save_and_load(const fs::path& dir, double state_gb, int ranks) {
  const GPTConfig cfg = model_of(state_gb * 1e9);
  const int64_t bytes = state_bytes(cfg);
  std::printf("1. save and load: %lld layers x %lld wide, %s of model state on %d ranks (ZeRO-3)\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
              format_bytes(double(bytes)).c_str(), ranks);
  std::mutex mu;
  double sharded_save = 0, gathered_save = 0, sharded_load = 0;
  run_local(ranks, [&](Communicator& comm) {
    Trainer t(cfg, options_of(3), &comm);
    const auto timed = [&](const std::function<void()>& f) {
      comm.barrier();
      const double start = now_seconds();
      f();
      comm.barrier();
      return now_seconds() - start;
    };
    const double s = timed([&] { save_checkpoint(dir / "sharded", t, {}, 1); });
    const double g =
        timed([&] { save_checkpoint(dir / "gathered", t, {}, 1, nullptr, CheckpointFormat::single_file); });
    const double l = timed([&] { load_checkpoint(resolve_checkpoint(dir / "sharded"), t); });
    if (comm.rank() == 0) {
      const std::lock_guard lock(mu);
      sharded_save = s;
      gathered_save = g;
      sharded_load = l;
    }
  });
  const int64_t per_rank = bytes / ranks;
  const double dd_write = dd_seconds(dir, ranks, per_rank, true);
  const double dd_read = dd_seconds(dir, ranks, per_rank, false);
  const auto rate = [&](double seconds) { return format_bytes(double(bytes) / seconds) + "/s"; };
  std::printf("   dd, %d at once     write %7.2f s (%s)   read %7.2f s (%s)\n", ranks, dd_write,
              rate(dd_write).c_str(), dd_read, rate(dd_read).c_str());
  std::printf("   sharded save      %7.2f s (%s)   x dd %.2f   (target >= 0.7)\n", sharded_save,
              rate(sharded_save).c_str(), dd_write / sharded_save);
  std::printf("   sharded load      %7.2f s (%s)   x dd %.2f   (target >= 0.7)\n", sharded_load,
              rate(sharded_load).c_str(), dd_read / sharded_load);
  std::printf("   gathered save     %7.2f s (%s)   sharded speed-up %.2fx\n", gathered_save,
              rate(gathered_save).c_str(), gathered_save / sharded_save);
}

void async_steps(const fs::path& dir, double state_mb, int steps) {
  const GPTConfig cfg = model_of(state_mb * 1e6);
  constexpr int kRanks = 2;
  constexpr int64_t B = 4;
  std::printf("2. asynchronous checkpoints: %lld layers, %s of model state on %d ranks (ZeRO-1), %d steps each\n",
              static_cast<long long>(cfg.n_layer), format_bytes(double(state_bytes(cfg))).c_str(), kRanks, steps);
  std::vector<double> plain, writing, pauses;
  int64_t written = 0;
  run_local(kRanks, [&](Communicator& comm) {
    Trainer t(cfg, options_of(1), &comm);
    CheckpointWriter writer(dir / "async", t, nullptr, {.keep_last = 1, .async = true},
                            [&](const CheckpointOutcome& c) {
                              if (comm.rank() == 0 && c.error.empty()) ++written;
                            });
    std::vector<int32_t> tokens(static_cast<size_t>(B * cfg.block_size + 1));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % cfg.vocab_size);
    const MicroBatch mb{tokens.data(), tokens.data() + 1, {B, cfg.block_size}, 0};
    const auto step = [&] {
      comm.barrier();
      const double start = now_seconds();
      t.step(std::span(&mb, 1));
      ops::synchronize();
      comm.barrier();
      return now_seconds() - start;
    };
    step();  // warm-up
    std::vector<double> p, w, s;
    for (int i = 0; i < steps; ++i) p.push_back(step());
    for (int i = 0; i < steps; ++i) {
      if (!writer.in_flight()) {
        comm.barrier();
        const double start = now_seconds();
        writer.save({});
        comm.barrier();
        s.push_back(now_seconds() - start);
      }
      w.push_back(step());
      writer.poll();
    }
    writer.finish();
    if (comm.rank() == 0) {
      plain = p;
      writing = w;
      pauses = s;
    }
  });
  const double base = median(plain), during = median(writing);
  std::printf("   step without a checkpoint  %7.1f ms (median)\n", 1e3 * base);
  std::printf("   step while one is written  %7.1f ms   x %.3f   (target <= 1.10)\n", 1e3 * during, during / base);
  std::printf("   snapshot pause             %7.1f ms   = %.2f steps   (%lld checkpoints written)\n",
              1e3 * median(pauses), median(pauses) / base, static_cast<long long>(written));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string where = argc > 1 ? argv[1] : "-";
    const double state_gb = argc > 2 ? std::atof(argv[2]) : 1.0;
    const int ranks = argc > 3 ? std::atoi(argv[3]) : 4;
    const double async_mb = argc > 4 ? std::atof(argv[4]) : 256.0;
    const int steps = argc > 5 ? std::atoi(argv[5]) : 8;
    if (state_gb <= 0 || ranks < 1 || async_mb <= 0 || steps < 1)
      throw Error("usage: checkpoint_bench [dir|-] [state_GB > 0] [ranks >= 1] [async_state_MB > 0] [steps >= 1]");
    const BenchDir dir(where);
    save_and_load(dir.path(), state_gb, ranks);
    async_steps(dir.path(), async_mb, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
