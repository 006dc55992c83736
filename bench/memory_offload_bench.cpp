// Chunk-based heterogeneous memory (memory.h): a GPT whose model state is ten
// times the device budget trained under each placement policy, against the
// same model trained with everything on an unlimited device (policy none),
// timed alongside in the same run.
//
//   memory_offload_bench [nvme_dir|-] [disk_MiB] [steps] [B] [T] [n_layer n_embd n_head vocab]
//   e.g. memory_offload_bench - 256 7 2 128 16 384 6 1024   (the defaults)
//        memory_offload_bench /mnt/nvme 1024                 (another disk, a longer throughput baseline)
//
// "-" (the default) makes a fresh directory ./loom-nvme-bench-<pid> for the
// NVMe tier and removes it at the end; a given directory must exist.
//
// The workload is fine-tuning-like: a deep, narrow model and a small batch
// with activation checkpointing (every run, the baseline too), so that what a
// step costs regardless of the batch (moving the parameters in, the
// gradients out, the AdamW update and its state's I/O) is a large part of
// it. Every run is fp32 with one micro-batch per step (gradients reuse the
// parameters' memory): 16 bytes of model state per parameter, 4 of them
// parameters and 12 master weights and moments.
//
// Budgets, per run (each run has a MemoryContext of its own):
//   device      a tenth of the model state of the padded chunks
//   host        a, b: unlimited; c: the parameters, half the optimizer state
//               and the host working set of a placement with the optimizer
//               state on NVMe (memory_needs), so NVMe is needed
// Runs:
//   a  static, offload_param_frac = offload_optim_frac = 1, no NVMe
//   b  auto, no NVMe
//   c  auto with the NVMe directory, against static with both fractions 1
//      on NVMe (every payload there)
//
// Timing: the runs of a group (a and b; the two c runs) and the baseline
// step in turn, the order rotated every round, so that the machine's load
// (shared cores) falls on all of them alike; x base is the median of the
// baseline's steps in that group over the run's median, and x base fastest
// the same of the fastest steps (load only ever slows a step down; the
// targets are judged on the medians). Each run's first two steps are
// warm-up, shown apart (for auto, the traced step and the step that
// migrates chunks into the device cache). Bytes moved and the NVMe
// figures are the differences of the run's report across each of its own
// timed steps, summed and divided by their count: the report is read right
// before and after each step, so time and I/O while the other runs step do
// not count (a write behind the update that completes then is missing from
// written/step, a percent or so). NVMe throughput is bytes
// over the seconds with a request of that kind in flight (NvmeStats), against
// measure_sequential_throughput of the same directory measured right before
// and right after the NVMe runs; the ratio is to the faster of the two.
//
// On a machine shared with other work, OMP_WAIT_POLICY=passive keeps the
// step's OpenMP threads from spinning against the other processes: next to
// two compilers on two cores, a baseline step ran about 9 times slower with
// the default spinning than without it.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/memory.h"
#include "loom/train.h"

using namespace loom;
using bench::median;
namespace fs = std::filesystem;

