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
//    once. Figures: dd's time over loom's (1 = dd's speed; target >= 0.7),
//    each the median of 6 rounds, dd and loom taking turns to go first, each
//    write starting with every dirty page written out, and the sharded
//    save's speed-up over the gathered one. Loads are
//    timed twice: from the device (the files' pages dropped from the page
//    cache first, as after a restart on another machine) and again from the
//    page cache, where dd only streams the bytes through one small buffer
//    while a load must also write each byte into the state.
// 2. Asynchronous checkpoints: a model of async_state_MB of state on 2
//    ranks trains `steps` steps with nothing written, then `steps` steps
//    with a checkpoint started before each one that found none in flight.
//    Figures: the median step time while a checkpoint is written over the
//    median without (target <= 1.10), and the pause at the step boundary
//    (the snapshot into host memory) over the median step. Baseline: the
//    same steps while `dd` writes the same bytes (one dd per rank, each
//    rank's share, conv=fsync), started before each step that found none
//    running: what writing those bytes costs the step on this machine
//    whatever writes them (on a virtual machine the device's emulation can
//    run on the same cores).
//
// "-" (the default) writes under ./loom-checkpoint-bench-<pid>, removed at
// the end. On two shared cores the writer's hashing competes with the step's
// threads; OMP_WAIT_POLICY=passive keeps idle threads from spinning.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
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

// Writes every dirty page out and then drops the pages of the files under
// `dir` from the page cache (clean pages go on posix_fadvise's word, no
// privileges needed), so that the next read of them comes from the device.
void evict_from_page_cache(const fs::path& dir) {
  ::sync();
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(str("cannot open ", e.path().string(), " to evict it from the page cache"));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

int64_t state_bytes(const GPTConfig& cfg) { return 12 * GPT(cfg).layout().numel(); }

// Each figure is the median of this many rounds (even: each side goes first
// in half of them); every write starts with no dirty pages (sync), so that
// neither side's time includes writing the other's pages back.
constexpr int kRounds = 6;

void save_and_load(const fs::path& dir, double state_gb, int ranks) {
  const GPTConfig cfg = model_of(state_gb * 1e9);
  const int64_t bytes = state_bytes(cfg), per_rank = bytes / ranks;
  std::printf("1. save and load: %lld layers x %lld wide, %s of model state on %d ranks (ZeRO-3), median of %d\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
              format_bytes(double(bytes)).c_str(), ranks, kRounds);
  std::vector<double> dd_write, save, dd_cold, load_cold, dd_warm, load_warm;
  double gathered_save = 0;
  run_local(ranks, [&](Communicator& comm) {
    Trainer t(cfg, options_of(3), &comm);
    const bool lead = comm.rank() == 0;
    const auto timed = [&](std::vector<double>& into, const std::function<void()>& f) {
      comm.barrier();
      const double start = now_seconds();
      f();
      comm.barrier();
      if (lead) into.push_back(now_seconds() - start);
    };
    // dd runs on rank 0 while the other ranks sleep in the barrier.
    const auto lead_only = [&](const std::function<void()>& f) {
      if (lead) f();
      comm.barrier();
    };
    for (int round = 0; round < kRounds; ++round) {
      const fs::path root = dir / str("sharded-", round);
      // The side that goes first alternates: whichever writes or reads first
      // after a sync meets the device still busy with what the sync wrote.
      const bool dd_first = round % 2 == 0;
      const auto in_order = [&](const std::function<void()>& dd, const std::function<void()>& loom) {
        if (dd_first) lead_only(dd);
        loom();
        if (!dd_first) lead_only(dd);
      };
      in_order(
          [&] {
            ::sync();
            dd_write.push_back(dd_seconds(dir, ranks, per_rank, true));
          },
          [&] {
            lead_only([] { ::sync(); });
            timed(save, [&] { save_checkpoint(root, t, {}, 1); });
          });
      lead_only([&] { evict_from_page_cache(dir); });
      in_order([&] { dd_cold.push_back(dd_seconds(dir, ranks, per_rank, false)); },
               [&] { timed(load_cold, [&] { load_checkpoint(resolve_checkpoint(root), t); }); });
      lead_only([&] { dd_warm.push_back(dd_seconds(dir, ranks, per_rank, false)); });
      timed(load_warm, [&] { load_checkpoint(resolve_checkpoint(root), t); });
      lead_only([&] { fs::remove_all(root); });
    }
    lead_only([] { ::sync(); });
    std::vector<double> gathered;
    timed(gathered, [&] { save_checkpoint(dir / "gathered", t, {}, 1, nullptr, CheckpointFormat::single_file); });
    if (lead) gathered_save = gathered[0];
  });
  const auto rate = [&](double seconds) { return format_bytes(double(bytes) / seconds) + "/s"; };
  const auto row = [&](const char* what, const std::vector<double>& baseline, const std::vector<double>& loom) {
    const double b = median(baseline), l = median(loom);
    std::printf("   %-30s dd %6.2f s (%s)   loom %6.2f s (%s)   x dd %.2f   (target >= 0.7)\n", what, b,
                rate(b).c_str(), l, rate(l).c_str(), b / l);
  };
  row("save (synced)", dd_write, save);
  row("load from the device", dd_cold, load_cold);
  row("load from the page cache", dd_warm, load_warm);
  std::printf("   gathered save (single file) %6.2f s (%s)   sharded speed-up %.2fx\n", gathered_save,
              rate(gathered_save).c_str(), gathered_save / median(save));
}

void async_steps(const fs::path& dir, double state_mb, int steps) {
  const GPTConfig cfg = model_of(state_mb * 1e6);
  constexpr int kRanks = 2;
  constexpr int64_t B = 4;
  std::printf("2. asynchronous checkpoints: %lld layers, %s of model state on %d ranks (ZeRO-1), %d steps each\n",
              static_cast<long long>(cfg.n_layer), format_bytes(double(state_bytes(cfg))).c_str(), kRanks, steps);
  std::vector<double> plain, writing, pauses, beside_dd;
  int64_t written = 0;
  const int64_t per_rank = state_bytes(cfg) / kRanks;
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
    // dd runs on a thread of rank 0, a new one whenever the last has ended;
    // its failure is raised here once the thread is joined.
    std::vector<double> d;
    std::thread dd;
    std::atomic<bool> dd_running{false};
    std::exception_ptr dd_failure;
    for (int i = 0; i < steps; ++i) {
      if (comm.rank() == 0 && !dd_running && !dd_failure) {
        if (dd.joinable()) dd.join();
        dd_running = true;
        dd = std::thread([&] {
          try {
            dd_seconds(dir, kRanks, per_rank, true);
          } catch (...) {
            dd_failure = std::current_exception();
          }
          dd_running = false;
        });
      }
      d.push_back(step());
    }
    if (dd.joinable()) dd.join();
    if (dd_failure) std::rethrow_exception(dd_failure);
    if (comm.rank() == 0) {
      plain = p;
      writing = w;
      pauses = s;
      beside_dd = d;
    }
  });
  const double base = median(plain), during = median(writing);
  std::printf("   step without a checkpoint  %7.1f ms (median)\n", 1e3 * base);
  std::printf("   step while one is written  %7.1f ms   x %.3f   (target <= 1.10)\n", 1e3 * during, during / base);
  std::printf("   step while dd writes as much %7.1f ms   x %.3f   (baseline: the same bytes written by dd)\n",
              1e3 * median(beside_dd), median(beside_dd) / base);
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