namespace {

constexpr int kWarmUpSteps = 2;

struct Settings {
  GPTConfig model;
  int64_t B = 2, T = 128;
  int steps = 7;
  uint64_t disk_bytes = uint64_t(256) << 20;
};

std::string bytes(double b) { return format_bytes(b); }

// What the budgets are made of, from the model's shapes.
struct Budgets {
  int num_chunks = 0;
  int64_t chunk_numel = 0;
  int64_t params = 0;  // the padded chunks' parameters, 4 bytes each
  int64_t state = 0;   // their model state, 16 bytes per parameter
  int64_t device = 0;
  int64_t device_working = 0;  // the manager's device working set with the parameters staged
  int64_t host_working = 0;    // its host working set with the optimizer state on NVMe
  int64_t host_nvme = 0;       // the host budget of the NVMe runs
};

Budgets budgets_for(const GPTConfig& cfg, const fs::path& nvme_dir) {
  const GPT model(cfg);
  const TierBytes unlimited{{INT64_MAX, INT64_MAX, INT64_MAX}};
  MemoryOptions off;
  off.policy = MemoryPolicy::fixed;
  off.offload_param_frac = off.offload_optim_frac = 1.0;
  const MemoryPlan plan = plan_memory(model.layout(), off, DType::f32, 1, 0, unlimited);
  const ChunkLayout chunks(model.layout(), plan.search.chunk_numel, 1);
  Budgets b;
  b.num_chunks = chunks.num_chunks();
  b.chunk_numel = chunks.chunk_numel();
  b.params = chunks.num_chunks() * chunks.shard_numel() * 4;
  for (int64_t t : plan.needs.model_state.bytes) b.state += t;
  b.device = b.state / 10;
  b.device_working = plan.needs.device_working;
  // auto's own plan with unlimited budgets keeps every payload on the host;
  // with the optimizer state moved to NVMe it gives the host working set.
  MemoryOptions automatic;
  automatic.policy = MemoryPolicy::automatic;
  automatic.nvme_dir = nvme_dir;
  ChunkPlacement with_nvme = plan_memory(model.layout(), automatic, DType::f32, 1, 0, unlimited).placement;
  std::fill(with_nvme.optim.begin(), with_nvme.optim.end(), Tier::nvme);
  b.host_working = memory_needs(chunks, with_nvme, DType::f32, automatic).host_working;
  b.host_nvme = b.params + b.host_working + 3 * b.params / 2;
  return b;
}

void add_difference(NvmeStats& sum, const NvmeStats& after, const NvmeStats& before) {
  sum.reads += after.reads - before.reads;
  sum.writes += after.writes - before.writes;
  sum.bytes_read += after.bytes_read - before.bytes_read;
  sum.bytes_written += after.bytes_written - before.bytes_written;
  sum.read_seconds += after.read_seconds - before.read_seconds;
  sum.write_seconds += after.write_seconds - before.write_seconds;
}

// A Trainer with allocators of its own: it is built, and every step runs,
// with its MemoryContext installed, so its budgets and high-water marks are
// its own while the other runs live beside it.
class Run {
 public:
  Run(std::string name, const Settings& s, const MemoryOptions& memory, size_t device_budget, size_t host_budget)
      : name_(std::move(name)), context_(std::make_unique<MemoryContext>()) {
    MemoryContext::Install in(*context_);
    context_->tier(Tier::device).set_budget(device_budget);
    context_->tier(Tier::host).set_budget(host_budget);
    TrainOptions o;
    o.schedule.max_lr = 1e-4f;
    // Every run follows the same schedule, so step i's loss is comparable
    // with the baseline's, which runs a step beside every round of both groups.
    o.schedule.total_steps = kWarmUpSteps + 2 * s.steps + 1;
    o.checkpoint_activations = true;
    o.memory = memory;
    o.memory.micro_batches = 1;
    trainer_ = std::make_unique<Trainer>(s.model, o);
  }

  const std::string& name() const { return name_; }
  void warm_up(const MicroBatch& mb) { warm_up_s_.push_back(step(mb)); }
  void timed_step(const MicroBatch& mb) {
    const MemoryReport before = report();
    step_s_.push_back(step(mb));
    const MemoryReport after = report();
    moved_ += after.traffic - before.traffic;
    add_difference(io_, after.nvme, before.nvme);
  }
  MemoryReport report() const {
    MemoryContext::Install in(*context_);
    return trainer_->memory_report();
  }
  // Keeps the last report and frees the run's memory.
  void finish() {
    final_ = report();
    trainer_.reset();
    context_.reset();
  }

  const std::vector<double>& warm_up_s() const { return warm_up_s_; }
  const std::vector<double>& step_s() const { return step_s_; }
  const std::vector<float>& losses() const { return losses_; }
  const MemoryReport& final_report() const { return final_; }
  // Per timed step.
  double moved(Tier from, Tier to) const { return static_cast<double>(moved_.at(from, to)) / step_s_.size(); }
  const NvmeStats& io() const { return io_; }

 private:
  double step(const MicroBatch& mb) {
    MemoryContext::Install in(*context_);
    const double t0 = bench::now_seconds();
    losses_.push_back(trainer_->step({&mb, 1}).loss);
    return bench::now_seconds() - t0;
  }

  std::string name_;
  std::unique_ptr<MemoryContext> context_;
  std::unique_ptr<Trainer> trainer_;
  std::vector<double> warm_up_s_, step_s_;
  std::vector<float> losses_;
  TierTraffic moved_;
  NvmeStats io_;
  MemoryReport final_;
};

// Warms the runs up, then steps the baseline and every run in turn, the
// order rotated each round. Returns the baseline's step times here.
std::vector<double> run_group(Run& base, const std::vector<Run*>& runs, const MicroBatch& mb, int steps) {
  for (Run* r : runs)
    for (int i = 0; i < kWarmUpSteps; ++i) r->warm_up(mb);
  std::vector<Run*> order{&base};
  order.insert(order.end(), runs.begin(), runs.end());
  const size_t first = base.step_s().size();
  for (int round = 0; round < steps; ++round)
    for (size_t k = 0; k < order.size(); ++k) order[(static_cast<size_t>(round) + k) % order.size()]->timed_step(mb);
  return {base.step_s().begin() + static_cast<std::ptrdiff_t>(first), base.step_s().end()};
}

double fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

std::string budget_text(int64_t budget) { return budget < 0 ? std::string("unlimited") : bytes(double(budget)); }

std::string verdict(bool pass) { return pass ? "PASS" : "MISS"; }

// The machine is shared: its load says how far the timings can be trusted.
std::string load_average() {
  double load[3] = {0, 0, 0};
  if (::getloadavg(load, 3) != 3) return "unknown";
  return str(load[0], " ", load[1], " ", load[2]);
}

std::string range_ms(const std::vector<double>& seconds) {
  const auto [low, high] = std::minmax_element(seconds.begin(), seconds.end());
  return str(std::lround(*low * 1e3), "-", std::lround(*high * 1e3));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Settings s;
    const std::string dir_arg = argc > 1 ? argv[1] : "-";
    if (argc > 2) s.disk_bytes = static_cast<uint64_t>(std::atoll(argv[2])) << 20;
    if (argc > 3) s.steps = std::atoi(argv[3]);
    if (argc > 4) s.B = std::atoll(argv[4]);
    if (argc > 5) s.T = std::atoll(argv[5]);
    s.model.n_layer = argc > 6 ? std::atoll(argv[6]) : 16;
    s.model.n_embd = argc > 7 ? std::atoll(argv[7]) : 384;
    s.model.n_head = argc > 8 ? std::atoll(argv[8]) : 6;
    s.model.vocab_size = argc > 9 ? std::atoll(argv[9]) : 1024;
    s.model.block_size = s.T;
    s.model.dropout = 0.0f;
    s.model.validate();
    if (s.steps < 1) throw Error(str("steps = ", s.steps, ": time at least one step"));
    if (s.disk_bytes == 0) throw Error("disk_MiB = 0: the throughput baseline needs at least 1 MiB");
    if (s.B < 1 || s.T < 1) throw Error(str("B = ", s.B, ", T = ", s.T, " must be positive"));

    const bench::NvmeDir nvme(dir_arg);
    const Budgets b = budgets_for(s.model, nvme.path());
    const double tokens = static_cast<double>(s.B * s.T);
    std::printf(
        "model: layers %lld width %lld heads %lld vocab %lld, %.2fM params; batch %lld x T=%lld (%.0f tokens, "
        "one micro-batch, fine-tuning-like: the per-step state movement is not amortized over a large "
        "batch); activation checkpointing; fp32; %d threads\n",
        static_cast<long long>(s.model.n_layer), static_cast<long long>(s.model.n_embd),
        static_cast<long long>(s.model.n_head), static_cast<long long>(s.model.vocab_size),
        static_cast<double>(s.model.num_params()) / 1e6, static_cast<long long>(s.B), static_cast<long long>(s.T),
        tokens, cpu::num_threads());
    std::printf("chunks: %d of %lld elements; model state %s (16 B/param: params %s, optimizer %s)\n", b.num_chunks,
                static_cast<long long>(b.chunk_numel), bytes(double(b.state)).c_str(), bytes(double(b.params)).c_str(),
                bytes(double(b.state - b.params)).c_str());
    std::printf(
        "device budget %s = model state / %.1f (the manager's device working set %s, the rest for "
        "activations); host budget of the NVMe runs %s = params + half the optimizer state + host working "
        "set %s\n",
        bytes(double(b.device)).c_str(), double(b.state) / double(b.device), bytes(double(b.device_working)).c_str(),
        bytes(double(b.host_nvme)).c_str(), bytes(double(b.host_working)).c_str());
    std::printf("NVMe directory: %s; %d timed steps per run after %d warm-up steps; load average %s\n\n",
                nvme.path().c_str(), s.steps, kWarmUpSteps, load_average().c_str());
    std::fflush(stdout);

    std::vector<int32_t> tokens_in(static_cast<size_t>(s.B * s.T)), targets(tokens_in.size());
    for (size_t i = 0; i < tokens_in.size(); ++i) {
      tokens_in[i] = static_cast<int32_t>(Philox::block(7, 0, i)[0] % static_cast<uint32_t>(s.model.vocab_size));
      targets[i] = static_cast<int32_t>(Philox::block(7, 1, i)[0] % static_cast<uint32_t>(s.model.vocab_size));
    }
    const MicroBatch mb{tokens_in.data(), targets.data(), {s.B, s.T}, 0};

    const size_t device = static_cast<size_t>(b.device), host_nvme = static_cast<size_t>(b.host_nvme);
    Run base("no offload (none, unlimited)", s, {}, kUnlimited, kUnlimited);
    for (int i = 0; i < kWarmUpSteps; ++i) base.warm_up(mb);

    struct Row {
      std::unique_ptr<Run> run;
      std::vector<double> base_s;  // the baseline's steps timed alongside
    };
    std::vector<Row> rows;
    const auto group = [&](std::vector<std::unique_ptr<Run>> runs) {
      std::vector<Run*> ptrs;
      for (auto& r : runs) ptrs.push_back(r.get());
      const std::vector<double> base_s = run_group(base, ptrs, mb, s.steps);
      for (auto& r : runs) {
        std::printf("%-32s %.0f ms/step (baseline %.0f ms/step alongside); load average %s\n", r->name().c_str(),
                    median(r->step_s()) * 1e3, median(base_s) * 1e3, load_average().c_str());
        r->finish();
        rows.push_back({std::move(r), base_s});
      }
      std::fflush(stdout);
    };

    MemoryOptions static_host;
    static_host.policy = MemoryPolicy::fixed;
    static_host.offload_param_frac = static_host.offload_optim_frac = 1.0;
    MemoryOptions auto_host;
    auto_host.policy = MemoryPolicy::automatic;
    {
      std::vector<std::unique_ptr<Run>> runs;
      runs.push_back(std::make_unique<Run>("a static host", s, static_host, device, kUnlimited));
      runs.push_back(std::make_unique<Run>("b auto host", s, auto_host, device, kUnlimited));
      group(std::move(runs));
    }

    MemoryOptions auto_nvme = auto_host;
    auto_nvme.nvme_dir = nvme.path();
    MemoryOptions static_nvme = static_host;
    static_nvme.nvme_dir = nvme.path();
    const DiskThroughput disk_before = measure_sequential_throughput(nvme.path(), s.disk_bytes);
    {
      std::vector<std::unique_ptr<Run>> runs;
      runs.push_back(std::make_unique<Run>("c auto NVMe", s, auto_nvme, device, host_nvme));
      runs.push_back(std::make_unique<Run>("c static all-NVMe", s, static_nvme, device, host_nvme));
      group(std::move(runs));
    }
    const DiskThroughput disk_after = measure_sequential_throughput(nvme.path(), s.disk_bytes);
    const DiskThroughput disk{std::max(disk_before.write_bytes_per_s, disk_after.write_bytes_per_s),
                              std::max(disk_before.read_bytes_per_s, disk_after.read_bytes_per_s)};

    const double base_s = median(base.step_s());
    std::printf("\nbaseline over the run: %zu timed steps, median %.0f ms (%s), %.0f tokens/s; load average %s\n\n",
                base.step_s().size(), base_s * 1e3, range_ms(base.step_s()).c_str(), tokens / base_s,
                load_average().c_str());

    // Step i of every run trains on the same batch with the same learning
    // rate as the baseline's step i: the losses say the placement trained
    // the same model.
    // The machine is shared and its load comes in bursts (other processes'
    // threads against the step's two OpenMP threads) that only ever slow a
    // step down: the ratio of the fastest steps says what the placement
    // costs without them; the targets are judged on the medians.
    const auto x_base = [](const Row& row) { return median(row.base_s) / median(row.run->step_s()); };
    const auto x_base_fastest = [](const Row& row) { return fastest(row.base_s) / fastest(row.run->step_s()); };
    const auto loss_diff = [&](const Run& r) {
      double worst = 0;
      for (size_t i = 0; i < r.losses().size(); ++i)
        worst = std::max(worst, std::fabs(double(r.losses()[i]) - base.losses()[i]) / std::fabs(base.losses()[i]));
      return worst;
    };

    std::printf(
        "| run | ms/step | range ms | tokens/s | x base | x base fastest | base ms here | warm-up ms | peak device / "
        "budget | "
        "peak host / budget | state/device budget | model state device / host / nvme | loss vs base |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& row : rows) {
      const Run& r = *row.run;
      const MemoryReport& m = r.final_report();
      const double step_s = median(r.step_s());
      std::string warm;
      for (double w : r.warm_up_s()) warm += str(warm.empty() ? "" : ", ", std::lround(w * 1e3));
      const int64_t state = m.model_state[Tier::device] + m.model_state[Tier::host] + m.model_state[Tier::nvme];
      std::printf(
          "| %s | %.0f | %s | %.0f | %.3f | %.3f | %.0f | %s | %s / %s | %s / %s | %.1f | %s / %s / %s | %.1e |\n",
          r.name().c_str(), step_s * 1e3, range_ms(r.step_s()).c_str(), tokens / step_s, x_base(row),
          x_base_fastest(row), median(row.base_s) * 1e3, warm.c_str(), bytes(double(m.peak[Tier::device])).c_str(),
          budget_text(m.budget[Tier::device]).c_str(), bytes(double(m.peak[Tier::host])).c_str(),
          budget_text(m.budget[Tier::host]).c_str(), double(state) / double(m.budget[Tier::device]),
          bytes(double(m.model_state[Tier::device])).c_str(), bytes(double(m.model_state[Tier::host])).c_str(),
          bytes(double(m.model_state[Tier::nvme])).c_str(), loss_diff(r));
    }

    std::printf("\nbytes moved per timed step (from -> to):\n\n| run |");
    std::vector<std::pair<Tier, Tier>> pairs;
    for (int f = 0; f < kNumTiers; ++f)
      for (int t = 0; t < kNumTiers; ++t)
        if (f != t) pairs.emplace_back(static_cast<Tier>(f), static_cast<Tier>(t));
    for (const auto& [f, t] : pairs) std::printf(" %s->%s |", tier_name(f), tier_name(t));
    std::printf("\n|---|");
    for (size_t i = 0; i < pairs.size(); ++i) std::printf("---|");
    std::printf("\n");
    for (const Row& row : rows) {
      std::printf("| %s |", row.run->name().c_str());
      for (const auto& [f, t] : pairs) std::printf(" %s |", bytes(row.run->moved(f, t)).c_str());
      std::printf("\n");
    }

    std::printf(
        "\nNVMe: sequential baseline of %s (%s in 1 MiB O_DIRECT requests, one at a time): write %s/s before, "
        "%s/s after; read %s/s before, %s/s after\n\n",
        nvme.path().c_str(), bytes(double(s.disk_bytes)).c_str(), bytes(disk_before.write_bytes_per_s).c_str(),
        bytes(disk_after.write_bytes_per_s).c_str(), bytes(disk_before.read_bytes_per_s).c_str(),
        bytes(disk_after.read_bytes_per_s).c_str());
    std::printf(
        "| run | read/step | read busy s/step | read/s | x seq read | written/step | write busy s/step | "
        "write/s | x seq write |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    struct IoRatio {
      std::string name;
      double read = 0, write = 0;
    };
    std::vector<IoRatio> io_ratios;
    for (const Row& row : rows) {
      const NvmeStats& io = row.run->io();
      if (io.reads == 0 && io.writes == 0) continue;
      const double n = static_cast<double>(row.run->step_s().size());
      const double read = io.read_seconds > 0 ? double(io.bytes_read) / io.read_seconds : 0;
      const double write = io.write_seconds > 0 ? double(io.bytes_written) / io.write_seconds : 0;
      io_ratios.push_back({row.run->name(), read / disk.read_bytes_per_s, write / disk.write_bytes_per_s});
      std::printf("| %s | %s | %.3f | %s/s | %.2f | %s | %.3f | %s/s | %.2f |\n", row.run->name().c_str(),
                  bytes(double(io.bytes_read) / n).c_str(), io.read_seconds / n, bytes(read).c_str(),
                  io_ratios.back().read, bytes(double(io.bytes_written) / n).c_str(), io.write_seconds / n,
                  bytes(write).c_str(), io_ratios.back().write);
    }

    const auto find = [&](const std::string& name) -> const Row& {
      for (const Row& row : rows)
        if (row.run->name() == name) return row;
      throw Error(str("no run named ", name));
    };
    const Row& a = find("a static host");
    const Row& b_row = find("b auto host");
    const Row& c_auto = find("c auto NVMe");
    const Row& c_static = find("c static all-NVMe");
    std::printf("\n");
    std::printf("target a: static host tokens/s >= 0.85 x no offload: %.3f %s (fastest steps: %.3f)\n", x_base(a),
                verdict(x_base(a) >= 0.85).c_str(), x_base_fastest(a));
    std::printf("report b: auto host tokens/s = %.3f x no offload (fastest steps: %.3f)\n", x_base(b_row),
                x_base_fastest(b_row));
    const double auto_over_static = median(c_static.run->step_s()) / median(c_auto.run->step_s());
    std::printf(
        "target c: auto NVMe tokens/s >= 1.5 x static all-NVMe: %.3f %s (fastest steps: %.3f; x no offload: auto "
        "%.3f, static %.3f)\n",
        auto_over_static, verdict(auto_over_static >= 1.5).c_str(),
        fastest(c_static.run->step_s()) / fastest(c_auto.run->step_s()), x_base(c_auto), x_base(c_static));
    for (const IoRatio& r : io_ratios) {
      std::printf("target d: %s NVMe read throughput >= 0.7 x sequential: %.2f %s\n", r.name.c_str(), r.read,
                  verdict(r.read >= 0.7).c_str());
      std::printf("target d: %s NVMe write throughput >= 0.7 x sequential: %.2f %s\n", r.name.c_str(), r.write,
                  verdict(r.write >= 0.7).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
